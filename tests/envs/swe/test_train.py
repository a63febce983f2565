"""swe-v0 end to end with the tiny policy: a warm start on the gold patches played through bash,
two PPO iterations on the shipped train split, and agentrl eval's pass@k on the test split."""

import json
from pathlib import Path

from agentrl.cli import main
from agentrl.envs.swe import SHIPPED
from agentrl.envs.swe.rows import load_rows

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes/swe_tiny.yaml"


def test_train_two_iterations_and_eval_pass_at_k(tmp_path, capsys):
    common = [f"run.output_dir={tmp_path}", "sandbox.kind=local", "metrics.progress=false"]
    assert main(["train", str(RECIPE), *common]) == 0
    printed = capsys.readouterr().out
    assert "warm start: 4 demonstration episodes (0 meant to fail)" in printed
    run = tmp_path / "swe-tiny"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]
    assert sum(records[0]["statuses"].values()) == 4  # 2 tasks x 2 samples, every one graded
    assert "critic/value_loss" in records[0] and "actor/policy_loss" in records[1]
    store = tmp_path / "eval-store"
    weights = f"model.init={run / 'warm_start.pt'}"
    assert main(["eval", str(RECIPE), *common, weights, "metrics.eval_samples=2", "--store", str(store)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(printed.strip().splitlines()[-1])
    assert "pass@1 " in printed and "pass@2 " in printed
    assert 0.0 <= result["eval_pass_at_1"] <= result["eval_pass_at_2"] <= 1.0
    episodes = [json.loads(line) for line in _records(store)]
    assert len(episodes) == 2 * (1 + 2)  # 2 held-out tasks: greedy, then 2 samples each
    test_split = {r.instance_id for r in load_rows(SHIPPED) if r.split == "test"}
    assert {e["task_id"] for e in episodes} <= test_split


def _records(store: Path):
    from agentrl.store import TrajectoryStore

    return (json.dumps(r) for r in TrajectoryStore(store).records())
