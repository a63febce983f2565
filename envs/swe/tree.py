"""A task's trees on the host, made once and cached: the pristine source (the sdist's source root),
the full starting tree (pristine + ``bug_patch``: what grading starts from) and the agent's tree
(the full tree without ``hidden_tests``).

Every tree is free of ``__pycache__``, ``*.pyc`` and ``*.egg-info``. The cache lives in
``$AGENTRL_CACHE/swe`` (default ``~/.cache/agentrl/swe``), keyed by the sdist's hash and the
patch's, so an edited row never reuses a stale tree.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

from agentrl.envs.swe.rows import RowError, SweRow

JUNK_DIRS = ("__pycache__", ".pytest_cache", ".mypy_cache", ".tox", ".git")


def cache_root() -> Path:
    base = os.environ.get("AGENTRL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "agentrl")
    return Path(base) / "swe"


def _clean(root: Path) -> None:
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_symlink():
            continue
        if path.is_dir() and (path.name in JUNK_DIRS or path.name.endswith(".egg-info")):
            shutil.rmtree(path)
        elif path.is_file() and path.suffix in (".pyc", ".pyo"):
            path.unlink()


def unpack_sdist(archive: Path, dest: Path) -> Path:
    """Unpack ``archive`` (.tar.gz / .tar.bz2 / .zip) under ``dest``; returns its single top-level
    directory (the source root). Members outside it, links out of it and devices are refused."""
    dest.mkdir(parents=True, exist_ok=True)
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as z:
            names = z.namelist()
            for name in names:
                if name.startswith("/") or ".." in PurePosixPath(name).parts:
                    raise RowError(f"{archive}: member {name!r} would land outside the tree")
            z.extractall(dest)
    else:
        with tarfile.open(archive) as t:
            names = t.getnames()
            t.extractall(dest, filter="data")
    tops = {PurePosixPath(n).parts[0] for n in names if n and PurePosixPath(n).parts}
    if len(tops) != 1 or not (dest / next(iter(tops))).is_dir():
        raise RowError(f"{archive}: an sdist holds one top-level directory; found {sorted(tops)[:5]}")
    return dest / tops.pop()


def apply_patch(root: Path, patch: str, what: str) -> None:
    """``git apply`` ``patch`` to the plain directory ``root`` (no repository needed)."""
    if not patch.strip():
        return
    with tempfile.NamedTemporaryFile("w", suffix=".patch", delete=False) as f:
        f.write(patch if patch.endswith("\n") else patch + "\n")
    try:
        done = subprocess.run(
            ["git", "apply", "--whitespace=nowarn", "--unsafe-paths", f.name],
            cwd=root,
            capture_output=True,
            text=True,
            env={**os.environ, "GIT_CEILING_DIRECTORIES": str(root.parent)},
        )
    finally:
        os.unlink(f.name)
    if done.returncode != 0:
        raise RowError(f"{what} does not apply to the pristine source: {done.stderr.strip()[:500]}")


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def pristine(row: SweRow) -> Path:
    """The unpacked, cleaned source root of the row's sdist (checked against its sha256)."""
    target = cache_root() / "pristine" / row.sha256[:20]
    if (target / ".complete").exists():
        return target / "src"
    shutil.rmtree(target, ignore_errors=True)  # a run that died half-way
    row.check_sha256()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="unpack-", dir=target.parent))
    try:
        root = unpack_sdist(row.sdist, tmp / "x")
        _clean(root)
        root.rename(tmp / "src")
        shutil.rmtree(tmp / "x")
        (tmp / ".complete").write_text(row.sdist.name)
        with contextlib.suppress(OSError):  # another process made it first
            tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target / "src"


def trees(row: SweRow) -> tuple[Path, Path]:
    """(full, agent): the starting tree with and without the hidden tests, cached."""
    target = (
        cache_root()
        / "tasks"
        / f"{row.instance_id[:80]}-{_key(row.sha256, row.bug_patch, *row.hidden_tests)}"
    )
    if (target / ".complete").exists():
        return target / "full", target / "agent"
    shutil.rmtree(target, ignore_errors=True)
    source = pristine(row)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="task-", dir=target.parent))
    try:
        full, agent = tmp / "full", tmp / "agent"
        shutil.copytree(source, full, symlinks=True)
        apply_patch(full, row.bug_patch, f"{row.instance_id}: bug_patch")
        for hidden in row.hidden_tests:
            if not (full / hidden).is_file():
                raise RowError(
                    f"{row.instance_id}: hidden_tests names {hidden!r}, which is not a file of the tree"
                )
        shutil.copytree(full, agent, symlinks=True)
        for hidden in row.hidden_tests:
            (agent / hidden).unlink()
        _clean(full)
        _clean(agent)
        (tmp / ".complete").write_text(row.instance_id)
        with contextlib.suppress(OSError):
            tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target / "full", target / "agent"
