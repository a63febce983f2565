"""``agentrl rollout CONFIG``: collect trajectories into a store without training.

The YAML file holds the fields of ``RolloutConfig``; ``key=value`` / ``loop.key=value`` arguments
override them. Example: ``recipes/rollout_bugfix_tiny.yaml``.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.config import ConfigError, make_env, read_settings, writable_dir
from agentrl.rollout.agent_loop import LoopConfig
from agentrl.sandbox import build_config


@dataclass
class RolloutConfig:
    env: str = "bugfix-v0"
    """Registered environment id."""
    env_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for ``make(env, ...)`` (e.g. ``sandbox: local``)."""
    model: str = "tiny"
    """``tiny`` (random, built in code), ``smollm2`` (SmolLM2-135M-Instruct), or a local model directory."""
    split: str = "train"
    num_tasks: int = 8
    first_task: int = 0
    n_samples: int = 1
    """Episodes per task (for group baselines)."""
    concurrency: int = 8
    store: str = "runs/rollout"
    """Directory of the trajectory store (created; appended to if it exists)."""
    loop: LoopConfig = field(default_factory=LoopConfig)


def load_config(path: str | None, overrides: list[str] = ()) -> RolloutConfig:
    data = read_settings(path, overrides)
    loop = data.pop("loop", None) or {}
    if not isinstance(loop, dict):
        raise ConfigError(f"loop must be a section of loop settings (e.g. loop.max_turns=4); got {loop!r}")
    try:
        cfg = build_config(RolloutConfig, data, "the rollout config")
        cfg.loop = build_config(LoopConfig, loop, "the loop section")
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None
    for name in ("num_tasks", "n_samples", "concurrency"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer; got {value!r}")
    if not isinstance(cfg.first_task, int) or isinstance(cfg.first_task, bool) or cfg.first_task < 0:
        raise ConfigError(f"first_task must be an integer >= 0; got {cfg.first_task!r}")
    for name in ("env", "model", "split", "store"):
        if not isinstance(getattr(cfg, name), str) or not getattr(cfg, name):
            raise ConfigError(f"{name} must be a non-empty string; got {getattr(cfg, name)!r}")
    return cfg


async def collect(cfg: RolloutConfig, log=print) -> dict[str, Any]:
    from agentrl.env import make
    from agentrl.models import load_model
    from agentrl.rollout.local import LocalEngine
    from agentrl.rollout.pool import RolloutPool
    from agentrl.store import TrajectoryStore

    # Everything a typo can break is checked here, before the model loads and episodes run.
    probe = make_env(cfg.env, cfg.env_args, "env_args")
    if not hasattr(probe, "tasks"):
        raise ConfigError(f"environment {cfg.env} has no tasks(split, n, start) to draw tasks from")
    try:
        tasks = probe.tasks(cfg.split, cfg.num_tasks, cfg.first_task)
    except (KeyError, ValueError) as e:
        raise ConfigError(
            f"{cfg.env} cannot draw num_tasks={cfg.num_tasks} tasks of split={cfg.split!r} from "
            f"first_task={cfg.first_task}: {e}; change those settings"
        ) from None
    writable_dir(cfg.store, "store")
    try:
        model, tokenizer = load_model(cfg.model)
    except (ImportError, OSError, ValueError) as e:
        raise ConfigError(f"model={cfg.model}: {e}") from None
    engine = LocalEngine(model)
    store = TrajectoryStore(cfg.store)
    pool = RolloutPool(
        lambda: make(cfg.env, **cfg.env_args),
        engine,
        tokenizer,
        cfg.loop,
        store=store,
        concurrency=cfg.concurrency,
        n_samples=cfg.n_samples,
    )
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
        "store": str(Path(cfg.store).resolve()),
        "data_files": store.data_files,
    }
    log(
        f"rollout: {summary['episodes']} episodes of {cfg.env} in {seconds:.1f}s, statuses {summary['statuses']}, "
        f"mean reward {summary['mean_reward']:.3f}; stored in {summary['store']} "
        f"(datasets.load_dataset('json', data_files='{summary['data_files']}'))"
    )
    return summary


def main(path: str | None, overrides: list[str]) -> dict[str, Any]:
    cfg = load_config(path, overrides)
    return asyncio.run(collect(cfg))
