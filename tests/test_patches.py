"""filter_patch on patches made by real git: the task's source edits are kept and apply; tests,
configuration, start-up hooks, binaries, symlinks and odd headers are dropped with the reason."""

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
    assert {f.path for f in split_patch(kept)} == {"pkg/a.py", "pkg/we ird.py", "pkg/t\tab.py"}
    # what is kept applies to a pristine checkout
    fresh = tmp_path / "fresh"
    git(tmp_path, "clone", "-q", str(repo), str(fresh))
    git(fresh, "checkout", "-q", "HEAD~0")
    git(fresh, "reset", "-q", "--hard", git(repo, "rev-parse", "HEAD").decode().strip())
    subprocess.run(["git", "apply"], cwd=fresh, input=kept.encode(), check=True)
    assert (fresh / "pkg" / "a.py").read_text() == "x = 2\n"
    assert (fresh / "pkg" / "t\tab.py").read_text() == "z = 1\n"
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
