"""filter_patch on patches made by real git: the task's source edits are kept and apply; tests,
configuration, start-up hooks, binaries, symlinks and odd headers are dropped with the reason."""

import shutil
import subprocess

import pytest

from agentrl.patches import filter_patch, path_problem, split_patch


def git(repo, *args, **kw):
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=repo,
        check=True,
        capture_output=True,
        **kw,
    ).stdout


@pytest.fixture
def repo(tmp_path):
    base = tmp_path / "base"
    (base / "pkg").mkdir(parents=True)
    (base / "tests").mkdir()
    (base / "pkg" / "a.py").write_text("x = 1\n")
    (base / "pkg" / "gone.py").write_text("g = 1\n")
    (base / "pkg" / "crlf.py").write_bytes(b"a = 0\r\n\x0c\nb = 2\r\nc = 0")
    (base / "pkg" / "blob.bin").write_bytes(b"bin\0ary")
    (base / "tests" / "test_a.py").write_text("def test():\n    assert False\n")
    git(base, "init", "-q")
    git(base, "add", "-A")
    git(base, "commit", "-qm", "base")
    return base


def agent_patch(repo) -> str:
    """Every kind of edit an agent can make, as agentrl's diff makes it."""
    (repo / "pkg" / "a.py").write_text("x = 2\n")
    (repo / "pkg" / "a.py").chmod(0o755)
    (repo / "pkg" / "we ird.py").write_text("y = 1\n")
    (repo / "pkg" / "t\tab.py").write_text("z = 1\n")
    (repo / "pkg" / "café.py").write_text("c = 1\n")  # quoted with octal escapes by git
    (repo / "pkg" / "empty.py").write_text("")  # a section with no hunks
    (repo / "pkg" / "crlf.py").write_bytes(b"a = 1\r\n\x0c\nb = 2\r\nc = 3")  # no newline at its end
    (repo / "pkg" / "gone.py").unlink()
    (repo / "pkg" / "blob.bin").write_bytes(b"bin\0ary2")
    (repo / "pkg" / "link").symlink_to("/etc")
    (repo / "pkg" / "hook.pth").write_text("import hook\n")
    (repo / "pkg" / "sub").mkdir()
    (repo / "pkg" / "sub" / "conftest.py").write_text("x\n")
    (repo / "pkg" / "tests").mkdir()
    (repo / "pkg" / "tests" / "helper.py").write_text("x\n")
    (repo / "conftest.py").write_text("import pytest\n")
    (repo / "setup.cfg").write_text("[tool:pytest]\naddopts = -p hook\n")
    (repo / "sitecustomize.py").write_text("import hook\n")
    (repo / "tests" / "test_a.py").write_text("def test():\n    pass\n")
    git(repo, "add", "-A")
    return git(
        repo, "diff", "--cached", "--binary", "--no-renames", "--src-prefix=a/", "--dst-prefix=b/", "HEAD"
    ).decode()


def test_keeps_source_edits_and_drops_the_rest(repo, tmp_path):
    kept, dropped = filter_patch(agent_patch(repo), ["pkg"])
    assert dict(dropped) == {
        "conftest.py": "a test file",
        "pkg/blob.bin": "a binary patch",
        "pkg/hook.pth": "a Python start-up hook",
        "pkg/link": "a symlink",
        "pkg/sub/conftest.py": "a test file",
        "pkg/tests/helper.py": "a test file",
        "setup.cfg": "test or build configuration",
        "sitecustomize.py": "a Python start-up hook",
        "tests/test_a.py": "a test file",
    }
    assert {f.path for f in split_patch(kept)} == {
        "pkg/a.py",
        "pkg/we ird.py",
        "pkg/t\tab.py",
        "pkg/café.py",
        "pkg/empty.py",
        "pkg/crlf.py",
        "pkg/gone.py",
    }
    # what is kept applies to a pristine checkout
    fresh = tmp_path / "fresh"
    git(tmp_path, "clone", "-q", str(repo), str(fresh))
    git(fresh, "checkout", "-q", "HEAD~0")
    git(fresh, "reset", "-q", "--hard", git(repo, "rev-parse", "HEAD").decode().strip())
    subprocess.run(["git", "apply"], cwd=fresh, input=kept.encode(), check=True)
    assert (fresh / "pkg" / "a.py").read_text() == "x = 2\n"
    assert (fresh / "pkg" / "t\tab.py").read_text() == "z = 1\n"
    assert (fresh / "pkg" / "café.py").read_text() == "c = 1\n" and (fresh / "pkg" / "empty.py").exists()
    assert (fresh / "pkg" / "crlf.py").read_bytes() == b"a = 1\r\n\x0c\nb = 2\r\nc = 3"
    assert not (fresh / "pkg" / "gone.py").exists()
    assert not (fresh / "conftest.py").exists() and not (fresh / "pkg" / "link").exists()
    assert (fresh / "tests" / "test_a.py").read_text() == "def test():\n    assert False\n"


def test_forged_sections_are_dropped():
    hunk = "--- a/{0}\n+++ b/{0}\n@@ -1 +1 @@\n-x\n+y\n"
    forged = (
        "diff --git a/../outside.py b/../outside.py\n"
        + hunk.format("../outside.py")
        + "diff --git a/pkg/x.py b/tests/test_x.py\nrename from pkg/x.py\nrename to tests/test_x.py\n"
        + "diff --git garbage\n"
        + hunk.format("pkg/y.py")
        + "diff --git a/.git/config b/.git/config\n"
        + hunk.format(".git/config")
        + "diff --git a/pkg/ok.py b/pkg/ok.py\n"
        + hunk.format("pkg/ok.py")
    )
    kept, dropped = filter_patch(forged, ["pkg"], hidden_paths=("pkg/hidden",))
    reasons = [why for _, why in dropped]
    assert reasons == [
        "a path outside the tree",
        "its header cannot be read",
        "its header cannot be read",
        "git's own files",
    ]
    assert kept == "diff --git a/pkg/ok.py b/pkg/ok.py\n" + hunk.format("pkg/ok.py")
    assert filter_patch("", ["pkg"]) == ("", [])


def test_path_rules():
    assert path_problem("pkg/mod.py", ["pkg"]) is None
    assert path_problem("pkg/testing/mod.py", ["pkg"]) == "a test file"
    assert path_problem("pkg/mod_test.py", ["pkg"]) == "a test file"
    assert path_problem("pkg/hidden/new.py", ["pkg"], ("pkg/hidden",)) == "a hidden test path"
    assert path_problem("pkg/hidden", ["pkg"], ("pkg/hidden",)) == "a hidden test path"
    assert path_problem("other/mod.py", ["pkg"]).startswith("outside the source directories")
    assert path_problem("pkg/pyproject.toml", ["pkg"]) == "test or build configuration"
    assert path_problem("/abs/pkg/mod.py", ["pkg"]) == "a path outside the tree"
    assert path_problem("pkg/./mod.py", ["pkg"]) == "a path outside the tree"


def test_a_library_of_one_module_keeps_its_edits():
    """A distribution that is one .py file lists the file itself as its source."""
    assert path_problem("mod.py", ["mod.py"]) is None
    assert (
        path_problem("mod.pyc", ["mod.py"]) is not None and path_problem("other.py", ["mod.py"]) is not None
    )
    patch = "diff --git a/mod.py b/mod.py\n--- a/mod.py\n+++ b/mod.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
    kept, dropped = filter_patch(patch, ["mod.py"])
    assert kept == patch and dropped == []


TEST_EDIT = "@@ -1,2 +1,2 @@\n def test():\n-    assert False\n+    pass\n"
SOURCE_EDIT = "--- a/pkg/a.py\n+++ b/pkg/a.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
TEST_PAIR = "--- a/tests/test_a.py\n+++ b/tests/test_a.py\n"
STRAY = "a ---/+++ pair among hunks whose counts are not met (another file's patch, to patch)"


@pytest.mark.parametrize(
    "forged,kept_source,why",
    [
        # the header names the source; the ---/+++ lines, which git apply follows, a test
        (
            "diff --git a/pkg/a.py b/pkg/a.py\n" + TEST_PAIR + TEST_EDIT,
            False,
            ("pkg/a.py", "---/+++ lines that name another file than its header"),
        ),
        # a second file's patch after the source edit's hunk, inside its section: read as its own
        (
            "diff --git a/pkg/a.py b/pkg/a.py\n" + SOURCE_EDIT + TEST_PAIR + TEST_EDIT,
            True,
            ("tests/test_a.py", "a test file"),
        ),
        # quoted headers naming two files: a rename without rename lines
        (
            'diff --git "a/tests/test_a.py" "b/pkg/a.py"\n--- a/tests/test_a.py\n+++ b/pkg/a.py\n'
            + TEST_EDIT,
            False,
            ('diff --git "a/tests/test_a.py" "b/pkg/a.py"', "its header cannot be read"),
        ),
        (
            'diff --git a/tests/test_a.py "b/pkg/a.py"\n--- a/tests/test_a.py\n+++ b/pkg/a.py\n' + TEST_EDIT,
            False,
            ('diff --git a/tests/test_a.py "b/pkg/a.py"', "its header cannot be read"),
        ),
        # a rename whose header names one file
        (
            "diff --git a/pkg/a.py b/pkg/a.py\nrename from tests/test_a.py\nrename to pkg/a.py\n",
            False,
            ("pkg/a.py", "a rename or copy"),
        ),
        # a plain diff (no diff --git line) of a test, after prose, before a git section of the source
        (
            "Here is my fix.\n" + TEST_PAIR + TEST_EDIT + "diff --git a/pkg/a.py b/pkg/a.py\n" + SOURCE_EDIT,
            True,
            ("tests/test_a.py", "a test file"),
        ),
    ],
)
def test_a_forged_section_cannot_edit_a_file_its_header_does_not_name(repo, forged, kept_source, why):
    tried = subprocess.run(
        ["git", "apply", "--check", "-v"], cwd=repo, input=forged.encode(), capture_output=True
    )
    assert b"tests/test_a.py" in tried.stderr  # what git apply would have touched
    kept, dropped = filter_patch(forged, ["pkg"])
    assert dropped == [why]
    assert kept == ("diff --git a/pkg/a.py b/pkg/a.py\n" + SOURCE_EDIT if kept_source else "")
    if kept:  # what is kept touches the source only, and applies
        applied = subprocess.run(
            ["git", "apply", "-v"], cwd=repo, input=kept.encode(), capture_output=True, check=True
        )
        assert b"tests/" not in applied.stderr and (repo / "pkg" / "a.py").read_text() == "x = 2\n"


def test_a_plain_unified_diff_is_read_file_by_file(repo):
    """What a model may submit: ``diff -u`` output with no ``diff --git`` lines, a new file among the
    edits, prose around them (left out)."""
    plain = (
        "The fix:\n"
        + SOURCE_EDIT
        + "and a helper\n--- /dev/null\n+++ b/pkg/helper.py\n@@ -0,0 +1 @@\n+h = 1\n"
        + TEST_PAIR
        + TEST_EDIT
        + "Done.\n"
    )
    kept, dropped = filter_patch(plain, ["pkg"])
    assert dropped == [("tests/test_a.py", "a test file")]
    assert kept == SOURCE_EDIT + "--- /dev/null\n+++ b/pkg/helper.py\n@@ -0,0 +1 @@\n+h = 1\n"
    subprocess.run(["git", "apply"], cwd=repo, input=kept.encode(), check=True)
    assert (repo / "pkg" / "helper.py").read_text() == "h = 1\n" and (
        repo / "pkg" / "a.py"
    ).read_text() == "x = 2\n"


NAMES = "--- a/pkg/a.py\n+++ b/pkg/a.py\n"


@pytest.mark.parametrize(
    "body,why",
    [
        ("@@ -1 +1 @@\n-x = 1\n+x = 2\n", "hunks without the ---/+++ lines that name their file"),
        ("similarity index 90%\n" + SOURCE_EDIT, "a header line git does not write"),
        (NAMES, "---/+++ lines without hunks"),
        (NAMES + "@@ -1,3 +1,3 @@\n-x = 1\n+x = 2\nsome text\n", "a line that is not a hunk's ('some text')"),
        (
            "--- a/pkg/a.py\n+++ b/pkg/b.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n",
            "---/+++ lines that name another file than its header",
        ),
        # a count past the hunk's lines, then another file's patch: where it starts is the tools' guess
        (NAMES + "@@ -1,9 +1,9 @@\n-x = 1\n+x = 2\n" + TEST_PAIR + TEST_EDIT, STRAY),
    ],
)
def test_sections_that_could_edit_another_file_or_that_git_would_not_write_are_dropped(body, why):
    kept, dropped = filter_patch("diff --git a/pkg/a.py b/pkg/a.py\n" + body, ["pkg"])
    assert kept == "" and dropped == [("pkg/a.py", why)]


def test_text_after_a_sections_counted_hunks_is_left_out():
    section = "diff --git a/pkg/a.py b/pkg/a.py\n" + SOURCE_EDIT
    assert filter_patch(section + "some text\n-- \n2.39.5\n", ["pkg"]) == (section, [])


def test_empty_context_lines_and_no_newline_markers_count_as_git_apply_counts_them(tmp_path):
    # an empty context line (a patch whose context spaces were stripped), "\\ No newline" markers
    ok = (
        "diff --git a/pkg/a.py b/pkg/a.py\n--- a/pkg/a.py\n+++ b/pkg/a.py\n@@ -1,2 +1,2 @@\n\n"
        "-x = 1\n\\ No newline at end of file\n+x = 2\n\\ No newline at end of file\n"
    )
    assert filter_patch(ok, ["pkg"]) == (ok, [])
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("\nx = 1")
    git(tmp_path, "init", "-q")
    subprocess.run(["git", "apply"], cwd=tmp_path, input=ok.encode(), check=True)
    assert (tmp_path / "pkg" / "a.py").read_text() == "\nx = 2"


def test_hand_written_hunks_whose_counts_are_not_met_are_left_to_patch_as_swebench_leaves_them(tmp_path):
    """A model's patch often miscounts its hunks: git apply refuses it and ``patch`` applies it
    (SWE-bench's harness falls back to it, and so do the graders here). What is kept applies with
    ``patch`` to the same file as the whole would: a count one short ends the hunk where both tools
    end it, one past the hunk's lines is kept whole (nothing in it could start another patch)."""
    if shutil.which("patch") is None:
        pytest.skip("GNU patch is not installed here (apt-get install patch)")
    header = "diff --git a/pkg/x.py b/pkg/x.py\n--- a/pkg/x.py\n+++ b/pkg/x.py\n"
    for counts, trimmed in (("-1,2 +1,2", True), ("-1,4 +1,4", False)):
        sloppy = f"{header}@@ {counts} @@\n a\n-b\n+B\n c\n"
        kept, dropped = filter_patch(sloppy, ["pkg"])
        assert dropped == [] and kept == (sloppy.removesuffix(" c\n") if trimmed else sloppy)
        results = []
        for text in (sloppy, kept):
            tree = tmp_path / f"{counts}-{len(results)}"
            (tree / "pkg").mkdir(parents=True)
            (tree / "pkg" / "x.py").write_text("a\nb\nc\nd\n")
            git(tree, "init", "-q")
            refused = subprocess.run(
                ["git", "apply", "--check"], cwd=tree, input=sloppy.encode(), capture_output=True
            )
            assert refused.returncode != 0
            subprocess.run(
                ["patch", "-p1", "--batch", "--fuzz=2"],
                cwd=tree,
                input=text.encode(),
                check=True,
                capture_output=True,
            )
            results.append((tree / "pkg" / "x.py").read_text())
        assert results[0] == results[1] == "a\nB\nc\nd\n"


def test_a_diff_u_of_two_trees_is_read_with_its_file_times(repo, tmp_path):
    """GNU diff's own output (``diff -ruN a b``): each file's time after a tab on its ---/+++ lines,
    and a ``diff -ruN`` line before each file, which is left out."""
    for side, text in (("a", "x = 1\n"), ("b", "x = 2\n")):
        (tmp_path / side / "pkg").mkdir(parents=True)
        (tmp_path / side / "pkg" / "a.py").write_text(text)
        (tmp_path / side / "tests").mkdir()
        (tmp_path / side / "tests" / "test_a.py").write_text(
            "def test():\n    assert " + ("False\n" if side == "a" else "True\n")
        )
    made = subprocess.run(["diff", "-ruN", "a", "b"], cwd=tmp_path, capture_output=True, text=True)
    assert made.returncode == 1 and "\t" in made.stdout.splitlines()[1]  # the file's time
    kept, dropped = filter_patch(made.stdout, ["pkg"])
    assert dropped == [("tests/test_a.py", "a test file")] and not kept.startswith("diff -ruN")
    subprocess.run(["git", "apply"], cwd=repo, input=kept.encode(), check=True)
    assert (repo / "pkg" / "a.py").read_text() == "x = 2\n"
    assert (repo / "tests" / "test_a.py").read_text() == "def test():\n    assert False\n"
