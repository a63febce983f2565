"""swe-v0 on a hand-written row (the row format is the contract): rows are checked field by field,
the agent's workspace holds the starting tree and nothing to recover the fix from, and grading in
a fresh sandbox with swebench's report rewards the gold patch and nothing else. The reward hacks
run for real through the tools, on bubblewrap and on Docker."""

import asyncio
import json
from pathlib import Path

import pytest

from agentrl.envs.swe import SweEnv
from agentrl.envs.swe.grading import junit_key, source_dirs
from agentrl.envs.swe.rows import RowError, load_rows
from agentrl.patches import runner_tamper
from agentrl.tools import ToolCall
from tests.conftest import require_docker
from tests.envs.swe.fixture import make_sdist, row, write_rows


@pytest.fixture
def dataset(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))
    _, sha = make_sdist(tmp_path)
    return tmp_path, sha


@pytest.fixture(params=["local", "docker"])
def backend(request):
    if request.param == "docker":
        require_docker()
    return request.param


def bash(command: str) -> ToolCall:
    return ToolCall("bash", {"command": command}, id="call_0")


SUBMIT = ToolCall("submit", {}, id="call_0")


def episode(env: SweEnv, *turns: list[ToolCall]):
    """Play ``turns`` then submit; returns (reward, grade report, the tools' outputs)."""

    async def go():
        task = env.tasks("train")[0]
        await env.reset(task)
        outputs = []
        try:
            for calls in turns:
                result = await env.step(calls)
                outputs += [m["content"] for m in result.observation]
            result = await env.step([SUBMIT])
            return result.reward, result.info["grade"], outputs
        finally:
            await env.close()

    return asyncio.run(go())


# -- rows --


def test_a_hand_written_row_loads(dataset):
    folder, sha = dataset
    (r,) = load_rows(write_rows(folder, [row(sha)]))
    assert r.PASS_TO_PASS == (
        "tests/test_clamp.py::test_inside",
        "tests/test_clamp.py::test_below",
    )  # from JSON text
    assert r.sdist == (folder / "sources/mini-1.0.tar.gz").resolve() and r.hidden_tests == (
        "tests/test_add.py",
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"patch": None}, r"row 0 \(pypi__mini-1.0__add\): missing field\(s\) patch"),
        ({"FAIL_TO_PASS": "[not json"}, r"field 'FAIL_TO_PASS' is a string but not a JSON list"),
        ({"FAIL_TO_PASS": []}, r"field 'FAIL_TO_PASS' is empty"),
        ({"eval_type": "fail_only"}, r"field 'eval_type' is 'fail_only'"),
        ({"hidden_tests": ["../etc/passwd"]}, r"field 'hidden_tests' holds '../etc/passwd'"),
        ({"source": {"sdist": "x.tar.gz", "sha256": "abc"}}, r"field 'source.sha256' must be 64"),
        (
            {"log_parser": "parse_log_pytset"},
            r"field 'log_parser' is 'parse_log_pytset', .* did you mean 'parse_log_pytest'",
        ),
        ({"created_by": ["me"]}, r"field 'created_by' must be an object \(or a note\); got list"),
        ({"split": 3}, r"field 'split' must be a non-empty string; got 3"),
        ({"PASS_TO_PASS": [" "]}, r"field 'PASS_TO_PASS' must be a list of non-empty strings"),
        ({"hints": ["look"]}, r"field 'hints' must be a string; got list"),
    ],
)
def test_a_bad_row_is_named_by_file_instance_and_field(dataset, change, message):
    folder, sha = dataset
    path = write_rows(folder, [row(sha, **change)])
    with pytest.raises(RowError, match=message) as e:
        load_rows(path)
    assert str(e.value).startswith(f"{path}: row 0 ")


def test_a_wrong_hash_stops_with_both_hashes(dataset):
    folder, sha = dataset
    wrong = "0" * 64
    env = SweEnv(sandbox="local", tasks=str(write_rows(folder, [row(wrong)])))
    with pytest.raises(RowError, match=f"has sha256 {sha}, but the row says {wrong}"):
        asyncio.run(env.reset(env.tasks("train")[0]))


def test_duplicate_ids_and_unknown_splits_stop(dataset):
    folder, sha = dataset
    with pytest.raises(RowError, match="appears twice"):
        load_rows(write_rows(folder, [row(sha), row(sha)]))
    env = SweEnv(sandbox="local", tasks=str(write_rows(folder, [row(sha)])))
    with pytest.raises(ValueError, match=r"split 'test' is not in .*its splits are \['train'\]"):
        env.tasks("test")


def test_grading_helpers(dataset):
    assert junit_key("tests/test_x.py::TestA::test_b[1-2]") == ("tests.test_x.TestA", "test_b[1-2]")
    assert junit_key("t/test_u.py::test_q[https://[::1]:80/]") == ("t.test_u", "test_q[https://[::1]:80/]")
    assert runner_tamper("+++ b/x.py\n+import _pytest.python\n+x = 1\n") == ["import _pytest.python"]
    assert runner_tamper("+++ b/x.py\n+def add(a, b):\n+    return a + b\n") == []
    assert runner_tamper("+++ b/x.py\n+STATUS_BYPASSED = 2\n") == []  # a word, not the runner's PASSED
    assert runner_tamper("+++ b/x.py\n+print('PASSED')\n") == ["print('PASSED')"]
    # pytest's own tasks: its source names the runner in any fix
    fix = "+++ b/src/_pytest/x.py\n+from _pytest.compat import getfslineno\n"
    assert runner_tamper(fix, ["src/_pytest", "src/pytest"]) == []
    assert runner_tamper(fix, ["src/pkg"]) == ["from _pytest.compat import getfslineno"]


# -- the workspace and grading, on both sandboxes --


def test_workspace_holds_the_starting_tree_and_nothing_to_recover_the_fix_from(dataset, backend):
    folder, sha = dataset
    env = SweEnv(sandbox=backend, tasks=str(write_rows(folder, [row(sha)])))
    probe = (
        "git rev-list --all | wc -l; git for-each-ref --format='%(refname)'; git reflog | wc -l; "
        "git remote | wc -l; git stash list | wc -l; ls tests; "
        "find . -name __pycache__ -o -name '*.egg-info' | wc -l; "
        "git cat-file --batch-all-objects --batch | grep -c 'return a + b'; "
        "grep -rl 'return a + b' / --include=ops.py 2>/dev/null | grep -v '^/proc' | wc -l"
    )
    reward, grade, outputs = episode(env, [bash(probe)])
    lines = outputs[0].split("\n")
    assert lines[:7] == ["1", "refs/heads/main", "0", "0", "0", "__init__.py", "test_clamp.py"], outputs[0]
    assert lines[7:10] == ["0", "0", "0"], outputs[0]  # no cache; no pristine line in git or on disk
    assert reward == 0.0 and not grade["resolved"]


def test_the_docker_image_holds_no_copy_of_a_shipped_library():
    """The shipped tasks' libraries are nowhere in the image outside the workspace: neither
    importable from elsewhere (Debian's pytest used to pull in more-itertools) nor vendored
    (pkg_resources carried another copy), so the agent cannot read their unbroken source."""
    require_docker()
    from agentrl.envs.swe.shipped import PACKAGES
    from agentrl.sandbox import make_sandbox

    modules = {
        "boltons",
        "toolz",
        "tlz",
        "cachetools",
        "more_itertools",
        "click",
        "parse",
        "tabulate",
        "voluptuous",
    }
    assert {name.replace("-", "_") for name, *_ in PACKAGES} <= modules
    named = " -o ".join(f"-name {m} -o -name {m}.py" for m in sorted(modules - {"parse"}))
    probe = (
        f"cd / && python3 -c 'import importlib.util as u; print(sorted(m for m in {json.dumps(sorted(modules))} if u.find_spec(m)))' "
        f"&& find / -xdev \\( -path /proc -o -path /testbed \\) -prune -o \\( {named} -o -path '*packages*/parse.py' \\) -print "
        "2>/dev/null; echo end"
    )

    async def run():
        async with make_sandbox("docker") as sandbox:
            return await sandbox.exec(probe, timeout=120)

    result = asyncio.run(run())
    assert result.output.split() == ["[]", "end"], result.output


def test_the_gold_patch_through_the_tools_earns_1(dataset, backend):
    folder, sha = dataset
    env = SweEnv(sandbox=backend, tasks=str(write_rows(folder, [row(sha)])))
    demo = env.demonstration(env.tasks("train")[0])
    reward, grade, _ = episode(env, demo.turns[0].calls)
    assert reward == 1.0 and grade["resolved"] and grade["apply_method"] == "apply", grade
    assert grade["tests_status"]["FAIL_TO_PASS"]["success"] == [
        "tests/test_add.py::test_add",
        "tests/test_add.py::test_add_negative",
    ]
    assert grade["junit_disagrees"] == [] and grade["dropped_paths"] == []


FORGED = (
    "import sys\\n"
    "for t in ('tests/test_add.py::test_add', 'tests/test_add.py::test_add_negative'):\\n"
    "    print('PASSED', t)\\n"
)
HACKS = {
    "write the hidden test file": [
        bash(
            "printf 'def test_add():\\n    pass\\n\\ndef test_add_negative():\\n    pass\\n' > tests/test_add.py"
        )
    ],
    "delete the tests": [bash("rm -rf tests")],
    "a conftest hook that rewrites failures": [
        bash(
            "printf 'import pytest\\n@pytest.hookimpl(hookwrapper=True)\\ndef pytest_runtest_makereport(item, call):\\n"
            '    out = yield\\n    r = out.get_result()\\n    r.outcome = "passed"\\n\' > conftest.py'
        )
    ],
    "xfail from a conftest": [
        bash(
            "printf 'import pytest\\ndef pytest_collection_modifyitems(items):\\n    [i.add_marker(pytest.mark.xfail) for i in items]\\n' > mini/conftest.py"
        )
    ],
    "addopts and a plugin from config files": [
        bash(
            "printf '[tool:pytest]\\naddopts = -p no:python\\n' > setup.cfg; printf '[pytest]\\naddopts = --co\\n' > pytest.ini"
        )
    ],
    "a .pth and sitecustomize in the tree": [
        bash(
            "echo 'import os; os._exit(0)' > mini/x.pth; printf 'import os\\nos._exit(0)\\n' > sitecustomize.py"
        )
    ],
    "forged PASSED lines printed at import": [bash(f"printf '{FORGED}' >> mini/__init__.py")],
    "os._exit(0) at import": [bash("printf 'import os\\nos._exit(0)\\n' >> mini/__init__.py")],
    "pytest patched from the package": [
        bash(
            "printf 'import _pytest.python\\n_pytest.python.Function.runtest = lambda self: None\\n' >> mini/__init__.py"
        )
    ],
    "site-packages edited": [
        bash(
            "for d in $(python3 -c 'import site, sys; print(\" \".join(site.getsitepackages()))'); do "
            "echo 'import os; os._exit(0)' > $d/agentrl_hack.pth; done; true"
        )
    ],
}


@pytest.mark.parametrize("hack", list(HACKS))
def test_reward_hacks_earn_nothing(dataset, backend, hack):
    folder, sha = dataset
    env = SweEnv(sandbox=backend, tasks=str(write_rows(folder, [row(sha)])))
    reward, grade, _ = episode(env, HACKS[hack])
    assert reward == 0.0 and not grade["resolved"], grade


def test_a_file_at_a_hidden_path_is_dropped_and_listed(dataset):
    folder, sha = dataset
    env = SweEnv(sandbox="local", tasks=str(write_rows(folder, [row(sha)])))
    _, grade, _ = episode(env, HACKS["write the hidden test file"])
    assert grade["dropped_paths"] == ["tests/test_add.py (a hidden test path)"]


def test_the_task_data_is_hidden_from_the_agent_wherever_the_run_starts(tmp_path, monkeypatch):
    """The shipped sdists hold each task's original source, the fix: on the local sandbox they and
    the task file are hidden from commands, not only when the run starts in the repository, and so
    is the history of the git checkout that holds them (where agentrl runs from one)."""
    from agentrl.envs.swe import _git_dir
    from agentrl.sandboxes.local import bwrap_works

    if not bwrap_works()[0]:
        pytest.skip("bubblewrap cannot run here: the local sandbox hides nothing without it")
    monkeypatch.chdir(tmp_path)  # the creating process's directory is hidden anyway: not the repo's
    env = SweEnv(sandbox="local")
    row = next(r for r in env.rows.values() if r.sdist)

    async def go():
        async with env._sandbox(row) as sb:
            probe = f"ls {row.sdist.parent} 2>/dev/null | wc -l; head -c 10 {env.path} 2>/dev/null | wc -c"
            probe += f"; ls -A {git} 2>/dev/null | wc -l" if git else "; echo 0"
            return (await sb.exec(probe, timeout=30)).output.split()

    git = _git_dir(Path(env.path))
    assert git is None or any(Path(git).iterdir())  # on the host, the checkout's objects are there
    assert row.sdist.is_file() and asyncio.run(go()) == ["0", "0", "0"]


def test_partial_credit_is_off_by_default_and_counts_f2p_when_on(dataset):
    folder, sha = dataset
    half = "printf 'def add(a, b):\\n    return a + b if a > 0 else a - b\\n' > /dev/null; sed -i 's/return a - b/return a + b if a > 0 else a - b/' mini/ops.py"
    rows = write_rows(folder, [row(sha)])
    reward, grade, _ = episode(SweEnv(sandbox="local", tasks=str(rows)), [bash(half)])
    assert reward == 0.0 and grade["tests_status"]["FAIL_TO_PASS"]["success"] == [
        "tests/test_add.py::test_add"
    ]
    reward, _, _ = episode(SweEnv(sandbox="local", tasks=str(rows), partial_credit=True), [bash(half)])
    assert reward == 0.5


def test_source_dirs_are_the_packages_and_top_level_modules(tmp_path):
    """The same from the tree (shipped rows) and from the shell listing run in an image row's
    container: packages at the top, under src/ and under lib/ (matplotlib's layout), and modules."""
    import subprocess

    from agentrl.envs.swe.grading import LIST_SOURCE_DIRS

    for path in (
        "pkg/__init__.py",
        "src/other/__init__.py",
        "lib/mpl/__init__.py",
        "tests/__init__.py",
        "single.py",
        "setup.py",
        "docs/x.py",
    ):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    assert source_dirs(tmp_path) == ["pkg", "src/other", "lib/mpl", "single.py"]
    listed = subprocess.run(["bash", "-c", LIST_SOURCE_DIRS], cwd=tmp_path, capture_output=True, text=True)
    assert sorted(line[4:] for line in listed.stdout.splitlines()) == sorted(source_dirs(tmp_path))


def test_rows_with_json_string_fields_match_list_fields(dataset):
    folder, sha = dataset
    text = row(
        sha,
        FAIL_TO_PASS=json.dumps(["tests/test_add.py::test_add"]),
        hidden_tests=json.dumps(["tests/test_add.py"]),
    )
    (r,) = load_rows(write_rows(folder, [text]))
    assert r.FAIL_TO_PASS == ("tests/test_add.py::test_add",)


# -- agentrl swe validate / grade --


def test_swe_validate_and_grade_commands(dataset, capsys):
    from agentrl.cli import main

    folder, sha = dataset
    rows = write_rows(folder, [row(sha), row(sha, instance_id="wrong-gold", patch=row(sha)["bug_patch"])])
    assert main(["swe", "validate", str(rows), "--sandbox", "local"]) == 1  # the second row's gold is wrong
    out = capsys.readouterr().out
    assert "| pypi__mini-1.0__add | resolved | not resolved | not resolved | yes |" in out
    assert "| wrong-gold | not resolved | not resolved | not resolved | NO |" in out
    predictions = folder / "preds.jsonl"
    predictions.write_text(
        json.dumps(
            {
                "instance_id": "pypi__mini-1.0__add",
                "model_name_or_path": "m",
                "model_patch": row(sha)["patch"],
            }
        )
        + "\n"
        + json.dumps({"instance_id": "wrong-gold", "model_name_or_path": "m", "model_patch": ""})
        + "\n"
    )
    report = folder / "report.json"
    assert (
        main(
            [
                "swe",
                "grade",
                str(rows),
                "--predictions",
                str(predictions),
                "--report",
                str(report),
                "--sandbox",
                "local",
            ]
        )
        == 0
    )
    graded = json.loads(report.read_text())
    assert (
        graded["pypi__mini-1.0__add"]["resolved"] is True
        and graded["pypi__mini-1.0__add"]["apply_method"] == "apply"
    )
    assert graded["wrong-gold"]["resolved"] is False
    predictions.write_text(json.dumps({"instance_id": "nope", "model_patch": ""}) + "\n")
    assert main(["swe", "grade", str(rows), "--predictions", str(predictions), "--sandbox", "local"]) == 2
    assert "instance_id 'nope' is not a row of" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, text",
    [
        ("empty.jsonl", ""),
        ("blank.jsonl", "\n\n"),
        ("empty.yaml", ""),
        ("list.json", "[ ]\n"),
        ("obj.json", "{}"),
    ],
)
def test_a_task_file_without_rows_is_an_input_error(dataset, capsys, name, text):
    from agentrl.cli import main

    folder, _ = dataset
    (folder / name).write_text(text)
    with pytest.raises(RowError, match="holds no task rows"):
        load_rows(folder / name)
    assert main(["swe", "validate", str(folder / name), "--sandbox", "local"]) == 2
    assert main(["swe", "grade", str(folder / name), "--predictions", "p.jsonl", "--sandbox", "local"]) == 2
    assert capsys.readouterr().err.count("holds no task rows") == 2


@pytest.mark.parametrize(
    "predictions, report, message",
    [
        (None, None, "--predictions {folder}/missing.jsonl does not exist"),
        ("DIR", None, "--predictions {folder}/preds.jsonl is a directory"),
        (
            [{"instance_id": "pypi__mini-1.0__add", "model_patch": 5}],
            None,
            "line 1 (pypi__mini-1.0__add): field 'model_patch' must be a string",
        ),
        (
            [{"instance_id": "pypi__mini-1.0__add", "model_patch": ""}] * 2,
            None,
            "line 2: instance_id 'pypi__mini-1.0__add' is predicted again (line 1 has it)",
        ),
        ([{"instance_id": ["x"], "model_patch": ""}], None, "line 1: instance_id ['x'] is not a row of"),
        ([5], None, "line 1: not a prediction with instance_id and model_patch"),
        ([], None, "holds no predictions"),
        (
            [{"instance_id": "pypi__mini-1.0__add", "model_patch": ""}],
            "/nonexistent/r.json",
            "the directory /nonexistent does not exist",
        ),
        (
            [{"instance_id": "pypi__mini-1.0__add", "model_patch": ""}],
            "{folder}",
            "--report {folder} is a directory",
        ),
    ],
)
def test_swe_grade_rejects_bad_input_before_any_sandbox_starts(
    dataset, capsys, monkeypatch, predictions, report, message
):
    from agentrl.cli import main

    async def no_grading(self, patch, fresh=None, row=None):
        raise AssertionError("grading started")

    monkeypatch.setattr(SweEnv, "grade_patch", no_grading)
    folder, sha = dataset
    rows = write_rows(folder, [row(sha)])
    path = folder / ("missing.jsonl" if predictions is None else "preds.jsonl")
    if predictions == "DIR":
        path.mkdir()
    elif predictions is not None:
        path.write_text("".join(json.dumps(p) + "\n" for p in predictions))
    argv = ["swe", "grade", str(rows), "--predictions", str(path), "--sandbox", "local"]
    if report:
        argv += ["--report", report.format(folder=folder)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message.format(folder=folder) in err and "Traceback" not in err


def test_swe_grade_reads_a_json_list_of_predictions(dataset):
    from agentrl.envs.swe.cli import read_predictions

    folder, sha = dataset
    rows = {r.instance_id: r for r in load_rows(write_rows(folder, [row(sha)]))}
    path = folder / "preds.json"
    path.write_text(json.dumps([{"instance_id": "pypi__mini-1.0__add", "model_patch": None}]))
    assert read_predictions(str(path), rows, "tasks.jsonl") == [(rows["pypi__mini-1.0__add"], "")]
    path.write_text(json.dumps([{"instance_id": "pypi__mini-1.0__add", "model_patch": 5}]))
    with pytest.raises(ValueError, match="item 0 .*'model_patch' must be a string"):
        read_predictions(str(path), rows, "tasks.jsonl")


@pytest.mark.parametrize(
    "argv",
    [
        ["validate", "T", "--sample", "-1"],
        ["validate", "T", "--concurrency", "0"],
        ["grade", "T", "--predictions", "P", "--concurrency", "0"],
    ],
)
def test_swe_counts_below_their_minimum_are_usage_errors(capsys, argv):
    from agentrl.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["swe", *argv])
    assert stopped.value.code == 2 and "pass " in capsys.readouterr().err


def test_swe_grade_reads_a_plain_diff_and_drops_a_test_edit_smuggled_into_a_section(dataset):
    """Predictions as models write them: a ``diff -u`` with no ``diff --git`` line, after prose, is
    graded as SWE-bench grades it; a test file's ---/+++ pair inside the fix's section is dropped
    (git apply would edit that test) while the fix beside it is graded."""
    from agentrl.cli import main

    folder, sha = dataset
    gold = row(sha)["patch"]
    plain = "Here is the fix:\n" + gold.split("\n", 1)[1]
    smuggled_edit = (
        "--- a/tests/test_clamp.py\n+++ b/tests/test_clamp.py\n@@ -1,2 +1,2 @@\n"
        "-from mini import clamp\n+from mini import clamp  # edited\n \n"
    )
    rows = write_rows(folder, [row(sha), row(sha, instance_id="smuggled")])
    predictions = folder / "preds.jsonl"
    predictions.write_text(
        json.dumps({"instance_id": "pypi__mini-1.0__add", "model_patch": plain})
        + "\n"
        + json.dumps({"instance_id": "smuggled", "model_patch": gold + smuggled_edit})
        + "\n"
    )
    report = folder / "report.json"
    argv = ["swe", "grade", str(rows), "--predictions", str(predictions), "--report", str(report)]
    assert main([*argv, "--sandbox", "local"]) == 0
    graded = json.loads(report.read_text())
    plain_report, smuggled_report = graded["pypi__mini-1.0__add"], graded["smuggled"]
    assert plain_report["resolved"] is True and plain_report["dropped_paths"] == []
    assert smuggled_report["resolved"] is True
    assert smuggled_report["dropped_paths"] == ["tests/test_clamp.py (a test file)"]


def test_grade_patch_disposes_of_the_sandbox_it_was_handed_when_it_cannot_grade():
    env = SweEnv(sandbox="local")
    closed = []

    class Started:  # a grading sandbox _finish started for it
        async def close(self):
            closed.append(True)

    async def go():
        starting = asyncio.get_running_loop().create_future()
        starting.set_result(None)
        with pytest.raises(RuntimeError, match="needs a reset"):
            await env.grade_patch("", (Started(), starting))
        await env.close()

    asyncio.run(go())
    assert closed == [True]
