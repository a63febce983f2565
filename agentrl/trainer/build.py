"""Building a run from its config: the environment's task splits, the policy, the training backend
and inference engine chosen by config (``agentrl.registry``), the rollout pool, the store, metrics,
checkpoints and the data cursor; resuming from the last checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.config import ConfigError, TrainConfig, writable_dir
from agentrl.env import AgentEnv, Task
from agentrl.models import LOAD_ERRORS, load_error
from agentrl.registry import BACKENDS, ENGINES
from agentrl.rollout.engine import Engine
from agentrl.rollout.from_config import (
    Splits,
    env_factory,
    load_policy,
    rollout_pool,
    seed_everything,
    splits,
)
from agentrl.rollout.pool import RolloutPool
from agentrl.store import TrajectoryStore
from agentrl.trainer.backend import LossConfig, TrainBackend
from agentrl.trainer.checkpoint import Checkpoints
from agentrl.trainer.data import TaskCursor
from agentrl.trainer.metrics import MetricsLogger


@dataclass
class Run:
    cfg: TrainConfig
    log: Any
    policy: Any
    tokenizer: Any
    engine: Engine
    backend: TrainBackend
    pool: RolloutPool
    store: TrajectoryStore
    metrics: MetricsLogger
    checkpoints: Checkpoints
    cursor: TaskCursor
    splits: Splits
    make_env: Callable[[], AgentEnv]
    start: int = 0
    state: dict[str, Any] = field(default_factory=dict)
    started_at: float = field(default_factory=time.monotonic)

    def next_tasks(self) -> tuple[list[Task], list[int]]:
        indices = self.cursor.next(self.cfg.rollout.tasks_per_iteration)
        tasks = [self.splits.train[i] for i in indices]
        # the pool runs n samples of each task; sample s of task k has group id k
        groups = [k for k in range(len(tasks)) for _ in range(self.cfg.rollout.n_samples)]
        return tasks, groups

    def save(self, iteration: int, record: dict[str, Any]) -> None:
        if (iteration + 1) % self.cfg.run.checkpoint_every == 0 or iteration + 1 == self.cfg.run.iterations:
            # the iteration's record goes into the checkpoint too: a kill between the two writes
            # would otherwise leave a checkpoint past the last line of metrics.jsonl
            # the engine's weight version too: a resumed run tags its episodes as this one would have
            state = {
                "cursor": self.cursor.state(),
                "state": self.state,
                "record": record,
                "weight_version": self.engine.weight_version,
            }
            self.checkpoints.save(iteration + 1, self.backend, state)
        self.metrics.log(record)


def loss_config(cfg: TrainConfig) -> LossConfig:
    a = cfg.algo
    return LossConfig(
        kind=a.policy_loss,
        clip_low=a.clip_low,
        clip_high=a.clip_high,
        dual_clip=a.dual_clip,
        agg=a.agg or "token-mean",
        kl_coef=a.kl_coef,
        # the engine reports a greedy turn's log-probs at temperature 1 (SGLang's rule too)
        temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
        value_clip=a.value_clip,
    )


async def setup(cfg: TrainConfig, log=print) -> Run:
    # A bad setting stops the run here, before anything is built: env, task counts, output directory.
    new_env = env_factory(cfg)
    probe = new_env()  # asked for its task splits, demonstrations and tokenizer corpus; never reset
    task_splits = splits(cfg, probe)
    if cfg.sft.episodes and not callable(getattr(probe, "demonstration", None)):
        raise ConfigError(
            f"sft.episodes={cfg.sft.episodes}: environment {cfg.env.id} has no demonstration(task) to "
            "warm-start from; set sft.episodes=0, or warm-start from stored trajectories (sft.from_store=PATH)"
        )
    if cfg.sft.from_store and not Path(cfg.sft.from_store).is_dir():
        raise ConfigError(
            f"sft.from_store={cfg.sft.from_store} is not a directory; pass a trajectory store's "
            "(e.g. runs/NAME/trajectories, where agentrl rollout and agentrl train write theirs)"
        )
    run_dir = writable_dir(cfg.run_dir, "run.output_dir")
    if int(os.environ.get("RANK", "0")) == 0:  # torchrun's other ranks write nothing here
        claim(run_dir, cfg)
    seed_everything(cfg.run.seed)
    policy, tokenizer = load_policy(cfg, probe)
    backend = BACKENDS.factory(cfg.trainer.backend)(policy, cfg)
    if getattr(backend, "driven", False) and backend.rank != 0:
        # torchrun's other ranks build the backend only, run their share of each call rank 0 makes
        # to it, and end with rank 0's run
        backend.follow()
        raise SystemExit(0)
    try:  # for the token view of agentrl replay --html (token texts beside their ids)
        tokenizer.save_pretrained(str(run_dir / "tokenizer"))
    except (AttributeError, OSError, TypeError, ValueError) as e:
        log(
            f"warning: the tokenizer could not be saved in {run_dir}/tokenizer ({e}); replay shows token ids only"
        )
    # The inference engine holds its own copy of the weights, synced after every update.
    engine = ENGINES.factory(cfg.engine.kind)(policy, cfg)
    store = TrajectoryStore(run_dir / "trajectories")
    pool = rollout_pool(cfg, new_env, engine, tokenizer, store)
    metrics = MetricsLogger(
        run_dir,
        tensorboard=cfg.metrics.tensorboard,
        wandb=cfg.metrics.wandb,
        wandb_mode=cfg.metrics.wandb_mode,
        config=cfg.model_dump(),
    )
    checkpoints = Checkpoints(run_dir, keep=cfg.run.keep_checkpoints)
    cursor = TaskCursor(task_splits.n_train, seed=cfg.run.seed)
    run = Run(
        cfg,
        log,
        policy,
        tokenizer,
        engine,
        backend,
        pool,
        store,
        metrics,
        checkpoints,
        cursor,
        task_splits,
        new_env,
    )
    latest = checkpoints.latest() if cfg.run.resume else None
    if cfg.run.resume and latest is None:
        log(f"resume=true but {checkpoints.dir} holds no complete checkpoint: starting from scratch")
    if latest is not None:
        try:
            saved = checkpoints.load(latest, backend)
        except LOAD_ERRORS as e:
            raise ConfigError(
                f"run.resume: cannot load checkpoint {latest}: {load_error(e)}; if the run's settings "
                f"changed since it was saved, resume with those in {run_dir / 'config.json'}; if the "
                f"checkpoint is damaged, delete {latest} to resume from the one before it"
            ) from None
        run.start = saved["iteration"]
        if run.start >= cfg.run.iterations:
            raise ConfigError(
                f"run.resume: {latest} holds iteration {run.start} of {run_dir.name}, and run.iterations="
                f"{cfg.run.iterations}: set run.iterations above {run.start} to train it further"
            )
        cursor.restore(saved["cursor"])
        run.state = saved.get("state", {})
        metrics.truncate_after(run.start - 1)
        redone = store.set_aside(lambda record: stored_iteration(record) >= run.start)
        if redone:
            log(
                f"set aside {redone} stored episodes of iterations {run.start} and later, which this run "
                f"redoes, in {store.path}/*.superseded"
            )
        last = saved.get("record")
        logged = {r.get("iteration") for r in metrics.read()}
        if last is not None and last.get("iteration") == run.start - 1 and run.start - 1 not in logged:
            metrics.log(last)  # killed after the checkpoint was written, before its metrics line was
        await engine.update_weights(backend.engine_state_dict(), saved.get("weight_version"))
        log(f"resumed from {latest} at iteration {run.start}")
    else:
        metrics.truncate_after(-1)
    # written once the run has started (a run that stopped above leaves the directory's as it was)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    return run


def stored_iteration(record: dict[str, Any]) -> int:
    """The training iteration a stored episode was collected in (-1 when it names none)."""
    extra = record.get("extra")
    try:
        extra = json.loads(extra) if isinstance(extra, str) else extra
        return int(extra.get("iteration", -1))
    except (ValueError, TypeError, AttributeError):
        return -1


RUN_OUTPUTS = (
    "metrics.jsonl",
    "summary.json",
    "curve.png",
    "warm_start.pt",
    "config.json",
    "checkpoints",
    "trajectories",
    "token_stats",
    "tensorboard",
    "wandb",
    "report",
    "tokenizer",
    "engine_weights",
    "engine_logs",
)
"""What a training run writes in its directory (``run.overwrite`` deletes these, and nothing else)."""


def previous_run(run_dir: Path) -> str | None:
    """What of an earlier training run ``run_dir`` holds (its metrics, checkpoints, warm start), or
    None. Episodes alone (``agentrl rollout`` into the run's store) are not a training run."""
    found = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        with open(metrics, "rb") as f:
            found.append(f"{sum(1 for line in f if line.strip())} iterations of metrics")
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("iter-*") if not p.name.endswith(".tmp"))
    if saved:
        found.append(f"checkpoint {saved[-1]}")
    found += [
        what
        for name, what in (("warm_start.pt", "a warm start"), ("summary.json", "a summary"))
        if (run_dir / name).exists()
    ]
    return ", ".join(found) or None


def claim(run_dir: Path, cfg: TrainConfig) -> None:
    """Make ``run_dir`` this run's: continue the run in it (``run.resume``), replace it
    (``run.overwrite``), or stop when it holds another run, rather than mix two runs' metrics,
    checkpoints and episodes."""
    previous = previous_run(run_dir)
    if previous is None or cfg.run.resume:
        return
    if not cfg.run.overwrite:
        raise ConfigError(
            f"{run_dir} holds a training run ({previous}): set run.resume=true to continue it, "
            "run.overwrite=true to replace it, or another run.name"
        )
    for key, value in (("sft.from_store", cfg.sft.from_store), ("model.init", cfg.model.init)):
        if value and Path(value).resolve().is_relative_to(run_dir.resolve()):
            raise ConfigError(
                f"run.overwrite=true would delete {key}={value}, which is inside {run_dir}: copy it "
                "elsewhere first, or choose another run.name"
            )
    for name in RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def rollout_seed(cfg: TrainConfig, iteration: int) -> int:
    """Sampling seed of an iteration's rollouts (fresh every iteration, reproducibly); held-out
    evaluation samples with iteration -1's, which no training iteration uses."""
    return cfg.run.seed * 1_000_003 + iteration
