"""How long ``agentrl replay STORE`` takes to list a 10,000-episode store, against a baseline.

    .venv/bin/python benchmarks/replay_list.py [--episodes 10000] [--tokens 2000] [--store DIR]

Writes a store of ``--episodes`` episodes (``--tokens`` tokens each over 8 assistant turns, random
token ids and log-probs, chat messages and tool-call records, a mix of statuses) to a temporary
directory (or ``--store``, kept), then times:

- baseline: reading the shards' JSON and nothing else (``TrajectoryStore.records()``: every gzip
  member decompressed and parsed whole);
- list, in process: ``agentrl.replay`` finding, naming and listing every episode (to /dev/null);
- list, the command: ``agentrl replay STORE > /dev/null`` as a user runs it (start-up included).

Prints the seconds of each (best of two) and the ratios to the baseline. The list parses only the
fields after each record's token arrays (``agentrl.replay.episodes._fields``), hence a ratio
below 1. Goal (issue 37): the command lists a
10,000-episode store in under 5 s on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentrl.replay.episodes import read, resolve
from agentrl.replay.transcript import list_view
from agentrl.store import TrajectoryStore
from agentrl.trajectory import STATUSES

TURNS = 8


def record(i: int, tokens: int, rng: random.Random) -> dict:
    prompt = tokens // 5
    per_turn = (tokens - prompt) // TURNS
    assistant = per_turn // 2
    ids, mask, logps, turns = [], [], [], [{"start": 0, "end": prompt, "role": "prompt"}]
    ids += [rng.randrange(150_000) for _ in range(prompt)]
    mask += [0] * prompt
    logps += [0.0] * prompt
    for _ in range(TURNS):
        for role, n in (("assistant", assistant), ("tool", per_turn - assistant)):
            turns.append({"start": len(ids), "end": len(ids) + n, "role": role})
            ids += [rng.randrange(150_000) for _ in range(n)]
            mask += [int(role == "assistant")] * n
            logps += [-rng.random() * 3 if role == "assistant" else 0.0 for _ in range(n)]
    status = STATUSES[i % len(STATUSES)] if i % 3 == 0 else "completed"
    messages = [{"role": "user", "content": "Fix the failing test in pkg/mod.py. " * 10}]
    calls = []
    for k in range(TURNS):
        messages.append({"role": "assistant", "content": f"Let me look at turn {k}. " * 20, "tool_calls": []})
        messages.append({"role": "tool", "content": "output line\n" * 30, "name": "bash"})
        calls.append(
            {
                "turn": k,
                "name": "bash",
                "arguments": {"command": "pytest -x"},
                "output": "ok\n" * 30,
                "exit_code": k % 2,
            }
        )
    return {
        "input_ids": ids,
        "loss_mask": mask,
        "rollout_logprobs": logps,
        "turns": turns,
        "reward": float(status == "completed" and i % 2 == 0),
        "status": status,
        "env_id": "bugfix-v0",
        "task_id": f"train-{i % 512:06d}",
        "seed": i,
        "sample_index": i % 4,
        "messages": json.dumps(messages),
        "tool_calls": json.dumps(calls),
        "weight_versions": [str(i // 256)] * TURNS,
        "finish_reasons": ["stop"] * TURNS,
        "timings": [{"generate_s": 0.5, "tool_s": 0.2}] * TURNS,
        "extra": json.dumps({"iteration": i // 256, "wall_s": 12.5}),
    }


def write(path: Path, episodes: int, tokens: int) -> None:
    rng = random.Random(0)
    templates = [record(i, tokens, rng) for i in range(64)]  # random ids are costly to draw: reuse
    with TrajectoryStore(path) as store:
        for i in range(episodes):
            r = dict(templates[i % len(templates)])
            r.update(task_id=f"train-{i % 512:06d}", seed=i, extra=json.dumps({"iteration": i // 256}))
            store.append(r)  # a dict: written as is (the templates are valid; validating 20M tokens is slow)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=2_000, help="tokens per episode")
    parser.add_argument(
        "--store", default=None, help="write the store here and keep it (default: a temporary one)"
    )
    args = parser.parse_args()
    tmp = None if args.store else tempfile.TemporaryDirectory()
    path = Path(args.store or tmp.name) / "trajectories"
    if not any(path.glob("*.jsonl.gz")):
        seconds = timed(lambda: write(path, args.episodes, args.tokens))
        print(f"wrote {args.episodes} episodes of {args.tokens} tokens in {seconds:.1f} s")
    size = sum(f.stat().st_size for f in path.glob("*.jsonl.gz"))
    print(f"store {size / 2**20:.0f} MiB ({path}); {os.cpu_count()} CPUs visible")

    def baseline():
        for _ in TrajectoryStore(path).records():
            pass

    def in_process():
        with open(os.devnull, "w") as null:
            episodes, _ = read(resolve(path))
            list_view(null, episodes)

    def command():
        agentrl = Path(sys.executable).with_name("agentrl")
        subprocess.run([str(agentrl), "replay", str(path)], stdout=subprocess.DEVNULL, check=True)

    base = min(timed(baseline) for _ in range(2))
    listed = min(timed(in_process) for _ in range(2))
    cmd = min(timed(command) for _ in range(2))
    print(f"baseline (read the shards' JSON): {base:.2f} s")
    print(f"list, in process:                 {listed:.2f} s  ratio {listed / base:.2f}")
    print(f"agentrl replay STORE (command):   {cmd:.2f} s  ratio {cmd / base:.2f}")
    if args.episodes == 10_000:
        print(f"goal: the command under 5 s for 10,000 episodes: {'met' if cmd < 5 else 'MISSED'}")
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    main()
