import os
import uuid

import pytest

# Every sandbox container this test session makes carries this run id, so the leak check below
# sees exactly the session's containers (and the child processes it spawns inherit it).
RUN_ID = os.environ.setdefault("AGENTRL_RUN_ID", f"pytest-{uuid.uuid4().hex[:8]}")


def docker_status() -> tuple[bool, str]:
    try:
        import docker

        client = docker.from_env(timeout=10)
        client.ping()
    except Exception as e:
        return False, f"no Docker engine reachable ({e}); `agentrl sandbox doctor` says how to start one"
    from agentrl.sandboxes.images import BASE_IMAGE

    if not client.images.list(name=BASE_IMAGE):
        return False, f"image {BASE_IMAGE} is missing; run `agentrl sandbox build`"
    return True, ""


DOCKER_OK, DOCKER_WHY = docker_status()


def require_docker() -> None:
    if not DOCKER_OK:
        if os.environ.get("AGENTRL_REQUIRE_DOCKER") == "1":
            pytest.fail(f"Docker is required here (AGENTRL_REQUIRE_DOCKER=1) but {DOCKER_WHY}")
        pytest.skip(DOCKER_WHY)


@pytest.fixture(scope="session", autouse=True)
def no_leaked_containers():
    """When the suite ends, no sandbox container of this session may exist, crashed tests included."""
    yield
    if not DOCKER_OK:
        return
    import docker

    client = docker.from_env()
    leaked = client.containers.list(
        all=True, filters={"label": ["agentrl.sandbox=1", f"agentrl.run={RUN_ID}"]}
    )
    for c in leaked:
        c.remove(force=True)
    assert not leaked, f"leaked sandbox containers: {[c.name for c in leaked]}"


def fake_distribution(root, name: str, entry_points: str) -> None:
    """What ``pip install`` leaves for entry-point lookup: ``NAME-0.1.dist-info`` under ``root`` (a
    sys.path entry) with ``entry_points.txt`` holding ``entry_points``."""
    dist = root / f"{name.replace('-', '_')}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(entry_points)


@pytest.fixture
def drawn(monkeypatch):
    """The matplotlib figures the test saves, in order (each kept after it is written)."""
    import matplotlib.figure

    figures = []
    save = matplotlib.figure.Figure.savefig

    def keep(self, *args, **kwargs):
        figures.append(self)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    return figures
