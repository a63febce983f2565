"""Held-out evaluation: greedy success on the held-out tasks (and, with ``metrics.eval_samples``,
sampled success and pass@n), during a run and for saved weights (``agentrl eval``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from agentrl.config import TrainConfig
from agentrl.env import AgentEnv, Task
from agentrl.registry import ENGINES
from agentrl.rollout.engine import Engine
from agentrl.rollout.from_config import env_factory, load_policy, loop_config, splits
from agentrl.rollout.pool import RolloutPool
from agentrl.store import TrajectoryStore
from agentrl.trainer.build import Run, rollout_seed
from agentrl.trainer.phases import check_collected
from agentrl.trajectory import succeeded


async def evaluate(run: Run) -> dict[str, float]:
    return await held_out(run.cfg, run.engine, run.tokenizer, run.make_env, run.splits.held_out, run.log)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` succeeded:
    1 - C(n - c, k) / C(n, k) (Chen et al. 2021, "Evaluating Large Language Models Trained on Code")."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_ci95(values: Sequence[float]) -> tuple[float, float]:
    """The mean over tasks and the half-width of its 95 % interval (normal approximation, 1.96
    standard errors; 0 with one task)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, 1.96 * math.sqrt(var / len(values))


async def held_out(
    cfg: TrainConfig,
    engine: Engine,
    tokenizer,
    make_env: Callable[[], AgentEnv],
    tasks: Sequence[Task],
    log=print,
    store=None,
) -> dict[str, float]:
    """Held-out success: greedy (``eval_success``, with ``eval_success_ci95`` the half-width of its
    95 % interval), and with ``metrics.eval_samples`` = N > 0 also the mean success of N samples per
    task at the rollout temperature (``eval_success_sampled``), the share of tasks that any of them
    solves (``eval_pass_at_n``), and the unbiased pass@k for k = 1, N (``eval_pass_at_1``,
    ``eval_pass_at_N``, each with ``..._ci95``). ``store``: a ``TrajectoryStore`` that keeps every
    episode. NaN with no held-out task."""
    if not tasks:
        return {"eval_success": float("nan")}

    def pool(greedy: bool, n_samples: int) -> RolloutPool:
        config = loop_config(cfg, greedy=greedy)
        if not greedy:  # the same random numbers at every evaluation of the run, none shared with training
            config.seed = rollout_seed(cfg, -1)
        return RolloutPool(
            make_env,
            engine,
            tokenizer,
            config,
            concurrency=cfg.rollout.concurrency,
            n_samples=n_samples,
            progress=False,
            store=store,
        )

    greedy = await pool(True, 1).run(list(tasks))
    check_collected(greedy, cfg, f"held-out evaluation on {len(tasks)} {cfg.env.eval_split} tasks")
    solved = [float(succeeded(t.reward)) for t in greedy]
    result = {}
    result["eval_success"], result["eval_success_ci95"] = mean_ci95(solved)
    text = f"held-out success on {len(tasks)} {cfg.env.eval_split} tasks: {result['eval_success']:.3f}"
    n = cfg.metrics.eval_samples
    if n:
        sampled = [
            succeeded(t.reward) for t in await pool(False, n).run(list(tasks))
        ]  # task order, n per task
        per_task = [any(sampled[i * n : (i + 1) * n]) for i in range(len(tasks))]
        result["eval_success_sampled"] = sum(sampled) / len(sampled)
        result["eval_pass_at_n"] = sum(per_task) / len(per_task)
        counts = [sum(sampled[i * n : (i + 1) * n]) for i in range(len(tasks))]
        for k in sorted({1, n}):
            mean, half = mean_ci95([pass_at_k(n, c, k) for c in counts])
            result[f"eval_pass_at_{k}"], result[f"eval_pass_at_{k}_ci95"] = mean, half
        text += (
            f" (greedy); {result['eval_success_sampled']:.3f} mean over {n} samples per task at "
            f"temperature {cfg.rollout.temperature:g}, pass@{n} {result['eval_pass_at_n']:.3f}"
        )
    log(text)
    return result


async def evaluate_weights(cfg: TrainConfig, log=print, store_dir: str | None = None) -> dict[str, float]:
    """``agentrl eval``: held-out success of the policy in ``model.init`` (saved weights, or a checkpoint
    directory of a run), with no training; the episodes go to a trajectory store at ``store_dir``
    when it is given."""
    new_env = env_factory(cfg)  # a bad env setting stops here, before the model loads
    probe = new_env()
    held = splits(cfg, probe).held_out
    if not cfg.model.init:
        log("model.init is not set: evaluating the untrained model")
    policy, tokenizer = load_policy(cfg, probe)
    engine = ENGINES.factory(cfg.engine.kind)(policy.eval(), cfg)
    store = TrajectoryStore(store_dir) if store_dir else None
    try:
        return await held_out(cfg, engine, tokenizer, new_env, held, log, store=store)
    finally:
        if store is not None:
            store.close()
        await engine.close()
