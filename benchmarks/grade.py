"""bugfix-v0 grading: what grading in a fresh sandbox costs, against the grader run alone, per grader.

    .venv/bin/python benchmarks/grade.py [--tasks 8] [--sandbox local|docker]

For each task and grader (pytest, and the plain-Python one the quickstart uses), with the expert's
fix written into the episode's sandbox and without it:

- baseline: the grader's command alone, run in the episode's own sandbox (what grading cost when it
  ran there, before it moved to a fresh sandbox);
- fresh: ``env.grade()``: the workspace's diff, a fresh sandbox with the task's files, the filtered
  patch applied, the grader with a cleared environment.

Both must give the expected verdicts (1 with the fix, 0 without). Prints the medians, their ratio
and the seconds a fresh sandbox adds per graded episode; passes are interleaved.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from agentrl.env import make


async def grade_times(grader: str, sandbox: str, n: int) -> dict[str, list[float]]:
    env = make("bugfix-v0", sandbox=sandbox, n_modules=1, n_distractors=0, grader=grader)
    seconds: dict[str, list[float]] = {"baseline": [], "fresh": []}
    try:
        for task in env.tasks("train")[:n]:
            await env.reset(task)
            for fixed in (False, True):
                if fixed:
                    fix = env.spec.fix
                    source = env.spec.files[fix["path"]]
                    await env.sandbox.write_file(fix["path"], source.replace(fix["old"], fix["new"]))
                t = time.perf_counter()
                reward, _ = await env._run_grader(env.sandbox)
                seconds["baseline"].append(time.perf_counter() - t)
                t = time.perf_counter()
                fresh = await env.grade()
                seconds["fresh"].append(time.perf_counter() - t)
                if (reward, fresh) != (float(fixed), float(fixed)):
                    raise SystemExit(
                        f"{task.id} ({grader}, {'fixed' if fixed else 'unfixed'}): the grader alone gave "
                        f"{reward}, the fresh sandbox {fresh}; expected {float(fixed)}"
                    )
    finally:
        await env.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--sandbox", default="local", choices=["local", "docker"])
    args = parser.parse_args()
    results: dict[str, dict[str, list[float]]] = {}
    for grader in ("pytest", "python", "pytest", "python"):  # interleaved
        for kind, values in asyncio.run(grade_times(grader, args.sandbox, args.tasks)).items():
            results.setdefault(grader, {}).setdefault(kind, []).extend(values)
    for grader, times in results.items():
        base, fresh = statistics.median(times["baseline"]), statistics.median(times["fresh"])
        print(
            f"grade ({args.sandbox} sandbox, {grader} grader, {len(times['fresh'])} grades): "
            f"grader alone {base:.3f} s, in a fresh sandbox {fresh:.3f} s (medians); "
            f"ratio {fresh / base:.2f}x, +{fresh - base:.3f} s per graded episode"
        )


if __name__ == "__main__":
    main()
