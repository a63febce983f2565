"""Scripted assistant turns played as tokens behind the real agent loop.

``ScriptedEngine`` answers each turn with a given text, so an expert's episode runs through exactly
the code path a model takes (render, generate, parse, step, observe, grade); ``play_demonstration``
plays an environment's ``Demonstration`` that way, for supervised warm starts and ``agentrl envs check``.
"""

from __future__ import annotations

from agentrl.env import AgentEnv, Demonstration, Task
from agentrl.rollout.agent_loop import LoopConfig, run_episode
from agentrl.rollout.engine import Generation, SamplingParams
from agentrl.rollout.render import Renderer
from agentrl.tools import RENDERERS
from agentrl.trajectory import Trajectory


class ScriptedEngine:
    """Answers turn k of one episode with ``script[k]`` (an empty turn past its end):
    ``ScriptedEngine(tok, script=[...])``, one engine per episode.

    The turn being asked for is the number of shorter inputs the episode has asked with before: the
    loop only appends to an episode's ids, so each turn's input extends the last one's (the same input
    again, a retried request, gets the same turn). No chat format's markers are read.
    Each answer is ``encode(text) + [end of turn]`` with log-prob 0.0 per token (a deterministic policy).
    """

    def __init__(self, tokenizer, *, script: list[str], end_of_turn: str | None = None):
        self.tok = tokenizer
        self.eot_id = tokenizer.convert_tokens_to_ids(end_of_turn or tokenizer.eos_token)
        self.script = list(script)
        self._asked: set[int] = set()  # the input lengths the episode has asked with
        self.weight_version = "scripted"

    async def generate(self, input_ids: list[int], params: SamplingParams) -> Generation:
        self._asked.add(len(input_ids))
        turn = sum(1 for n in self._asked if n < len(input_ids))
        text = self.script[turn] if turn < len(self.script) else ""
        ids = self.tok.encode(text, add_special_tokens=False) + [self.eot_id]
        reason = "stop"
        if len(ids) > params.max_new_tokens:
            ids, reason = ids[: params.max_new_tokens], "length"
        return Generation(ids, [0.0] * len(ids), reason, self.weight_version)

    async def update_weights(self, *args, **kwargs) -> str:
        return self.weight_version

    async def health(self) -> bool:
        return True

    async def close(self) -> None:
        pass


def demonstration_texts(demo: Demonstration, tool_format: str) -> list[str]:
    """The demonstration's assistant turns as a model would write them in ``tool_format``."""
    if tool_format not in RENDERERS:
        raise ValueError(f"tool_format must be one of {sorted(RENDERERS)}; got {tool_format!r}")
    render = RENDERERS[tool_format]
    texts = []
    for turn in demo.turns:
        calls = render(turn.calls) if turn.calls else ""
        texts.append("\n".join(t for t in (turn.content, calls) if t))
    return texts


async def play_demonstration(
    env: AgentEnv,
    tokenizer,
    task: Task,
    demo: Demonstration,
    loop: LoopConfig,
    *,
    renderer: Renderer | None = None,
) -> Trajectory:
    """One episode of ``task`` in which the assistant's turns are ``demo``'s, through the real loop.
    A turn marked ``trainable=False`` keeps loss mask 0 (played, not imitated); ``extra`` records the
    reward the demonstration meant to earn (``demo_reward``)."""
    engine = ScriptedEngine(tokenizer, script=demonstration_texts(demo, loop.tool_format))
    trajectory = await run_episode(env, engine, tokenizer, task, loop, renderer=renderer)
    played = [s for s in trajectory.turns if s.role == "assistant"]
    for turn, span in zip(demo.turns, played, strict=False):
        if not turn.trainable:
            n = span.end - span.start
            trajectory.loss_mask[span.start : span.end] = [0] * n
            trajectory.rollout_logprobs[span.start : span.end] = [0.0] * n
    trajectory.extra["demo_reward"] = demo.reward
    return trajectory


async def check_demonstration(
    make_env, demos: list[tuple[Task, Demonstration | None]], tokenizer, loop: LoopConfig
) -> list[str]:
    """``agentrl envs check``'s episode checks, through the real loop: each ``(task, demonstration)``
    of ``demos`` (None: the env has none for it) earns the reward it means to, and an episode of the
    first task whose assistant does nothing earns no success (a grader that passes untouched work
    teaches nothing). Returns what passed; ``EnvCheckError`` names what did not."""
    from agentrl.env import EnvCheckError
    from agentrl.trajectory import NOT_TRAINABLE, succeeded

    passed, played_rewards = [], []
    for task, demo in demos:
        if demo is None:
            continue
        env = make_env()
        played = await play_demonstration(env, tokenizer, task, demo, loop)
        if played.status != "completed" or played.reward != demo.reward:
            why = played.extra.get("error", "no error recorded")
            if played.status == "truncated_context":
                why = f"it outgrew the check's {loop.max_context}-token context"
            raise EnvCheckError(
                f"the demonstration of task {task.id} ended {played.status} with reward {played.reward}, "
                f"but means to earn {demo.reward} ({why}); fix demonstration() or the grading"
            )
        played_rewards.append(demo.reward)
    if len(played_rewards) == 1:
        passed.append(f"the demonstration earns its reward ({played_rewards[0]:g}) through the agent loop")
    elif played_rewards:
        rewards = ", ".join(f"{r:g}" for r in played_rewards)
        passed.append(
            f"the demonstrations of {len(played_rewards)} tasks earn their rewards ({rewards}) through the agent loop"
        )
    task = demos[0][0]
    idle = await run_episode(make_env(), ScriptedEngine(tokenizer, script=[""]), tokenizer, task, loop)
    if idle.status in NOT_TRAINABLE:
        raise EnvCheckError(
            f"an episode of task {task.id} in which the agent did nothing ended {idle.status} "
            f"({idle.extra.get('error', 'no error recorded')}): the env must end an episode normally "
            "whatever the agent does"
        )
    if succeeded(idle.reward):
        raise EnvCheckError(
            f"an episode of task {task.id} in which the agent did nothing earned reward {idle.reward}: "
            "the grading passes untouched work; check that the task starts broken"
        )
    passed.append(
        f"an agent that does nothing does not succeed (status {idle.status}, reward {idle.reward:g})"
    )
    return passed
