"""The agent loop's own cost, with an instant engine and an in-memory environment.

    .venv/bin/python benchmarks/agent_loop.py

1. Overhead per turn at turns 1-5 vs turns 96-100 of 100-turn episodes (goal: at most 1.5x,
   i.e. nothing in the loop grows with the history).
2. Episodes per second with 256 concurrent 10-turn episodes.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

from agentrl.env import Observation, StepResult, Task
from agentrl.models import tiny_tokenizer
from agentrl.rollout.agent_loop import LoopConfig, run_episode
from agentrl.rollout.engine import Generation
from agentrl.rollout.render import Renderer
from agentrl.tools import CODING_TOOLS


class InstantEngine:
    def __init__(self, output_ids):
        self.output_ids = output_ids
        self.stamps: list[float] = []

    async def generate(self, input_ids, params):
        self.stamps.append(time.perf_counter())
        return Generation(self.output_ids, [-0.1] * len(self.output_ids), "stop", "0")

    async def update_weights(self, *a, **k):
        return "0"

    async def health(self):
        return True


class MemoryEnv:
    id = "memory-v0"

    def __init__(self, turns):
        self.turns, self.steps = turns, 0

    async def reset(self, task):
        self.steps = 0
        return Observation([{"role": "user", "content": "go"}], CODING_TOOLS)

    async def step(self, calls):
        self.steps += 1
        if self.steps >= self.turns:
            return StepResult([], 1.0, True, {"status": "completed"})
        out = "file_a.py\nfile_b.py\n[exit code 0]"
        return StepResult([{"role": "tool", "content": out, "name": "bash", "tool_call_id": "c"}])

    async def close(self):
        pass


async def per_turn_overhead(tok, output_ids, episodes=5, turns=100):
    early, late = [], []
    renderer = Renderer(tok, None)
    cfg = LoopConfig(max_turns=turns + 1, max_context=1_000_000, max_new_tokens=64)
    for _ in range(episodes):
        engine = InstantEngine(output_ids)
        traj = await run_episode(MemoryEnv(turns), engine, tok, Task("t"), cfg, renderer=renderer)
        assert traj.status == "completed" and len(traj.finish_reasons) == turns
        gaps = [b - a for a, b in zip(engine.stamps, engine.stamps[1:], strict=False)]
        early += gaps[:5]
        late += gaps[-5:]
    return statistics.median(early), statistics.median(late), len(traj)


async def throughput(tok, output_ids, n=256, turns=10):
    renderer = Renderer(tok, None)
    cfg = LoopConfig(max_turns=turns + 1, max_context=1_000_000, max_new_tokens=64)
    engine = InstantEngine(output_ids)
    start = time.perf_counter()
    trajs = await asyncio.gather(
        *(run_episode(MemoryEnv(turns), engine, tok, Task(f"t{i}"), cfg, renderer=renderer) for i in range(n))
    )
    seconds = time.perf_counter() - start
    assert all(t.status == "completed" for t in trajs)
    return n / seconds, n * turns / seconds


async def main() -> int:
    tok = tiny_tokenizer()
    eot = tok.convert_tokens_to_ids(tok.eos_token)
    output_ids = tok.encode(
        '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>', add_special_tokens=False
    )
    output_ids.append(eot)
    early, late, length = await per_turn_overhead(tok, output_ids)
    ratio = late / early
    print(
        f"[overhead] per turn: turns 1-5 {early * 1e3:.3f} ms, turns 96-100 {late * 1e3:.3f} ms "
        f"(episode of {length} tokens) -> {ratio:.2f}x (goal <= 1.5x: {'met' if ratio <= 1.5 else 'MISSED'})"
    )
    eps, turns_per_s = await throughput(tok, output_ids)
    print(f"[throughput] 256 concurrent 10-turn episodes: {eps:.0f} episodes/s, {turns_per_s:.0f} turns/s")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
