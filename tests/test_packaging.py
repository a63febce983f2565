"""The package installs as documented: agentrl, agentrl.envs and agentrl.sandboxes, and no top-level envs/sandboxes."""

import inspect
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python(code: str, cwd: Path, *flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *flags, "-c", code], cwd=cwd, env=env, capture_output=True, text=True
    )


IMPORTS = (
    "import importlib.util, agentrl.envs, agentrl.sandboxes; "
    "print(agentrl.envs.__file__); print(agentrl.sandboxes.__file__); "
    "print(importlib.util.find_spec('envs'), importlib.util.find_spec('sandboxes'))"
)


def test_installed_environment_imports_mapped_packages(tmp_path):
    # From a directory that is not the repository, so only the installed package can answer.
    out = python(IMPORTS, tmp_path)
    assert out.returncode == 0, out.stderr
    envs_file, sandboxes_file, top_level = out.stdout.splitlines()
    assert envs_file.endswith("envs/__init__.py") and sandboxes_file.endswith("sandboxes/__init__.py")
    assert top_level == "None None"


def test_wheel_holds_only_agentrl(tmp_path):
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("agentrl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"agentrl", next(t for t in tops if t.endswith(".dist-info"))}, tops
    assert {"agentrl/envs/__init__.py", "agentrl/sandboxes/__init__.py", "agentrl/algo/__init__.py"} <= set(
        names
    )
    entry_points = (
        zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    )
    assert "agentrl = agentrl.cli:main" in entry_points

    # A normal (non-editable) install of that wheel: import it with site-packages switched off (-S),
    # so the editable install of this checkout cannot answer instead.
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr
    out = python(IMPORTS, tmp_path, "-S", env={"PYTHONPATH": str(target)})
    assert out.returncode == 0, out.stderr
    envs_file, sandboxes_file, top_level = out.stdout.splitlines()
    assert envs_file == str(target / "agentrl/envs/__init__.py")
    assert sandboxes_file == str(target / "agentrl/sandboxes/__init__.py")
    assert top_level == "None None"


@pytest.mark.parametrize(
    "name,params",
    [
        ("gae", "rewards, values, mask, gamma=1.0, lam=1.0"),
        ("group_advantages", "rewards, group_ids, kind='grpo', normalize_std=True, eps=1e-06"),
        ("icepop_weights", "train_logp, rollout_logp, mask, low=0.5, high=5.0"),
        (
            "policy_loss",
            "logp, old_logp, advantages, mask, kind='ppo', *, clip_low=0.2, clip_high=0.28, dual_clip=None, "
            "token_weights=None, agg='token-mean', **kind_params",
        ),
        ("value_loss", "values, old_values, returns, mask, clip=0.2"),
        ("kl_penalty", "logp, ref_logp, mask, kind='k3'"),
        (
            "token_logprobs",
            "hidden, weight, targets, temperature=1.0, chunk_size=1024, return_entropy=False, *, tf32=False",
        ),
    ],
)
def test_public_signatures(name, params):
    import agentrl.algo

    assert _normalise(inspect.signature(getattr(agentrl.algo, name))) == params


def _normalise(sig: inspect.Signature) -> str:
    parts, star_done = [], False
    for p in sig.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        text = ("**" if p.kind is p.VAR_KEYWORD else "") + p.name
        if p.default is not p.empty:
            text += f"={p.default!r}"
        parts.append(text)
    return ", ".join(parts)
