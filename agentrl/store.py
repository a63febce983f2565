"""A crash-safe, append-only store of trajectories: sharded, gzip-compressed JSON lines.

Layout: ``PATH/<writer>-<NNNNN>.jsonl.gz``. Each record is one JSON object on one line,
compressed as its own gzip member and written with a single ``write``; concatenated members are
a valid gzip file, so ``datasets.load_dataset("json", data_files=f"{PATH}/*.jsonl.gz")`` reads a
store directly (its JSON reader parses floats to about 10 significant digits;
``TrajectoryStore.read`` is exact). One writer per ``writer`` name at a time (a lock file
enforces it); run several writers under different names.

Damage, and what happens to it. A record is intact when its gzip member decompresses with a
correct CRC and length, ends in a newline, and holds a JSON object. Anything else is damage:
bytes that are not a gzip member, a member cut short, a member that fails to decompress, a
member whose text is not JSON or not an object. No data is ever deleted.

- Reading (``records``, ``read``, ``len``) never raises on damage. It skips a damaged stretch
  with a warning on this module's logger naming the shard and the byte offset, then resumes at
  the next intact gzip member: it searches for the gzip magic from the damaged offset + 1 and
  tries a whole member there (a magic that is really compressed data fails, and the search goes
  on). Every intact record after the damage is read. ``read`` also skips, with a warning, an
  intact JSON object that is not a trajectory.
- A writer opening the store checks only its own last shard, the one it would append to:

  - damage at the end only (a record cut short by a crash, the normal case, or any damaged
    bytes after the last intact record): the damaged bytes are copied to ``<shard>.corrupt``
    (``.corrupt.1``, ``.corrupt.2``, ... when that exists), synced, and only then cut off the
    shard, which ends at its last intact record again; appends follow it, so ``datasets``
    still reads the shard. A crash between the copy and the cut leaves the bytes in both.
  - damage with intact records after it: the shard is left exactly as it is (a damaged end
    included) and the writer starts the next shard. Readers skip the damage there; ``datasets``
    cannot read that shard (it needs an unbroken gzip stream), so rename it out of the
    ``*.jsonl.gz`` glob before loading the store with ``datasets``.

  Earlier shards are never written again (but by ``set_aside``, which moves records a resumed
  training run redoes to ``<shard>.superseded``). ``.corrupt`` and ``.superseded`` files do not
  match ``*.jsonl.gz``.

Reading decompresses one member at a time, in chunks, so memory holds a shard's bytes and one
record, never a shard's records all at once.
"""

from __future__ import annotations

import fcntl
import glob
import gzip
import itertools
import json
import logging
import os
import re
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from agentrl.trajectory import Trajectory

logger = logging.getLogger(__name__)

_GZIP_MAGIC = b"\x1f\x8b\x08"  # ID1, ID2, CM=deflate: how every member this store writes begins


def _inflate(view: memoryview, start: int, chunk: int = 1 << 16) -> tuple[int, bytes] | str:
    """Decompress the gzip member at ``start``: ``(end offset, its bytes)``, or why it is not one."""
    d = zlib.decompressobj(wbits=31)
    parts, pos, n = [], start, len(view)
    try:
        while not d.eof and pos < n:  # fed in chunks so unused_data stays small
            piece = view[pos : pos + chunk]
            parts.append(d.decompress(piece))
            pos += len(piece)
    except zlib.error as e:
        return f"not a valid gzip member: {e}"
    if not d.eof:
        return "a gzip member cut short by the end of the file: a crash, or a write in progress"
    return pos - len(d.unused_data), b"".join(parts)


def _parse(text: bytes) -> dict | str:
    """The record in one member's text, or why it is not one."""
    if not text.endswith(b"\n"):
        return "a gzip member whose text does not end in a newline"
    try:
        record = json.loads(text)
    except (ValueError, RecursionError) as e:  # ValueError covers bad UTF-8 and bad JSON
        return f"a gzip member whose text is not valid JSON: {e}"
    if not isinstance(record, dict):
        return f"a gzip member holding a JSON {type(record).__name__}, not an object"
    return record


def _text(text: bytes) -> bytes | str:
    """One member's text, unparsed (``TrajectoryStore.scan(parse=False)``), or why it is not a record."""
    return text if text.endswith(b"\n") else "a gzip member whose text does not end in a newline"


def _scan(data: bytes, parse: Callable[[bytes], Any] = _parse) -> Iterator[tuple[int, int, Any]]:
    """Split a shard into ``(start, end, record or why that stretch is damaged)``, covering every byte."""
    view, n, offset = memoryview(data), len(data), 0
    while offset < n:
        member = _inflate(view, offset)
        if isinstance(member, tuple):
            end, text = member
            yield offset, end, parse(text)
            offset = end
            continue
        resume = data.find(_GZIP_MAGIC, offset + 1)
        while resume != -1 and not isinstance(_inflate(view, resume), tuple):
            resume = data.find(_GZIP_MAGIC, resume + 1)
        resume = n if resume == -1 else resume
        yield offset, resume, member
        offset = resume


def _resumes(end: int, n: int) -> str:
    return "they run to the end of the file" if end == n else f"reading resumes at offset {end}"


def _next_shard(shard: Path) -> Path:
    writer, rest = shard.name.rsplit("-", 1)
    return shard.with_name(f"{writer}-{int(rest.split('.')[0]) + 1:05d}.jsonl.gz")


def _write_synced(f, parts) -> None:
    for part in parts:
        f.write(part)
    f.flush()
    os.fsync(f.fileno())


def _aside(shard: Path, suffix: str, parts) -> Path:
    """Write ``parts`` durably to a new ``<shard>.<suffix>[.N]``; its path."""
    for i in itertools.count():
        target = shard.with_name(f"{shard.name}.{suffix}" + (f".{i}" if i else ""))
        try:
            with open(target, "xb") as f:  # exclusive: an earlier set-aside is never overwritten
                _write_synced(f, parts)
        except FileExistsError:
            continue
        return target


def _set_aside(shard: Path, data: bytes, start: int) -> Path:
    """Copy ``data[start:]`` to a new ``<shard>.corrupt[.N]``, durably, then cut it off the shard."""
    target = _aside(shard, "corrupt", [memoryview(data)[start:]])
    os.truncate(shard, start)
    return target


class TrajectoryStore:
    """Append trajectories to, and read them from, a directory of shards."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        writer: str = "w0",
        max_shard_bytes: int = 64 * 2**20,
        fsync: bool = False,
    ):
        self.path = Path(path)
        self.writer = writer
        self.max_shard_bytes = max_shard_bytes
        self.fsync = fsync
        self._fd: int | None = None
        self._lock_fd: int | None = None
        self._shard: Path | None = None
        self._size = 0

    # -- writing --
    def _shards(self, writer: str | None = None) -> list[Path]:
        if writer is None:
            return sorted(self.path.glob("*.jsonl.gz"))
        # exactly WRITER-NNNNN: writer "w" must not take writer "w-1"'s shards for its own
        own = re.compile(re.escape(writer) + r"-\d+\.jsonl\.gz")
        return sorted(p for p in self.path.glob(f"{glob.escape(writer)}-*.jsonl.gz") if own.fullmatch(p.name))

    def _open_for_append(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.path / f".{self.writer}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise RuntimeError(
                f"another process is writing {self.path} as writer {self.writer!r}; give this writer another name"
            ) from None
        shards = self._shards(self.writer)
        shard = shards[-1] if shards else self.path / f"{self.writer}-00000.jsonl.gz"
        if shard.exists():
            shard = self._repair(shard)
        self._shard = shard
        self._fd = os.open(shard, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
        self._size = os.fstat(self._fd).st_size

    def _repair(self, shard: Path) -> Path:
        """Make the last shard safe to append to (see the module docstring); the shard to append to."""
        data = shard.read_bytes()
        intact_end, damage = 0, []
        for start, end, record in _scan(data):
            if isinstance(record, dict):
                intact_end = end
            else:
                damage.append((start, end, record))
        inner = [d for d in damage if d[0] < intact_end]
        if inner:
            new = _next_shard(shard)
            where = "; ".join(f"offset {s} ({e - s} bytes, {why})" for s, e, why in inner[:3])
            where += f"; and {len(inner) - 3} more" if len(inner) > 3 else ""
            logger.warning(
                "%s has damaged bytes before intact records, at %s; leaving it as it is (reading "
                "skips the damage, datasets.load_dataset cannot read this shard) and appending to %s",
                shard,
                where,
                new,
            )
            return new
        if intact_end < len(data):
            target = _set_aside(shard, data, intact_end)
            logger.warning(
                "%s: %d bytes from offset %d to the end are not intact records (%s); moved them to %s "
                "and cut the shard back to %d bytes, so appends stay readable",
                shard,
                len(data) - intact_end,
                intact_end,
                damage[0][2],
                target,
                intact_end,
            )
        return shard

    def _rotate(self) -> None:
        os.close(self._fd)
        self._shard = _next_shard(self._shard)
        self._fd = os.open(self._shard, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
        self._size = 0

    def append(self, trajectory: Trajectory | dict) -> None:
        """Write one trajectory (validated first), whole or not at all."""
        if self._fd is None:
            self._open_for_append()
        record = trajectory.validate().to_record() if isinstance(trajectory, Trajectory) else trajectory
        line = json.dumps(record, allow_nan=False, separators=(",", ":")).encode() + b"\n"
        member = gzip.compress(line, compresslevel=6, mtime=0)
        if self._size and self._size + len(member) > self.max_shard_bytes:
            self._rotate()
        written = os.write(self._fd, member)
        if written != len(member):  # a short write (disk full): undo it rather than leave half a record
            os.ftruncate(self._fd, self._size)
            raise OSError(
                f"short write to {self._shard} ({written} of {len(member)} bytes); is the disk full?"
            )
        self._size += written
        if self.fsync:
            os.fsync(self._fd)

    def set_aside(self, predicate: Callable[[dict], bool], suffix: str = "superseded") -> int:
        """Move this writer's intact records for which ``predicate`` is true out of the store, into
        ``<shard>.<suffix>[.N]`` beside each shard they were in (concatenated gzip members, as a shard
        holds them; not matched by ``*.jsonl.gz``); returns how many. Each shard is copied first,
        durably, then rewritten without those records (to a temporary file renamed over it): a crash
        between the two leaves the records in both, never in neither. A resumed training run sets
        aside the episodes of the iterations it redoes."""
        if self._fd is None:
            self._open_for_append()  # the lock, and a last shard cut back to its intact records
        moved = 0
        for shard in self._shards(self.writer):
            data = shard.read_bytes()
            drop = [(a, b) for a, b, r in _scan(data) if isinstance(r, dict) and predicate(r)]
            if not drop:
                continue
            view = memoryview(data)
            target = _aside(shard, suffix, [view[a:b] for a, b in drop])
            keep, at = [], 0
            for a, b in drop:
                keep.append(view[at:a])
                at = b
            keep.append(view[at:])
            tmp = shard.with_name(shard.name + ".tmp")
            with open(tmp, "wb") as f:
                _write_synced(f, keep)
            os.replace(tmp, shard)
            moved += len(drop)
            if shard == self._shard:  # the append handle still points at the file replaced
                os.close(self._fd)
                self._fd = os.open(shard, os.O_WRONLY | os.O_APPEND)
                self._size = os.fstat(self._fd).st_size
            logger.info("%s: moved %d records to %s", shard, len(drop), target)
        return moved

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> TrajectoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading --
    def _located_records(self) -> Iterator[tuple[Path, int, dict]]:
        for shard in self._shards():
            data = shard.read_bytes()
            for start, end, record in _scan(data):
                if isinstance(record, dict):
                    yield shard, start, record
                else:
                    logger.warning(
                        "%s: skipped %d damaged bytes at offset %d (%s), left in the file; %s",
                        shard,
                        end - start,
                        start,
                        record,
                        _resumes(end, len(data)),
                    )

    def scan(self, parse: bool = True) -> Iterator[tuple[Path, int, int, dict | bytes | str]]:
        """Every stretch of every shard, damage included: ``(shard, line, byte offset, record or why
        it is damaged)``; the record is a dict, or with ``parse=False`` its JSON text (bytes, not
        checked to be JSON). ``line`` counts a shard's records from 1 as its decompressed text would
        (a damaged stretch takes the line its record would have had); for tools that report damage
        (``agentrl replay``) rather than skip it with a warning."""
        for shard in self._shards():
            for line, (start, _, record) in enumerate(
                _scan(shard.read_bytes(), _parse if parse else _text), 1
            ):
                yield shard, line, start, record

    @staticmethod
    def record_at(shard: str | os.PathLike, offset: int) -> dict:
        """The record whose gzip member starts at byte ``offset`` of ``shard`` (as ``scan`` gives
        it); ``ValueError`` saying why when there is none intact there."""
        with open(shard, "rb") as f:
            f.seek(offset)
            data = f.read()
        member = _inflate(memoryview(data), 0)
        record = _parse(member[1]) if isinstance(member, tuple) else member
        if isinstance(record, str):
            raise ValueError(f"{shard} at byte offset {offset}: {record}")
        return record

    def records(self) -> Iterator[dict]:
        """Every intact record, shard by shard; damaged bytes are skipped with a warning."""
        for _, _, record in self._located_records():
            yield record

    def read(self, filter: Callable[[Trajectory], bool] | None = None) -> Iterator[Trajectory]:
        """Iterate stored trajectories (those for which ``filter`` is true); skips records that are not
        one, whole and consistent (``Trajectory.validate``: a record edited or written by another tool
        could hold tokens, masks and log-probs of different lengths)."""
        for shard, start, record in self._located_records():
            try:
                trajectory = Trajectory.from_record(record).validate()
            except (ValueError, TypeError) as e:  # TrajectoryError is a ValueError
                logger.warning(
                    "%s: skipped the record at offset %d, which is not a trajectory: %s", shard, start, e
                )
                continue
            if filter is None or filter(trajectory):
                yield trajectory

    def __len__(self) -> int:
        """The number of intact records (``read`` may yield fewer: it also skips non-trajectories)."""
        return sum(1 for _ in self.records())

    @property
    def data_files(self) -> str:
        """The glob to hand ``datasets.load_dataset("json", data_files=...)``."""
        return str(self.path / "*.jsonl.gz")
