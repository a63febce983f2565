"""Docker sandbox backend: one container per episode, from a local image.

Isolation by default: no network (``network_mode="none"``: only ``lo``), a non-root user
(``agent``, uid 1000), memory limit with swap equal to it, a pids limit, a CPU quota,
``init=True`` (so PID 1 reaps and forwards signals), ``no-new-privileges``, no host mounts, the
workspace at ``/testbed``. The container's keep-alive process runs as root, so an agent that runs
``kill -9 -1`` kills only its own processes; where it does kill the keep-alive (``user="root"``),
the OOM killer takes it, or the daemon restarts, the next call reports ``sandbox_died``.

Every command goes through a small runner script (``_exec.sh``, root-owned and read-only, run as
root) that runs the command as the sandbox's user, enforces its timeout inside the container,
kills every process the command started when it expires, detaches background processes from the
caller's output stream, and reports OOM kills and fork bombs (the pids limit refusing a fork:
every process of the user is then killed). At the timeout, every process of the user is stopped
at once (kill(-1) as the user, so none can keep forking past it); those started since the command
began (by uid and start time, which no child can shed) are killed and the others resumed. A
timeout's kill also takes what a command run at the same time in the same sandbox started since;
episodes run their commands one at a time. The Docker SDK's ``exec_run`` has none of this, and a
client-side socket timeout does not apply to exec streams. A cancelled ``exec`` (asyncio
cancellation) returns once the runner has killed everything the command started and removed its
files, wherever the cancel landed in the runner; one that comes before the daemon has started the
runner leaves a mark, and the runner, when it starts, runs nothing.

Files: ``read_file`` and ``write_file`` run as the sandbox's user, inside the container, on paths
resolved there (symlinks included) that must stay inside the workspace; never through Docker's
archive API, which writes as root anywhere. ``upload`` (the environment's own files, before the
agent starts) is the one use of the archive API.

Disk: a per-file size limit (``max_file_size``, RLIMIT_FSIZE) always holds. A limit on the total
size of the container's writable layer (``disk``, Docker's ``storage_opt size``) needs a storage
driver that supports it (overlay2 on xfs with project quotas, btrfs, zfs, devicemapper); on other
drivers (overlay2 on ext4, the common case) it cannot be enforced: a warning says so once and
``agentrl sandbox doctor`` reports it. ``/tmp`` and the runner's two directories (commands' output;
results kept for a lost stream) are size-limited tmpfs.

Cleanup: containers are removed on ``close()`` (normal exit, exception, asyncio cancellation), at
interpreter exit, and on SIGINT/SIGTERM of the creating process. Each carries labels
``agentrl.sandbox=1``, ``agentrl.run``, ``agentrl.pid`` (and the host and process start time), so
``agentrl sandbox gc`` can remove those whose creating process is gone (``kill -9``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import io
import logging
import os
import posixpath
import secrets
import shutil
import socket
import tarfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from agentrl.sandbox import (
    ARGUMENT_CHARS,
    FILE_OP_CODES,
    FILE_OPS,
    GIT_RESET,
    WORKSPACE_SETUP,
    AsyncStartClose,
    ExecResult,
    SandboxDied,
    SandboxError,
    check_command,
    cut_output,
    file_op_error,
    join_cut,
    read_diff,
    to_bytes,
    within,
)
from agentrl.sandboxes import _cleanup
from agentrl.sandboxes.images import AGENT_UID, BASE_IMAGE, image_present

log = logging.getLogger(__name__)

RUNNER = (Path(__file__).parent / "_exec.sh").read_text()
OUTPUT_DIR = "/run/agentrl"  # a root-only tmpfs: the runner's output files, out of the agent's reach
RESULT_DIR = "/run/agentrl-results"  # another: the results kept for a lost stream, which no output can fill
RUNNER_PATH = "/.agentrl-runner"  # not under a tmpfs: the archive API cannot write into one
WRITE_CHUNK = 48 * 2**10  # bytes per exec of a file write: base64 in one argument stays under 128 KiB
FILE_OP_TIMEOUT = 60  # seconds; a file operation is a cat or a write, far quicker unless wedged
LABEL = "agentrl.sandbox"
_UNITS = {"b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(value: str | int, what: str) -> int:
    """``"512m"`` / ``"2g"`` / bytes -> bytes; anything else is an error naming the setting."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        text = value.strip().lower().removesuffix("b") or "x"
        unit = _UNITS.get(text[-1], 1)
        number = text[:-1] if text[-1] in _UNITS else text
        try:
            size = int(float(number) * unit)
        except ValueError:
            size = 0
        if size > 0:
            return size
    raise ValueError(f"{what} must be a positive size like '512m' or '2g' (or bytes); got {value!r}")


def run_id() -> str:
    """The run id of this process: ``AGENTRL_RUN_ID`` if set, else one made at first use."""
    if not os.environ.get("AGENTRL_RUN_ID"):
        os.environ["AGENTRL_RUN_ID"] = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    return os.environ["AGENTRL_RUN_ID"]


def process_start_time(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (tells a live process from a reused pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


@dataclass
class DockerConfig:
    image: str = BASE_IMAGE
    """Local image to run (``agentrl sandbox build`` makes the base one; nothing is pulled)."""
    user: str = "agent"
    """User that commands run as. Non-root by default; ``root`` lets the agent kill the sandbox."""
    workdir: str = "/testbed"
    """The workspace: default cwd of commands, root of relative paths and of ``diff``."""
    memory: str = "2g"
    """Memory limit (swap limit set equal, so no swap). A command over it is OOM-killed."""
    pids: int = 512
    """Maximum number of processes and threads in the container (stops fork bombs)."""
    cpus: float = 1.0
    """CPU quota in cores."""
    network: bool = False
    """Give the container a network. Off: only ``lo`` exists."""
    disk: str | None = "10g"
    """Limit on the writable layer, where the storage driver supports it (see the module doc)."""
    max_file_size: str = "1g"
    """Largest file a command may write (RLIMIT_FSIZE); enforced on every storage driver."""
    tmp_size: str = "512m"
    """Size of the tmpfs mounted at ``/tmp`` (counts against ``memory``)."""
    timeout: float = 300.0
    """Default timeout of a command in seconds."""
    output_cap: int = 100_000
    """Bytes of command output kept; above it the head and tail are kept with a marker."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for every command."""
    run: str | None = None
    """Run id label (default: ``AGENTRL_RUN_ID`` or one made per process)."""
    docker_host: str | None = None
    """Docker daemon URL (default: ``DOCKER_HOST`` or the local socket)."""
    hosts: list[str] = field(default_factory=list)
    """Several Docker daemons (``unix://…``, ``tcp://…``, ``ssh://…``) to spread sandboxes over: each
    sandbox starts on the one with the fewest of this process's sandboxes; a daemon that fails its
    health check is skipped for ``HOST_RETRY`` seconds. Empty: ``docker_host`` alone."""
    max_parallel_calls: int = 32
    """Blocking Docker SDK calls running at once (they run on a thread pool off the event loop)."""
    grace: float = 10.0
    """Seconds past a command's timeout before the caller gives up on the runner and kills the sandbox."""

    def __post_init__(self):
        if not isinstance(self.image, str) or not self.image:
            raise ValueError(f"image must be a non-empty image name; got {self.image!r}")
        self.memory_bytes = parse_size(self.memory, "memory")
        self.tmp_bytes = parse_size(self.tmp_size, "tmp_size")
        self.max_file_bytes = parse_size(self.max_file_size, "max_file_size")
        if self.disk is not None:
            parse_size(self.disk, "disk")
        for name in ("pids", "output_cap", "max_parallel_calls"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")
        for name in ("cpus", "timeout", "grace"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name} must be a positive number; got {value!r}")
        if not PurePosixPath(self.workdir).is_absolute():
            raise ValueError(f"workdir must be an absolute path inside the container; got {self.workdir!r}")
        if not isinstance(self.hosts, list | tuple) or not all(
            isinstance(h, str) and "://" in h for h in self.hosts
        ):
            raise ValueError(
                f"hosts must be a list of daemon URLs like unix:///var/run/docker.sock; got {self.hosts!r}"
            )
        if self.hosts and self.docker_host:
            raise ValueError("set docker_host (one daemon) or hosts (several), not both")


# --- process-wide plumbing: one client, one thread pool, the live containers ----------------------

_lock = threading.RLock()  # re-entrant: the signal hook below may run while this thread holds it
_clients: dict[str | None, Any] = {}
_executor: ThreadPoolExecutor | None = None
_live: dict[str, Any] = {}  # container id -> client, for cleanup at exit and on signals
_creating = 0  # container creates on their way to the daemon; the exit hook waits for them
_stopping = False  # set while the exit hook runs: a create that finishes then removes its container
_warned: set[str] = set()
_image_ids: dict[tuple[str | None, str, str], str] = {}  # (daemon, image, user) -> "uid gid"
ID_SCRIPT = 'id -u -- "$1" && id -g -- "$1"'


def client_for(base_url: str | None, pool_size: int = 64):
    import docker

    with _lock:
        if base_url not in _clients:
            try:
                if base_url:
                    _clients[base_url] = docker.DockerClient(
                        base_url=base_url, max_pool_size=pool_size, timeout=120
                    )
                else:
                    _clients[base_url] = docker.from_env(max_pool_size=pool_size, timeout=120)
                _clients[base_url].ping()
            except Exception as e:
                _clients.pop(base_url, None)
                raise SandboxError(
                    f"cannot reach the Docker daemon ({base_url or os.environ.get('DOCKER_HOST') or 'local socket'}): {e}. "
                    "Start it (`sudo dockerd &` or `systemctl start docker`), or use the local backend; "
                    "`agentrl sandbox doctor` checks this machine."
                ) from e
        return _clients[base_url]


HOST_RETRY = 30.0  # seconds a daemon that failed its health check is left out
HOST_CHECK = 10.0  # seconds a passed health check is trusted
_host_load: dict[str, int] = {}  # daemon URL -> this process's sandboxes started or starting there
_host_state: dict[str, tuple[bool, float, str]] = {}  # daemon URL -> (healthy, when checked, error)


def _healthy(host: str) -> tuple[bool, str]:
    """Whether ``host`` answers a ping (cached: HOST_CHECK when it did, HOST_RETRY when it did not)."""
    now = time.monotonic()
    with _lock:
        ok, when, error = _host_state.get(host, (False, -1e9, ""))
    if now - when < (HOST_CHECK if ok else HOST_RETRY):
        return ok, error
    try:
        client_for(host).ping()
        state = (True, now, "")
    except Exception as e:  # an unreachable daemon, a broken connection, an SSH failure
        with _lock:
            _clients.pop(host, None)
        state = (False, now, str(e).split(";")[0][:300])
    with _lock:
        _host_state[host] = state
    return state[0], state[2]


def pick_host(hosts: list[str]) -> str:
    """The healthy daemon of ``hosts`` with the fewest of this process's sandboxes (ties: list
    order); counted as taken until ``release_host``. Stops naming every host's error when none answers.

    Health is checked first (a ping may take a while, outside the lock); the least-loaded healthy
    host is then chosen and counted in one step under the lock, so that sandboxes started at once
    from several threads spread instead of all reading the same loads."""
    health = {host: _healthy(host) for host in dict.fromkeys(hosts)}
    with _lock:
        healthy = [i for i, host in enumerate(hosts) if health[host][0]]
        if healthy:
            best = hosts[min(healthy, key=lambda i: (_host_load.get(hosts[i], 0), i))]
            _host_load[best] = _host_load.get(best, 0) + 1
            return best
    errors = [f"{host}: {error or 'failed its health check recently'}" for host, (_, error) in health.items()]
    raise SandboxError(
        f"no Docker daemon of sandbox hosts answers ({'; '.join(errors)}); start them, or remove the dead "
        "ones from sandbox.docker.hosts"
    )


def _unreachable(error: BaseException) -> bool:
    """The daemon could not be reached at all (as opposed to refusing a request: a missing image
    on one host is not a reason to leave that host out)."""
    import requests

    if isinstance(error, SandboxError):
        return str(error).startswith("cannot reach the Docker daemon")
    return isinstance(error, requests.exceptions.ConnectionError) or (
        getattr(error, "status_code", None) is None and "connection" in str(error).lower()
    )


def release_host(host: str) -> None:
    with _lock:
        _host_load[host] = max(0, _host_load.get(host, 0) - 1)


def mark_unhealthy(host: str, error: str) -> None:
    with _lock:
        _host_state[host] = (False, time.monotonic(), error[:300])
        _clients.pop(host, None)


def executor(max_workers: int) -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="agentrl-docker")
        return _executor


def _remove_live_containers() -> None:
    """At exit or on SIGINT/SIGTERM: remove every container this process made.

    A create sent to the daemon just before the signal is waited for (a few seconds at most), and
    the daemon is then asked for every container labelled with this process, so that one whose
    create the daemon finished but this process never heard of is removed too."""
    global _stopping
    _stopping = True
    try:
        deadline = time.monotonic() + 10.0
        while _creating and time.monotonic() < deadline:
            time.sleep(0.05)
        with _lock:
            items = list(_live.items())
            _live.clear()
            clients = list(_clients.values())
        for cid, client in items:
            with contextlib.suppress(Exception):
                client.api.remove_container(cid, force=True, v=True)
        pid = os.getpid()
        mine = {"agentrl.pid": str(pid), "agentrl.pid_start": process_start_time(pid) or ""}
        for client in clients:
            with contextlib.suppress(Exception):
                for c in client.api.containers(
                    all=True, filters={"label": [f"{LABEL}=1", f"agentrl.pid={pid}"]}
                ):
                    labels = c.get("Labels") or {}
                    if (
                        all(labels.get(k) == v for k, v in mine.items())
                        and labels.get("agentrl.host") == socket.gethostname()
                    ):
                        with contextlib.suppress(Exception):
                            client.api.remove_container(c["Id"], force=True, v=True)
    finally:
        _stopping = False


def _transient(e: BaseException) -> bool:
    """Daemon hiccups worth retrying: a dropped connection or a 5xx answer. Never a 4xx."""
    import docker
    import requests

    if isinstance(e, requests.exceptions.ConnectionError | requests.exceptions.ChunkedEncodingError):
        return True
    return isinstance(e, docker.errors.APIError) and e.status_code is not None and e.status_code >= 500


_retry = retry(
    retry=retry_if_exception(_transient),
    stop=stop_after_attempt(4),
    wait=wait_exponential(multiplier=0.2, max=2.0),
    reraise=True,
)


def storage_supports_size(client) -> bool:
    """Whether ``storage_opt={"size": ...}`` is enforced by this daemon's storage driver."""
    info = client.info()
    driver = info.get("Driver", "")
    backing = dict(info.get("DriverStatus") or []).get("Backing Filesystem", "")
    if driver in ("btrfs", "zfs", "devicemapper", "windowsfilter"):
        return True
    return driver in ("overlay2", "overlay") and backing == "xfs"  # and mounted with pquota: tried at create


def _runner_tar() -> bytes:
    data = RUNNER.encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(RUNNER_PATH.rsplit("/", 1)[1])
        info.size, info.mode, info.uid, info.gid = len(data), 0o444, 0, 0
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@functools.cache
def _engine_ready() -> bool:
    """Whether a Docker engine answers and holds the base image (checked once per process)."""
    try:
        import docker

        return image_present(docker.from_env(timeout=5), BASE_IMAGE)
    except Exception:
        return False


class DockerSandbox(AsyncStartClose):
    """One container; use as ``async with DockerSandbox(DockerConfig(...)) as sb``."""

    Config = DockerConfig

    @staticmethod
    def usable() -> tuple[bool, str]:
        """Whether a Docker engine answers here with the base image; if not, what is missing."""
        if _engine_ready():
            return True, ""
        return False, "no Docker engine with the base image answers (start one, then `agentrl sandbox build`)"

    def __init__(self, config: DockerConfig | None = None):
        self.config = config or DockerConfig()
        self.workdir = self.config.workdir
        self.container_id: str | None = None
        self.base_commit: str | None = None
        self._client = None
        self.host: str | None = self.config.docker_host  # the daemon this sandbox runs on
        self._dead = False
        self._closed = False
        self._ids: dict[str, tuple[str, str]] = {}  # user name -> (uid, gid) in the image
        # the user's processes were all killed since the last command (a reset, a recovery): the
        # next runner does not compare the pids counter with where the last command left it
        self._pids_fresh = False
        self.disk_limit_enforced = False

    # -- plumbing --
    async def _call(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            executor(self.config.max_parallel_calls), lambda: fn(*args, **kwargs)
        )

    def _labels(self) -> dict[str, str]:
        pid = os.getpid()
        return {
            LABEL: "1",
            "agentrl.run": self.config.run or run_id(),
            "agentrl.pid": str(pid),
            "agentrl.pid_start": process_start_time(pid) or "",
            "agentrl.host": socket.gethostname(),
        }

    # -- lifecycle --
    async def start(self) -> None:
        if self.container_id is not None:
            return
        _cleanup.on_exit(_remove_live_containers)
        try:
            for attempt in range(max(1, len(self.config.hosts))):
                if self.config.hosts:
                    self.host = await self._call(pick_host, list(self.config.hosts))
                try:
                    self._client = await self._call(client_for, self.host)
                    creating = asyncio.ensure_future(self._call(self._create_and_start))
                    try:
                        await asyncio.shield(creating)
                    except asyncio.CancelledError:
                        # The create runs in a thread that cancelling cannot stop: let it finish, so
                        # that the container it may still make is known (container_id) and removed below.
                        await asyncio.gather(creating, return_exceptions=True)
                        raise
                    break
                except Exception as e:
                    # A daemon of several that went away since its last health check: left out for
                    # a while, and the sandbox starts on another.
                    if not self.config.hosts or self.container_id is not None or not _unreachable(e):
                        raise
                    mark_unhealthy(self.host, str(e))
                    release_host(self.host)
                    self.host = None
                    if attempt == len(self.config.hosts) - 1:
                        raise
            for _ in range(3):  # idempotent; retried when a loaded daemon drops the exec's output
                setup = await self.exec(WORKSPACE_SETUP, timeout=120)
                if setup.exit_code != 0 or len(setup.output.split()) >= 2:
                    break
            if setup.exit_code != 0 or len(setup.output.split()) < 2:
                raise SandboxError(
                    f"could not set up the workspace {self.workdir} in image {self.config.image} as user "
                    f"{self.config.user} (exit {setup.exit_code}): {setup.output.strip()[-500:]}. The workspace "
                    f"must exist and be writable by that user (in a Dockerfile: COPY --chown={self.config.user} ...)."
                )
        except BaseException:  # failed or cancelled half-way: no container is left behind
            await self.close()
            raise
        self.base_commit, self._git_fingerprint = setup.output.split()[:2]

    def _create_and_start(self) -> None:
        import docker

        client, cfg = self._client, self.config
        try:
            client.images.get(cfg.image)
        except docker.errors.ImageNotFound:
            hint = (
                "run `agentrl sandbox build`"
                if cfg.image == BASE_IMAGE
                else "build it first (nothing is pulled)"
            )
            raise SandboxError(f"image {cfg.image!r} does not exist on this Docker daemon; {hint}.") from None
        name = f"agentrl-{uuid.uuid4().hex[:12]}"
        kwargs: dict[str, Any] = dict(
            image=cfg.image,
            command=["sleep", "infinity"],
            name=name,
            detach=True,
            init=True,
            user="root",  # the keep-alive; commands run as cfg.user
            working_dir=cfg.workdir,
            hostname="sandbox",
            network_mode="bridge" if cfg.network else "none",
            mem_limit=cfg.memory_bytes,
            memswap_limit=cfg.memory_bytes,
            pids_limit=cfg.pids,
            nano_cpus=int(cfg.cpus * 1e9),
            security_opt=["no-new-privileges"],
            ulimits=[docker.types.Ulimit(name="fsize", soft=cfg.max_file_bytes, hard=cfg.max_file_bytes)],
            tmpfs={
                "/tmp": f"size={cfg.tmp_bytes},mode=1777",
                OUTPUT_DIR: "size=256m,mode=0700",
                RESULT_DIR: "size=256m,mode=0700",
            },
            labels=self._labels(),
            environment={
                "HOME": "/home/agent" if cfg.user == "agent" else "/root",
                "PYTHONDONTWRITEBYTECODE": "1",  # keeps __pycache__ out of the workspace diff
                "PYTHONNOUSERSITE": "1",  # nothing outside the workspace on the import path
                **cfg.env,
            },
        )
        if cfg.disk is not None and storage_supports_size(client):
            kwargs["storage_opt"] = {"size": cfg.disk}
            self.disk_limit_enforced = True
        elif cfg.disk is not None and "disk" not in _warned:
            _warned.add("disk")
            log.warning(
                "the Docker storage driver here cannot limit a container's disk use (disk=%s is not "
                "enforced); files are capped at max_file_size=%s each, /tmp at %s.",
                cfg.disk,
                cfg.max_file_size,
                cfg.tmp_size,
            )
        global _creating
        with _lock:
            _creating += 1
        try:
            container = self._create(kwargs)
            self.container_id = container.id
            with _lock:
                _live[container.id] = client
        finally:
            with _lock:
                _creating -= 1
        if _stopping:  # made while the process is being stopped: it would outlive the exit hook
            self._remove_sync()
            raise SandboxError("this process is stopping (SIGINT/SIGTERM); no sandbox was started")
        try:
            _retry(container.start)()
            # The runner lives in the container, root-owned and read-only, so the agent cannot edit it.
            _retry(client.api.put_archive)(container.id, "/", _runner_tar())
            key = (cfg.docker_host, cfg.image, cfg.user)
            code, ids = (0, _image_ids[key]) if key in _image_ids else self._control(ID_SCRIPT, cfg.user)
        except Exception as e:
            self._remove_sync()
            raise SandboxError(f"container for image {cfg.image!r} failed to start: {e}") from e
        if code != 0 or len(ids.split()) != 2:
            self._remove_sync()
            raise SandboxError(
                f"user {cfg.user!r} does not exist in image {cfg.image!r} ({ids.strip()}); "
                "set `user` to one that does (the base image has `agent`)"
            )
        self._ids[cfg.user] = tuple(ids.split())
        _image_ids[key] = ids

    def _create(self, kwargs: dict[str, Any]):
        import docker

        client = self._client

        @_retry
        def create():
            try:
                return client.containers.create(**kwargs)
            except docker.errors.APIError as e:
                if e.status_code == 409:  # an earlier attempt did create it before the connection dropped
                    return client.containers.get(kwargs["name"])
                if e.status_code == 400 or "invalid" in str(e).lower():
                    raise SandboxError(f"Docker refused the sandbox settings: {e.explanation or e}") from e
                raise

        try:
            return create()
        except docker.errors.APIError as e:
            if "storage_opt" in kwargs and "storage" in str(e).lower():
                # Supported driver, but not on this filesystem (e.g. xfs without pquota).
                kwargs.pop("storage_opt")
                self.disk_limit_enforced = False
                return create()
            raise

    def _remove_sync(self) -> None:
        cid = self.container_id
        if cid is None:
            return
        with _lock:
            _live.pop(cid, None)
        try:
            _retry(self._client.api.remove_container)(cid, force=True, v=True)
        except Exception as e:
            if getattr(e, "status_code", None) != 404:
                log.warning(
                    "could not remove sandbox container %s: %s (agentrl sandbox gc will)", cid[:12], e
                )

    async def close(self) -> None:
        """Remove the container. Idempotent; completes even when the calling task is cancelled."""
        if self._closed:
            return
        self._closed = True
        if self.config.hosts and self.host is not None:
            release_host(self.host)
        if self.container_id is None:
            return
        task = asyncio.ensure_future(self._call(self._remove_sync))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            await task
            raise

    async def alive(self) -> bool:
        if self._dead or self.container_id is None or self._closed:
            return False
        try:
            state = await self._call(_retry(self._client.api.inspect_container), self.container_id)
        except Exception:
            self._dead = True
            return False
        if not state["State"]["Running"]:
            self._dead = True
        return not self._dead

    async def oom_killed_container(self) -> bool:
        state = await self._call(self._client.api.inspect_container, self.container_id)
        return bool(state["State"].get("OOMKilled"))

    # -- commands --
    def _require_running(self) -> None:
        if self.container_id is None or self._closed:
            raise SandboxError(
                "the sandbox is not started (use `async with make_sandbox(...) as sb`) or already closed"
            )
        if self._dead:
            raise SandboxDied(f"sandbox {self.container_id[:12]} is dead; create a fresh one")

    async def exec(
        self,
        cmd: str,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        *,
        user: str | None = None,
        output_cap: int | None = None,
    ) -> ExecResult:
        """Run ``cmd`` with bash in the workspace (or ``cwd``); never raises for a failing command."""
        check_command(cmd, timeout)
        if self._dead and not self._closed:
            return ExecResult(-1, "", sandbox_died=True)
        self._require_running()
        timeout = float(timeout or self.config.timeout)
        cap = output_cap or self.config.output_cap
        # The trailer's secret goes in the environment, which the command cannot read; the tag, in the
        # arguments, names the runner's files and process.
        tag, nonce = uuid.uuid4().hex, secrets.token_hex(16)
        uid, gid = await self._user_ids(user or self.config.user)
        # a long command in pieces of one argument each; the runner joins them
        pieces = [cmd[i : i + ARGUMENT_CHARS] for i in range(0, len(cmd), ARGUMENT_CHARS)] or [""]
        fresh = self._pids_fresh
        argv = [
            "bash",
            RUNNER_PATH,
            f"{timeout:.3f}",
            str(cap),
            tag,
            OUTPUT_DIR,
            uid,
            gid,
            RESULT_DIR,
            "1" if fresh else "0",
            *pieces,
        ]
        workdir = self._inside(cwd) if cwd else self.workdir
        start = time.perf_counter()
        api = self._client.api
        try:
            exec_id = await self._call(
                _retry(api.exec_create),
                self.container_id,
                argv,
                user="root",  # the runner; it runs the command itself as uid:gid
                workdir=workdir,
                environment={**(env or {}), "AGENTRL_TRAILER": nonce},
            )
        except Exception as e:
            return await self._failed_to_start(e, start)
        future = asyncio.ensure_future(self._call(api.exec_start, exec_id["Id"]))
        try:
            raw = await within(asyncio.shield(future), timeout + self.config.grace)
        except TimeoutError:
            # The runner did not come back: the sandbox is wedged (frozen, daemon hung).
            await self._call(self._kill_wedged)
            return ExecResult(
                -1, "", timed_out=True, sandbox_died=True, duration_s=time.perf_counter() - start
            )
        except asyncio.CancelledError:
            await asyncio.shield(self._call(self._cancel_command, tag))
            raise
        except Exception as e:
            return await self._failed_to_start(e, start)
        if fresh:  # the runner has run: it left the counter for the next one
            self._pids_fresh = False
        if raw.rfind(b"\n" + nonce.encode() + b" ") < 0 and await self.alive():
            raw = await self._call(self._recover_output, tag, nonce) or raw
        return await self._parse(raw, nonce, cap, exec_id["Id"], start)

    async def _user_ids(self, user: str) -> tuple[str, str]:
        if user not in self._ids:
            code, ids = await self._call(self._control, ID_SCRIPT, user)
            if code != 0 or len(ids.split()) != 2:
                raise SandboxError(f"user {user!r} does not exist in image {self.config.image!r}")
            self._ids[user] = tuple(ids.split())
        return self._ids[user]

    async def _failed_to_start(self, error: Exception, start: float) -> ExecResult:
        """The daemon could not run the command: a dead sandbox, or one out of processes (fork bomb)."""
        if await self.alive() and await self._call(self._recover_from_fork_bomb):
            return self._fork_bomb_result(start)
        alive = await self.alive()
        message = "" if not alive else f"agentrl: the sandbox could not start the command: {error}"
        return ExecResult(
            -1 if not alive else 126, message, sandbox_died=not alive, duration_s=time.perf_counter() - start
        )

    @staticmethod
    def _fork_bomb_result(start: float) -> ExecResult:
        return ExecResult(137, "", pids_exhausted=True, duration_s=time.perf_counter() - start)

    async def _parse(self, raw: bytes, nonce: str, cap: int, exec_id: str, start: float) -> ExecResult:
        marker = b"\n" + nonce.encode() + b" "
        at = raw.rfind(marker)
        if at < 0:
            # The runner did not finish: the container died, or it is out of processes and could not
            # start the runner at all. Docker marks a container exited a moment after its init does.
            await asyncio.sleep(0.25)
            alive = await self.alive()
            if alive and await self._call(self._recover_from_fork_bomb):
                return self._fork_bomb_result(start)
            code = -1
            if alive:
                info = await self._call(self._client.api.exec_inspect, exec_id)
                code = info.get("ExitCode") if info.get("ExitCode") is not None else -1
            text, truncated = cut_output(raw, cap)
            if alive and code == 0:
                # The runner always ends with its trailer unless killed, and a killed runner does not
                # exit 0: the daemon lost the stream and the read-back failed, or the runner could not
                # write its result (a background process filling the output space). The command's
                # exit code is unknown: not 0.
                log.warning("sandbox %s: the result of a command was lost", self.container_id[:12])
                code = 125
                text += (
                    "\n[agentrl: the command's result was lost: its exit code is unknown. A process "
                    "left writing output without end fills the sandbox's output space; kill it]"
                )
            return ExecResult(
                code,
                text,
                truncated=truncated,
                sandbox_died=not alive,
                duration_s=time.perf_counter() - start,
            )
        fields = [int(x) for x in raw[at + len(marker) :].split()[:5]]
        rc, timed_out, oom, size, pids = (fields + [0])[:5]
        body = raw[:at]
        truncated = size > cap
        if truncated:  # the runner sent only the head and the tail
            text = join_cut(body[: cap // 2], body[cap // 2 :], size)
        else:
            text = body.decode("utf-8", errors="replace")
        died = False
        if oom:
            died = not await self.alive()  # the OOM killer may have taken the keep-alive too
        return ExecResult(
            exit_code=-1 if died else rc,
            output=text,
            timed_out=bool(timed_out),
            truncated=truncated,
            oom_killed=bool(oom),
            pids_exhausted=bool(pids),
            killed=rc == 137 and not (timed_out or oom or pids or died),
            sandbox_died=died,
            duration_s=time.perf_counter() - start,
        )

    def _recover_from_fork_bomb(self) -> bool:
        """When the container is at its pids limit, kill every process of the sandbox's users.

        With no process left to fork, not even a root exec can start, so the limit is raised for the
        moment it takes to stop and kill them, then set back. Returns whether it was at the limit.
        """
        api = self._client.api
        try:
            pids = api.stats(self.container_id, stream=False, one_shot=True).get("pids_stats") or {}
        except Exception:
            return False
        limit, current = pids.get("limit") or 0, pids.get("current") or 0
        if not limit or current < limit - 1:
            return False
        log.warning(
            "sandbox %s: at its pids limit (%d); killing the agent's processes", self.container_id[:12], limit
        )
        users = sorted({uid for uid, _ in self._ids.values() if uid != "0"})
        script = (
            'for i in 1 2 3 4 5 6 7 8; do for u in "$@"; do pkill -STOP -u "$u"; done; done; '
            'for i in 1 2 3 4 5 6 7 8; do for u in "$@"; do pkill -KILL -u "$u"; done; done; true'
        )
        url = api._url("/containers/{0}/update", self.container_id)
        try:
            api._raise_for_status(api._post_json(url, data={"PidsLimit": limit + 64}))
            self._control(script, *users)
            self._pids_fresh = True  # this call reports the bomb: the next command need not
        except Exception as e:
            log.warning("sandbox %s: could not recover from its fork bomb: %s", self.container_id[:12], e)
            self._kill_wedged()
        finally:
            with contextlib.suppress(Exception):
                api._post_json(url, data={"PidsLimit": limit})
        return True

    def _control(self, script: str, *args: str, user: str = "root") -> tuple[int, str]:
        """Run a control script directly (not through the runner); blocking. Returns (exit code, output)."""
        api = self._client.api
        exec_id = _retry(api.exec_create)(
            self.container_id, ["bash", "-c", script, "agentrl", *args], user=user
        )["Id"]
        output = api.exec_start(exec_id).decode("utf-8", errors="replace")
        return api.exec_inspect(exec_id)["ExitCode"], output

    def _recover_output(self, tag: str, nonce: str) -> bytes | None:
        """Read back a result the daemon's stream dropped (the runner keeps a copy); None if absent."""
        for _ in range(3):
            try:
                api = self._client.api
                exec_id = _retry(api.exec_create)(
                    self.container_id, ["cat", f"{RESULT_DIR}/{tag}.result"], user="root"
                )
                data = api.exec_start(exec_id["Id"])
            except Exception:
                return None
            if data.rfind(b"\n" + nonce.encode() + b" ") >= 0:
                log.info(
                    "sandbox %s: read back a command result the daemon's stream dropped",
                    self.container_id[:12],
                )
                return data
        return None

    def _cancel_command(self, tag: str) -> None:
        """Stop a cancelled command: its runner, sent SIGTERM, kills everything the command started.

        Returns once the runner is gone. Under load a cancel was seen to miss about once in 100 (32
        sandboxes on 2 cores): the runner had not started yet when it was signalled, or the signal was
        lost. So the cancel first leaves a mark that a runner starting later finds, then signals the
        runner again until none is left (the runner ignores the repeats while it cleans up)."""
        pattern = f"^bash {RUNNER_PATH} [^ ]+ [^ ]+ {tag} "
        script = (
            ': > "$2"; for i in $(seq 200); do pkill -TERM -u 0 -f "$1" || exit 0; sleep 0.05; done; exit 1'
        )
        try:
            code, _ = self._control(script, pattern, f"{RESULT_DIR}/{tag}.cancel")
        except Exception as e:
            log.warning("sandbox %s: could not cancel a command: %s", self.container_id[:12], e)
            return
        if code != 0:
            log.warning(
                "sandbox %s: a cancelled command's runner is still there after 10 s", self.container_id[:12]
            )

    def _kill_wedged(self) -> None:
        self._dead = True
        with contextlib.suppress(Exception):
            self._client.api.kill(self.container_id)

    # -- files --
    def _path(self, path: str) -> PurePosixPath:
        p = PurePosixPath(path)
        return p if p.is_absolute() else PurePosixPath(self.workdir) / p

    def _inside(self, path: str) -> str:
        """``path`` (relative to the workspace, or absolute) normalised; outside it is refused. For
        the caller's own paths (a command's ``cwd``): agents' paths are resolved in the container."""
        target = posixpath.normpath(str(self._path(path)))
        if not PurePosixPath(target).is_relative_to(self.workdir):
            raise PermissionError(
                f"{path!r} resolves to {target}, outside the workspace {self.workdir}; "
                "paths must stay inside it (no '..')"
            )
        return target

    def _file_op(self, op: str, path: str, *args: str) -> bytes:
        """Run one ``FILE_OPS`` operation as the sandbox's user; blocking. Returns its stdout."""
        import docker

        api = self._client.api
        argv = ["timeout", "-s", "KILL", str(FILE_OP_TIMEOUT), "bash", "-c", FILE_OPS, "agentrl", op]
        try:
            exec_id = _retry(api.exec_create)(
                self.container_id, [*argv, self.workdir, path, *args], user=self.config.user
            )["Id"]
            stdout, stderr = api.exec_start(exec_id, demux=True)
            code = api.exec_inspect(exec_id)["ExitCode"]
        except docker.errors.APIError:
            self._out_of_processes(op, path)
            raise
        if code not in FILE_OP_CODES:  # not FILE_OPS's own answer: it may not have started at all
            self._out_of_processes(op, path)
        error = file_op_error(code, op, path, self.workdir, stdout or b"", stderr or b"")
        if error is not None:
            raise error
        return stdout or b""

    def _out_of_processes(self, op: str, path: str) -> None:
        """After a file operation failed: when the container was at its pids limit (a fork bomb left
        running between two commands), kill the agent's processes, as the next command would, and
        tell the agent so."""
        if self._recover_from_fork_bomb():
            what = "read" if op == "read" else "write"
            raise PermissionError(
                f"cannot {what} {path}: the sandbox had run out of processes (a fork bomb left running "
                "in the background); every process the agent started was killed. Try again"
            )

    async def read_file(self, path: str) -> bytes:
        """The bytes of a file inside the workspace, read as the sandbox's user."""
        self._require_running()
        return await self._call(self._file_op, "read", path)

    async def write_file(self, path: str, data: bytes | str) -> None:
        """Write a file inside the workspace as the sandbox's user (parents made, mode kept if it exists)."""
        self._require_running()
        payload = to_bytes(data)
        for at in range(0, max(len(payload), 1), WRITE_CHUNK):
            chunk = base64.b64encode(payload[at : at + WRITE_CHUNK]).decode()
            await self._call(self._file_op, "write" if at == 0 else "append", path, chunk)

    async def _ensure_dir(self, directory: PurePosixPath) -> None:
        result = await self.exec(f"mkdir -p -- '{directory}'", timeout=30)
        if result.exit_code != 0:
            raise PermissionError(f"cannot create {directory} in the sandbox: {result.output.strip()}")

    async def upload(self, local_path: str, dest: str) -> None:
        """Copy a local file or directory to ``dest`` (its new path) in the sandbox, owned by the user.

        For the environment's own files (a task's tree, before the agent starts): it goes through
        Docker's archive API, as root, which agents' file operations never do."""
        self._require_running()
        source = Path(local_path)
        if not source.exists():
            raise FileNotFoundError(f"upload source {source} does not exist")
        target = self._path(dest)
        if target != PurePosixPath(self.workdir):  # the workspace's parent exists
            await self._ensure_dir(target.parent)
        uid = AGENT_UID if self.config.user == "agent" else 0

        def owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
            info.uid = info.gid = uid
            info.uname = info.gname = ""
            return info

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(str(source), arcname=target.name, filter=owned)
        await self._call(
            _retry(self._client.api.put_archive), self.container_id, str(target.parent), buf.getvalue()
        )

    async def diff(self, base: str | None = None) -> str:
        """``git diff`` of the workspace against ``base`` (default: the workspace at start), untracked files included."""
        return await read_diff(self, base or self.base_commit)

    async def reset(self) -> bool:
        """Bring a used sandbox back to its state at start; False when it cannot be trusted to be.

        Kills every process of the user, empties ``/tmp`` and the home directory, and restores the
        workspace to the start commit (tracked and untracked files); then checks that HEAD, a clean
        status and the git config and hooks are as they were at start.
        """
        if not await self.alive():
            return False
        # kill(-1): every process of the user but this shell, in one step of the kernel's (a process
        # that keeps forking moves to a new pid faster than a pass over /proc), until none is left
        # (as root it would take the keep-alive down: a pass over /proc then, as before)
        kill = (
            'if [ "$(id -u)" != 0 ]; then for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16; do '
            "kill -9 -1 2>/dev/null || break; sleep 0.02; done; else for p in /proc/[0-9]*; do "
            '[ "${p#/proc/}" != $$ ] && [ "${p#/proc/}" != 1 ] && kill -9 "${p#/proc/}" 2>/dev/null; done; fi; '
        )
        script = (
            kill
            # every place the user may write outside the workspace; odd names and modes too
            + 'for d in /tmp /var/tmp /dev/shm /run/lock "$HOME"; do chmod -R u+rwx "$d" 2>/dev/null; '
            'find "$d" -mindepth 1 -delete 2>/dev/null; done; '
            + 'cd "$1" && BASE="$2" && '
            + GIT_RESET
            + "; rc=$?; "
            + kill  # whatever the git steps may still have started
            + "exit $rc"
        )
        try:  # bounded: a reset that hangs (a FIFO the agent left) means the sandbox is replaced
            code, output = await within(
                self._call(self._control, script, self.workdir, self.base_commit, user=self.config.user), 120
            )
        except Exception:
            return False
        # a bomb of the last user, killed by the reset, is not reported to the next one
        self._pids_fresh = True
        return code == 0 and output.split()[:2] == [self.base_commit, self._git_fingerprint]


def gc(
    *, everything: bool = False, run: str | None = None, docker_host: str | None = None
) -> list[tuple[str, str]]:
    """Remove agentrl sandbox containers whose creating process is gone.

    A container is removed when it was made on this host and its creating process (pid and start
    time, from its labels) no longer runs; with ``run``, every container of that run id; with
    ``everything``, every agentrl sandbox container. Returns ``(short id, reason)`` per removal.
    """
    client = client_for(docker_host)
    host = socket.gethostname()
    removed = []
    # One list call, no per-container inspect: containers that come and go meanwhile are just gone.
    for c in client.api.containers(all=True, filters={"label": f"{LABEL}=1"}):
        labels = c.get("Labels") or {}
        if everything:
            reason = "--all"
        elif run is not None:
            if labels.get("agentrl.run") != run:
                continue
            reason = f"run {run}"
        elif labels.get("agentrl.host", host) != host:
            continue  # made on another machine: its process cannot be checked from here
        else:
            pid = int(labels.get("agentrl.pid", "0") or 0)
            started = process_start_time(pid) if pid else None
            if started is not None and started == labels.get("agentrl.pid_start", started):
                continue  # its creator still runs
            reason = f"creating process {pid} is gone"
        try:
            client.api.remove_container(c["Id"], force=True, v=True)
            removed.append((c["Id"][:12], reason))
        except Exception as e:
            # 404: removed meanwhile (by its own sandbox, or another gc); 409: a removal is under way
            if getattr(e, "status_code", None) not in (404, 409):
                raise
    return removed


def doctor(docker_host: str | None = None, image: str = BASE_IMAGE) -> list[tuple[str, bool, str]]:
    """What works on this machine: ``(check, ok, detail or the command that fixes it)``."""
    checks: list[tuple[str, bool, str]] = []
    try:
        client = client_for(docker_host)
    except SandboxError as e:
        if not shutil.which("dockerd"):
            fix = "apt-get install -y docker.io && dockerd > /tmp/dockerd.log 2>&1 &"
        else:
            fix = "dockerd > /tmp/dockerd.log 2>&1 &  (as root; or systemctl start docker)"
        checks.append(("docker daemon", False, f"{str(e).split(';')[0]}. Fix: {fix}"))
        return checks
    version = client.version()
    checks.append(
        ("docker daemon", True, f"engine {version.get('Version')}, API {version.get('ApiVersion')}")
    )
    # The test the docker backend itself makes (``image_present``): a base image built by an older
    # recipe is there but not used, and ``agentrl sandbox build`` replaces it.
    present = image_present(client, image)
    if present:
        detail = "present"
    elif client.images.list(name=image):
        detail = "built by an older recipe, so the docker backend does not use it. Fix: agentrl sandbox build"
    else:
        detail = "missing. Fix: agentrl sandbox build"
    checks.append((f"image {image}", present, detail))
    supports = storage_supports_size(client)
    driver = client.info().get("Driver")
    checks.append(
        (
            "disk limit",
            supports,
            f"storage driver {driver} enforces `disk`"
            if supports
            else f"storage driver {driver} cannot limit a container's disk use; files are capped by max_file_size, /tmp is a sized tmpfs",
        )
    )
    return checks
