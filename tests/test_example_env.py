"""An environment from another package (tests/example_env, installed by ``make setup`` and found
through its entry point) passes ``agentrl envs check``, rolls out, and warm-starts from its own
demonstrations and trains through ``agentrl train`` like the built-in one."""

import importlib.metadata
import json
import re
from collections import Counter
from pathlib import Path

import pytest

import agentrl.env as env_module
from agentrl.cli import main
from agentrl.replay.episodes import read
from agentrl.store import TrajectoryStore
from tests.conftest import fake_distribution

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/rollout_bugfix_tiny.yaml"


@pytest.fixture
def installed():
    """The package as ``make setup`` installs it (``pip install -e tests/example_env``): found
    through its ``agentrl.envs`` entry point, as any user's package is."""
    points = [e for e in importlib.metadata.entry_points(group="agentrl.envs") if e.name == "example"]
    assert points, (
        "tests/example_env is not installed: `make setup` installs it (pip install -e tests/example_env)"
    )
    assert points[0].value == "agentrl_example_env:register_envs"
    assert "linecount-v0" in env_module.list_envs()
    return points[0]


def test_the_plugin_env_passes_envs_check_and_rolls_out(installed, tmp_path, capsys):
    assert main(["envs"]) == 0
    assert "linecount-v0  agentrl_example_env:LineCountEnv" in capsys.readouterr().out
    assert main(["envs", "check", "linecount-v0", "--sandbox", "local"]) == 0
    out = capsys.readouterr().out
    assert "ok  the demonstration earns its reward (1) through the agent loop" in out
    assert "ok  an agent that does nothing does not succeed" in out
    assert "linecount-v0: all checks passed" in out
    store = tmp_path / "store"
    rollout = ["rollout", str(RECIPE), "env.id=linecount-v0", "sandbox.kind=local", f"collect.store={store}"]
    assert main([*rollout, "collect.tasks=3", "rollout.n_samples=2", "rollout.max_turns=2"]) == 0
    assert "rollout: 6 episodes of linecount-v0" in capsys.readouterr().out
    assert len(list(TrajectoryStore(store).read())) == 6


def test_the_plugin_env_warm_starts_and_trains(installed, tmp_path, capsys):
    out = tmp_path / "runs"
    args = [
        "train",
        str(ROOT / "recipes/quickstart.yaml"),
        f"run.output_dir={out}",
        "run.iterations=2",
        "env.id=linecount-v0",
        "env.args={max_lines: 5}",
        "env.train_tasks=16",
        "env.eval_tasks=4",
        "sandbox.kind=local",
        "sft.episodes=16",
        "sft.epochs=1",
        "rollout.tasks_per_iteration=2",
        "rollout.n_samples=2",
        "rollout.max_turns=3",
        "rollout.max_new_tokens=24",
        "metrics.progress=false",
        "debug.token_stats_every=2",
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "warm start: 16 demonstration episodes (0 meant to fail)" in printed
    summary = json.loads((out / "quickstart" / "summary.json").read_text())
    assert 0.0 <= summary["eval_before"] <= 1.0 and summary["iterations"] == 2
    records = [json.loads(line) for line in (out / "quickstart" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]
    assert "critic/value_loss" in records[0] and "actor/policy_loss" in records[1]  # critic-only first
    from agentrl.trajectory import NOT_TRAINABLE

    for r in records:  # tasks of the iteration with fewer than n_samples=2 trainable episodes
        mine = [
            t
            for t in TrajectoryStore(out / "quickstart" / "trajectories").read()
            if t.extra.get("iteration") == r["iteration"]
        ]
        kept = Counter(t.task_id for t in mine if t.status not in NOT_TRAINABLE)
        assert r["short_groups"] == sum(kept[task] < 2 for task in r["tasks"]), r
    # The trainer's per-token stats of iteration 0 (every 2nd), one row per trained episode, and none of 1.
    from agentrl import token_stats

    run = out / "quickstart"
    assert sorted(p.name for p in (run / "token_stats").iterdir()) == ["iter-000000.jsonl.gz"]
    episodes = [t for t in TrajectoryStore(run / "trajectories").read() if t.extra.get("iteration") == 0]
    stats = [token_stats.lookup(run, t) for t in episodes]
    assert len(episodes) == 4 and all(
        s and len(s["values"]) == len(t) for s, t in zip(stats, episodes, strict=True)
    )
    assert "debug/token_stats_s" in records[0] and "debug/token_stats_s" not in records[1]
    # An episode of iteration 1 re-run by the policy from its turn 2, with the weights that sampled it.
    original = next(e for e in read(run / "trajectories")[0] if e.iteration == 1 and e.turns >= 2)
    assert main(["replay", str(run), "--id", original.id, "--from-turn", "2", "--seed", "0"]) == 0
    printed = capsys.readouterr().out
    assert f"re-ran {original.id} from turn 2 with the weights that sampled it (iter-000001)" in printed
    branch = next(e for e in read(run / "trajectories")[0] if e.id.startswith("replay-"))
    assert branch.extra["branch_of"] == original.id and branch.extra["from_turn"] == 2
    old, new = original.trajectory(), branch.trajectory()
    cut = [s for s in old.turns if s.role == "assistant"][1].start
    assert new.input_ids[:cut] == old.input_ids[:cut] and new.task_id == old.task_id
    # Without --seed, a fresh one, recorded: the store stays one that datasets reads whole.
    assert main(["replay", str(run), "--id", original.id, "--from-turn", "2"]) == 0
    capsys.readouterr()
    stored = read(run / "trajectories")[0]
    assert all(isinstance(e.trajectory().seed, int) for e in stored if e.id.startswith("replay-"))
    import datasets

    datasets.disable_progress_bars()
    rows = datasets.load_dataset("json", data_files=str(run / "trajectories" / "*.jsonl.gz"), split="train")
    assert len(rows) == len(stored)
    # What cannot be branched is named, and nothing is stored.
    import shutil

    bare, broken = tmp_path / "bare", tmp_path / "broken" / "quickstart"
    shutil.copytree(run / "trajectories", bare)
    shutil.copytree(run / "trajectories", broken / "trajectories")
    (broken / "config.json").write_text('{"run": {')
    for argv, message in [
        (
            [str(run), "--from-turn", "99"],
            f"--from-turn 99: episode {original.id} has {original.turns} assistant",
        ),
        ([str(bare), "--from-turn", "2"], "--from-turn needs a run directory (its config.json names"),
        (
            [str(run), "--from-turn", "2", "--set", "env.id=bugfix-v0"],
            "the episode is of environment 'linecount-v0' but the run trains 'bugfix-v0'",
        ),
        (
            [str(run), "--from-turn", "2", "--set", "rollout.max_turns=x"],
            "invalid config (the override rollout.max_turns=x): 'rollout.max_turns': Input should be a valid",
        ),
        (
            [str(broken), "--from-turn", "2"],
            f"{broken / 'config.json'} is not the JSON that `agentrl train` writes",
        ),
    ]:
        assert main(["replay", *argv, "--id", original.id]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.splitlines()) == 1 and "pydantic" not in err, (argv, err)
    assert len(read(run / "trajectories")[0]) == len(stored)
    # The run on one page: agentrl report reads what the run wrote.
    assert main(["report", str(out / "quickstart")]) == 0
    page = (out / "quickstart" / "report" / "index.html").read_text()
    assert f"held-out success</b> (4 tasks, greedy): {summary['eval_before']:.3f}" in page
    assert len(re.findall(r"<tr><td>\d+</td>", page)) == 2 and 'href="episodes/w0-' in page


def test_a_plugin_that_fails_to_load_is_named_when_its_env_is_asked_for(tmp_path, monkeypatch):
    fake_distribution(tmp_path, "broken-plugin", "[agentrl.envs]\nbroken = no_such_module_xyz:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(env_module, "_plugins_loaded", False)
    monkeypatch.setattr(env_module, "_plugin_failures", [])
    with (
        pytest.warns(UserWarning, match="could not load environment plugin broken"),
        pytest.raises(
            KeyError, match="Plugins that failed to load: broken \\(no_such_module_xyz:register\\)"
        ),
    ):
        env_module.make("mine-v0")
    assert "bugfix-v0" in env_module.list_envs()  # the built-in envs are there all the same
