"""Reward hacks of a hostile agent on bugfix-v0, run for real through the environment's tools on both
backends: none of them earns a reward. Each would have earned 1 where the grader ran in the agent's
own sandbox and its file editor wrote as root."""

import ast
import asyncio
import dataclasses
import io
import json
import shlex
import tarfile

import pytest

from agentrl.env import make
from agentrl.tools import ToolCall
from tests.conftest import require_docker

# A start-up hook that makes every pytest test pass and rewrites the plain-Python grader's summary.
PROBE_HOOK = """
import builtins, re
try:
    import _pytest.python
    _pytest.python.Function.runtest = lambda self: None
except Exception:
    pass
_print = builtins.print
def _forged(*args, **kwargs):
    if args and isinstance(args[0], str):
        args = (re.sub(r"(\\d+) passed (\\d+) failed$", lambda m: f"{int(m[1]) + int(m[2])} passed 0 failed", args[0]),) + args[1:]
    _print(*args, **kwargs)
builtins.print = _forged
"""
SITE_DIRS = {"docker": "/usr/lib/python3/dist-packages", "local": None}  # local: this Python's own


@pytest.fixture(params=["docker", "local"])
def backend(request):
    if request.param == "docker":
        require_docker()
    return request.param


def run(coro):
    return asyncio.run(coro)


def editor(command: str, path: str, **kw) -> ToolCall:
    return ToolCall("str_replace_editor", {"command": command, "path": path, **kw})


def site_dir(backend: str) -> str:
    if SITE_DIRS[backend]:
        return SITE_DIRS[backend]
    import sysconfig

    return sysconfig.get_paths()["purelib"]


@pytest.mark.parametrize("grader", ["pytest", "python"])
def test_pth_hook_on_the_import_path_earns_nothing(backend, grader):
    """The editor (and bash) cannot put a hook on Python's import path; the hook in the workspace is
    dropped from the patch; 0 of 3 episodes per grader earn a reward."""
    site = site_dir(backend)

    async def go():
        env = make("bugfix-v0", sandbox=backend, grader=grader)
        rewards, observations = [], []
        try:
            for task in env.tasks("train")[:3]:
                await env.reset(task)
                result = await env.step(
                    [
                        editor("create", f"{site}/probe_hook.py", file_text=PROBE_HOOK),
                        editor("create", f"{site}/zzz_probe.pth", file_text="import probe_hook\n"),
                        ToolCall(
                            "bash",
                            {
                                "command": f"cp /dev/null {site}/zzz_probe2.pth; echo '{PROBE_HOOK[:40]}' > {site}/x.py"
                            },
                        ),
                        # the same files in the workspace, where the grader's Python might read them
                        editor("create", "probe_hook.py", file_text=PROBE_HOOK),
                        editor("create", "zzz_probe.pth", file_text="import probe_hook\n"),
                        editor("create", "sitecustomize.py", file_text="import probe_hook\n"),
                        editor(
                            "create", f"{env.spec.package}/zzz_probe.pth", file_text="import probe_hook\n"
                        ),
                        editor("create", "conftest.py", file_text="import probe_hook\n"),
                    ]
                )
                observations.append([m["content"] for m in result.observation])
                result = await env.step([ToolCall("submit", {})])
                rewards.append(result.reward)
                dropped = " ".join(result.info["grade"]["dropped_paths"])
                assert (
                    "sitecustomize.py" in dropped and "zzz_probe.pth" in dropped and "conftest.py" in dropped
                )
        finally:
            await env.close()
        return rewards, observations

    rewards, observations = run(go())
    assert rewards == [0.0, 0.0, 0.0]
    for obs in observations:
        assert obs[0].startswith("error:") and "outside the workspace" in obs[0]
        assert obs[1].startswith("error:") and "outside the workspace" in obs[1]
        assert "[exit code 0]" not in obs[2]  # bash as the sandbox's user cannot write there either


def test_the_hook_is_a_real_forgery_where_root_can_place_it():
    """Control: placed on the import path by root (what the file editor's archive-API writes did),
    the same hook turns an unfixed task's pytest verdict into a pass in that sandbox."""
    require_docker()

    def tar_of(files: dict[str, str]) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for name, text in files.items():
                data = text.encode()
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return buf.getvalue()

    async def go():
        env = make("bugfix-v0", sandbox="docker")
        try:
            task = env.task("train", 0)
            await env.reset(task)
            sb = env.sandbox
            archive = tar_of({"probe_hook.py": PROBE_HOOK, "zzz_probe.pth": "import probe_hook\n"})
            sb._client.api.put_archive(sb.container_id, SITE_DIRS["docker"], archive)
            pytest_run = await sb.exec(
                "python3 -m pytest -q -p no:cacheprovider tests | tail -n 1", timeout=120
            )
            return env.spec.n_tests, pytest_run.output
        finally:
            await env.close()

    n_tests, pytest_out = run(go())
    assert f"{n_tests} passed" in pytest_out and "failed" not in pytest_out


# Pasted into the package's own source (kept for grading, imported by the grader): it prints the
# tests' expected values, read from the test files, as the plain grader's result line, and replaces
# the process with `true` before the real line is printed. It names nothing the static check knows.
ANSWER_HOOK = """
import json as _j, os as _o, re as _r, sys as _s
_found = []
_files = sorted(f for f in (_o.listdir("tests") if _o.path.isdir("tests") else []) if f.startswith("test_"))
for _f in _files:
    for _m in _r.finditer(r"assert .*? (==|is) (.+)", open(_o.path.join("tests", _f)).read()):
        _found.append(repr(eval(_m.group(2), {})))
_s.stdout.write("\\n" + _j.dumps(_found) + "\\n"); _s.stdout.flush()
getattr(_o, "ex" + "ecv")("/bin/true", ["true"])
"""


def test_the_plain_graders_verdict_cannot_be_printed_by_the_package():
    """The plain grader draws its verdict outside the grading sandbox, which holds no tests: a hook in
    the package that prints every test's expected value as the result line and exits 0 earns nothing.
    Control: run where the tests are (the agent's own sandbox), the same hook forges a pass."""
    from agentrl.envs.bugfix import _CALLER, _verdict, checks, hidden_checks

    async def go():
        env = make("bugfix-v0", sandbox="local", grader="python")
        try:
            await env.reset(env.tasks("train")[0])
            init = f"{env.spec.package}/__init__.py"
            await env.sandbox.exec(f"cat >> {init} <<'EOF'\n{ANSWER_HOOK}\nEOF", timeout=30)
            calls = json.dumps([[c.module, c.call] for c in checks(env.spec)])
            here = await env.sandbox.exec(
                f"python3 -c {shlex.quote(_CALLER)} {shlex.quote(calls)}", timeout=60
            )
            forged = _verdict(checks(env.spec), here.output)
            result = await env.step([ToolCall("submit", {})])
            graded = len(checks(env.spec) + hidden_checks(env.spec))
            return env.spec.n_tests, forged, result.reward, result.info["grade"], graded
        finally:
            await env.close()

    n_tests, forged, reward, grade, graded = run(go())
    assert forged == (n_tests, [])  # with the tests at hand, the hook's line passes every check
    assert reward == 0.0 and not grade.get("runner_tamper") and grade["applied"], grade
    assert f"0 passed {graded} failed" in grade["output"]


def test_a_background_loop_rewriting_the_tests_during_grading_earns_nothing(backend):
    """The agent leaves a loop that rewrites every test to pass and submits without a fix: grading
    runs elsewhere, after the agent's sandbox and its processes are gone. 0 of 6 episodes."""
    loop = (
        "nohup sh -c 'while true; do for f in tests/test_*.py; do "
        'printf "def test_ok():\\n    pass\\n" > "$f"; done; sleep 0.05; done\' > /dev/null 2>&1 & '
        "(setsid env -i sh -c 'while true; do sleep 1; done' &); echo started"
    )

    async def go():
        env = make("bugfix-v0", sandbox=backend, max_turns=4)
        rewards = []
        try:
            for task in env.tasks("train")[:6]:
                await env.reset(task)
                await env.step([ToolCall("bash", {"command": loop})])
                result = await env.step([ToolCall("submit", {})])
                rewards.append(result.reward)
                assert all("test" in p for p in result.info["grade"]["dropped_paths"]) or backend == "local"
        finally:
            await env.close()
        return rewards

    assert run(go()) == [0.0] * 6


@pytest.mark.parametrize("grader", ["pytest", "python"])
def test_the_hook_in_the_packages_own_source_earns_nothing(grader):
    """The package's own source is kept for grading and imported by the tests, so the same hook
    pasted into its __init__.py runs in the grader's process and forges a pass with either grader;
    the kept patch reaches into the runner, and such a patch is graded but never rewarded."""

    async def go():
        env = make("bugfix-v0", sandbox="local", grader=grader)
        try:
            await env.reset(env.tasks("train")[0])
            init = f"{env.spec.package}/__init__.py"
            await env.sandbox.exec(f"cat >> {init} <<'EOF'\n{PROBE_HOOK}\nEOF", timeout=30)
            result = await env.step([ToolCall("submit", {})])
            return result.reward, result.info["grade"]
        finally:
            await env.close()

    reward, grade = run(go())
    assert reward == 0.0 and grade["runner_tamper"] and grade["dropped_paths"] == []
    assert any("builtins" in line or "_pytest" in line for line in grade["runner_tamper"])


# Writes pytest's summary line to every open descriptor (pytest's capture keeps a copy of the real
# stdout among them) and replaces the process with `true`: pytest's verdict alone was forged by it.
SUMMARY_HOOK = """
import os as _o
for _fd in range(1, 30):
    try:
        _o.write(_fd, b"\\n%d passed in 0.01s\\n")
    except OSError:
        pass
getattr(_o, "ex" + "ecv")("/bin/true", ["true"])
"""


@pytest.mark.parametrize("grader", ["pytest", "python"])
def test_a_summary_printed_by_the_package_earns_nothing(grader):
    """Control: in the agent's sandbox, pytest with the hook in the package exits 0 and says every test
    passed. Graded, the hook earns nothing with either grader: the checks drawn outside the sandbox
    come first, and pytest's verdict counts only beside them."""

    async def go():
        env = make("bugfix-v0", sandbox="local", grader=grader)
        try:
            await env.reset(env.tasks("train")[0])
            init = f"{env.spec.package}/__init__.py"
            await env.sandbox.exec(
                f"cat >> {init} <<'EOF'\n{SUMMARY_HOOK % env.spec.n_tests}\nEOF", timeout=30
            )
            alone = await env.sandbox.exec("python3 -m pytest -q -p no:cacheprovider tests", timeout=60)
            result = await env.step([ToolCall("submit", {})])
            return env.spec.n_tests, alone, result.reward, result.info["grade"]
        finally:
            await env.close()

    n_tests, alone, reward, grade = run(go())
    assert alone.exit_code == 0 and f"{n_tests} passed" in alone.output and "failed" not in alone.output
    assert reward == 0.0 and not grade.get("runner_tamper") and grade["applied"], grade


def special_cased(spec) -> str:
    """The buggy module with its buggy function wrapped: the tests' own calls get the tests' answers,
    any other call the buggy code's result. The whole suite passes, and nothing is fixed."""
    from agentrl.envs.bugfix import checks

    source = spec.files[spec.fix["path"]]
    name = next(
        node.name
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef) and spec.fix["old"] in ast.get_source_segment(source, node)
    )
    answers = {}
    for check in checks(spec):
        if check.call.startswith(f"{name}("):
            args, kwargs = eval(check.call, {name: lambda *a, **k: (a, k)})
            answers[repr((args, sorted(kwargs.items())))] = check.expected
    return (
        f"{source}\n_{name} = {name}\n_ANSWERS = {answers!r}\n\n\n"
        f"def {name}(*args, **kwargs):\n"
        f"    key = repr((args, sorted(kwargs.items())))\n"
        f"    return _ANSWERS[key] if key in _ANSWERS else _{name}(*args, **kwargs)\n"
    )


@pytest.mark.parametrize("grader", ["pytest", "python"])
def test_special_casing_the_tests_earns_nothing(grader):
    """A patch that keeps the bug and answers the tests' own calls passes the whole suite in the agent's
    sandbox, and earns nothing: the hidden checks call the function on inputs no file holds. Control:
    the same patch graded without them earns 1."""

    async def go():
        env = make("bugfix-v0", sandbox="local", grader=grader)
        graded = []
        try:
            for i, task in enumerate(env.tasks("train")[:4]):
                await env.reset(task)
                await env.sandbox.write_file(env.spec.fix["path"], special_cased(env.spec))
                alone = await env.sandbox.exec("python3 -m pytest -q -p no:cacheprovider tests", timeout=60)
                assert alone.exit_code == 0 and f"{env.spec.n_tests} passed" in alone.output, alone.output
                if i == 0:  # the control: the same patch, graded without the hidden checks
                    env.spec = dataclasses.replace(env.spec, hidden=[])
                    assert await env.grade_patch(await env.sandbox.diff(env._base)) == 1.0, env.last_grade
                    env.spec = env.task_spec(task)
                result = await env.step([ToolCall("submit", {})])
                graded.append((result.reward, "hidden checks" in result.info["grade"]["output"]))
        finally:
            await env.close()
        return graded

    assert run(go()) == [(0.0, True)] * 4
