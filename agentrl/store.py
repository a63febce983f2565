"""A crash-safe, append-only store of trajectories: sharded, gzip-compressed JSON lines.

Layout: ``PATH/<writer>-<NNNNN>.jsonl.gz``. Each record is one JSON line compressed as its own
gzip member and written with a single ``write``; concatenated members are a valid gzip file, so
``datasets.load_dataset("json", data_files=f"{PATH}/*.jsonl.gz")`` reads a store directly (its
JSON reader parses floats to about 10 significant digits; ``TrajectoryStore.read`` is exact).

Crash safety: a process killed while writing (``kill -9``, power loss after the page cache)
leaves at most one partial member at the end of the shard it was writing. Readers skip it; a
writer opening the store cuts it off before appending, so every earlier record reads back and
the shard stays readable by ``datasets``. One writer per ``writer`` name at a time (a lock file
enforces it); run several writers under different names.
"""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from agentrl.trajectory import Trajectory


def _members(data: bytes, chunk: int = 1 << 16) -> Iterator[tuple[int, bytes]]:
    """Yield ``(end offset, decompressed bytes)`` for each complete gzip member of ``data``."""
    view, offset, n = memoryview(data), 0, len(data)
    while offset < n:
        d = zlib.decompressobj(wbits=31)
        parts, pos = [], offset
        try:
            while not d.eof and pos < n:  # fed in chunks so unused_data stays small
                piece = view[pos : pos + chunk]
                parts.append(d.decompress(piece))
                pos += len(piece)
        except zlib.error:
            return
        if not d.eof:
            return  # a member cut short by a crash
        end = pos - len(d.unused_data)
        yield end, b"".join(parts)
        offset = end


def _complete_records(data: bytes) -> Iterator[tuple[int, bytes]]:
    for end, out in _members(data):
        if not out.endswith(b"\n"):
            return
        yield end, out


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
        pattern = f"{writer}-*.jsonl.gz" if writer else "*.jsonl.gz"
        return sorted(self.path.glob(pattern))

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
            data = shard.read_bytes()
            good = max((end for end, _ in _complete_records(data)), default=0)
            if good != len(data):  # a record cut short by a crash: drop it so appends stay readable
                os.truncate(shard, good)
        self._shard = shard
        self._fd = os.open(shard, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
        self._size = os.fstat(self._fd).st_size

    def _rotate(self) -> None:
        os.close(self._fd)
        index = int(self._shard.name.rsplit("-", 1)[1].split(".")[0]) + 1
        self._shard = self.path / f"{self.writer}-{index:05d}.jsonl.gz"
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
    def records(self) -> Iterator[dict]:
        """Every complete record, shard by shard, without loading a shard's records all at once."""
        for shard in self._shards():
            data = shard.read_bytes()
            for _, out in _complete_records(data):
                yield json.loads(out)

    def read(self, filter: Callable[[Trajectory], bool] | None = None) -> Iterator[Trajectory]:
        """Iterate stored trajectories (those for which ``filter`` is true)."""
        for record in self.records():
            trajectory = Trajectory.from_record(record)
            if filter is None or filter(trajectory):
                yield trajectory

    def __len__(self) -> int:
        return sum(1 for _ in self.records())

    @property
    def data_files(self) -> str:
        """The glob to hand ``datasets.load_dataset("json", data_files=...)``."""
        return str(self.path / "*.jsonl.gz")
