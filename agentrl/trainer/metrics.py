"""Metrics: JSON lines always; TensorBoard when installed; W&B when asked (offline by default)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class MetricsLogger:
    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_mode: str = "offline",
        config: dict | None = None,
    ):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tb = None
        self._wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError:  # tensorboard is optional: without it, torch's writer cannot import
                self._tb = None
        if wandb:
            try:
                import wandb as wb

                self._wandb = wb.init(
                    project="agentrl",
                    name=Path(run_dir).name,
                    mode=wandb_mode,
                    config=config or {},
                    dir=str(run_dir),
                )
            except ImportError:
                log.warning(
                    "metrics.wandb is on but wandb is not installed (pip install wandb); logging without it"
                )

    def truncate_after(self, iteration: int) -> None:
        """On resume: drop lines of iterations after the checkpoint (they will be redone), and a line
        cut short by a kill or a full disk (the checkpoint holds its iteration's record)."""
        if not self.path.exists():
            return
        kept = [json.dumps(r) for r in self.read() if r.get("iteration", -1) <= iteration]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        step = record.get("iteration", 0)
        scalars = {k: v for k, v in record.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def read(self) -> list[dict[str, Any]]:
        """The records logged, less any line that is not one (cut short by a kill or a full disk)."""
        if not self.path.exists():
            return []
        records = []
        for n, line in enumerate(self.path.read_text().splitlines(), 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if isinstance(record, dict):
                records.append(record)
            elif line.strip():
                log.warning("%s: line %d is not a JSON record (cut short?); skipped", self.path, n)
        return records

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
