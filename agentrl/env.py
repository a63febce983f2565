"""Agent environments: the protocol environment authors implement, a registry, and a conformance checker.

    from agentrl.env import make
    env = make("bugfix-v0", sandbox="local")
    task = env.tasks("train")[0]                        # a split's tasks: a sequence with a length
    obs = await env.reset(task)                         # initial chat messages + tool specs
    result = await env.step(parsed_turn.calls)          # tool observations, reward, done
    await env.close()

Register an environment with ``register("name-v0", entry_point="pkg.module:Class", **defaults)``, or
from another package through the entry-point group ``agentrl.envs`` (each entry point is a
module or a function that calls ``register``).
"""

from __future__ import annotations

import asyncio
import difflib
import importlib
import importlib.metadata
import json
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, overload, runtime_checkable

from agentrl.sandbox import NoSandboxError, SandboxError
from agentrl.tools import ToolCall, spec_problems

ENTRY_POINT_GROUP = "agentrl.envs"
_ID = re.compile(r"^[A-Za-z][A-Za-z0-9_.\-]*-v\d+$")


@dataclass
class Task:
    """One task: a stable id, and whatever the environment needs to set it up."""

    id: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Observation:
    """What ``reset`` returns: the initial chat messages and the tool specs to render them with."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]


@dataclass
class StepResult:
    observation: list[dict[str, Any]]
    """New chat messages for the policy (tool results, or a reminder); empty when done."""
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    """Per step: ``tool_calls`` (name, arguments, output, exit_code, error), counters, ``status`` when done."""


class TaskList(Sequence[Task]):
    """A split's tasks, made on demand: ``TaskList(size, fetch)`` holds ``size`` tasks, task ``i``
    being ``fetch(i)`` (for environments that generate tasks, or hold too many to list up front)."""

    def __init__(self, size: int, fetch: Callable[[int], Task]):
        self.size, self.fetch = size, fetch

    def __len__(self) -> int:
        return self.size

    @overload
    def __getitem__(self, index: int) -> Task: ...
    @overload
    def __getitem__(self, index: slice) -> list[Task]: ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.fetch(i) for i in range(*index.indices(self.size))]
        i = index + self.size if index < 0 else index
        if not 0 <= i < self.size:
            raise IndexError(f"task index {index} is out of range: the split holds {self.size} tasks")
        return self.fetch(i)


@dataclass
class DemoTurn:
    """One assistant turn of a demonstration: the tool calls it makes (rendered in the policy's tool
    format when played) after optional plain text; ``trainable=False`` plays it without imitating it
    (its tokens get loss mask 0)."""

    calls: list[ToolCall]
    content: str = ""
    trainable: bool = True


@dataclass
class Demonstration:
    """An expert's episode on one task, for a supervised warm start: the assistant turns, played in
    order through the real agent loop, and the reward the episode is meant to earn (1 for a
    solution; less for a deliberately imperfect one that a noisy demonstrator's warm start imitates
    all the same). A warm start keeps an episode only when it ends as meant: completed, with that
    reward."""

    turns: list[DemoTurn]
    reward: float = 1.0


@runtime_checkable
class AgentEnv(Protocol):
    """An environment the agent loop drives. An env owns its sandbox(es) (``agentrl.sandbox.make_sandbox``).

    Required:

    - ``tasks(split) -> Sequence[Task]``: the tasks of a split (``"train"``, ``"test"``, ...), with
      ``len()`` the split's size; the trainer and the CLI take their task counts from it (a list,
      or a ``TaskList`` that makes task ``i`` on demand). An unknown split raises ``ValueError``.
    - ``async reset(task) -> Observation``, ``async step(tool_calls) -> StepResult``, ``async close()``
      (idempotent; ``reset`` again after steps starts a new episode).

    Optional:

    - ``deterministic = True`` promises that ``reset`` of the same task gives the same observation.
    - ``reads_text = True``: ``step(tool_calls, text=...)`` also gets the assistant's plain text.
    - ``async grade() -> float``: a reward computed only at the end.
    - ``demonstration(task) -> Demonstration | None``: an expert's episode, for a supervised warm
      start (``sft.episodes``) and for ``agentrl envs check``.
    - ``corpus() -> list[str]``: the text a tokenizer trained for this environment should learn
      from (the tiny model's); without it: general coding text plus the env's tasks and demonstrations.
      It should hold every call the demonstrations make, as rendered: one it never saw is spelled
      in short pieces, which a tiny model miscounts.

    Construction: ``make(id, **args)`` calls the registered factory with the config's ``env.args``;
    a factory that takes a ``sandbox`` keyword also gets the run's sandbox choice (``sandbox.kind``:
    ``docker`` or ``local``, resolved from ``auto`` by ``agentrl.sandbox.resolve_kind``).
    """

    def tasks(self, split: str) -> Sequence[Task]: ...
    async def reset(self, task: Task) -> Observation: ...
    async def step(self, tool_calls: list[ToolCall]) -> StepResult: ...
    async def close(self) -> None: ...


# --- registry -------------------------------------------------------------------------------------


@dataclass
class EnvSpec:
    id: str
    entry_point: str
    defaults: dict[str, Any]


_REGISTRY: dict[str, EnvSpec] = {}
_plugins_loaded = False
_plugin_failures: list[str] = []  # "name (module:attr): error" of each entry point that did not load
_registrations = 0  # calls of register(), to tell an entry point that registered nothing


def register(id: str, entry_point: str, **defaults: Any) -> None:
    """Register ``entry_point`` ("module:Class") under a versioned id ("name-v0") with default kwargs."""
    global _registrations
    if not _ID.match(id):
        raise ValueError(f"environment id {id!r} must be versioned like 'name-v0'")
    if ":" not in entry_point:
        raise ValueError(f"entry_point {entry_point!r} must look like 'package.module:ClassName'")
    if id in _REGISTRY and _REGISTRY[id].entry_point != entry_point:
        warnings.warn(
            f"environment {id!r} was registered as {_REGISTRY[id].entry_point}; overriding with {entry_point}",
            stacklevel=2,
        )
    elif id in _REGISTRY and _REGISTRY[id].defaults != defaults:
        warnings.warn(f"environment {id!r} re-registered with other defaults: {defaults}", stacklevel=2)
    _REGISTRY[id] = EnvSpec(id, entry_point, dict(defaults))
    _registrations += 1


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    importlib.import_module("agentrl.envs")  # the built-in environments register themselves
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            problem = _load_plugin(ep)
        except Exception as e:  # one broken plugin must not hide the others, nor the built-in envs
            problem = f"{type(e).__name__}: {e}"
        if problem:
            failure = f"{ep.name} ({ep.value}): {problem}"
            _plugin_failures.append(failure)
            warnings.warn(f"could not load environment plugin {failure}", stacklevel=2)


def _load_plugin(ep: importlib.metadata.EntryPoint) -> str | None:
    """Load one entry point of ``agentrl.envs``: a module (that registers on import) or a function
    that calls ``register``. Returns what is wrong with it, or None."""
    loaded = ep.load()
    if isinstance(loaded, type):  # calling it would build an environment, not register one
        name = ep.name if _ID.match(ep.name) else "name-v0"
        return (
            f"it names the class {loaded.__name__}; an {ENTRY_POINT_GROUP} entry point is a module or "
            f"a function that calls register(), e.g. register({name!r}, entry_point={ep.value!r})"
        )
    if callable(loaded):
        before = _registrations
        loaded()
        if _registrations == before:
            return "calling it registered no environment; it must call agentrl.env.register(...)"
    return None


def list_envs() -> list[str]:
    _load_plugins()
    return sorted(_REGISTRY)


def spec(id: str) -> EnvSpec:
    _load_plugins()
    if id not in _REGISTRY:
        close = difflib.get_close_matches(id, _REGISTRY, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        failed = f" Plugins that failed to load: {'; '.join(_plugin_failures)}." if _plugin_failures else ""
        raise KeyError(
            f"no environment {id!r}.{hint} Registered: {', '.join(sorted(_REGISTRY)) or 'none'}.{failed}"
        )
    return _REGISTRY[id]


def make(id: str, **overrides: Any) -> AgentEnv:
    """Instantiate a registered environment; ``overrides`` replace its registered defaults."""
    s = spec(id)
    module, _, attr = s.entry_point.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    env = cls(**{**s.defaults, **overrides})
    if not getattr(env, "id", None):
        env.id = id
    return env


# --- checker --------------------------------------------------------------------------------------


class EnvCheckError(AssertionError):
    """An environment breaks the contract; the message names the likely cause."""


VALID_ROLES = {"system", "user", "assistant", "tool"}


def _check_messages(messages: Any, where: str) -> None:
    if not isinstance(messages, list):
        raise EnvCheckError(f"{where} must be a list of chat messages; got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or m.get("role") not in VALID_ROLES
            or not isinstance(m.get("content"), str)
        ):
            raise EnvCheckError(
                f"{where}[{i}] = {str(m)[:120]} is not a chat message: each needs a role in {sorted(VALID_ROLES)} "
                "and string content (chat templates render nothing else)"
            )
    try:
        json.dumps(messages)
    except TypeError as e:
        raise EnvCheckError(
            f"{where} is not JSON-serialisable ({e}); trajectories store messages as JSON"
        ) from e


def _check_members(env: Any) -> None:
    if not isinstance(env, AgentEnv):
        missing = [m for m in ("tasks", "reset", "step", "close") if not callable(getattr(env, m, None))]
        raise EnvCheckError(
            f"{type(env).__name__} lacks {', '.join(missing)}: the AgentEnv protocol needs tasks(split), "
            "reset(task), step(tool_calls) and close()"
        )


def first_task(env: AgentEnv, split: str = "train") -> Task:
    """The first task of ``split``, checking that ``tasks(split)`` is a non-empty sequence of
    ``Task``; ``EnvCheckError`` naming what it returned otherwise."""
    _check_members(env)
    try:
        tasks = env.tasks(split)
    except Exception as e:
        raise EnvCheckError(
            f"tasks({split!r}) raised {type(e).__name__}: {e}; it must return the split's tasks"
        ) from e
    try:
        size = len(tasks)
        task = tasks[0] if size else None
    except Exception as e:
        raise EnvCheckError(
            f"tasks({split!r}) must return a Sequence of Task (a list, or a TaskList) with a length "
            f"and indexing; got {type(tasks).__name__} ({type(e).__name__}: {e})"
        ) from e
    if not size:
        raise EnvCheckError(f"tasks({split!r}) is empty; the checker runs its first task")
    if not isinstance(task, Task):
        raise EnvCheckError(
            f"tasks({split!r})[0] must be a Task(id, data); got {type(task).__name__}: {str(task)[:120]}"
        )
    return task


async def check_env_async(env: AgentEnv, task: Task) -> list[str]:
    """Run the conformance checks on ``env`` with ``task``; returns what passed, raises ``EnvCheckError``.

    The env must allow ``reset`` again after steps (each reset starts a new episode).
    """
    passed = []
    _check_members(env)
    try:
        try:
            obs = await env.reset(task)
        except (SandboxError, NoSandboxError):
            raise  # this machine's sandbox backend, not the env: its message says what to do
        except Exception as e:
            raise EnvCheckError(
                f"reset(task) raised {type(e).__name__}: {e} (task {task.id}); reset must start an "
                "episode of any task that tasks() returns"
            ) from e
        if not isinstance(obs, Observation):
            raise EnvCheckError(
                f"reset must return an Observation(messages, tools); got {type(obs).__name__}"
            )
        _check_messages(obs.messages, "reset().messages")
        if not obs.messages or obs.messages[-1]["role"] != "user":
            raise EnvCheckError(
                "reset().messages should end with the user's task (the policy answers a user turn)"
            )
        passed.append("reset returns valid chat messages")
        if not isinstance(obs.tools, list) or not obs.tools:
            raise EnvCheckError("reset().tools must be a non-empty list of tool specs")
        for t in obs.tools:
            problems = spec_problems(t)
            if problems:
                raise EnvCheckError(f"invalid tool spec: {'; '.join(problems)}")
        passed.append("tool specs are valid JSON schema")

        bad_calls = [
            ToolCall("", raw="<tool_call>{not json</tool_call>", error="invalid JSON (test)"),
            ToolCall("no_such_tool_xyz", {"x": 1}),
            ToolCall(obs.tools[0]["function"]["name"], {"unexpected_argument_xyz": 1}),
        ]
        for call in bad_calls:
            try:
                result = await env.step([call])
            except Exception as e:
                raise EnvCheckError(
                    f"step raised {type(e).__name__}: {e} on a malformed tool call ({call.name or call.raw!r}); "
                    "malformed calls must become an observation the agent can read"
                ) from e
            if not isinstance(result, StepResult):
                raise EnvCheckError(f"step must return a StepResult; got {type(result).__name__}")
            _check_messages(result.observation, "step().observation")
            if not result.done and not result.observation:
                raise EnvCheckError(
                    "step answered a malformed call with no observation; tell the agent what was wrong"
                )
            if not isinstance(result.reward, int | float) or not isinstance(result.done, bool):
                raise EnvCheckError("StepResult.reward must be a number and StepResult.done a bool")
            if result.done:
                break
        passed.append("malformed tool calls become observations")

        if getattr(env, "deterministic", False):
            again = await env.reset(task)
            if again.messages != obs.messages or again.tools != obs.tools:
                raise EnvCheckError(
                    "the env says it is deterministic, but two resets of the same task differ; "
                    "seed every random choice from the task"
                )
            passed.append("same task gives the same observation")
        checked_demonstration(env, task)
    except EnvCheckError as e:
        failed = await _close(env)
        if failed is None:
            raise
        # the first failure leads; the close that failed after it is named too
        raise EnvCheckError(f"{e}; then close() raised {type(failed).__name__}: {failed}") from e
    except BaseException:
        await _close(env)
        raise
    for why in (
        "close() raised {}; close must release the episode's resources without raising",
        "close is not idempotent: the second call raised {}",
    ):
        failed = await _close(env)
        if isinstance(failed, SandboxError | NoSandboxError):
            raise failed  # this machine's sandbox backend, not the env: its message says what to do
        if failed is not None:
            raise EnvCheckError(why.format(f"{type(failed).__name__}: {failed}")) from failed
    passed.append("close is idempotent")
    return passed


async def _close(env: AgentEnv) -> Exception | None:
    """``env.close()``; what it raised, or None."""
    try:
        await env.close()
    except Exception as e:
        return e
    return None


def checked_demonstration(env: AgentEnv, task: Task) -> Demonstration | None:
    """``env.demonstration(task)``: a ``Demonstration``, or None (also where the env has none);
    ``EnvCheckError`` naming the task when it raises or returns something else."""
    demonstrate = getattr(env, "demonstration", None)
    if not callable(demonstrate):
        return None
    try:
        demo = demonstrate(task)
    except Exception as e:
        raise EnvCheckError(
            f"demonstration(task) raised {type(e).__name__}: {e} (task {task.id}); it must return a "
            "Demonstration of the task, or None where it has none"
        ) from e
    if demo is not None and not isinstance(demo, Demonstration):
        raise EnvCheckError(
            f"demonstration(task) must return a Demonstration(turns, reward) or None; got "
            f"{type(demo).__name__}: {str(demo)[:120]} (task {task.id})"
        )
    return demo


def check_env(env: AgentEnv, task: Task) -> list[str]:
    """Synchronous wrapper of ``check_env_async`` for scripts and the CLI."""
    return asyncio.run(check_env_async(env, task))
