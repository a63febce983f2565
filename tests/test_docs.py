"""The docs cannot rot: every code block marked ``runnable`` in README.md and docs/*.md runs (bash
blocks with the virtualenv's commands first on PATH, Python blocks with this interpreter), in a
scratch directory that sees the repository's recipes; every relative link resolves."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks/README.md"]
BLOCK = re.compile(r"^```(\w+) runnable[^\n]*\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def blocks():
    for page in PAGES:
        text = page.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            yield pytest.param(match.group(1), match.group(2), id=f"{page.relative_to(ROOT)}:{line}")


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+ (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_runnable_blocks_are_found():
    found = {param.id.split(":")[0] for param in blocks()}
    assert {"README.md", "docs/environments.md"} <= found


@pytest.mark.parametrize("language, code", list(blocks()))
def test_runnable_block(language, code, tmp_path):
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if language == "bash":
        command = ["bash", "-euo", "pipefail", "-c", code]
    elif language == "python":
        command = [sys.executable, "-c", code]
    else:
        pytest.fail(f"a runnable block in {language!r}: only bash and python blocks can run")
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page):
    text = page.read_text()
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        missing_anchor = bool(anchor) and resolved.suffix == ".md" and resolved.exists()
        if not resolved.exists() or (missing_anchor and anchor not in anchors(resolved.read_text())):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to what is not there: {broken}"
