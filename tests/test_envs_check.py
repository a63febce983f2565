"""``agentrl envs check`` on the environments a third-party author writes: a factory without a
``sandbox`` argument, one with required arguments (``--args``), and contract failures that must
come out as ``FAILED:`` lines, not as crashes."""

import pytest

import agentrl.env as env_module
from agentrl.cli import main
from agentrl.env import Demonstration, DemoTurn, Observation, StepResult, Task, register
from agentrl.tools import ToolCall, function_spec

ANSWER = function_spec("answer", "Give your final answer.", {"text": {"type": "string"}}, ["text"])


class NoSandboxEnv:
    """Well-behaved, and its factory takes no argument at all (no ``sandbox``)."""

    def __init__(self):
        self.word = ""

    def tasks(self, split):
        return [Task(f"{split}-{i}", {"word": w}) for i, w in enumerate(["agent", "reward"])]

    async def reset(self, task):
        self.word = task.data["word"]
        return Observation([{"role": "user", "content": f"Reverse {self.word!r}."}], [ANSWER])

    async def step(self, tool_calls):
        call = tool_calls[0] if tool_calls else None
        if call is None or call.error or call.name != "answer" or "text" not in call.arguments:
            return StepResult([{"role": "tool", "name": "answer", "content": "Call answer(text)."}])
        reward = float(call.arguments["text"] == self.word[::-1])
        return StepResult([], reward=reward, done=True, info={"status": "completed"})

    async def close(self):
        pass


MADE = []  # (data_path, sandbox) of each DataEnv


class DataEnv(NoSandboxEnv):
    def __init__(self, data_path, sandbox="docker"):
        super().__init__()
        MADE.append((data_path, sandbox))


class GeneratorTasksEnv(NoSandboxEnv):
    def tasks(self, split):
        return (t for t in super().tasks(split))


class RaisingResetEnv(NoSandboxEnv):
    async def reset(self, task):
        raise RuntimeError("no data for this task")


class RaisingCloseEnv(NoSandboxEnv):
    async def close(self):
        raise RuntimeError("the workspace is gone")


class RaisingResetAndCloseEnv(RaisingCloseEnv):
    async def reset(self, task):
        raise RuntimeError("no data for this task")


class RaisingDemoEnv(NoSandboxEnv):
    def demonstration(self, task):
        raise ValueError("no solution for this task")


class DictDemoEnv(NoSandboxEnv):
    def demonstration(self, task):
        return {"turns": []}


class OwnStatusEnv(NoSandboxEnv):
    """Ends every episode at the first step, with an outcome of its own as the status."""

    async def step(self, tool_calls):
        return StepResult([], reward=0.0, done=True, info={"status": "wrong_answer"})


class WrongDemoEnv(NoSandboxEnv):
    """Its demonstration answers the word unreversed, and means to earn 1."""

    def demonstration(self, task):
        return Demonstration([DemoTurn([ToolCall("answer", {"text": task.data["word"]}, id="call_0")])])


class RightDemoEnv(NoSandboxEnv):
    def demonstration(self, task):
        return Demonstration([DemoTurn([ToolCall("answer", {"text": task.data["word"][::-1]}, id="call_0")])])


class SecondDemoWrongEnv(RightDemoEnv):
    """Its demonstration is right on the first task and answers the second one unreversed."""

    def demonstration(self, task):
        if task.id.endswith("-0"):
            return super().demonstration(task)
        return Demonstration([DemoTurn([ToolCall("answer", {"text": task.data["word"]}, id="call_0")])])


class SecondDemoRaisesEnv(RightDemoEnv):
    def demonstration(self, task):
        if task.id.endswith("-0"):
            return super().demonstration(task)
        raise KeyError("solution")


class PassesIdleEnv(NoSandboxEnv):
    """Grades whatever the agent does as solved."""

    async def step(self, tool_calls):
        return StepResult([], reward=1.0, done=True, info={"status": "completed"})


ENVS = {
    "wrongdemo-v0": "WrongDemoEnv",
    "rightdemo-v0": "RightDemoEnv",
    "seconddemowrong-v0": "SecondDemoWrongEnv",
    "seconddemoraises-v0": "SecondDemoRaisesEnv",
    "passesidle-v0": "PassesIdleEnv",
    "ownstatus-v0": "OwnStatusEnv",
    "nosandbox-v0": "NoSandboxEnv",
    "needsdata-v0": "DataEnv",
    "gentasks-v0": "GeneratorTasksEnv",
    "raisingreset-v0": "RaisingResetEnv",
    "raisingclose-v0": "RaisingCloseEnv",
    "raisingresetandclose-v0": "RaisingResetAndCloseEnv",
    "raisingdemo-v0": "RaisingDemoEnv",
    "dictdemo-v0": "DictDemoEnv",
}


@pytest.fixture(autouse=True)
def registered():
    for env_id, cls in ENVS.items():
        register(env_id, entry_point=f"tests.test_envs_check:{cls}")
    register("defaultdata-v0", entry_point="tests.test_envs_check:DataEnv", data_path="d.jsonl")
    yield
    for env_id in [*ENVS, "defaultdata-v0"]:
        env_module._REGISTRY.pop(env_id, None)


def test_sandbox_goes_only_to_a_factory_that_takes_it(capsys):
    assert main(["envs", "check", "nosandbox-v0", "--sandbox", "local"]) == 0
    assert "nosandbox-v0: all checks passed" in capsys.readouterr().out


def test_args_give_the_env_its_arguments(capsys):
    assert main(["envs", "check", "needsdata-v0", "--sandbox", "local"]) == 2
    assert capsys.readouterr().err == (
        "error: environment needsdata-v0 needs the argument data_path (its env.args): "
        "give it with --args '{data_path: ...}'\n"
    )
    MADE.clear()
    assert (
        main(["envs", "check", "needsdata-v0", "--args", "{data_path: t.jsonl}", "--sandbox", "local"]) == 0
    )
    assert "needsdata-v0: all checks passed" in capsys.readouterr().out
    assert MADE and set(MADE) == {("t.jsonl", "local")}


def test_a_required_argument_comes_from_the_registered_defaults_or_is_named_for_any_command(capsys):
    from agentrl.config import ConfigError, make_env

    MADE.clear()
    assert main(["envs", "check", "defaultdata-v0"]) == 0
    assert MADE and set(MADE) == {("d.jsonl", "docker")}
    # the same check where a recipe builds the env (train, rollout)
    with pytest.raises(ConfigError, match=r"needsdata-v0 needs the argument data_path \(its env.args\): "):
        make_env("needsdata-v0", {}, "env.args")


@pytest.mark.parametrize(
    "given,message",
    [
        (
            "{data_pth: x}",
            "--args.data_pth='x': environment needsdata-v0 takes no argument 'data_pth'. "
            "Did you mean --args.data_path?",
        ),
        ("{data_path: [x", "--args '{data_path: [x' is not YAML"),
        ("[x]", "--args '[x]' must be a mapping of the env's arguments"),
        ("{data_path: x, sandbox: docker}", "--args sandbox='docker': give the sandbox with --sandbox"),
    ],
)
def test_bad_args_are_named(given, message, capsys):
    assert main(["envs", "check", "needsdata-v0", "--args", given]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "env_id,message",
    [
        (
            "gentasks-v0",
            "FAILED: tasks('train') must return a Sequence of Task (a list, or a TaskList) "
            "with a length and indexing; got generator",
        ),
        ("raisingreset-v0", "FAILED: reset(task) raised RuntimeError: no data for this task (task train-0)"),
        (
            "raisingclose-v0",
            "FAILED: close() raised RuntimeError: the workspace is gone; close must release the "
            "episode's resources without raising",
        ),
        (
            "raisingresetandclose-v0",
            "FAILED: reset(task) raised RuntimeError: no data for this task (task train-0); reset must "
            "start an episode of any task that tasks() returns; then close() raised RuntimeError: the "
            "workspace is gone",
        ),
        (
            "raisingdemo-v0",
            "FAILED: demonstration(task) raised ValueError: no solution for this task (task train-0); "
            "it must return a Demonstration of the task, or None where it has none",
        ),
        (
            "dictdemo-v0",
            "FAILED: demonstration(task) must return a Demonstration(turns, reward) or None; "
            "got dict: {'turns': []} (task train-0)",
        ),
        (
            "wrongdemo-v0",
            "FAILED: the demonstration of task train-0 ended completed with reward 0.0, but means to earn 1.0 "
            "(no error recorded); fix demonstration() or the grading",
        ),
        (
            "passesidle-v0",
            "FAILED: an episode of task train-0 in which the agent did nothing earned reward 1.0: "
            "the grading passes untouched work",
        ),
        (
            "ownstatus-v0",
            "FAILED: an episode of task train-0 in which the agent did nothing ended env_error "
            "(ValueError: step() ended the episode with info['status'] = 'wrong_answer'",
        ),
    ],
)
def test_contract_failures_are_failed_lines(env_id, message, capsys):
    assert main(["envs", "check", env_id]) == 1
    err = capsys.readouterr().err
    assert err.startswith(message) and len(err.splitlines()) == 1


def test_demos_plays_the_demonstrations_of_the_first_n_training_tasks(capsys):
    assert main(["envs", "check", "seconddemowrong-v0"]) == 0  # the first task's only, by default
    assert "ok  the demonstration earns its reward (1) through the agent loop" in capsys.readouterr().out
    assert main(["envs", "check", "seconddemowrong-v0", "--demos", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("FAILED: the demonstration of task train-1 ended completed with reward 0.0")
    assert main(["envs", "check", "rightdemo-v0", "--demos", "5"]) == 0  # the split holds two
    assert "ok  the demonstrations of 2 tasks earn their rewards (1, 1)" in capsys.readouterr().out
    assert main(["envs", "check", "seconddemoraises-v0", "--demos", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("FAILED: demonstration(task) raised KeyError: 'solution' (task train-1)")
    with pytest.raises(SystemExit):
        main(["envs", "check", "rightdemo-v0", "--demos", "0"])
    assert "'0' is not a whole number of at least 1" in capsys.readouterr().err
