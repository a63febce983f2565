"""swe-v0's costs: episode setup, grading, and building tasks, each against a baseline run here.

    .venv/bin/python benchmarks/swe.py [--sandbox local|docker] [--tasks 8] [--concurrency 8] [--build 4]

1. Episode setup (``reset``: a sandbox, the starting tree uploaded, the one-commit repository),
   p50/p95 over ``--tasks`` shipped train tasks, against a bare sandbox start on the same backend.
   Goal: at most 1.5 s p50 (with a warm pool).
2. Grading the gold patch of each task (a fresh sandbox, the full tree, the filtered patch applied,
   the graded tests with a junit report, swebench's report), p50/p95 and grades per minute at
   ``--concurrency`` at once; against the bare test run of the same ids in a sandbox that already
   holds the fixed tree (``python -m pytest -rA IDS``), one at a time. Goal: a grade at most 1.5x
   the bare run.
3. ``agentrl swe build`` time per validated task on toolz (``--build`` tasks; 0 skips it).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from agentrl.envs.swe import SweEnv, grading
from agentrl.envs.swe.tree import apply_patch, trees
from agentrl.sandbox import make_sandbox


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


async def setup_times(env: SweEnv, tasks, kind: str) -> tuple[list[float], list[float]]:
    resets, bare = [], []
    for task in tasks:
        t0 = time.perf_counter()
        await env.reset(task)
        resets.append(time.perf_counter() - t0)
        await env.close()
        t0 = time.perf_counter()
        config = {"image": env.row_of(task).image} if kind == "docker" else {}
        async with make_sandbox(kind, **config):
            bare.append(time.perf_counter() - t0)
    return resets, bare


async def bare_runs(env: SweEnv, rows, kind: str) -> list[float]:
    """The graded ids run alone in a sandbox that already holds the fixed tree."""
    times = []
    for row in rows:
        full, _ = trees(row)
        with tempfile.TemporaryDirectory() as tmp:
            fixed = Path(tmp) / "tree"
            shutil.copytree(full, fixed)
            apply_patch(fixed, row.patch, "gold")
            config = {"image": row.image} if kind == "docker" else {}
            async with make_sandbox(kind, **config) as sandbox:
                await sandbox.upload(str(fixed), sandbox.workdir)
                ids = " ".join(shlex.quote(t) for t in (*row.FAIL_TO_PASS, *row.PASS_TO_PASS))
                command = f"{grading.PYTHON_SHIM}; {grading.CLEAR_ENV}{row.test_cmd} {ids} > /dev/null 2>&1; echo $?"
                t0 = time.perf_counter()
                result = await sandbox.exec(command, timeout=900)
                times.append(time.perf_counter() - t0)
                if result.output.strip().splitlines()[-1] != "0":
                    raise RuntimeError(
                        f"{row.instance_id}: the gold tree's tests did not pass: {result.output[-300:]}"
                    )
    return times


async def grade_times(env: SweEnv, rows, concurrency: int) -> tuple[list[float], float]:
    gate = asyncio.Semaphore(concurrency)
    latencies = []

    async def one(row):
        async with gate:
            t0 = time.perf_counter()
            report = await env.grade_patch(row.patch, row=row)
            latencies.append(time.perf_counter() - t0)
            if not report["resolved"]:
                raise RuntimeError(f"{row.instance_id}: the gold patch did not resolve: {report}")

    t0 = time.perf_counter()
    await asyncio.gather(*(one(row) for row in rows))
    wall = time.perf_counter() - t0
    await env.close()
    return latencies, wall


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sandbox", default="local", choices=["local", "docker"])
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--build", type=int, default=4, help="tasks to build from toolz (0: skip)")
    args = parser.parse_args()
    env = SweEnv(sandbox=args.sandbox)
    tasks = env.tasks("train")[: args.tasks]
    rows = [env.row_of(t) for t in tasks]
    for row in rows:
        trees(row)  # the host-side cache, made once per task, is not what is measured
    resets, bare = asyncio.run(setup_times(env, tasks, args.sandbox))
    print(
        f"setup ({args.sandbox}, {len(tasks)} tasks): p50 {statistics.median(resets):.2f} s, p95 {pct(resets, 0.95):.2f} s; "
        f"a bare sandbox start p50 {statistics.median(bare):.2f} s "
        f"({statistics.median(resets) / statistics.median(bare):.2f}x)"
    )
    alone = asyncio.run(bare_runs(env, rows, args.sandbox))
    latencies, wall = asyncio.run(grade_times(env, rows, args.concurrency))
    print(
        f"grade ({args.concurrency} at once): p50 {statistics.median(latencies):.2f} s, p95 {pct(latencies, 0.95):.2f} s, "
        f"{60 * len(rows) / wall:.1f} grades/min; the bare test run alone p50 {statistics.median(alone):.2f} s; "
        f"grade / bare (one at a time would be lower) p50 {statistics.median(latencies) / statistics.median(alone):.2f}x"
    )
    latencies1, _ = asyncio.run(grade_times(SweEnv(sandbox=args.sandbox), rows, 1))
    print(
        f"grade (one at a time): p50 {statistics.median(latencies1):.2f} s; "
        f"grade / bare test run p50 {statistics.median(latencies1) / statistics.median(alone):.2f}x (goal <= 1.5x)"
    )
    if args.build:
        from agentrl.envs.swe.build import build

        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            built = build(
                Path(__file__).resolve().parents[1] / "envs/swe/sources/toolz-1.2.0.tar.gz",
                "toolz",
                "1.2.0",
                out_dir=Path(out),
                max_tasks=args.build,
                sandboxes=(args.sandbox,),
                log=lambda _: None,
            )
            spent = time.perf_counter() - t0
        print(
            f"build: {len(built)} validated toolz tasks in {spent:.0f} s, {spent / max(len(built), 1):.1f} s per task"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
