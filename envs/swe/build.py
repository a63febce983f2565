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
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from agentrl.envs.swe import grading
from agentrl.envs.swe.mutate import mutants
from agentrl.envs.swe.rows import parse_row
from agentrl.envs.swe.tree import _clean, trees, unpack_sdist
from agentrl.sandbox import make_sandbox, resolve_kind

IMAGE = "agentrl/base:bookworm"
ROW_TEST_CMD = 'python -m pytest -rA --tb=no -p no:cacheprovider -o addopts=""'
STATUS = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED) (\S+)", re.MULTILINE)
SUITE_TIMEOUT = 600.0


def parse_statuses(output: str) -> dict[str, str]:
    """{node id: status} from a ``-rA`` report; a test reported failed once stays failed (a failing
    subtest is reported before its test's own PASSED line)."""
    statuses: dict[str, str] = {}
    for status, test in STATUS.findall(output):
        if statuses.get(test) not in ("FAILED", "ERROR"):
            statuses[test] = status
    return statuses


class Suite:
    """A sandbox holding a pristine tree, where the suite runs with one file replaced at a time."""

    def __init__(self, kind: str, root: Path, test_cmd: str):
        self.kind, self.root, self.test_cmd = kind, root, test_cmd
        config = {"image": IMAGE} if kind == "docker" else {}
        self.sandbox = make_sandbox(kind, **config)

    async def __aenter__(self) -> Suite:
        await self.sandbox.start()
        await self.sandbox.upload(str(self.root), self.sandbox.workdir)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.sandbox.close()

    async def run(self, replace: dict[str, str] | None = None) -> tuple[dict[str, str], str]:
        replace = replace or {}
        for rel, text in replace.items():
            await self.sandbox.write_file(rel, text)
        try:
            command = (
                f"find . -name __pycache__ -prune -exec rm -rf {{}} +; {grading.PYTHON_SHIM}; "
                f"{grading.CLEAR_ENV}{self.test_cmd.replace('--tb=no', '--tb=short')} 2>&1"
            )
            result = await self.sandbox.exec(command, timeout=SUITE_TIMEOUT, output_cap=64 * 2**20)
        finally:
            for rel in replace:
                await self.sandbox.write_file(rel, (self.root / rel).read_text())
        if result.timed_out:
            return {}, "timeout"
        return parse_statuses(result.output), result.output


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


def problem_statement(package: str, function: str, test: str, assertion: str, n_failing: int) -> str:
    where = function.split(".<locals>")[0]
    plural = n_failing != 1
    text = (
        f"Something in `{package}` around `{where}` no longer behaves as documented. "
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
    """The rows whose gold resolves and whose empty patch does not, in a fresh sandbox of each kind."""
    kept = []
    for raw in rows:
        row = parse_row(raw, base)
        full, _ = trees(row)
        ok = True
        for kind in kinds:
            for patch, want in ((row.patch, True), ("", False)):
                config = {"image": row.image} if kind == "docker" else {}
                async with make_sandbox(kind, **config) as sandbox:
                    report = await grading.grade(sandbox, row, full, patch)
                if report["resolved"] != want:
                    ok = False
                    log(
                        f"  {row.instance_id}: dropped, {'gold' if want else 'empty patch'} in {kind}: {report.get('error') or report.get('tests_status')}"
                    )
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
    log: Callable[[str], None] = print,
) -> list[dict]:
    """``test_args``: pytest arguments every run of the suite needs (they go into the rows' test_cmd)."""
    kinds = list(dict.fromkeys(resolve_kind(k) for k in sandboxes))
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="agentrl-swe-build-") as tmp:
        root = unpack_sdist(sdist, Path(tmp) / "x")
        _clean(root)
        test_cmd = ROW_TEST_CMD + (" -o pythonpath=src" if (root / "src").is_dir() else "")
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
        log(f"{package} {version}: {len(stable)} tests pass 3 times of 3 in {', '.join(kinds)}")
        try:
            if not stable:
                raise RuntimeError(
                    f"{package}: no test passes in the pristine tree; can pytest run its suite?"
                )
            candidates = []
            for path in _source_files(root):
                rel = path.relative_to(root).as_posix()
                candidates += [
                    (rel, m) for m in mutants(rel, path.read_text(), seed=seed, max_per_function=1)
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
                            package, mutant.function, f2p[0], _assertion(output, f2p[0]), len(f2p)
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


def build(sdist: Path, package: str, version: str, **kwargs) -> list[dict]:
    """Rows for ``package`` built from ``sdist`` (its path in the rows is relative to ``out_dir``)."""
    return asyncio.run(build_async(sdist, package, version, **kwargs))


def write(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
