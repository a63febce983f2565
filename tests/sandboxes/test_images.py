"""The base image's Debian mirror comes from this machine's apt sources, in either format."""

import pytest

from agentrl.sandboxes import images
from tests.conftest import require_docker


def test_debian_mirror_from_apt_sources(tmp_path, monkeypatch):
    listing, directory = tmp_path / "sources.list", tmp_path / "sources.list.d"
    directory.mkdir()
    monkeypatch.setattr(images, "APT_SOURCES", (listing, directory))
    monkeypatch.delenv(images.MIRROR_ENV, raising=False)
    with pytest.raises(images.ImageBuildError, match="no Debian archive in this machine's apt sources"):
        images.debian_mirror()
    (directory / "other.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/node\nSuites: x\n\n"
        "Types: deb\nURIs: http://mirror.example/debian/\nSuites: bookworm\nComponents: main\n"
    )
    assert images.debian_mirror() == "http://mirror.example/debian"
    listing.write_text("# comment\ndeb [arch=amd64] http://local.example/debian bookworm main\n")
    assert images.debian_mirror() == "http://local.example/debian"


def test_debian_mirror_override(tmp_path, monkeypatch):
    monkeypatch.setattr(images, "APT_SOURCES", (tmp_path / "none.list", tmp_path / "none.d"))
    monkeypatch.setenv(images.MIRROR_ENV, "http://override.example/debian/")
    assert images.debian_mirror() == "http://override.example/debian"
    monkeypatch.setenv(images.MIRROR_ENV, "override.example")
    with pytest.raises(images.ImageBuildError, match="AGENTRL_DEBIAN_MIRROR='override.example' is not a URL"):
        images.debian_mirror()


def test_build_without_a_daemon_or_with_a_bad_mirror_is_one_clear_error(monkeypatch):
    from agentrl.cli import main

    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(images.ImageBuildError, match=r"cannot reach the Docker daemon \(unix:///nonexistent"):
        images.build_base_image(log=lambda _: None)
    assert main(["sandbox", "build"]) == 1


def test_build_rejects_a_mirror_that_is_not_a_url():
    require_docker()
    with pytest.raises(images.ImageBuildError, match="mirror 'deb.example/debian' is not a URL"):
        images.build_base_image(mirror="deb.example/debian", log=lambda _: None)
