"""Sandbox images built with no registry: a Debian base from ``debootstrap``, and task layers on top.

No image can be pulled on the machines agentrl is developed on (and many training clusters are
air-gapped), so the base image is assembled from Debian packages and ``docker import``-ed:

    agentrl sandbox build          # builds agentrl/base:bookworm unless present (about a minute)

Task images are ordinary Dockerfiles ``FROM agentrl/base:bookworm``, built with networking off
(``build_task_image``): whatever a task needs is copied in, never downloaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

BASE_IMAGE = "agentrl/base:bookworm"
SUITE = "bookworm"
APT_SOURCES = (Path("/etc/apt/sources.list"), Path("/etc/apt/sources.list.d"))
# minbase lacks ps/pkill (procps) and patch; git and pytest are what coding tasks run.
PACKAGES = ("python3", "python3-pytest", "git", "ca-certificates", "procps", "patch")
# Debian's pytest package pulls in more-itertools, and pkg_resources vendors another copy: a copy of
# a library that swe-v0 tasks are built from would show the agent its unbroken source. pytest 7.2
# imports neither, so both packages are removed (dependencies forced) after debootstrap.
LIBRARY_COPIES = ("python3-more-itertools", "python3-pkg-resources")
# Raised when the recipe changes: an image built by an older recipe is rebuilt by `sandbox build`.
BASE_VERSION = "2"
AGENT_USER, AGENT_UID = "agent", 1000
WORKSPACE = "/testbed"
IMAGE_CHANGES = (
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
    f"WORKDIR {WORKSPACE}",
    'CMD ["sleep", "infinity"]',
    "LABEL agentrl.image=base",
    f"LABEL agentrl.base_version={BASE_VERSION}",
)
GITCONFIG = """[user]
\tname = agentrl
\temail = agentrl@localhost
[init]
\tdefaultBranch = main
[safe]
\tdirectory = *
[advice]
\tdetachedHead = false
"""


class ImageBuildError(RuntimeError):
    pass


def image_present(client, tag: str) -> bool:
    """Whether ``tag`` exists (for the base image: built by the current recipe, ``BASE_VERSION``)."""
    import docker

    try:
        image = client.images.get(tag)
    except docker.errors.ImageNotFound:
        return False
    if tag != BASE_IMAGE:
        return True
    return (image.labels or {}).get("agentrl.base_version") == BASE_VERSION


MIRROR_ENV = "AGENTRL_DEBIAN_MIRROR"


def debian_mirror() -> str:
    """The Debian archive for debootstrap: ``$AGENTRL_DEBIAN_MIRROR`` when set, else the one this
    machine's apt uses (its sources, one-line or deb822)."""
    override = os.environ.get(MIRROR_ENV, "").strip()
    if override:
        if "://" not in override:
            raise ImageBuildError(
                f"{MIRROR_ENV}={override!r} is not a URL; set it to a Debian archive such as "
                "http://HOST/debian, or unset it to use apt's sources"
            )
        return override.rstrip("/")
    files = (
        [APT_SOURCES[0]] + sorted(APT_SOURCES[1].glob("*.list")) + sorted(APT_SOURCES[1].glob("*.sources"))
    )
    for path in files:
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            words = line.split("#", 1)[0].split()
            if words[:1] == ["deb"]:  # deb [options] URI SUITE COMPONENTS
                uris = [w for w in words[1:] if "://" in w][:1]
            elif words[:1] == ["URIs:"]:
                uris = words[1:]
            else:
                continue
            for uri in uris:
                if uri.rstrip("/").endswith("/debian"):
                    return uri.rstrip("/")
    raise ImageBuildError(
        "no Debian archive in this machine's apt sources (/etc/apt/sources.list[.d]); set "
        f"{MIRROR_ENV}=URL, pass `agentrl sandbox build --mirror URL`, or add one to apt's sources"
    )


def _customise_rootfs(rootfs: Path) -> None:
    """Add the non-root agent user and its workspace; trim what a sandbox never reads."""
    with open(rootfs / "etc/passwd", "a") as f:
        f.write(f"{AGENT_USER}:x:{AGENT_UID}:{AGENT_UID}:agentrl agent:/home/{AGENT_USER}:/bin/bash\n")
    with open(rootfs / "etc/group", "a") as f:
        f.write(f"{AGENT_USER}:x:{AGENT_UID}:\n")
    with open(rootfs / "etc/shadow", "a") as f:
        f.write(f"{AGENT_USER}:*:19000:0:99999:7:::\n")
    for path in (f"home/{AGENT_USER}", WORKSPACE.lstrip("/")):
        (rootfs / path).mkdir(parents=True, exist_ok=True)
        os.chown(rootfs / path, AGENT_UID, AGENT_UID)
    (rootfs / "etc/gitconfig").write_text(GITCONFIG)
    proc = subprocess.run(
        ["chroot", str(rootfs), "dpkg", "--force-depends", "--purge", *LIBRARY_COPIES],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise ImageBuildError(f"removing {', '.join(LIBRARY_COPIES)} failed: {proc.stderr[-1000:]}")
    for junk in ("var/lib/apt/lists", "var/cache/apt", "usr/share/doc", "usr/share/man", "usr/share/locale"):
        shutil.rmtree(rootfs / junk, ignore_errors=True)
        (rootfs / junk).mkdir(parents=True, exist_ok=True)


def build_base_image(
    tag: str = BASE_IMAGE,
    *,
    mirror: str | None = None,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> str:
    """Build the base image with ``debootstrap`` + ``docker import``; returns "present" or "built".

    Needs root (debootstrap) and a reachable Debian mirror (default: the one apt uses here); no
    container registry.
    """
    import docker

    try:
        client = docker.from_env()
        present = image_present(client, tag)
    except docker.errors.DockerException as e:
        raise ImageBuildError(
            f"cannot reach the Docker daemon ({os.environ.get('DOCKER_HOST') or 'local socket'}): "
            f"{str(e).split(';')[0]}. Start it (`dockerd > /tmp/dockerd.log 2>&1 &` as root, or "
            "`systemctl start docker`); `agentrl sandbox doctor` checks this machine."
        ) from e
    if mirror is not None and "://" not in mirror:
        raise ImageBuildError(
            f"mirror {mirror!r} is not a URL; pass a Debian archive such as http://HOST/debian"
        )
    if not force and present:
        log(f"{tag}: already present, nothing to do (force=True rebuilds it)")
        return "present"
    if os.geteuid() != 0:
        raise ImageBuildError(
            f"building {tag} runs debootstrap, which needs root; run `sudo agentrl sandbox build`."
        )
    if not shutil.which("debootstrap"):
        raise ImageBuildError("debootstrap is not installed; run `apt-get install -y debootstrap` and retry.")
    mirror = mirror or debian_mirror()
    with tempfile.TemporaryDirectory(prefix="agentrl-rootfs-", dir="/var/tmp") as tmp:
        rootfs = Path(tmp) / "rootfs"
        cmd = [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(PACKAGES)}",
            SUITE,
            str(rootfs),
            mirror,
        ]
        log(f"{tag}: {' '.join(cmd)}")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ImageBuildError(f"debootstrap failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        _customise_rootfs(rootfs)
        tarball = Path(tmp) / "rootfs.tar"
        subprocess.run(["tar", "-C", str(rootfs), "-cf", str(tarball), "."], check=True)
        log(f"{tag}: docker import ({tarball.stat().st_size / 2**20:.0f} MiB)")
        repository, _, version = tag.partition(":")
        client.api.import_image_from_file(
            str(tarball), repository=repository, tag=version or "latest", changes=list(IMAGE_CHANGES)
        )
    log(f"{tag}: built")
    return "built"


def build_task_image(context: str | Path, tag: str, *, buildargs: dict[str, str] | None = None) -> str:
    """Build a task image from a Dockerfile in ``context`` with networking off; returns its id."""
    import docker

    client = docker.from_env()
    try:
        image, _ = client.images.build(
            path=str(context),
            tag=tag,
            network_mode="none",
            rm=True,
            forcerm=True,
            buildargs=buildargs or {},
            labels={"agentrl.image": "task"},
        )
    except docker.errors.BuildError as e:
        log = "".join(chunk.get("stream", "") for chunk in e.build_log if isinstance(chunk, dict))
        raise ImageBuildError(f"building {tag} from {context} failed: {e.msg}\n{log[-2000:]}") from e
    return image.id
