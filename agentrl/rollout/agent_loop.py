"""One multi-turn episode, token in / token out: what the policy sampled is exactly what is trained on.

    trajectory = await run_episode(env, engine, tokenizer, task, LoopConfig())

- The prompt is rendered once with the tokenizer's chat template (tool specs passed to it).
- Each turn sends the exact current token ids; the sampled ids are appended as they are (mask 1,
  the engine's log-probs), the end-of-turn token the model produced included. They are decoded
  only to parse tool calls, and never replaced by a re-encoding of their text.
- Observations: only the new part (the template's glue after the assistant turn, the tool
  messages, the next generation prompt) is tokenised, and appended with mask 0 and log-prob 0.0.
  Its cost does not grow with the length of the episode.
- Re-tokenisation drift (``encode(decode(ids)) != ids`` for an assistant turn) is counted in
  ``trajectory.extra["retokenization_drift_turns"]`` and never hidden by rewriting history.
- Budgets: per-turn ``max_new_tokens`` clamped to the remaining context (a turn may fill it,
  its end-of-turn token last); ``max_turns``; a wall-clock ``deadline_s``. Each end sets its
  status; engine and env failures set theirs: output a trajectory cannot hold (a NaN or positive
  log-prob) is the engine's, a ``grade()`` that fails for a cut-off episode the env's, never a
  reward of 0. A cancelled episode, or one whose generation the engine aborted (``finish_reason``
  ``abort``), closes its env (a cancellation waits for the close) and returns its trajectory with
  status ``aborted``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import zlib
from dataclasses import dataclass, field, replace
from typing import Any

from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from agentrl.env import AgentEnv, Task
from agentrl.rollout.engine import Engine, EngineError, Generation, SamplingParams
from agentrl.rollout.render import Renderer
from agentrl.sandbox import SandboxError
from agentrl.tools import ParsedTurn, ToolCall, get_parser
from agentrl.trajectory import NOT_TRAINABLE, STATUSES, Trajectory, TrajectoryError, TurnSpan

log = logging.getLogger(__name__)
TASK_DATA_MAX = 4096
"""A task's data up to this many characters of JSON is stored with its trajectories (``extra.task_data``)."""
LOGPROB_SLACK = 1e-4
"""A sampled token's log-prob may exceed 0 by this much (float rounding of a log-softmax near 0); it is stored as 0.0."""
GRADE_TIMEOUT_S = 300.0
"""Seconds ``env.grade()`` of a cut-off episode may take."""
CLOSE_WAIT_S = 60.0
"""Seconds a cancelled episode still waits for ``env.close()`` (its sandbox) before it returns."""


@dataclass
class LoopConfig:
    max_turns: int = 20
    """Assistant turns before the episode ends with status max_turns."""
    max_context: int = 8192
    """Tokens the whole episode may hold (prompt, turns, observations)."""
    max_new_tokens: int = 1024
    """Per-turn generation budget, clamped to what is left of max_context."""
    deadline_s: float = 1800.0
    """Wall-clock seconds for the whole episode."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    tool_format: str = "hermes"
    """Tool-call parser: hermes (Qwen, Hermes) or glm (GLM-4.5/5)."""
    end_of_turn: str | None = None
    """The token that ends an assistant turn (default: the tokenizer's eos token)."""
    engine_retries: int = 3
    """Attempts of a generate call that failed with a transient engine error."""
    reset_retries: int = 3
    """Attempts of ``env.reset`` that failed with a sandbox error (a daemon hiccup, a container that would not start)."""
    grade_on_truncation: bool = True
    """When the episode ends on max_turns, context or deadline, ask the env to grade the work so far."""
    seed: int | None = None
    """Base sampling seed; each (task, sample, turn) draws its own seed from it (None: unseeded)."""
    extra_sampling: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Values come from YAML and the command line; unchecked, a bad one would end every episode
        # as env_error, which a rollout counts and the trainer drops.
        def integer(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def number(v: Any) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool)

        checks = [
            ("max_turns", integer(self.max_turns) and self.max_turns >= 1, "an integer >= 1"),
            ("max_context", integer(self.max_context) and self.max_context >= 1, "an integer >= 1"),
            ("max_new_tokens", integer(self.max_new_tokens) and self.max_new_tokens >= 1, "an integer >= 1"),
            ("deadline_s", number(self.deadline_s) and self.deadline_s > 0, "a number of seconds > 0"),
            ("temperature", number(self.temperature) and self.temperature >= 0, "a number >= 0 (0: greedy)"),
            ("top_p", number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", integer(self.top_k) and self.top_k >= -1, "an integer >= 1, or -1 or 0 for no top-k"),
            ("tool_format", isinstance(self.tool_format, str), "the name of a tool-call format"),
            ("end_of_turn", self.end_of_turn is None or isinstance(self.end_of_turn, str), "a token or null"),
            ("engine_retries", integer(self.engine_retries) and self.engine_retries >= 1, "an integer >= 1"),
            ("reset_retries", integer(self.reset_retries) and self.reset_retries >= 1, "an integer >= 1"),
            ("grade_on_truncation", isinstance(self.grade_on_truncation, bool), "true or false"),
            ("seed", self.seed is None or integer(self.seed), "an integer or null"),
            ("extra_sampling", isinstance(self.extra_sampling, dict), "a mapping"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"loop.{name} must be {rule}; got {getattr(self, name)!r}")
        try:
            get_parser(self.tool_format)
        except ValueError as e:
            raise ValueError(f"loop.tool_format: {e}") from None


class DeadlinePassed(Exception):
    """The episode's deadline passed during one of its calls (status ``timeout``). Not a
    ``TimeoutError``: one raised by an env or engine is that component's failure, not the policy's."""


async def _within(awaitable, budget_s: float):
    """``await awaitable`` in the episode's time left: ``DeadlinePassed`` when it runs out. (Not
    ``asyncio.wait_for``: on Python 3.11 it drops a cancellation that arrives as the call ends.)"""
    timeout = asyncio.timeout(max(budget_s, 0.001))
    try:
        async with timeout:
            return await awaitable
    except TimeoutError:
        if timeout.expired():
            raise DeadlinePassed from None
        raise


def _transient(e: BaseException) -> bool:
    # Not DeadlinePassed: the episode's deadline, which a retry cannot meet.
    return (isinstance(e, EngineError) and e.transient) or isinstance(e, ConnectionError)


async def _with_retries(call, *, retry_on, attempts: int, counters: dict[str, int], key: str):
    """Await ``call()``, again on failures that ``retry_on`` accepts (counted in ``counters[key]``)."""
    async for attempt in AsyncRetrying(
        retry=retry_if_exception(retry_on),
        stop=stop_after_attempt(attempts),
        wait=wait_exponential(multiplier=0.1, max=2.0),
        reraise=True,
    ):
        with attempt:
            if attempt.retry_state.attempt_number > 1:
                counters[key] += 1
            return await call()


def _checked(gen: Generation) -> Generation:
    """``gen`` if its ids and log-probs can enter a trajectory (log-probs within ``LOGPROB_SLACK``
    above 0 are set to 0.0); an EngineError naming the first bad value otherwise, which ends the
    episode (a diverged policy's NaN logits), not the rollout."""
    if len(gen.logprobs) != len(gen.output_ids):
        raise EngineError(
            f"the engine returned {len(gen.output_ids)} token ids but {len(gen.logprobs)} log-probs; "
            "it must return one log-prob per sampled token"
        )
    for i, (token, lp) in enumerate(zip(gen.output_ids, gen.logprobs, strict=True)):
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise EngineError(f"the engine returned output_ids[{i}] = {token!r}, which is not a token id")
        if not isinstance(lp, int | float) or not math.isfinite(lp) or lp > LOGPROB_SLACK:
            raise EngineError(
                f"the engine returned logprobs[{i}] = {lp!r}; a log-prob must be finite and <= 0 "
                "(NaN or inf: the policy's logits are not finite)"
            )
    if any(lp > 0 for lp in gen.logprobs):
        return replace(gen, logprobs=[min(float(lp), 0.0) for lp in gen.logprobs])
    return gen


async def _generate(engine: Engine, input_ids: list[int], params: SamplingParams, budget_s: float):
    """One engine call under the episode's deadline; any failure of the engine, or output that
    cannot be trained on, becomes an EngineError."""
    try:
        # The live list, not a copy: copying would cost O(history) per turn. Engines must not mutate it.
        return _checked(await _within(engine.generate(input_ids, params), budget_s))
    except (EngineError, DeadlinePassed, asyncio.CancelledError):
        raise
    except TimeoutError as e:  # the engine's own, not the episode's deadline
        raise EngineError(f"the engine timed out: {e or 'TimeoutError'}", transient=True) from e
    except ConnectionError as e:
        raise EngineError(f"engine unreachable: {e}", transient=True) from e
    except Exception as e:
        raise EngineError(f"{type(e).__name__}: {e}") from e


def _parse_safely(parse, text: str, tools) -> ParsedTurn:
    """``parse(text, tools)``; should the parser raise, one error call instead, so the episode goes on.

    An exception here would end the episode as env_error, which the trainer drops: the turn that
    broke the parser would never be penalised.
    """
    try:
        return parse(text, tools)
    except Exception as e:
        log.warning(
            "the tool-call parser raised %s on a %d-character turn: %s", type(e).__name__, len(text), e
        )
        error = (
            f"the tool calls of this turn could not be read ({type(e).__name__}: {str(e)[:120]}); "
            "write each call in the format the system prompt shows."
        )
        return ParsedTurn(text.strip(), [ToolCall("", id="call_0", raw=text, error=error)])


def _env_status(status: Any) -> str:
    """The status an env ended an episode with (``info["status"]``): one of the trajectory's."""
    if status not in STATUSES:
        raise ValueError(
            f"step() ended the episode with info['status'] = {status!r}, which is not one of {STATUSES}; "
            "leave it out (completed), or put the env's own outcome under another key of info"
        )
    return status


def _env_reward(reward: Any, where: str) -> float:
    """An env's reward as a finite float, or a ValueError naming where it came from."""
    try:
        value = float(reward)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"{where} returned reward {reward!r}; a reward must be a finite number")
    return value


async def run_episode(
    env: AgentEnv,
    engine: Engine,
    tokenizer,
    task: Task,
    config: LoopConfig | None = None,
    *,
    sample_index: int = 0,
    renderer: Renderer | None = None,
) -> Trajectory:
    """Drive ``env`` with ``engine`` for one episode of ``task``; always returns a valid trajectory."""
    cfg = config or LoopConfig()
    parse = get_parser(cfg.tool_format)
    render = renderer or Renderer(tokenizer, cfg.end_of_turn)
    start = time.monotonic()
    deadline = start + cfg.deadline_s
    traj = Trajectory(
        [], [], [], [], env_id=getattr(env, "id", ""), task_id=task.id, sample_index=sample_index
    )
    traj.seed = cfg.seed
    traj.extra["max_turns"] = cfg.max_turns  # the turn limit, for replay to rebuild the env with it
    try:  # the task's own data, small, so that replay can rebuild the task without searching for it
        if len(json.dumps(task.data)) <= TASK_DATA_MAX:
            traj.extra["task_data"] = task.data
    except (TypeError, ValueError):
        pass
    counters = {
        "tool_call_errors": 0,
        "retokenization_drift_turns": 0,
        "engine_retries": 0,
        "reset_retries": 0,
    }
    status, reward, graded, started = None, 0.0, False, False

    def append(ids: list[int], role: str, logprobs: list[float] | None = None) -> None:
        n = len(traj.input_ids)
        traj.input_ids.extend(ids)
        traj.loss_mask.extend([1 if role == "assistant" else 0] * len(ids))
        traj.rollout_logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        traj.turns.append(TurnSpan(n, n + len(ids), role))

    def left() -> float:
        return deadline - time.monotonic()

    try:
        obs = await _with_retries(
            lambda: _within(env.reset(task), left()),
            retry_on=lambda e: isinstance(e, SandboxError | ConnectionError),
            attempts=cfg.reset_retries,
            counters=counters,
            key="reset_retries",
        )
        started = True
        tools = obs.tools
        traj.messages = list(obs.messages)
        append(render.prompt(obs.messages, tools), "prompt")
        turn = 0
        while True:
            if turn >= cfg.max_turns:
                status = "max_turns"
                break
            room = cfg.max_context - len(traj.input_ids)
            if room <= 0:
                status = "truncated_context"
                break
            params = SamplingParams(
                max_new_tokens=min(cfg.max_new_tokens, room),
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                stop_token_ids=[render.eot_id],
                seed=None
                if cfg.seed is None
                else zlib.crc32(f"{cfg.seed}/{task.id}/{sample_index}/{turn}".encode()),
            )
            t0 = time.monotonic()
            gen = await _with_retries(
                lambda p=params: _generate(engine, traj.input_ids, p, left()),
                retry_on=_transient,
                attempts=cfg.engine_retries,
                counters=counters,
                key="engine_retries",
            )
            generate_s = time.monotonic() - t0
            if gen.output_ids:  # an aborted request may end before its first token
                append(list(gen.output_ids), "assistant", list(gen.logprobs))
                traj.weight_versions.append(str(gen.weight_version))
            traj.finish_reasons.append(gen.finish_reason)
            turn += 1
            if gen.finish_reason == "abort":  # the server dropped the request (/abort_request, a pause)
                status = "aborted"
                traj.timings.append({"generate_s": generate_s})
                break

            ended = bool(gen.output_ids) and gen.output_ids[-1] == render.eot_id
            body_ids = gen.output_ids[:-1] if ended else gen.output_ids
            text = tokenizer.decode(body_ids, skip_special_tokens=False)
            if render.encode(text) != list(body_ids):
                counters["retokenization_drift_turns"] += 1
            parsed = _parse_safely(parse, text, tools)
            counters["tool_call_errors"] += parsed.errors
            traj.messages.append(
                {"role": "assistant", "content": text, "tool_calls": [c.to_dict() for c in parsed.calls]}
            )
            # A turn may fill the context to its last token with its end-of-turn; one cut there is unfinished.
            if len(traj.input_ids) > cfg.max_context or (
                len(traj.input_ids) == cfg.max_context and not ended
            ):
                status = "truncated_context"
                traj.timings.append({"generate_s": generate_s})
                break

            t1 = time.monotonic()
            step = (
                env.step(parsed.calls, text=parsed.content)
                if getattr(env, "reads_text", False)
                else env.step(parsed.calls)
            )
            result = await _within(step, left())
            traj.timings.append({"generate_s": generate_s, "tool_s": time.monotonic() - t1})
            for call in result.info.get("tool_calls", []):
                traj.tool_calls.append({"turn": turn - 1, **call})
            if result.done:
                reward, graded = _env_reward(result.reward, "step()"), True
                status = _env_status(result.info.get("status", "completed"))
                if result.info.get("grade") is not None:  # the env's grading report, shown by replay
                    traj.extra["grade"] = json.loads(json.dumps(result.info["grade"], default=str))
                break
            obs_ids = render.observation(result.observation, after_eot=ended)
            traj.messages.extend(result.observation)
            if len(traj.input_ids) + len(obs_ids) >= cfg.max_context:
                status = "truncated_context"  # no room to answer the observation: do not append half of it
                break
            append(obs_ids, "tool")
    except DeadlinePassed:
        if started:
            status = "timeout"
        else:  # no prompt yet: the env was too slow to start, nothing the policy did
            status = "env_error"
            traj.extra["error"] = (
                f"reset() did not finish within the episode's deadline ({cfg.deadline_s:g}s)"
            )
    except EngineError as e:
        status = "engine_error"
        traj.extra["error"] = f"{type(e).__name__}: {e}"
    except asyncio.CancelledError:
        status = "aborted"
        task_obj = asyncio.current_task()
        if task_obj is not None:
            task_obj.uncancel()
    except Exception as e:
        # Anything the env raised (or a bug in a tool runner): the episode ends, the pool goes on.
        status = "env_error"
        traj.extra["error"] = f"{type(e).__name__}: {e}"
        log.warning("episode %s/%s ended with env_error: %s", traj.env_id, task.id, e)
    finally:
        try:
            cut = status in ("max_turns", "truncated_context", "timeout")
            grade = getattr(env, "grade", None)
            if cut and started and cfg.grade_on_truncation and not graded and grade is not None:
                try:
                    reward = _env_reward(
                        await asyncio.shield(asyncio.wait_for(grade(), GRADE_TIMEOUT_S)), "grade()"
                    )
                except asyncio.CancelledError:  # the run is stopping: the episode ends unrewarded
                    status = "aborted"
                    if (current := asyncio.current_task()) is not None:
                        current.uncancel()
                except Exception as e:
                    # No grade is not a reward of 0: trained on, it would teach that the work was wrong.
                    traj.extra["error"] = f"grade() of the {status} episode failed: {type(e).__name__}: {e}"
                    status = "env_error"
        finally:  # whatever grading raised, the env (its sandbox) is closed
            await _close(env, traj)
    traj.status = status or "completed"
    traj.reward = reward if traj.status not in NOT_TRAINABLE else 0.0
    traj.extra.update(counters)
    traj.extra["wall_s"] = time.monotonic() - start
    try:
        return traj.validate()
    except TrajectoryError as e:
        # What the per-turn checks missed: this episode's tokens are dropped, and the rollout goes on.
        log.warning("episode %s/%s broke a trajectory invariant: %s", traj.env_id, task.id, e)
        traj.status, traj.reward = "engine_error", 0.0
        traj.extra["error"] = "; ".join(filter(None, [traj.extra.get("error"), f"TrajectoryError: {e}"]))
        traj.input_ids, traj.loss_mask, traj.rollout_logprobs, traj.turns = [], [], [], []
        return traj.validate()


async def _close(env: AgentEnv, traj: Trajectory) -> None:
    """``env.close()``; a cancellation meanwhile waits for it (up to ``CLOSE_WAIT_S``) and is then
    taken as the episode's end, so that whoever waits for a cancelled episode waits for its sandbox."""
    closing = asyncio.ensure_future(env.close())
    try:
        await asyncio.shield(closing)
    except asyncio.CancelledError:
        if (current := asyncio.current_task()) is not None:
            current.uncancel()
        await asyncio.wait([closing], timeout=CLOSE_WAIT_S)
    except Exception:
        pass  # read from the task below
    if not closing.done():
        traj.extra["close_error"] = (
            f"close() had not finished {CLOSE_WAIT_S:g}s after the episode was cancelled"
        )
    elif closing.cancelled():
        traj.extra["close_error"] = "close() was cancelled"
    elif (e := closing.exception()) is not None:
        traj.extra["close_error"] = f"{type(e).__name__}: {e}"
