"""Sandbox overheads on a real Docker engine, each as a ratio against a baseline measured in this run.

    .venv/bin/python benchmarks/sandbox.py          # needs a running dockerd and `agentrl sandbox build`

1. ``Sandbox.exec("true")`` (timeout, process-tree kill, OOM report, output cap) against the raw
   SDK ``container.exec_run("true")`` on the same container. Goal: at most 1.3x.
2. Warm-pool ``acquire()`` (a pre-started sandbox, reset after its last use) against a cold
   sandbox start (create + start + workspace setup). Goal: at least 5x faster.
3. 32 sandboxes running 20 commands each, all at once: throughput and p50/p99 latency, and how many
   commands did not come back (a sandbox given up for dead). ``--load-rounds N`` repeats this load N
   times more with fresh sandboxes and counts those commands only (a rare loss needs many commands).
4. ``--cancel-rounds N``: N rounds of 32 sandboxes each cancelling 20 commands (one with a background
   child) at a random point of their first 1.5 s, under that load: counts the cancels that left a
   runner, a process of the agent or an output file behind 5 s later, and the next commands that
   did not come back right. Goal: none.
5. ``--timeout-rounds N``: N rounds of 32 sandboxes each running 10 commands (with escaping
   background children) that reach a 1 s timeout: counts those that did not come back as a timeout
   (a runner that never returned makes the caller give its sandbox up for dead). Goal: none.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from agentrl.sandbox import SandboxPool, make_sandbox
from agentrl.sandboxes.docker import OUTPUT_DIR, RUNNER_PATH


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


async def exec_overhead(rounds: int = 60) -> tuple[float, float]:
    async with make_sandbox("docker") as sb:
        container = sb._client.containers.get(sb.container_id)
        ours, raw = [], []
        for _ in range(5):  # warm up both paths
            await sb.exec("true")
            container.exec_run("true", user="agent")
        for _ in range(rounds):  # interleaved, so drift hits both alike
            t = time.perf_counter()
            await sb.exec("true")
            ours.append(time.perf_counter() - t)
            t = time.perf_counter()
            container.exec_run("true", user="agent")
            raw.append(time.perf_counter() - t)
    return statistics.median(ours), statistics.median(raw)


async def pool_vs_cold(rounds: int = 10) -> tuple[float, float]:
    cold = []
    for _ in range(rounds):
        t = time.perf_counter()
        sb = make_sandbox("docker")
        await sb.start()
        cold.append(time.perf_counter() - t)
        await sb.close()
    warm = []
    async with SandboxPool("docker", size=2) as pool:
        for _ in range(rounds):
            t = time.perf_counter()
            sb = await pool.acquire()
            warm.append(time.perf_counter() - t)
            await sb.exec("echo used > used.txt")
            pool.release(sb)
            while pool._tasks:  # the reset happens after release, off the acquire path
                await asyncio.sleep(0.01)
        assert pool.stats["cold"] == 0
    return statistics.median(cold), statistics.median(warm)


async def load(n_sandboxes: int, n_commands: int, latencies: list[float]) -> tuple[list, int, float, float]:
    """``n_sandboxes`` fresh sandboxes run ``n_commands`` each at once. Returns the sandboxes (still
    running), how many commands did not come back with exit code 0, the start time and the wall time.
    A sandbox whose command is lost runs no more of them; its remaining commands count as lost."""
    lost = 0

    async def worker(sb):
        nonlocal lost
        for i in range(n_commands):
            t = time.perf_counter()
            r = await sb.exec(f"echo {i} && ls / > /dev/null", timeout=60)
            latencies.append(time.perf_counter() - t)
            if r.exit_code != 0 or r.output != f"{i}\n":
                print(f"  lost: sandbox {sb.container_id[:12]} command {i}: {r}", flush=True)
                lost += n_commands - i
                return

    sandboxes = [make_sandbox("docker", memory="256m") for _ in range(n_sandboxes)]
    t = time.perf_counter()
    await asyncio.gather(*(sb.start() for sb in sandboxes))
    started = time.perf_counter() - t
    t = time.perf_counter()
    try:
        await asyncio.gather(*(worker(sb) for sb in sandboxes))
    except BaseException:
        await asyncio.gather(*(sb.close() for sb in sandboxes))
        raise
    return sandboxes, lost, started, time.perf_counter() - t


async def concurrency(n_sandboxes: int = 32, n_commands: int = 20) -> dict[str, float]:
    latencies: list[float] = []
    sandboxes, lost, started, wall = await load(n_sandboxes, n_commands, latencies)
    try:
        # Baseline: the same load through the raw SDK's exec_run, on 32 threads.
        raw_latencies: list[float] = []

        def raw_worker(sb):
            container = sb._client.containers.get(sb.container_id)
            for i in range(n_commands):
                t0 = time.perf_counter()
                container.exec_run(["bash", "-c", f"echo {i} && ls / > /dev/null"], user="agent")
                raw_latencies.append(time.perf_counter() - t0)

        up = await asyncio.gather(*(sb.alive() for sb in sandboxes))
        alive = [sb for sb, ok in zip(sandboxes, up, strict=True) if ok]
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(n_sandboxes) as pool:
            t = time.perf_counter()
            await asyncio.gather(*(loop.run_in_executor(pool, raw_worker, sb) for sb in alive))
            raw_wall = time.perf_counter() - t
    finally:
        await asyncio.gather(*(sb.close() for sb in sandboxes))
    return {
        "lost": lost,
        "start_all_s": started,
        "wall_s": wall,
        "throughput": len(latencies) / wall,
        "p50": pct(latencies, 50),
        "p99": pct(latencies, 99),
        "raw_throughput": len(raw_latencies) / raw_wall,
        "raw_p50": pct(raw_latencies, 50),
        "raw_p99": pct(raw_latencies, 99),
    }


async def lost_commands(rounds: int, n_sandboxes: int = 32, n_commands: int = 20) -> int:
    lost = 0
    for k in range(rounds):
        sandboxes, lost_now, _, wall = await load(n_sandboxes, n_commands, [])
        await asyncio.gather(*(sb.close() for sb in sandboxes))
        lost += lost_now
        print(f"[load] round {k + 1} of {rounds}: {wall:.1f} s, commands lost so far {lost}", flush=True)
    return lost


async def in_rounds(label: str, rounds: int, n_sandboxes: int, worker, counts: dict[str, int]) -> None:
    """``rounds`` times: ``n_sandboxes`` fresh sandboxes run ``worker(sb)`` at once, then close."""
    for k in range(rounds):
        sandboxes = [make_sandbox("docker", memory="256m") for _ in range(n_sandboxes)]
        try:
            await asyncio.gather(*(sb.start() for sb in sandboxes))
            await asyncio.gather(*(worker(sb) for sb in sandboxes))
        finally:
            await asyncio.gather(*(sb.close() for sb in sandboxes))
        print(f"[{label}] round {k + 1} of {rounds}: {counts}", flush=True)


# runners, processes of the agent, output files
LEFT = f'pgrep -f "^bash {RUNNER_PATH}" | wc -l; pgrep -u "$1" | wc -l; ls {OUTPUT_DIR} | wc -l'


async def cancelled_commands(rounds: int, n_sandboxes: int = 32, n_cancels: int = 20) -> tuple[int, int, int]:
    """Returns (cancels, cancels that left something behind, next commands that went wrong)."""
    counts = {"cancels": 0, "left": 0, "bad": 0}
    rng = random.Random(0)

    async def worker(sb):
        uid, _ = await sb._user_ids(sb.config.user)
        for i in range(n_cancels):
            task = asyncio.ensure_future(sb.exec("(sleep 300 &); sleep 200", timeout=60))
            await asyncio.sleep(rng.uniform(0.0, 1.5))
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            counts["cancels"] += 1
            deadline = time.perf_counter() + 5
            while True:
                _, out = await sb._call(sb._control, LEFT, uid)
                if out.split() == ["0", "0", "0"]:
                    break
                if time.perf_counter() > deadline:
                    counts["left"] += 1
                    print(
                        f"  left behind in {sb.container_id[:12]} (runners, processes, files): {out.split()}"
                    )
                    await sb._call(
                        sb._control, f'pkill -KILL -u "$1"; pkill -KILL -f "^bash {RUNNER_PATH}"; true', uid
                    )
                    break
                await asyncio.sleep(0.2)
            r = await sb.exec(f"echo {i}", timeout=60)
            if r.output != f"{i}\n":
                counts["bad"] += 1
                print(f"  next command in {sb.container_id[:12]}: {r}")

    await in_rounds("cancel", rounds, n_sandboxes, worker, counts)
    return counts["cancels"], counts["left"], counts["bad"]


async def timed_out_commands(rounds: int, n_sandboxes: int = 32, n_commands: int = 10) -> tuple[int, int]:
    """Returns (commands, commands that did not come back as a timeout)."""
    counts = {"commands": 0, "wrong": 0}

    async def worker(sb):
        for _ in range(n_commands):
            r = await sb.exec("(sleep 300 &); setsid sleep 301 & sleep 200", timeout=1)
            counts["commands"] += 1
            if not r.timed_out or r.sandbox_died:
                counts["wrong"] += 1
                print(f"  not a timeout in {sb.container_id[:12]}: {r}")
                return

    await in_rounds("timeout", rounds, n_sandboxes, worker, counts)
    return counts["commands"], counts["wrong"]


async def main(load_rounds: int, cancel_rounds: int, timeout_rounds: int) -> int:
    ok = True
    ours, raw = await exec_overhead()
    ratio = ours / raw
    ok &= ratio <= 1.3
    print(
        f"[exec] Sandbox.exec('true') {ours * 1e3:.1f} ms vs raw exec_run('true') {raw * 1e3:.1f} ms (medians of 60)"
        f" -> {ratio:.2f}x (goal <= 1.3x: {'met' if ratio <= 1.3 else 'MISSED'})"
    )
    cold, warm = await pool_vs_cold()
    speedup = cold / warm
    ok &= speedup >= 5
    print(
        f"[pool] cold start {cold * 1e3:.0f} ms vs warm acquire {warm * 1e3:.2f} ms (medians of 10)"
        f" -> {speedup:.0f}x faster (goal >= 5x: {'met' if speedup >= 5 else 'MISSED'})"
    )
    c = await concurrency()
    print(
        f"[concurrency] 32 sandboxes x 20 commands: started in {c['start_all_s']:.1f} s; "
        f"{c['throughput']:.0f} commands/s over {c['wall_s']:.1f} s; latency p50 {c['p50'] * 1e3:.0f} ms, "
        f"p99 {c['p99'] * 1e3:.0f} ms\n              raw exec_run baseline, same load: {c['raw_throughput']:.0f} commands/s, "
        f"p50 {c['raw_p50'] * 1e3:.0f} ms, p99 {c['raw_p99'] * 1e3:.0f} ms -> throughput ratio "
        f"{c['throughput'] / c['raw_throughput']:.2f}; commands lost: {c['lost']} of 640"
    )
    if load_rounds:
        lost = await lost_commands(load_rounds)
        print(
            f"[load] {load_rounds} more rounds of 32 sandboxes x 20 commands: {lost} of {load_rounds * 640} lost"
        )
        ok &= lost == 0
    if cancel_rounds:
        n, left, bad = await cancelled_commands(cancel_rounds)
        print(
            f"[cancel] {n} commands cancelled under load: {left} left something behind, {bad} next "
            f"commands went wrong (goal: none)"
        )
        ok &= left == 0 and bad == 0
    if timeout_rounds:
        n, wrong = await timed_out_commands(timeout_rounds)
        print(
            f"[timeout] {n} commands timed out under load: {wrong} did not come back as a timeout (goal: none)"
        )
        ok &= wrong == 0
    ok &= c["lost"] == 0
    print("all goals met" if ok else "some goals MISSED")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--load-rounds", type=int, default=0, help="more rounds of part 3, counting lost commands"
    )
    parser.add_argument(
        "--cancel-rounds", type=int, default=0, help="rounds of part 4, counting cancels that left something"
    )
    parser.add_argument(
        "--timeout-rounds", type=int, default=0, help="rounds of part 5, counting timeouts that went wrong"
    )
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.load_rounds, args.cancel_rounds, args.timeout_rounds)))
