"""What of an agent's patch may reach the grader: its edits to the task's source, nothing else.

An agent's workspace diff is untrusted input. Grading applies it to a pristine checkout in a fresh
sandbox, so a patch is the one way an agent's work reaches the verdict; ``filter_patch`` keeps the
file sections that edit the task's non-test source and drops, with the reason, every section
that could change how the verdict is reached instead of what is judged:

- paths outside the source directories, absolute paths, ``..``, anything under ``.git``;
- tests: a ``test``/``tests``/``testing`` directory anywhere on the path, ``test_*.py``,
  ``*_test.py``, ``conftest.py``, and anything at or under a hidden test path of the task;
- test and build configuration: ``pytest.ini``, ``tox.ini``, ``setup.cfg``, ``pyproject.toml``,
  ``setup.py``, ``.pytest.ini``, ``noxfile.py``;
- Python start-up hooks: ``sitecustomize.py``, ``usercustomize.py``, ``*.pth``;
- binary patches and symlinks (mode 120000); renames and copies (diffs are made with
  ``--no-renames``; one that has them was not made by agentrl);
- sections that could edit another file than the one their header names: a header that cannot
  be read or names two files, ``---``/``+++`` lines naming another file than the header (``git
  apply`` and ``patch`` edit the file those lines name), and, in hunks whose counts do not hold
  (hand-written patches, which ``patch`` applies all the same), a line that is not a hunk's or a
  ``---``/``+++`` pair (both tools read one that no count covers as another file's patch); and a
  patch before the first ``diff --git`` line.

The reward hacks this closes are those seen in the wild on SWE-style tasks: edited or added
tests, a root ``conftest.py`` whose hook rewrites outcomes, pytest options from config files,
and ``.pth``/``sitecustomize`` files that patch the test runner at start-up.
"""

from __future__ import annotations

import ast
import fnmatch
import posixpath
import re
from dataclasses import dataclass

TEST_DIRS = frozenset({"test", "tests", "testing"})
TEST_FILES = ("test_*.py", "*_test.py", "conftest.py")
CONFIG_FILES = frozenset(
    {"pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "setup.py", "noxfile.py"}
)
STARTUP_HOOKS = ("sitecustomize.py", "usercustomize.py", "*.pth")
_MODE_LINES = ("new file mode", "new mode", "old mode", "deleted file mode")


@dataclass
class FileDiff:
    """One file's section of a git patch."""

    path: str
    """The file's path relative to the tree (the new path; the old one for a deletion); "" if unreadable."""
    text: str
    """The whole section, from its ``diff --git`` line."""
    problem: str | None = None
    """Why the section cannot be applied as an edit of a text file (binary, symlink, rename, ...)."""


def _unquote(text: str) -> tuple[str, str] | None:
    """Read one path from the start of ``text`` (C-quoted by git when it holds odd characters);
    returns (path, the rest) or None."""
    if not text.startswith('"'):
        return None
    end = 1
    while end < len(text):
        if text[end] == "\\":
            end += 2
            continue
        if text[end] == '"':
            break
        end += 1
    if end >= len(text):
        return None
    try:
        # git's quoting is C's: octal escapes of UTF-8 bytes, \t, \n, \", \\.
        raw = ast.literal_eval("b" + text[: end + 1])
        return raw.decode("utf-8", errors="replace"), text[end + 1 :]
    except (ValueError, SyntaxError):
        return None


def _header_paths(line: str) -> tuple[str, str] | None:
    """The a/ and b/ paths of a ``diff --git a/X b/Y`` line, or None when it cannot be read or
    names two files (without renames both sides name the same one)."""
    rest = line[len("diff --git ") :]
    if rest.startswith('"'):
        first = _unquote(rest)
        if first is None:
            return None
        a, rest = first
        rest = rest.lstrip(" ")
        second = _unquote(rest) if rest.startswith('"') else (rest, "")
        if second is None or second[1]:
            return None
        b = second[0]
    elif rest.endswith('"'):
        at = rest.rfind(' "')
        second = _unquote(rest[at + 1 :]) if at >= 0 else None
        if second is None or second[1]:
            return None
        a, b = rest[:at], second[0]
    else:
        # "a/P b/P", so P is half of what is left.
        if (len(rest) - 5) % 2:
            return None
        n = (len(rest) - 5) // 2
        a, b = rest[: 2 + n], rest[3 + n :]
    if not (a.startswith("a/") and b.startswith("b/")) or a[2:] != b[2:]:
        return None
    return a[2:], b[2:]


def _file_name(line: str, marker: str) -> str | None:
    """The name on a ``--- NAME`` or ``+++ NAME`` line (git quotes an odd one, and ends one holding a
    space with a tab); None when it cannot be read."""
    rest = line[len(marker) :].rstrip("\n")
    if rest.startswith('"'):
        quoted = _unquote(rest)
        return quoted[0] if quoted is not None and not quoted[1] else None
    return rest[:-1] if rest.endswith("\t") and " " in rest else rest


def _lines(text: str) -> list[str]:
    """``text`` split after each newline, and only there: ``git apply`` and ``patch`` read lines so,
    and a form feed or a carriage return is part of a line (``str.splitlines`` would split there)."""
    parts = text.split("\n")
    return [part + "\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


_EXTENDED = ("old mode ", "new mode ", "deleted file mode ", "new file mode ", "index ")
_HUNK = re.compile(r"@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")


def _counted(hunks: list[str]) -> bool:
    """Whether ``hunks`` (a section's lines after its ``---``/``+++``) are hunks that hold exactly
    the lines their headers count, as git writes them."""
    i, n = 0, len(hunks)
    while i < n:
        hunk = _HUNK.match(hunks[i])
        if hunk is None:
            return False
        old_left, new_left = int(hunk[1] or 1), int(hunk[2] or 1)
        i += 1
        while i < n and (old_left or new_left):
            kind = hunks[i][0]
            if kind in " \n":  # context; an empty line is one whose space was stripped
                old_left, new_left = old_left - 1, new_left - 1
            elif kind == "-":
                old_left -= 1
            elif kind == "+":
                new_left -= 1
            elif kind != "\\":  # "\ No newline at end of file"
                return False
            i += 1
        if old_left or new_left:
            return False
        while i < n and hunks[i].startswith("\\"):
            i += 1
    return True


def _stray(hunks: list[str]) -> str | None:
    """In hunks whose counts do not hold (a hand-written patch; ``patch`` applies many of them, as
    SWE-bench's harness does): what a tool could read as the start of another file's patch."""
    for i, line in enumerate(hunks):
        if not (_HUNK.match(line) or line[0] in " +-\\\n"):
            return f"a line that is not a hunk's ({line.rstrip()[:60]!r})"
        if line.startswith("--- ") and i + 1 < len(hunks) and hunks[i + 1].startswith("+++ "):
            return "a ---/+++ pair among hunks whose counts do not hold (another file's patch, to git apply and patch)"
    return None


def _section_problem(lines: list[str], path: str) -> str | None:
    """Why a file section of a patch (its lines after ``diff --git``) is not an edit of ``path`` only:
    extended header lines as git writes them, ``---``/``+++`` naming that file, then hunks.

    ``git apply`` and ``patch`` change the file that the ``---``/``+++`` lines name, whatever the
    ``diff --git`` line says, and read a ``---``/``+++`` pair that no hunk's count covers as another
    file's patch. So the pair must name the header's file, and in hunks whose counts do not hold
    (which ``patch`` applies all the same) every line must be a hunk's, with no such pair."""
    i, n = 0, len(lines)
    while i < n and not lines[i].startswith(("--- ", "@@")):
        line = lines[i]
        if line.startswith(("rename from", "rename to", "copy from", "copy to")):
            return "a rename or copy"
        if line.startswith(("GIT binary patch", "Binary files")):
            return "a binary patch"
        if line.startswith(_MODE_LINES) and line.split()[-1] == "120000":
            return "a symlink"
        if not line.startswith(_EXTENDED):
            return "a header line git does not write"
        i += 1
    if i == n:
        return None  # a mode change, or an empty file made or removed
    if not lines[i].startswith("--- ") or i + 1 == n or not lines[i + 1].startswith("+++ "):
        return "hunks without the ---/+++ lines that name their file"
    old, new = _file_name(lines[i], "--- "), _file_name(lines[i + 1], "+++ ")
    if old not in (f"a/{path}", "/dev/null") or new not in (f"b/{path}", "/dev/null") or old == new:
        return "---/+++ lines that name another file than its header"
    hunks = lines[i + 2 :]
    if not hunks:
        return "---/+++ lines without hunks"
    return None if _counted(hunks) else _stray(hunks)


def split_patch(patch: str) -> list[FileDiff]:
    """The file sections of a git patch, each with its path and what makes it unappliable or not a
    plain edit of that one file (if anything). Text before the first section is part of none; when it
    holds a patch of its own (``---``/``+++`` or hunk lines), that text is a section with no path."""
    sections: list[list[str]] = []
    before: list[str] = []
    for line in _lines(patch):
        if line.startswith("diff --git "):
            sections.append([line])
        elif sections:
            sections[-1].append(line)
        else:
            before.append(line)
    files = []
    if any(line.startswith(("--- ", "+++ ", "@@ ")) for line in before):
        files.append(FileDiff("", "".join(before), "a patch before the first diff --git line (not git's)"))
    for lines in sections:
        text = "".join(lines)
        paths = _header_paths(lines[0].rstrip("\n"))
        if paths is None:
            files.append(FileDiff("", text, "its header cannot be read"))
            continue
        files.append(FileDiff(paths[1], text, _section_problem(lines[1:], paths[1])))
    return files


def path_problem(path: str, source_dirs: list[str], hidden_paths: tuple[str, ...] = ()) -> str | None:
    """Why an edit of ``path`` may not reach the grader; None when it is an edit of the task's source."""
    parts = path.split("/")
    if not path or path.startswith("/") or ".." in parts or posixpath.normpath(path) != path:
        return "a path outside the tree"
    name = parts[-1]
    if parts[0] == ".git":
        return "git's own files"
    if any(path == h or path.startswith(h.rstrip("/") + "/") for h in hidden_paths):
        return "a hidden test path"
    if TEST_DIRS.intersection(parts[:-1]) or any(fnmatch.fnmatch(name, p) for p in TEST_FILES):
        return "a test file"
    if name in CONFIG_FILES:
        return "test or build configuration"
    if any(fnmatch.fnmatch(name, p) for p in STARTUP_HOOKS):
        return "a Python start-up hook"
    if not any(path == d or path.startswith(d.rstrip("/") + "/") for d in source_dirs):  # d: a module too
        return f"outside the source directories ({', '.join(source_dirs)})"
    return None


def filter_patch(
    patch: str, source_dirs: list[str], hidden_paths: tuple[str, ...] = ()
) -> tuple[str, list[tuple[str, str]]]:
    """Keep the sections of ``patch`` that edit the task's source; returns (kept patch, [(path, why
    dropped), ...]). ``source_dirs``: directories (relative to the tree) holding the source."""
    kept, dropped = [], []
    for section in split_patch(patch):
        why = section.problem or path_problem(section.path, source_dirs, hidden_paths)
        if why is None:
            kept.append(section.text)
        else:
            dropped.append((section.path or section.text.splitlines()[0][:200], why))
    return "".join(kept), dropped


# Added lines that reach into the test runner from the package's own source (imported by the tests,
# so it runs in the test process): patching pytest, its junit writer, its exit code, or Python's
# builtins (a plain runner's printed verdict).
RUNNER_TAMPER = re.compile(
    r"\b_pytest\b|\bimport\s+pytest\b|\bfrom\s+pytest\b|\bpytest\.|\bos\._exit\b|\bjunitxml\b|\bPASSED\b|\bXFAIL|\bbuiltins\b|__builtins__"
)
RUNNER_PACKAGES = ("_pytest", "pytest")
"""Where the package is the test runner itself (pytest's own tasks), its source names the runner in
ordinary fixes: no line there counts as reaching into it."""


def runner_tamper(patch: str, dirs: list[str] = ()) -> list[str]:
    """The added lines of ``patch`` that touch the test runner (empty for an ordinary fix, and for
    a fix of the runner itself: ``dirs``, the source directories, name it)."""
    if any(posixpath.basename(d.rstrip("/")) in RUNNER_PACKAGES for d in dirs):
        return []
    added = (line[1:] for line in patch.splitlines() if line.startswith("+") and not line.startswith("+++"))
    return [line.strip()[:200] for line in added if RUNNER_TAMPER.search(line)]
