"""What the trainer needs from a training backend, and the batch it hands over.

Per-token tensors are ``[B, T]`` (rows padded to the longest trajectory; backends pack rows
without padding for the forward pass). Column ``t`` describes token ``t`` of the trajectory:
its log-prob given tokens ``< t``, the value of the state before it, its advantage. Column 0 is
never trainable (a trajectory starts with its prompt).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from agentrl.trajectory import Trajectory


@dataclass
class Batch:
    input_ids: Tensor
    """[B, T] long, padded with 0 past each row's length."""
    lengths: Tensor
    """[B] tokens per row."""
    loss_mask: Tensor
    """[B, T] bool: tokens the policy sampled."""
    rollout_logprobs: Tensor
    """[B, T] the inference engine's log-probs (0 off the mask)."""
    rewards: Tensor
    """[B] episode rewards."""
    group_ids: Tensor
    """[B] which task each row is a sample of."""
    old_logprobs: Tensor | None = None
    """[B, T] training backend's log-probs before the update."""
    ref_logprobs: Tensor | None = None
    old_values: Tensor | None = None
    advantages: Tensor | None = None
    returns: Tensor | None = None
    token_weights: Tensor | None = None
    """[B, T] IcePop / TIS weights."""

    @classmethod
    def from_trajectories(cls, trajectories: list[Trajectory], group_ids: list[int] | None = None) -> Batch:
        n = len(trajectories)
        width = max((len(t) for t in trajectories), default=1)
        ids = torch.zeros((n, width), dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.bool)
        logps = torch.zeros((n, width), dtype=torch.float32)
        for i, t in enumerate(trajectories):
            k = len(t)
            ids[i, :k] = torch.tensor(t.input_ids, dtype=torch.long)
            mask[i, :k] = torch.tensor(t.loss_mask, dtype=torch.bool)
            logps[i, :k] = torch.tensor(t.rollout_logprobs, dtype=torch.float32)
        mask[:, 0] = False  # the first token has no prefix to be predicted from
        return cls(
            input_ids=ids,
            lengths=torch.tensor([len(t) for t in trajectories], dtype=torch.long),
            loss_mask=mask,
            rollout_logprobs=logps,
            rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
            group_ids=torch.tensor(group_ids if group_ids is not None else list(range(n)), dtype=torch.long),
        )

    def rows(self, index: Tensor | list[int]) -> Batch:
        """The sub-batch of the given rows (tensors sliced; None stays None)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        return Batch(**{k: (v[idx] if isinstance(v, Tensor) else v) for k, v in self.__dict__.items()})

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class LossConfig:
    kind: str = "ppo"
    clip_low: float | None = None
    """The ratio's band (``ppo``, ``gspo``); None: the loss's own."""
    clip_high: float | None = None
    dual_clip: float | None = None
    agg: str = "token-mean"
    kl_coef: float = 0.0
    temperature: float = 1.0
    """Sampling temperature of the rollout: log-probs are recomputed at it."""
    value_clip: float | None = 0.2


def actor_agg(loss: LossConfig) -> str:
    """How the actor's per-token terms are averaged: ``loss.agg`` for ``ppo`` and ``sapo``; ``gspo``
    and ``gmpo`` are sequence-level objectives (a row's mean, then the mean over rows). A backend
    weighs each micro-batch by its share of the minibatch's tokens or rows to match."""
    return loss.agg if loss.kind in ("ppo", "sapo") else "seq-mean-token-mean"


def actor_objective(
    logp: Tensor, entropy: Tensor, sub: Batch, loss: LossConfig, device: torch.device
) -> tuple[Tensor, dict[str, float]]:
    """The actor's loss on one micro-batch ``sub`` (its rows' log-probs and entropies, ``[b, T]``):
    the policy loss, plus ``loss.kl_coef`` times the KL to the reference aggregated as the policy
    loss is (so that micro-batches weighed by their share sum to the loss of the whole minibatch);
    metrics ``policy_loss`` and ``entropy`` (a metric only: no entropy bonus)."""
    from agentrl.algo import aggregate, kl_penalty, policy_loss

    mask = sub.loss_mask.to(device)
    band = {"clip_low": loss.clip_low, "clip_high": loss.clip_high}
    if loss.kind == "gspo":  # its band is a parameter of its own
        band = {"gspo_clip_low": loss.clip_low, "gspo_clip_high": loss.clip_high}
    value, metrics = policy_loss(
        logp,
        sub.old_logprobs.to(device),
        sub.advantages.to(device),
        mask,
        loss.kind,
        **{k: v for k, v in band.items() if v is not None},
        dual_clip=loss.dual_clip,
        token_weights=None if sub.token_weights is None else sub.token_weights.to(device),
        agg=loss.agg,
    )
    if loss.kl_coef > 0:
        kl, kl_metrics = kl_penalty(logp, sub.ref_logprobs.to(device), mask)
        value = value + loss.kl_coef * aggregate(kl, mask, actor_agg(loss))
        metrics.update(kl_metrics)
    metrics["policy_loss"] = float(value.detach())
    # a rising entropy is the first sign of a degrading policy
    metrics["entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1))
    return value, metrics


def critic_objective(
    values: Tensor, sub: Batch, loss: LossConfig, device: torch.device
) -> tuple[Tensor, dict[str, float]]:
    """The value model's loss on one micro-batch ``sub`` (its rows' values, ``[b, T]``); metrics
    ``value_loss`` and ``value_loss``'s own, with the sums ``PartMetrics`` needs for the minibatch's
    explained variance (``_ev_*``)."""
    from agentrl.algo.losses import explained_variance_sums, value_loss

    mask = sub.loss_mask.to(device)
    returns = sub.returns.to(device)
    value, metrics = value_loss(values, sub.old_values.to(device), returns, mask, clip=loss.value_clip)
    metrics["value_loss"] = float(value.detach())
    # the minibatch's explained variance comes from its parts' sums (PartMetrics)
    metrics |= {f"_ev_{k}": v for k, v in explained_variance_sums(values, returns, mask).items()}
    return value, metrics


class PartMetrics:
    """A minibatch's metrics from those of its parts (micro-batches, data-parallel ranks), as if
    computed on the whole minibatch, whatever the packing: a ``*_loss`` weighed by each part's share
    of the minibatch's loss (the parts sum to its loss), a ``*_min`` / ``*_max`` as the least /
    greatest, ``value_explained_var`` from the parts' sums (``_ev_*``), and the rest (means and
    fractions over trainable tokens) weighed by each part's trainable tokens."""

    def __init__(self) -> None:
        self.state: dict[str, float] = {}

    def add(self, metrics: dict[str, float], share: float, tokens: int) -> None:
        part = {"_tokens": float(tokens)}
        for k, v in metrics.items():
            if k.startswith("_") or k.endswith(("_min", "_max")):
                part[k] = v
            elif k.endswith("_loss"):
                part[k] = v * share
            else:
                part[k] = v * tokens
        self.merge(part)

    def merge(self, other: dict[str, float]) -> None:
        """Take in another part's ``state`` (a data-parallel rank's)."""
        for k, v in other.items():
            if k not in self.state:
                self.state[k] = v
            elif k.endswith("_min"):
                self.state[k] = min(self.state[k], v)
            elif k.endswith("_max"):
                self.state[k] = max(self.state[k], v)
            else:
                self.state[k] += v

    def result(self) -> dict[str, float]:
        s = self.state
        tokens = s.get("_tokens", 0.0)
        out = {}
        for k, v in s.items():
            if k.startswith("_"):
                continue
            if k.endswith(("_min", "_max", "_loss")):
                out[k] = v
            else:
                out[k] = v / tokens if tokens else 0.0
        if "value_explained_var" in out and "_ev_n" in s:
            from agentrl.algo.losses import explained_variance_from_sums

            sums = {k.removeprefix("_ev_"): v for k, v in s.items() if k.startswith("_ev_")}
            out["value_explained_var"] = explained_variance_from_sums(sums)
        return out


@runtime_checkable
class TrainBackend(Protocol):
    """What the PPO loop and the warm start need from a training backend (``trainer.backend`` names
    one registered in ``agentrl.registry.BACKENDS``; a factory builds it from the policy and the
    whole config).

    - ``logprobs`` / ``ref_logprobs`` / ``values``: ``[B, T]`` per token (column t: token t given
      tokens < t; the value of the state before it), at the rollout temperature.
    - ``train_actor`` / ``train_critic``: one PPO update of each on a batch with advantages and
      returns; metrics as floats. ``train_sft``: supervised epochs on the trainable tokens (the warm
      start), the loss of each step.
    - ``reset_critic`` / ``reset_reference``: the value model and the KL's reference start again from
      the policy's current weights (after a warm start).
    - ``engine_state_dict``: the policy's weights as the inference engine loads them;
      ``save`` / ``load``: the whole training state (weights, optimizers, schedules, RNG) for resume.
    - ``device``: where the policy trains.
    """

    device: torch.device

    def logprobs(self, batch: Batch, temperature: float = 1.0) -> Tensor: ...
    def ref_logprobs(self, batch: Batch, temperature: float = 1.0) -> Tensor: ...
    def values(self, batch: Batch) -> Tensor: ...
    def train_actor(self, batch: Batch, loss: LossConfig) -> dict[str, float]: ...
    def train_critic(
        self, batch: Batch, loss: LossConfig, *, epochs: int | None = None, minibatches: int | None = None
    ) -> dict[str, float]: ...
    def train_sft(self, batch: Batch, *, epochs: int, lr: float, batch_size: int = 8) -> list[float]: ...
    def reset_critic(self) -> None: ...
    def reset_reference(self) -> None: ...
    def engine_state_dict(self) -> dict[str, Any]: ...
    def save(self, path: str) -> None: ...
    def load(self, path: str) -> None: ...
