"""The plumbing behind the PPO loop's named phases: building the run, filters, advantages, evaluation."""

from __future__ import annotations

import asyncio
import copy
import difflib
import inspect
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agentrl.algo import explained_variance, forking_tokens, gae, group_advantages, icepop_weights
from agentrl.config import AlgoConfig, ConfigError, TrainConfig, make_env, writable_dir
from agentrl.env import Task, make
from agentrl.rollout.agent_loop import LoopConfig, _Renderer, run_episode
from agentrl.rollout.local import LocalEngine
from agentrl.rollout.pool import RolloutPool
from agentrl.store import TrajectoryStore
from agentrl.trainer.backend import Batch, LossConfig
from agentrl.trainer.checkpoint import Checkpoints
from agentrl.trainer.data import TaskCursor
from agentrl.trainer.metrics import MetricsLogger
from agentrl.trainer.torch_backend import TorchBackend
from agentrl.trajectory import Trajectory


@dataclass
class Run:
    cfg: TrainConfig
    log: Any
    policy: Any
    tokenizer: Any
    engine: LocalEngine
    backend: TorchBackend
    pool: RolloutPool
    store: TrajectoryStore
    metrics: MetricsLogger
    checkpoints: Checkpoints
    cursor: TaskCursor
    probe_env: Any
    start: int = 0
    state: dict[str, Any] = field(default_factory=dict)
    started_at: float = field(default_factory=time.monotonic)

    def next_tasks(self) -> tuple[list[Task], list[int]]:
        cfg = self.cfg
        indices = self.cursor.next(cfg.rollout.tasks_per_iteration)
        tasks = [self.probe_env.task(cfg.env.train_split, i) for i in indices]
        # the pool runs n samples of each task; sample s of task k has group id k
        groups = [k for k in range(len(tasks)) for _ in range(cfg.rollout.n_samples)]
        return tasks, groups

    def save(self, iteration: int, record: dict[str, Any]) -> None:
        if (iteration + 1) % self.cfg.run.checkpoint_every == 0 or iteration + 1 == self.cfg.run.iterations:
            self.checkpoints.save(
                iteration + 1, self.backend, {"cursor": self.cursor.state(), "state": self.state}
            )
        self.metrics.log(record)
        self.log(_line(record))


def _line(r: dict[str, Any]) -> str:
    keys = [
        ("reward", "reward_mean"),
        ("success", "success_rate"),
        ("icepop", "icepop_masked_frac"),
        ("clip", "actor/clip_frac"),
        ("kl", "actor/approx_kl"),
        ("ent", "actor/entropy"),
        ("ev", "critic/explained_var_before"),
        ("trunc", "truncation_rate"),
    ]
    parts = [f"iter {r['iteration']:3d}"] + [f"{name} {r[k]:.3f}" for name, k in keys if k in r]
    return "  ".join(parts)


def loss_config(cfg: TrainConfig) -> LossConfig:
    a = cfg.algo
    return LossConfig(
        kind=a.policy_loss,
        clip_low=a.clip_low,
        clip_high=a.clip_high,
        dual_clip=a.dual_clip,
        agg=a.agg,
        kl_coef=a.kl_coef,
        temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
        value_clip=a.value_clip,
    )


def loop_config(cfg: TrainConfig, *, greedy: bool = False) -> LoopConfig:
    r = cfg.rollout
    return LoopConfig(
        max_turns=r.max_turns,
        max_context=r.max_context,
        max_new_tokens=r.max_new_tokens,
        temperature=0.0 if greedy else r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        tool_format=r.tool_format,
        deadline_s=r.deadline_s,
        seed=None if greedy else cfg.run.seed,
    )


def _load_policy(cfg: TrainConfig):
    from agentrl.models import load_model, tiny_chat_model

    if cfg.model.name == "tiny":
        policy, tokenizer = tiny_chat_model(
            seed=cfg.run.seed, hidden=cfg.model.tiny_hidden, layers=cfg.model.tiny_layers
        )
    else:
        try:
            policy, tokenizer = load_model(cfg.model.name)
        except (ImportError, OSError, ValueError) as e:
            raise ConfigError(f"model.name={cfg.model.name}: {e}") from None
    if cfg.model.init:
        try:
            if Path(cfg.model.init).is_dir():  # a run's checkpoint directory: the actor's weights in it
                saved = torch.load(
                    Path(cfg.model.init) / "backend.pt", map_location="cpu", weights_only=False
                )
                state = saved["policy"]
            else:
                state = torch.load(cfg.model.init, map_location="cpu", weights_only=True)
            policy.load_state_dict(state)
        except (OSError, RuntimeError, KeyError) as e:
            raise ConfigError(
                f"model.init: cannot load {cfg.model.init} into the {cfg.model.name} model: {e!r}"
            ) from None
    return policy, tokenizer


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


async def setup(cfg: TrainConfig, log=print) -> Run:
    # A bad setting stops the run here, before anything is built: env, expert keys, output directory.
    probe_env = make_env(cfg.env.id, cfg.env.args, "env.args")
    if cfg.sft.episodes:
        _expert_texts(cfg)
    run_dir = writable_dir(cfg.run_dir, "run.output_dir")
    _seed(cfg.run.seed)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    policy, tokenizer = _load_policy(cfg)
    o = cfg.optim
    iters = cfg.run.iterations
    backend = TorchBackend(
        policy,
        actor_lr=o.actor_lr,
        critic_lr=o.critic_lr,
        weight_decay=o.weight_decay,
        adam_eps=o.adam_eps,
        actor_frozen=o.actor_frozen,
        actor_optimizer=o.actor_optimizer,
        warmup_steps=o.warmup_steps,
        schedule=o.schedule,
        total_steps=iters * o.epochs * o.minibatches,
        grad_clip=o.grad_clip,
        epochs=o.epochs,
        critic_epochs=o.critic_epochs,
        minibatches=o.minibatches,
        micro_token_budget=o.micro_token_budget,
        packing=o.packing,
        logprob_chunk=o.logprob_chunk,
        dtype=cfg.model.dtype,
        reference=cfg.algo.kl_coef > 0,
        seed=cfg.run.seed,
    )
    # The inference engine holds its own copy of the weights, synced after every update.
    engine = LocalEngine(copy.deepcopy(policy).eval())
    env_factory = lambda: make(cfg.env.id, **cfg.env.args)  # noqa: E731
    store = TrajectoryStore(run_dir / "trajectories")
    pool = RolloutPool(
        env_factory,
        engine,
        tokenizer,
        loop_config(cfg),
        store=store,
        concurrency=cfg.rollout.concurrency,
        n_samples=cfg.rollout.n_samples,
        progress=cfg.metrics.progress,
    )
    metrics = MetricsLogger(
        run_dir,
        tensorboard=cfg.metrics.tensorboard,
        wandb=cfg.metrics.wandb,
        wandb_mode=cfg.metrics.wandb_mode,
        config=cfg.model_dump(),
    )
    checkpoints = Checkpoints(run_dir, keep=cfg.run.keep_checkpoints)
    cursor = TaskCursor(cfg.env.train_tasks, seed=cfg.run.seed)
    run = Run(
        cfg, log, policy, tokenizer, engine, backend, pool, store, metrics, checkpoints, cursor, probe_env
    )
    latest = checkpoints.latest() if cfg.run.resume else None
    if cfg.run.resume and latest is None:
        log(f"resume=true but {checkpoints.dir} holds no complete checkpoint: starting from scratch")
    if latest is not None:
        saved = checkpoints.load(latest, backend)
        run.start = saved["iteration"]
        cursor.restore(saved["cursor"])
        run.state = saved.get("state", {})
        metrics.truncate_after(run.start - 1)
        await engine.update_weights(backend.engine_state_dict())
        log(f"resumed from {latest} at iteration {run.start}")
    elif not cfg.run.resume:
        metrics.truncate_after(-1)
    return run


async def expert_episodes(cfg: TrainConfig, tokenizer, indices: list[int]) -> list[Trajectory]:
    """The scripted expert's episodes on training tasks ``indices``, played through the real loop
    (the same rendering, parsing, tools and grading as the policy's), ``rollout.concurrency`` at a
    time; an ``Untrained`` turn (a deliberate wrong edit) gets loss mask 0, so a warm start learns
    the recovery but not the mistake."""
    from agentrl.rollout.scripted import Miss, ScriptedEngine, Untrained

    expert_texts = _expert_texts(cfg)
    renderer = _Renderer(tokenizer, None)
    loop = loop_config(cfg)
    loop.max_turns, loop.max_new_tokens = max(loop.max_turns, 8), max(loop.max_new_tokens, 1024)
    loop.max_context = max(loop.max_context, 16384)
    slots = asyncio.Semaphore(cfg.rollout.concurrency)

    async def one(index: int) -> Trajectory:
        env = make(cfg.env.id, **cfg.env.args)
        task = env.task(cfg.env.train_split, index)
        obs = env.observation(task)  # the prompt the loop will send, rendered without a sandbox
        engine = ScriptedEngine(tokenizer)  # one per episode: two tasks may render the same prompt
        texts = expert_texts(env.task_spec(task), cfg.rollout.tool_format, **cfg.sft.expert)
        engine.add(renderer.prompt(obs.messages, obs.tools), texts)
        async with slots:
            trajectory = await run_episode(env, engine, tokenizer, task, loop, renderer=renderer)
        played = [s for s in trajectory.turns if s.role == "assistant"]
        for text, span in zip(texts, played, strict=False):
            if isinstance(text, Untrained):
                trajectory.loss_mask[span.start : span.end] = [0] * (span.end - span.start)
                trajectory.rollout_logprobs[span.start : span.end] = [0.0] * (span.end - span.start)
        trajectory.extra["expert_miss"] = any(isinstance(text, Miss) for text in texts)
        return trajectory

    return list(await asyncio.gather(*(one(i) for i in indices)))


def sft_episodes(trajectories: list[Trajectory]) -> tuple[list[Trajectory], int]:
    """The expert episodes a warm start trains on, in order, and how many of them are slipped fixes:
    the solved ones and the deliberate slips (``sft.expert.miss``), all submitted. An episode cut off
    by the turn limit would teach not to submit; a failure the expert did not mean is left out."""
    solved = [t.reward == 1.0 and t.status == "completed" for t in trajectories]
    if not any(solved):
        raise RuntimeError(
            f"the scripted expert solved none of {len(trajectories)} warm-start episodes: "
            f"{Counter(t.status for t in trajectories)}"
        )
    slips = [
        t.extra.get("expert_miss", False) and t.reward == 0.0 and t.status == "completed"
        for t in trajectories
    ]
    kept = [t for t, a, b in zip(trajectories, solved, slips, strict=True) if a or b]
    return kept, sum(slips)


async def warm_start(run: Run) -> None:
    """Supervised warm start on the scripted expert's episodes, played through the real loop."""
    cfg = run.cfg
    if cfg.sft.episodes == 0:
        return
    # Expert episodes use training tasks from the far end of the training set's index range.
    indices = [cfg.env.train_tasks + i for i in range(cfg.sft.episodes)]
    trajectories = await expert_episodes(cfg, run.tokenizer, indices)
    kept, slipped = sft_episodes(trajectories)
    batch = Batch.from_trajectories(kept)
    losses = run.backend.train_sft(batch, epochs=cfg.sft.epochs, lr=cfg.sft.lr, batch_size=cfg.sft.batch_size)
    run.backend.reset_critic()  # the value model starts from the warm-started weights, as with model.init
    run.backend.reset_reference()  # and so does the KL's reference (algo.kl_coef > 0)
    critic = pretrain_critic(run, batch) if cfg.sft.critic_epochs else {}
    await run.engine.update_weights(run.backend.engine_state_dict())
    torch.save(run.backend.engine_state_dict(), cfg.run_dir / "warm_start.pt")  # model.init= to reuse it
    run.state["sft"] = {
        "episodes": len(kept),
        "slipped": slipped,
        "loss_first": losses[0],
        "loss_last": losses[-1],
    } | critic
    run.log(
        f"warm start: {len(kept)} expert episodes ({slipped} with a slipped fix), "
        f"SFT loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        + (
            f"; critic explained variance {critic['critic_ev_first']:.2f} -> {critic['critic_ev_last']:.2f}"
            if critic
            else ""
        )
    )


def pretrain_critic(run: Run, batch: Batch) -> dict[str, float]:
    """``sft.critic_epochs`` critic epochs on the warm start's expert episodes (``sft.batch_size`` of them
    per step), against the returns the loop's GAE gives them. Returns the explained variance of those
    returns by the values before the first epoch and after the last."""
    cfg = run.cfg
    first = None
    for _ in range(cfg.sft.critic_epochs):  # targets re-derived each epoch, as each RL batch's are
        batch.old_values = run.backend.values(batch)
        batch.advantages, batch.returns, metrics = advantages(batch, cfg.algo)
        first = metrics["critic/explained_var_before"] if first is None else first
        run.backend.train_critic(
            batch, loss_config(cfg), epochs=1, minibatches=max(1, batch.size // cfg.sft.batch_size)
        )
    last = explained_variance(run.backend.values(batch), batch.returns, batch.loss_mask)
    return {"critic_epochs": cfg.sft.critic_epochs, "critic_ev_first": first, "critic_ev_last": last}


def _expert_texts(cfg: TrainConfig):
    if cfg.env.id != "bugfix-v0":
        raise ConfigError(
            f"sft.episodes > 0 needs a scripted expert; only bugfix-v0 has one (env.id is {cfg.env.id}): "
            "set sft.episodes=0 or env.id=bugfix-v0"
        )
    from agentrl.envs.bugfix import expert_texts

    known = [p for p in inspect.signature(expert_texts).parameters if p not in ("spec", "tool_format")]
    for key in cfg.sft.expert:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            raise ConfigError(
                f"sft.expert.{key}: the bugfix-v0 expert takes {known}"
                + (f"; did you mean {close[0]!r}?" if close else "")
            )
    return expert_texts


def rollout_seed(cfg: TrainConfig, iteration: int) -> int:
    """Sampling seed of an iteration's rollouts (fresh every iteration, reproducibly); held-out
    evaluation samples with iteration -1's, which no training iteration uses."""
    return cfg.run.seed * 1_000_003 + iteration


async def evaluate(run: Run) -> dict[str, float]:
    return await held_out(run.cfg, run.engine, run.tokenizer, run.log)


async def held_out(cfg: TrainConfig, engine, tokenizer, log=print) -> dict[str, float]:
    """Held-out success: greedy (``eval_success``), and with ``metrics.eval_samples`` = N > 0 also the
    mean success of N samples per task at the rollout temperature (``eval_success_sampled``) and the
    share of tasks that any of them solves (``eval_pass_at_n``)."""
    if cfg.env.eval_tasks == 0:
        return {"eval_success": float("nan")}
    probe = make(cfg.env.id, **cfg.env.args)
    tasks = [probe.task(cfg.env.eval_split, i) for i in range(cfg.env.eval_tasks)]

    def pool(greedy: bool, n_samples: int) -> RolloutPool:
        config = loop_config(cfg, greedy=greedy)
        if not greedy:  # the same random numbers at every evaluation of the run, none shared with training
            config.seed = rollout_seed(cfg, -1)
        return RolloutPool(
            lambda: make(cfg.env.id, **cfg.env.args),
            engine,
            tokenizer,
            config,
            concurrency=cfg.rollout.concurrency,
            n_samples=n_samples,
            progress=False,
        )

    solved = [t.reward >= 1.0 for t in await pool(True, 1).run(tasks)]
    result = {"eval_success": sum(solved) / len(solved)}
    text = f"held-out success on {len(tasks)} {cfg.env.eval_split} tasks: {result['eval_success']:.3f}"
    n = cfg.metrics.eval_samples
    if n:
        sampled = [t.reward >= 1.0 for t in await pool(False, n).run(tasks)]  # in task order, n per task
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
    make_env(cfg.env.id, cfg.env.args, "env.args")  # a bad env setting stops here, before the model loads
    if not cfg.model.init:
        log("model.init is not set: evaluating the untrained model")
    policy, tokenizer = _load_policy(cfg)
    engine = LocalEngine(policy.eval())
    try:
        return await held_out(cfg, engine, tokenizer, log)
    finally:
        await engine.close()


def token_weights(batch: Batch, algo: AlgoConfig) -> tuple[torch.Tensor | None, dict[str, float]]:
    weights, metrics = _filter_weights(batch, algo)
    if algo.entropy_top is None:
        return weights, metrics
    if batch.old_entropy is None:
        raise ValueError("algo.entropy_top needs the old policy's entropies (batch.old_entropy)")
    keep, fork_metrics = forking_tokens(batch.old_entropy, batch.loss_mask, algo.entropy_top)
    weights = keep.float() if weights is None else weights * keep
    return weights, metrics | fork_metrics


def _filter_weights(batch: Batch, algo: AlgoConfig) -> tuple[torch.Tensor | None, dict[str, float]]:
    if algo.token_filter == "none":
        return None, {}
    weights, metrics = icepop_weights(
        batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, algo.icepop_low, algo.icepop_high
    )
    if algo.token_filter == "tis":
        # Truncated importance sampling: keep every token, weight min(k, high).
        k = torch.exp(batch.old_logprobs - batch.rollout_logprobs)
        weights = torch.where(batch.loss_mask, k.clamp(max=algo.icepop_high), torch.zeros_like(k))
        return weights, {
            "tis_mean_weight": float(weights[batch.loss_mask].mean()) if batch.loss_mask.any() else 1.0
        }
    gap = (batch.old_logprobs - batch.rollout_logprobs)[batch.loss_mask]
    metrics["logprob_gap_mean_abs"] = float(gap.abs().mean()) if gap.numel() else 0.0
    return weights, metrics


def advantages(batch: Batch, algo: AlgoConfig) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    mask = batch.loss_mask
    metrics: dict[str, float] = {}
    if algo.estimator == "gae":
        rewards = torch.zeros_like(batch.old_values)
        has = mask.any(1)
        last = torch.where(mask, torch.arange(mask.shape[1]), -1).max(1).values  # last trainable token
        rows = torch.nonzero(has).squeeze(1)
        rewards[rows, last[rows]] = batch.rewards[rows]
        adv, ret = gae(rewards, batch.old_values, mask, algo.gamma, algo.lam)
        # How much of the return the values behind these advantages explained (before this batch's
        # critic update; critic/value_explained_var is measured while the critic fits the batch).
        metrics["critic/explained_var_before"] = explained_variance(batch.old_values, ret, mask)
    else:
        seq, metrics = group_advantages(batch.rewards, batch.group_ids, algo.estimator)
        adv = torch.where(mask, seq[:, None].expand_as(mask), torch.zeros(()))
        ret = torch.where(mask, batch.rewards[:, None].expand_as(mask), torch.zeros(()))
    raw = adv[mask]
    metrics["zero_adv_frac"] = float((raw == 0).float().mean()) if raw.numel() else 0.0
    if algo.normalize_advantages and raw.numel() > 1 and float(raw.std()) > 0:
        adv = torch.where(mask, (adv - raw.mean()) / (raw.std() + 1e-8), torch.zeros(()))
    metrics["advantage_mean_abs"] = float(raw.abs().mean()) if raw.numel() else 0.0
    return adv, ret, metrics


CUT_OFF = ("truncated_context", "max_turns", "timeout")  # a budget ended the episode, not the policy


def actor_rows(batch: Batch, statuses: list[str], algo: AlgoConfig) -> tuple[Batch, dict[str, float]]:
    """The batch the actor trains on: with ``algo.mask_truncated``, cut-off episodes get loss mask 0
    (they leave the loss's token count too); the critic keeps the whole batch."""
    if not algo.mask_truncated:
        return batch, {}
    cut = torch.tensor([s in CUT_OFF for s in statuses], dtype=torch.bool)
    masked = replace(batch, loss_mask=batch.loss_mask & ~cut[:, None])
    return masked, {"actor/masked_truncated_frac": float(cut.float().mean()) if len(statuses) else 0.0}


def rollout_metrics(trajectories: list[Trajectory], seconds: float) -> dict[str, Any]:
    n = max(len(trajectories), 1)
    statuses = Counter(t.status for t in trajectories)
    tokens = sum(len(t) for t in trajectories)
    return {
        "reward_mean": sum(t.reward for t in trajectories) / n,
        "success_rate": sum(t.reward >= 1.0 for t in trajectories) / n,
        "statuses": dict(statuses),
        "truncation_rate": sum(statuses[s] for s in CUT_OFF) / n,
        "turns_mean": sum(len(t.finish_reasons) for t in trajectories) / n,
        "length_mean": tokens / n,
        "tool_call_errors": sum(t.extra.get("tool_call_errors", 0) for t in trajectories) / n,
        "rollout_tokens_per_s": tokens / max(seconds, 1e-9),
    }


async def finish(run: Run) -> dict[str, Any]:
    cfg = run.cfg
    evals_after = await evaluate(run)
    evals_before = run.state.get("eval_before", {})
    if not isinstance(evals_before, dict):  # a checkpoint written before evaluate() returned a dict
        evals_before = {"eval_success": evals_before}
    before = evals_before.get("eval_success", float("nan"))
    after = evals_after["eval_success"]
    summary = {
        "run_dir": str(cfg.run_dir),
        "iterations": cfg.run.iterations,
        "eval_before": before,
        "eval_after": after,
    }
    for key, name in (("eval_success_sampled", "sampled"), ("eval_pass_at_n", "pass_at_n")):
        if key in evals_after:  # with metrics.eval_samples > 0
            summary[f"eval_before_{name}"] = evals_before.get(key, float("nan"))
            summary[f"eval_after_{name}"] = evals_after[key]
    summary["seconds"] = time.monotonic() - run.started_at
    (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    curve = plot_curve(run.metrics.read(), cfg.run_dir / "curve.png", before, after)
    run.store.close()
    run.metrics.close()
    await run.engine.close()
    run.log(
        f"{cfg.run.name}: held-out success {before:.3f} -> {after:.3f} over {cfg.run.iterations} iterations "
        f"in {summary['seconds']:.0f}s; curve {curve or '(matplotlib not installed)'}"
    )
    return summary


def plot_curve(records: list[dict[str, Any]], path, before: float, after: float) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    its = [r["iteration"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(its, [r.get("reward_mean", 0) for r in records], label="train reward")
    ax.plot(its, [r.get("success_rate", 0) for r in records], label="train success")
    evals = [(r["iteration"], r["eval_success"]) for r in records if "eval_success" in r]
    points = [(-1, before), *evals, (its[-1] if its else 0, after)]
    ax.plot([p[0] for p in points], [p[1] for p in points], "o--", label="held-out success")
    ax.set_xlabel("iteration")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
