"""Local sandbox backend, for machines without Docker (a laptop quickstart).

Isolation is weaker than the Docker backend's, and this says how:

- With bubblewrap (``bwrap``, ``isolation="bwrap"`` or ``"auto"`` when installed): each command
  runs in fresh namespaces (``--unshare-all``: no network but ``lo``, own PIDs, own IPC), on a
  read-only view of the host's root filesystem, with a private ``/tmp``, ``/root``, ``/home``
  and the creating process's working directory hidden (the Python environment is mounted back
  read-only so the agent's ``python`` works), and only the workspace writable. When the command
  exits, everything it started in the background is killed with its PID namespace.
- Without bubblewrap (``isolation="none"``): a plain subprocess in the workspace directory. It
  can read (not write, when dropped to an unprivileged user) the host's files and reach the
  network. Background processes survive the command and are killed at ``close()``. ``/tmp`` is
  the host's, shared by every sandbox: each gets a private temporary directory of its own as
  ``TMPDIR`` (removed with the workspace), which scratch files of concurrent sandboxes must use.

Limits: where this process may create cgroups (root on a cgroup v1 or v2 host), each sandbox
gets its own, with a process limit (``processes``) and a memory limit (``memory``) that the OOM
killer enforces and ``oom_killed`` reports, and ``close()`` kills everything in it. Elsewhere the
limits are rlimits: address space (allocations fail with ``MemoryError`` instead of an OOM kill,
so ``oom_killed`` is never set) and processes (counted per user, over all of the user's
processes, and not enforced at all for root). File size and CPU time are always rlimits; total
disk use is not limited (each file is, by ``max_file_size``). Under bwrap commands run as uid
1000 in a user namespace; without it, as the calling user. The weaker isolation is logged once
per process.

Cleanup: a workspace this backend created is removed on ``close()``, at interpreter exit and on
SIGINT/SIGTERM of the creating process (not after ``kill -9``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
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

from agentrl.sandbox import (
    WORKSPACE_SETUP,
    AsyncStartClose,
    ExecResult,
    SandboxError,
    check_command,
    diff_script,
    join_cut,
)
from agentrl.sandboxes import _cleanup
from agentrl.sandboxes.docker import parse_size

log = logging.getLogger(__name__)
_warned: set[str] = set()
SANDBOX_UID = 1000


def bwrap_works() -> tuple[bool, str]:
    """Whether bubblewrap is installed and can create namespaces here, with the reason if not."""
    path = shutil.which("bwrap")
    if not path:
        return False, "bwrap is not installed (apt-get install -y bubblewrap)"
    probe = subprocess.run(
        [path, "--unshare-all", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "true"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return False, f"bwrap cannot create namespaces here: {probe.stderr.strip()}"
    return True, path


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
            return cls(f"agentrl-{os.getpid()}-{uuid.uuid4().hex[:8]}", pids, memory)
        except OSError:
            return None

    def join(self) -> None:
        """Move the calling process in (used in the child before exec)."""
        for d in self.dirs:
            (d / "cgroup.procs").write_text("0")

    def oom_kills(self) -> int:
        for line in self.events.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def kill_all(self) -> None:
        for _ in range(5):
            pids = [int(p) for p in (self.dirs[0] / "cgroup.procs").read_text().split()]
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

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


@dataclass
class LocalConfig:
    workdir: str | None = None
    """Host directory used as the workspace; default: a fresh temporary directory, removed at close."""
    isolation: str = "auto"
    """``bwrap`` (bubblewrap namespaces), ``none`` (plain subprocess), or ``auto`` (bwrap when it works)."""
    memory: str = "4g"
    """Address-space limit of each process (RLIMIT_AS)."""
    processes: int = 256
    """Process limit (RLIMIT_NPROC, counted per user; not enforced for root, hence ``uid``)."""
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


def _remove_live_workdirs() -> None:
    """At exit or on SIGINT/SIGTERM: the workspace directories ``close()`` did not get to."""
    for path in list(_live_workdirs):
        shutil.rmtree(path, ignore_errors=True)
        _live_workdirs.discard(path)


class LocalSandbox(AsyncStartClose):
    """A workspace directory on this machine; use as ``async with LocalSandbox(LocalConfig(...)) as sb``."""

    Config = LocalConfig

    def __init__(self, config: LocalConfig | None = None):
        self.config = config or LocalConfig()
        self.workdir = ""
        self.base_commit: str | None = None
        self._own_workdir = False
        self._closed = False
        self._started = False
        self._groups: set[int] = set()
        self._bwrap: str | None = None
        self._cgroup: Cgroup | None = None
        self._hidden_cwd = os.getcwd()
        self._tmpdir: str | None = None

    async def start(self) -> None:
        if self._started:
            return
        cfg = self.config
        if cfg.isolation in ("auto", "bwrap"):
            ok, detail = bwrap_works()
            if ok:
                self._bwrap = detail
            elif cfg.isolation == "bwrap":
                raise SandboxError(f"isolation='bwrap' was asked for, but {detail}.")
        mode = "bwrap" if self._bwrap else "none"
        if mode not in _warned:
            _warned.add(mode)
            log.warning(
                "local sandbox (%s): weaker isolation than Docker; see agentrl.sandboxes.local for what is and is not contained",
                mode,
            )
        if cfg.workdir:
            path = Path(cfg.workdir).resolve()
            path.mkdir(parents=True, exist_ok=True)
        else:
            _cleanup.on_exit(_remove_live_workdirs)
            path = Path(tempfile.mkdtemp(prefix="agentrl-ws-"))
            _live_workdirs.add(str(path))
            self._own_workdir = True
        self.workdir = str(path)
        if not self._bwrap:  # the host's /tmp is shared: each sandbox gets its own TMPDIR
            _cleanup.on_exit(_remove_live_workdirs)
            self._tmpdir = tempfile.mkdtemp(prefix="agentrl-tmp-")
            _live_workdirs.add(self._tmpdir)
        try:
            if cfg.cgroup:
                self._cgroup = Cgroup.create(cfg.processes, cfg.memory_bytes)
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

    # -- commands --
    def _argv(self, cmd: str, cwd: str) -> list[str]:
        if not self._bwrap:
            return ["bash", "-c", cmd]
        argv = [
            self._bwrap,
            "--unshare-all",
            "--unshare-user",
            "--uid",
            str(SANDBOX_UID),
            "--gid",
            str(SANDBOX_UID),
        ]
        argv += ["--die-with-parent", "--new-session", "--ro-bind", "/", "/"]
        argv += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
        for hidden in ("/root", "/home", self._hidden_cwd):
            if os.path.isdir(hidden) and hidden != "/":
                argv += ["--tmpfs", hidden]
        for keep in {sys.prefix, sys.base_prefix}:
            if os.path.isdir(keep):
                argv += ["--ro-bind", keep, keep]
        argv += ["--bind", self.workdir, self.workdir, "--chdir", cwd, "bash", "-c", cmd]
        return argv

    def _env(self, extra: dict[str, str] | None) -> dict[str, str]:
        path = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
        home = "/tmp" if self._bwrap else self.workdir
        env = {
            "PATH": path,
            "HOME": home,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",  # keeps __pycache__ out of the workspace diff
            "AGENTRL_BASE": self.base_commit or "",
        }
        if self._tmpdir:
            env["TMPDIR"] = self._tmpdir
        return {**env, **self.config.env, **(extra or {})}

    def _limits(self, timeout: float):
        cfg = self.config
        cpu = int(timeout) + 2

        cgroup = self._cgroup

        def apply() -> None:
            if cgroup is not None:
                cgroup.join()
            else:
                resource.setrlimit(resource.RLIMIT_AS, (cfg.memory_bytes, cfg.memory_bytes))
                resource.setrlimit(resource.RLIMIT_NPROC, (cfg.processes, cfg.processes))
            resource.setrlimit(resource.RLIMIT_FSIZE, (cfg.max_file_bytes, cfg.max_file_bytes))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))

        return apply

    def _resolve_cwd(self, cwd: str | None) -> str:
        if not cwd:
            return self.workdir
        return str(self._inside(cwd))

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
        with tempfile.TemporaryFile() as out:
            proc = await asyncio.create_subprocess_exec(
                *self._argv(cmd, workdir),
                cwd=workdir,
                env=self._env(env),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=self._limits(timeout),
            )
            self._groups.add(proc.pid)
            timed_out = False
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except TimeoutError:
                timed_out = True
                self._kill_group(proc.pid)
                await proc.wait()
            except asyncio.CancelledError:
                self._kill_group(proc.pid)
                raise
            if self._bwrap:
                self._groups.discard(proc.pid)  # its PID namespace, and everything in it, is gone
            size = out.seek(0, os.SEEK_END)
            out.seek(0)
            if size > cap:
                head = out.read(cap // 2)
                out.seek(size - (cap - cap // 2))
                text = join_cut(head, out.read(), size)
            else:
                text = out.read().decode("utf-8", errors="replace")
        code = proc.returncode
        exit_code = 124 if timed_out else (128 - code if code < 0 else code)
        return ExecResult(
            exit_code=exit_code,
            output=text,
            timed_out=timed_out,
            truncated=size > cap,
            oom_killed=bool(self._cgroup and self._cgroup.oom_kills() > oom_before),
            duration_s=time.perf_counter() - start,
        )

    def _kill_group(self, pgid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)

    # -- files --
    def _inside(self, path: str) -> Path:
        """Resolve ``path`` (relative to the workspace, or absolute inside it); refuse anything outside."""
        root = Path(self.workdir).resolve()
        target = (root / path).resolve()
        if not target.is_relative_to(root):
            raise PermissionError(
                f"{path!r} resolves to {target}, outside the workspace {root}; "
                "paths must stay inside it (no '..' or symlinks out)"
            )
        return target

    async def read_file(self, path: str) -> bytes:
        target = self._inside(path)
        if not target.is_file():
            raise FileNotFoundError(f"{path} does not exist in the sandbox workspace")
        return target.read_bytes()

    def _make_parents(self, target: Path) -> None:
        missing = []
        parent = target.parent
        while not parent.exists():
            missing.append(parent)
            parent = parent.parent
        for directory in reversed(missing):
            directory.mkdir()

    async def write_file(self, path: str, data: bytes | str) -> None:
        target = self._inside(path)
        self._make_parents(target)
        target.write_bytes(data.encode() if isinstance(data, str) else data)

    async def upload(self, local_path: str, dest: str) -> None:
        source = Path(local_path)
        if not source.exists():
            raise FileNotFoundError(f"upload source {source} does not exist")
        target = self._inside(dest)
        self._make_parents(target)
        if source.is_dir():
            shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(source, target)

    async def diff(self, base: str | None = None) -> str:
        result = await self.exec(diff_script(base or self.base_commit), timeout=120, output_cap=256 * 2**20)
        if result.exit_code != 0:
            raise SandboxError(f"git diff in {self.workdir} failed: {result.output.strip()[-500:]}")
        return result.output

    async def alive(self) -> bool:
        return self._started and not self._closed and Path(self.workdir).is_dir()

    async def reset(self) -> bool:
        if not await self.alive():
            return False
        for pgid in list(self._groups):
            self._kill_group(pgid)
        self._groups.clear()
        if self._cgroup is not None:
            self._cgroup.kill_all()
        if self._tmpdir:  # the next user starts with an empty TMPDIR, as with a fresh /tmp
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            os.mkdir(self._tmpdir, 0o700)
        result = await self.exec(
            'git reset -q --hard "$AGENTRL_BASE" && git clean -qffdx && [ -z "$(git status --porcelain)" ] && '
            "git rev-parse HEAD && cat .git/config .git/hooks/* 2>/dev/null | cksum",
            timeout=60,
        )
        return result.exit_code == 0 and result.output.split()[:2] == [
            self.base_commit,
            self._git_fingerprint,
        ]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for pgid in list(self._groups):
            self._kill_group(pgid)
        self._groups.clear()
        if self._cgroup is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._cgroup.remove)
        if self._own_workdir and self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            _live_workdirs.discard(self.workdir)
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            _live_workdirs.discard(self._tmpdir)
