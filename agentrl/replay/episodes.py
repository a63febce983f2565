"""The episodes of a trajectory store as ``agentrl replay`` sees them: found, named, filtered.

An episode's id is ``<shard>:<line>``: the shard's file name without ``.jsonl.gz`` and the
record's line in its decompressed text (from 1), e.g. ``w0-00000:17``. It depends only on the
store's own files, so it is the same on a copy of the store on another machine. Listing reads
the records as JSON objects and builds no ``Trajectory``: the list of a 10,000-episode store
costs about what parsing its JSON costs (``benchmarks/replay_list.py``).
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.store import TrajectoryStore
from agentrl.trajectory import STATUSES, Trajectory


class ReplayError(ValueError):
    """Bad input to replay (a path, an id, a filter); the message names the value and what would do."""


@dataclass
class Damage:
    """A stretch of a shard that is not an intact trajectory record; it is skipped, the rest is shown."""

    shard: str
    line: int
    offset: int
    why: str

    def __str__(self) -> str:
        return f"{self.shard} line {self.line} (byte offset {self.offset}): {self.why}; skipped"


@dataclass
class Episode:
    """One stored episode: its id, where it is, and the fields of the list view."""

    id: str
    shard: Path
    offset: int
    record: dict[str, Any] = field(repr=False)
    """The record's fields (those after its token arrays when it was read fast; see ``_fields``)."""
    tokens: int = 0
    trained: int = 0
    turns: int = 0

    @property
    def task(self) -> str:
        return str(self.record.get("task_id", ""))

    @property
    def env(self) -> str:
        return str(self.record.get("env_id", ""))

    @property
    def status(self) -> str:
        return str(self.record.get("status", ""))

    @property
    def reward(self) -> float:
        return float(self.record.get("reward", 0.0))

    @property
    def extra(self) -> dict[str, Any]:
        extra = self.record.get("extra", {})  # parsed by ``read``, which calls any other damage
        return extra if isinstance(extra, dict) else {}

    @property
    def iteration(self) -> int | None:
        """The training iteration that collected the episode, where the writer recorded one."""
        value = self.extra.get("iteration")
        return value if isinstance(value, int) else None

    def trajectory(self) -> Trajectory:
        """The whole trajectory, read again from its shard."""
        try:
            # validated: a page or transcript of spans past the tokens, or of a role that is none,
            # would index out of range or write the role into the page as it is
            return Trajectory.from_record(TrajectoryStore.record_at(self.shard, self.offset)).validate()
        except (OSError, ValueError, TypeError) as e:  # TrajectoryError is a ValueError
            raise ReplayError(f"episode {self.id} cannot be shown: {e}") from None


def resolve(path: str | Path) -> Path:
    """The store directory of ``path``: a run directory (its ``trajectories/``) or a store itself."""
    p = Path(path)
    if not p.exists():
        raise ReplayError(
            f"{path} does not exist; give a run directory (holding trajectories/) or a trajectory store directory"
        )
    if p.is_file():
        raise ReplayError(
            f"{path} is a file; give the directory that holds it (a trajectory store) or the run directory"
        )
    if (p / "trajectories").is_dir():
        p = p / "trajectories"
    if not any(p.glob("*.jsonl.gz")):
        raise ReplayError(
            f"{p} holds no trajectory shards (*.jsonl.gz): the store is empty, or this is not a store; "
            "give a run directory (holding trajectories/) or a trajectory store directory"
        )
    return p


_IDS, _MASK, _LOGPROBS, _TURNS = (
    b'{"input_ids":[',
    b'],"loss_mask":[',
    b'],"rollout_logprobs":[',
    b'],"turns":',
)


def _fields(text: bytes) -> tuple[dict[str, Any], int, int]:
    """``(fields, tokens, trained)`` of one record's JSON text.

    A record that ``TrajectoryStore.append`` wrote (compact JSON, fields in ``Trajectory`` order)
    is read fast: the three token arrays, which are most of its bytes, are counted rather than
    parsed, and only the fields after them are parsed. Any other text is parsed whole."""
    if text.startswith(_IDS):
        i = text.find(_MASK, len(_IDS))
        j = text.find(_LOGPROBS, i)
        k = text.find(_TURNS, j)
        if -1 < i < j < k:
            ids, mask = text[len(_IDS) : i], text[i + len(_MASK) : j]
            tokens = ids.count(b",") + 1 if ids else 0
            trained = mask.count(b"1")
            # every mask entry one digit, 0 or 1, one per token: the counts are exact
            if len(mask) == max(2 * tokens - 1, 0) and trained + mask.count(b"0") == tokens:
                return json.loads(b"{" + text[k + 2 :]), tokens, trained
    record = json.loads(text)
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {type(record).__name__}, not an object")
    return record, len(record["input_ids"]), sum(record["loss_mask"])


def read(store: Path) -> tuple[list[Episode], list[Damage]]:
    """Every episode of the store in order, and every damaged stretch (reported, never raised)."""
    episodes, damage = [], []
    for shard, line, offset, text in TrajectoryStore(store).scan(parse=False):
        if isinstance(text, str):
            damage.append(Damage(shard.name, line, offset, text))
            continue
        try:
            record, tokens, trained = _fields(text)
            turns = sum(1 for span in record["turns"] if span["role"] == "assistant")
            if record.get("status") not in STATUSES:
                raise ValueError(f"status {record.get('status')!r} is not one of {STATUSES}")
            float(record.get("reward", 0.0))
            # extra is JSON text (Trajectory.to_record): parsed here, where its damage is reported
            extra = record.get("extra", {})
            if isinstance(extra, str):
                try:
                    record["extra"] = extra = json.loads(extra)
                except ValueError as e:
                    raise ValueError(f"extra is not JSON: {e}") from None
            if not isinstance(extra, dict):
                raise ValueError(f"extra is a JSON {type(extra).__name__}, not an object")
        except (KeyError, TypeError, ValueError, RecursionError) as e:  # ValueError: bad JSON too
            why = f"missing {e}" if isinstance(e, KeyError) else str(e)
            damage.append(Damage(shard.name, line, offset, f"not a trajectory record ({why})"))
            continue
        name = shard.name.removesuffix(".jsonl.gz")
        episodes.append(Episode(f"{name}:{line}", shard, offset, record, tokens, trained, turns))
    return episodes, damage


def find(episodes: list[Episode], episode_id: str, store: Path) -> Episode:
    """The episode named ``episode_id``; an unknown id gets the closest ids in the error."""
    for episode in episodes:
        if episode.id == episode_id:
            return episode
    ids = [e.id for e in episodes]
    close = difflib.get_close_matches(episode_id, ids, n=3, cutoff=0.6)
    hint = (
        f"closest: {', '.join(close)}"
        if close
        else "ids look like <shard>:<line>, e.g. " + (f"{ids[0]} .. {ids[-1]}" if ids else "w0-00000:1")
    )
    raise ReplayError(
        f"no episode {episode_id!r} in {store} ({len(ids)} episodes); {hint}; `agentrl replay {store}` lists them"
    )


# -- filters --
def _status(value: str) -> Callable[[Episode], bool]:
    wanted = value.split("|")
    for status in wanted:
        if status not in STATUSES:
            close = difflib.get_close_matches(status, STATUSES, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ReplayError(
                f"--filter status={status!r} is not a status{hint}; statuses: {', '.join(STATUSES)}"
            )
    return lambda e: e.status in wanted


def _number(key: str, value: str, kind: type) -> list:
    try:
        numbers = [kind(v) for v in value.split("|")]
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ReplayError(f"--filter {key}={value!r} is not {what} (alternatives: {key}=1|2)") from None
    if not all(math.isfinite(n) for n in numbers):
        raise ReplayError(f"--filter {key}={value!r} must be finite")
    return numbers


def _reward(value: str) -> Callable[[Episode], bool]:
    rewards = _number("reward", value, float)
    return lambda e: any(math.isclose(e.reward, r, abs_tol=1e-9) for r in rewards)


def _iteration(value: str) -> Callable[[Episode], bool]:
    iterations = _number("iteration", value, int)
    return lambda e: e.iteration in iterations


def _glob(attribute: str) -> Callable[[str], Callable[[Episode], bool]]:
    def build(value: str) -> Callable[[Episode], bool]:
        patterns = value.split("|")
        return lambda e: any(fnmatch.fnmatchcase(getattr(e, attribute), p) for p in patterns)

    return build


FILTERS: dict[str, Callable[[str], Callable[[Episode], bool]]] = {
    "status": _status,
    "reward": _reward,
    "iteration": _iteration,
    "task": _glob("task"),
    "env": _glob("env"),
}
"""``--filter`` keys: a value may list alternatives with ``|``; task and env take shell globs."""


def parse_filter(text: str) -> Callable[[Episode], bool]:
    """``status=timeout,reward=0`` -> a predicate true where every key matches (values of one key: any)."""
    tests: dict[str, list[Callable[[Episode], bool]]] = {}
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ReplayError(f"--filter item {item!r} is not key=value; keys: {', '.join(FILTERS)}")
        if key not in FILTERS:
            close = difflib.get_close_matches(key, FILTERS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ReplayError(f"--filter key {key!r} is unknown{hint}; valid keys: {', '.join(FILTERS)}")
        tests.setdefault(key, []).append(FILTERS[key](value))
    if not tests:
        raise ReplayError(
            f"--filter {text!r} holds no key=value item, e.g. status=timeout,reward=0; keys: {', '.join(FILTERS)}"
        )
    return lambda e: all(any(t(e) for t in alternatives) for alternatives in tests.values())
