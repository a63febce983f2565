"""Held-out evaluation: greedy success on the held-out tasks (and, with ``metrics.eval_samples``,
sampled success and pass@n), during a run and for saved weights (``agentrl eval``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agentrl.config import TrainConfig
from agentrl.env import AgentEnv, Task
from agentrl.registry import ENGINES
from agentrl.rollout.engine import Engine
from agentrl.rollout.from_config import env_factory, load_policy, loop_config, splits
from agentrl.rollout.pool import RolloutPool
from agentrl.trainer.build import Run, rollout_seed
from agentrl.trajectory import succeeded


async def evaluate(run: Run) -> dict[str, float]:
    return await held_out(run.cfg, run.engine, run.tokenizer, run.make_env, run.splits.held_out, run.log)


async def held_out(
    cfg: TrainConfig,
    engine: Engine,
    tokenizer,
    make_env: Callable[[], AgentEnv],
    tasks: Sequence[Task],
    log=print,
) -> dict[str, float]:
    """Held-out success: greedy (``eval_success``), and with ``metrics.eval_samples`` = N > 0 also the
    mean success of N samples per task at the rollout temperature (``eval_success_sampled``) and the
    share of tasks that any of them solves (``eval_pass_at_n``). NaN with no held-out task."""
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
        )

    solved = [succeeded(t.reward) for t in await pool(True, 1).run(list(tasks))]
    result = {"eval_success": sum(solved) / len(solved)}
    text = f"held-out success on {len(tasks)} {cfg.env.eval_split} tasks: {result['eval_success']:.3f}"
    n = cfg.metrics.eval_samples
    if n:
        sampled = [
            succeeded(t.reward) for t in await pool(False, n).run(list(tasks))
        ]  # task order, n per task
        per_task = [any(sampled[i * n : (i + 1) * n]) for i in range(len(tasks))]
        result["eval_success_sampled"] = sum(sampled) / len(sampled)
        result["eval_pass_at_n"] = sum(per_task) / len(per_task)
        text += (
            f" (greedy); {result['eval_success_sampled']:.3f} mean over {n} samples per task at "
            f"temperature {cfg.rollout.temperature:g}, pass@{n} {result['eval_pass_at_n']:.3f}"
        )
    log(text)
    return result


async def evaluate_weights(cfg: TrainConfig, log=print) -> dict[str, float]:
    """``agentrl eval``: held-out success of the policy in ``model.init`` (saved weights, or a checkpoint
    directory of a run), with no training and nothing written."""
    new_env = env_factory(cfg)  # a bad env setting stops here, before the model loads
    probe = new_env()
    held = splits(cfg, probe).held_out
    if not cfg.model.init:
        log("model.init is not set: evaluating the untrained model")
    policy, tokenizer = load_policy(cfg, probe)
    engine = ENGINES.factory(cfg.engine.kind)(policy.eval(), cfg)
    try:
        return await held_out(cfg, engine, tokenizer, new_env, held, log)
    finally:
        await engine.close()
