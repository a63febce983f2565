"""Atomic checkpoints: a checkpoint directory exists under its final name only once it is complete.

Layout: ``RUN/checkpoints/iter-000012/`` with ``backend.pt`` (actor, critic, both optimizers and
schedules; the Megatron backend writes one ``megatron-tp<r>[-pp<s>].pt`` per split and the policy
under the model's own names in ``policy.pt``), ``trainer.json`` (iteration, data cursor) and ``rng.pt`` (Python, NumPy and torch RNG
states). It is written into a temporary sibling and renamed into place, so a process killed at any
moment leaves either the previous checkpoint or the new one, never half of one; the latest is the
highest complete iteration.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


class Checkpoints:
    def __init__(self, run_dir: str | os.PathLike, keep: int = 2):
        self.dir = Path(run_dir) / "checkpoints"
        self.keep = keep

    def latest(self) -> Path | None:
        done = sorted(
            p
            for p in self.dir.glob("iter-*")
            if (p / "trainer.json").exists() and not p.name.endswith(".tmp")
        )
        return done[-1] if done else None

    def save(self, iteration: int, backend, trainer_state: dict[str, Any]) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.dir / f"iter-{iteration:06d}"
        tmp = self.dir / f"iter-{iteration:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        backend.save(str(tmp))
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / "trainer.json").write_text(json.dumps({"iteration": iteration, **trainer_state}))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in sorted(p for p in self.dir.glob("iter-*") if not p.name.endswith(".tmp"))[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load(self, path: Path, backend) -> dict[str, Any]:
        backend.load(str(path))
        set_rng_state(torch.load(path / "rng.pt", weights_only=False))
        return json.loads((path / "trainer.json").read_text())
