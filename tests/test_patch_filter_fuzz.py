"""The patch filter against random forged patches: whatever it keeps, git apply and GNU patch touch
no file but the source's, however the sections, their ---/+++ pairs, hunk counts and the text
between them are mixed up."""

import random
import re
import shutil
import subprocess

import pytest

from agentrl.patches import filter_patch

FILES = ["pkg/a.py", "pkg/b.py", "tests/test_a.py", "conftest.py", "setup.cfg"]
BODY = "line 1\nline 2\nline 3\n"


def hunk(rng: random.Random) -> list[str]:
    """One hunk of BODY, its counts right or off by one either way."""
    old, new = 3, 3
    lines = [" line 1\n", "-line 2\n", "+line two\n", " line 3\n"]
    if rng.random() < 0.4:
        old, new = old + rng.choice((-1, 1)), new + rng.choice((-1, 1))
    return [f"@@ -1,{old} +1,{new} @@\n", *lines]


def section(rng: random.Random) -> list[str]:
    """One file's patch, sometimes with a header that names another file than its ---/+++ lines,
    no header, a new or deleted file, or a quoted name."""
    path, named = rng.choice(FILES), rng.choice(FILES) if rng.random() < 0.3 else None
    named = named or path
    out = []
    if rng.random() < 0.85:
        a, b = (f'"a/{path}"', f'"b/{path}"') if rng.random() < 0.2 else (f"a/{path}", f"b/{path}")
        out.append(f"diff --git {a} {b}\n")
        if rng.random() < 0.1:
            out += [f"rename from {named}\n", f"rename to {path}\n"]
    out += [f"--- a/{named}\n", f"+++ b/{named}\n"]
    for _ in range(rng.randint(1, 2)):
        out += hunk(rng)
    return out


def forged(rng: random.Random) -> str:
    lines: list[str] = []
    for _ in range(rng.randint(1, 4)):
        lines += section(rng)
    for _ in range(rng.randint(0, 3)):  # shuffled-in pairs, hunk lines and prose
        piece = rng.choice(
            [
                [f"--- a/{rng.choice(FILES)}\n", f"+++ b/{rng.choice(FILES)}\n"],
                hunk(rng),
                ["some prose\n"],
                [f"diff --git a/{rng.choice(FILES)} b/{rng.choice(FILES)}\n"],
            ]
        )
        at = rng.randint(0, len(lines))
        lines[at:at] = piece
    return "".join(lines)


def touched_by_git(patch: str, tree) -> set[str]:
    out = subprocess.run(["git", "apply", "--numstat"], cwd=tree, input=patch, capture_output=True, text=True)
    return {line.split("\t")[2] for line in out.stdout.splitlines() if line.count("\t") == 2}


def touched_by_patch(patch: str, tree) -> set[str]:
    out = subprocess.run(
        ["patch", "-p1", "--dry-run", "--batch", "--fuzz=2", "--force"],
        cwd=tree,
        input=patch,
        capture_output=True,
        text=True,
    )
    return set(re.findall(r"^checking file (\S+)", out.stdout, re.M))


@pytest.mark.skipif(
    shutil.which("patch") is None, reason="GNU patch is not installed here (apt-get install patch)"
)
def test_what_is_kept_of_a_forged_patch_touches_the_source_only(tmp_path):
    for path in FILES:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(BODY)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    rng = random.Random(0)
    reached = set()  # what the tools would touch given the whole patch: the fuzz must reach the tests
    for _ in range(300):
        patch = forged(rng)
        kept, _ = filter_patch(patch, ["pkg"])
        reached |= touched_by_git(patch, tmp_path) | touched_by_patch(patch, tmp_path)
        for tool in (touched_by_git, touched_by_patch):
            touched = tool(kept, tmp_path)
            assert all(p.startswith("pkg/") for p in touched), (tool.__name__, touched, patch, kept)
    assert {"tests/test_a.py", "conftest.py", "setup.cfg"} <= reached
