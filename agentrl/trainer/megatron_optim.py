"""Megatron's distributed optimizer for the Megatron backend (``trainer.megatron.distributed_optimizer``).

Each data-parallel rank keeps Adam's moments for its ``1/dp`` slice of every weight. megatron-core's
``DistributedDataParallel`` collects the gradients in one flat buffer per model and reduce-scatters
it over the data-parallel group; its ``DistributedOptimizer`` updates this rank's slice and
all-gathers the updated weights. The arithmetic is the backend's own path (whole gradients
all-reduced, torch AdamW on every rank), so either gives the same step:

- gradients are summed over data-parallel ranks, not averaged: each micro-batch's loss already
  carries its share of the global minibatch (the DDP wrapper sees ``calculate_per_token_loss``);
- weight decay applies to every weight, as the backend's torch AdamW does (no per-parameter
  override: megatron would otherwise skip biases and norms);
- the gradient norm counts tensor-parallel shards and the tied output copy once, and the clip
  coefficient is ``max_norm / (norm + 1e-6)``, as in the backend;
- the learning rate follows the backend's ``lr_schedule``.

On CPU, every call into megatron's optimizer runs under ``megatron_cpu.optimizer_calls()``.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from agentrl.trainer.megatron_cpu import optimizer_calls
from agentrl.trainer.updates import lr_schedule


class DistributedAdam:
    """AdamW over ``model`` with its moments sharded over the data-parallel ranks. Gradients land
    in ``gradient(p)`` (the DDP buffer), not ``p.grad``; every method is collective over the ranks."""

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float,
        weight_decay: float,
        eps: float,
        grad_clip: float,
        warmup_steps: int = 0,
        schedule: str = "constant",
        total_steps: int = 1,
        ddp: nn.Module | None = None,
    ):
        """``ddp``: the wrapper of ``model`` another ``DistributedAdam`` made (a model's gradients
        have one buffer); otherwise ``model`` is wrapped here, once."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.model, self.grad_clip = model, grad_clip
        optimizer_config = OptimizerConfig(
            optimizer="adam",
            lr=lr,
            weight_decay=weight_decay,
            adam_eps=eps,
            clip_grad=grad_clip,
            use_distributed_optimizer=True,
            params_dtype=torch.float32,
        )
        with optimizer_calls():
            if ddp is None:
                config = copy.copy(model.config)
                config.calculate_per_token_loss = True  # a sum over data-parallel ranks
                ddp_config = DistributedDataParallelConfig(
                    use_distributed_optimizer=True, grad_reduce_in_fp32=True
                )
                ddp = DistributedDataParallel(config, ddp_config, model)
            self.ddp = ddp
            self.optimizer = get_megatron_optimizer(optimizer_config, [self.ddp], config_overrides={})
        self.parts = list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))
        self.steps = 0  # megatron's state_dict needs the moments an update creates
        self.schedules = [
            lr_schedule(part.optimizer, warmup_steps, schedule, total_steps) for part in self.parts
        ]

    def another(self, *, lr: float, weight_decay: float, eps: float) -> DistributedAdam:
        """A fresh optimizer (new moments, constant ``lr``) over the same model and buffers."""
        return DistributedAdam(
            self.model, lr=lr, weight_decay=weight_decay, eps=eps, grad_clip=self.grad_clip, ddp=self.ddp
        )

    def params(self) -> list[Tensor]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def zero_grad(self) -> None:
        with optimizer_calls(), warnings.catch_warnings():
            # megatron sets the .grad of its weight slices (views) to None, which warns
            warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()

    @staticmethod
    def gradient(p: Tensor) -> Tensor:
        """The gradient accumulated so far for weight ``p`` (before the data-parallel reduction)."""
        return p.main_grad

    def step(self) -> float:
        """Reduce-scatter the gradients, clip, update this rank's slice, all-gather the weights;
        the global gradient norm before clipping."""
        with optimizer_calls():
            self.ddp.finish_grad_sync()
            ok, norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("Megatron's distributed optimizer skipped a step (a non-finite gradient)")
        self.steps += 1
        for schedule in self.schedules:
            schedule.step()
        return float(norm)

    def last_lr(self) -> float:
        return self.schedules[0].get_last_lr()[0]

    def moments(self) -> int:
        """How many numbers of Adam state this rank keeps."""
        return sum(
            t.numel()
            for part in self.parts
            for state in part.optimizer.state.values()
            for t in state.values()
            if isinstance(t, Tensor) and t.dim() > 0
        )

    def state_dict(self) -> dict[str, Any]:
        """The whole state: the moments gathered on data-parallel rank 0 (None on the others)."""
        state: dict[str, Any] = {"steps": self.steps, "schedules": [s.state_dict() for s in self.schedules]}
        if self.steps:
            with optimizer_calls():
                state["optimizer"] = self.optimizer.state_dict()
                state["moments"] = [part.get_parameter_state_dp_zero() for part in self.parts]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``state`` as ``state_dict`` gave it on data-parallel rank 0, read by every rank."""
        self.steps = state["steps"]
        for schedule, saved in zip(self.schedules, state["schedules"], strict=True):
            schedule.load_state_dict(saved)
        if not self.steps:  # saved before its first update: no moments yet
            return
        # the weight slices it writes are views of the (fp32) weights themselves
        with optimizer_calls(), torch.no_grad():
            self.optimizer.load_state_dict(state["optimizer"])
            for part, moments in zip(self.parts, state["moments"], strict=True):
                # with torch's AdamW (no Transformer Engine or Apex) each weight's state also holds
                # its step. load_state_dict has just set it, but as one tensor shared by every
                # weight, which AdamW would then advance once per weight; and the gathered moments
                # do not carry it. So each weight gets its own copy, kept out of the moments' load.
                steps = {p: st.pop("step") for p, st in part.optimizer.state.items() if "step" in st}
                part.load_parameter_state_from_dp_zero(moments)
                for p, step in steps.items():
                    part.optimizer.state[p]["step"] = step.clone()
