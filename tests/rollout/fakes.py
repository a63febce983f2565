"""In-memory environments and engines for the loop's tests (the real ones are tested beside them)."""

import asyncio

from agentrl.env import Observation, StepResult, Task
from agentrl.rollout.engine import EngineError, Generation
from agentrl.tools import CODING_TOOLS


class EchoEnv:
    """Answers every step with one tool message; ends after ``episode_len`` steps or on submit."""

    def tasks(self, split: str) -> list[Task]:
        return [Task(f"{split}-{i}", {}) for i in range(8)]

    def __init__(
        self, episode_len=3, obs_text="ok", step_delay=0.0, fail_at=None, reward=1.0, reset_failures=0
    ):
        self.reset_failures = reset_failures
        self.episode_len, self.obs_text, self.step_delay, self.fail_at, self.reward = (
            episode_len,
            obs_text,
            step_delay,
            fail_at,
            reward,
        )
        self.steps, self.closed, self.graded = 0, 0, 0
        self.id = "echo-v0"

    async def reset(self, task: Task) -> Observation:
        if self.reset_failures:
            from agentrl.sandbox import SandboxError

            self.reset_failures -= 1
            raise SandboxError("the container would not start")
        self.steps = 0
        return Observation(
            [{"role": "system", "content": "sys"}, {"role": "user", "content": f"task {task.id}"}],
            CODING_TOOLS,
        )

    async def step(self, tool_calls) -> StepResult:
        self.steps += 1
        if self.step_delay:
            await asyncio.sleep(self.step_delay)
        if self.fail_at == self.steps:
            raise RuntimeError("the environment broke")
        if any(c.name == "submit" for c in tool_calls) or self.steps >= self.episode_len:
            return StepResult([], self.reward, True, {"status": "completed"})
        return StepResult(
            [
                {
                    "role": "tool",
                    "content": f"{self.obs_text} {self.steps}",
                    "name": "bash",
                    "tool_call_id": "c",
                }
            ]
        )

    async def grade(self) -> float:
        self.graded += 1
        return 0.5

    async def close(self) -> None:
        self.closed += 1


class FixedEngine:
    """Returns the same output ids every call (with made-up log-probs), optionally failing first."""

    def __init__(self, output_ids, fail=None, transient_failures=0, delay=0.0):
        self.output_ids, self.fail, self.transient_failures, self.delay = (
            list(output_ids),
            fail,
            transient_failures,
            delay,
        )
        self.calls = []
        self.weight_version = "7"

    async def generate(self, input_ids, params):
        self.calls.append(list(input_ids))
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.transient_failures:
            self.transient_failures -= 1
            raise EngineError("overloaded", transient=True)
        if self.fail:
            raise self.fail
        ids = self.output_ids[: params.max_new_tokens]
        reason = "stop" if ids and ids[-1] in params.stop_token_ids else "length"
        return Generation(ids, [-0.5 - 0.01 * i for i in range(len(ids))], reason, self.weight_version)

    async def update_weights(self, *a, **k):
        return self.weight_version

    async def health(self):
        return True


class RecordingEngine:
    """Wraps an engine and keeps every generation it returned."""

    def __init__(self, inner):
        self.inner, self.generations = inner, []

    async def generate(self, input_ids, params):
        g = await self.inner.generate(input_ids, params)
        self.generations.append(g)
        return g

    async def update_weights(self, *a, **k):
        return await self.inner.update_weights(*a, **k)

    @property
    def weight_version(self):
        return self.inner.weight_version

    async def health(self):
        return True
