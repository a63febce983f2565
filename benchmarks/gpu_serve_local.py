"""The agent loop through ``SGLangEngine`` against ``agentrl serve local`` serving SmolLM2-135M on a
GPU, against the same episodes on the embedded engine in this process (the baseline), one after the
other on the same GPU: output tokens/s of each and their ratio.

    .venv/bin/python benchmarks/gpu_serve_local.py                     # a GPU: smollm2, 64 episodes
    .venv/bin/python benchmarks/gpu_serve_local.py --small --device cpu  # anywhere: the tiny model

Episodes are three turns of a tool-less chat (the env answers each turn with a short message), at
``--concurrency`` at a time, sampled at temperature 1 with seeds, so both engines decode the same
work. The served run goes over real HTTP (uvicorn) to a server process of its own. ``--model``
takes a local Hugging Face directory instead (``gpu_check.py`` passes SmolLM2's shape with random
weights, as its GGUF file cannot be carried to a GPU machine).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from agentrl.env import Observation, StepResult, Task
from agentrl.rollout.agent_loop import LoopConfig, run_episode


class ChatEnv:
    """Three turns; each answered with a short user message; reward 0."""

    id = "chat-v0"

    def __init__(self, turns: int = 3):
        self.turns, self.steps = turns, 0

    async def reset(self, task: Task) -> Observation:
        self.steps = 0
        return Observation([{"role": "user", "content": f"Write a Python function number {task.id}."}], [])

    async def step(self, tool_calls) -> StepResult:
        self.steps += 1
        if self.steps >= self.turns:
            return StepResult([], 0.0, True, {"status": "completed"})
        return StepResult([{"role": "user", "content": "Now make it shorter."}])

    async def close(self) -> None:
        pass


async def episodes(
    engine, tokenizer, n: int, concurrency: int, max_new_tokens: int
) -> tuple[float, int, dict]:
    gate = asyncio.Semaphore(concurrency)
    loop = LoopConfig(max_new_tokens=max_new_tokens, max_context=4096, seed=0, temperature=1.0)

    async def one(i: int):
        async with gate:
            return await run_episode(ChatEnv(), engine, tokenizer, Task(str(i)), loop)

    start = time.perf_counter()
    trajectories = await asyncio.gather(*(one(i) for i in range(n)))
    seconds = time.perf_counter() - start
    tokens = sum(sum(t.loss_mask) for t in trajectories)
    statuses: dict[str, int] = {}
    for t in trajectories:
        statuses[t.status] = statuses.get(t.status, 0) + 1
    return tokens / seconds, tokens, statuses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="the tiny model and a few short episodes")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu", "auto"])
    parser.add_argument("--episodes", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--model",
        default=None,
        help="tiny | smollm2 | a local Hugging Face model directory (default: smollm2, tiny with --small)",
    )
    args = parser.parse_args()
    model_name = args.model or ("tiny" if args.small else "smollm2")
    n = args.episodes or (8 if args.small else 64)
    max_new = 16 if args.small else 256

    from agentrl.models import load_model
    from agentrl.rollout.sglang import SGLangEngine

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentrl.cli",
            "serve",
            "local",
            "--model",
            model_name,
            "--port",
            str(port),
            "--device",
            args.device,
        ],
        start_new_session=True,
    )
    model, tokenizer = load_model(model_name)  # the client's tokenizer; the model is the baseline's
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("agentrl serve local did not start") from None
                time.sleep(0.5)

        async def served():
            engine = SGLangEngine(url)
            try:
                return await episodes(engine, tokenizer, n, args.concurrency, max_new)
            finally:
                await engine.close()

        http_rate, http_tokens, http_statuses = asyncio.run(served())
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)

    from agentrl.device import resolve_device
    from agentrl.rollout.local import LocalEngine

    model = model.to(resolve_device(args.device)).eval()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("sdpa")

    async def embedded():
        engine = LocalEngine(model)
        try:
            return await episodes(engine, tokenizer, n, args.concurrency, max_new)
        finally:
            await engine.close()

    local_rate, local_tokens, local_statuses = asyncio.run(embedded())
    print(
        f"{model_name} on {args.device}: {n} episodes of 3 turns, {args.concurrency} at a time, <= {max_new} tokens a turn"
    )
    print(
        f"  SGLangEngine -> agentrl serve local: {http_rate:8.1f} output tokens/s ({http_tokens} tokens, {http_statuses})"
    )
    print(
        f"  embedded LocalEngine (baseline):     {local_rate:8.1f} output tokens/s ({local_tokens} tokens, {local_statuses})"
    )
    print(f"ratio (served / embedded, tokens/s): {http_rate / local_rate:.2f}")


if __name__ == "__main__":
    main()
