"""``linecount-v0``: write the number of lines of ``data.txt`` into ``answer.txt``.

A complete agentrl environment outside the agentrl package: tasks, a sandbox per episode, tools,
a reward, and a demonstration for the supervised warm start. Registered through the entry point in
this package's ``pyproject.toml`` (group ``agentrl.envs``), so ``pip install`` is all a user does.
"""

from __future__ import annotations

import random

from agentrl.env import (
    Demonstration,
    DemoTurn,
    Observation,
    StepResult,
    Task,
    TaskList,
    register,
)
from agentrl.sandbox import SandboxError, make_sandbox
from agentrl.tools import BASH, SUBMIT, ToolCall, truncate, validate_call

SPLITS = {"train": 10_000, "test": 1_000}


def register_envs() -> None:
    """The entry point: called once, when agentrl first looks up an environment."""
    register("linecount-v0", entry_point="agentrl_example_env:LineCountEnv")


class LineCountEnv:
    deterministic = True  # the same task gives the same first observation

    def __init__(self, sandbox: str = "local", max_lines: int = 9, command_timeout: float = 10.0):
        # `sandbox` and `max_turns` are run settings: the trainer passes sandbox.kind here (and
        # rollout.max_turns, to a factory that takes it); everything else comes from env.args.
        if max_lines < 1:
            raise ValueError(f"max_lines must be >= 1; got {max_lines}")
        self.backend, self.max_lines, self.command_timeout = sandbox, max_lines, command_timeout
        self.tools = [BASH, SUBMIT]
        self.sandbox = None

    def task(self, split: str, index: int) -> Task:
        rng = random.Random(f"{split}-{index}")  # a task is a pure function of its id
        lines = [f"item {rng.randrange(1000)}" for _ in range(rng.randint(1, self.max_lines))]
        return Task(f"{split}-{index}", {"lines": lines})

    def tasks(self, split: str) -> TaskList:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {sorted(SPLITS)}; got {split!r}")
        return TaskList(SPLITS[split], lambda i: self.task(split, i))

    async def reset(self, task: Task) -> Observation:
        await self.close()
        self.task_now = task
        self.sandbox = make_sandbox(self.backend)
        await self.sandbox.start()
        await self.sandbox.write_file("data.txt", "".join(line + "\n" for line in task.data["lines"]))
        prompt = "Write the number of lines of data.txt into answer.txt, then submit."
        return Observation([{"role": "user", "content": prompt}], self.tools)

    async def step(self, tool_calls: list[ToolCall]) -> StepResult:
        observation = []
        for call in tool_calls:
            validate_call(call, self.tools)  # a bad call gets call.error; it never raises
            if call.error:
                output = f"error: {call.error}"
            elif call.name == "submit":
                return StepResult([], await self._grade(), True, {"status": "completed"})
            else:
                result = await self.sandbox.exec(call.arguments["command"], timeout=self.command_timeout)
                output = f"{truncate(result.output, 2000)}\n[exit code {result.exit_code}]"
            observation.append({"role": "tool", "content": output, "name": call.name or "invalid"})
        if not tool_calls:
            observation.append({"role": "user", "content": "Use a tool call (bash, or submit when done)."})
        return StepResult(observation)

    async def _grade(self) -> float:
        try:
            answer = (await self.sandbox.read_file("answer.txt")).decode().strip()
        except (FileNotFoundError, SandboxError, UnicodeDecodeError):
            answer = ""
        await self.close()
        return 1.0 if answer == str(len(self.task_now.data["lines"])) else 0.0

    def demonstration(self, task: Task) -> Demonstration:
        """What an expert does: count with wc, then submit. The warm start imitates it."""
        count = ToolCall("bash", {"command": "wc -l < data.txt > answer.txt"}, id="call_0")
        return Demonstration([DemoTurn([count]), DemoTurn([ToolCall("submit", {}, id="call_0")])])

    async def close(self) -> None:
        if self.sandbox is not None:
            sandbox, self.sandbox = self.sandbox, None
            await sandbox.close()
