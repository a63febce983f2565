"""Containers and local workspaces and cgroups are removed on SIGTERM/SIGINT; after kill -9,
`agentrl sandbox gc` removes them."""

import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from agentrl.cli import main
from tests.conftest import require_docker

CHILD = """
import asyncio, signal, sys
from agentrl.sandbox import make_sandbox
# a child of a background job inherits SIGINT ignored (and then keeps it ignored): restore Python's own
signal.signal(signal.SIGINT, signal.default_int_handler)
async def go():
    async with make_sandbox(sys.argv[1], memory="256m") as sb:
        await sb.exec("echo started", timeout=10)
        print("ready", getattr(sb, "workdir", ""), flush=True)
        await sb.exec("sleep 600", timeout=600)  # mid-episode when the signal comes
asyncio.run(go())
"""


def containers_of(pid: int):
    import docker

    return docker.from_env().containers.list(
        all=True, filters={"label": ["agentrl.sandbox=1", f"agentrl.pid={pid}"]}
    )


def start_child():
    child = subprocess.Popen([sys.executable, "-c", CHILD, "docker"], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().split()[0] == "ready"
    assert len(containers_of(child.pid)) == 1
    return child


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_removes_the_containers(signum):
    require_docker()
    child = start_child()
    child.send_signal(signum)
    child.wait(timeout=60)  # removing the container takes seconds, more on a loaded machine
    assert containers_of(child.pid) == []


def cgroups_of(pid: int) -> list:
    from agentrl.sandboxes.local import CGROUP_ROOTS

    return [d for root in CGROUP_ROOTS if root.is_dir() for d in root.glob(f"agentrl-{pid}-*")]


def start_local_child():
    child = subprocess.Popen([sys.executable, "-c", CHILD, "local"], stdout=subprocess.PIPE, text=True)
    ready, workdir = child.stdout.readline().split()
    if not (ready == "ready" and os.path.isdir(workdir) and f"agentrl-ws-{child.pid}-" in workdir):
        child.kill()
        pytest.fail(f"the child did not start its sandbox as expected: {ready} {workdir}")
    return child, workdir


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_removes_the_local_workspace_and_cgroup(signum):
    from agentrl.sandboxes.local import Cgroup

    child, workdir = start_local_child()
    made = cgroups_of(child.pid)  # none where this process may not make cgroups
    probe = Cgroup.create(8, 1 << 20)
    if probe is not None:
        probe.remove()
        assert made, "a cgroup could be made here, but the sandbox has none"
    child.send_signal(signum)
    child.wait(timeout=60)
    left = {str(d): (d / "cgroup.procs").read_text().split() for d in cgroups_of(child.pid)}
    assert not os.path.exists(workdir) and not left, (os.path.exists(workdir), left, child.returncode)


def test_kill_9_then_gc_removes_the_local_workspace_and_cgroup(capsys):
    child, workdir = start_local_child()
    made = cgroups_of(child.pid)
    child.kill()
    child.wait(timeout=30)
    assert os.path.isdir(workdir) and cgroups_of(child.pid) == made  # nothing in the process could run
    main(["sandbox", "gc"])  # whether or not a Docker daemon answers, the local leftovers go
    out = capsys.readouterr().out
    assert f"removed {workdir} (its process {child.pid} is gone)" in out
    assert not os.path.exists(workdir) and cgroups_of(child.pid) == []


def test_kill_9_then_gc_leaves_nothing(capsys):
    require_docker()
    child = start_child()
    child.kill()
    child.wait(timeout=30)
    time.sleep(0.2)
    assert len(containers_of(child.pid)) == 1  # nothing in the process could run
    assert main(["sandbox", "gc"]) == 0
    assert "creating process" in capsys.readouterr().out
    assert containers_of(child.pid) == []


def test_gc_keeps_containers_of_live_processes():
    require_docker()
    child = start_child()
    try:
        assert main(["sandbox", "gc"]) == 0
        assert len(containers_of(child.pid)) == 1
    finally:
        child.terminate()
        child.wait(timeout=30)
    assert containers_of(child.pid) == []


def test_only_transient_daemon_errors_are_retried():
    import docker

    from agentrl.sandboxes.docker import _retry, _transient

    assert _transient(requests.exceptions.ConnectionError("reset by peer"))
    assert _transient(docker.errors.APIError("boom", response=type("R", (), {"status_code": 502})()))
    assert not _transient(docker.errors.APIError("no", response=type("R", (), {"status_code": 409})()))
    assert not _transient(docker.errors.ImageNotFound("nope"))
    calls = []

    @_retry
    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise requests.exceptions.ConnectionError("connection reset")
        return "ok"

    assert flaky() == "ok" and len(calls) == 3


def test_gc_with_no_daemon_is_one_error_line(capsys):
    assert main(["sandbox", "gc", "--host", "unix:///nonexistent/docker.sock"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("error: cannot reach the Docker daemon (unix:///nonexistent/docker.sock)")


def test_doctor_reports_each_backend(capsys):
    assert main(["sandbox", "doctor"]) == 0
    out = capsys.readouterr().out
    assert "docker daemon" in out and "local backend: usable" in out


def test_doctor_exits_1_where_no_backend_isolates_commands(monkeypatch, capsys):
    import agentrl.sandboxes.docker
    import agentrl.sandboxes.local

    monkeypatch.setattr(
        agentrl.sandboxes.docker, "doctor", lambda docker_host=None: [("docker daemon", False, "x")]
    )
    monkeypatch.setattr(agentrl.sandboxes.local, "bwrap_works", lambda: (False, "no user namespaces"))
    assert main(["sandbox", "doctor"]) == 1
    assert "docker backend: not usable here; local backend: only unisolated" in capsys.readouterr().out


def test_doctor_fails_a_base_image_of_an_older_recipe(monkeypatch):
    # `sandbox.kind: auto` (image_present) passes over such an image: the doctor must not call it fine.
    require_docker()
    from agentrl.sandboxes import images
    from agentrl.sandboxes.docker import doctor

    assert ("image agentrl/base:bookworm", True, "present") in doctor()
    monkeypatch.setattr(images, "BASE_VERSION", images.BASE_VERSION + "-newer")
    name, ok, detail = doctor()[1]
    assert name == "image agentrl/base:bookworm" and not ok
    assert detail.startswith("built by an older recipe") and detail.endswith("Fix: agentrl sandbox build")
