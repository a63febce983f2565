"""What the trainer computed for each token of an iteration's trained episodes, kept to debug a run
(``debug.token_stats_every``) and shown by ``agentrl replay --html``.

One file per recorded iteration, ``RUN/token_stats/iter-NNNNNN.jsonl.gz``, written whole and then
renamed into place (a crash leaves the previous file or none, never half of one). One line per
trained episode:

    {"task_id": ..., "sample_index": ..., "length": T, "crc": CRC32 of the token ids,
     "logprobs": [...], "weights": [...], "advantages": [...], "values": [...]}

Each array has ``T`` entries aligned with the trajectory's ``input_ids``: the training backend's
log-prob of the token (before the iteration's update, at the rollout temperature), the IcePop / TIS
weight (0 = dropped; absent when ``algo.token_filter`` is none), the advantage, and the critic's value
(absent without a critic). Entries off the loss mask are 0 and mean nothing. Values are rounded to
``DIGITS`` decimals; on disk about 4.5 bytes per token (``benchmarks/token_stats.py``).

An episode's stats are found by its iteration (in the trajectory's extra), task, sample, length and
the CRC32 of its token ids, so that an iteration that samples a task twice keeps both apart.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from array import array
from functools import lru_cache
from pathlib import Path
from typing import Any

DIRNAME = "token_stats"
DIGITS = 4
FIELDS = ("logprobs", "weights", "advantages", "values")


def path_of(run_dir: Path, iteration: int) -> Path:
    return Path(run_dir) / DIRNAME / f"iter-{iteration:06d}.jsonl.gz"


def crc(ids: list[int]) -> int:
    return zlib.crc32(array("q", ids).tobytes())


def _row(tensor: Any, i: int, n: int) -> list[float] | None:
    if tensor is None:
        return None
    return [round(float(x), DIGITS) for x in tensor[i, :n].tolist()]


def write(run_dir: Path, iteration: int, trajectories: list, batch: Any) -> Path:
    """Store ``batch``'s per-token stats (rows in the order of ``trajectories``); the file's path."""
    target = path_of(run_dir, iteration)
    target.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, t in enumerate(trajectories):
        n = len(t)
        record: dict[str, Any] = {
            "task_id": t.task_id,
            "sample_index": t.sample_index,
            "length": n,
            "crc": crc(t.input_ids),
        }
        for name, tensor in zip(
            FIELDS, (batch.old_logprobs, batch.token_weights, batch.advantages, batch.old_values), strict=True
        ):
            row = _row(tensor, i, n)
            if row is not None:
                record[name] = row
        lines.append(json.dumps(record, separators=(",", ":")))
    tmp = target.with_suffix(".tmp")
    tmp.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode(), compresslevel=6))
    os.replace(tmp, target)
    _read.cache_clear()
    return target


@lru_cache(maxsize=8)
def _read(path: Path, mtime: float) -> tuple[dict[tuple[str, int, int, int], dict[str, Any]], str | None]:
    """The file's records by episode key, and a warning when it cannot be read (no records then).
    The failure is cached as a table is: a damaged file is read once, not once per episode."""
    out = {}
    try:
        for line in gzip.decompress(path.read_bytes()).decode().splitlines():
            record = json.loads(line)
            key = (
                str(record["task_id"]),
                int(record["sample_index"]),
                int(record["length"]),
                int(record["crc"]),
            )
            out[key] = record
    except (OSError, EOFError, ValueError, KeyError, TypeError) as e:  # EOFError: a truncated gzip
        return {}, f"{path} cannot be read ({e}); its per-token stats are left out"
    return out, None


def lookup(run_dir: Path, trajectory: Any) -> dict[str, list[float]] | None:
    """The stats of ``trajectory`` (its iteration in ``extra``), or None when none were recorded or
    its iteration's file cannot be read (``find`` tells the two apart)."""
    return find(run_dir, trajectory)[0]


def find(run_dir: Path, trajectory: Any) -> tuple[dict[str, list[float]] | None, str | None]:
    """``(stats, damage)``: the stats of ``trajectory`` (None where none were recorded), and a
    warning naming its iteration's file when that file exists but cannot be read."""
    iteration = trajectory.extra.get("iteration")
    if not isinstance(iteration, int):
        return None, None
    path = path_of(run_dir, iteration)
    if not path.is_file():
        return None, None
    try:
        table, damage = _read(path, path.stat().st_mtime)
    except OSError as e:  # gone since it was found
        return None, f"{path} cannot be read ({e}); its per-token stats are left out"
    if damage:
        return None, damage
    record = table.get(
        (trajectory.task_id, trajectory.sample_index, len(trajectory), crc(trajectory.input_ids))
    )
    return (None if record is None else {k: record[k] for k in FIELDS if k in record}), None
