"""Sandboxes: where every tool call of an agent runs.

``Sandbox`` is a protocol, not a base class: a backend is any class with these methods. Backends
are registered by name (``docker``, ``local``) and built with ``make_sandbox(backend, **config)``,
whose keyword arguments are checked against the backend's config class.

    async with make_sandbox("docker", image="agentrl/base:bookworm") as sb:
        result = await sb.exec("pytest -x", timeout=60)
        patch = await sb.diff()
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import difflib
import importlib
import typing
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass
class ExecResult:
    """What one command did."""

    exit_code: int
    """Exit status of the command; 124 when it timed out, -1 when the sandbox died under it, 137 when
    it was killed (``oom_killed``, ``pids_exhausted`` or ``killed`` says by what)."""
    output: str
    """stdout and stderr merged in the order they were written, possibly cut (see ``truncated``)."""
    timed_out: bool = False
    """The command ran past its timeout and its whole process tree was killed."""
    truncated: bool = False
    """The output was longer than the cap: head and tail kept, a marker says how much was cut."""
    oom_killed: bool = False
    """A process of the command was killed by the out-of-memory killer."""
    pids_exhausted: bool = False
    """The sandbox's process limit refused a fork (a fork bomb): every process of the sandbox's user
    was killed so that the sandbox can run commands again."""
    killed: bool = False
    """The command died of SIGKILL that was not the timeout's, the OOM killer's or the pids limit's
    (the agent killed it itself, e.g. ``kill -9 -1``)."""
    sandbox_died: bool = False
    """The sandbox itself is gone (its init was killed, the daemon restarted); ask for a fresh one."""
    duration_s: float = 0.0
    """Wall-clock seconds from submitting the command to having its result."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not (self.timed_out or self.sandbox_died or self.pids_exhausted)

    def notes(self, timeout: float | None = None) -> list[str]:
        """What happened to the command beyond its output, one line each, for the agent to read."""
        notes = []
        if self.timed_out:
            after = f" after {timeout:g} s" if timeout else ""
            notes.append(f"[command timed out{after} and was killed, with every process it started]")
        if self.oom_killed:
            notes.append("[a process of the command was killed for using too much memory]")
        if self.pids_exhausted:
            notes.append(
                "[the sandbox ran out of processes (a fork bomb?): every process of yours was killed]"
            )
        if self.killed:
            notes.append("[the command was killed by SIGKILL]")
        if self.sandbox_died:
            notes.append("[the sandbox died while running this command]")
        return notes


class SandboxError(RuntimeError):
    """A sandbox could not be created, reached or used (not a failing command: that is an ExecResult)."""


class SandboxDied(SandboxError):
    """The sandbox is gone; operations on it cannot succeed. Create a fresh one."""


@runtime_checkable
class Sandbox(Protocol):
    """An isolated place to run an agent's commands, with a workspace directory (``workdir``)."""

    workdir: str

    async def __aenter__(self) -> Sandbox: ...
    async def __aexit__(self, *exc: object) -> None: ...
    async def start(self) -> None: ...
    async def exec(
        self,
        cmd: str,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult: ...
    async def read_file(self, path: str) -> bytes: ...
    async def write_file(self, path: str, data: bytes | str) -> None: ...
    async def upload(self, local_path: str, dest: str) -> None: ...
    async def diff(self, base: str | None = None) -> str: ...
    async def alive(self) -> bool: ...
    async def close(self) -> None: ...


class AsyncStartClose:
    """``async with x:`` calls ``await x.start()`` and, on the way out whatever happened, ``await x.close()``."""

    async def __aenter__(self):
        try:
            await self.start()
        except BaseException:  # a start that failed or was cancelled half-way leaves nothing behind
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def within(awaitable, timeout: float):
    """``await awaitable``, or ``TimeoutError`` after ``timeout`` seconds. Unlike Python 3.11's
    ``asyncio.wait_for``, it never loses a cancellation: 3.11's returns the result when the cancel
    lands as the awaitable finishes, and the cancelled episode runs on."""
    async with asyncio.timeout(timeout):
        return await awaitable


def join_cut(head: bytes, tail: bytes, total: int) -> str:
    """Head and tail of an output of ``total`` bytes, with a marker saying how much was cut between them."""
    cut = total - len(head) - len(tail)
    return (
        head.decode("utf-8", errors="replace")
        + f"\n[... {cut} bytes of output cut; {total} in all ...]\n"
        + tail.decode("utf-8", errors="replace")
    )


def cut_output(data: bytes, cap: int) -> tuple[str, bool]:
    """Decode ``data``; above ``cap`` bytes keep the head and the tail with a marker between them."""
    if len(data) <= cap:
        return data.decode("utf-8", errors="replace"), False
    return join_cut(data[: cap // 2], data[len(data) - (cap - cap // 2) :], len(data)), True


ARGUMENT_CHARS = 30_000
"""The most characters of a command either backend passes in one program argument (``bash -c
CMD`` is one): an argument holds at most 128 KiB (MAX_ARG_STRLEN), and a character at most 4 bytes.
A longer command reaches bash through a file."""


# Shell snippets shared by the backends. The workspace is a git repository whose start commit is
# the baseline of ``diff`` (an empty workspace gets one, so that new files show up).
GIT_FINGERPRINT = "find .git/config .git/hooks .git/info -type f -exec cat {} + 2>/dev/null | cksum"
"""A checksum of what in ``.git`` the agent could use to run code or change what git shows (its
config, hooks, info/attributes and grafts), regular files only: a FIFO there would block a reader."""
WORKSPACE_SETUP = (
    "git rev-parse -q --verify HEAD >/dev/null 2>&1 || "
    "{ git init -q && git add -A && git -c user.name=agentrl -c user.email=agentrl@localhost "
    "commit -q --allow-empty -m 'agentrl: workspace at start'; } "
    "&& git rev-parse HEAD && " + GIT_FINGERPRINT
)
GIT_RESET = (
    # The agent's repository config and hooks must not run during the reset (core.fsmonitor, a
    # post-checkout hook: code of the agent's after its processes were killed), and replace refs
    # must not stand in for the start commit's objects.
    "export GIT_NO_REPLACE_OBJECTS=1 && rm -rf .git/refs/replace && "
    'g() { git -c core.fsmonitor=false -c core.hooksPath=/dev/null "$@"; } && '
    'g reset -q --hard "$BASE" && g clean -qffdx && [ -z "$(g status --porcelain)" ] && '
    "g rev-parse HEAD && " + GIT_FINGERPRINT
)
"""Shell run in the workspace with ``BASE`` set: the work tree back to the start commit, then its
hash and ``GIT_FINGERPRINT`` (which must equal those at start for the sandbox to be reused)."""


# File operations of the tools, run as the sandbox's user (never by the host or the container
# runtime as root) and confined to the workspace: the path is resolved in the sandbox, symlinks
# included, and must stay inside it. Usage: bash -c FILE_OPS agentrl OP WORKSPACE PATH [BASE64]
#   read           the file's bytes on stdout
#   write, append  the bytes of BASE64, or of stdin when it is absent, into the file (parents made)
# Exit codes (``file_op_error`` turns them into exceptions): 72 missing, 73 outside the workspace
# (the resolved path on stdout), 74 a directory, 75 not a regular file, 76/77 cannot create/write,
# 78 larger than READ_LIMIT (its size on stdout): the bytes would all reach the host's process.
FILE_OP_CODES = frozenset({0, 64, *range(70, 79)})
"""The exit codes of ``FILE_OPS`` itself; any other means it did not run to its end."""
READ_LIMIT = 16 << 20
"""Bytes of the largest file the editor reads (``view``, ``str_replace``, ``insert``)."""
FILE_OPS = r"""
op=$1 path=$3
root=$(realpath -e -- "$2") && cd "$root" || exit 70
target=$(realpath -m -- "$path") || exit 71
case "$target" in "$root" | "$root"/*) ;; *) printf '%s' "$target"; exit 73 ;; esac
case "$op" in
read)
    [ -e "$target" ] || exit 72
    [ -d "$target" ] && exit 74
    [ -f "$target" ] || exit 75
    size=$(stat -c %s -- "$target") || exit 75
    [ "$size" -le @READ_LIMIT@ ] || { printf '%s' "$size"; exit 78; }
    exec head -c @READ_LIMIT@ -- "$target" ;;
write | append)
    [ -d "$target" ] && exit 74
    [ -e "$target" ] && [ ! -f "$target" ] && exit 75  # a FIFO or a device would block or not hold it
    mkdir -p -- "${target%/*}" || exit 76
    if [ "$op" = write ]; then { : > "$target"; } || exit 77; fi
    if [ $# -ge 4 ]; then printf '%s' "$4" | base64 -d >> "$target"; else cat >> "$target"; fi || exit 77 ;;
*) exit 64 ;;
esac
""".replace("@READ_LIMIT@", str(READ_LIMIT))


class FileTooLarge(ValueError):
    """A file over ``READ_LIMIT`` bytes, which the editor does not read."""


def file_op_error(
    code: int, op: str, path: str, workspace: str, stdout: bytes, stderr: bytes
) -> OSError | FileTooLarge | None:
    """The exception for a ``FILE_OPS`` exit code (None for success), worded for the agent to act on."""
    detail = stderr.decode("utf-8", errors="replace").strip().splitlines()[-1:] or [f"exit {code}"]
    if code == 0:
        return None
    if code == 72:
        return FileNotFoundError(f"{path} does not exist in the sandbox")
    if code == 73:
        resolved = stdout.decode("utf-8", errors="replace")
        return PermissionError(
            f"{path!r} resolves to {resolved}, outside the workspace {workspace}; "
            "paths must stay inside it (no '..' or symlinks out)"
        )
    if code == 74:
        return IsADirectoryError(f"{path} is a directory")
    if code == 75:
        return IsADirectoryError(f"{path} is not a regular file")
    if code == 78:
        size = stdout.decode("ascii", errors="replace")
        return FileTooLarge(
            f"{path} is {size} bytes, more than the editor reads ({READ_LIMIT >> 20} MiB); "
            "look at parts of it with bash (head, sed -n, grep)"
        )
    what = "read" if op == "read" else "create" if code == 76 else "write"
    return PermissionError(f"cannot {what} {path} in the sandbox: {detail[0]}")


def diff_script(base: str, paths: list[str] | None = None) -> str:
    """Shell that prints ``git diff`` of the work tree (untracked files included) against ``base``.

    It stages into a fresh temporary index built from ``base``, so the agent's own index is left
    alone and no cached stat data can hide an edit (a copied index would: git's "racily clean"
    check compares file times with the index file's time, and a same-size edit made in the same
    second as the baseline commit would look unchanged).

    The repository's config is the agent's to edit, so the output's shape is fixed by flags
    (prefixes, no colour, no renames, no external diff or text conversion, no fsmonitor command,
    odd file names quoted) and stderr is kept out of it; a patch from here is still untrusted input
    for the grader (``agentrl.patches.filter_patch``).

    The diff is printed in base64 (``read_diff`` decodes it): command output is read as text, and a
    byte that is not UTF-8 would come back as U+FFFD, so a patch touching a Latin-1 file would no
    longer apply; and a diff cut by an output limit fails to decode instead of losing its end.
    """
    quoted = " ".join("'" + p.replace("'", "'\\''") + "'" for p in (paths or []))
    return (
        'idx=$(mktemp -u) && err=$(mktemp) && export GIT_INDEX_FILE="$idx" GIT_NO_REPLACE_OBJECTS=1 && '
        "{ git -c core.fsmonitor=false read-tree " + base + " && git -c core.fsmonitor=false add -A && "
        "git -c core.fsmonitor=false -c core.quotePath=true diff --cached --binary --no-color --no-renames --no-ext-diff "
        "--no-textconv --src-prefix=a/ --dst-prefix=b/ " + base + " -- " + quoted + " "
        "':(exclude,glob)**/__pycache__/**'; } 2> \"$err\" | base64 -w0; rc=${PIPESTATUS[0]}; "
        '[ $rc = 0 ] || { echo; cat "$err"; }; rm -f "$idx" "$err"; exit $rc'
    )


DIFF_CAP = 256 * 2**20
"""Characters of base64 a workspace's diff may take (192 MiB of diff)."""


async def read_diff(sandbox: Any, base: str) -> str:
    """The workspace's ``git diff`` against ``base`` (``diff_script``), byte for byte: bytes that are
    not UTF-8 are kept as surrogate escapes (``write_file`` writes them back as they were)."""
    result = await sandbox.exec(diff_script(base), timeout=120, output_cap=DIFF_CAP)
    if result.exit_code != 0:
        raise SandboxError(f"git diff in {sandbox.workdir} failed: {result.output.strip()[-500:]}")
    try:
        raw = base64.b64decode(result.output.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise SandboxError(
            f"the diff of {sandbox.workdir} was cut: it is over {DIFF_CAP * 3 // 4 >> 20} MiB, or the "
            f"sandbox lost part of its output ({len(result.output)} characters came back)"
        ) from None
    return raw.decode("utf-8", errors="surrogateescape")


def to_bytes(data: bytes | str) -> bytes:
    """What ``write_file`` writes: text as UTF-8, with ``read_diff``'s surrogate escapes as their bytes."""
    return data if isinstance(data, bytes) else data.encode("utf-8", errors="surrogateescape")


def check_command(cmd: object, timeout: object) -> None:
    if not isinstance(cmd, str):
        raise TypeError(
            f"a sandbox command must be a str (a shell command line); got {type(cmd).__name__}: {cmd!r}"
        )
    if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds; got {timeout!r}")


# --- registry ---------------------------------------------------------------------------------

_BACKENDS: dict[str, str] = {
    "docker": "agentrl.sandboxes.docker:DockerSandbox",
    "local": "agentrl.sandboxes.local:LocalSandbox",
}


def register_backend(name: str, entry_point: str) -> None:
    """Register a sandbox backend class (``"module:Class"``) under ``name``.

    The class takes one argument, an instance of its ``Config`` class attribute (a dataclass
    with a docstring per field), and satisfies the ``Sandbox`` protocol. A class registered as
    ``docker`` or ``local``, the two that ``sandbox.kind: auto`` chooses from, also has a static
    ``usable() -> (bool, str)``: whether it can run here, and if not what is missing.
    """
    _BACKENDS[name] = entry_point


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def load_backend(name: str) -> type:
    if not isinstance(name, str):
        raise ValueError(
            f"a sandbox backend is named by a string, one of {', '.join(backend_names())}; got {name!r}"
        )
    if name not in _BACKENDS:
        close = difflib.get_close_matches(name, _BACKENDS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown sandbox backend {name!r}; known backends: {', '.join(backend_names())}.{hint}"
        )
    module, _, attr = _BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def build_config(config_cls: type, values: dict[str, Any], what: str) -> Any:
    """Instantiate a config dataclass, rejecting unknown keys with the closest valid one."""
    fields = {f.name for f in dataclasses.fields(config_cls)}
    for key in values:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"{what} has no setting {key!r}.{hint} Valid settings: {', '.join(sorted(fields))}."
            )
    hints = typing.get_type_hints(config_cls)
    for key, value in values.items():
        expected = _shape_problem(hints.get(key), value)
        if expected:
            raise ValueError(f"{what}: setting {key!r} must be {expected}; got {value!r}")
    return config_cls(**values)


def _shape_problem(hint: Any, value: Any) -> str | None:
    """What ``value`` should have been when its shape cannot be the field's: a flag that is not a
    bool, a string where a list is due (``hidden_paths: /data`` would be read letter by letter), a
    mapping that is not one of strings. Scalars are left to the config class's own checks."""
    if value is None and type(None) in typing.get_args(hint):
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if origin in (list, tuple) and args[:1] == (str,):
        strings = isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
        return None if strings else "a list of strings"
    if origin is dict and args == (str, str):
        items = value.items() if isinstance(value, dict) else [(None, None)]
        strings = all(isinstance(k, str) and isinstance(v, str) for k, v in items)
        return None if strings else "a mapping of strings to strings"
    return None


KINDS = ("auto", "docker", "local")


class NoSandboxError(RuntimeError):
    """``auto`` found no backend that isolates agent commands here; the message says what to do."""


def resolve_kind(kind: str, prefer: str = "docker") -> str:
    """The sandbox backend for ``sandbox.kind``: ``docker`` or ``local`` as asked; ``auto``: Docker when
    an engine answers with the base image, else bubblewrap (``local``), tried in the other order with
    ``prefer="local"``; each backend class says whether it can run here (``usable()``). With neither,
    ``NoSandboxError`` names how to get one, and the explicit opt-in for running agent commands
    without isolation (the local backend's ``isolation: none``)."""
    if prefer not in ("docker", "local"):
        raise ValueError(f"prefer must be 'docker' or 'local'; got {prefer!r}")
    if kind in ("docker", "local"):
        return kind
    if not isinstance(kind, str):
        raise ValueError(f"sandbox kind must be one of {', '.join(KINDS)}; got {kind!r}")
    if kind != "auto":
        close = difflib.get_close_matches(kind, KINDS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"sandbox kind must be one of {', '.join(KINDS)}; got {kind!r}.{hint}")
    missing = {}
    for name in ("local", "docker") if prefer == "local" else ("docker", "local"):
        ok, missing[name] = load_backend(name).usable()
        if ok:
            return name
    raise NoSandboxError(
        f"sandbox.kind=auto: no sandbox backend works here: {missing['docker']} and {missing['local']}. "
        "Install one (`agentrl sandbox doctor` says how), or run agent commands without isolation, on "
        "this machine as they are, by asking for it: sandbox.kind=local with the local backend's "
        "isolation: none"
    )


_DEFAULTS: dict[str, dict[str, Any]] = {}


def set_defaults(backend: str, **config: Any) -> None:
    """Settings every later ``make_sandbox(backend, ...)`` of this process starts from (a run's
    ``sandbox.docker.hosts``, set once by whoever builds the run); explicit arguments win."""
    _DEFAULTS[backend] = dict(config)


def make_sandbox(backend: str = "docker", **config: Any) -> Sandbox:
    """A not-yet-started sandbox of the named backend; use it as ``async with``."""
    cls = load_backend(backend)
    merged = {**_DEFAULTS.get(backend, {}), **config}
    if backend == "docker" and config.get("docker_host"):
        merged.pop("hosts", None)  # one daemon named explicitly
    return cls(build_config(cls.Config, merged, f"sandbox backend {backend!r}"))


class SandboxPool(AsyncStartClose):
    """Pre-started sandboxes, handed out at once and reset between uses.

    ``acquire()`` returns a ready sandbox (or starts one cold when none is ready); ``release(sb)``
    resets it in the background (kill the user's processes, empty ``/tmp`` and the home
    directory, restore the workspace to its start commit) and puts it back, or closes it and
    starts a replacement when it died or the reset cannot vouch for it. The backend must have
    ``reset() -> bool``.

        async with SandboxPool("docker", size=8, image=...) as pool:
            async with pool.sandbox() as sb:
                await sb.exec("pytest -x")
    """

    def __init__(self, backend: str = "docker", size: int = 4, **config: Any):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"pool size must be a positive integer; got {size!r}")
        self.backend, self.size, self.config = backend, size, config
        load_backend(backend)  # an unknown backend fails here, not in a background task
        self._ready: asyncio.Queue[Sandbox] = asyncio.Queue()
        self._all: set[Sandbox] = set()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self.stats = {"reused": 0, "replaced": 0, "cold": 0}

    async def _new(self) -> Sandbox:
        sb = make_sandbox(self.backend, **self.config)
        self._all.add(sb)
        try:
            await sb.start()
        except BaseException:
            self._all.discard(sb)
            await sb.close()
            raise
        return sb

    async def start(self) -> None:
        """Start ``size`` sandboxes concurrently."""
        for sb in await asyncio.gather(*(self._new() for _ in range(self.size))):
            self._ready.put_nowait(sb)

    async def acquire(self) -> Sandbox:
        if self._closed:
            raise SandboxError("the sandbox pool is closed")
        try:
            return self._ready.get_nowait()
        except asyncio.QueueEmpty:
            self.stats["cold"] += 1
            return await self._new()

    def release(self, sb: Sandbox) -> None:
        """Give a sandbox back; it is reset (or replaced) in the background."""
        task = asyncio.ensure_future(self._recycle(sb))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _recycle(self, sb: Sandbox) -> None:
        if not self._closed and await sb.reset():
            self.stats["reused"] += 1
            self._ready.put_nowait(sb)
            return
        self._all.discard(sb)
        await sb.close()
        if not self._closed and self._ready.qsize() < self.size:
            self.stats["replaced"] += 1
            self._ready.put_nowait(await self._new())

    @contextlib.asynccontextmanager
    async def sandbox(self):
        sb = await self.acquire()
        try:
            yield sb
        finally:
            self.release(sb)

    async def close(self) -> None:
        self._closed = True
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(sb.close() for sb in list(self._all)), return_exceptions=True)
        self._all.clear()
