"""Building ``swe-v0`` tasks from a released sdist: inject one bug with an AST transform
(``mutate.py``), keep it when tests that passed now fail.

For one package: unpack the sdist, run its suite 3 times and keep the tests that passed every
time (ids with spaces dropped: swebench's parser cuts ids there); then, one function at a time in a
deterministic order, write a mutant, run the suite, and keep the mutant when 1 <= |FAIL_TO_PASS|
<= 50, FAIL_TO_PASS is at most ``max_f2p_share`` of the suite and PASS_TO_PASS is not empty;
duplicates (the same failing set) are dropped. The row's ``bug_patch`` is the mutant's diff, the gold
``patch`` its reverse, ``hidden_tests`` the test files that hold a FAIL_TO_PASS test, and the problem
statement a template: the failing behaviour, a failing test's name and its assertion from the buggy
run, never the fix. The same sdist and seed give the same rows.

The suite runs here in a subprocess with a cleared environment (released code, trusted); whether
each gold patch resolves in a fresh sandbox is what ``agentrl swe validate`` checks afterwards.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from agentrl.envs.swe.grading import source_dirs
from agentrl.envs.swe.mutate import mutants
from agentrl.envs.swe.tree import _clean, unpack_sdist

TEST_CMD = 'python -m pytest -rA --tb=short -p no:cacheprovider -o addopts=""'
ROW_TEST_CMD = 'python -m pytest -rA --tb=no -p no:cacheprovider -o addopts=""'
STATUS = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED) (\S+)", re.MULTILINE)


def run_suite(root: Path, timeout: float = 300.0, args: tuple[str, ...] = ()) -> tuple[dict[str, str], str]:
    """Run the tree's tests; returns ({node id: status}, output)."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(root),
        "LANG": "C.UTF-8",
        "TZ": "UTC",
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONNOUSERSITE": "1",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    for cache in root.rglob("__pycache__"):
        shutil.rmtree(cache, ignore_errors=True)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-rA",
        "--tb=short",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
    ]
    if (root / "src").is_dir():  # a src layout, not installed: pytest puts src/ on the path itself
        command += ["-o", "pythonpath=src"]
    command += args
    try:
        done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {}, "timeout"
    output = done.stdout + done.stderr
    statuses: dict[str, str] = {}
    for status, test in STATUS.findall(output):
        if statuses.get(test) not in ("FAILED", "ERROR"):
            statuses[test] = status
    return statuses, output


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
    text = (
        f"Something in `{package}` around `{where}` no longer behaves as documented. "
        f"{n_failing} test{'s' if n_failing != 1 else ''} of the project's suite fail{'' if n_failing != 1 else 's'}, "
        f"for example `{test}`"
    )
    if assertion:
        text += f":\n\n```\n{assertion}\n```\n"
    else:
        text += ".\n"
    return text + "\nFind the cause in the library's source and fix it."


def build(
    sdist: Path,
    package: str,
    version: str,
    *,
    out_dir: Path,
    max_tasks: int = 25,
    seed: int = 0,
    split: str = "train",
    max_f2p: int = 50,
    max_f2p_share: float = 0.2,
    max_tries: int = 400,
    log=print,
) -> list[dict]:
    """Rows for ``package`` built from ``sdist`` (its path in the rows is relative to ``out_dir``)."""
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="agentrl-swe-build-") as tmp:
        root = unpack_sdist(sdist, Path(tmp) / "x")
        _clean(root)
        runs = [run_suite(root)[0] for _ in range(3)]
        stable = {
            t for t, s in runs[0].items() if s == "PASSED" and all(r.get(t) == "PASSED" for r in runs[1:])
        }
        stable = {t for t in stable if " " not in t}
        log(f"{package} {version}: {len(stable)} tests pass 3 times of 3")
        if not stable:
            raise RuntimeError(
                f"{package}: no test passes in the pristine tree; is pytest able to run its suite?"
            )
        files = [
            p
            for d in source_dirs(root)
            for p in (sorted((root / d).rglob("*.py")) if (root / d).is_dir() else [root / d])
            if "test" not in p.relative_to(root).as_posix().split("/")[-1]
            and not set(p.relative_to(root).parts) & {"tests", "test", "testing"}
        ]
        candidates = []
        for path in files:
            rel = path.relative_to(root).as_posix()
            candidates += [(rel, m) for m in mutants(rel, path.read_text(), seed=seed, max_per_function=1)]
        random.Random(f"{seed}/{package}/{version}").shuffle(candidates)
        seen: set[frozenset[str]] = set()
        for tries, (rel, mutant) in enumerate(candidates):
            if len(rows) >= max_tasks or tries >= max_tries:
                break
            original = (root / rel).read_text()
            (root / rel).write_text(mutant.source)
            try:
                statuses, output = run_suite(root)
            finally:
                (root / rel).write_text(original)
            f2p = sorted(t for t in stable if statuses.get(t) != "PASSED")
            p2p = sorted(t for t in stable if statuses.get(t) == "PASSED")
            if not 1 <= len(f2p) <= max_f2p or len(f2p) > max_f2p_share * len(stable) or not p2p:
                continue
            if frozenset(f2p) in seen:
                continue
            seen.add(frozenset(f2p))
            hidden = sorted({t.split("::")[0] for t in f2p})
            p2p = [t for t in p2p if t.split("::")[0] not in hidden] + [
                t for t in p2p if t.split("::")[0] in hidden
            ]
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
                    "image": "agentrl/base:bookworm",
                    "test_cmd": ROW_TEST_CMD + (" -o pythonpath=src" if (root / "src").is_dir() else ""),
                    "source": {"sdist": os.path.relpath(sdist, out_dir), "sha256": digest},
                    "bug_patch": _diff(rel, original, mutant.source),
                    "hidden_tests": hidden,
                    "split": split,
                    "created_by": {"transform": mutant.transform, "function": mutant.function, "file": rel},
                }
            )
            log(f"  {instance}: {mutant.description}; {len(f2p)} fail, {len(p2p)} pass")
    return rows


def write(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
