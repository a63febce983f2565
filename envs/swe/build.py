"""Building ``swe-v0`` tasks from a released sdist: inject one bug with an AST transform
(``mutate.py``), keep it when tests that passed now fail.

For one package, in a sandbox of each backend asked for (``sandboxes``; the first one runs the
mutants): unpack the sdist, run its suite 3 times in every backend and keep the tests that passed
every time (ids with spaces dropped: swebench's parser cuts ids there); then, one function at a time
in a deterministic order, write a mutant into the sandbox, run the suite, and keep the mutant when
1 <= |FAIL_TO_PASS| <= 50, FAIL_TO_PASS is at most ``max_f2p_share`` of the suite and PASS_TO_PASS
is not empty; duplicates (the same failing set) are dropped. The row's ``bug_patch`` is the
mutant's diff, the gold ``patch`` its reverse, ``hidden_tests`` the test files that hold a
FAIL_TO_PASS test, and the problem statement a template: the failing behaviour, a failing test's
name and its assertion from the buggy run, never the fix. Last, each row is graded as
``agentrl swe validate`` does (gold resolves, an empty patch does not) in a fresh sandbox of every
backend; a row that fails is dropped. The same sdist, seed and backends give the same rows.
"""

from __future__ import annotations

import asyncio
import difflib
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from agentrl.envs.swe import grading
from agentrl.envs.swe.mutate import mutants
from agentrl.envs.swe.rows import RowError, parse_row
from agentrl.envs.swe.tree import _clean, apply_patch, trees, unpack_sdist
from agentrl.sandbox import make_sandbox, resolve_kind

IMAGE = "agentrl/base:bookworm"
ROW_TEST_CMD = 'python -m pytest -rA --tb=no -p no:cacheprovider -o addopts=""'
STATUS = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED) (\S+)", re.MULTILINE)
SUITE_TIMEOUT = 600.0  # a pristine run
# A mutant's run is stopped after this many times the slowest pristine run (at least
# MUTANT_TIMEOUT_MIN s): a mutant that loops forever (a broken loop condition) would otherwise hold
# the build for SUITE_TIMEOUT each time.
MUTANT_TIMEOUT_FACTOR, MUTANT_TIMEOUT_MIN = 10.0, 60.0


def parse_statuses(output: str) -> dict[str, str]:
    """{node id: status} from a ``-rA`` report; a test reported failed once stays failed (a failing
    subtest is reported before its test's own PASSED line)."""
    statuses: dict[str, str] = {}
    for status, test in STATUS.findall(output):
        if "[" in test and not test.endswith("]"):
            continue  # a parametrized id with a space, cut there: swebench's parser cuts it too
        if statuses.get(test) not in ("FAILED", "ERROR"):
            statuses[test] = status
    return statuses


class Suite:
    """A sandbox holding a pristine tree, where the suite runs with one file replaced at a time."""

    def __init__(self, kind: str, root: Path, test_cmd: str):
        self.kind, self.root, self.test_cmd = kind, root, test_cmd
        self.timeout, self.slowest = SUITE_TIMEOUT, 0.0  # the slowest run so far, in seconds
        config = {"image": IMAGE} if kind == "docker" else {}
        self.sandbox = make_sandbox(kind, **config)

    async def __aenter__(self) -> Suite:
        await self.sandbox.start()
        await self.sandbox.upload(str(self.root), self.sandbox.workdir)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.sandbox.close()

    async def run(
        self, replace: dict[str, str] | None = None, ids: Sequence[str] = ()
    ) -> tuple[dict[str, str], str]:
        replace = replace or {}
        selected = " ".join(shlex.quote(t) for t in ids)
        for rel, text in replace.items():
            await self.sandbox.write_file(rel, text)
        try:
            command = (
                f"find . -name __pycache__ -prune -exec rm -rf {{}} +; {grading.PYTHON_SHIM}; "
                f"{grading.CLEAR_ENV}{self.test_cmd.replace('--tb=no', '--tb=short')} {selected} 2>&1"
            )
            started = time.monotonic()
            result = await self.sandbox.exec(command, timeout=self.timeout, output_cap=64 * 2**20)
            self.slowest = max(self.slowest, time.monotonic() - started)
        finally:
            for rel in replace:
                await self.sandbox.write_file(rel, (self.root / rel).read_text())
        if result.timed_out:
            return {}, "timeout"
        return parse_statuses(result.output), result.output


NOT_FOUND = re.compile(r"^ERROR: not found: (\S+)", re.MULTILINE)


async def selectable(suite: Suite, ids: set[str]) -> set[str]:
    """The ids of ``ids`` that pass when they are named on the command line, as grading names them
    (a test a whole-suite run reports may not be found by its id: pytest then runs nothing)."""
    ids = set(ids)
    for _ in range(5):
        statuses, output = await suite.run(ids=sorted(ids))
        reported = NOT_FOUND.findall(output)
        missing = {
            t for t in ids if any(m.endswith("/" + t) or m.endswith("/" + t.split("[")[0]) for m in reported)
        }
        if not reported:
            return {t for t in ids if statuses.get(t) == "PASSED"}
        if not missing:
            break  # an id pytest cannot find that is none of ours: nothing can be kept
        ids -= missing
    return set()


def _diff(path: str, before: str, after: str) -> str:
    lines = difflib.unified_diff(
        before.splitlines(keepends=True), after.splitlines(keepends=True), f"a/{path}", f"b/{path}"
    )
    return f"diff --git a/{path} b/{path}\n" + "".join(lines)


def _assertion(output: str, test: str) -> str:
    """The ``E`` lines of ``test``'s failure in a ``--tb=short`` report (at most 6)."""
    name = test.split("::")[-1]
    blocks = re.split(r"^_{3,} (.+?) _{3,}$", output, flags=re.MULTILINE)
    for title, body in zip(blocks[1::2], blocks[2::2], strict=False):
        if title.split(".")[-1].split("::")[-1] == name or title.endswith(name):
            lines = [line[4:].rstrip() for line in body.splitlines() if line.startswith("E   ")]
            return "\n".join(lines[:6])
    return ""


HINT_LEVELS = (0, 1, 2)


def problem_statement(
    package: str, function: str, test: str, assertion: str, n_failing: int, hints: int = 1, file: str = ""
) -> str:
    """The issue text: what fails and a failing test's assertion, never the fix. ``hints`` says
    where to look: 0 nothing beyond the package, 1 the function (the default), 2 the function and
    its file."""
    if hints not in HINT_LEVELS:
        raise ValueError(
            f"hints must be one of {HINT_LEVELS} (0: no location, 1: function, 2: file too); got {hints!r}"
        )
    where = function.split(".<locals>")[0]
    plural = n_failing != 1
    around = ""
    if hints >= 1:
        around = f" around `{where}`" + (f" in `{file}`" if hints >= 2 and file else "")
    text = (
        f"Something in `{package}`{around} no longer behaves as documented. "
        f"{n_failing} test{'s' if plural else ''} of the project's suite fail{'' if plural else 's'}, "
        f"for example `{test}`"
    )
    text += f":\n\n```\n{assertion}\n```\n" if assertion else ".\n"
    return text + "\nFind the cause in the library's source and fix it."


def _source_files(root: Path) -> list[Path]:
    files = []
    for d in grading.source_dirs(root):
        for p in sorted((root / d).rglob("*.py")) if (root / d).is_dir() else [root / d]:
            parts = p.relative_to(root).parts
            if not set(parts) & {"tests", "test", "testing"} and not parts[-1].startswith("test"):
                files.append(p)
    return files


async def _validated(rows: list[dict], base: Path, kinds: Sequence[str], log) -> list[dict]:
    """The rows that pass ``grading.validation_checks`` in a fresh sandbox of each kind."""
    kept = []
    for raw in rows:
        row = parse_row(raw, base)
        full, _ = trees(row)
        ok = True
        for kind in kinds:
            for name, graded, patch, want in grading.validation_checks(row):
                config = {"image": row.image} if kind == "docker" else {}
                async with make_sandbox(kind, **config) as sandbox:
                    report = await grading.grade(sandbox, graded, full, patch)
                if report["resolved"] != want:
                    ok = False
                    why = report.get("error") or report.get("junit_disagrees") or report.get("log_tail", "")
                    log(f"  {row.instance_id}: dropped, {name} in {kind}: {str(why)[-800:]}")
                    break
            if not ok:
                break
        if ok:
            kept.append(raw)
    return kept


async def build_async(
    sdist: Path,
    package: str,
    version: str,
    *,
    out_dir: Path,
    sandboxes: Sequence[str] = ("auto",),
    max_tasks: int = 25,
    seed: int = 0,
    split: str = "train",
    max_f2p: int = 50,
    max_f2p_share: float = 0.2,
    max_tries: int = 400,
    test_args: str = "",
    per_function: int = 1,
    hints: int = 1,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """``test_args``: pytest arguments every run of the suite needs (they go into the rows' test_cmd);
    ``hints``: how much the problem statements say about where the bug is (``problem_statement``)."""
    if hints not in HINT_LEVELS:
        raise ValueError(f"hints must be one of {HINT_LEVELS}; got {hints!r}")
    kinds = list(dict.fromkeys(resolve_kind(k) for k in sandboxes))
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="agentrl-swe-build-") as tmp:
        root = unpack_sdist(sdist, Path(tmp) / "x")
        _clean(root)
        # A src layout's package is found through PYTHONPATH: pytest's own `-o pythonpath=src` needs
        # an ini file before pytest 7.3 (Debian bookworm's 7.2 fails with an AssertionError without one).
        test_cmd = ("PYTHONPATH=src " if (root / "src").is_dir() else "") + ROW_TEST_CMD
        test_cmd += f" {test_args}" if test_args else ""
        stable: set[str] | None = None
        for kind in reversed(kinds):  # the first kind's sandbox stays open for the mutants
            suite = Suite(kind, root, test_cmd)
            await suite.__aenter__()
            try:
                for _ in range(3):
                    statuses, _ = await suite.run()
                    passed = {t for t, s in statuses.items() if s == "PASSED" and " " not in t}
                    stable = passed if stable is None else stable & passed
            finally:
                if kind != kinds[0]:
                    await suite.__aexit__()
        stable = await selectable(suite, stable) if stable else stable
        suite.timeout = min(SUITE_TIMEOUT, max(MUTANT_TIMEOUT_MIN, MUTANT_TIMEOUT_FACTOR * suite.slowest))
        log(f"{package} {version}: {len(stable)} tests pass 3 times of 3 in {', '.join(kinds)}, and by id")
        try:
            if not stable:
                raise RuntimeError(
                    f"{package}: no test passes in the pristine tree; can pytest run its suite?"
                )
            candidates = []
            for path in _source_files(root):
                rel = path.relative_to(root).as_posix()
                candidates += [
                    (rel, m) for m in mutants(rel, path.read_text(), seed=seed, max_per_function=per_function)
                ]
            random.Random(f"{seed}/{package}/{version}").shuffle(candidates)
            seen: set[frozenset[str]] = set()
            for tries, (rel, mutant) in enumerate(candidates):
                if len(rows) >= max_tasks or tries >= max_tries:
                    break
                statuses, output = await suite.run({rel: mutant.source})
                f2p = sorted(t for t in stable if statuses.get(t) != "PASSED")
                p2p = sorted(t for t in stable if statuses.get(t) == "PASSED")
                if not 1 <= len(f2p) <= max_f2p or len(f2p) > max_f2p_share * len(stable) or not p2p:
                    continue
                if frozenset(f2p) in seen or output == "timeout":
                    continue
                seen.add(frozenset(f2p))
                original = (root / rel).read_text()
                instance = f"pypi__{package}-{version}__{len(rows):04d}"
                rows.append(
                    {
                        "instance_id": instance,
                        "repo": f"pypi/{package}",
                        "version": version,
                        "problem_statement": problem_statement(
                            package,
                            mutant.function,
                            f2p[0],
                            _assertion(output, f2p[0]),
                            len(f2p),
                            hints=hints,
                            file=rel,
                        ),
                        "FAIL_TO_PASS": f2p,
                        "PASS_TO_PASS": p2p,
                        "patch": _diff(rel, mutant.source, original),
                        "test_patch": "",
                        "log_parser": "parse_log_pytest",
                        "eval_type": "pass_and_fail",
                        "image": IMAGE,
                        "test_cmd": test_cmd,
                        "source": {"sdist": os.path.relpath(sdist, out_dir), "sha256": digest},
                        "bug_patch": _diff(rel, original, mutant.source),
                        "hidden_tests": sorted({t.split("::")[0] for t in f2p}),
                        "split": split,
                        "created_by": {
                            "transform": mutant.transform,
                            "function": mutant.function,
                            "file": rel,
                            "lines": [mutant.lineno, mutant.end_lineno],
                        },
                    }
                )
                log(f"  {instance}: {mutant.description}; {len(f2p)} fail, {len(p2p)} pass")
        finally:
            await suite.__aexit__()
    kept = await _validated(rows, out_dir, kinds, log)
    for i, raw in enumerate(kept):  # numbered without gaps, in build order
        raw["instance_id"] = f"pypi__{package}-{version}__{i:04d}"
    return kept


def _apart(a: dict, b: dict) -> bool:
    """Two single-bug rows of the same file whose changed lines are at least 4 lines apart."""
    ca, cb = a["created_by"], b["created_by"]
    if "lines" not in ca or "lines" not in cb or ca["file"] != cb["file"]:
        return False
    (a0, a1), (b0, b1) = ca["lines"], cb["lines"]
    return a1 + 4 < b0 or b1 + 4 < a0


async def combine_async(
    rows: list[dict],
    sdist: Path,
    *,
    out_dir: Path,
    n: int = 3,
    sandboxes: Sequence[str] = ("auto",),
    max_f2p: int = 50,
    hints: int = 1,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Up to ``n`` harder tasks, each the bugs of two validated rows of one file at once (both fixes
    needed: undoing either bug leaves the other's failing tests). FAIL_TO_PASS and PASS_TO_PASS come
    from running the suite on the combined file; the rows are validated like single-bug ones."""
    kinds = list(dict.fromkeys(resolve_kind(k) for k in sandboxes))
    singles = [r for r in rows if "lines" in r.get("created_by", {})]
    pairs = [(a, b) for i, a in enumerate(singles) for b in singles[i + 1 :] if _apart(a, b)]
    if not pairs or n <= 0:
        return []
    first = singles[0]
    combined: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="agentrl-swe-combine-") as tmp:
        root = unpack_sdist(sdist, Path(tmp) / "x")
        _clean(root)
        async with Suite(kinds[0], root, first["test_cmd"]) as suite:
            stable = set(first["FAIL_TO_PASS"]) | set(first["PASS_TO_PASS"])
            for a, b in pairs:
                if len(combined) >= n:
                    break
                rel = a["created_by"]["file"]
                work = Path(tmp) / f"c{len(combined)}"
                shutil.copytree(root, work)
                try:
                    apply_patch(work, a["bug_patch"], "bug A")
                    apply_patch(work, b["bug_patch"], "bug B")
                except RowError:
                    continue
                original, both = (root / rel).read_text(), (work / rel).read_text()
                statuses, output = await suite.run({rel: both})
                f2p = sorted(t for t in stable if statuses.get(t) != "PASSED")
                p2p = sorted(t for t in stable if statuses.get(t) == "PASSED")
                needed = set(a["FAIL_TO_PASS"]) <= set(f2p) and set(b["FAIL_TO_PASS"]) <= set(f2p)
                if not needed or len(f2p) > max_f2p or not p2p:
                    continue
                package = a["repo"].split("/", 1)[1]
                shown = b["FAIL_TO_PASS"][0] if b["FAIL_TO_PASS"][0] != a["FAIL_TO_PASS"][0] else f2p[-1]
                where = f"{a['created_by']['function']} and {b['created_by']['function']}"
                combined.append(
                    {
                        **a,
                        "instance_id": f"{a['instance_id'].rsplit('__', 1)[0]}__c{len(combined):03d}",
                        "problem_statement": problem_statement(
                            package,
                            where,
                            a["FAIL_TO_PASS"][0],
                            _assertion(output, a["FAIL_TO_PASS"][0]),
                            len(f2p),
                            hints=hints,
                            file=a["created_by"]["file"],
                        ).replace("\nFind the cause", f"\n`{shown}` fails as well.\n\nFind the causes"),
                        "FAIL_TO_PASS": f2p,
                        "PASS_TO_PASS": p2p,
                        "patch": _diff(rel, both, original),
                        "bug_patch": _diff(rel, original, both),
                        "hidden_tests": sorted({t.split("::")[0] for t in f2p}),
                        "created_by": {"combined": [a["instance_id"], b["instance_id"]], "file": rel},
                    }
                )
                log(
                    f"  {combined[-1]['instance_id']}: bugs of {a['instance_id']} and {b['instance_id']}; {len(f2p)} fail"
                )
    return await _validated(combined, out_dir, kinds, log)


def combine(rows: list[dict], sdist: Path, **kwargs) -> list[dict]:
    return asyncio.run(combine_async(rows, sdist, **kwargs))


def build(sdist: Path, package: str, version: str, **kwargs) -> list[dict]:
    """Rows for ``package`` built from ``sdist`` (its path in the rows is relative to ``out_dir``)."""
    return asyncio.run(build_async(sdist, package, version, **kwargs))


def write(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
