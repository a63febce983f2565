"""The GPU benchmarks run anywhere with --small (their CI smoke runs): gpu_train_step.py times both
packings, the plain step and the LM head with fp32 and TF32 products, and prints the ratios its
goals are stated in; gpu_megatron.py times
the Megatron backend, with and without the distributed optimizer, beside the PyTorch backend."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def small_run(script: str) -> str:
    """``benchmarks/SCRIPT --small --repeats 1``'s output; it must exit 0."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--small", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_gpu_train_step_small_runs_on_the_cpu_and_prints_its_ratios():
    text = small_run("gpu_train_step.py")
    assert "PPO step, padded:" in text and "PPO step, packed (dense):" in text, text
    assert re.search(r"packed / padded tokens/s: \d+\.\d\dx", text), text
    assert re.search(r"PPO step's fraction of peak / the plain step's: \d+\.\d\dx", text), text
    gap = re.search(r"LM head, \d+ tokens forward \+ backward: .* TF32 .* largest log-prob gap (\S+)", text)
    assert gap and float(gap.group(1)) == 0.0, text  # TF32 is CUDA's: on the CPU it changes nothing


def test_gpu_megatron_small_runs_on_the_cpu_and_compares_each_megatron_run_with_torch():
    """Both Megatron runs (torch AdamW, and megatron-core's distributed optimizer) and the PyTorch
    backend's: log-probs within 1e-4 of the PyTorch backend's, and a tokens/s ratio for each."""
    pytest.importorskip("megatron.core")
    text = small_run("gpu_megatron.py")
    gaps = re.findall(r"against torch, first rows: largest gap (\S+)", text)
    assert len(gaps) == 2 and all(float(g) < 1e-4 for g in gaps), text
    ratios = re.findall(r"^megatron .* / torch tokens/s: \d+\.\d\dx$", text, re.MULTILINE)
    assert len(ratios) == 2 and "distributed optimizer" in ratios[0], text
