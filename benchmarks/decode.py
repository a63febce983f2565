"""Speed of the embedded engine's batched decode: a preallocated KV cache and finished requests
leaving the batch, against the model's default cache (concatenated at every step) with every
request kept to the end (the baseline), both run here on the same requests.

    .venv/bin/python benchmarks/decode.py [--requests 32] [--hidden 128] [--layers 3] [--repeats 3]

The requests are shaped like a quickstart rollout batch: prompts of 400-700 tokens, answers of
20-96 tokens (seeded sampling at temperature 0.5, no stop token, so each answer's length is its
``max_new_tokens``). Both engines must give every request the same tokens; the script checks
that first. Goal: faster than the baseline (ratio > 1).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from agentrl.models import tiny_chat_model
from agentrl.rollout.engine import SamplingParams
from agentrl.rollout.local import LocalEngine


def requests(n: int, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(400, 701, (1,), generator=g))
        answer = int(torch.randint(20, 97, (1,), generator=g))
        prompt = torch.randint(3, 700, (length,), generator=g).tolist()
        out.append((prompt, SamplingParams(temperature=0.5, max_new_tokens=answer, seed=i)))
    return out


async def decode(engine: LocalEngine, batch) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    gens = await asyncio.gather(*(engine.generate(p, sp) for p, sp in batch))
    return time.perf_counter() - start, [g.output_ids for g in gens]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, _ = tiny_chat_model(seed=0, hidden=args.hidden, layers=args.layers)
    batch = requests(args.requests)
    engines = {
        "baseline": LocalEngine(model, preallocate_cache=False, drop_finished=False),
        "engine": LocalEngine(model),
    }

    async def run() -> dict[str, list[float]]:
        times: dict[str, list[float]] = {name: [] for name in engines}
        outputs = {}
        for _ in range(args.repeats):  # interleaved, so that a slow stretch of the machine hits both
            for name, engine in engines.items():
                seconds, outputs[name] = await decode(engine, batch)
                times[name].append(seconds)
        for engine in engines.values():
            if engine.stats["batches"] != args.repeats:
                raise SystemExit(f"FAILED: the requests were not decoded as one batch: {engine.stats}")
            await engine.close()
        if outputs["engine"] != outputs["baseline"]:
            raise SystemExit("FAILED: the engine's tokens differ from the baseline's")
        return times

    times = asyncio.run(run())
    base, new = (statistics.median(times[k]) for k in ("baseline", "engine"))
    tokens = sum(sp.max_new_tokens for _, sp in batch)
    print(
        f"{args.requests} requests, {tokens} new tokens, tiny model hidden {args.hidden} x {args.layers} layers"
    )
    print(f"one batch, median of {args.repeats}: baseline {base:.2f} s, engine {new:.2f} s (same tokens)")
    print(f"speed-up: {base / new:.2f}x (goal > 1)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
