"""The trajectory record: one episode as the exact token ids the policy saw and sampled.

Everything downstream (the store, the trainer, replay) reads this record. ``input_ids`` holds the
whole episode: the rendered prompt, then every assistant turn exactly as sampled and every
observation as tokenised once. ``loss_mask`` is 1 only on tokens the policy sampled;
``rollout_logprobs`` holds the inference engine's log-prob of each of them (0.0 elsewhere).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

STATUSES = ("completed", "truncated_context", "max_turns", "timeout", "env_error", "engine_error", "aborted")
CUT_OFF = ("truncated_context", "max_turns", "timeout")
"""A budget (context, turns, wall clock) ended the episode, not the policy: trained on, counted as truncation."""
NOT_TRAINABLE = ("env_error", "engine_error", "aborted")
"""Not the policy's doing (the environment, the engine or a stop failed): reward 0, never trained on."""
SUCCESS_REWARD = 1.0
"""An episode succeeds when its reward reaches this (``succeeded``)."""


def succeeded(reward: float) -> bool:
    """The success rule of every metric (train success, held-out success, pass@n, warm-start filters)."""
    return reward >= SUCCESS_REWARD


ROLES = ("prompt", "assistant", "tool")


class TrajectoryError(ValueError):
    """A trajectory breaks one of its invariants; the message names the index that breaks it."""


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float in it replaced by None (JSON has neither): the
    free-form fields (messages, tool calls, extras: an env's grading report, a task's data) may hold
    one, and a trajectory must still be stored. The same object when there is none."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        items = {k: finite(v) for k, v in value.items()}
        return value if all(items[k] is v for k, v in value.items()) else items
    if isinstance(value, list | tuple):
        items = [finite(v) for v in value]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else items
    return value


@dataclass
class TurnSpan:
    """Tokens ``[start, end)`` of ``input_ids`` and who produced them."""

    start: int
    end: int
    role: str
    """``prompt`` (system + task + first generation prompt), ``assistant`` (sampled), ``tool`` (observation + template)."""


@dataclass
class Trajectory:
    input_ids: list[int]
    """The whole episode: prompt, then every turn, as token ids."""
    loss_mask: list[int]
    """1 on tokens the policy sampled (and is trained on), 0 elsewhere. Same length as input_ids."""
    rollout_logprobs: list[float]
    """The inference engine's log-prob of each sampled token; 0.0 where loss_mask is 0."""
    turns: list[TurnSpan]
    """Contiguous spans covering input_ids, in order."""
    reward: float = 0.0
    status: str = "completed"
    """One of STATUSES: how the episode ended."""
    env_id: str = ""
    task_id: str = ""
    seed: int | None = None
    sample_index: int = 0
    """Which of the n samples of this task (for group baselines)."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation as chat messages, for display; never used to rebuild input_ids."""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """Per call: turn, name, arguments, error (malformed), output, exit_code."""
    weight_versions: list[str] = field(default_factory=list)
    """Policy weight version that sampled each assistant turn."""
    finish_reasons: list[str] = field(default_factory=list)
    """Per assistant turn: stop, length, abort."""
    timings: list[dict[str, float]] = field(default_factory=list)
    """Per turn: seconds spent generating and running tools."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else (counters like tool-call errors and re-tokenisation drift)."""

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_trainable(self) -> int:
        return sum(self.loss_mask)

    def validate(self) -> Trajectory:
        """Check the invariants; raise ``TrajectoryError`` naming the first index that breaks one."""
        n = len(self.input_ids)
        if len(self.loss_mask) != n or len(self.rollout_logprobs) != n:
            raise TrajectoryError(
                f"lengths differ: input_ids {n}, loss_mask {len(self.loss_mask)}, "
                f"rollout_logprobs {len(self.rollout_logprobs)}; they must be equal"
            )
        if self.status not in STATUSES:
            raise TrajectoryError(f"status {self.status!r} is not one of {STATUSES}")
        if not isinstance(self.reward, int | float) or not math.isfinite(self.reward):
            raise TrajectoryError(f"reward must be a finite number; got {self.reward!r}")
        for i, token in enumerate(self.input_ids):
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise TrajectoryError(f"input_ids[{i}] = {token!r} is not a token id (a non-negative int)")
        expected = 0
        for k, span in enumerate(self.turns):
            if span.role not in ROLES:
                raise TrajectoryError(f"turns[{k}].role = {span.role!r} is not one of {ROLES}")
            if span.start != expected or span.end <= span.start:
                raise TrajectoryError(
                    f"turns[{k}] = [{span.start}, {span.end}) must start at {expected} and be non-empty "
                    "(spans are contiguous and cover input_ids in order)"
                )
            expected = span.end
        if expected != n:
            raise TrajectoryError(f"turns cover [0, {expected}) but input_ids has {n} tokens")
        assistant = [False] * n
        for span in self.turns:
            if span.role == "assistant":
                assistant[span.start : span.end] = [True] * (span.end - span.start)
        for i, (m, lp) in enumerate(zip(self.loss_mask, self.rollout_logprobs, strict=True)):
            if m not in (0, 1):
                raise TrajectoryError(f"loss_mask[{i}] = {m!r}; it must be 0 or 1")
            if m == 1 and not assistant[i]:
                raise TrajectoryError(
                    f"loss_mask[{i}] is 1 outside an assistant span (token {self.input_ids[i]})"
                )
            if m == 1 and not (isinstance(lp, int | float) and math.isfinite(lp) and lp <= 0.0):
                raise TrajectoryError(
                    f"rollout_logprobs[{i}] = {lp!r} at a trainable token; it must be finite and <= 0"
                )
            if m == 0 and lp != 0.0:
                raise TrajectoryError(
                    f"rollout_logprobs[{i}] = {lp!r} at a non-trainable token; it must be 0.0"
                )
        return self

    # -- serialisation --
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise TrajectoryError(f"unknown trajectory field(s) {sorted(unknown)}")
        values = dict(data)
        values["turns"] = [s if isinstance(s, TurnSpan) else TurnSpan(**s) for s in data.get("turns", [])]
        return cls(**values)

    def to_json(self) -> str:
        """JSON text; floats are written with ``repr`` precision, so ``from_json`` gives back equal values."""
        record = self.to_dict()
        for name in self._JSON_FIELDS:
            record[name] = finite(record[name])
        return json.dumps(record, allow_nan=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Trajectory:
        return cls.from_dict(json.loads(text))

    # Fields whose shape varies from record to record (chat messages, tool arguments, extras) are
    # stored as JSON text, so that a store has one stable Arrow schema for datasets.load_dataset.
    _JSON_FIELDS = ("messages", "tool_calls", "extra")

    def to_record(self) -> dict[str, Any]:
        record = self.to_dict()
        for name in self._JSON_FIELDS:
            record[name] = json.dumps(finite(record[name]), allow_nan=False, separators=(",", ":"))
        return record

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Trajectory:
        data = dict(record)
        for name in cls._JSON_FIELDS:
            if isinstance(data.get(name), str):
                data[name] = json.loads(data[name])
        return cls.from_dict(data)
