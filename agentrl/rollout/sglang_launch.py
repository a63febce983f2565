"""``agentrl serve sglang``: start SGLang servers (and, for several, ``sglang_router`` in front of them),
wait until they generate, keep them running, and stop every process they started on exit or signal.

    agentrl serve sglang --model PATH [--tp N] [--dp N] [--servers K] [--port P]

One server: ``python -m sglang.launch_server`` on ``P``. K > 1 servers: each on ``P + 1 + i`` with
its own GPUs (``--base-gpu-id i * tp * dp``), and the router on ``P``
(``python -m sglang_router.launch_router --worker-urls ...``); a run then sets
``engine.url=http://HOST:P`` and, since the router forwards neither aborts nor weight updates,
``engine.abort_urls`` to the workers' URLs (printed at start). Each process writes its log to
``LOG_DIR/<name>.log``; each runs in a process group of its own, so that stopping it stops whatever
it started (SGLang's scheduler and detokenizer processes).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit


@dataclass
class Process:
    name: str
    argv: list[str]
    url: str
    health: str
    """The path that answers 200 once this process serves (``/health_generate``: a real generation)."""
    popen: subprocess.Popen | None = field(default=None, repr=False)


def sglang_plan(
    model: str,
    *,
    tp: int = 1,
    dp: int = 1,
    servers: int = 1,
    host: str = "127.0.0.1",
    port: int = 30000,
    python: str = sys.executable,
    extra: list[str] | None = None,
) -> list[Process]:
    """The processes of ``agentrl serve sglang``, servers first, the router (K > 1) last."""
    for name, value in (("--tp", tp), ("--dp", dp), ("--servers", servers)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1; got {value}")
    plan = []
    for i in range(servers):
        p = port if servers == 1 else port + 1 + i
        argv = [python, "-m", "sglang.launch_server", "--model-path", model, "--host", host, "--port", str(p)]
        argv += ["--tp-size", str(tp), "--dp-size", str(dp), "--base-gpu-id", str(i * tp * dp)]
        plan.append(
            Process(f"sglang-{i}", argv + list(extra or []), f"http://{host}:{p}", "/health_generate")
        )
    if servers > 1:
        workers = [s.url for s in plan]
        argv = [python, "-m", "sglang_router.launch_router", "--worker-urls", *workers]
        argv += ["--host", host, "--port", str(port), "--policy", "cache_aware"]
        plan.append(Process("router", argv, f"http://{host}:{port}", "/health"))
    return plan


def local_plan(
    model: str, *, host: str = "127.0.0.1", port: int = 30000, python: str = sys.executable
) -> list[Process]:
    """``agentrl serve local`` as the one server (``engine.launch.server: local``)."""
    argv = [
        python,
        "-m",
        "agentrl.cli",
        "serve",
        "local",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
    ]
    return [Process("serve-local", argv, f"http://{host}:{port}", "/health_generate")]


class Launcher:
    """Starts ``plan``'s processes (logs under ``log_dir``), waits for each to serve, stops them all."""

    def __init__(self, plan: list[Process], log_dir: str | Path):
        self.plan, self.log_dir = plan, Path(log_dir)

    def start(self, timeout_s: float) -> None:
        """Start the servers, wait for each to serve, then the router (it routes only to servers
        that answer), all within ``timeout_s``; ``RuntimeError`` naming the process and its log
        when one exits or does not answer in time, or naming the port when one is taken before any
        starts (what answers there is not ours, and ours would die on it)."""
        for proc in self.plan:
            _check_port_free(proc)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout_s
        servers = [p for p in self.plan if p.name != "router"]
        routers = [p for p in self.plan if p.name == "router"]
        for group in (servers, routers):
            for proc in group:
                with open(self.log_dir / f"{proc.name}.log", "ab") as log:
                    proc.popen = subprocess.Popen(
                        proc.argv,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,  # its own process group: stop() reaches its children
                    )
            for proc in group:
                self._wait(proc, deadline, timeout_s)

    def _wait(self, proc: Process, deadline: float, timeout_s: float) -> None:
        log = self.log_dir / f"{proc.name}.log"
        while True:
            self._check_running(proc, log)
            try:
                with urllib.request.urlopen(proc.url + proc.health, timeout=30) as r:
                    if r.status == 200:
                        self._check_running(proc, log)  # the answer came from our process
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{proc.name} did not answer {proc.url}{proc.health} in {timeout_s:g}s; see {log}"
                )
            time.sleep(1.0)

    @staticmethod
    def _check_running(proc: Process, log: Path) -> None:
        code = proc.popen.poll()
        if code is not None:
            raise RuntimeError(
                f"{proc.name} exited with status {code} before serving; see {log}:\n{_tail(log)}"
            )

    def wait(self) -> int:
        """Block until a process exits; its status (the others are then stopped by ``stop``)."""
        while True:
            for proc in self.plan:
                if proc.popen is not None and proc.popen.poll() is not None:
                    return proc.popen.returncode
            time.sleep(0.5)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to each process group, SIGKILL to those still there after ``grace_s``."""
        started = [p for p in reversed(self.plan) if p.popen is not None]
        for proc in started:
            _signal_group(proc.popen, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in started:
            try:
                proc.popen.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                _signal_group(proc.popen, signal.SIGKILL)
                proc.popen.wait()
            _signal_group(proc.popen, signal.SIGKILL)  # children the leader left behind


def bind_error(host: str, port: int) -> OSError | None:
    """What a server binding ``host:port`` would meet now (a ``socket.gaierror`` for a host that does
    not resolve), or None where it can listen (the probe lets the port go again)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        return e
    with socket.socket(family, kind, proto) as probe:
        # as servers bind: TIME_WAIT is no obstacle
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            return e
    return None


def _check_port_free(proc: Process) -> None:
    """``RuntimeError`` naming ``proc``'s port when something listens there already."""
    url = urlsplit(proc.url)
    error = bind_error(url.hostname, url.port)
    # anything else (a privileged port, an address of another host) is not ours to judge: the server tells
    if error is not None and error.errno == errno.EADDRINUSE:
        raise RuntimeError(
            f"{proc.name}: port {url.port} on {url.hostname} is already in use (another server still "
            f"running?); stop what listens there, or choose another port (--port, engine.launch.port)"
        )


def _tail(log: Path, lines: int = 20) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return "  (no log)"
    return "\n".join(f"  {line}" for line in text)


def _signal_group(popen: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, signum)


def main(plan: list[Process], log_dir: str, timeout_s: float, out=print) -> int:
    """Start ``plan``, report where it serves, hold until a process exits or a signal comes, stop all."""
    launcher = Launcher(plan, log_dir)
    try:
        launcher.start(timeout_s)
        workers = [p.url for p in plan if p.name != "router"]
        out(f"serving on {plan[-1].url} (logs in {log_dir}); engine.kind=sglang engine.url={plan[-1].url}")
        if len(workers) > 1:
            out(f"  behind the router: engine.abort_urls=[{','.join(workers)}]")
        return launcher.wait()
    finally:
        launcher.stop()
