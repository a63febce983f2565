"""``agentrl swe``: check a task set (``validate``) and grade predictions in swebench's format
(``grade``). Added to the ``agentrl`` command through the ``agentrl.commands`` entry point."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

from agentrl.envs.swe import grading
from agentrl.envs.swe.rows import RowError, SweRow


def add_commands(commands) -> None:
    swe = commands.add_parser("swe", help="swe-v0 task sets: build, validate, grade predictions")
    actions = swe.add_subparsers(dest="swe_command", metavar="ACTION", required=True)
    validate = actions.add_parser(
        "validate", help="per row: gold resolves, an empty patch does not, a conftest tamper does not"
    )
    validate.add_argument("path", help="a .jsonl or .parquet file of swe-v0 rows")
    validate.add_argument(
        "--sample", type=_at_least(0), default=0, help="rows to check, spread over the repos (0: all)"
    )
    validate.add_argument("--sandbox", choices=["auto", "docker", "local"], default="auto")
    validate.add_argument("--concurrency", type=_at_least(1), default=2)
    validate.set_defaults(func=_validate)
    build = actions.add_parser(
        "build", help="build tasks from a released sdist by injecting one bug at a time"
    )
    build.add_argument("--package", required=True, help="NAME==VERSION, e.g. toolz==1.2.0")
    build.add_argument(
        "--sdist",
        default=None,
        help="the archive (default: envs/swe/sources/NAME-VERSION.tar.gz, as shipped)",
    )
    build.add_argument("--max-tasks", type=int, default=25)
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--split", default="train")
    build.add_argument(
        "--hints",
        type=int,
        choices=[0, 1, 2],
        default=1,
        help="where the problem statement says to look: 0 nowhere, 1 the function, 2 its file too",
    )
    build.add_argument(
        "--sandbox",
        nargs="+",
        default=["auto"],
        choices=["auto", "docker", "local"],
        help="backends whose pristine runs must all pass a test, and where each row is validated (the first runs the mutants)",
    )
    build.add_argument("--out", required=True, help="folder; the rows go to OUT/tasks.jsonl")
    build.set_defaults(func=_build)
    grade = actions.add_parser(
        "grade", help="grade predictions (instance_id, model_name_or_path, model_patch)"
    )
    grade.add_argument("path", help="the task rows")
    grade.add_argument(
        "--predictions",
        required=True,
        help="swebench-format predictions: JSON lines, or a JSON list",
    )
    grade.add_argument("--report", default=None, help="write {instance_id: report} here as JSON")
    grade.add_argument("--sandbox", choices=["auto", "docker", "local"], default="auto")
    grade.add_argument("--concurrency", type=_at_least(1), default=2)
    grade.set_defaults(func=_grade)


def _at_least(low: int):
    """An argparse type: an integer no smaller than ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}; pass {low} or more")
        return value

    return parse


def read_predictions(path: str, rows: dict[str, SweRow], tasks: str) -> list[tuple[SweRow, str]]:
    """``(row, model_patch)`` per prediction of a JSON-lines file or a JSON list (swebench takes
    both), each checked before any sandbox starts; a ``ValueError`` names the bad one."""
    file = Path(path)
    if not file.is_file():
        what = "is a directory" if file.is_dir() else "does not exist"
        raise ValueError(f"--predictions {path} {what}; pass a JSON-lines file of predictions")
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--predictions {path} cannot be read ({e})") from None
    if text.lstrip().startswith("["):
        try:
            items = list(enumerate(json.loads(text)))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a JSON list of predictions ({e})") from None
        where = "item"
    else:
        items, where = [], "line"
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    items.append((n, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not a line of JSON ({e})") from None
    jobs, seen = [], {}
    for n, prediction in items:
        at = f"{path}: {where} {n}"
        if not isinstance(prediction, dict) or not {"instance_id", "model_patch"} <= prediction.keys():
            raise ValueError(
                f"{at}: not a prediction with instance_id and model_patch; got {prediction!r:.200}"
            )
        instance, patch = prediction["instance_id"], prediction["model_patch"]
        if not isinstance(instance, str) or instance not in rows:
            raise ValueError(f"{at}: instance_id {instance!r} is not a row of {tasks}")
        if patch is not None and not isinstance(patch, str):
            raise ValueError(
                f"{at} ({instance}): field 'model_patch' must be a string (a diff, or empty); "
                f"got {type(patch).__name__}"
            )
        if instance in seen:
            raise ValueError(
                f"{at}: instance_id {instance!r} is predicted again ({where} {seen[instance]} has it); "
                "keep one prediction per instance"
            )
        seen[instance] = n
        jobs.append((rows[instance], patch or ""))
    if not jobs:
        raise ValueError(f"--predictions {path} holds no predictions")
    return jobs


def _check_writable(path: str) -> None:
    """Stop before grading if the report could not be written after it."""
    file = Path(path)
    folder = file.parent
    if file.is_dir():
        raise ValueError(f"--report {path} is a directory; pass a file path such as {file / 'report.json'}")
    if not folder.is_dir():
        raise ValueError(f"--report {path}: the directory {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK | os.X_OK) or (file.exists() and not os.access(file, os.W_OK)):
        raise ValueError(f"--report {path} is not writable here; pass a path you can write")


def sample(rows: list[SweRow], n: int) -> list[SweRow]:
    """``n`` rows spread over the repos: round-robin over them, each repo's rows in file order."""
    if n <= 0 or n >= len(rows):
        return rows
    by_repo: dict[str, list[SweRow]] = defaultdict(list)
    for row in rows:
        by_repo[row.repo].append(row)
    picked, queues = [], [list(v) for _, v in sorted(by_repo.items())]
    while len(picked) < n:
        for queue in queues:
            if queue and len(picked) < n:
                picked.append(queue.pop(0))
    return picked


async def _grade_all(env, jobs: list[tuple[SweRow, str]], concurrency: int) -> list[dict]:
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(row: SweRow, patch: str) -> dict:
        async with gate:
            try:
                report = await env.grade_patch(patch, row=row)
            except (RowError, RuntimeError, OSError) as e:
                report = {"instance_id": row.instance_id, "resolved": False, "reward": 0.0, "error": str(e)}
            return report

    try:
        return await asyncio.gather(*(one(row, patch) for row, patch in jobs))
    finally:
        await env.close()


def _env(path: str, sandbox: str):
    from agentrl.envs.swe import SweEnv

    return SweEnv(sandbox=sandbox, tasks=path)


def _validate(args: argparse.Namespace) -> int:
    try:
        env = _env(args.path, args.sandbox)
    except RowError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = sample(list(env.rows.values()), args.sample)
    checks = {row.instance_id: grading.validation_checks(row) for row in rows}
    jobs = [(graded, patch) for row in rows for _, graded, patch, _ in checks[row.instance_id]]
    reports = asyncio.run(_grade_all(env, jobs, args.concurrency))
    first = checks[rows[0].instance_id] if rows else []
    mismatches, n = 0, len(first)
    names = [name for name, *_ in first]
    print(f"| instance | {' | '.join(names)} | ok |\n|{'---|' * (n + 2)}")
    for i, row in enumerate(rows):
        got = [reports[n * i + k]["resolved"] for k in range(n)]
        ok = got == [want for *_, want in checks[row.instance_id]]
        mismatches += not ok
        cells = " | ".join("resolved" if g else "not resolved" for g in got)
        print(f"| {row.instance_id} | {cells} | {'yes' if ok else 'NO'} |")
        if not ok:
            for (name, *_), report in zip(checks[row.instance_id], reports[n * i : n * i + n], strict=True):
                if "error" in report:
                    print(f"    {name}: {report['error'][:300]}", file=sys.stderr)
    print(f"{len(rows) - mismatches} of {len(rows)} rows as expected")
    return 1 if mismatches else 0


def _grade(args: argparse.Namespace) -> int:
    try:
        env = _env(args.path, args.sandbox)
    except RowError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        jobs = read_predictions(args.predictions, env.rows, args.path)
        if args.report:
            _check_writable(args.report)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    reports = asyncio.run(_grade_all(env, jobs, args.concurrency))
    print(
        "| instance | resolved | F2P passed | P2P passed | applied by | dropped |\n|---|---|---|---|---|---|"
    )
    out = {}
    for (row, _), report in zip(jobs, reports, strict=True):
        status = report.get("tests_status", {})
        f2p = len(status.get("FAIL_TO_PASS", {}).get("success", []))
        p2p = len(status.get("PASS_TO_PASS", {}).get("success", []))
        print(
            f"| {row.instance_id} | {report['resolved']} | {f2p}/{len(row.FAIL_TO_PASS)} | "
            f"{p2p}/{len(row.PASS_TO_PASS)} | {report.get('apply_method')} | {len(report.get('dropped_paths', []))} |"
        )
        out[row.instance_id] = {
            k: report.get(k)
            for k in ("resolved", "tests_status", "dropped_paths", "apply_method", "error")
            if k in report
        }
    resolved = sum(r["resolved"] for r in reports)
    print(f"resolved {resolved} of {len(reports)}")
    if args.report:
        try:
            Path(args.report).write_text(json.dumps(out, indent=2))
        except OSError as e:  # checked before grading, so rare: keep the reports on stdout
            print(json.dumps(out, indent=2))
            print(
                f"error: --report {args.report} cannot be written ({e}); the reports are above",
                file=sys.stderr,
            )
            return 2
    return 0


def _build(args: argparse.Namespace) -> int:
    from agentrl.envs.swe.build import build, write

    name, _, version = args.package.partition("==")
    if not name or not version:
        print(f"error: --package {args.package!r} must be NAME==VERSION, e.g. toolz==1.2.0", file=sys.stderr)
        return 2
    shipped = Path(__file__).parent / "sources"
    sdist = (
        Path(args.sdist)
        if args.sdist
        else next(
            (
                p
                for p in sorted(shipped.glob("*.tar.gz"))
                if p.name.lower().replace("_", "-") == f"{name}-{version}.tar.gz".lower().replace("_", "-")
            ),
            None,
        )
    )
    if sdist is None or not sdist.is_file():
        print(
            f"error: no sdist of {args.package} (looked in {shipped}); download one with "
            f"`pip download --no-deps --no-binary :all: {args.package}` and pass --sdist PATH",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    rows = build(
        sdist.resolve(),
        name,
        version,
        out_dir=out.resolve(),
        max_tasks=args.max_tasks,
        seed=args.seed,
        split=args.split,
        sandboxes=args.sandbox,
        hints=args.hints,
    )
    write(rows, out / "tasks.jsonl")
    print(
        f"{len(rows)} tasks of {args.package} in {out / 'tasks.jsonl'}; check them with `agentrl swe validate`"
    )
    return 0 if rows else 1
