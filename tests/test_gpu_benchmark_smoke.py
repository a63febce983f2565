"""benchmarks/gpu_train_step.py runs anywhere with --small (the CI smoke run of the GPU benchmark):
it times both packings and the plain step and prints the ratios its goals are stated in."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_train_step_small_runs_on_the_cpu_and_prints_its_ratios():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gpu_train_step.py"), "--small", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "PPO step, padded:" in text and "PPO step, packed (dense):" in text, text
    assert re.search(r"packed / padded tokens/s: \d+\.\d\dx", text), text
    assert re.search(r"PPO step's fraction of peak / the plain step's: \d+\.\d\dx", text), text
