"""The Megatron training backend: megatron-core ``GPTModel`` policy and value model, tensor and data
parallel, numerically the PyTorch backend's twin.

- The policy is a ``GPTModel`` built from the HF Llama / Qwen2 config, its weights converted from
  the HF model (``megatron_convert``). Its ``output_layer`` hands back the final-normed hidden
  states; log-probs come from them and this rank's vocabulary rows of the output projection
  (``megatron_logprobs``), so the ``[tokens, vocab]`` logits are never gathered nor held whole.
- The value model is the same ``GPTModel`` with ``output_layer`` replaced by a ``Linear(hidden, 1)``
  replicated on every tensor-parallel rank (final norm kept); V(state before token t) is read from
  the hidden state at t-1, as in the PyTorch backend. Zero-initialised, as there.
- Rows are packed into one sequence per micro-batch under ``micro_token_budget`` tokens, each row
  attending only to itself: through THD ``PackedSeqParams`` (``cu_seqlens``), each row's causal
  attention run on its own with no ``[T, T]`` mask (``megatron_attention``); or, with
  ``attention="mask"``, through an explicit block-diagonal causal mask over the pack (the reference
  the tests compare against; RoPE at the packed positions: within one row every query-key offset
  is the row's own, so scores are those of the row alone).
- Updates: gradient accumulation with each micro-batch's share of the minibatch's trainable
  tokens (as the PyTorch backend), data-parallel ranks each take every ``dp``-th row of a
  minibatch and sum their gradients, the gradient norm counts tensor-parallel shards once,
  torch AdamW and the PyTorch backend's schedule; or, with ``distributed_optimizer``, megatron-core's
  distributed optimizer over the same arithmetic (``megatron_optim``). The losses are
  ``agentrl.algo``'s.
- Processes: under ``torchrun`` the world is ``tp * pp * dp`` ranks; alone, one gloo process.
  Rank 0 runs the trainer (rollouts, engine, loop) and drives: each backend call it makes is sent
  to the other ranks first (method and arguments, the batch included), which run nothing but
  ``follow()``, so every rank executes the same call on the same batch.
  Checkpoints: one file per tensor-parallel rank (written by data-parallel rank 0; the distributed
  optimizer's moments gathered into it).
- Precision: fp32 weights and optimizer; ``dtype="bfloat16"`` runs the forward passes under bf16
  autocast (CUDA only), as the PyTorch backend does.
"""

from __future__ import annotations

import atexit
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from agentrl.trainer.backend import Batch, PartMetrics
from agentrl.trainer.megatron_convert import build_gpt, from_stages, hf_to_megatron, megatron_to_hf, to_stage
from agentrl.trainer.megatron_logprobs import vocab_parallel_logprobs
from agentrl.trainer.megatron_optim import DistributedAdam
from agentrl.trainer.megatron_parallel import collective, init_parallel
from agentrl.trainer.updates import Updates, backend_settings, live_rows, lr_schedule, pack, scatter


class HiddenOut(nn.Module):
    """The policy's ``output_layer``: the same weight (and name), but the forward returns the hidden
    states it is given, for ``vocab_parallel_logprobs`` to project chunk by chunk."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.weight = layer.weight  # None with tied embeddings

    def forward(self, x: Tensor, weight: Tensor | None = None, runtime_gather_output=None):
        return x, None


class ValueHead(nn.Module):
    """``Linear(hidden, 1)`` in the ``output_layer`` slot, with its call signature; the same on every
    tensor-parallel rank (its input, the final norm's output, is replicated)."""

    def __init__(self, hidden: int, sequence_parallel: bool = False):
        super().__init__()
        self.linear = nn.Linear(hidden, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        for p in self.linear.parameters():
            # under sequence parallelism Megatron all-reduces these grads so the copies stay equal
            p.sequence_parallel = sequence_parallel

    def forward(self, x: Tensor, weight: Tensor | None = None, runtime_gather_output=None):
        return self.linear(x), None


def _is_sharded(p: Tensor) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False))


def _grad(p: Tensor) -> Tensor:
    """``p.grad``, zeros where no micro-batch reached ``p``."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


class MegatronBackend(Updates):
    def __init__(
        self,
        policy: nn.Module,
        *,
        tp: int = 1,
        pp: int = 1,
        dp: int = 1,
        actor_lr: float = 1e-4,
        critic_lr: float = 1e-4,
        weight_decay: float = 0.0,
        adam_eps: float = 1e-8,
        warmup_steps: int = 0,
        schedule: str = "constant",
        total_steps: int = 1000,
        critic_total_steps: int | None = None,
        grad_clip: float = 1.0,
        epochs: int = 1,
        critic_epochs: int | None = None,
        minibatches: int = 1,
        micro_token_budget: int = 8192,
        logprob_chunk: int = 1024,
        dtype: str = "float32",
        reference: bool = False,
        critic: bool = True,
        seed: int = 0,
        driven: bool = False,
        recompute: str = "none",
        distributed_optimizer: bool = False,
        attention: str = "rows",
    ):
        """``driven``: rank 0 alone calls the backend and the other ranks ``follow()`` (the trainer);
        otherwise every rank makes every call itself (a script run by torchrun on all ranks).
        ``recompute``: activation recomputation, ``none`` | ``selective`` | ``full``
        (``megatron_convert.RECOMPUTE``). ``distributed_optimizer``: Megatron's, its Adam moments
        sharded over the data-parallel ranks (``megatron_optim``); otherwise torch AdamW on every rank.
        ``attention``: how packed rows are kept apart, ``rows`` (THD ``cu_seqlens``, no mask) or
        ``mask`` (the block-diagonal reference: ``benchmarks/megatron_packing.py`` measures both)."""
        from megatron.core import parallel_state as ps

        init_parallel(tp, pp, dp, seed)
        self.world, self.rank, self._busy = dist.get_world_size(), dist.get_rank(), False
        self.driven = driven and self.world > 1
        self.hf_config = policy.config
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.tp_rank, self.dp_rank = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
        self.dp, self.pp = dp, pp
        self.pp_group, self.pp_rank = (
            ps.get_pipeline_model_parallel_group(),
            ps.get_pipeline_model_parallel_rank(),
        )
        self.first, self.last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        if pp > 1:
            self.prev_rank = ps.get_pipeline_model_parallel_prev_rank()
            self.next_rank = ps.get_pipeline_model_parallel_next_rank()
            self.last_rank = ps.get_pipeline_model_parallel_last_rank()
        # tied embeddings over several stages: the first stage's embedding and the last stage's copy
        # get the sum of both gradients (so they stay equal); the copy is left out of the norm
        # (marked ``shared``, as megatron marks it, which its distributed optimizer reads too)
        self.tied_stages = pp > 1 and bool(getattr(policy.config, "tie_word_embeddings", False))
        self._tied: set[int] = set()
        if dtype not in ("float32", "bfloat16") or (dtype == "bfloat16" and self.device.type != "cuda"):
            raise ValueError(
                f"model.dtype={dtype!r}: the Megatron backend runs float32, or bfloat16 autocast on CUDA; "
                "set model.dtype=float32 on CPU"
            )
        self.autocast = dtype == "bfloat16"
        self.recompute = recompute
        if attention not in ("rows", "mask"):
            raise ValueError(f"attention={attention!r}: use rows or mask")
        self.rows = attention == "rows"
        hf_state = {k: v.detach().float().cpu() for k, v in policy.state_dict().items()}
        self.policy = self._gpt(hf_state, value=False)
        self.critic = self._gpt(hf_state, value=True) if critic else None
        # Built, not deep-copied: megatron-core's modules hold process groups, which do not copy.
        self.reference = self._gpt(hf_state, value=False).eval().requires_grad_(False) if reference else None
        self.budget, self.chunk, self.grad_clip = micro_token_budget, logprob_chunk, grad_clip
        critic_total = self._set_update_order(
            epochs, critic_epochs, minibatches, seed, total_steps, critic_total_steps
        )
        self.sharded = distributed_optimizer
        self.actor_opt, self.actor_sched = self._optimizer(
            self.policy, actor_lr, weight_decay, adam_eps, warmup_steps, schedule, total_steps
        )
        self._critic_args = (critic_lr, weight_decay, adam_eps, warmup_steps, schedule, critic_total)
        if self.critic is not None:
            self._critic_optimizer()
        if self.driven and self.rank == 0:
            atexit.register(self._release_followers)

    # -- processes --
    def follow(self) -> None:
        """Ranks other than 0: run each call rank 0 makes, until rank 0's process ends."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            name, args, kwargs = box[0]
            if name == "stop":
                return
            getattr(self, name)(*args, **kwargs)

    def _release_followers(self) -> None:
        if dist.is_initialized():
            dist.broadcast_object_list([("stop", (), {})], src=0)

    # -- models --
    def _gpt(self, hf_state: dict[str, Tensor], *, value: bool) -> nn.Module:
        tp = dist.get_world_size(self.tp_group)
        model = build_gpt(
            self.hf_config, cpu=self.device.type == "cpu", recompute=self.recompute, rows=self.rows
        )
        state = hf_to_megatron(hf_state, self.hf_config, tp, self.tp_rank)
        missing, unexpected = model.load_state_dict(
            to_stage(state, self.hf_config, self.pp, self.pp_rank), strict=False
        )
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"HF -> Megatron left weights unset {missing} or unused {unexpected}")
        if value and model.post_process:
            model.output_layer = ValueHead(self.hf_config.hidden_size, model.config.sequence_parallel)
        elif model.post_process:
            model.output_layer = HiddenOut(model.output_layer)
        model = model.to(self.device).train()
        if self.tied_stages and not value:
            if model.pre_process:
                self._tied.add(id(model.embedding.word_embeddings.weight))
            if model.post_process:
                self._tied.add(id(model.output_layer.weight))
                model.output_layer.weight.shared = True
        return model

    def _optimizer(self, model: nn.Module, lr, weight_decay, eps, warmup_steps, schedule, total_steps):
        """AdamW over ``model`` and its learning-rate schedule: Megatron's distributed optimizer (the
        schedule inside it, so None here), or torch's on every rank."""
        if self.sharded:
            opt = DistributedAdam(
                model,
                lr=lr,
                weight_decay=weight_decay,
                eps=eps,
                grad_clip=self.grad_clip,
                warmup_steps=warmup_steps,
                schedule=schedule,
                total_steps=total_steps,
            )
            return opt, None
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, eps=eps)
        return opt, lr_schedule(opt, warmup_steps, schedule, total_steps)

    def _critic_optimizer(self) -> None:
        self.critic_opt, self.critic_sched = self._optimizer(self.critic, *self._critic_args)

    def _policy_hf_state(self) -> dict[str, Tensor]:
        return megatron_to_hf(self._gather_shards(self.policy), self.hf_config)

    @collective
    def reset_critic(self) -> None:
        """A fresh value model (and optimizer) from the policy as it is now (after a warm start)."""
        if self.critic is not None:
            self.critic = self._gpt(self._policy_hf_state(), value=True)
            self._critic_optimizer()

    @collective
    def reset_reference(self) -> None:
        if self.reference is not None:
            self.reference = self._gpt(self._policy_hf_state(), value=False).eval().requires_grad_(False)

    # -- forward passes over packed rows --
    def _hidden(self, model: nn.Module, batch: Batch, rows: list[int]) -> Tensor:
        """The model's output at the first ``length - 1`` tokens of each row, concatenated:
        ``[sum(len - 1), H]`` (policy: hidden states; value model: ``[.., 1]``)."""
        lengths = [int(batch.lengths[r]) for r in rows]
        ends = torch.tensor([0, *lengths]).cumsum(0)  # each row's start in the pack, then its end
        start = int(ends[-1])
        ids = [batch.input_ids[r, :n] for r, n in zip(rows, lengths, strict=True)]
        positions = [torch.arange(n) for n in lengths]
        src = [torch.arange(a, b - 1) for a, b in pairwise(ends.tolist())]
        if self.rows:  # each row's attention on its own
            from megatron.core.packed_seq_params import PackedSeqParams

            longest = max(lengths)
            cu = ends.to(device=self.device, dtype=torch.int32)
            kwargs: dict[str, Any] = {
                "attention_mask": None,
                "packed_seq_params": PackedSeqParams(
                    qkv_format="thd",
                    cu_seqlens_q=cu,
                    cu_seqlens_kv=cu,
                    max_seqlen_q=longest,
                    max_seqlen_kv=longest,
                ),
            }
        else:
            seg = torch.arange(len(rows)).repeat_interleave(torch.tensor(lengths))
            causal = torch.tril(torch.ones(start, start, dtype=torch.bool))
            masked = ~(causal & (seg[:, None] == seg[None, :]))  # Megatron: True = may not attend
            kwargs = {"attention_mask": masked[None, None].to(self.device)}
        if not self.first:  # the previous stage's output, [S, 1, H]
            x = torch.empty((start, 1, self.hf_config.hidden_size), device=self.device)
            dist.recv(x, src=self.prev_rank)
            self._stage_input = x.requires_grad_(torch.is_grad_enabled())
            model.set_input_tensor(x)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = model(
                torch.cat(ids)[None].to(self.device), torch.cat(positions)[None].to(self.device), **kwargs
            )
        if not self.last:  # on to the next stage; the gradient comes back in _step
            dist.send(out.detach().float().contiguous(), dst=self.next_rank)
            self._stage_output = out
            return None
        return out[0][torch.cat(src).to(self.device)]

    def _output_weight(self, model: nn.Module) -> Tensor:
        if model.share_embeddings_and_output_weights:
            return model.embedding.word_embeddings.weight
        return model.output_layer.weight

    def _row_logprobs(self, model, batch: Batch, rows: list[int], temperature: float, entropy: bool = False):
        hidden = self._hidden(model, batch, rows)
        if hidden is None:  # not the last pipeline stage
            return None
        targets = torch.cat([batch.input_ids[r, 1 : int(batch.lengths[r])] for r in rows]).to(self.device)
        out = vocab_parallel_logprobs(
            hidden.float(),
            self._output_weight(model),
            targets,
            vocab_size=self.hf_config.vocab_size,
            temperature=temperature,
            chunk=self.chunk,
            group=self.tp_group,
            entropy=entropy,
            tf32=self.autocast,  # bf16 autocast runs on CUDA only
        )
        if entropy:
            return scatter(out[0], batch, rows), scatter(out[1], batch, rows)
        return scatter(out, batch, rows)

    def _row_values(self, batch: Batch, rows: list[int]) -> Tensor | None:
        hidden = self._hidden(self.critic, batch, rows)
        return None if hidden is None else scatter(hidden.squeeze(-1).float(), batch, rows)

    @torch.no_grad()
    def _all(self, fn, batch: Batch) -> Tensor:
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        # a row with no trainable token is not run: 0
        for rows in pack(batch.lengths.tolist(), live_rows(batch), self.budget):
            got = fn(rows)
            if got is not None:
                out[rows] = got.cpu()
        if self.pp > 1:  # the last stage computed them; on the device: NCCL takes no CPU tensor
            on_device = out.to(self.device)
            dist.broadcast(on_device, src=self.last_rank, group=self.pp_group)
            out = on_device.cpu()
        return out

    # -- updates (what Updates' train_* calls) --
    def _grad_norm_and_clip(self, params: list[Tensor]) -> float:
        """The global gradient norm (tensor-parallel shards summed over the group, replicated weights
        counted once), then every gradient scaled as ``torch.nn.utils.clip_grad_norm_`` does."""
        square = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in params:
            if (
                p.grad is not None
                and (_is_sharded(p) or self.tp_rank == 0)
                and not getattr(p, "shared", False)
            ):
                square += p.grad.double().pow(2).sum()
        if dist.get_world_size(self.tp_group) > 1:
            dist.all_reduce(square, group=self.tp_group)
        if self.pp > 1:
            dist.all_reduce(square, group=self.pp_group)
        norm = float(square.sqrt())
        coef = min(1.0, self.grad_clip / (norm + 1e-6))
        if coef < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

    def _step(self, opt, sched, batch: Batch, loss_fn, share_fn, epochs: int, minibatches: int):
        """``epochs`` passes over ``minibatches`` random minibatches, one optimizer step each; with
        ``sched`` None, ``opt`` is Megatron's distributed optimizer (``megatron_optim``)."""
        history = []
        lengths = batch.lengths.tolist()
        trainable = batch.loss_mask.any(1).tolist()
        sharded = isinstance(opt, DistributedAdam)
        params = opt.params() if sharded else [p for group in opt.param_groups for p in group["params"]]
        gradient = opt.gradient if sharded else _grad
        for _ in range(epochs):
            for rows in self._minibatches(batch, minibatches):
                opt.zero_grad()  # torch's: grads set to None; megatron's: its buffers zeroed
                total = share_fn(rows)
                if total == 0:
                    continue
                live = [r for r in rows if trainable[r]]
                mine = live[self.dp_rank :: self.dp]  # this data-parallel rank's rows
                parts = PartMetrics()
                for micro in pack(lengths, mine, self.budget):
                    share = share_fn(micro) / total
                    result = loss_fn(micro)
                    if result is not None:  # the last pipeline stage: the loss
                        loss, m = result
                        (loss * share).backward()
                        parts.add(m, share, int(batch.loss_mask[micro].sum()))
                    else:  # an earlier stage: the next stage's gradient of this one's output
                        grad = torch.empty(self._stage_output.shape, device=self.device)
                        dist.recv(grad, src=self.next_rank)
                        self._stage_output.backward(grad.to(self._stage_output.dtype))
                    if not self.first:
                        dist.send(self._stage_input.grad.float().contiguous(), dst=self.prev_rank)
                if self.dp > 1:  # the distributed optimizer reduce-scatters the gradients itself
                    self._dp_sum([] if sharded else params, parts)
                metrics = parts.result()
                if self.pp > 1:
                    metrics = self._pipeline_sync(params, metrics, gradient)
                if sharded:  # clips with the norm it computes as _grad_norm_and_clip does
                    metrics["grad_norm"] = opt.step()
                else:
                    metrics["grad_norm"] = self._grad_norm_and_clip(params)
                    opt.step()
                    sched.step()
                history.append(metrics)
        return history

    def _pipeline_sync(self, params: list[Tensor], metrics: dict[str, float], gradient) -> dict[str, float]:
        """Tied embedding copies get their summed gradient; every stage gets the last one's metrics."""
        from megatron.core import parallel_state as ps

        tied = [p for p in params if id(p) in self._tied]
        if tied and ps.is_rank_in_embedding_group():
            for p in tied:
                dist.all_reduce(gradient(p), group=ps.get_embedding_group())
        box = [metrics]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.pp_group)
        return box[0]

    def _dp_sum(self, params: list[Tensor], parts: PartMetrics) -> None:
        """Sum gradients over data-parallel ranks, and merge their metrics (each holds its rows')."""
        for p in params:
            dist.all_reduce(_grad(p), group=self.dp_group)
        gathered: list[dict[str, float]] = [{} for _ in range(self.dp)]
        dist.all_gather_object(gathered, parts.state, group=self.dp_group)
        parts.state = {}
        for state in gathered:
            parts.merge(state)

    def _sft_optimizer(self, lr: float):
        if self.sharded:  # over the actor's gradient buffers: a model is wrapped once
            return self.actor_opt.another(lr=lr, weight_decay=0.01, eps=1e-8), None
        opt = torch.optim.AdamW(self.policy.parameters(), lr=lr)  # torch AdamW's defaults
        return opt, lr_schedule(opt, 0, "constant", 1)

    def _actor_lr(self) -> float:
        return self.actor_opt.last_lr() if self.sharded else self.actor_sched.get_last_lr()[0]

    # the calls both backends share, made by every rank (rank 0 sends each to the others first)
    logprobs = collective(Updates.logprobs)
    ref_logprobs = collective(Updates.ref_logprobs)
    values = collective(Updates.values)
    train_actor = collective(Updates.train_actor)
    train_critic = collective(Updates.train_critic)
    train_sft = collective(Updates.train_sft)

    # -- weights and checkpoints --
    def _gather_shards(self, model: nn.Module) -> list[dict[str, Tensor]]:
        """Every tensor-parallel rank's weights of ``model`` (on CPU), in rank order."""
        local = {k: v.detach().cpu() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        if self.pp > 1:
            stages: list[Any] = [None] * self.pp
            dist.all_gather_object(stages, local, group=self.pp_group)
            local = from_stages(stages, self.hf_config)
        tp = dist.get_world_size(self.tp_group)
        if tp == 1:
            return [local]
        shards: list[Any] = [None] * tp
        dist.all_gather_object(shards, local, group=self.tp_group)
        return shards

    @collective
    def engine_state_dict(self) -> dict[str, Any]:
        """The policy's weights under the HF model's names (the engine's and ``save_pretrained``'s)."""
        return self._policy_hf_state()

    def _file(self, path: str) -> Path:
        stage = f"-pp{self.pp_rank}" if self.pp > 1 else ""
        return Path(path) / f"megatron-tp{self.tp_rank}{stage}.pt"

    @collective
    def save(self, path: str) -> None:
        state = self._state()  # on every rank: the distributed optimizer gathers its moments
        if self.dp_rank == 0:
            torch.save(state, self._file(path))
        policy = self._policy_hf_state()  # on every rank: gathered over the splits
        if self.rank == 0:  # the policy under the model's own names, for model.init, eval and replay
            torch.save(policy, Path(path) / "policy.pt")
        if self.world > 1:
            dist.barrier()  # every file is written before rank 0 completes the checkpoint

    def _state(self) -> dict[str, Any]:
        state = {
            "distributed_optimizer": self.sharded,
            "policy": self.policy.state_dict(),
            "actor_opt": self.actor_opt.state_dict(),
            "generator": self.generator.get_state(),
        }
        if not self.sharded:
            state["actor_sched"] = self.actor_sched.state_dict()
        if self.critic is not None:
            state |= {"critic": self.critic.state_dict(), "critic_opt": self.critic_opt.state_dict()}
            if not self.sharded:
                state["critic_sched"] = self.critic_sched.state_dict()
        if self.reference is not None:
            state["reference"] = self.reference.state_dict()
        return state

    @collective
    def load(self, path: str) -> None:
        file = self._file(path)
        if not file.exists():
            raise FileNotFoundError(
                f"{file} is missing: this checkpoint was not written by the Megatron backend at "
                f"tensor-parallel size {dist.get_world_size(self.tp_group)}; resume with the same trainer settings"
            )
        state = torch.load(file, map_location=self.device, weights_only=False)
        if state.get("distributed_optimizer", False) != self.sharded:
            raise ValueError(
                f"{file} was written with trainer.megatron.distributed_optimizer="
                f"{str(not self.sharded).lower()}: resume with that setting"
            )
        self.policy.load_state_dict(state["policy"])
        self.actor_opt.load_state_dict(state["actor_opt"])
        self.generator.set_state(state["generator"].cpu())  # a CPU generator; loaded onto the device
        if not self.sharded:
            self.actor_sched.load_state_dict(state["actor_sched"])
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
            self.critic_opt.load_state_dict(state["critic_opt"])
            if not self.sharded:
                self.critic_sched.load_state_dict(state["critic_sched"])
        if self.reference is not None and "reference" in state:
            self.reference.load_state_dict(state["reference"])


def from_config(policy: nn.Module, cfg) -> MegatronBackend:
    """``trainer.backend: megatron``: sizes from ``trainer.megatron``, the rest as the PyTorch backend
    (``optim``, ``algo.kl_coef``); fp32 on CPU."""
    from agentrl.config import ConfigError
    from agentrl.device import resolve_dtype

    device = next(policy.parameters()).device  # where run.device placed the policy
    if device.type == "cpu" and torch.cuda.is_available():
        raise ConfigError(
            f"run.device={cfg.run.device}: trainer.backend=megatron trains on the GPU wherever torch sees "
            "one (its process groups and kernels are CUDA's there); set run.device=auto, or "
            "trainer.backend=torch to train on the CPU"
        )
    m = cfg.trainer.megatron
    return MegatronBackend(
        policy,
        **backend_settings(cfg),
        tp=m.tp,
        pp=m.pp,
        dp=m.dp,
        dtype=resolve_dtype(cfg.model.dtype, torch.device("cuda" if torch.cuda.is_available() else "cpu")),
        driven=True,
        recompute=m.recompute,
        distributed_optimizer=m.distributed_optimizer,
    )
