import glob
import gzip
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


FILLER = """
import resource, signal, sys
from tests.test_trajectory_store import sample
from agentrl.store import TrajectoryStore
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then returns short, as on a full disk
store = TrajectoryStore(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (4000, 4000))
for i in range(1000):
    try:
        store.append(sample(i))
    except OSError as e:
        print(i, e, flush=True)
"""


def test_a_full_disk_fails_the_append_that_does_not_fit_and_damages_nothing(tmp_path):
    path = tmp_path / "s"
    out = subprocess.run(
        [sys.executable, "-c", FILLER, str(path)], capture_output=True, text=True, cwd=os.getcwd(), check=True
    ).stdout.splitlines()
    first = int(out[0].split()[0])
    # from the first append that did not fit, each raises OSError, its partial write cut off again
    assert first > 3 and [int(line.split()[0]) for line in out] == list(range(first, 1000))
    assert all(line.endswith("is the disk full?") and " short write to " in line for line in out)
    shard = next(path.glob("*.jsonl.gz"))
    assert shard.stat().st_size < 4000  # the short write was cut off again
    store = TrajectoryStore(path)
    assert [t.seed for t in store.read()] == list(range(first))
    store.append(sample(5000))
    store.close()
    assert [t.seed for t in TrajectoryStore(path).read()] == [*range(first), 5000]


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


def test_a_writer_named_as_the_prefix_of_another_keeps_to_its_own_shards(tmp_path):
    """Writer "w"'s shards are w-NNNNN only: it neither appends to writer "w-1"'s shard nor takes a
    record that writer has half written for damage to repair."""
    other = TrajectoryStore(tmp_path / "s", writer="w-1")
    other.append(sample(1))
    other.close()
    shard = tmp_path / "s" / "w-1-00000.jsonl.gz"
    with open(shard, "ab") as f:
        f.write(gzip.compress(b'{"torn": ')[:12])  # the other writer's record in flight
    before = shard.read_bytes()
    mine = TrajectoryStore(tmp_path / "s", writer="w")
    mine.append(sample(2))
    mine.close()
    assert shard.read_bytes() == before and (tmp_path / "s" / "w-00000.jsonl.gz").is_file()
    assert not list((tmp_path / "s").glob("*.corrupt*"))


def test_values_json_cannot_hold_are_stored_as_null_not_a_lost_run(tmp_path):
    """An env's grading report or a task's data may hold NaN or infinity; the trajectory is still
    stored (as null there), and read back."""
    t = sample(0)
    t.extra["grade"] = {"score": float("nan"), "bounds": [0.0, float("inf")]}
    with TrajectoryStore(tmp_path / "s") as store:
        store.append(t)
    (back,) = TrajectoryStore(tmp_path / "s").read()
    assert back.extra["grade"] == {"score": None, "bounds": [0.0, None]}
    assert json.loads(t.to_json())["extra"]["grade"]["score"] is None


# -- damaged shards: every intact record survives reading and a later append; no byte is deleted --


def eight_record_shard(path):
    """A store at ``path`` holding seeds 0-7 in one shard: (shard, its bytes, each member's start)."""
    starts = []
    with TrajectoryStore(path) as store:
        for i in range(8):
            starts.append(0 if i == 0 else (path / "w0-00000.jsonl.gz").stat().st_size)
            store.append(sample(i))
    shard = path / "w0-00000.jsonl.gz"
    return shard, shard.read_bytes(), starts


def set_aside_files(shard):
    return sorted(shard.parent.glob(shard.name + ".corrupt*"))


def assert_nothing_deleted(shard, original):
    """The shard still starts with the original bytes, bar a tail that now sits whole in a .corrupt file."""
    aside = set_aside_files(shard)
    assert len(aside) <= 1
    moved = aside[0].read_bytes() if aside else b""
    cut = len(original) - len(moved)
    assert original[cut:] == moved
    assert shard.read_bytes().startswith(original[:cut])


def store_messages(caplog):
    messages = [r.getMessage() for r in caplog.records if r.name == "agentrl.store"]
    caplog.clear()
    return messages


def read_then_append_two(path, original, want, caplog):
    """Read the damaged store, append seeds 100 and 101, read again; returns the writer's warnings."""
    shard = path / "w0-00000.jsonl.gz"
    with caplog.at_level(logging.WARNING, logger="agentrl.store"):
        caplog.clear()
        assert list(TrajectoryStore(path).read()) == [sample(i) for i in want]
        read_warnings = store_messages(caplog)
        assert len(TrajectoryStore(path)) == len(want)
        store_messages(caplog)
        with TrajectoryStore(path) as store:
            store.append(sample(100))
            store.append(sample(101))
        writer_warnings = store_messages(caplog)
        assert list(TrajectoryStore(path).read()) == [sample(i) for i in [*want, 100, 101]]
    assert_nothing_deleted(shard, original)
    return read_warnings, writer_warnings


def load_with_datasets(store, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    ds = datasets.load_dataset(
        "json", data_files=store.data_files, split="train", cache_dir=str(tmp_path / "hf")
    )
    return sorted(ds["seed"])


def gz(text: bytes) -> bytes:
    return gzip.compress(text, mtime=0)


GARBAGE = b"garbage!" * 20 + b"\x1f\x8b\x08\x00 a false gzip magic inside the garbage " + b"\x00" * 30


# (what, damage(original bytes, member starts) -> (damaged bytes, offset the warning must name), seeds read)
MIDDLE = [
    ("garbage between records 3 and 4", lambda d, s: (d[: s[3]] + GARBAGE + d[s[3] :], s[3]), range(8)),
    (
        "invalid JSON in an intact member",
        lambda d, s: (d[: s[3]] + gz(b'{"seed": \n') + d[s[3] :], s[3]),
        range(8),
    ),
    ("a JSON list, not an object", lambda d, s: (d[: s[3]] + gz(b"[1, 2]\n") + d[s[3] :], s[3]), range(8)),
    ("a member without a newline", lambda d, s: (d[: s[3]] + gz(b'{"a": 1}') + d[s[3] :], s[3]), range(8)),
    ("record 3 cut short", lambda d, s: (d[: s[3] + 50] + d[s[4] :], s[3]), [0, 1, 2, 4, 5, 6, 7]),
]
TAIL = [
    ("a truncated tail", lambda d, s: (d[: s[7] + 60], s[7]), range(7)),
    ("garbage at the very end", lambda d, s: (d + GARBAGE, len(d)), range(8)),
    ("invalid JSON as the last member", lambda d, s: (d + gz(b"not json\n"), len(d)), range(8)),
    ("a JSON number as the last member", lambda d, s: (d + gz(b"7\n"), len(d)), range(8)),
    ("a torn member after garbage", lambda d, s: (d + GARBAGE + d[s[2] : s[3] - 9], len(d)), range(8)),
]


@pytest.mark.parametrize("what,damage,want", MIDDLE, ids=[m[0] for m in MIDDLE])
def test_damage_inside_a_shard_is_skipped_and_the_writer_starts_a_new_shard(
    tmp_path, caplog, what, damage, want
):
    path = tmp_path / "s"
    shard, data, starts = eight_record_shard(path)
    damaged, offset = damage(data, starts)
    shard.write_bytes(damaged)
    read_warnings, writer_warnings = read_then_append_two(path, damaged, list(want), caplog)
    assert len(read_warnings) == 1 and str(shard) in read_warnings[0]
    assert f"at offset {offset} " in read_warnings[0]
    assert len(writer_warnings) == 1 and f"{shard} has damaged bytes" in writer_warnings[0]
    assert f"offset {offset} " in writer_warnings[0] and "w0-00001.jsonl.gz" in writer_warnings[0]
    assert shard.read_bytes() == damaged and not set_aside_files(shard)  # left exactly as it was
    lines = gzip.decompress((path / "w0-00001.jsonl.gz").read_bytes()).splitlines()
    assert [json.loads(line)["seed"] for line in lines] == [100, 101]


@pytest.mark.parametrize("what,damage,want", TAIL, ids=[t[0] for t in TAIL])
def test_damage_at_the_end_is_moved_aside_and_datasets_still_reads_the_store(
    tmp_path, caplog, monkeypatch, what, damage, want
):
    path = tmp_path / "s"
    shard, data, starts = eight_record_shard(path)
    damaged, offset = damage(data, starts)
    shard.write_bytes(damaged)
    read_warnings, writer_warnings = read_then_append_two(path, damaged, list(want), caplog)
    assert read_warnings and str(shard) in read_warnings[0] and f"at offset {offset} " in read_warnings[0]
    aside = shard.with_name(shard.name + ".corrupt")
    assert set_aside_files(shard) == [aside] and aside.read_bytes() == damaged[offset:]
    assert len(writer_warnings) == 1
    assert f"{shard}: {len(damaged) - offset} bytes from offset {offset}" in writer_warnings[0]
    assert f"moved them to {aside}" in writer_warnings[0]
    assert sorted(Path(p).name for p in glob.glob(TrajectoryStore(path).data_files)) == [shard.name]
    assert load_with_datasets(TrajectoryStore(path), tmp_path, monkeypatch) == [*want, 100, 101]


def test_a_flipped_byte_anywhere_loses_at_most_the_record_it_hits(tmp_path, caplog):
    original_path = tmp_path / "original"
    _, data, starts = eight_record_shard(original_path)
    for position in range(0, len(data), 97):
        hit = max(i for i, start in enumerate(starts) if start <= position)
        path = tmp_path / f"flip-{position}"
        path.mkdir()
        shard = path / "w0-00000.jsonl.gz"
        damaged = bytearray(data)
        damaged[position] ^= 0x55
        shard.write_bytes(damaged)
        with caplog.at_level(logging.WARNING, logger="agentrl.store"):
            caplog.clear()
            seeds = [t.seed for t in TrajectoryStore(path).read()]
            warnings = store_messages(caplog)
        if seeds == list(range(8)):  # a header byte the format does not check (mtime, OS): still intact
            want = list(range(8))
            assert not warnings, position
        else:
            want = [i for i in range(8) if i != hit]
            assert seeds == want, position
            assert str(shard) in warnings[0] and f"at offset {starts[hit]} " in warnings[0], position
        read_then_append_two(path, bytes(damaged), want, caplog)
        if hit < 7 and hit not in want:
            assert shard.read_bytes() == damaged, position  # damage inside: left as it is


def test_an_empty_shard_is_appended_to(tmp_path, caplog):
    path = tmp_path / "s"
    path.mkdir()
    (path / "w0-00000.jsonl.gz").write_bytes(b"")
    assert read_then_append_two(path, b"", [], caplog) == ([], [])
    assert sorted(p.name for p in path.iterdir()) == [".w0.lock", "w0-00000.jsonl.gz"]


def test_a_shard_of_nothing_but_garbage_is_moved_aside_whole(tmp_path, caplog):
    path = tmp_path / "s"
    path.mkdir()
    shard = path / "w0-00000.jsonl.gz"
    shard.write_bytes(GARBAGE)
    read_warnings, _ = read_then_append_two(path, GARBAGE, [], caplog)
    assert "at offset 0 " in read_warnings[0] and "they run to the end of the file" in read_warnings[0]
    assert shard.with_name(shard.name + ".corrupt").read_bytes() == GARBAGE


def test_each_repair_sets_aside_into_a_new_file_outside_the_shard_glob(tmp_path, monkeypatch):
    path = tmp_path / "s"
    shard, _, _ = eight_record_shard(path)
    tails = [b"first torn tail", b"second torn tail"]
    for tail in tails:
        with open(shard, "ab") as f:
            f.write(tail)
        with TrajectoryStore(path) as store:  # opening the writer repairs the shard
            store.append(sample(100 + len(tail)))
    aside = set_aside_files(shard)
    assert [p.name for p in aside] == [shard.name + ".corrupt", shard.name + ".corrupt.1"]
    assert [p.read_bytes() for p in aside] == tails
    assert [Path(p).name for p in glob.glob(TrajectoryStore(path).data_files)] == [shard.name]
    assert [t.seed for t in TrajectoryStore(path).read()] == [*range(8), 115, 116]
    assert load_with_datasets(TrajectoryStore(path), tmp_path, monkeypatch) == [*range(8), 115, 116]


def test_read_skips_an_intact_record_that_is_not_a_trajectory(tmp_path, caplog):
    path = tmp_path / "s"
    with TrajectoryStore(path) as store:
        store.append(sample(0))
        store.append({"not": "a trajectory"})
        store.append(sample(1))
    second = len(
        gzip.compress(json.dumps(sample(0).to_record(), separators=(",", ":")).encode() + b"\n", mtime=0)
    )
    with caplog.at_level(logging.WARNING, logger="agentrl.store"):
        assert [t.seed for t in TrajectoryStore(path).read()] == [0, 1]
    (message,) = store_messages(caplog)
    assert f"{path / 'w0-00000.jsonl.gz'}: skipped the record at offset {second}" in message
    assert len(TrajectoryStore(path)) == 3  # records, not trajectories


def test_read_skips_a_record_whose_parts_disagree(tmp_path, caplog):
    """JSON that parses into a trajectory whose tokens, mask and log-probs are not one length (a
    record edited or written by another tool) is skipped by name, not handed to the trainer."""
    with TrajectoryStore(tmp_path / "s") as store:
        store.append(sample(0))
        bad = sample(1).to_record()
        bad["loss_mask"] = bad["loss_mask"][:-1]
        store.append(bad)
        store.append(sample(2))
    with caplog.at_level(logging.WARNING):
        seeds = [t.seed for t in TrajectoryStore(tmp_path / "s").read()]
    assert seeds == [0, 2] and "which is not a trajectory" in caplog.text


def test_set_aside_moves_the_chosen_records_out_of_every_shard_and_appends_go_on(tmp_path):
    store = TrajectoryStore(tmp_path, max_shard_bytes=1500)  # several shards
    for i in range(12):
        store.append(sample(i))
    shards = sorted(tmp_path.glob("*.jsonl.gz"))
    assert len(shards) > 2
    odd = lambda record: int(record["task_id"].split("-")[1]) % 2 == 1  # noqa: E731
    assert store.set_aside(odd) == 6
    store.append(sample(12))  # the handle follows the rewritten last shard
    assert [t.seed for t in store.read()] == [0, 2, 4, 6, 8, 10, 12]
    aside = sorted(tmp_path.glob("*.superseded"))
    assert aside and not any(p.match("*.jsonl.gz") for p in aside)
    moved = tmp_path / "moved"
    moved.mkdir()
    for k, p in enumerate(aside):  # each holds whole gzip members, as a shard does
        (moved / f"w0-{k:05d}.jsonl.gz").write_bytes(p.read_bytes())
    assert sorted(t.seed for t in TrajectoryStore(moved).read()) == [1, 3, 5, 7, 9, 11]
    assert store.set_aside(odd) == 0 and len(sorted(tmp_path.glob("*.superseded"))) == len(aside)
    store.close()
