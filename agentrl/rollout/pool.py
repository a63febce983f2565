"""Run many episodes concurrently; one failing episode never stops the others; every trajectory is stored.

    pool = RolloutPool(env_factory, engine, tokenizer, LoopConfig(), store=TrajectoryStore("runs/x"),
                       concurrency=32, n_samples=4)
    trajectories = await pool.run(tasks)

Each task runs ``n_samples`` times (for group baselines; ``sample_index`` tells them apart), in
its own environment instance from ``env_factory()``. Inside each episode, ``env.reset`` (where a
sandbox is made) is retried on sandbox errors and engine calls on transient errors; a tool call
is never re-run. Whatever happens to an episode, its trajectory, with its status, is
returned and written to the store.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from agentrl.env import AgentEnv, Task
from agentrl.rollout.agent_loop import LoopConfig, run_episode
from agentrl.rollout.engine import Engine
from agentrl.rollout.render import Renderer
from agentrl.store import TrajectoryStore
from agentrl.trajectory import Trajectory


class RolloutPool:
    def __init__(
        self,
        env_factory: Callable[[], AgentEnv],
        engine: Engine,
        tokenizer,
        config: LoopConfig | None = None,
        *,
        store: TrajectoryStore | None = None,
        concurrency: int = 16,
        n_samples: int = 1,
        progress: bool = True,
    ):
        if concurrency < 1 or n_samples < 1:
            raise ValueError(f"concurrency and n_samples must be >= 1; got {concurrency} and {n_samples}")
        self.env_factory, self.engine, self.tokenizer = env_factory, engine, tokenizer
        self.config = config or LoopConfig()
        self.store, self.concurrency, self.n_samples, self.progress = store, concurrency, n_samples, progress
        self.renderer = Renderer(tokenizer, self.config.end_of_turn)

    async def _episode(self, task: Task, sample: int, slots: asyncio.Semaphore) -> Trajectory:
        async with slots:
            try:
                env = self.env_factory()
            except Exception as e:
                t = Trajectory([], [], [], [], status="env_error", task_id=task.id, sample_index=sample)
                t.extra["error"] = f"could not create the environment: {type(e).__name__}: {e}"
                return t
            return await run_episode(
                env,
                self.engine,
                self.tokenizer,
                task,
                self.config,
                sample_index=sample,
                renderer=self.renderer,
            )

    async def run(self, tasks: list[Task], extra: dict[str, Any] | None = None) -> list[Trajectory]:
        """Run every task ``n_samples`` times; trajectories come back in task order. ``extra`` is
        added to each trajectory's ``extra`` before it is stored (the trainer's ``iteration``, which
        ``agentrl replay --filter iteration=N`` selects by)."""
        slots = asyncio.Semaphore(self.concurrency)
        # A task given twice (an iteration that crosses an epoch of the task order) gets other
        # sample indices the second time: seeded sampling would otherwise give it the same episodes.
        seen: Counter[str] = Counter()
        jobs = []
        for task in tasks:
            jobs += [(task, seen[task.id] * self.n_samples + s) for s in range(self.n_samples)]
            seen[task.id] += 1
        futures = [asyncio.ensure_future(self._episode(task, s, slots)) for task, s in jobs]
        start = time.monotonic()
        bar = _Progress(len(futures)) if self.progress else None
        statuses: Counter[str] = Counter()
        tokens = 0
        try:
            for done in asyncio.as_completed(futures):
                trajectory = await done
                trajectory.extra.update(extra or {})
                if self.store is not None:
                    self.store.append(trajectory)
                statuses[trajectory.status] += 1
                tokens += len(trajectory)
                if bar:
                    bar.update(statuses, tokens / max(time.monotonic() - start, 1e-9))
        except BaseException:
            for f in futures:
                f.cancel()
            await asyncio.gather(*futures, return_exceptions=True)
            raise
        finally:
            if bar:
                bar.close()
        return [f.result() for f in futures]


class _Progress:
    """A rich progress bar: episodes done, tokens/s, status counts."""

    def __init__(self, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("rollout"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            transient=False,
        )
        self._task = self._progress.add_task("episodes", total=total, info="")
        self._progress.start()

    def update(self, statuses: Counter, tokens_per_s: float) -> None:
        info = f"{tokens_per_s:,.0f} tok/s  " + " ".join(f"{k}={v}" for k, v in sorted(statuses.items()))
        self._progress.update(self._task, advance=1, info=info)

    def close(self) -> None:
        self._progress.stop()
