"""Re-execution of a stored episode: its recorded tool calls replayed in a fresh environment of the
same id and task, each observation compared with the recorded one (``agentrl replay --reexec``).

No model runs: turn ``k``'s tool calls are the ones the agent loop parsed from the policy's text
and stored with the assistant message (``messages[...]["tool_calls"]``, malformed ones included,
so the env answers them as it did). After each ``step`` the comparison is, in order: for every
tool call, its exit code and its output (the env's ``info["tool_calls"]`` against the trajectory's
``tool_calls`` of that turn); then the observation messages the policy read; when the env ends the
episode, whether it ends on the same turn, with the same status and reward. The first difference is the
divergence. Durations that tools print ("5 passed in 0.03s") are masked before comparing (``VOLATILE``;
``exact=True`` compares every byte). An identical replay says the environment reproduces the episode, so a bad episode is
the policy's doing; a divergence on a call whose inputs were the same points at a
nondeterministic environment (time, randomness, network, state left over between episodes).

The environment is the run's: a run directory's ``config.json`` gives ``env.args``, the sandbox
kind and the turn limit (``agentrl.rollout.from_config.env_factory``, as training built it).
A bare store has no config; its env is built from the registered defaults and ``sandbox``, with
the turn limit the loop stored with the episode (``extra["max_turns"]``) as its ``max_turns``, or,
in stores written before episodes carried it, the episode's turns when the env ended it ``max_turns``.
The task is rebuilt from the data the agent loop stored with the trajectory
(``extra["task_data"]``), or else found by id in the env's splits.

Environments that read the assistant's plain text (``reads_text``) get the recorded assistant text
whole, tool-call markup included (the loop passed them the text without it; the store keeps only
the whole text).
"""

from __future__ import annotations

import asyncio
import difflib
import json
import re
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from agentrl.env import AgentEnv, Task
from agentrl.replay.episodes import ReplayError
from agentrl.replay.transcript import turn_messages
from agentrl.tools import ToolCall
from agentrl.trajectory import NOT_TRAINABLE, Trajectory

SCAN_LIMIT = 20_000
"""At most this many tasks of each split are searched for a task id (stores written before
trajectories carried their task's data)."""
VOLATILE = re.compile(r"\b(in|took) \d+(\.\d+)?\s?(s|ms|seconds)\b")
"""Wall-clock durations a tool prints ("15 passed in 0.03s", unittest's "Ran 3 tests in 0.001s"):
they differ on every run, so they are compared as ``<duration>`` unless ``exact``."""
STEPPED_LAST = {"completed", "max_turns"}
"""Statuses after which the env was stepped on the last assistant turn even when nothing of that
step was recorded (the loop breaks before stepping on truncation, an abort, an engine error)."""


@dataclass
class Divergence:
    """Where the replay first differs: ``turn`` from 1 (0: the reset), ``call`` from 1 when a tool
    call's result differs, ``what`` (exit_code, output, observation, end, reward, error)."""

    turn: int
    what: str
    recorded: Any
    now: Any
    call: int | None = None
    name: str = ""

    def where(self) -> str:
        if self.turn == 0:
            return "reset"
        call = f", call {self.call} ({self.name})" if self.call else ""
        return f"turn {self.turn}{call}"


@dataclass
class Replayed:
    """What a re-execution did: turns stepped, calls compared, and the first divergence (if any)."""

    turns: int = 0
    calls: int = 0
    divergence: Divergence | None = None
    reward: float | None = None
    """The reward of the replay when the env ended it (None when it did not)."""
    notes: list[str] = field(default_factory=list)


def assistant_turns(t: Trajectory) -> list[tuple[dict, list[dict]]]:
    """Per assistant message: it and the messages that followed it (the observation it got)."""
    return turn_messages(t.messages)[1]


def prompt_messages(t: Trajectory) -> list[dict]:
    return turn_messages(t.messages)[0]


def recorded_calls(message: dict) -> list[ToolCall]:
    calls = []
    for c in message.get("tool_calls") or []:
        calls.append(
            ToolCall(
                name=str(c.get("name") or ""),
                arguments=dict(c.get("arguments") or {}),
                id=str(c.get("id") or ""),
                error=c.get("error"),
                raw=str(c.get("raw") or ""),
            )
        )
    return calls


def find_task(env: AgentEnv, t: Trajectory, splits: list[str]) -> Task:
    """The episode's task: rebuilt from its stored data, or searched for by id in ``splits``."""
    data = t.extra.get("task_data")
    if isinstance(data, dict):
        return Task(t.task_id, data)
    searched = []
    for split in dict.fromkeys(splits):
        try:
            tasks = env.tasks(split)
        except (KeyError, ValueError):
            continue
        for task in islice(tasks, SCAN_LIMIT):
            if task.id == t.task_id:
                return task
        searched.append(f"{split} ({min(len(tasks), SCAN_LIMIT)} tasks)")
    raise ReplayError(
        f"task {t.task_id!r} of environment {t.env_id} is in none of its splits searched: "
        f"{', '.join(searched) or 'none could be listed'}; the trajectory carries no task data "
        "(stores written before it did), so the task cannot be rebuilt"
    )


def _same(a: Any, b: Any, exact: bool) -> bool:
    if exact or not isinstance(a, str) or not isinstance(b, str):
        return a == b
    return VOLATILE.sub(r"\1 <duration>", a) == VOLATILE.sub(r"\1 <duration>", b)


def _text(messages: list[dict], exact: bool = True) -> list[dict]:
    """Messages as the policy read them (role, name, content), for comparison (durations masked
    unless ``exact``)."""
    out = []
    for m in messages:
        kept = {k: m.get(k) for k in ("role", "name", "content") if m.get(k) is not None}
        if not exact and isinstance(kept.get("content"), str):
            kept["content"] = VOLATILE.sub(r"\1 <duration>", kept["content"])
        out.append(kept)
    return out


def _call_divergence(turn: int, recorded: list[dict], now: list[dict], exact: bool) -> Divergence | None:
    for i, (old, new) in enumerate(zip(recorded, now, strict=False), 1):
        name = str(old.get("name") or new.get("name") or "")
        for key in ("exit_code", "output"):
            if key in old and not _same(old.get(key), new.get(key), exact):
                return Divergence(turn, key, old.get(key), new.get(key), call=i, name=name)
    if len(recorded) != len(now):
        return Divergence(turn, "calls", len(recorded), len(now))
    return None


async def reexec(env: AgentEnv, t: Trajectory, task: Task, *, exact: bool = False) -> Replayed:
    """Step ``env`` through ``t``'s recorded tool calls on ``task``; stop at the first divergence.
    Durations printed by tools are not compared (``VOLATILE``) unless ``exact``."""
    out = Replayed()
    calls_of: dict[int, list[dict]] = {}
    for call in t.tool_calls:
        calls_of.setdefault(int(call.get("turn", -1)), []).append(call)
    turns = assistant_turns(t)
    at = 0  # the turn being run (0: the reset)
    try:
        obs = await env.reset(task)
        if _text(obs.messages, exact) != _text(prompt_messages(t), exact):
            out.divergence = Divergence(0, "observation", _text(prompt_messages(t)), _text(obs.messages))
            return out
        for k, (message, after) in enumerate(turns):
            last = k == len(turns) - 1
            if last and not (calls_of.get(k) or after) and t.status not in STEPPED_LAST:
                out.notes.append(
                    f"turn {k + 1} was not run by the env in the recorded episode (it ended {t.status}); "
                    "not stepped"
                )
                break
            calls, at = recorded_calls(message), k + 1
            if getattr(env, "reads_text", False):
                result = await env.step(calls, text=str(message.get("content", "")))
            else:
                result = await env.step(calls)
            out.turns, out.calls = k + 1, out.calls + len(calls)
            now_calls = list(result.info.get("tool_calls", []))
            if d := _call_divergence(k + 1, calls_of.get(k, []), now_calls, exact):
                out.divergence = d
                return out
            if result.done:
                out.reward = float(result.reward)
                status = result.info.get("status", "completed")
                if not last:
                    out.divergence = Divergence(k + 1, "end", "the episode went on", "the env ended it here")
                elif after or status != t.status:  # the loop ended it (the env went on), or another end
                    by = " by the loop's turn limit (the env went on)" if after else ""
                    out.divergence = Divergence(
                        k + 1, "end", f"the episode ended {t.status}{by}", f"the env ended it {status}"
                    )
                elif out.reward != t.reward and t.status not in NOT_TRAINABLE:
                    out.divergence = Divergence(k + 1, "reward", t.reward, out.reward)
                return out
            if _text(result.observation, exact) != _text(after, exact):
                out.divergence = Divergence(k + 1, "observation", _text(after), _text(result.observation))
                return out
            if last and t.status == "completed":
                out.divergence = Divergence(k + 1, "end", "the env ended the episode", "the episode goes on")
                return out
        if t.status != "completed":
            out.notes.append(f"the recorded episode ended {t.status}; the env did not end it, as recorded")
        return out
    except Exception as e:  # what the env raises is the replay's result, as it was the episode's
        # As recorded: the episode ended env_error on this same turn (its last), with the same error.
        recorded = t.extra.get("error", "") if t.status == "env_error" else ""
        now = f"{type(e).__name__}: {e}"
        if recorded != now or at != len(turns):
            out.divergence = Divergence(at, "error", recorded or "no error", now)
        return out
    finally:
        try:
            await asyncio.shield(env.close())
        except Exception as e:
            out.notes.append(f"closing the env failed: {type(e).__name__}: {e}")


def build_env(store: Path, t: Trajectory, sandbox: str | None) -> tuple[AgentEnv, list[str], str]:
    """The episode's environment, its split names, and where its settings came from."""
    from agentrl.config import ConfigError, TrainConfig, env_factory_params, make_env, validate_settings
    from agentrl.rollout.from_config import env_factory

    config = store.parent / "config.json" if store.name == "trajectories" else None
    if config is not None and config.is_file():
        try:
            cfg = validate_settings(TrainConfig, json.loads(config.read_text()))
        except ValueError as e:  # not JSON, or settings this version does not read (a ConfigError)
            raise ReplayError(
                f"{config} is not a run config this version reads ({e}); copy the episode's shard "
                "to a store of its own to re-execute it there"
            ) from None
        if cfg.env.id != t.env_id:
            raise ReplayError(
                f"the episode is of environment {t.env_id!r} but {config} runs {cfg.env.id!r}; "
                "copy the episode's shard to a store of its own to re-execute it"
            )
        if sandbox is not None:
            cfg.sandbox.kind = sandbox
        try:
            env = env_factory(cfg)()
        except ConfigError as e:
            raise ReplayError(str(e)) from None
        return env, [cfg.env.train_split, cfg.env.eval_split, "train", "test"], f"{config}"
    try:
        params = env_factory_params(t.env_id)
        args: dict[str, Any] = {}
        if "sandbox" in params:
            from agentrl.sandbox import NoSandboxError, resolve_kind

            try:
                args["sandbox"] = resolve_kind(sandbox or "auto")
            except NoSandboxError as e:
                raise ReplayError(str(e)) from None
        if "max_turns" in params and (limit := turn_limit(t)):
            args["max_turns"] = limit
        env = make_env(t.env_id, args, "--sandbox")
    except ConfigError as e:
        raise ReplayError(str(e)) from None
    return (
        env,
        ["train", "test"],
        "the environment's registered defaults"
        + (f", sandbox {args['sandbox']}" if "sandbox" in args else "")
        + (f", max_turns {args['max_turns']} ({limit_source(t)})" if "max_turns" in args else ""),
    )


def turn_limit(t: Trajectory) -> int | None:
    """The turn limit the episode ran under: as the loop stored it, else as the episode shows it."""
    stored = t.extra.get("max_turns")
    if isinstance(stored, int) and not isinstance(stored, bool) and stored >= 1:
        return stored
    return env_turn_limit(t)


def limit_source(t: Trajectory) -> str:
    stored = t.extra.get("max_turns")
    return "where the episode ended" if turn_limit(t) != stored else "as the episode recorded it"


def env_turn_limit(t: Trajectory) -> int | None:
    """The env's turn limit as the episode shows it: its number of turns when it ended ``max_turns``
    with nothing after the last turn (the env ended it; the loop would have kept its observation);
    else None (a bare store does not say)."""
    turns = assistant_turns(t)
    if t.status == "max_turns" and turns and not turns[-1][1]:
        return len(turns)
    return None


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, indent=1)


def describe(result: Replayed, t: Trajectory, max_lines: int = 40) -> list[str]:
    """The report's lines: what was compared, then the divergence with a diff of its values."""
    lines = [f"replayed {result.turns} turn{'s' * (result.turns != 1)}, {result.calls} tool calls"]
    lines += [f"note: {n}" for n in result.notes]
    d = result.divergence
    if d is None:
        ended = (
            f"; the env gave reward {result.reward:g} (recorded {t.reward:g})"
            if result.reward is not None
            else ""
        )
        lines.append(f"identical: every exit code, output and observation as recorded{ended}")
        return lines
    lines.append(f"first divergence: {d.where()}: {d.what} differs")
    old, new = _show(d.recorded), _show(d.now)
    if "\n" in old or "\n" in new or len(old) + len(new) > 120:
        diff = list(
            difflib.unified_diff(
                old.splitlines(), new.splitlines(), "recorded", "re-executed", lineterm="", n=2
            )
        )
        lines += diff[:max_lines] + (
            [f"… {len(diff) - max_lines} more diff lines"] if len(diff) > max_lines else []
        )
    else:
        lines += [f"  recorded:    {old}", f"  re-executed: {new}"]
    return lines
