"""What the PyTorch and Megatron backends share: the order of an update and the helpers around it.

``Updates`` holds the calls that read the same in both backends: log-probs, reference log-probs and
values over a batch, the actor's, the critic's and the warm start's updates (``epochs`` passes over
random minibatches, each one optimizer step), and the share each micro-batch's loss takes of its
minibatch. A backend supplies its forward passes and its optimizer step:

- ``_row_logprobs(model, batch, rows, temperature, entropy=False)`` and ``_row_values(batch, rows)``:
  ``[len(rows), T]`` tensors (column 0 left at 0), or None on a rank that does not hold the output
  (an earlier pipeline stage);
- ``_all(fn, batch)``: ``fn`` over the batch's rows, micro-batch by micro-batch, without gradients;
- ``_step(opt, sched, batch, loss_fn, share_fn, epochs, minibatches)``: the list of each step's
  metrics;
- ``_sft_optimizer(lr)``: the warm start's optimizer and schedule; ``_actor_lr()``: the actor's
  learning rate now.

and sets ``policy``, ``reference``, ``critic``, the optimizers and their schedules; its constructor
calls ``_set_update_order`` for the passes, minibatches and their random order.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from agentrl.trainer.backend import Batch, LossConfig, actor_agg, actor_objective, critic_objective


def bucket(lengths: list[int], rows: list[int], budget: int) -> list[list[int]]:
    """Group ``rows`` of similar length: sorted longest first, each group padded to its first row's length
    holds at most ``budget`` tokens, padding included (a longer row goes alone)."""
    groups: list[list[int]] = []
    for r in sorted(rows, key=lambda r: -lengths[r]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def pack(lengths: list[int], rows: list[int], budget: int) -> list[list[int]]:
    """Group ``rows`` (longest first) into micro-batches of at most ``budget`` tokens (a longer row goes alone)."""
    groups: list[list[int]] = []
    sizes: list[int] = []
    for r in sorted(rows, key=lambda r: -lengths[r]):
        for g, used in enumerate(sizes):
            if used + lengths[r] <= budget:
                groups[g].append(r)
                sizes[g] += lengths[r]
                break
        else:
            groups.append([r])
            sizes.append(lengths[r])
    return groups


def lr_schedule(opt, warmup: int, kind: str, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup`` steps, then constant or cosine to 0 at ``total`` steps."""

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "cosine":
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def live_rows(batch: Batch) -> list[int]:
    """The rows with a trainable token."""
    return [r for r, any_ in enumerate(batch.loss_mask.any(1).tolist()) if any_]


def scatter(flat: Tensor, batch: Batch, rows: list[int]) -> Tensor:
    """``[sum(len - 1)]`` per-token values -> ``[len(rows), T]`` with column 0 left at 0."""
    out = torch.zeros((len(rows), batch.input_ids.shape[1]), device=flat.device, dtype=flat.dtype)
    at = 0
    for k, r in enumerate(rows):
        n = int(batch.lengths[r])
        out[k, 1:n] = flat[at : at + n - 1]
        at += n - 1
    return out


def mean_metrics(history: list[dict[str, float]], prefix: str = "") -> dict[str, float]:
    """Each metric's mean over the steps of ``history``, its name after ``prefix``."""
    keys = {k for h in history for k in h}
    return {prefix + k: sum(h.get(k, 0.0) for h in history) / max(1, len(history)) for k in sorted(keys)}


def backend_settings(cfg) -> dict[str, Any]:
    """The keyword arguments both backends take from a ``TrainConfig``: the ``optim`` section (each
    schedule spans the optimizer steps its model takes over the run: the actor takes none in the
    ``algo.critic_warmup`` iterations), ``algo.kl_coef`` (a reference model), ``algo.critic`` and the
    run's seed."""
    o = cfg.optim
    actor_iterations = max(1, cfg.run.iterations - cfg.algo.critic_warmup)
    return {
        "actor_lr": o.actor_lr,
        "critic_lr": o.critic_lr,
        "weight_decay": o.weight_decay,
        "adam_eps": o.adam_eps,
        "warmup_steps": o.warmup_steps,
        "schedule": o.schedule,
        "total_steps": actor_iterations * o.epochs * o.minibatches,
        "critic_total_steps": cfg.run.iterations * (o.critic_epochs or o.epochs) * o.minibatches,
        "grad_clip": o.grad_clip,
        "epochs": o.epochs,
        "critic_epochs": o.critic_epochs,
        "minibatches": o.minibatches,
        "micro_token_budget": o.micro_token_budget,
        "logprob_chunk": o.logprob_chunk,
        "reference": cfg.algo.kl_coef > 0,
        "critic": cfg.algo.critic,
        "seed": cfg.run.seed,
    }


class Updates:
    """The calls both backends make the same way (see the module's docstring for what a backend
    supplies); a backend's constructor calls ``_set_update_order``."""

    def logprobs(self, batch: Batch, temperature: float = 1.0) -> Tensor:
        return self._all(lambda rows: self._row_logprobs(self.policy, batch, rows, temperature), batch)

    def ref_logprobs(self, batch: Batch, temperature: float = 1.0) -> Tensor:
        if self.reference is None:
            raise RuntimeError(
                "this backend was built without a reference model (reference=True for a KL term)"
            )
        return self._all(lambda rows: self._row_logprobs(self.reference, batch, rows, temperature), batch)

    def values(self, batch: Batch) -> Tensor:
        self._needs_critic()
        return self._all(lambda rows: self._row_values(batch, rows), batch)

    def train_actor(self, batch: Batch, loss: LossConfig) -> dict[str, float]:
        def loss_fn(micro: list[int]):
            out = self._row_logprobs(self.policy, batch, micro, loss.temperature, entropy=True)
            if out is None:  # not the last pipeline stage
                return None
            return actor_objective(*out, batch.rows(micro), loss, self.device)

        history = self._step(
            self.actor_opt,
            self.actor_sched,
            batch,
            loss_fn,
            self._share(batch, actor_agg(loss)),
            self.epochs,
            self.minibatches,
        )
        return mean_metrics(history, prefix="actor/") | {"actor/lr": self._actor_lr()}

    def train_critic(
        self, batch: Batch, loss: LossConfig, *, epochs: int | None = None, minibatches: int | None = None
    ) -> dict[str, float]:
        """Value regression on the batch: ``epochs`` passes (default: the backend's ``critic_epochs``) of
        ``minibatches`` optimizer steps each (default: the backend's)."""
        self._needs_critic()

        def loss_fn(micro: list[int]):
            v = self._row_values(batch, micro)
            return None if v is None else critic_objective(v, batch.rows(micro), loss, self.device)

        history = self._step(
            self.critic_opt,
            self.critic_sched,
            batch,
            loss_fn,
            self._share(batch, "token-mean"),
            self.critic_epochs if epochs is None else epochs,
            self.minibatches if minibatches is None else minibatches,
        )
        return mean_metrics(history, prefix="critic/")

    def train_sft(self, batch: Batch, *, epochs: int, lr: float, batch_size: int = 8) -> list[float]:
        """Supervised warm start: maximise the log-likelihood of the sampled tokens, ``batch_size``
        episodes per optimizer step. Returns the mean loss of each epoch."""
        opt, sched = self._sft_optimizer(lr)

        def loss_fn(micro: list[int]):
            logp = self._row_logprobs(self.policy, batch, micro, 1.0)
            if logp is None:  # not the last pipeline stage
                return None
            mask = batch.loss_mask[micro].to(self.device)
            value = -(logp * mask).sum() / mask.sum().clamp(min=1)
            return value, {"sft_loss": float(value.detach())}

        steps = max(1, -(-batch.size // batch_size))  # no step holds more than batch_size episodes
        losses = []
        for _ in range(epochs):
            history = self._step(opt, sched, batch, loss_fn, self._share(batch, "token-mean"), 1, steps)
            losses.append(mean_metrics(history)["sft_loss"])
        return losses

    def _set_update_order(
        self,
        epochs: int,
        critic_epochs: int | None,
        minibatches: int,
        seed: int,
        total_steps: int,
        critic_total_steps: int | None = None,
    ) -> int:
        """Set what the shared calls read: passes over a batch (the critic's own number, by default
        the actor's), minibatches per pass and the generator that draws them. Returns the critic's
        optimizer steps over the run, for its schedule: ``critic_total_steps`` when given, else
        ``critic_epochs / epochs`` times the actor's ``total_steps``."""
        self.epochs, self.minibatches = epochs, minibatches
        self.critic_epochs = critic_epochs or epochs
        self.generator = torch.Generator().manual_seed(seed)
        if critic_total_steps is not None:
            return max(1, critic_total_steps)
        return max(1, total_steps * self.critic_epochs // epochs)

    def _minibatches(self, batch: Batch, minibatches: int) -> list[list[int]]:
        order = torch.randperm(batch.size, generator=self.generator).tolist()
        n = max(1, min(minibatches, batch.size))
        return [order[i::n] for i in range(n)]

    @staticmethod
    def _share(batch: Batch, agg: str):
        """A micro-batch's weight in its minibatch's loss: its trainable tokens, or for a sequence-level
        aggregation its rows with any."""
        if agg == "token-mean":
            return lambda rows: int(batch.loss_mask[rows].sum())
        return lambda rows: int((batch.loss_mask[rows].sum(1) > 0).sum())

    def _needs_critic(self) -> None:
        if self.critic is None:
            raise RuntimeError(
                "this backend was built without a value model (critic=True; a run builds one for "
                "estimator gae only)"
            )
