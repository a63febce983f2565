"""Rows in SWE-bench's published layout: an image that holds the repository at /testbed at
base_commit, graded by the row's own eval_script. Tested with an image built here in that layout."""

import asyncio
import io
import json
import subprocess
import tarfile

import pytest

from agentrl.envs.swe import SweEnv
from agentrl.envs.swe.rows import RowError, load_rows
from agentrl.tools import ToolCall
from tests.conftest import require_docker
from tests.envs.swe.fixture import BUGGY, GOLD, SOURCE, diff

IMAGE = "agentrl/test-swebench-layout:1"
ADD_TESTS = SOURCE["mini-1.0/tests/test_add.py"]


def _repo(tmp_path):
    """The repository as SWE-bench's images hold it: the buggy code committed, the F2P tests not yet."""
    repo = tmp_path / "testbed"
    for name, text in SOURCE.items():
        rel = name.split("/", 1)[1]
        if rel == "tests/test_add.py":
            continue
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(BUGGY if rel == "mini/ops.py" else text)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    base = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    # a later commit with the fix, as a clone of the real repository would carry: the workspace must not
    (repo / "mini/ops.py").write_text(SOURCE["mini-1.0/mini/ops.py"])
    subprocess.run([*git, "commit", "-qam", "the fix"], check=True)
    subprocess.run([*git, "checkout", "-q", base], check=True)
    return repo, base


@pytest.fixture(scope="module")
def image_row(tmp_path_factory):
    require_docker()
    import docker

    tmp = tmp_path_factory.mktemp("image")
    repo, base = _repo(tmp)
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        dockerfile = b"FROM agentrl/base:bookworm\nCOPY testbed /testbed\nRUN chown -R agent:agent /testbed\n"
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(dockerfile)
        tar.addfile(info, io.BytesIO(dockerfile))
        tar.add(repo, arcname="testbed")
    context.seek(0)
    client = docker.from_env()
    client.images.build(
        fileobj=context, custom_context=True, tag=IMAGE, rm=True, pull=False, network_mode="none"
    )
    test_patch = diff("tests/test_add.py", "", ADD_TESTS).replace(
        "--- a/tests/test_add.py", "new file mode 100644\n--- /dev/null"
    )
    eval_script = "\n".join(
        [
            "#!/bin/bash",
            "set -uxo pipefail",
            "cd /testbed",
            f"git checkout {base} tests/test_clamp.py",
            "git apply -v - <<'EOF_114329324912'",
            test_patch.rstrip("\n"),
            "EOF_114329324912",
            ": '>>>>> Start Test Output'",
            "python3 -m pytest -rA -p no:cacheprovider tests/test_add.py tests/test_clamp.py",
            ": '>>>>> End Test Output'",
            f"git checkout {base} tests/test_clamp.py",
        ]
    )
    row = {
        "instance_id": "mini__mini-1",
        "repo": "mini/mini",
        "version": "1.0",
        "problem_statement": "add(2, 3) returns -1.",
        "FAIL_TO_PASS": ["tests/test_add.py::test_add", "tests/test_add.py::test_add_negative"],
        "PASS_TO_PASS": ["tests/test_clamp.py::test_inside", "tests/test_clamp.py::test_below"],
        "patch": GOLD,
        "test_patch": test_patch,
        "log_parser": "parse_log_pytest",
        "eval_type": "pass_and_fail",
        "image": IMAGE,
        "base_commit": base,
        "eval_script": eval_script,
    }
    path = tmp / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    yield path
    client.images.remove(IMAGE, force=True)


def _episode(env, calls):
    async def go():
        task = env.tasks("train")[0]
        await env.reset(task)
        try:
            out = []
            for c in calls:
                result = await env.step([c])
                out += [m["content"] for m in result.observation]
            result = await env.step([ToolCall("submit", {}, id="s")])
            return result.reward, result.info["grade"], out
        finally:
            await env.close()

    return asyncio.run(go())


def test_an_image_row_is_run_and_graded_with_its_own_eval_script(image_row):
    env = SweEnv(sandbox="docker", tasks=str(image_row))
    probe = ToolCall(
        "bash",
        {"command": "git rev-list --all | wc -l; git reflog | wc -l; grep -c 'a - b' mini/ops.py"},
        id="p",
    )
    gold = env.demonstration(env.tasks("train")[0]).turns[0].calls[0]
    reward, grade, out = _episode(env, [probe, gold])
    assert out[0].split("\n")[:3] == ["1", "0", "1"], out[0]  # one commit: the later fix is not reachable
    assert reward == 1.0 and grade["resolved"] and grade["apply_method"] == "apply", grade
    reward, grade, _ = _episode(env, [])
    assert reward == 0.0 and grade["tests_status"]["FAIL_TO_PASS"]["failure"], grade
    conftest = ToolCall(
        "bash",
        {
            "command": "printf 'import pytest\\n@pytest.hookimpl(hookwrapper=True)\\ndef pytest_runtest_makereport(item, call):\\n"
            '    out = yield\\n    out.get_result().outcome = "passed"\\n\' > conftest.py'
        },
        id="c",
    )
    reward, grade, _ = _episode(env, [conftest])
    assert reward == 0.0 and grade["dropped_paths"] == ["conftest.py (a test file)"], grade


def test_image_rows_need_docker_and_their_fields(image_row, tmp_path):
    env = SweEnv(sandbox="local", tasks=str(image_row))
    with pytest.raises(ValueError, match="is an image row .* set sandbox.kind=docker"):
        asyncio.run(env.reset(env.tasks("train")[0]))
    raw = json.loads(image_row.read_text())
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**raw, "base_commit": "not-a-sha"}) + "\n")
    with pytest.raises(RowError, match="field 'base_commit' must be a git commit"):
        load_rows(bad)
    for change, message in (
        ({"split": 3}, "field 'split' must be a non-empty string; got 3"),
        ({"test_patch": ["a"]}, "field 'test_patch' must be a string; got list"),
        ({"log_parser": "pytest"}, "field 'log_parser' is 'pytest', which swebench's PARSER_REGISTRY"),
    ):
        bad.write_text(json.dumps({**raw, **change}) + "\n")
        with pytest.raises(RowError, match=message):
            load_rows(bad)
