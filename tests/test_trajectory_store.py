import gzip
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from agentrl.store import TrajectoryStore
from agentrl.trajectory import Trajectory, TrajectoryError, TurnSpan


def sample(i: int = 0, n_tool: int = 3) -> Trajectory:
    # prompt (3) / assistant (2) / tool (n_tool) / assistant (2)
    ids = [1, 2, 3, 10 + i, 11, *range(20, 20 + n_tool), 12, 13]
    mask = [0, 0, 0, 1, 1, *[0] * n_tool, 1, 1]
    logps = [0.0, 0.0, 0.0, -0.1 - 0.2, -1e-300, *[0.0] * n_tool, -2.5, -0.123456789012345]
    return Trajectory(
        input_ids=ids,
        loss_mask=mask,
        rollout_logprobs=logps,
        turns=[
            TurnSpan(0, 3, "prompt"),
            TurnSpan(3, 5, "assistant"),
            TurnSpan(5, 5 + n_tool, "tool"),
            TurnSpan(5 + n_tool, 7 + n_tool, "assistant"),
        ],
        reward=float(i % 2),
        status="completed",
        env_id="bugfix-v0",
        task_id=f"train-{i:06d}",
        seed=i,
        messages=[{"role": "user", "content": "fix it"}, {"role": "assistant", "content": 'say "hi"\n'}],
        tool_calls=[
            {"turn": 0, "name": "bash", "arguments": {"command": "ls"}, "output": "a\n", "exit_code": 0}
        ],
        weight_versions=["3", "3"],
        finish_reasons=["stop", "stop"],
        timings=[{"generate_s": 0.5}, {"generate_s": 0.25, "tool_s": 1.0}],
        extra={"drift": 0, "nested": {"k": [1, 2]}},
    )


def test_json_round_trip_is_lossless():
    t = sample(3)
    back = Trajectory.from_json(t.to_json())
    assert back == t and back.rollout_logprobs[3] == -0.1 - 0.2 and back.rollout_logprobs[4] == -1e-300
    assert Trajectory.from_record(json.loads(json.dumps(t.to_record()))) == t


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda t: t.loss_mask.pop(), r"lengths differ: input_ids 10, loss_mask 9"),
        (lambda t: t.loss_mask.__setitem__(6, 1), r"loss_mask\[6\] is 1 outside an assistant span"),
        (
            lambda t: t.rollout_logprobs.__setitem__(8, float("nan")),
            r"rollout_logprobs\[8\] = nan at a trainable token",
        ),
        (
            lambda t: t.rollout_logprobs.__setitem__(1, -0.5),
            r"rollout_logprobs\[1\] = -0.5 at a non-trainable token",
        ),
        (lambda t: t.turns.__setitem__(2, TurnSpan(6, 8, "tool")), r"turns\[2\] = \[6, 8\) must start at 5"),
        (lambda t: t.turns.__setitem__(1, TurnSpan(3, 5, "bot")), r"turns\[1\].role = 'bot'"),
        (lambda t: setattr(t, "status", "done"), "status 'done' is not one of"),
        (lambda t: t.input_ids.__setitem__(0, -4), r"input_ids\[0\] = -4 is not a token id"),
    ],
)
def test_validate_names_the_index_that_breaks(mutate, message):
    t = sample()
    assert t.validate() is t
    mutate(t)
    with pytest.raises(TrajectoryError, match=message):
        t.validate()


def test_store_appends_reads_filters_and_rotates(tmp_path):
    with TrajectoryStore(tmp_path / "s", max_shard_bytes=1500) as store:
        for i in range(20):
            store.append(sample(i))
    store = TrajectoryStore(tmp_path / "s")
    assert len(list((tmp_path / "s").glob("*.jsonl.gz"))) > 1  # rotated by size
    got = list(store.read())
    assert got == [sample(i) for i in range(20)]
    assert [t.task_id for t in store.read(filter=lambda t: t.reward == 1.0)] == [
        f"train-{i:06d}" for i in range(1, 20, 2)
    ]
    with pytest.raises(TrajectoryError):
        store.append(Trajectory([1], [1], [0.0], [TurnSpan(0, 1, "prompt")]))
    store.close()


def test_datasets_reads_a_store_directly(tmp_path):
    import datasets

    with TrajectoryStore(tmp_path / "s", max_shard_bytes=2000) as store:
        for i in range(12):
            store.append(sample(i, n_tool=1 + i))
    ds = datasets.load_dataset("json", data_files=store.data_files, split="train")
    assert len(ds) == 12
    rows = sorted(ds, key=lambda r: r["seed"])
    for i, row in enumerate(rows):
        got, want = Trajectory.from_record(row), sample(i, n_tool=1 + i)
        # datasets' JSON reader parses floats to ~10 significant digits (TrajectoryStore.read is exact).
        assert got.rollout_logprobs == pytest.approx(want.rollout_logprobs, rel=1e-9, abs=1e-300)
        got.rollout_logprobs = want.rollout_logprobs
        assert got == want


WRITER = """
import sys
from tests.test_trajectory_store import sample
from agentrl.store import TrajectoryStore
store = TrajectoryStore(sys.argv[1], max_shard_bytes=1 << 30)
big = "x" * 400_000
i = 0
while True:
    t = sample(i)
    t.extra["padding"] = big + str(i)  # large records, so a kill often lands inside a write
    store.append(t)
    print(i, flush=True)
    i += 1
"""


def test_kill_9_mid_write_loses_at_most_the_record_being_written(tmp_path):
    path = tmp_path / "s"
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    last = -1
    deadline = time.time() + 60
    while last < 30 and time.time() < deadline:
        last = int(child.stdout.readline())
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    # Also tear the end of the shard by hand, as a kill inside write() would.
    shard = sorted(path.glob("*.jsonl.gz"))[-1]
    partial = gzip.compress(json.dumps(sample(999).to_record()).encode() + b"\n")
    with open(shard, "ab") as f:
        f.write(partial[: len(partial) // 2])

    store = TrajectoryStore(path)
    seeds = [t.seed for t in store.read()]
    assert seeds == list(range(len(seeds))) and len(seeds) >= last + 1  # every acknowledged record is back
    store.append(sample(5000))  # reopens, cuts the torn record off, keeps appending
    store.close()
    seeds_after = [t.seed for t in TrajectoryStore(path).read()]
    assert seeds_after == [*seeds, 5000]

    import datasets

    ds = datasets.load_dataset("json", data_files=str(path / "*.jsonl.gz"), split="train")
    assert len(ds) == len(seeds_after)


def test_one_writer_per_name(tmp_path):
    a = TrajectoryStore(tmp_path / "s")
    a.append(sample(0))
    b = TrajectoryStore(tmp_path / "s")
    with pytest.raises(RuntimeError, match="another process is writing .* as writer 'w0'"):
        b.append(sample(1))
    c = TrajectoryStore(tmp_path / "s", writer="w1")
    c.append(sample(2))
    a.close()
    c.close()
    assert sorted(t.seed for t in TrajectoryStore(tmp_path / "s").read()) == [0, 2]
