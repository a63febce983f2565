"""The PyTorch training backend: a Hugging Face causal LM policy and a value model, on CPU or one GPU.

- The value model is the policy's architecture with a scalar head: the policy's backbone weights
  (copied, then trained separately) and a fresh ``Linear(hidden, 1)``.
- Rows are never padded to the longest of the batch. ``packing="packed"`` concatenates rows under
  ``micro_token_budget`` tokens into one sequence with per-row position ids and a block-diagonal
  causal mask (no token attends across rows, no compute on padding: right with varlen attention
  kernels). ``packing="padded"`` (the default, for CPU and SDPA, whose cost with a dense mask grows
  with the square of the pack length) groups rows of similar length, each group padded only to
  its own longest row, under the same budget counting padding, and needs no mask (right padding).
- Dropout is off: the models stay in eval mode, so that the recomputed log-probs and the first
  update's are of the same function (a ratio of 1 before any step).
- Log-probs come from ``token_logprobs`` (chunked over the vocabulary: the ``[tokens, vocab]``
  logits are never held whole).
- Gradient accumulation over micro-batches scales each one by its share of the minibatch's
  trainable tokens (or sequences, for sequence-level aggregations), so the result equals one
  big batch. AdamW, a warmup + constant/cosine schedule, gradient clipping, fp32 or bf16 autocast
  (the LM head's logits stay fp32; in a bf16 run on CUDA they come from TF32 products).
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from agentrl.algo import token_logprobs
from agentrl.trainer.backend import Batch, PartMetrics
from agentrl.trainer.updates import Updates, backend_settings, bucket, live_rows, lr_schedule, pack, scatter


def _backbone(model: nn.Module) -> nn.Module:
    return getattr(model, model.base_model_prefix)


def _frozen_copy(model: nn.Module) -> nn.Module:
    """A copy that takes no gradient and stays in eval mode: the KL term's reference."""
    return copy.deepcopy(model).eval().requires_grad_(False)


class ValueModel(nn.Module):
    """A causal LM backbone with a scalar head: V(state before token t) from the hidden state at t-1."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.backbone = copy.deepcopy(_backbone(policy))
        hidden = policy.config.hidden_size
        self.head = nn.Linear(hidden, 1)
        # V = 0 everywhere at the start: until the critic has learned, advantages are the returns
        # themselves (no arbitrary baseline that pushes every sampled token up or down).
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, **kwargs) -> Tensor:
        hidden = self.backbone(**kwargs).last_hidden_state
        return self.head(hidden).squeeze(-1)


def _padded_inputs(batch: Batch, rows: list[int], device) -> dict[str, Tensor]:
    """Rows padded on the right to the group's longest, with no padding mask: under causal attention
    a real token attends only to the tokens before it, all real, so its hidden state is the one a
    mask would give (pad positions' states are never read). Without a mask SDPA runs its causal
    kernel instead of a dense ``[rows, heads, width, width]`` one (``benchmarks/train_step.py``)."""
    width = int(batch.lengths[rows].max())
    return {
        "input_ids": batch.input_ids[rows, :width].to(device),
        "position_ids": torch.arange(width)[None].expand(len(rows), width).to(device),
    }


ATTENTION = ("auto", "dense", "flex", "varlen")
"""How packed rows attend only within themselves: ``dense`` (a ``[T, T]`` block-diagonal boolean
mask with SDPA; the CPU reference), ``flex`` (FlexAttention with a document mask, no ``[T, T]``
tensor), ``varlen`` (flash-attn's variable-length kernel, given the rows' boundaries; bf16 only);
``auto``: varlen on CUDA when flash-attn is installed and the dtype is bf16, else flex on CUDA,
dense on CPU."""

_ATTN_IMPLEMENTATION = {"dense": "sdpa", "flex": "flex_attention", "varlen": "flash_attention_2"}


def resolve_attention(attention: str, device: torch.device, dtype: str = "float32") -> str:
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}; got {attention!r}")
    flash = importlib.util.find_spec("flash_attn") is not None
    if attention == "varlen" and not flash:
        raise ValueError(
            "attention='varlen' runs flash-attn's variable-length kernel, and flash-attn is not "
            "installed: install it (pip install flash-attn), or set attention to 'flex' or 'auto'"
        )
    if attention == "varlen" and dtype != "bfloat16":
        raise ValueError(
            f"attention='varlen' needs dtype 'bfloat16' (flash-attn has no float32 kernel); got "
            f"{dtype!r}: set model.dtype to bfloat16 (auto is bfloat16 on CUDA), or attention to 'flex'"
        )
    if attention != "auto":
        return attention
    if device.type != "cuda":
        return "dense"
    return "varlen" if flash and dtype == "bfloat16" else "flex"


def document_block_mask(seg: Tensor, block: int = 128):
    """FlexAttention's ``BlockMask`` for causal attention within documents: token ``q`` attends to
    ``kv <= q`` of the same document, ``seg`` holding each token's document (non-decreasing).

    Built from the documents' extents per block of ``block`` tokens, in ``[blocks, blocks]``:
    ``create_block_mask`` evaluates the mask over every (q, kv) pair first, some 10 bytes for
    each (2.6 GiB for a 16k-token pack, 40 GiB at 64k), the square this path exists to avoid."""
    from torch.nn.attention.flex_attention import BlockMask

    total = seg.numel()
    starts = torch.arange(0, total, block, device=seg.device)
    ends = torch.clamp(starts + block, max=total) - 1
    first, last = seg[starts], seg[ends]  # the first and last document in each block
    filled = ends - starts + 1 == block
    index = torch.arange(len(starts), device=seg.device)
    q, kv = index[:, None], index[None, :]
    # a kv block at or before the q block that shares a document with it: some pairs attend
    some = (kv <= q) & (last[kv] >= first[q])
    # strictly before it, both blocks filled and in one document: every pair attends
    whole = (kv < q) & (first[kv] == last[q]) & filled[q] & filled[kv]

    def ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
        blocks = blocks.to(torch.int32)[None, None]
        order = torch.argsort(blocks, dim=-1, descending=True, stable=True)
        return blocks.sum(-1, dtype=torch.int32), order.to(torch.int32)

    def same_document_causal(b, h, q_idx, kv_idx):
        return (seg[q_idx] == seg[kv_idx]) & (q_idx >= kv_idx)

    return BlockMask.from_kv_blocks(
        *ordered(some & ~whole),
        *ordered(whole),
        BLOCK_SIZE=block,
        mask_mod=same_document_causal,
        seq_lengths=(total, total),
    )


def _packed_inputs(
    batch: Batch, rows: list[int], device, attention: str = "dense", multiple: int = 1
) -> tuple[dict[str, Tensor], list[tuple[int, int, int]]]:
    """One sequence holding ``rows``; returns model kwargs and ``(row, start, length)`` spans.

    Each row restarts its position ids at 0 and attends only to itself (``attention``). The flex
    path pads the sequence to a multiple of ``multiple`` tokens (a segment of its own that nothing
    reads), so that a compiled kernel sees few distinct lengths."""
    ids, positions, segments, spans = [], [], [], []
    start = 0
    for k, r in enumerate(rows):
        n = int(batch.lengths[r])
        ids.append(batch.input_ids[r, :n])
        positions.append(torch.arange(n))
        segments.append(torch.full((n,), k))
        spans.append((r, start, n))
        start += n
    pad = (-start) % multiple if attention == "flex" else 0
    if pad:
        ids.append(torch.zeros(pad, dtype=torch.long))
        positions.append(torch.arange(pad))
        segments.append(torch.full((pad,), len(rows)))
    seg = torch.cat(segments).to(device)
    kwargs = {
        "input_ids": torch.cat(ids)[None].to(device),
        "position_ids": torch.cat(positions)[None].to(device),
    }
    if attention == "dense":
        total = seg.numel()
        causal = torch.tril(torch.ones(total, total, dtype=torch.bool, device=device))
        kwargs["attention_mask"] = (causal & (seg[:, None] == seg[None, :]))[None, None]
    elif attention == "flex":
        kwargs["attention_mask"] = document_block_mask(seg)
    elif attention == "varlen":
        # No mask: flash-attn's kernel takes the row boundaries. Given here once per forward; from
        # the reset position ids alone, every layer would search for them again (a device sync each).
        bounds = torch.tensor([0] + [s + n for _, s, n in spans], dtype=torch.int32, device=device)
        longest = max(n for _, _, n in spans)
        kwargs |= {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds}
        kwargs |= {"max_length_q": longest, "max_length_k": longest}
    return kwargs, spans


class TorchBackend(Updates):
    def __init__(
        self,
        policy: nn.Module,
        *,
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
        packing: str = "padded",
        attention: str = "auto",
        seed: int = 0,
    ):
        # Dropout stays off (eval mode throughout): PPO's ratio compares two passes of the same
        # weights, which dropout would make differ at random (the Megatron backend sets it to 0).
        self.policy = policy.eval()
        self.device = next(policy.parameters()).device
        # Packed rows need an attention that keeps each row to itself; set before the critic and
        # the reference are copied from the policy, so that they use it too.
        self.attention = resolve_attention(attention, self.device, dtype) if packing == "packed" else "dense"
        if packing == "packed" and hasattr(policy, "set_attn_implementation"):
            policy.set_attn_implementation(_ATTN_IMPLEMENTATION[self.attention])
        self.critic = ValueModel(policy).to(self.device).eval() if critic else None
        self.reference = _frozen_copy(policy) if reference else None
        self.budget, self.chunk, self.grad_clip = micro_token_budget, logprob_chunk, grad_clip
        if packing not in ("padded", "packed"):
            raise ValueError(f"packing must be 'padded' or 'packed'; got {packing!r}")
        self.packing = packing
        self._group = pack if packing == "packed" else bucket
        self.autocast = dtype == "bfloat16"
        # the LM head's logits stay fp32; in a bf16 run on CUDA they come from TF32 products
        self.tf32 = self.autocast and self.device.type == "cuda"
        critic_total = self._set_update_order(
            epochs, critic_epochs, minibatches, seed, total_steps, critic_total_steps
        )
        self.actor_opt = torch.optim.AdamW(
            policy.parameters(), lr=actor_lr, weight_decay=weight_decay, eps=adam_eps
        )
        self.actor_sched = lr_schedule(self.actor_opt, warmup_steps, schedule, total_steps)
        self._critic_args = (critic_lr, weight_decay, adam_eps, warmup_steps, schedule, critic_total)
        if self.critic is not None:
            self._critic_optimizer()

    def _critic_optimizer(self) -> None:
        lr, weight_decay, eps, warmup_steps, schedule, total_steps = self._critic_args
        self.critic_opt = torch.optim.AdamW(
            self.critic.parameters(), lr=lr, weight_decay=weight_decay, eps=eps
        )
        self.critic_sched = lr_schedule(self.critic_opt, warmup_steps, schedule, total_steps)

    def reset_critic(self) -> None:
        """A fresh value model (and optimizer) from the policy as it is now: after a supervised warm
        start, the critic starts from the backbone that learned the task's format, not the one before."""
        if self.critic is not None:
            self.critic = ValueModel(self.policy).to(self.device).eval()
            self._critic_optimizer()

    def reset_reference(self) -> None:
        """The KL term's reference becomes the policy as it is now: after a supervised warm start the
        KL anchors to the warm-started weights, not to the ones the run was built from."""
        if self.reference is not None:
            self.reference = _frozen_copy(self.policy)

    def _ctx(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast)

    # -- forward passes over packed rows --
    def _hidden(self, backbone: nn.Module, batch: Batch, rows: list[int]) -> Tensor:
        """Hidden states of the first ``length - 1`` tokens of each row, concatenated: ``[sum(len - 1), H]``.

        Token t of a row is predicted from (and valued at) the hidden state at t-1 of the same row.
        """
        lengths = [int(batch.lengths[r]) for r in rows]
        with self._ctx():
            if self.packing == "packed":
                kwargs, spans = _packed_inputs(
                    batch, rows, self.device, self.attention, multiple=max(128, self.budget // 8)
                )
                h = backbone(**kwargs).last_hidden_state[0]
                src = torch.cat([torch.arange(s, s + n - 1) for _, s, n in spans]).to(self.device)
                return h[src]
            h = backbone(**_padded_inputs(batch, rows, self.device)).last_hidden_state
            return torch.cat([h[k, : n - 1] for k, n in enumerate(lengths)])

    def _row_logprobs(
        self, model: nn.Module, batch: Batch, rows: list[int], temperature: float, entropy: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """[len(rows), T] log-prob of each token given its prefix (column 0 is 0); with ``entropy``,
        also the entropy of the distribution each token was drawn from."""
        hidden = self._hidden(_backbone(model), batch, rows)
        targets = torch.cat([batch.input_ids[r, 1 : int(batch.lengths[r])] for r in rows]).to(self.device)
        weight = model.get_output_embeddings().weight
        out = token_logprobs(
            hidden.float(), weight.float(), targets, temperature, self.chunk, entropy, tf32=self.tf32
        )
        if entropy:
            return scatter(out[0], batch, rows), scatter(out[1].detach(), batch, rows)
        return scatter(out, batch, rows)

    def _row_values(self, batch: Batch, rows: list[int]) -> Tensor:
        hidden = self._hidden(self.critic.backbone, batch, rows)
        with self._ctx():
            values = self.critic.head(hidden).squeeze(-1).float()
        return scatter(values, batch, rows)

    @torch.no_grad()
    def _all(self, fn, batch: Batch) -> Tensor:
        """``fn`` over the batch's rows, micro-batch by micro-batch; 0 for a row with no trainable token
        (nothing reads its log-probs or values: it is not run, however long its prompt)."""
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        lengths = batch.lengths.tolist()
        for rows in self._group(lengths, live_rows(batch), self.budget):
            out[rows] = fn(rows).cpu()
        return out

    # -- updates (what Updates' train_* calls) --
    def _step(
        self, opt, sched, batch: Batch, loss_fn, share_fn, epochs: int, minibatches: int
    ) -> list[dict[str, float]]:
        """``epochs`` passes over the batch, ``minibatches`` optimizer steps each."""
        history = []
        lengths = batch.lengths.tolist()
        trainable = batch.loss_mask.any(1).tolist()
        for _ in range(epochs):
            for rows in self._minibatches(batch, minibatches):
                opt.zero_grad(set_to_none=True)
                total = share_fn(rows)
                if total == 0:
                    continue
                parts = PartMetrics()
                # a row with no trainable token adds no gradient and no share: no forward for it
                live = [r for r in rows if trainable[r]]
                for micro in self._group(lengths, live, self.budget):
                    loss, m = loss_fn(micro)
                    share = share_fn(micro) / total
                    (loss * share).backward()
                    parts.add(m, share, int(batch.loss_mask[micro].sum()))
                metrics = parts.result()
                params = [p for group in opt.param_groups for p in group["params"]]
                metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip))
                opt.step()
                sched.step()
                history.append(metrics)
        return history

    def _sft_optimizer(self, lr: float):
        opt = torch.optim.AdamW(self.policy.parameters(), lr=lr)
        return opt, lr_schedule(opt, 0, "constant", 1)

    def _actor_lr(self) -> float:
        return self.actor_sched.get_last_lr()[0]

    # -- weights and checkpoints --
    def engine_state_dict(self) -> dict[str, Any]:
        return {k: v.detach().clone() for k, v in self.policy.state_dict().items()}

    def save(self, path: str) -> None:
        state = {
            "policy": self.policy.state_dict(),
            "actor_opt": self.actor_opt.state_dict(),
            "actor_sched": self.actor_sched.state_dict(),
            "generator": self.generator.get_state(),
        }
        if self.critic is not None:
            state |= {
                "critic": self.critic.state_dict(),
                "critic_opt": self.critic_opt.state_dict(),
                "critic_sched": self.critic_sched.state_dict(),
            }
        if self.reference is not None:
            state["reference"] = self.reference.state_dict()
        torch.save(state, Path(path) / "backend.pt")

    def load(self, path: str) -> None:
        state = torch.load(Path(path) / "backend.pt", map_location=self.device, weights_only=False)
        self.policy.load_state_dict(state["policy"])
        self.actor_opt.load_state_dict(state["actor_opt"])
        self.actor_sched.load_state_dict(state["actor_sched"])
        self.generator.set_state(state["generator"].cpu())  # a CPU generator; loaded onto the device
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
            self.critic_opt.load_state_dict(state["critic_opt"])
            self.critic_sched.load_state_dict(state["critic_sched"])
        if self.reference is not None and "reference" in state:
            self.reference.load_state_dict(state["reference"])


def from_config(policy: nn.Module, cfg) -> TorchBackend:
    """``trainer.backend: torch``: the backend built from a ``TrainConfig``'s ``optim`` section (the
    schedule spans the run's iterations), ``model.dtype`` and ``algo.kl_coef`` (a reference model)."""
    from agentrl.config import ConfigError
    from agentrl.device import resolve_dtype

    device = next(policy.parameters()).device
    if cfg.optim.packing == "packed" and cfg.optim.attention == "flex" and device.type != "cuda":
        raise ConfigError(
            f"optim.attention=flex trains on CUDA only (FlexAttention has no backward pass on "
            f"{device.type}): set optim.attention=auto (dense on {device.type}) or optim.packing=padded"
        )
    return TorchBackend(
        policy,
        **backend_settings(cfg),
        packing=cfg.optim.packing,
        attention=cfg.optim.attention,
        dtype=resolve_dtype(cfg.model.dtype, device),
    )
