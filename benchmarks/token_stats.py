"""What recording the trainer's per-token stats (``debug.token_stats_every``) costs an iteration.

    .venv/bin/python benchmarks/token_stats.py [--rows 32] [--tokens 4096]

A batch of ``--rows`` episodes of ``--tokens`` tokens each (8 turns, random ids and log-probs, half
the tokens trained), its four per-token tensors (trainer log-probs, IcePop weights, advantages,
values) filled. Times, best of three:

- baseline: appending the same episodes to a trajectory store, which every iteration does anyway;
- stats: ``agentrl.token_stats.write`` of the batch (what an iteration with the option on adds).

Prints both, the ratio of stats to baseline, and the bytes per token of each on disk.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from agentrl import token_stats
from agentrl.store import TrajectoryStore
from agentrl.trainer.backend import Batch
from agentrl.trajectory import Trajectory, TurnSpan


def episode(i: int, n: int, rng: random.Random) -> Trajectory:
    turns, mask, logps, pos = [], [], [], 0
    for k in range(8):
        length = n // 8
        role = "assistant" if k % 2 else "tool"
        turns.append(TurnSpan(pos, pos + length, "prompt" if k == 0 else role))
        mask += [int(role == "assistant" and k > 0)] * length
        logps += [-rng.random() if role == "assistant" and k > 0 else 0.0 for _ in range(length)]
        pos += length
    ids = [rng.randrange(32000) for _ in range(pos)]
    return Trajectory(
        ids, mask, logps, turns, reward=float(i % 2), task_id=f"train-{i}", extra={"iteration": 0}
    )


def best(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    rng = random.Random(0)
    trajectories = [episode(i, args.tokens, rng) for i in range(args.rows)]
    batch = Batch.from_trajectories(trajectories)
    g = torch.Generator().manual_seed(0)
    mask = batch.loss_mask
    batch.old_logprobs = (batch.rollout_logprobs + 0.01 * torch.randn(mask.shape, generator=g)) * mask
    batch.token_weights = mask.float()
    batch.advantages = torch.randn(mask.shape, generator=g) * mask
    batch.old_values = torch.rand(mask.shape, generator=g) * mask
    total = sum(len(t) for t in trajectories)
    with tempfile.TemporaryDirectory() as tmp:
        stores = iter(range(10))

        def store():
            with TrajectoryStore(Path(tmp) / f"store{next(stores)}") as s:
                for t in trajectories:
                    s.append(t)

        base = best(store)
        stats = best(lambda: token_stats.write(Path(tmp) / "run", 0, trajectories, batch))
        store_bytes = sum(f.stat().st_size for f in (Path(tmp) / "store0").glob("*.jsonl.gz"))
        stats_bytes = token_stats.path_of(Path(tmp) / "run", 0).stat().st_size
    print(f"{args.rows} episodes, {total} tokens")
    print(
        f"baseline, the store's append of the episodes: {base:.3f} s, {store_bytes / total:.1f} bytes/token"
    )
    print(
        f"token stats, written:                         {stats:.3f} s, {stats_bytes / total:.1f} bytes/token"
    )
    print(f"ratio stats / baseline: {stats / base:.2f}x time, {stats_bytes / store_bytes:.2f}x disk")


if __name__ == "__main__":
    sys.exit(main())
