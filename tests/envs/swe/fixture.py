"""A small sdist made on the spot, and swe-v0 rows for it written by hand in the row format."""

from __future__ import annotations

import difflib
import hashlib
import io
import json
import tarfile
from pathlib import Path

SOURCE = {
    "mini-1.0/PKG-INFO": "Metadata-Version: 2.1\nName: mini\nVersion: 1.0\n",
    "mini-1.0/setup.py": "from setuptools import setup\nsetup(name='mini', version='1.0', packages=['mini'])\n",
    "mini-1.0/mini/__init__.py": "from mini.ops import add, clamp\n",
    "mini-1.0/mini/ops.py": (
        "def add(a, b):\n    return a + b\n\n\n"
        "def clamp(x, lo, hi):\n    if x < lo:\n        return lo\n    if x > hi:\n        return hi\n    return x\n"
    ),
    "mini-1.0/tests/__init__.py": "",
    "mini-1.0/tests/test_add.py": (
        "from mini import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
        "def test_add_negative():\n    assert add(-1, -1) == -2\n"
    ),
    "mini-1.0/tests/test_clamp.py": (
        "from mini import clamp\n\n\ndef test_inside():\n    assert clamp(5, 0, 10) == 5\n\n\n"
        "def test_below():\n    assert clamp(-3, 0, 10) == 0\n\n\n"
        "def test_above():\n    assert clamp(13, 0, 10) == 10\n"
    ),
}
OPS = SOURCE["mini-1.0/mini/ops.py"]
BUGGY = OPS.replace("return a + b", "return a - b")


def diff(path: str, before: str, after: str) -> str:
    """A git-style unified diff of one file (3 lines of context)."""
    lines = difflib.unified_diff(
        before.splitlines(keepends=True), after.splitlines(keepends=True), f"a/{path}", f"b/{path}"
    )
    return f"diff --git a/{path} b/{path}\n" + "".join(lines)


BUG_PATCH = diff("mini/ops.py", OPS, BUGGY)
GOLD = diff("mini/ops.py", BUGGY, OPS)
TEST_CMD = 'python -m pytest -rA --tb=no -p no:cacheprovider -o addopts=""'


def make_sdist(folder: Path) -> tuple[Path, str]:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in sorted(SOURCE.items()):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    path = folder / "sources" / "mini-1.0.tar.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buffer.getvalue())
    return path, hashlib.sha256(buffer.getvalue()).hexdigest()


def row(sha256: str, **changes) -> dict:
    base = {
        "instance_id": "pypi__mini-1.0__add",
        "repo": "pypi/mini",
        "version": "1.0",
        "problem_statement": "add(2, 3) returns -1; it should return 5.",
        "FAIL_TO_PASS": ["tests/test_add.py::test_add", "tests/test_add.py::test_add_negative"],
        "PASS_TO_PASS": json.dumps(["tests/test_clamp.py::test_inside", "tests/test_clamp.py::test_below"]),
        "patch": GOLD,
        "test_patch": "",
        "log_parser": "parse_log_pytest",
        "eval_type": "pass_and_fail",
        "image": "agentrl/base:bookworm",
        "test_cmd": TEST_CMD,
        "source": {"sdist": "sources/mini-1.0.tar.gz", "sha256": sha256},
        "bug_patch": BUG_PATCH,
        "hidden_tests": ["tests/test_add.py"],
        "split": "train",
    }
    return {**base, **changes}


def write_rows(folder: Path, rows: list[dict]) -> Path:
    path = folder / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
