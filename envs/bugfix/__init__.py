"""``bugfix-v0``: fix the one bug in a small generated Python project so that its pytest suite passes.

Reward is 1 if and only if the whole suite passes after the agent's edits, graded in a fresh
sandbox (never the one the agent used, which is closed first with every process in it) holding the
task's pristine files plus the agent's diff filtered to the package's non-test source
(``agentrl.patches``): edits to tests, test configuration (``conftest.py``, ``pytest.ini``, ...)
or start-up hooks (``*.pth``, ``sitecustomize.py``) do not count. The grader runs with a cleared
environment and no bytecode. The number of passing tests must equal the task's, so skipping or
deselecting tests earns nothing. The verdict is computed outside the sandbox: the tests' files
are removed from the grading sandbox, a runner there imports the package and evaluates each test's
call, and the results are compared here with the expected values, which never enter the sandbox.
Code in the package can print anything, but cannot know what to print without computing it. Each
function is also checked on hidden inputs (``generator.HIDDEN_PER_FUNCTION`` each, drawn per task,
in no file of the task): a patch that special-cases the tests' inputs fails them.
``grader: pytest`` then puts the tests back and runs them with pytest too; both must pass. (The
package runs in pytest's process, so pytest's verdict alone can be forged; a kept line that reaches
into the runner is also graded but never rewarded: ``agentrl.patches.runner_tamper``.)

Knobs: ``n_modules``, ``n_distractors`` (correct functions beside the buggy one, per module),
``packages`` / ``modules`` (the names drawn from; a single name each fixes the file layout),
``templates`` (the function templates drawn from, by name: ``generator.TEMPLATE_NAMES``),
``single_bug`` (each template injects only its first bug kind, so the function's name tells the fix),
``name_failing_test`` (say which tests fail in the prompt), ``max_turns``, ``on_no_tool_call``
(``end`` the episode, or ``remind`` the agent to use a tool), ``grader`` (``python``, the default:
the checks above, pytest's verdict for these generated suites at about a fifth of the start-up
cost; ``pytest``: the checks, then the suite under pytest),
``expert_run_tests`` / ``expert_miss`` (the scripted expert's ``demonstration``: whether it runs the
tests, and the share of tasks on which its fix has a one-token slip that fails).
"""

from __future__ import annotations

import ast
import asyncio
import functools
import hashlib
import json
import math
import os
import re
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.coding_env import CodingEpisodeEnv
from agentrl.env import Demonstration, DemoTurn, Observation, Task, TaskList
from agentrl.envs.bugfix.generator import (
    SPLITS,
    BugfixTask,
    check_layout,
    describe,
    fails_after,
    generate,
)
from agentrl.patches import filter_patch, runner_tamper
from agentrl.sandbox import make_sandbox, resolve_kind, to_bytes
from agentrl.tools import CODING_TOOLS, ToolCall, render_hermes

SPLIT_SIZES = {"train": 100_000, "test": 10_000}  # tasks per split (generated on demand)

SYSTEM_PROMPT = (
    "You are a careful software engineer. You work in a repository through tools: run shell commands "
    "with `bash`, read and edit files with `str_replace_editor`, and call `submit` when you are done."
)
_APPLY_FAILED = "agentrl: the submission did not apply"
_SUBMISSION = ".agentrl-submission.patch"
_PASSED = re.compile(r"(\d+) passed")
# grader="python": in the grading sandbox, which holds no tests, evaluate each test's call (its
# module, its expression) in the namespace of the package's module, and print the reprs of the
# results (None for an exception, SystemExit too) as the last line, in JSON. The verdict is drawn here.
_CALLER = r"""
import importlib, json, os, sys
sys.dont_write_bytecode = True
sys.path.insert(0, os.getcwd())
results = []
for module, call in json.loads(sys.argv[1]):
    try:
        results.append(repr(eval(call, dict(vars(importlib.import_module(module))))))
    except BaseException as e:
        results.append(None)
sys.stdout.write("\n" + json.dumps(results) + "\n")
"""


@dataclass(frozen=True)
class Check:
    """One generated test, ``assert CALL == EXPECTED`` (or ``is``), or a hidden check: what the grading
    sandbox evaluates (``module``, ``call``) and what it is compared with here (``op``, ``expected``;
    ``Close``: equal, floats to a relative 1e-9, since an equivalent fix may round otherwise)."""

    test: str
    module: str
    call: str
    op: str
    expected: Any


def checks(spec: BugfixTask) -> list[Check]:
    """The task's tests as calls and expected values (each generated test is one such ``assert``)."""
    found = []
    for path in spec.test_files:
        if not path.startswith("tests/test_"):
            continue
        module = f"{spec.package}.{path[len('tests/test_') : -3]}"
        for node in ast.parse(spec.files[path]).body:
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
                continue
            (stmt,) = node.body
            compare = stmt.test
            assert isinstance(stmt, ast.Assert) and isinstance(compare, ast.Compare)
            (op,) = compare.ops
            (right,) = compare.comparators
            expected = eval(compile(ast.Expression(right), path, "eval"), {"__builtins__": {}})
            found.append(
                Check(f"{path}::{node.name}", module, ast.unparse(compare.left), type(op).__name__, expected)
            )
    return found


def hidden_checks(spec: BugfixTask) -> list[Check]:
    """The task's hidden checks (``BugfixTask.hidden``): booleans by identity, as the tests check them."""
    return [
        Check(f"hidden::{module}::{call}", module, call, "Is" if isinstance(want, bool) else "Close", want)
        for module, call, want in spec.hidden
    ]


def _matches(value: Any, check: Check) -> bool:
    if check.op == "Is":
        return value is check.expected
    return _close(value, check.expected) if check.op == "Close" else bool(value == check.expected)


def _close(value: Any, want: Any) -> bool:
    if isinstance(value, float) and isinstance(want, float):
        return math.isclose(value, want, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(value, list) and isinstance(want, list):
        return len(value) == len(want) and all(_close(v, w) for v, w in zip(value, want, strict=True))
    return bool(value == want)


def _verdict(checks_: list[Check], output: str) -> tuple[int, list[str]]:
    """(tests passed, failing tests) from the caller's last line of ``output``."""
    results = None
    for line in reversed(output.splitlines()):
        try:
            parsed = json.loads(line)
        except (ValueError, RecursionError):  # whatever the package's code printed
            continue
        if isinstance(parsed, list) and len(parsed) == len(checks_):
            results = parsed
            break
    if results is None:
        return 0, [c.test for c in checks_]
    failing = []
    for check, result in zip(checks_, results, strict=True):
        try:
            value = ast.literal_eval(result) if isinstance(result, str) else _NO_RESULT
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            value = _NO_RESULT
        if value is _NO_RESULT or not _matches(value, check):
            failing.append(check.test)
    return len(checks_) - len(failing), failing


_NO_RESULT = object()


class BugfixEnv(CodingEpisodeEnv):
    """An ``AgentEnv``; one sandbox per episode, made at ``reset``."""

    deterministic = True

    def __init__(
        self,
        sandbox: str = "auto",
        sandbox_config: dict[str, Any] | None = None,
        n_modules: int = 2,
        n_distractors: int = 2,
        name_failing_test: bool = True,
        max_turns: int = 12,
        on_no_tool_call: str = "remind",
        command_timeout: float = 60.0,
        max_observation_chars: int = 8_000,
        compact_tools: bool = False,
        seed: int = 0,
        packages: list[str] | None = None,
        modules: list[str] | None = None,
        templates: list[str] | None = None,
        single_bug: bool = False,
        grader: str = "python",
        expert_run_tests: bool = True,
        expert_miss: float = 0.0,
    ):
        if grader not in ("pytest", "python"):
            raise ValueError(f"grader must be 'pytest' or 'python'; got {grader!r}")
        if sandbox not in ("auto", "docker", "local"):
            raise ValueError(f"sandbox must be 'auto', 'docker' or 'local'; got {sandbox!r}")
        self._init_episode(max_turns, on_no_tool_call)
        if not 0.0 <= expert_miss <= 1.0:
            raise ValueError(
                f"expert_miss is the share of tasks with a slipped fix, in [0, 1]; got {expert_miss!r}"
            )
        self.expert_run_tests, self.expert_miss = bool(expert_run_tests), float(expert_miss)
        self.backend = resolve_kind(sandbox)
        self.sandbox_config = dict(sandbox_config or {})
        self.n_modules, self.n_distractors, self.seed = n_modules, n_distractors, seed
        packages, modules, templates = check_layout(
            n_modules, n_distractors, packages, modules, templates, single_bug
        )
        # what generate() draws each task from, beside its layout
        self.draw = {
            "packages": packages,
            "modules": modules,
            "templates": templates,
            "single_bug": single_bug,
        }
        self.name_failing_test = name_failing_test
        self.grader = grader
        self.command_timeout = command_timeout
        self.max_observation_chars = max_observation_chars
        # Compact tool specs (no descriptions) keep small models' prompts short.
        self.tools = [_compact(t) for t in CODING_TOOLS] if compact_tools else list(CODING_TOOLS)
        self.spec: BugfixTask | None = None

    # -- tasks --
    def task(self, split: str, index: int) -> Task:
        spec = self._generate(split, index)
        return Task(spec.id, {"split": split, "index": index, "key": spec.key[:16]})

    def tasks(self, split: str) -> TaskList:
        """The split's generated tasks (``SPLIT_SIZES``), each made when it is asked for. The held-out
        split's tasks are distinct up to names, so a narrow layout (``n_modules``, ``n_distractors``,
        ``templates``) holds fewer: a task past them raises ``HeldOutExhausted`` (an ``IndexError``)
        naming how many there are."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}; got {split!r}")
        return TaskList(SPLIT_SIZES[split], functools.partial(self.task, split))

    def demonstration(self, task: Task) -> Demonstration:
        """The scripted expert's episode (``expert_turns`` with ``expert_run_tests`` and
        ``expert_miss``): reward 1, or 0 when its fix has a slip (imitated all the same)."""
        spec = self.task_spec(task)
        turns = expert_turns(spec, self.expert_run_tests, self.expert_miss)
        slipped = any(
            c.arguments.get("new_str", spec.fix["new"]) != spec.fix["new"] for t in turns for c in t
        )
        return Demonstration([DemoTurn(calls) for calls in turns], reward=0.0 if slipped else 1.0)

    def corpus(self) -> list[str]:
        """Text for a tokenizer trained for this environment: the tool specs its prompts show, and
        the files, prompt and expert's calls (its right fix, then submit) of 40 of its own training
        tasks, and the test runner's summary lines."""
        texts = [json.dumps(t) for t in self.tools]
        for i in range(40):
            task = self._generate("train", i)
            texts += list(task.files.values()) + [describe(task, self.name_failing_test)]
            texts.append(render_hermes([c for turn in expert_turns(task) for c in turn]))
        texts += ["passed in 0.03s\n[exit code 0]\n", "failed, 14 passed\n\n[exit code 1]\n", "\n\n\n\n"] * 3
        return texts

    def task_spec(self, task: Task) -> BugfixTask:
        try:
            split, index = task.data["split"], int(task.data["index"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"bugfix task {task.id!r} needs data {{'split': 'train'|'test', 'index': int}}; got {task.data!r}"
            ) from None
        spec = self._generate(split, index)
        key = task.data.get("key")
        if key is not None and key != spec.key[:16]:
            raise ValueError(
                f"bugfix task {task.id!r} was drawn as another task (key {key}, now {spec.key[:16]}): it "
                "comes from another version of the generator or of the env's arguments, and cannot be "
                "rebuilt; replay its stored episode without --reexec"
            )
        return spec

    def _generate(self, split: str, index: int) -> BugfixTask:
        return generate(
            split,
            index,
            n_modules=self.n_modules,
            n_distractors=self.n_distractors,
            seed=self.seed,
            **self.draw,
        )

    # -- episode --
    async def reset(self, task: Task) -> Observation:
        await self._close_sandbox()
        self.spec = self.task_spec(task)
        self.sandbox = sandbox = self._new_sandbox()  # closed by the next reset or close
        await sandbox.start()
        self._begin_episode(sandbox, await self._install_task(sandbox))
        return self.observation(task)

    def _new_sandbox(self):
        return make_sandbox(self.backend, **self.sandbox_config)

    async def _install_task(
        self, sandbox, extra: dict[str, str] | None = None, commit: bool = True, tests_only: bool = False
    ) -> str:
        """Put the task's files (and ``extra`` ones; with ``tests_only``, its tests alone) in
        ``sandbox``'s workspace, and commit them; returns the commit ("" with ``commit=False``)."""
        if tests_only:
            files = {p: c for p, c in self.spec.files.items() if p.startswith("tests/")}
        else:
            files = {**self.spec.files, **(extra or {})}
        with tempfile.TemporaryDirectory(prefix="agentrl-bugfix-") as tmp:
            root = Path(tmp) / "task"
            for path, content in files.items():
                (root / path).parent.mkdir(parents=True, exist_ok=True)
                (root / path).write_bytes(to_bytes(content))  # a patch's bytes as the diff gave them
            os.chmod(root, 0o755)
            await sandbox.upload(str(root), sandbox.workdir)
        if not commit:
            return ""
        setup = await sandbox.exec(
            "git add -A && git -c user.name=agentrl -c user.email=agentrl@localhost commit -qm task && git rev-parse HEAD",
            timeout=60,
        )
        if setup.exit_code != 0:
            raise RuntimeError(f"bugfix task setup failed in the sandbox: {setup.output[-500:]}")
        return setup.output.split()[-1]

    def observation(self, task: Task) -> Observation:
        """What ``reset(task)`` returns, without making a sandbox (e.g. to render a prompt ahead)."""
        spec = self.task_spec(task)
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": describe(spec, self.name_failing_test)},
        ]
        return Observation(messages=messages, tools=list(self.tools))

    async def grade_patch(self, patch: str, fresh: tuple[Any, asyncio.Future] | None = None) -> float:
        """1.0 when the task's whole suite passes with ``patch``'s edits of the package's source.

        Never in the agent's sandbox: a fresh one (``fresh``: one already starting) gets the task's
        pristine files, the patch filtered to the package's non-test source (``agentrl.patches``),
        and the grader with a cleared environment and no bytecode. The report (dropped paths,
        whether it applied, the verdict's last lines) is ``self.last_grade``."""
        if self.spec is None:
            raise RuntimeError("grade_patch() needs a reset() first")
        kept, dropped = filter_patch(patch, [self.spec.package])
        report: dict[str, Any] = {"dropped_paths": [f"{p} ({why})" for p, why in dropped]}
        self.last_grade = report
        fresh = fresh or self._fresh()
        sandbox, starting = fresh
        try:
            await starting
            # the patch travels with the task's files; applied to the work tree, no commit needed
            await self._install_task(sandbox, {_SUBMISSION: kept} if kept else None, commit=False)
            apply = ""
            if kept:
                apply = (
                    f"git apply --whitespace=nowarn {_SUBMISSION} "
                    f"|| {{ echo {_APPLY_FAILED}; exit 1; }}; rm {_SUBMISSION}; "
                )
            reward, output = await self._run_grader(sandbox, prefix=apply)
        finally:
            self._dispose(fresh)
        report["applied"] = _APPLY_FAILED not in output if kept else None
        # The package runs inside the test process: a kept line that reaches into the runner (pytest,
        # builtins such as the plain runner's print) could forge the verdict. Graded, never rewarded.
        tamper = runner_tamper(kept)
        if tamper:
            report["runner_tamper"] = tamper
            reward = 0.0
        report.update(reward=reward, output=output[-500:])
        return reward

    async def _run_grader(self, sandbox, prefix: str = "") -> tuple[float, str]:
        # A cleared environment: only what the sandbox itself sets for a command, no PYTHON*/PYTEST*
        # variable, no user site, no bytecode written or read from a cache the tree could carry.
        clear = (
            'env -i PATH="$PATH" HOME="$HOME" LANG=C.UTF-8 TZ=UTC PYTHONHASHSEED=0 '
            'PYTHONDONTWRITEBYTECODE=1 PYTHONNOUSERSITE=1 ${TMPDIR:+TMPDIR="$TMPDIR"} '
        )
        no_cache = "find . -name __pycache__ -prune -exec rm -rf {} +; "
        # The checks, with no tests in the sandbox: the expected values stay here.
        task_checks = checks(self.spec) + hidden_checks(self.spec)
        calls = json.dumps([[c.module, c.call] for c in task_checks])
        run = f"rm -rf tests; {clear}python3 -I -B -c {shlex.quote(_CALLER)} {shlex.quote(calls)}"
        r = await sandbox.exec(f"{prefix}{no_cache}{run}", timeout=120)
        if r.exit_code != 0:
            return 0.0, r.output
        passed, failing = _verdict(task_checks, r.output)
        summary = "".join(f"FAILED {t}\n" for t in failing) + f"{passed} passed {len(failing)} failed"
        hidden = sum(t.startswith("hidden::") for t in failing)
        if hidden:
            summary += f" ({hidden} of them hidden checks)"
        ok = not failing and len(task_checks) == self.spec.n_tests + len(self.spec.hidden)
        output = f"{r.output.rstrip()}\n[agentrl grader] {summary}\n"
        if self.grader == "python" or not ok:
            return (1.0 if ok else 0.0), output
        # grader="pytest": the suite under pytest as well, its files put back. What the package's
        # code does there can only fail a verdict that the checks above have already passed.
        await self._install_task(sandbox, commit=False, tests_only=True)
        # pytest's own plugins only: the verdict cannot depend on what else the sandbox's Python
        # has installed, and a start-up without entry-point plugins costs about half as much
        run = f"{clear}PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python3 -B -m pytest -q -p no:cacheprovider tests"
        r = await sandbox.exec(f"{no_cache}{run}", timeout=120)
        output += r.output
        if r.exit_code != 0:
            return 0.0, output
        match = _PASSED.findall(r.output)
        passed = int(match[-1]) if match else 0
        ok = "failed" not in r.output and "error" not in r.output.lower() and passed == self.spec.n_tests
        return (1.0 if ok else 0.0), output


def _compact(spec: dict[str, Any]) -> dict[str, Any]:
    fn = spec["function"]
    props = {
        k: {kk: vv for kk, vv in v.items() if kk != "description"}
        for k, v in fn["parameters"]["properties"].items()
    }
    return {
        "type": "function",
        "function": {"name": fn["name"], "parameters": {**fn["parameters"], "properties": props}},
    }


def _hash32(key: str) -> int:
    """A 32-bit number drawn from ``key`` (a task's id): the same task always makes the same choices."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)


def _drawn(spec: BugfixTask, what: str, share: float) -> bool:
    """Whether ``spec`` is among the ``share`` of tasks (chosen by id, separately for each ``what``)."""
    return _hash32(f"{what}/{spec.id}") < share * 0x100000000


# One-token slips on the right fix (operator, comparison, bound, name), tried in this order: the first
# that still leaves a test failing is the near miss, so a bug kind always gets the same one.
_SLIPS = (
    (" + ", " - "), (" - ", " + "), (" * ", " / "), (" / ", " * "), ("+=", "-="), ("*=", "/="),
    (">=", ">"), ("<=", "<"), (" > ", " < "), (" < ", " > "), ("==", "!="), ("!=", "=="),
    ("ljust", "rjust"), (" or ", " and "), (">=", "<="), (" / ", " - "), ("-n", "-n - 1"), ("hi", "lo"),
    (">=", "=="), ("[best]", "[i]"), ("[i]", "[i - 1]"), ("))", ") + 1)"), ("1", "0"), ("0", "1"),
    ("+ ", "* "),
)  # fmt: skip


_NEAR_MISSES: dict[tuple[str, str], tuple[str, str] | None] = {}


def near_miss_edit(spec: BugfixTask) -> tuple[str, str] | None:
    """A plausible wrong fix for ``spec``: the right ``old``, and the right ``new`` with one slip (an
    operator, comparison or bound) that still leaves a test failing; None when no slip does."""
    key = (spec.content_hash, spec.fix["new"])
    if key not in _NEAR_MISSES:
        old, new = spec.fix["old"], spec.fix["new"]
        slips = (new.replace(a, b, 1) for a, b in _SLIPS if a in new)
        _NEAR_MISSES[key] = next(
            ((old, s) for s in slips if s not in (new, old) and fails_after(spec, old, s)), None
        )
    return _NEAR_MISSES[key]


def expert_turns(spec: BugfixTask, run_tests: bool = True, miss: float = 0.0) -> list[list[ToolCall]]:
    """The scripted expert: run the tests, view the buggy file, fix it, run the tests, submit.

    ``run_tests=False``: view, fix, submit (the prompt names the failing tests; each test run costs
    a pytest start-up in the sandbox, the bulk of an episode's time on a small machine).
    ``miss``: the share of tasks (chosen by id) on which the expert's fix has a slip
    (``near_miss_edit``): it applies, the tests still fail, and the expert submits anyway — a noisy
    demonstrator, like a weaker model's unfiltered episodes.
    """
    if not 0.0 <= miss <= 1.0:
        raise ValueError(f"miss is the share of tasks with a slipped fix, in [0, 1]; got {miss!r}")
    fix = spec.fix

    def edit(old: str, new: str) -> list[ToolCall]:
        arguments = {"command": "str_replace", "path": fix["path"], "old_str": old, "new_str": new}
        return [ToolCall("str_replace_editor", arguments, id="call_0")]

    tests = [ToolCall("bash", {"command": "python3 -m pytest -q --tb=no | tail -n 2"}, id="call_0")]
    view = [ToolCall("str_replace_editor", {"command": "view", "path": fix["path"]}, id="call_0")]
    slip = near_miss_edit(spec) if _drawn(spec, "miss", miss) else None
    right = slip or (fix["old"], fix["new"])
    turns = [tests, view, edit(*right), tests, [ToolCall("submit", {}, id="call_0")]]
    return turns if run_tests else [t for t in turns if t is not tests]
