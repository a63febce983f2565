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
  apply`` and ``patch`` edit the file those lines name), and hunks whose counts are not met (which
  ``patch`` applies all the same) holding a line that is not a hunk's or a ``---``/``+++`` pair.

A section passes on only its hunks, up to where their counts end (both tools read them alike);
a ``---``/``+++`` pair after them starts another file's patch, filtered as any other, as do the
pairs of a plain ``diff -u`` patch with no ``diff --git`` line. Other text is left out.

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
    """The section as it is passed on: from its ``diff --git`` line (or its ``---``/``+++`` pair, in a
    plain unified diff) to the end of its hunks."""
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
    """The name on a ``--- NAME`` or ``+++ NAME`` line, up to a tab (``diff -u`` writes the file's
    time after one; git ends a name holding a space with one, and quotes an odd name); None when it
    cannot be read."""
    rest = line[len(marker) :].rstrip("\n")
    if rest.startswith('"'):
        quoted = _unquote(rest)
        return quoted[0] if quoted is not None and quoted[1][:1] in ("", "\t") else None
    return rest.split("\t", 1)[0]


def _lines(text: str) -> list[str]:
    """``text`` split after each newline, and only there: ``git apply`` and ``patch`` read lines so,
    and a form feed or a carriage return is part of a line (``str.splitlines`` would split there)."""
    parts = text.split("\n")
    return [part + "\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


# the extended header lines git writes, bar renames and binaries
_EXTENDED = (*(f"{m} " for m in _MODE_LINES), "index ")
_HUNK = re.compile(r"@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")


def _counted_end(lines: list[str], i: int) -> int | None:
    """Where the hunks from ``lines[i]`` on end when each holds the lines its header counts (its
    ``\\ No newline`` markers too): that is how ``git apply`` and ``patch`` read them. None when one
    runs out of lines, or meets a line that is not a hunk's, before its count is met."""
    n = len(lines)
    while i < n and (hunk := _HUNK.match(lines[i])):
        old_left, new_left = int(hunk[1] or 1), int(hunk[2] or 1)
        i += 1
        while i < n and (old_left or new_left):
            kind = lines[i][0]
            if kind in " \n":  # context; an empty line is one whose space was stripped
                old_left, new_left = old_left - 1, new_left - 1
            elif kind == "-":
                old_left -= 1
            elif kind == "+":
                new_left -= 1
            elif kind != "\\":  # "\ No newline at end of file"
                return None
            i += 1
        if old_left or new_left:
            return None
        while i < n and lines[i].startswith("\\"):
            i += 1
    return i


def _stray(lines: list[str], i: int) -> str | None:
    """In hunks whose counts are not met (a hand-written patch's; ``patch`` applies many of them, as
    SWE-bench's harness does), from ``lines[i]`` on: what could start another file's patch."""
    for j in range(i, len(lines)):
        if not (_HUNK.match(lines[j]) or lines[j][0] in " +-\\\n"):
            return f"a line that is not a hunk's ({lines[j].rstrip()[:60]!r})"
        if _pair(lines, j):
            return "a ---/+++ pair among hunks whose counts are not met (another file's patch, to patch)"
    return None


def _pair(lines: list[str], i: int) -> bool:
    return lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")


def _pair_path(old: str | None, new: str | None) -> str | None:
    """The one file a ``---``/``+++`` pair names (a new or deleted file by its other side)."""
    if old == "/dev/null" and new and new.startswith("b/"):
        return new[2:]
    if new == "/dev/null" and old and old.startswith("a/"):
        return old[2:]
    if old and new and old.startswith("a/") and new.startswith("b/") and old[2:] == new[2:]:
        return old[2:]
    return None


def _unified(head: str, lines: list[str], i: int, path: str | None) -> tuple[FileDiff, int]:
    """One file's patch from its ``---``/``+++`` pair at ``lines[i]``, after ``head`` (its ``diff
    --git`` header, or nothing); and where the lines after its hunks start.

    ``git apply`` and ``patch`` change the file the pair names, so it must name ``path`` (the
    header's; without a header it names the file). The section keeps only hunks whose counts are
    met, which both tools read alike; what follows them is for ``_plain`` to read another file's
    patch from. Hunks whose counts are not met (``patch`` may apply them) are kept, to the end of
    the lines, only when nothing in them could start another file's patch."""
    n = len(lines)
    named = _pair_path(_file_name(lines[i], "--- "), _file_name(lines[i + 1], "+++ "))
    if named is None or (path is not None and named != path):
        what = "name another file than its header" if path is not None else "do not name one file"
        return FileDiff(path or "", head + "".join(lines[i:]), f"---/+++ lines that {what}"), n
    end = _counted_end(lines, i + 2)
    if end is None:
        return FileDiff(named, head + "".join(lines[i:]), _stray(lines, i + 2)), n
    if end == i + 2:
        return FileDiff(named, head + "".join(lines[i:]), "---/+++ lines without hunks"), n
    return FileDiff(named, head + "".join(lines[i:end])), end


def _plain(lines: list[str], i: int = 0) -> list[FileDiff]:
    """The file patches in ``lines[i:]`` that have no ``diff --git`` line (a plain ``diff -u``, or
    what follows a section's hunks), each from a ``---``/``+++`` pair; other lines are no patch's and
    are left out."""
    files = []
    while i < len(lines):
        if _pair(lines, i):
            section, i = _unified("", lines, i, None)
            files.append(section)
        else:
            i += 1
    return files


def _git_section(lines: list[str], path: str) -> list[FileDiff]:
    """A ``diff --git`` section of ``path`` (``lines``, from that line on): its extended header as git
    writes it, then the file's patch (and any other file's patch after its hunks)."""
    i, n = 1, len(lines)
    while i < n and not lines[i].startswith(("--- ", "@@")):
        line, problem = lines[i], None
        if line.startswith(("rename from", "rename to", "copy from", "copy to")):
            problem = "a rename or copy"
        elif line.startswith(("GIT binary patch", "Binary files")):
            problem = "a binary patch"
        elif line.startswith(_MODE_LINES) and line.split()[-1] == "120000":
            problem = "a symlink"
        elif not line.startswith(_EXTENDED):
            problem = "a header line git does not write"
        if problem:
            return [FileDiff(path, "".join(lines), problem)]
        i += 1
    if i == n:
        return [FileDiff(path, "".join(lines))]  # a mode change, or an empty file made or removed
    if not _pair(lines, i):
        return [FileDiff(path, "".join(lines), "hunks without the ---/+++ lines that name their file")]
    section, rest = _unified("".join(lines[:i]), lines, i, path)
    return [section, *_plain(lines, rest)]


def split_patch(patch: str) -> list[FileDiff]:
    """The file sections of a git patch (or a plain unified diff), each with its path and what makes
    it unappliable, or able to change another file than that path (if anything)."""
    sections: list[list[str]] = []
    before: list[str] = []
    for line in _lines(patch):
        if line.startswith("diff --git "):
            sections.append([line])
        elif sections:
            sections[-1].append(line)
        else:
            before.append(line)
    files = _plain(before)
    for lines in sections:
        paths = _header_paths(lines[0].rstrip("\n"))
        if paths is None:
            files.append(FileDiff("", "".join(lines), "its header cannot be read"))
        else:
            files.extend(_git_section(lines, paths[1]))
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
