"""Sandboxes spread over several Docker daemons (sandbox.docker.hosts), tested with a second dockerd
on this machine (its own socket, data root and exec root): the least-loaded daemon takes each new
sandbox, a daemon that stops answering is skipped and taken again once it answers, and
`agentrl sandbox gc` / `doctor` cover every host."""

import asyncio
import os
import shutil
import signal
import subprocess
import time

import pytest

from agentrl.cli import main
from agentrl.sandbox import make_sandbox
from agentrl.sandboxes import docker as docker_backend
from agentrl.sandboxes.images import BASE_IMAGE
from tests.conftest import require_docker

ROOT = "/var/lib/agentrl-test-dockerd2"
SOCKET = f"unix://{ROOT}/docker.sock"
# A bridge of its own: a daemon started with --bridge=none deletes the host's docker0, which the
# first daemon's builds and bridged containers need.
BRIDGE = "agentrl-br2"


def _bridge() -> None:
    if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode == 0:
        return
    for command in (
        ["ip", "link", "add", BRIDGE, "type", "bridge"],
        ["ip", "addr", "add", "172.31.250.1/24", "dev", BRIDGE],
        ["ip", "link", "set", BRIDGE, "up"],
    ):
        subprocess.run(command, check=True, capture_output=True)


def _start_second_daemon() -> subprocess.Popen:
    os.makedirs(ROOT, exist_ok=True)
    _bridge()
    log = open(f"{ROOT}/dockerd.log", "ab")  # noqa: SIM115 - the daemon writes it while it runs
    daemon = subprocess.Popen(
        [
            "dockerd",
            f"--host={SOCKET}",
            f"--data-root={ROOT}/data",
            f"--exec-root={ROOT}/exec",
            f"--pidfile={ROOT}/docker.pid",
            f"--bridge={BRIDGE}",
            "--iptables=false",
            "--ip6tables=false",
        ],
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    import docker

    for _ in range(120):
        try:
            docker.DockerClient(base_url=SOCKET, timeout=5).ping()
            return daemon
        except Exception:
            if daemon.poll() is not None:
                break
            time.sleep(0.5)
    daemon.kill()
    pytest.skip(f"a second dockerd did not start here (see {ROOT}/dockerd.log)")


def _stop(daemon: subprocess.Popen) -> None:
    daemon.send_signal(signal.SIGTERM)
    try:
        daemon.wait(30)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()


@pytest.fixture(scope="module")
def two_hosts():
    require_docker()
    if os.geteuid() != 0 or not shutil.which("dockerd") or not shutil.which("ip"):
        pytest.skip("a second Docker daemon needs root, dockerd and ip (iproute2)")
    import docker

    first = docker.from_env().api.base_url
    first = (
        "unix:///var/run/docker.sock" if "docker.sock" in first or first.startswith("http+docker") else first
    )
    daemon = _start_second_daemon()
    second = docker.DockerClient(base_url=SOCKET, timeout=300)
    if not second.images.list(name=BASE_IMAGE):  # the base image, copied over (no registry)
        image = docker.from_env(timeout=300).images.get(BASE_IMAGE)
        (loaded,) = second.images.load(b"".join(image.save(named=True)))
        loaded.tag(*BASE_IMAGE.split(":"))
    state = {"daemon": daemon}
    yield [first, SOCKET], state
    _stop(state["daemon"])
    shutil.rmtree(ROOT, ignore_errors=True)
    subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True)


def test_sandboxes_spread_over_hosts_and_skip_a_dead_one(two_hosts, monkeypatch, capsys):
    hosts, state = two_hosts
    monkeypatch.setattr(docker_backend, "HOST_CHECK", 0.0)  # every pick checks health
    monkeypatch.setattr(docker_backend, "HOST_RETRY", 2.0)

    async def start(n):
        boxes = [make_sandbox("docker", hosts=hosts) for _ in range(n)]
        await asyncio.gather(*(b.start() for b in boxes))
        outputs = await asyncio.gather(*(b.exec("echo ok") for b in boxes))
        assert all(o.output.strip() == "ok" for o in outputs)
        return boxes

    async def close(boxes):
        await asyncio.gather(*(b.close() for b in boxes))

    def why():  # what each daemon answered last, and the second daemon's own log, for a failure
        with open(f"{ROOT}/dockerd.log", "rb") as log:
            tail = log.read()[-3000:].decode(errors="replace")
        return f"health: {docker_backend._host_state}; second dockerd log tail:\n{tail}"

    async def scenario():
        opened = []
        try:
            # A fresh daemon's first container sets up its bridge network: done once here, so that a
            # slow first create under the full suite's load is not what the spread below measures.
            async with make_sandbox("docker", docker_host=hosts[1]):
                pass
            boxes = await start(4)
            opened += boxes
            placed = sorted(b.host for b in boxes)
            assert placed == sorted([hosts[0], hosts[1]] * 2), why()  # least loaded first
            await close(boxes)
            _stop(state["daemon"])
            boxes = await start(3)
            opened += boxes
            assert {b.host for b in boxes} == {hosts[0]}, why()  # the dead daemon is skipped
            state["daemon"] = _start_second_daemon()
            async with make_sandbox("docker", docker_host=hosts[1]):  # the daemon answers creates, too
                pass
            await asyncio.sleep(2.5)  # past HOST_RETRY: asked again, and it has the fewest sandboxes
            more = await start(2)
            opened += more
            assert [b.host for b in more].count(hosts[1]) == 2, why()
        finally:
            await close(opened)

    asyncio.run(scenario())
    assert main(["sandbox", "doctor", "--host", hosts[0], "--host", hosts[1]]) == 0
    out = capsys.readouterr().out
    assert f"[ok] docker daemon ({hosts[1]})" in out and f"[ok] image {BASE_IMAGE} ({hosts[1]})" in out


def test_gc_covers_every_host(two_hosts, capsys):
    hosts, _ = two_hosts

    async def leave_one():
        box = make_sandbox("docker", docker_host=hosts[1], run="agentrl-hosts-gc-test")
        await box.start()
        return box

    box = asyncio.run(leave_one())
    assert (
        main(["sandbox", "gc", "--run", "agentrl-hosts-gc-test", "--host", hosts[0], "--host", hosts[1]]) == 0
    )
    out = capsys.readouterr().out
    assert f"on {hosts[1]} (run agentrl-hosts-gc-test)" in out and "1 sandbox container(s) removed" in out
    asyncio.run(box.close())  # its container is gone already: close says nothing


def test_no_host_answers_names_each(monkeypatch):
    monkeypatch.setattr(docker_backend, "HOST_CHECK", 0.0)
    dead = ["unix:///nonexistent/a.sock", "unix:///nonexistent/b.sock"]

    async def go():
        async with make_sandbox("docker", hosts=dead):
            pass

    with pytest.raises(Exception, match="no Docker daemon of sandbox hosts answers .*a.sock.*b.sock"):
        asyncio.run(go())


def test_a_runs_hosts_reach_every_docker_sandbox_it_makes(monkeypatch):
    from agentrl import sandbox as sandbox_module
    from agentrl.config import TrainConfig, load_config
    from agentrl.rollout.from_config import env_factory

    monkeypatch.setattr(sandbox_module, "_DEFAULTS", {})
    hosts = ["unix:///a/docker.sock", "ssh://user@b"]
    cfg = load_config(
        TrainConfig, "recipes/quickstart.yaml", [f"sandbox.docker.hosts={hosts}", "sandbox.kind=local"]
    )
    env_factory(cfg)
    assert make_sandbox("docker").config.hosts == hosts
    assert make_sandbox("docker", docker_host="unix:///c.sock").config.hosts == []  # one named daemon wins


def test_concurrent_picks_spread_over_hosts(monkeypatch):
    """Picks made at once from several threads (as sandboxes start on the executor) read and count
    the loads in one step: eight picks over two hosts give four each, even when health checks are slow."""
    from concurrent.futures import ThreadPoolExecutor

    def slow_ping(host):
        time.sleep(0.05)
        return True, ""

    monkeypatch.setattr(docker_backend, "_healthy", slow_ping)
    monkeypatch.setattr(docker_backend, "_host_load", {})
    hosts = ["tcp://a:2375", "tcp://b:2375"]
    with ThreadPoolExecutor(8) as pool:
        picked = list(pool.map(lambda _: docker_backend.pick_host(hosts), range(8)))
    assert sorted(picked) == sorted(hosts * 4)
    for host in picked:
        docker_backend.release_host(host)
    assert docker_backend._host_load == {hosts[0]: 0, hosts[1]: 0}


def test_pick_names_every_dead_host(monkeypatch):
    monkeypatch.setattr(docker_backend, "_healthy", lambda host: (False, f"{host[6:7]} refused"))
    with pytest.raises(
        docker_backend.SandboxError, match=r"tcp://a:2375: a refused; tcp://b:2375: b refused"
    ):
        docker_backend.pick_host(["tcp://a:2375", "tcp://b:2375"])
