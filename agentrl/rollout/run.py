"""``agentrl rollout RECIPE``: collect trajectories into a store without training.

The recipe is a training recipe (``agentrl.config.TrainConfig``): the same ``env``, ``sandbox``,
``model``, ``engine`` and ``rollout`` sections build the same environment, policy and agent loop as
``agentrl train`` would; the ``collect`` section says which tasks and where the store is.
``key.sub=value`` arguments override the file. Example: ``recipes/rollout_bugfix_tiny.yaml``.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

from agentrl.config import ConfigError, TrainConfig, load_config, writable_dir


async def collect(cfg: TrainConfig, log=print) -> dict[str, Any]:
    from agentrl.registry import ENGINES
    from agentrl.rollout.from_config import env_factory, fetch, load_policy, rollout_pool, seed_everything
    from agentrl.store import TrajectoryStore

    # Everything a typo can break is checked here, before the model loads and episodes run.
    new_env = env_factory(cfg)
    probe = new_env()
    c = cfg.collect
    split = c.split or cfg.env.train_split
    try:
        env_tasks = probe.tasks(split)
        available = len(env_tasks)
    except (KeyError, ValueError) as e:
        raise ConfigError(
            f"collect.split={split!r}: environment {cfg.env.id} has no such split ({e})"
        ) from None
    if c.first_task + c.tasks > available:
        raise ConfigError(
            f"collect.first_task={c.first_task} + collect.tasks={c.tasks} is past the {available} tasks of "
            f"the {split!r} split of {cfg.env.id}; lower them"
        )
    tasks = fetch(env_tasks, c.first_task, c.first_task + c.tasks, f"collect.tasks={c.tasks}", split, cfg)
    store_dir = writable_dir(c.store or cfg.run_dir / "trajectories", "collect.store")
    seed_everything(cfg.run.seed)
    policy, tokenizer = load_policy(cfg, probe)
    engine = ENGINES.factory(cfg.engine.kind)(policy, cfg)
    store = TrajectoryStore(store_dir)
    pool = rollout_pool(cfg, new_env, engine, tokenizer, store)
    start = time.monotonic()
    try:
        trajectories = await pool.run(tasks)
    finally:
        store.close()
        await engine.close()
    seconds = time.monotonic() - start
    summary = {
        "episodes": len(trajectories),
        "statuses": dict(Counter(t.status for t in trajectories)),
        "mean_reward": sum(t.reward for t in trajectories) / max(len(trajectories), 1),
        "tokens": sum(len(t) for t in trajectories),
        "seconds": seconds,
        "store": str(Path(store_dir).resolve()),
        "data_files": store.data_files,
    }
    log(
        f"rollout: {summary['episodes']} episodes of {cfg.env.id} in {seconds:.1f}s, statuses "
        f"{summary['statuses']}, mean reward {summary['mean_reward']:.3f}; stored in {summary['store']} "
        f"(datasets.load_dataset('json', data_files='{summary['data_files']}'))"
    )
    return summary


def main(path: str | None, overrides: list[str]) -> dict[str, Any]:
    return asyncio.run(collect(load_config(TrainConfig, path, overrides)))
