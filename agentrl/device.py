"""Where the policy, the value model and the embedded engine run (``run.device``) and in what
precision they train (``model.dtype``)."""

from __future__ import annotations

import torch

from agentrl.config import ConfigError


def resolve_device(setting: str) -> torch.device:
    """``cuda`` (the current GPU; a ``ConfigError`` where there is none), ``cpu``, or ``auto`` (CUDA
    when torch sees a GPU, else the CPU)."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "run.device=cuda, but torch sees no CUDA GPU here (torch.cuda.is_available() is False: a "
            f"CPU build of torch {torch.__version__}, or no GPU); set run.device=cpu or run.device=auto"
        )
    if setting not in ("cuda", "cpu"):
        raise ConfigError(f"run.device={setting!r}: use auto, cpu or cuda")
    return torch.device(setting)


def resolve_dtype(setting: str, device: torch.device) -> str:
    """``model.dtype``: ``auto`` is bfloat16 on a GPU and float32 on the CPU (where bf16 autocast is
    slower and changes the numbers the CPU tests pin)."""
    if setting == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    return setting
