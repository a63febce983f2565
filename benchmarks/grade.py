"""bugfix-v0 grading: the plain-Python grader against pytest, on the same tasks in the same run.

    .venv/bin/python benchmarks/grade.py [--tasks 8] [--sandbox local|docker]

Each task is reset once per grader and graded with the expert's fix applied (reward 1) and without
it (reward 0); both graders must agree on every verdict. Prints seconds per grade for each and the
ratio pytest / python (the baseline is pytest, the grader bugfix-v0 uses by default).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from agentrl.env import make


async def grade_times(grader: str, sandbox: str, n: int) -> tuple[list[float], list[float]]:
    env = make("bugfix-v0", sandbox=sandbox, n_modules=1, n_distractors=0, grader=grader)
    seconds, verdicts = [], []
    try:
        for task in env.tasks("train", n):
            await env.reset(task)
            verdicts.append(await _timed(env, seconds))
            fix = env.spec.fix
            source = env.spec.files[fix["path"]]
            await env.sandbox.write_file(fix["path"], source.replace(fix["old"], fix["new"]))
            verdicts.append(await _timed(env, seconds))
    finally:
        await env.close()
    return seconds, verdicts


async def _timed(env, seconds: list[float]) -> float:
    t = time.perf_counter()
    reward = await env.grade()
    seconds.append(time.perf_counter() - t)
    return reward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--sandbox", default="local", choices=["local", "docker"])
    args = parser.parse_args()
    results = {}
    for grader in ("pytest", "python", "pytest", "python"):  # interleaved
        seconds, verdicts = asyncio.run(grade_times(grader, args.sandbox, args.tasks))
        prev = results.setdefault(grader, ([], verdicts))
        prev[0].extend(seconds)
        if prev[1] != verdicts:
            raise SystemExit(f"{grader} gave different verdicts on two passes: {prev[1]} vs {verdicts}")
    if results["pytest"][1] != results["python"][1]:
        raise SystemExit(
            f"the graders disagree: pytest {results['pytest'][1]}, python {results['python'][1]}"
        )
    assert results["python"][1] == [0.0, 1.0] * args.tasks, results["python"][1]
    base = statistics.median(results["pytest"][0])
    fast = statistics.median(results["python"][0])
    print(
        f"grade ({args.sandbox} sandbox, {2 * args.tasks} grades x 2 passes each): "
        f"pytest {base:.3f} s, python {fast:.3f} s (medians); ratio {base / fast:.2f}x; verdicts agree"
    )


if __name__ == "__main__":
    main()
