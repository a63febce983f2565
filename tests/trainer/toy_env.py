"""A toy environment with one right answer: say the magic word."""

from agentrl.env import Observation, StepResult, Task
from agentrl.tools import SUBMIT

MAGIC = "assert"  # " assert" is one token of the tiny tokenizer


class MagicWordEnv:
    """One turn. Reward 1 if the assistant's text contains the magic word, else 0."""

    deterministic = True
    reads_text = True

    def __init__(self, word: str = MAGIC, broken: bool = False):
        self.word, self.broken = word, broken

    def tasks(self, split: str) -> list[Task]:
        if split not in ("train", "test"):
            raise KeyError(f"split must be 'train' or 'test'; got {split!r}")
        return [Task(f"{split}-{i}", {}) for i in range(1000)]

    async def reset(self, task: Task) -> Observation:
        if self.broken:
            raise RuntimeError("the service behind this env is down")
        return Observation([{"role": "user", "content": "Say the magic word."}], [SUBMIT])

    async def step(self, tool_calls, text: str = "") -> StepResult:
        reward = 1.0 if self.word in text else 0.0
        return StepResult([], reward, True, {"status": "completed"})

    async def close(self) -> None:
        pass
