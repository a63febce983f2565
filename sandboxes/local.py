"""Local sandbox backend, for machines without Docker (a laptop quickstart).

Isolation is weaker than the Docker backend's, and this says how:

- With bubblewrap (``isolation="bwrap"``, or ``"auto"``): each command runs in fresh namespaces
  (no network but ``lo``, own PIDs, own IPC), on a read-only view of the host's root filesystem,
  with a private ``/tmp``, ``/run`` (the Docker socket lives there), ``/root``, ``/home`` and the
  creating process's working directory hidden (the Python environment is mounted back read-only
  so the agent's ``python`` works), and only the workspace writable. When the command exits,
  everything it started in the background is killed with its PID namespace, and the call returns
  once what was in the sandbox's cgroup (or ran as its uid) is gone, so that a fork bomb's dying
  processes do not count against the next command's limit. The sandbox's user
  is never host root: started as root, the command runs as a host uid of its own (one per
  sandbox, from ``HOST_UIDS``), which cannot read mode-0600 files or use the Docker socket; started
  as another user, as uid 1000 in a user namespace mapped to that user.
- Without bubblewrap (``isolation="none"``, which must be asked for: ``auto`` refuses to fall back
  to it): a plain subprocess in the workspace directory, which can read the host's world-readable
  files and reach the network. Started as root, commands run as a host uid of their own, which
  can write only the workspace and world-writable places; started as another user, as that user.
  Everything a command starts is killed when it exits (by uid when started as root; otherwise by
  ``_reaper.py``, a child subreaper that outlives the command, which a command can defeat only by
  killing it first). ``/tmp`` is the host's: each sandbox gets a private temporary directory of
  its own as ``TMPDIR`` (removed with the workspace), which scratch files must use.

Files: ``read_file`` and ``write_file`` run the same way as commands (inside bubblewrap, as the
sandbox's user), on paths resolved there, symlinks included, that must stay inside the workspace.

Limits: where this process may create cgroups (root on a cgroup v1 or v2 host), each sandbox
gets its own, with a process limit (``processes``) and a memory limit (``memory``) that the OOM
killer enforces and ``oom_killed`` reports, a fork refused at the limit is reported as
``pids_exhausted``, and ``close()`` kills everything in it. Elsewhere the limits are rlimits:
address space (allocations fail with ``MemoryError`` instead of an OOM kill, so ``oom_killed`` is
never set) and processes (counted per host user: per sandbox when started as root, else over
all of the user's processes). File size and CPU time are always rlimits; total disk use is not
limited (each file is, by ``max_file_size``).

Cleanup: a workspace this backend created is removed on ``close()``, at interpreter exit and on
SIGINT/SIGTERM of the creating process (not after ``kill -9``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.sandbox import (
    ARGUMENT_CHARS,
    FILE_OPS,
    GIT_RESET,
    WORKSPACE_SETUP,
    AsyncStartClose,
    ExecResult,
    SandboxError,
    check_command,
    file_op_error,
    join_cut,
    read_diff,
    to_bytes,
    within,
)
from agentrl.sandboxes import _cleanup
from agentrl.sandboxes.docker import parse_size

log = logging.getLogger(__name__)
_warned: set[str] = set()
SANDBOX_UID = 1000  # the sandbox user's uid inside bubblewrap's user namespace (not started as root)
HOST_UIDS = range(200_000, 265_536)  # host uids for sandboxes started as root, one per sandbox
REAPER = Path(__file__).with_name("_reaper.py")
FILE_OP_TIMEOUT = 60.0
# bwrap's message when a host mount changed under it while it set up the sandbox's view
MOUNT_RACE = "Unable to apply mount flags"
MOUNT_RACE_TRIES = 6
MOUNT_RACE_PAUSE = 0.05


@contextlib.contextmanager
def _script(cmd: str):
    """None for a short command; else the fd of an unnamed file holding it, readable by the sandbox's
    user through /dev/fd (the script closes that fd first, so nothing it starts inherits it)."""
    if len(cmd) <= ARGUMENT_CHARS:
        yield None
        return
    with tempfile.TemporaryFile() as f:
        f.write(f"exec {f.fileno()}<&-; {cmd}".encode("utf-8", errors="surrogateescape"))
        f.flush()
        os.fchmod(f.fileno(), 0o444)
        yield f.fileno()


# Moves the shell into the cgroups whose cgroup.procs files come before "--", then runs the rest.
JOIN_CGROUP = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 126; shift; done; shift; exec "$@"'


def bwrap_works() -> tuple[bool, str]:
    """Whether bubblewrap is installed and can create namespaces here, with the reason if not."""
    path = shutil.which("bwrap")
    if not path:
        return False, "bwrap is not installed (apt-get install -y bubblewrap)"
    if os.geteuid() == 0:  # as root it runs without a user namespace, then drops to a uid of its own
        probe_argv = [path, "--unshare-pid", "--unshare-net", "--ro-bind", "/", "/", "--proc", "/proc"]
    else:
        probe_argv = [path, "--unshare-all", "--ro-bind", "/", "/", "--proc", "/proc"]
    if not shutil.which("setpriv") and os.geteuid() == 0:
        return False, "setpriv (util-linux) is not installed, and bwrap as root needs it to drop to a user"
    for attempt in range(5):
        probe = subprocess.run([*probe_argv, "--dev", "/dev", "true"], capture_output=True, text=True)
        # A mount that appears or goes while bwrap re-mounts the host's tree read-only (a Docker
        # container starting or stopping on this host) fails it once; the next try succeeds.
        if probe.returncode == 0 or MOUNT_RACE not in probe.stderr:
            break
        time.sleep(0.05 * (attempt + 1))
    if probe.returncode != 0:
        return False, f"bwrap cannot create namespaces here: {probe.stderr.strip()}"
    return True, path


def _counter(path: Path, key: str) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


class Cgroup:
    """A cgroup (v1: pids + memory controllers; v2: unified) for one sandbox's processes."""

    def __init__(self, name: str, pids: int, memory: int):
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        if v2.exists():
            self.dirs = [Path("/sys/fs/cgroup") / name]
            settings = {"pids.max": pids, "memory.max": memory, "memory.swap.max": 0}
            self.events = self.dirs[0] / "memory.events"
        else:
            self.dirs = [Path("/sys/fs/cgroup/pids") / name, Path("/sys/fs/cgroup/memory") / name]
            settings = {"pids.max": pids, "memory.limit_in_bytes": memory}
            self.events = self.dirs[1] / "memory.oom_control"
        for d in self.dirs:
            d.mkdir()
        for key, value in settings.items():
            for d in self.dirs:
                if (d / key).exists():
                    (d / key).write_text(str(value))

    @classmethod
    def create(cls, pids: int, memory: int) -> Cgroup | None:
        try:
            group = cls(f"agentrl-{os.getpid()}-{uuid.uuid4().hex[:8]}", pids, memory)
        except OSError:
            return None
        _cleanup.on_exit(_remove_leftovers)
        _live_cgroups.add(group)
        return group

    def join(self) -> None:
        """Move the calling process in (used in the child before exec)."""
        for d in self.dirs:
            (d / "cgroup.procs").write_text("0")

    def oom_kills(self) -> int:
        return _counter(self.events, "oom_kill")

    def pids_refused(self) -> int:
        """Forks refused at the process limit so far (the ``max`` counter of ``pids.events``)."""
        return _counter(self.dirs[0] / "pids.events", "max")

    def procs(self) -> list[int]:
        try:
            return [int(p) for p in (self.dirs[0] / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def kill_all(self, wait: float = 2.0) -> None:
        """Kill every process in the cgroup and wait (up to ``wait`` seconds) until none is left:
        a process counts against the limit until it is reaped, and one that forks is killed again."""
        deadline = time.monotonic() + wait
        while pids := self.procs():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)

    def remove(self) -> None:
        self.kill_all()
        for d in self.dirs:
            for _ in range(20):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)
        _live_cgroups.discard(self)


CGROUP_ROOTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/memory"))
LEFTOVER = re.compile(r"agentrl-(?:ws-|tmp-)?(\d+)-")
"""The names of what a local sandbox makes on the host (its cgroups, workspace and TMPDIR), with the
pid of the process that made it."""


def gc(temp_dir: str | None = None) -> list[tuple[str, str]]:
    """Remove the local sandboxes' cgroups and workspace directories whose creating process is gone
    (``kill -9``); returns ``(path, reason)`` per removal."""
    removed = []
    candidates = [d for root in CGROUP_ROOTS if root.is_dir() for d in root.glob("agentrl-*")]
    candidates += Path(temp_dir or tempfile.gettempdir()).glob("agentrl-[wt][sm]*-*")
    for path in sorted(candidates):
        match = LEFTOVER.match(path.name)
        if not match or not path.is_dir() or _alive(int(match.group(1))):
            continue
        if path.is_relative_to("/sys/fs/cgroup"):
            group = Cgroup.__new__(Cgroup)  # one of another process's: only its directory is known
            group.dirs = [path]
            group.remove()
        else:
            shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append((str(path), f"its process {match.group(1)} is gone"))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


class HostUid:
    """An unprivileged host uid held by one sandbox (a root process only).

    Held by an exclusive lock on a file named after it in a root-only directory, so that
    concurrent processes never share one; a uid whose lock is free may still have processes from
    a creator killed with ``kill -9``: they are killed when it is taken.
    """

    def __init__(self):
        directory = (
            Path("/run/agentrl-uids")
            if os.path.isdir("/run")
            else Path(tempfile.gettempdir()) / "agentrl-uids"
        )
        directory.mkdir(mode=0o700, exist_ok=True)
        for uid in HOST_UIDS:
            fd = os.open(directory / str(uid), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            kill_uid(uid)
            return
        raise SandboxError(f"every host uid in {HOST_UIDS} is held by a live sandbox")

    def release(self) -> None:
        kill_uid(self.uid)
        with contextlib.suppress(OSError):
            os.close(self._fd)


def _uid_processes(uid: int) -> list[int]:
    """Processes whose real uid is ``uid`` (from their status: /proc/PID's owner can be root)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            found.append(int(name))
                        break
        except (OSError, ValueError):
            pass
    return found


def kill_uid(uid: int) -> None:
    """Kill every process of ``uid``: stopped first (a stopped process cannot fork), then killed."""
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for _ in range(20):
            pids = _uid_processes(uid)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            if sig == signal.SIGKILL:
                time.sleep(0.01)


@dataclass
class LocalConfig:
    workdir: str | None = None
    """Host directory used as the workspace; default: a fresh temporary directory, removed at close."""
    isolation: str = "auto"
    """``bwrap`` (bubblewrap namespaces); ``auto`` (bwrap, or an error saying why it cannot run
    here); ``none`` (a plain subprocess, no isolation: only when asked for)."""
    memory: str = "4g"
    """Memory limit: the cgroup's where there is one, else each process's address space (RLIMIT_AS)."""
    processes: int = 256
    """Process limit: the cgroup's where there is one, else RLIMIT_NPROC (per host user)."""
    max_file_size: str = "1g"
    """Largest file a command may write (RLIMIT_FSIZE)."""
    timeout: float = 300.0
    """Default timeout of a command in seconds; the CPU-time limit is set just above it."""
    output_cap: int = 100_000
    """Bytes of command output kept; above it the head and tail are kept with a marker."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for every command (on top of a minimal PATH, HOME, LANG)."""
    cgroup: bool = True
    """Use a cgroup of its own for process and memory limits when this process may create one."""
    hidden_paths: tuple[str, ...] = ()
    """Host directories commands must not read (with bubblewrap: an empty directory over each, after
    the Python environment is mounted back, so one inside it is hidden too), besides ``/root``,
    ``/home`` and the creating process's working directory: e.g. an environment's task data."""

    def __post_init__(self):
        if self.isolation not in ("auto", "bwrap", "none"):
            raise ValueError(f"isolation must be 'auto', 'bwrap' or 'none'; got {self.isolation!r}")
        self.memory_bytes = parse_size(self.memory, "memory")
        self.max_file_bytes = parse_size(self.max_file_size, "max_file_size")
        for name in ("processes", "output_cap"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")
        if not isinstance(self.timeout, int | float) or self.timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds; got {self.timeout!r}")


_live_workdirs: set[str] = set()  # workspaces (and TMPDIRs) this process made and has not removed yet
_live_cgroups: set[Cgroup] = set()  # the same for cgroups


def _remove_leftovers() -> None:
    """At exit or on SIGINT/SIGTERM: the cgroups and workspace directories ``close()`` did not get to."""
    for group in list(_live_cgroups):
        group.remove()
    for path in list(_live_workdirs):
        shutil.rmtree(path, ignore_errors=True)
        _live_workdirs.discard(path)


def _chown_tree(path: Path, uid: int) -> None:
    os.lchown(path, uid, uid)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.lchown(os.path.join(root, name), uid, uid)


_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_DUMPABLE = 4


class LocalSandbox(AsyncStartClose):
    """A workspace directory on this machine; use as ``async with LocalSandbox(LocalConfig(...)) as sb``."""

    Config = LocalConfig

    @staticmethod
    def usable() -> tuple[bool, str]:
        """Whether this backend isolates commands here (bubblewrap runs); if not, what is missing."""
        ok, why = bwrap_works()
        return ok, "" if ok else f"bubblewrap cannot run ({why})"

    def __init__(self, config: LocalConfig | None = None):
        self.config = config or LocalConfig()
        self.workdir = ""
        self.base_commit: str | None = None
        self._own_workdir = False
        self._closed = False
        self._started = False
        self._bwrap: str | None = None
        self._cgroup: Cgroup | None = None
        self._host_uid: HostUid | None = None
        self._hidden_cwd = os.getcwd()
        self._tmpdir: str | None = None
        self._procs: set[asyncio.subprocess.Process] = set()

    @property
    def uid(self) -> int | None:
        """The host uid commands run as when started as root (one per sandbox); None otherwise."""
        return self._host_uid.uid if self._host_uid else None

    async def start(self) -> None:
        if self._started:
            return
        cfg = self.config
        if cfg.isolation in ("auto", "bwrap"):
            ok, detail = bwrap_works()
            if not ok:
                raise SandboxError(
                    f"the local sandbox needs bubblewrap, but {detail}. Install it, use the docker "
                    "backend, or run commands with no isolation at all by setting isolation='none'."
                )
            self._bwrap = detail
        mode = "bwrap" if self._bwrap else "none"
        if mode not in _warned:
            _warned.add(mode)
            log.warning(
                "local sandbox (%s): weaker isolation than Docker; see agentrl.sandboxes.local for what is and is not contained",
                mode,
            )
        try:
            if os.geteuid() == 0:
                self._host_uid = HostUid()
            if cfg.workdir:
                path = Path(cfg.workdir).resolve()
                path.mkdir(parents=True, exist_ok=True)
            else:
                _cleanup.on_exit(_remove_leftovers)
                path = Path(tempfile.mkdtemp(prefix=f"agentrl-ws-{os.getpid()}-"))
                _live_workdirs.add(str(path))
                self._own_workdir = True
            self.workdir = str(path)
            if self.uid is not None:
                _chown_tree(path, self.uid)
            if not self._bwrap:  # the host's /tmp is shared: each sandbox gets its own TMPDIR
                _cleanup.on_exit(_remove_leftovers)
                self._tmpdir = tempfile.mkdtemp(prefix=f"agentrl-tmp-{os.getpid()}-")
                _live_workdirs.add(self._tmpdir)
                if self.uid is not None:
                    os.chown(self._tmpdir, self.uid, self.uid)
            if cfg.cgroup:
                self._cgroup = Cgroup.create(cfg.processes, cfg.memory_bytes)
            if self.uid is not None and not self._bwrap and "python" not in _warned:
                _warned.add("python")
                self._check_python_reachable()
            self._started = True
            setup = await self.exec(WORKSPACE_SETUP, timeout=60)
            if setup.exit_code != 0:
                raise SandboxError(
                    f"could not set up the workspace {self.workdir} (git needed): {setup.output.strip()[-500:]}"
                )
        except BaseException:  # failed or cancelled half-way: no workspace or cgroup is left behind
            await self.close()
            raise
        self.base_commit, self._git_fingerprint = setup.output.split()[:2]

    def _check_python_reachable(self) -> None:
        """Unisolated as root, the sandbox's uid sees the host's permissions: say so once when this
        Python (and the packages beside it) lies where that uid cannot run it."""
        try:
            reachable = (
                subprocess.run(
                    [sys.executable, "-c", "pass"], capture_output=True, preexec_fn=self._limits(30.0)
                ).returncode
                == 0
            )
        except OSError:
            reachable = False
        if not reachable:
            log.warning(
                "local sandbox (none): the sandbox's user (uid %d) cannot run %s (a directory on its "
                "path is closed to other users); its `python3` is the system's, without this "
                "environment's packages. Use bubblewrap (isolation='bwrap') to give it this one.",
                self.uid,
                sys.executable,
            )

    # -- commands --
    def _bwrap_argv(self, argv: list[str], cwd: str) -> list[str]:
        hidden = [h for h in ("/root", "/home", self._hidden_cwd) if os.path.isdir(h) and h != "/"]
        if self.uid is None:
            out = [self._bwrap, "--unshare-all", "--unshare-user", "--uid", str(SANDBOX_UID)]
            out += ["--gid", str(SANDBOX_UID)]
        else:  # root: bwrap needs no user namespace, and the command drops to the sandbox's host uid
            out = [self._bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
            out += ["--unshare-cgroup-try"]
        out += ["--die-with-parent", "--new-session", "--ro-bind", "/", "/"]
        out += ["--dev", "/dev", "--proc", "/proc", "--perms", "1777", "--tmpfs", "/tmp", "--tmpfs", "/run"]
        for directory in hidden:
            out += ["--tmpfs", directory]
        for keep in sorted({sys.prefix, sys.base_prefix}):
            if not os.path.isdir(keep):
                continue
            # the directories bwrap makes on a tmpfs to mount on are root-only: open them up
            for parent in reversed(Path(keep).parents):
                if any(parent.is_relative_to(h) and str(parent) != h for h in hidden):
                    out += ["--perms", "0755", "--dir", str(parent)]
            out += ["--ro-bind", keep, keep]
        for directory in self.config.hidden_paths:  # after the binds above: inside them too
            if os.path.isdir(directory) and os.path.realpath(directory) != "/":
                out += ["--tmpfs", os.path.realpath(directory)]
        out += ["--bind", self.workdir, self.workdir, "--chdir", cwd]
        if self.uid is not None:
            ids = [f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups"]
            out += ["setpriv", *ids, "--inh-caps=-all", "--bounding-set=-all", "--"]
        return out + argv

    def _lost_mount_race(self, code: int | None, output: str, attempt: int) -> bool:
        """Whether bwrap failed before the command ran because a mount on the host came or went
        while it re-mounted the host's tree read-only (a Docker container starting or stopping on
        this host); the same command run again a moment later succeeds."""
        # bwrap's one line and nothing else; a command that prints exactly this line and exits 1
        # is run again too (up to MOUNT_RACE_TRIES times), which nothing else can tell apart
        lost = bool(self._bwrap) and code == 1 and output.startswith("bwrap: Can't ")
        lost = lost and MOUNT_RACE in output and output.rstrip("\n").count("\n") == 0
        return lost and attempt + 1 < MOUNT_RACE_TRIES

    def _argv(self, argv: list[str], cwd: str) -> list[str]:
        if self._bwrap:
            return self._bwrap_argv(argv, cwd)
        if self.uid is None and self._cgroup is None:
            return [sys.executable, "-I", "-S", str(REAPER), *argv]
        return argv

    def _env(self, extra: dict[str, str] | None) -> dict[str, str]:
        path = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
        home = "/tmp" if self._bwrap else self.workdir
        env = {
            "PATH": path,
            "HOME": home,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",  # keeps __pycache__ out of the workspace diff
            "PYTHONNOUSERSITE": "1",  # nothing outside the workspace on the import path
            "AGENTRL_BASE": self.base_commit or "",
        }
        if self._tmpdir:
            env["TMPDIR"] = self._tmpdir
        return {**env, **self.config.env, **(extra or {})}

    def _launch(self, argv: list[str], timeout: float) -> tuple[list[str], Any]:
        """``argv`` wrapped to run in the sandbox's cgroup, under its limits, as its user; returns
        (argv, preexec_fn). With prlimit and setpriv (util-linux) the wrapping is done by small
        programs, so that no Python code runs between fork and exec and the spawn can use vfork:
        a plain fork of this process (a trainer holding a model) costs tens of milliseconds, with
        the event loop blocked, on every command and file operation."""
        if not shutil.which("prlimit") or (self.uid is not None and not shutil.which("setpriv")):
            return argv, self._limits(timeout)
        cfg, cpu = self.config, int(timeout) + 2
        out = ["prlimit", f"--fsize={cfg.max_file_bytes}", f"--cpu={cpu}:{cpu + 1}"]
        if self._cgroup is None:
            out += [f"--as={cfg.memory_bytes}", f"--nproc={cfg.processes}"]
        out.append("--")
        if self.uid is not None and not self._bwrap:  # bwrap as root drops to the uid itself
            ids = [f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups"]
            out += ["setpriv", *ids, "--inh-caps=-all", "--bounding-set=-all", "--"]
        out += argv
        if self._cgroup is not None:
            procs = [str(d / "cgroup.procs") for d in self._cgroup.dirs]
            out = ["sh", "-c", JOIN_CGROUP, "agentrl", *procs, "--", *out]
        return out, None

    def _limits(self, timeout: float):
        cfg = self.config
        cpu = int(timeout) + 2
        cgroup, uid, bwrap = self._cgroup, self.uid, self._bwrap

        def apply() -> None:
            if cgroup is not None:
                cgroup.join()
            else:
                resource.setrlimit(resource.RLIMIT_AS, (cfg.memory_bytes, cfg.memory_bytes))
                resource.setrlimit(resource.RLIMIT_NPROC, (cfg.processes, cfg.processes))
            resource.setrlimit(resource.RLIMIT_FSIZE, (cfg.max_file_bytes, cfg.max_file_bytes))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            if uid is not None and not bwrap:  # bwrap as root drops to the uid itself (setpriv)
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)

        return apply

    def _resolve_cwd(self, cwd: str | None) -> str:
        if not cwd:
            return self.workdir
        root = Path(self.workdir).resolve()
        target = (root / cwd).resolve()
        if not target.is_relative_to(root):
            raise PermissionError(
                f"{cwd!r} resolves to {target}, outside the workspace {root}; "
                "paths must stay inside it (no '..' or symlinks out)"
            )
        return str(target)

    async def _spawn(self, argv: list[str], cwd: str, env, timeout: float, stdout, stdin=None, pass_fds=()):
        """Start ``argv`` as the sandbox runs commands (namespaces, user, limits); returns the process."""
        full, preexec = self._launch(self._argv(argv, cwd), timeout)
        proc = await asyncio.create_subprocess_exec(
            *full,
            cwd=cwd,
            env=self._env(env),
            stdin=stdin if stdin is not None else subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.STDOUT if stdout is not subprocess.PIPE else subprocess.PIPE,
            start_new_session=True,
            preexec_fn=preexec,
            pass_fds=pass_fds,
        )
        self._procs.add(proc)
        return proc

    async def _wait(self, proc, timeout: float, pids_before: int) -> tuple[bool, bool]:
        """Wait for a command; returns (timed out, pids limit hit). With a cgroup, a fork refused at
        its process limit (a fork bomb) ends the wait at once, as the timeout does."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return True, bool(self._cgroup and self._cgroup.pids_refused() > pids_before)
            step = min(left, 0.1) if self._cgroup else left
            with contextlib.suppress(TimeoutError):
                await within(proc.wait(), step)
            refused = bool(self._cgroup and self._cgroup.pids_refused() > pids_before)
            if refused or proc.returncode is not None:
                return False, refused

    async def _stop(self, proc) -> None:
        """Kill a command and everything it started."""
        if self._bwrap is None and self.uid is None and self._cgroup is None:
            # the reaper kills what the command left behind when told to stop; give it a moment
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await within(proc.wait(), 2.0)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        self._procs.discard(proc)
        await self._sweep()

    async def _sweep(self, force: bool = False) -> None:
        """Kill what is left of the sandbox's commands (background processes, or a namespace whose
        command was killed) and wait until it is gone, so that the next command starts with the
        process limit free. While another command runs in the sandbox (``force`` aside) nothing is
        killed: its processes cannot be told apart; what is left is killed when the last one ends."""
        if self._procs and not force:
            return
        loop = asyncio.get_running_loop()
        if self._cgroup is not None:
            if self._cgroup.procs():
                await loop.run_in_executor(None, self._cgroup.kill_all)
        elif self.uid is not None:
            await loop.run_in_executor(None, kill_uid, self.uid)

    async def exec(
        self,
        cmd: str,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        *,
        output_cap: int | None = None,
    ) -> ExecResult:
        check_command(cmd, timeout)
        if not self._started or self._closed:
            raise SandboxError(
                "the sandbox is not started (use `async with make_sandbox(...) as sb`) or already closed"
            )
        if not Path(self.workdir).is_dir():
            return ExecResult(-1, "", sandbox_died=True)  # the workspace is gone
        timeout = float(timeout or self.config.timeout)
        cap = output_cap or self.config.output_cap
        workdir = self._resolve_cwd(cwd)
        start = time.perf_counter()
        oom_before = self._cgroup.oom_kills() if self._cgroup else 0
        pids_before = self._cgroup.pids_refused() if self._cgroup else 0
        for attempt in range(MOUNT_RACE_TRIES):
            with tempfile.TemporaryFile() as out, _script(cmd) as script:
                if script is None:
                    proc = await self._spawn(["bash", "-c", cmd], workdir, env, timeout, out)
                else:  # too long for one argument: bash reads it from a file handed down as an fd
                    argv = ["bash", f"/dev/fd/{script}"]
                    proc = await self._spawn(argv, workdir, env, timeout, out, pass_fds=(script,))
                try:
                    timed_out, pids_exhausted = await self._wait(proc, timeout, pids_before)
                except asyncio.CancelledError:
                    await asyncio.shield(self._stop(proc))
                    raise
                finally:
                    self._procs.discard(proc)
                if timed_out or pids_exhausted:
                    await self._stop(proc)
                else:
                    await self._sweep()  # background processes do not outlive their command here
                size = out.seek(0, os.SEEK_END)
                out.seek(0)
                if size > cap:
                    head = out.read(cap // 2)
                    out.seek(size - (cap - cap // 2))
                    text = join_cut(head, out.read(), size)
                else:
                    text = out.read().decode("utf-8", errors="replace")
            if not self._lost_mount_race(proc.returncode, text, attempt):
                break
            await asyncio.sleep(MOUNT_RACE_PAUSE * (attempt + 1))
        code = proc.returncode
        exit_code = 124 if timed_out else 137 if pids_exhausted else (128 - code if code < 0 else code)
        oom = bool(self._cgroup and self._cgroup.oom_kills() > oom_before)
        return ExecResult(
            exit_code=exit_code,
            output=text,
            timed_out=timed_out,
            truncated=size > cap,
            oom_killed=oom,
            pids_exhausted=pids_exhausted,
            killed=exit_code == 137 and not (timed_out or oom or pids_exhausted),
            duration_s=time.perf_counter() - start,
        )

    # -- files --
    async def _file_op(self, op: str, path: str, data: bytes | None = None) -> bytes:
        """Run one ``FILE_OPS`` operation the way commands run (as the sandbox's user); its stdout."""
        if not self._started or self._closed:
            raise SandboxError("the sandbox is not started or already closed")
        argv = ["bash", "-c", FILE_OPS, "agentrl", op, self.workdir, path]
        stdin = subprocess.PIPE if data is not None else None
        for attempt in range(MOUNT_RACE_TRIES):
            proc = await self._spawn(argv, self.workdir, None, FILE_OP_TIMEOUT, subprocess.PIPE, stdin)
            try:
                stdout, stderr = await within(proc.communicate(data), FILE_OP_TIMEOUT)
            except (
                TimeoutError
            ):  # wedged (a file the agent made blocks it): an error the agent reads, as on Docker
                await asyncio.shield(self._stop(proc))
                what = "read" if op == "read" else "write"
                raise PermissionError(
                    f"cannot {what} {path} in the sandbox: the file operation did not finish within "
                    f"{FILE_OP_TIMEOUT:g}s"
                ) from None
            except asyncio.CancelledError:
                await asyncio.shield(self._stop(proc))
                raise
            finally:
                self._procs.discard(proc)
            if not self._lost_mount_race(proc.returncode, stderr.decode(errors="replace"), attempt):
                break
            await asyncio.sleep(MOUNT_RACE_PAUSE * (attempt + 1))
        error = file_op_error(proc.returncode, op, path, self.workdir, stdout, stderr)
        if error is not None:
            raise error
        return stdout

    async def read_file(self, path: str) -> bytes:
        """The bytes of a file inside the workspace, read as the sandbox's user."""
        return await self._file_op("read", path)

    async def write_file(self, path: str, data: bytes | str) -> None:
        """Write a file inside the workspace as the sandbox's user (parents made, mode kept if it exists)."""
        await self._file_op("write", path, to_bytes(data))

    async def upload(self, local_path: str, dest: str) -> None:
        """Copy a local file or directory to ``dest`` in the workspace (the environment's own files,
        before the agent starts; owned by the sandbox's user)."""
        source = Path(local_path)
        if not source.exists():
            raise FileNotFoundError(f"upload source {source} does not exist")
        target = Path(self._resolve_cwd(dest))
        missing = []
        parent = target.parent
        while not parent.exists():
            missing.append(parent)
            parent = parent.parent
        for directory in reversed(missing):
            directory.mkdir()
            if self.uid is not None:
                os.chown(directory, self.uid, self.uid)
        if source.is_dir():
            shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(source, target)
        if self.uid is not None:
            _chown_tree(target, self.uid)

    async def diff(self, base: str | None = None) -> str:
        return await read_diff(self, base or self.base_commit)

    async def alive(self) -> bool:
        return self._started and not self._closed and Path(self.workdir).is_dir()

    async def reset(self) -> bool:
        if not await self.alive():
            return False
        for proc in list(self._procs):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        await self._sweep(force=True)
        if self._tmpdir:  # the next user starts with an empty TMPDIR, as with a fresh /tmp
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            os.mkdir(self._tmpdir, 0o700)
            if self.uid is not None:
                os.chown(self._tmpdir, self.uid, self.uid)
        result = await self.exec('BASE="$AGENTRL_BASE" && ' + GIT_RESET, timeout=60)
        await self._sweep(force=True)  # whatever the git steps may still have started
        return result.exit_code == 0 and result.output.split()[:2] == [
            self.base_commit,
            self._git_fingerprint,
        ]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for proc in list(self._procs):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        self._procs.clear()
        loop = asyncio.get_running_loop()
        if self._cgroup is not None:
            await loop.run_in_executor(None, self._cgroup.remove)
        if self._host_uid is not None:
            await loop.run_in_executor(None, self._host_uid.release)
        if self._own_workdir and self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            _live_workdirs.discard(self.workdir)
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            _live_workdirs.discard(self._tmpdir)
