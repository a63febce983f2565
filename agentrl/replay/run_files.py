"""What a training run's directory holds, read for ``agentrl report``: ``metrics.jsonl`` (one record
per iteration), ``summary.json`` (once the run has ended), ``config.json`` and the trajectory store.

Damaged lines of ``metrics.jsonl`` are skipped and named in ``RunData.warnings``, with damaged
episode records; a ``metrics.jsonl`` with no intact line is an error, as a directory without one
is. A value of the wrong type where the page reads one (a metric that is no number, ``statuses``
that are no counts, a ``run`` setting that is no mapping) is left out and named with its file and
field in a warning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.replay.episodes import Episode, ReplayError, read


@dataclass
class RunData:
    path: Path
    records: list[dict[str, Any]]
    summary: dict[str, Any]
    config: dict[str, Any]
    damaged: int = 0
    episodes: list[Episode] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    """Damage that was skipped, a line each: the lines of metrics.jsonl, records of the store."""

    @property
    def n_eval(self) -> int:
        env = self.config.get("env")
        n = self.summary.get("eval_tasks") or (env.get("eval_tasks") if isinstance(env, dict) else None)
        return int(n) if _is_number(n) and n > 0 else 0

    @property
    def name(self) -> str:
        run = self.config.get("run")
        name = run.get("name") if isinstance(run, dict) else None
        return name if isinstance(name, str) and name else self.path.name


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _mistyped_metrics(record: dict[str, Any], numbers: tuple[str, ...]) -> list[tuple[str, Any, str]]:
    """``(field, value, what it should be)`` of each field of ``record`` that the page reads and
    that has the wrong type; those fields are removed from ``record``."""
    bad = [
        (key, record.pop(key), "a number") for key in numbers if key in record and not _is_number(record[key])
    ]
    statuses = record.get("statuses")
    if statuses is not None and not (
        isinstance(statuses, dict) and all(_is_number(n) and n >= 0 for n in statuses.values())
    ):
        bad.append(("statuses", record.pop("statuses"), "a mapping of status to episode count"))
    return bad


def _mistyped_files(data: RunData) -> list[str]:
    """Warnings for the values of summary.json and config.json the page reads that have the wrong
    type; those of the summary are set to null (not measured), the config is shown as it is."""
    warnings = []
    for key in ("eval_before", "eval_after", "seconds"):
        value = data.summary.get(key)
        if value is not None and not _is_number(value):
            data.summary[key] = None
            warnings.append(
                f"{data.path / 'summary.json'}: {key} = {_short(value)} is not a number; "
                "shown as not measured"
            )
    config = data.path / "config.json"
    run, env = data.config.get("run"), data.config.get("env")
    if run is not None and not isinstance(run, dict):
        warnings.append(
            f"{config}: run = {_short(run)} is not a mapping of settings (run.name, ...); "
            "the run is named after its directory"
        )
    elif isinstance(run, dict) and run.get("name") is not None and not isinstance(run["name"], str):
        warnings.append(
            f"{config}: run.name = {_short(run['name'])} is not a string; the run is named after its directory"
        )
    if env is not None and not isinstance(env, dict):
        warnings.append(
            f"{config}: env = {_short(env)} is not a mapping of settings (env.id, env.eval_tasks, ...); "
            "the number of held-out tasks is taken from summary.json alone"
        )
    return warnings


def _json_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ReplayError(
            f"{path} cannot be read ({e}); restore it or remove it to report without it"
        ) from None
    return data if isinstance(data, dict) else {}


def load(run: str | Path, numbers: tuple[str, ...] = ()) -> RunData:
    """The run's records, summary, config and stored episodes; ``ReplayError`` when it is no run.
    ``numbers``: the metrics read as numbers (one of another type is left out, with a warning)."""
    path = Path(run)
    metrics = path / "metrics.jsonl"
    if not path.is_dir():
        raise ReplayError(
            f"{run} is not a directory; give a run directory (runs/NAME, holding metrics.jsonl)"
        )
    if not metrics.is_file():
        raise ReplayError(
            f"{run} holds no metrics.jsonl: it is not a training run's directory, or the run has not "
            "finished its first iteration; give runs/NAME of an `agentrl train` run"
        )
    records, damaged = [], []
    mistyped: dict[tuple[str, str], tuple[list[int], Any]] = {}  # (field, expected) -> (lines, a value)
    for n, line in enumerate(metrics.read_text(errors="replace").splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:
            damaged.append(n)
            continue
        if isinstance(record, dict) and isinstance(record.get("iteration"), int):
            records.append(record)
            for key, value, expected in _mistyped_metrics(record, numbers):
                mistyped.setdefault((key, expected), ([], value))[0].append(n)
        else:
            damaged.append(n)
    if damaged and not records:
        raise ReplayError(
            f"{metrics} holds no metrics record (a JSON object with an integer iteration) in its "
            f"{len(damaged)} line{'s' if len(damaged) > 1 else ''}; restore it from a copy, or give another run"
        )
    data = RunData(
        path, records, _json_file(path / "summary.json"), _json_file(path / "config.json"), len(damaged)
    )
    if damaged:
        lines = ", ".join(map(str, damaged[:10])) + (
            f" and {len(damaged) - 10} more" if len(damaged) > 10 else ""
        )
        data.warnings.append(
            f"{metrics} line{'s' if len(damaged) > 1 else ''} {lines}: not a metrics record; skipped"
        )
    for (key, expected), (at, value) in mistyped.items():
        lines = ", ".join(map(str, at[:10])) + (f" and {len(at) - 10} more" if len(at) > 10 else "")
        data.warnings.append(
            f"{metrics} line{'s' if len(at) > 1 else ''} {lines}: {key} = {_short(value)} is not {expected}; "
            "left out of the report"
        )
    data.warnings += _mistyped_files(data)
    store = path / "trajectories"
    if store.is_dir() and any(store.glob("*.jsonl.gz")):
        data.episodes, damage = read(store)
        data.warnings += [f"{store}/{d}" for d in damage]
    return data
