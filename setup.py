"""Package map: the top-level folders envs/ and sandboxes/ install as agentrl.envs and agentrl.sandboxes.

pyproject.toml holds the metadata; this file only exists because that mapping needs the package
list computed (a new sub-package under envs/ or sandboxes/ is picked up without editing anything).
"""

from setuptools import find_packages, setup

MAPPED = {"agentrl.envs": "envs", "agentrl.sandboxes": "sandboxes"}


def _packages() -> list[str]:
    packages = find_packages(include=["agentrl", "agentrl.*"])
    for name, folder in MAPPED.items():
        packages += [name + sub[len(folder) :] for sub in find_packages(include=[folder, f"{folder}.*"])]
    return packages


setup(packages=_packages(), package_dir=MAPPED)
