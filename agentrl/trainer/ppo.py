"""The PPO trainer: collect, recompute, filter, estimate advantages, train critic then actor, sync, save.

    agentrl train recipes/quickstart.yaml [key.sub=value ...]

PPO with a learned value model (Schulman et al. 2017, arXiv 1707.06347) gives token-level credit on
long, sparse-reward agent trajectories; GAE runs over the tokens the policy generated only;
IcePop (arXiv 2510.18855) drops tokens whose training/inference probability ratio leaves its band,
so no KL term is needed (``algo.kl_coef`` defaults to 0). Group estimators (GRPO, RLOO) and the
GSPO / GMPO / SAPO losses are a config switch away.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from agentrl import token_stats
from agentrl.config import TrainConfig
from agentrl.trainer.backend import Batch
from agentrl.trainer.build import Run, loss_config, rollout_seed, setup
from agentrl.trainer.evaluation import evaluate
from agentrl.trainer.phases import advantages, check_collected, rollout_metrics, token_weights
from agentrl.trainer.report import finish, line
from agentrl.trainer.warm_start import warm_start
from agentrl.trajectory import NOT_TRAINABLE


async def train(cfg: TrainConfig, log=print) -> dict:
    run: Run = await setup(cfg, log)
    if run.start == 0:
        # supervised, on demonstrations (sft.episodes) and stored successes (sft.from_store)
        await warm_start(run)
        run.state["eval_before"] = await evaluate(run)
    for it in range(run.start, cfg.run.iterations):
        t0 = time.monotonic()
        # 1. collect: n samples of each task of this iteration's slice of the training set
        tasks, group_ids = run.next_tasks()
        run.pool.config.seed = rollout_seed(cfg, it)  # fresh samples every iteration, reproducibly
        version = run.engine.weight_version  # what the trainer's weights were synced as
        trajectories = await run.pool.run(tasks, extra={"iteration": it})
        kept = [i for i, t in enumerate(trajectories) if t.status not in NOT_TRAINABLE]
        batch = Batch.from_trajectories([trajectories[i] for i in kept], [group_ids[i] for i in kept])
        check_collected(trajectories, cfg, f"iteration {it}")
        t1 = time.monotonic()
        # 2. recompute old log-probs (training engine, at the temperature the engine reported its
        # log-probs at: greedy ones are at 1) and values (critic; GAE only)
        loss = loss_config(cfg)
        batch.old_logprobs = run.backend.logprobs(batch, loss.temperature)
        if cfg.algo.critic:
            batch.old_values = run.backend.values(batch)
        if cfg.algo.kl_coef > 0:
            batch.ref_logprobs = run.backend.ref_logprobs(batch, loss.temperature)
        # 3. IcePop (or TIS) token weights from recomputed vs rollout log-probs
        batch.token_weights, filter_metrics = token_weights(batch, cfg.algo)
        # 4. advantages: GAE over trainable tokens, or a group baseline
        batch.advantages, batch.returns, adv_metrics = advantages(batch, cfg.algo)
        debug = {}
        if cfg.debug.token_stats_every and it % cfg.debug.token_stats_every == 0:
            t_stats = time.monotonic()  # what the trainer saw per token, for agentrl replay --html
            token_stats.write(cfg.run_dir, it, [trajectories[i] for i in kept], batch)
            debug["debug/token_stats_s"] = time.monotonic() - t_stats
        # 5. critic, then actor (after the critic-only warm-up)
        train_metrics = run.backend.train_critic(batch, loss) if cfg.algo.critic else {}
        if it >= cfg.algo.critic_warmup:
            train_metrics |= run.backend.train_actor(batch, loss)
        # 6. weight sync to the inference engine
        await run.engine.update_weights(run.backend.engine_state_dict())
        # 7. checkpoint, then metrics (a resumed run redoes whatever came after its checkpoint)
        record = {"iteration": it, "tasks": [t.id for t in tasks]}
        record |= (
            rollout_metrics(trajectories, t1 - t0, version)
            | filter_metrics
            | adv_metrics
            | train_metrics
            | debug
        )
        record["train_tokens_per_s"] = int(batch.lengths.sum()) / max(time.monotonic() - t1, 1e-9)
        # tasks trained on fewer than n samples (failed episodes left out): a group baseline over fewer
        kept_per_task = Counter(group_ids[i] for i in kept)
        record["short_groups"] = sum(kept_per_task[k] < cfg.rollout.n_samples for k in range(len(tasks)))
        if cfg.metrics.eval_every and (it + 1) % cfg.metrics.eval_every == 0:
            record |= await evaluate(run)
        run.save(it, record)
        run.log(line(record))
    return await finish(run)


def main(cfg: TrainConfig) -> dict:
    return asyncio.run(train(cfg))
