import sys
import textwrap

import pytest

import agentrl.env as env_module
from agentrl.env import (
    EnvCheckError,
    Observation,
    StepResult,
    Task,
    TaskList,
    check_env,
    first_task,
    list_envs,
    make,
    register,
    spec,
)
from agentrl.tools import BASH
from tests.conftest import DOCKER_OK, fake_distribution


class EchoEnv:
    """A minimal well-behaved env used to test the registry and the checker."""

    deterministic = True

    def __init__(self, greeting="hello", broken=None):
        self.greeting, self.broken, self.closed = greeting, broken, 0

    def tasks(self, split):
        if self.broken == "no_tasks":
            raise AttributeError("tasks")
        if self.broken == "tasks_raise":
            raise FileNotFoundError("data/tasks.jsonl")
        if self.broken == "empty_split":
            return []
        if self.broken == "task_ids":
            return [f"{split}-{i}" for i in range(4)]
        return [Task(f"{split}-{i}", {"index": i}) for i in range(4)]

    async def reset(self, task):
        if self.broken == "nondeterministic":
            self.greeting += "!"
        messages = [{"role": "user", "content": f"{self.greeting} {task.id}"}]
        if self.broken == "bad_message":
            messages.append({"role": "robot", "content": "x"})
        if self.broken == "ends_with_assistant":
            messages.append({"role": "assistant", "content": "I will"})
        if self.broken == "not_json":
            messages[0]["seen"] = {task.id}
        tools = [BASH] if self.broken != "bad_spec" else [{"type": "function", "function": {"name": "x"}}]
        if self.broken == "reset_raises":
            raise KeyError(task.id)
        if self.broken == "reset_messages":
            return messages
        if self.broken == "messages_str":
            return Observation(messages[0]["content"], tools)
        return Observation(messages, [] if self.broken == "no_tools" else tools)

    async def step(self, tool_calls):
        if self.broken == "raises" and tool_calls and tool_calls[0].error:
            raise RuntimeError("cannot parse")
        observation = [{"role": "tool", "content": "error: bad call", "name": "bash", "tool_call_id": "c"}]
        if self.broken == "step_tuple":
            return observation, 0.0, False
        if self.broken == "silent_step":
            return StepResult([])
        if self.broken == "reward_str":
            return StepResult(observation, reward="0")
        return StepResult(observation)

    async def close(self):
        self.closed += 1
        if self.broken == "close_twice" and self.closed > 1:
            raise RuntimeError("already closed")


def test_register_make_with_overrides_and_warning():
    register("echo-v0", entry_point="tests.test_env_registry:EchoEnv", greeting="hi")
    env = make("echo-v0")
    assert env.greeting == "hi" and env.id == "echo-v0"
    assert make("echo-v0", greeting="yo").greeting == "yo"
    with pytest.warns(UserWarning, match="overriding with"):
        register("echo-v0", entry_point="tests.test_env_registry:Other")
    with pytest.warns(UserWarning):
        register("echo-v0", entry_point="tests.test_env_registry:EchoEnv", greeting="hi")
    assert "echo-v0" in list_envs() and "bugfix-v0" in list_envs()
    with pytest.raises(ValueError, match="must be versioned like 'name-v0'"):
        register("echo", entry_point="x:Y")


def test_unknown_id_lists_known_and_closest():
    with pytest.raises(
        KeyError, match="no environment 'bugfx-v0'. Did you mean 'bugfix-v0'\\? Registered: .*bugfix-v0"
    ):
        make("bugfx-v0")


def test_entry_point_plugins_register(tmp_path, monkeypatch):
    pkg = tmp_path / "myplugin"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        textwrap.dedent(
            """
            from agentrl.env import register

            def register_all():
                register("plugin-echo-v1", entry_point="tests.test_env_registry:EchoEnv", greeting="plugin")
            """
        )
    )
    fake_distribution(tmp_path, "myplugin", "[agentrl.envs]\nmyplugin = myplugin:register_all\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(env_module, "_plugins_loaded", False)
    assert "plugin-echo-v1" in list_envs()
    assert make("plugin-echo-v1").greeting == "plugin"
    assert spec("plugin-echo-v1").entry_point == "tests.test_env_registry:EchoEnv"
    sys.modules.pop("myplugin", None)


@pytest.mark.parametrize(
    "broken,message",
    [
        ("bad_message", "is not a chat message: each needs a role"),
        ("bad_spec", "invalid tool spec"),
        ("raises", "step raised RuntimeError: cannot parse on a malformed tool call"),
        ("close_twice", "close is not idempotent"),
        ("nondeterministic", "says it is deterministic, but two resets of the same task differ"),
        (
            "reset_raises",
            "reset\\(task\\) raised KeyError: 't-0' \\(task t-0\\); reset must start an episode",
        ),
        ("reset_messages", "reset must return an Observation\\(messages, tools\\); got list"),
        ("messages_str", "reset\\(\\).messages must be a list of chat messages; got str"),
        ("ends_with_assistant", "reset\\(\\).messages should end with the user's task"),
        ("not_json", "reset\\(\\).messages is not JSON-serialisable \\(Object of type set"),
        ("no_tools", "reset\\(\\).tools must be a non-empty list of tool specs"),
        ("step_tuple", "step must return a StepResult; got tuple"),
        ("silent_step", "step answered a malformed call with no observation; tell the agent what was wrong"),
        ("reward_str", "StepResult.reward must be a number and StepResult.done a bool"),
    ],
)
def test_checker_names_the_likely_cause(broken, message):
    with pytest.raises(EnvCheckError, match=message):
        check_env(EchoEnv(broken=broken), Task("t-0"))
    assert check_env(EchoEnv(), Task("t-0"))[-1] == "close is idempotent"


@pytest.mark.parametrize(
    "broken,message",
    [
        (
            "tasks_raise",
            "tasks\\('train'\\) raised FileNotFoundError: data/tasks.jsonl; it must return the split's tasks",
        ),
        ("empty_split", "tasks\\('train'\\) is empty; the checker runs its first task"),
        ("task_ids", "tasks\\('train'\\)\\[0\\] must be a Task\\(id, data\\); got str: train-0"),
    ],
)
def test_first_task_names_what_tasks_returned(broken, message):
    with pytest.raises(EnvCheckError, match=message):
        first_task(EchoEnv(broken=broken))
    assert first_task(EchoEnv()) == Task("train-0", {"index": 0})


def test_a_task_list_makes_its_tasks_on_demand_and_names_its_size():
    made = []
    tasks = TaskList(3, lambda i: made.append(i) or Task(f"t-{i}"))
    assert len(tasks) == 3 and made == []
    assert tasks[-1].id == "t-2" and [t.id for t in tasks[1:]] == ["t-1", "t-2"] and made == [2, 1, 2]
    assert [t.id for t in tasks] == ["t-0", "t-1", "t-2"]
    for index in (3, -4):
        with pytest.raises(IndexError, match=f"task index {index} is out of range: the split holds 3 tasks"):
            tasks[index]


def test_checker_names_what_the_protocol_lacks():
    class NoTasks(EchoEnv):
        tasks = None

    with pytest.raises(EnvCheckError, match="NoTasks lacks tasks: the AgentEnv protocol needs tasks"):
        check_env(NoTasks(), Task("t-0"))


# Every environment the package ships (tests register toy ones, and install tests/example_env).
@pytest.mark.parametrize(
    "env_id", [e for e in list_envs() if spec(e).entry_point.startswith("agentrl.envs.")]
)
@pytest.mark.parametrize("backend", ["local", "docker"])
def test_check_env_on_every_registered_env(env_id, backend):
    if backend == "docker" and not DOCKER_OK:
        from tests.conftest import require_docker

        require_docker()
    env = make(env_id, sandbox=backend)
    passed = check_env(env, env.tasks("train")[0])
    assert "malformed tool calls become observations" in passed and "close is idempotent" in passed


def test_envs_check_plays_the_demonstration_and_an_idle_agent(capsys):
    from agentrl.cli import main

    assert main(["envs", "check", "bugfix-v0", "--sandbox", "local"]) == 0
    out = capsys.readouterr().out
    assert "ok  the demonstration earns its reward (1) through the agent loop" in out
    assert "ok  an agent that does nothing does not succeed" in out


def test_an_entry_point_that_registers_nothing_is_named(tmp_path, monkeypatch):
    # Two mistakes of a plugin author: an entry point at the env class, and a function that forgets
    # to call register(). Each is named (a warning, and in the message of an unknown id), and the
    # class is never instantiated.
    (tmp_path / "mistaken.py").write_text(
        textwrap.dedent(
            """
            made = []

            class ClassEnv:
                def __init__(self):
                    made.append(self)

            def forgets():
                pass
            """
        )
    )
    points = "[agentrl.envs]\nclass-v0 = mistaken:ClassEnv\nforgot = mistaken:forgets\n"
    fake_distribution(tmp_path, "mistaken", points)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(env_module, "_plugins_loaded", False)
    monkeypatch.setattr(env_module, "_plugin_failures", [])
    with pytest.warns(UserWarning) as warned:
        assert "class-v0" not in list_envs()
    assert [str(w.message) for w in warned] == [
        "could not load environment plugin class-v0 (mistaken:ClassEnv): it names the class ClassEnv; "
        "an agentrl.envs entry point is a module or a function that calls register(), "
        "e.g. register('class-v0', entry_point='mistaken:ClassEnv')",
        "could not load environment plugin forgot (mistaken:forgets): calling it registered no "
        "environment; it must call agentrl.env.register(...)",
    ]
    with pytest.raises(
        KeyError, match=r"Plugins that failed to load: class-v0 \(mistaken:ClassEnv\): it names"
    ):
        make("class-v0")
    assert sys.modules["mistaken"].made == []
    sys.modules.pop("mistaken", None)
