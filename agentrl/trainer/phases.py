"""The named phases of a PPO iteration that turn a collected batch into training targets: token
weights (IcePop or TIS) and advantages (GAE over trainable tokens, or a group baseline), built from
the pure functions of ``agentrl.algo``; plus the rollout metrics an iteration logs."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from agentrl.algo import (
    explained_variance,
    gae,
    group_advantages,
    icepop_weights,
    place_rewards,
    tis_weights,
    whiten,
)
from agentrl.config import AlgoConfig, ConfigError, TrainConfig
from agentrl.trainer.backend import Batch
from agentrl.trajectory import CUT_OFF, NOT_TRAINABLE, Trajectory, succeeded


def check_collected(trajectories: list[Trajectory], cfg: TrainConfig, what: str) -> None:
    """Stop the run when a whole batch of episodes (``what``: an iteration's, the held-out ones)
    gave nothing to learn from or to measure: no episode both ended normally (not env_error,
    engine_error or aborted) and holds a token the policy generated. That is a broken environment,
    sandbox or engine, or a prompt over ``rollout.max_context``, not a policy that has yet to learn;
    going on would train on nothing and report 0 as a measurement."""
    if not trajectories or any(t.status not in NOT_TRAINABLE and any(t.loss_mask) for t in trajectories):
        return
    statuses = dict(Counter(t.status for t in trajectories))
    failed = next((t for t in trajectories if t.extra.get("error")), None)
    first = f"; the first error ({failed.task_id}): {failed.extra['error']}" if failed is not None else ""
    if all(t.status == "truncated_context" and not t.finish_reasons for t in trajectories):
        hint = (
            f"the prompts alone fill rollout.max_context={cfg.rollout.max_context} tokens: raise it, "
            "or shorten the environment's prompt"
        )
    elif statuses.keys() <= {"engine_error", "aborted"}:
        hint = f"check the inference engine (engine.kind={cfg.engine.kind})"
    else:
        hint = (
            f"check the environment and its sandbox: agentrl envs check {cfg.env.id} "
            f"(sandbox.kind={cfg.sandbox.kind})"
        )
    raise ConfigError(
        f"{what}: none of its {len(trajectories)} episodes holds a token the policy generated and "
        f"ended normally (statuses {statuses}){first}; {hint}"
    )


def token_weights(batch: Batch, algo: AlgoConfig) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Per-token weights from the recomputed (``old_logprobs``) and rollout log-probs:
    ``algo.token_filter`` = ``icepop`` (out-of-band tokens dropped), ``tis`` (weights truncated at
    ``icepop_high``) or ``none`` (None: every trainable token weighs 1)."""
    if algo.token_filter == "none":
        return None, {}
    if algo.token_filter == "tis":
        return tis_weights(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, algo.icepop_high)
    weights, metrics = icepop_weights(
        batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, algo.icepop_low, algo.icepop_high
    )
    gap = (batch.old_logprobs - batch.rollout_logprobs)[batch.loss_mask]
    metrics["logprob_gap_mean_abs"] = float(gap.abs().mean()) if gap.numel() else 0.0
    return weights, metrics


def advantages(batch: Batch, algo: AlgoConfig) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """``(advantages, returns, metrics)`` over the trainable tokens: GAE from the critic's
    ``old_values`` with the episode reward on the last trainable token, whitened with
    ``algo.normalize_advantages``; or the group baseline of ``algo.estimator`` spread over the row,
    as it is (normalised within its group already: a group whose samples all earned the same
    reward keeps advantage 0)."""
    mask = batch.loss_mask
    metrics: dict[str, float] = {}
    if algo.estimator == "gae":
        adv, ret = gae(place_rewards(batch.rewards, mask), batch.old_values, mask, algo.gamma, algo.lam)
        # How much of the return the values behind these advantages explained (before this batch's
        # critic update; critic/value_explained_var is measured while the critic fits the batch).
        metrics["critic/explained_var_before"] = explained_variance(batch.old_values, ret, mask)
    else:
        seq, metrics = group_advantages(batch.rewards, batch.group_ids, algo.estimator)
        adv = torch.where(mask, seq[:, None].expand_as(mask), torch.zeros(()))
        ret = torch.where(mask, batch.rewards[:, None].expand_as(mask), torch.zeros(()))
    raw = adv[mask]
    metrics["zero_adv_frac"] = float((raw == 0).float().mean()) if raw.numel() else 0.0
    if algo.normalize_advantages and algo.critic:
        adv = whiten(adv, mask)
    metrics["advantage_mean_abs"] = float(raw.abs().mean()) if raw.numel() else 0.0
    return adv, ret, metrics


def offpolicy_tokens(trajectories: list[Trajectory], weight_version: str) -> tuple[int, int]:
    """``(off-policy, all)`` sampled tokens: those of assistant turns whose weight version is not
    ``weight_version`` (the one the trainer's weights were last synced as), e.g. turns an engine
    sampled before a sync that happened during collection."""
    off = total = 0
    for t in trajectories:
        spans = [s for s in t.turns if s.role == "assistant"]
        for version, span in zip(t.weight_versions, spans, strict=False):
            total += span.end - span.start
            off += (span.end - span.start) if version != weight_version else 0
    return off, total


def rollout_metrics(
    trajectories: list[Trajectory], seconds: float, weight_version: str | None = None
) -> dict[str, Any]:
    n = max(len(trajectories), 1)
    statuses = Counter(t.status for t in trajectories)
    tokens = sum(len(t) for t in trajectories)
    extra: dict[str, Any] = {}
    if weight_version is not None:
        off, sampled = offpolicy_tokens(trajectories, weight_version)
        extra = {"offpolicy_tokens": off, "offpolicy_token_frac": off / max(sampled, 1)}
    return extra | {
        "reward_mean": sum(t.reward for t in trajectories) / n,
        "success_rate": sum(succeeded(t.reward) for t in trajectories) / n,
        "statuses": dict(statuses),
        "truncation_rate": sum(statuses[s] for s in CUT_OFF) / n,
        "turns_mean": sum(len(t.finish_reasons) for t in trajectories) / n,
        "length_mean": tokens / n,
        "tool_call_errors": sum(t.extra.get("tool_call_errors", 0) for t in trajectories) / n,
        "rollout_tokens_per_s": tokens / max(seconds, 1e-9),
    }
