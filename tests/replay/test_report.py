"""agentrl report RUN: the page, its figures and its episode links, from a run directory written
the way the trainer writes one (metrics records, summary, config, a store of real-loop episodes)."""

import asyncio
import base64
import json
import re

import pytest

from agentrl.cli import main
from agentrl.env import Task
from agentrl.models import tiny_tokenizer
from agentrl.replay.report import PANELS, chosen_episodes, load
from agentrl.rollout.agent_loop import LoopConfig, run_episode
from agentrl.store import TrajectoryStore
from tests.rollout.fakes import EchoEnv, FixedEngine

RECORDS = [
    {
        "iteration": 0,
        "reward_mean": 0.25,
        "success_rate": 0.25,
        "statuses": {"completed": 3, "max_turns": 1},
        "icepop_masked_frac": 0.01,
        "critic/explained_var_before": 0.0,
        "rollout_tokens_per_s": 900.0,
    },
    {
        "iteration": 1,
        "reward_mean": 0.5,
        "success_rate": 0.5,
        "statuses": {"completed": 4},
        "icepop_masked_frac": 0.02,
        "actor/clip_frac": 0.1,
        "actor/approx_kl": 0.003,
        "eval_success": 0.5,
        "critic/explained_var_before": 0.2,
        "rollout_tokens_per_s": 1000.0,
        "train_tokens_per_s": 500.0,
    },
]


@pytest.fixture(scope="module")
def episodes():
    """Four episodes of the real loop: rewards 1, 0.5, 0 (completed) and a max_turns one (graded on
    truncation: EchoEnv's grade gives 0.5)."""
    tok = tiny_tokenizer()
    eot = tok.convert_tokens_to_ids("<|im_end|>")

    async def go():
        out = []
        for reward, turns in ((1.0, 2), (0.5, 2), (0.0, 2), (1.0, 9)):
            env = EchoEnv(turns, reward=reward)
            t = await run_episode(
                env, FixedEngine([eot]), tok, Task("train-1"), LoopConfig(max_turns=3), sample_index=len(out)
            )
            out.append(t)
        return out

    return asyncio.run(go())


@pytest.fixture
def run(tmp_path, episodes):
    run = tmp_path / "runs" / "r1"
    with TrajectoryStore(run / "trajectories") as s:
        for t in episodes[:2]:  # iteration 0: the best of the run, not of its last iteration
            t.extra["iteration"] = 0
            s.append(t)
        for t in episodes:
            t.extra["iteration"] = 1
            s.append(t)
    lines = [json.dumps(r) for r in RECORDS]
    (run / "metrics.jsonl").write_text(lines[0] + "\n{not json\n" + lines[1] + "\n")
    (run / "summary.json").write_text(
        json.dumps({"eval_before": 0.25, "eval_after": 0.5, "eval_tasks": 64, "seconds": 90})
    )
    (run / "config.json").write_text(json.dumps({"run": {"name": "r1"}, "env": {"id": "echo-v0"}}))
    return run


def test_the_page_holds_the_held_out_noise_the_table_figures_and_episode_links(run, capsys, drawn):
    assert main(["report", str(run)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {run / 'report' / 'index.html'}"
    page = (run / "report" / "index.html").read_text()
    # 0.25 and 0.5 over 64 tasks: standard errors sqrt(p (1 - p) / 64)
    assert "(64 tasks, greedy): 0.250 ± 0.054 before RL &rarr; 0.500 ± 0.062 after (gain +0.250)" in page
    assert "2 iterations recorded; the run ended; 1 damaged lines of metrics.jsonl skipped" in page
    rows = re.findall(r"<tr><td>(\d+)</td>(.*?)</tr>", page)
    assert [int(i) for i, _ in rows] == [0, 1]
    assert "<td>0.0030" in rows[1][1] and "completed 3, max_turns 1" in rows[0][1]
    # both figures inline, as PNG; the files beside the page too
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 3 and all(base64.b64decode(i).startswith(b"\x89PNG") for i in images)
    for png in ("curve.png", "diagnostics.png", "episodes.png"):
        assert (run / "report" / png).is_file()
    diagnostics = drawn[1]
    assert [ax.get_title() for ax in diagnostics.axes] == [title for title, _ in PANELS]
    # the last iteration's episodes: best = highest reward, then fewer tokens; worst = reward 0
    links = re.findall(
        r'<li><a href="(episodes/[^"]+)">([^<]+)</a> task train-1: (\w+), reward ([\d.]+)', page
    )
    best, worst = links[:3], links[3:]
    assert [(s, r) for _, _, s, r in best] == [("completed", "1"), ("completed", "0.5"), ("max_turns", "0.5")]
    assert [(s, r) for _, _, s, r in worst] == [("completed", "0")]
    for href, episode_id, *_ in links:
        assert episode_id.startswith("w0-00000:") and episode_id not in ("w0-00000:1", "w0-00000:2")
        assert "turn 1" in (run / "report" / href).read_text()
    # the last iteration's four episodes listed, each with its page; the histograms of all six
    listed = re.findall(r'<tr><td><a href="episodes/([^"]+)">(w0-00000:\d)</a>', page)
    assert [i for _, i in listed] == [f"w0-00000:{k}" for k in (3, 4, 5, 6)]
    histograms = drawn[2]
    assert [ax.get_title() for ax in histograms.axes] == [
        "reward (6 episodes)",
        "assistant turns (6 episodes)",
        "tokens (6 episodes)",
    ]
    assert "no per-token stats recorded (train with debug.token_stats_every=N)" in page


def test_the_episodes_with_the_largest_log_prob_gap_are_named_where_stats_were_recorded(run, episodes):
    """Token stats for iteration 1 with a gap that grows with the episode's row: the last is worst."""
    import torch

    from agentrl import token_stats
    from agentrl.trainer.backend import Batch

    batch = Batch.from_trajectories(episodes)
    batch.old_logprobs = batch.rollout_logprobs + torch.arange(len(episodes))[:, None] * 0.1 * batch.loss_mask
    token_stats.write(run, 1, episodes, batch)
    assert main(["report", str(run)]) == 0
    page = (run / "report" / "index.html").read_text()
    section = page.split("largest gap between the trainer's and the rollout's log-probs")[1].split("</ul>")[0]
    found = re.findall(r">(w0-00000:\d)</a>.*?mean \|log-prob gap\| ([\d.]+)", section)
    assert found == [("w0-00000:6", "0.3000"), ("w0-00000:5", "0.2000"), ("w0-00000:4", "0.1000")]


def test_damaged_lines_of_metrics_are_named_on_stderr_and_none_intact_is_an_error(run, capsys):
    assert main(["report", str(run)]) == 0
    assert (
        capsys.readouterr().err == f"warning: {run / 'metrics.jsonl'} line 2: not a metrics record; skipped\n"
    )
    (run / "metrics.jsonl").write_text("{not json\n[1]\n")
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"error: {run / 'metrics.jsonl'} holds no metrics record (a JSON object")
    assert "in its 2 lines; restore it from a copy" in err


def test_a_damaged_token_stats_file_is_named_and_the_page_written_without_it(run, episodes, capsys):
    from agentrl import token_stats
    from agentrl.trainer.backend import Batch

    stats = token_stats.write(run, 1, episodes, Batch.from_trajectories(episodes))
    stats.write_bytes(stats.read_bytes()[:40])  # truncated
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    assert main(["report", str(run)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: {stats} cannot be read (")
    assert "no per-token stats recorded" in (run / "report" / "index.html").read_text()


def test_a_metric_the_run_did_not_record_is_said_so(run, drawn):
    (run / "metrics.jsonl").write_text(json.dumps({"iteration": 0, "reward_mean": 0.1}) + "\n")
    assert main(["report", str(run), "--out", str(run / "elsewhere")]) == 0
    texts = [t.get_text() for ax in drawn[1].axes for t in ax.texts]  # the diagnostics figure
    assert texts.count("not recorded") == len(PANELS) - 1
    assert (run / "elsewhere" / "index.html").is_file()


def test_a_run_still_going_is_reported_as_far_as_it_got(run):
    (run / "summary.json").unlink()
    assert main(["report", str(run)]) == 0
    page = (run / "report" / "index.html").read_text()
    assert "still going, or stopped before its end (no summary.json)" in page
    assert "0.500 at the last evaluation" in page


def test_best_and_worst_never_repeat_an_episode(run):
    data = load(run)
    best, worst = chosen_episodes(data.episodes, n=3)
    assert len(best) == 3 and len(worst) == 1 and not set(e.id for e in best) & set(e.id for e in worst)


def test_a_directory_that_is_no_run_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds no metrics.jsonl" in err and len(err.splitlines()) == 1
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert main(["report", str(tmp_path)]) == 2
    assert "holds no metrics record (a JSON object with an integer iteration) in its 1 line;" in (
        capsys.readouterr().err
    )
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 0}\n')
    (tmp_path / "summary.json").write_text("{broken")
    assert main(["report", str(tmp_path)]) == 2
    assert "summary.json cannot be read" in capsys.readouterr().err


def test_values_of_the_wrong_type_are_named_and_the_page_made_without_them(run, capsys, drawn):
    records = [dict(r) for r in RECORDS]
    records[0]["statuses"] = ["completed", "max_turns"]
    records[1]["eval_success"] = "n/a"
    records[1]["actor/clip_frac"] = True
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "summary.json").write_text(json.dumps({"eval_before": "x", "eval_after": 0.5, "eval_tasks": 64}))
    (run / "config.json").write_text(json.dumps({"run": "r9", "env": {"id": "echo-v0"}}))
    assert main(["report", str(run)]) == 0
    metrics, summary, config = run / "metrics.jsonl", run / "summary.json", run / "config.json"
    assert capsys.readouterr().err.splitlines() == [
        f'warning: {metrics} line 1: statuses = ["completed", "max_turns"] is not a mapping of status to '
        "episode count; left out of the report",
        f'warning: {metrics} line 2: eval_success = "n/a" is not a number; left out of the report',
        f"warning: {metrics} line 2: actor/clip_frac = true is not a number; left out of the report",
        f'warning: {summary}: eval_before = "x" is not a number; shown as not measured',
        f'warning: {config}: run = "r9" is not a mapping of settings (run.name, ...); the run is named '
        "after its directory",
    ]
    page = (run / "report" / "index.html").read_text()
    assert "<h1>Run r1</h1>" in page and "nan ± " not in page
    assert "nan before RL &rarr; 0.500" in page
    rows = re.findall(r"<tr><td>(\d)</td>(.*?)</tr>", page)
    assert [i for i, _ in rows] == ["0", "1"] and "completed" not in rows[0][1] and "0.1000" not in rows[1][1]
