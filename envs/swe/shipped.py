"""The shipped task set (``envs/swe/tasks/tasks.jsonl``): which packages, in which split, and how it
is rebuilt. Held-out success measures transfer: the ``test`` split's packages are not in ``train``.

    .venv/bin/python -m agentrl.envs.swe.shipped [--only toolz] [--sandbox local docker] [--out PATH]

rebuilds it from the sdists vendored in ``envs/swe/sources/`` (each with its license); the same
sdists, seed and backends give the same rows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from agentrl.envs.swe.build import build, combine, write

HERE = Path(__file__).parent
TASKS = HERE / "tasks" / "tasks.jsonl"
# (name, version, archive, split, extra pytest arguments for every run of its suite)
PACKAGES = (
    ("boltons", "26.2.0", "boltons-26.2.0.tar.gz", "train", ""),
    ("toolz", "1.2.0", "toolz-1.2.0.tar.gz", "train", ""),
    ("cachetools", "8.0.2", "cachetools-8.0.2.tar.gz", "train", ""),
    ("more-itertools", "11.2.1", "more_itertools-11.2.1.tar.gz", "train", ""),
    # click: its stress tests are 31k repetitions; test_deprecations.py reads the installed
    # distribution's metadata, which a source tree run from src/ does not have
    ("click", "8.5.1", "click-8.5.1.tar.gz", "train", "-m 'not stress' --ignore=tests/test_deprecations.py"),
    ("parse", "1.22.4", "parse-1.22.4.tar.gz", "test", ""),
    ("tabulate", "0.10.0", "tabulate-0.10.0.tar.gz", "test", ""),
    ("voluptuous", "0.16.0", "voluptuous-0.16.0.tar.gz", "test", ""),
)

PER_FUNCTION = {"parse": 2}
"""Mutants tried per function where one each is not enough for 25 tasks (parse is one module)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only", nargs="*", default=None, help="rebuild these packages, keep the others' rows"
    )
    parser.add_argument("--max-tasks", type=int, default=25)
    parser.add_argument("--combined", type=int, default=2, help="two-bug tasks per package")
    parser.add_argument(
        "--sandbox", nargs="+", default=["local", "docker"], choices=["auto", "docker", "local"]
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=TASKS,
        help="write the rows here (default: the shipped file); keep it in envs/swe/tasks/, as the rows' "
        "sdist paths are relative to it",
    )
    args = parser.parse_args(argv)
    out = args.out.resolve()
    old = [json.loads(line) for line in TASKS.read_text().splitlines()] if TASKS.exists() else []
    rows = []

    def old_rows(name: str) -> list[dict]:
        return [r for r in old if r["repo"] == f"pypi/{name}"]

    for i, (name, version, archive, split, extra) in enumerate(PACKAGES):
        if args.only is not None and name not in args.only:
            rows += old_rows(name)
            continue
        singles = build(
            HERE / "sources" / archive,
            name,
            version,
            out_dir=out.parent,
            max_tasks=args.max_tasks,
            split=split,
            sandboxes=args.sandbox,
            test_args=extra,
            per_function=PER_FUNCTION.get(name, 1),
        )
        # and a few harder tasks: two of those bugs in one file at once
        both = combine(
            singles, HERE / "sources" / archive, out_dir=out.parent, n=args.combined, sandboxes=args.sandbox
        )
        rows += singles + both
        # after each package, so that a long rebuild cut short keeps what it has done
        write(rows + [r for later in PACKAGES[i + 1 :] for r in old_rows(later[0])], out)
    write(rows, out)
    counts = {name: sum(r["repo"] == f"pypi/{name}" for r in rows) for name, *_ in PACKAGES}
    print(f"{len(rows)} tasks in {out}: {counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
