"""An engine that plays back scripted assistant turns as tokens (a scripted policy behind the real loop).

Used to run a scripted expert through exactly the code path a model takes (render, generate,
parse, step, observe), and to make its trajectories for supervised warm starts.
"""

from __future__ import annotations

from agentrl.rollout.engine import EngineError, Generation, SamplingParams


class Untrained(str):
    """A scripted turn that is played but not imitated: a warm start gives its tokens loss mask 0
    (e.g. an expert's deliberate wrong edit, there so that the next turn shows how to recover)."""


class Miss(str):
    """A scripted turn that is imitated although it does not solve the task (a noisy expert's plausible
    wrong fix): a warm start keeps the episode, which fails, and trains on it like any other."""


class ScriptedEngine:
    """``add(prompt_ids, turns)`` registers the texts to answer an episode whose prompt is ``prompt_ids``.

    The turn being asked for is the number of generation prompts in the input after the first.
    Each answer is ``encode(text) + [end of turn]`` with log-prob 0.0 per token (a deterministic policy).
    """

    def __init__(
        self, tokenizer, *, end_of_turn: str | None = None, generation_prompt: str = "<|im_start|>assistant\n"
    ):
        self.tok = tokenizer
        self.eot_id = tokenizer.convert_tokens_to_ids(end_of_turn or tokenizer.eos_token)
        self.gen_prompt = tokenizer.encode(generation_prompt, add_special_tokens=False)
        self._scripts: dict[int, dict[tuple[int, ...], list[str]]] = {}
        self.weight_version = "scripted"

    def add(self, prompt_ids: list[int], turns: list[str]) -> None:
        scripts = self._scripts.setdefault(len(prompt_ids), {})
        key, turns = tuple(prompt_ids), list(turns)
        if scripts.get(key, turns) != turns:
            raise ValueError(
                "another script is registered for the same prompt (two tasks render the same prompt): "
                "use one ScriptedEngine per episode"
            )
        scripts[key] = turns

    def _turn(self, input_ids: list[int]) -> int:
        g, n, count = self.gen_prompt, len(self.gen_prompt), 0
        for i in range(len(input_ids) - n + 1):
            if input_ids[i : i + n] == g:
                count += 1
        return count - 1

    async def generate(self, input_ids: list[int], params: SamplingParams) -> Generation:
        for length, scripts in self._scripts.items():
            script = scripts.get(tuple(input_ids[:length]))
            if script is not None:
                break
        else:
            raise EngineError("no script registered for this prompt")
        turn = self._turn(input_ids)
        text = script[turn] if turn < len(script) else ""
        ids = self.tok.encode(text, add_special_tokens=False) + [self.eot_id]
        reason = "stop"
        if len(ids) > params.max_new_tokens:
            ids, reason = ids[: params.max_new_tokens], "length"
        return Generation(ids, [0.0] * len(ids), reason, self.weight_version)

    async def update_weights(self, *args, **kwargs) -> str:
        return self.weight_version

    async def health(self) -> bool:
        return True
