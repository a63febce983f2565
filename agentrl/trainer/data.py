"""The data cursor: which training tasks each iteration takes, resumable exactly."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class TaskCursor:
    """Walks a shuffled order of ``num_tasks`` task indices, reshuffling at each pass; its state is two ints."""

    num_tasks: int
    seed: int = 0
    epoch: int = 0
    position: int = 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.num_tasks))
        random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def next(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            order = self._order(self.epoch)
            take = order[self.position : self.position + n - len(out)]
            out += take
            self.position += len(take)
            if self.position >= self.num_tasks:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def restore(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
