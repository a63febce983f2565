"""The base image's Debian mirror comes from this machine's apt sources, in either format."""

import pytest

from agentrl.sandboxes import images


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
