"""An environment from another package (tests/example_env, the example of docs/environments.md),
registered through its entry point as ``pip install`` would, passes ``agentrl envs check`` and
warm-starts and trains through ``agentrl train`` like the built-in one."""

import json
import sys
from pathlib import Path

import pytest

import agentrl.env as env_module
from agentrl.cli import main

PACKAGE = Path(__file__).resolve().parent / "example_env"


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """What ``pip install tests/example_env`` leaves for the entry-point lookup, without a network:
    the package on sys.path and its dist-info with the entry point of its pyproject.toml."""
    dist = tmp_path / "agentrl_example_env-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: agentrl-example-env\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text("[agentrl.envs]\nexample = agentrl_example_env:register_envs\n")
    assert 'example = "agentrl_example_env:register_envs"' in (PACKAGE / "pyproject.toml").read_text()
    monkeypatch.syspath_prepend(str(PACKAGE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(env_module, "_plugins_loaded", False)
    yield tmp_path
    sys.modules.pop("agentrl_example_env", None)


def test_the_plugin_env_passes_envs_check(installed, capsys):
    assert main(["envs"]) == 0
    assert "linecount-v0  agentrl_example_env:LineCountEnv" in capsys.readouterr().out
    assert main(["envs", "check", "linecount-v0", "--sandbox", "local"]) == 0
    out = capsys.readouterr().out
    assert "ok  the demonstration earns its reward (1) through the agent loop" in out
    assert "ok  an agent that does nothing does not succeed" in out
    assert "linecount-v0: all checks passed" in out


def test_the_plugin_env_warm_starts_and_trains(installed, capsys):
    out = installed / "runs"
    args = [
        "train",
        str(PACKAGE.parents[1] / "recipes/quickstart.yaml"),
        f"run.output_dir={out}",
        "run.iterations=1",
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
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "warm start: 16 demonstration episodes (0 meant to fail)" in printed
    summary = json.loads((out / "quickstart" / "summary.json").read_text())
    assert 0.0 <= summary["eval_before"] <= 1.0 and summary["iterations"] == 1
    record = json.loads((out / "quickstart" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["statuses"] and "critic/value_loss" in record


def test_a_plugin_that_fails_to_load_is_named_when_its_env_is_asked_for(tmp_path, monkeypatch):
    dist = tmp_path / "broken_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[agentrl.envs]\nbroken = no_such_module_xyz:register\n")
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
