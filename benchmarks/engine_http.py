"""The cost of ``SGLangEngine`` over HTTP: requests/s at 256 concurrent ``/generate`` calls against
``agentrl serve local`` with an instant model, ``SGLangEngine.generate`` against a bare aiohttp POST
loop sending the same bodies (the baseline), both run here against the same server, alternately.

    .venv/bin/python benchmarks/engine_http.py [--requests 4096] [--concurrency 256] [--repeats 3]

The server runs in a process of its own (so that the client's event loop has the interpreter to
itself); its model answers at once (``max_new_tokens`` tokens, fixed log-probs), so what is measured
is the HTTP path: JSON, the contract checks, the retry wrapper, parsing. Goal: ratio >= 0.8; also
printed: the latency the client adds per call (p50, p99 of each minus the baseline's).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time

from agentrl.rollout.engine import Generation, SamplingParams


class InstantEngine:
    """A model that answers every request at once: ``max_new_tokens`` ids, log-prob -1.0 each."""

    def __init__(self):
        self.weight_version = "0"
        self.stats = {"requests": 0}

    async def generate(self, input_ids, params: SamplingParams) -> Generation:
        self.stats["requests"] += 1
        n = params.max_new_tokens
        return Generation([7] * n, [-1.0] * n, "length", self.weight_version)


def serve(port: int) -> None:
    from agentrl.rollout.serve_local import LocalServer, uvicorn_server

    server = LocalServer(InstantEngine(), model_path="instant", max_context=1 << 16, vocab_size=1 << 16)
    uvicorn_server(server, "127.0.0.1", port).run()


def percentiles(latencies: list[float]) -> tuple[float, float]:
    ordered = sorted(latencies)
    return statistics.median(ordered), ordered[int(0.99 * (len(ordered) - 1))]


async def run(call, n: int, concurrency: int) -> tuple[float, list[float]]:
    """``n`` calls, ``concurrency`` at a time: (requests/s, latency of each call)."""
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(i: int):
        async with gate:
            t = time.perf_counter()
            await call(i)
            latencies.append(time.perf_counter() - t)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return n / (time.perf_counter() - start), latencies


async def bench(url: str, n: int, concurrency: int, repeats: int) -> None:
    import aiohttp

    from agentrl.rollout.sglang import SGLangEngine
    from agentrl.rollout.sglang_api import generate_request

    prompt = list(range(1, 513))
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=0)
    engine = SGLangEngine(url)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def bare(i: int):
        async with session.post(f"{url}/generate", json=generate_request(prompt, params, f"bare-{i}")) as r:
            body = await r.json()
        assert r.status == 200 and len(body["meta_info"]["output_token_logprobs"]) == 16

    async def client(i: int):
        gen = await engine.generate(prompt, params)
        assert len(gen.output_ids) == 16

    await run(bare, concurrency, concurrency)  # warm both: connections open, code paths run once
    await run(client, concurrency, concurrency)
    results: dict[str, list] = {"bare": [], "client": []}
    for _ in range(repeats):
        for name, call in (("bare", bare), ("client", client)):
            results[name].append(await run(call, n, concurrency))
    await session.close()
    await engine.close()
    assert sum(engine.stats["retries"].values()) == 0 and engine.stats["failed"] == 0
    best = {name: max(runs, key=lambda r: r[0]) for name, runs in results.items()}
    (bare_rps, bare_lat), (client_rps, client_lat) = best["bare"], best["client"]
    (b50, b99), (c50, c99) = percentiles(bare_lat), percentiles(client_lat)
    print(f"{n} requests, {concurrency} concurrent, 512-token prompts, 16 tokens out (best of {repeats})")
    print(
        f"  bare aiohttp POST loop: {bare_rps:8.0f} requests/s  p50 {b50 * 1e3:6.1f} ms  p99 {b99 * 1e3:6.1f} ms"
    )
    print(
        f"  SGLangEngine.generate:  {client_rps:8.0f} requests/s  p50 {c50 * 1e3:6.1f} ms  p99 {c99 * 1e3:6.1f} ms"
    )
    print(f"  added latency per call: p50 {(c50 - b50) * 1e3:+.1f} ms, p99 {(c99 - b99) * 1e3:+.1f} ms")
    print(f"ratio (SGLangEngine / bare, requests/s): {client_rps / bare_rps:.2f}  (goal >= 0.8)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4096)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = multiprocessing.get_context("spawn").Process(target=serve, args=(port,), daemon=True)
    process.start()
    url = f"http://127.0.0.1:{port}"
    try:
        import urllib.request

        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or not process.is_alive():
                    raise SystemExit("the server did not start") from None
                time.sleep(0.1)
        asyncio.run(bench(url, args.requests, args.concurrency, args.repeats))
    finally:
        process.terminate()
        process.join(10)


if __name__ == "__main__":
    main()
