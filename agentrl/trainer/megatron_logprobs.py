"""Log-probabilities of target tokens with the vocabulary split across tensor-parallel ranks.

Each rank holds rows ``[start, start + V/tp)`` of the output projection. The full ``[tokens, V]``
logits are never gathered, and no rank holds more than ``[chunk, V/tp]`` of its own at once: the
forward reduces the per-token max, sum of exponentials and target logit over the group
(Megatron's vocab-parallel cross-entropy, Shoeybi et al. arXiv 1909.08053 §3), and the backward
recomputes each chunk's logits, as ``agentrl.algo.token_logprobs`` does on one device. Written
here rather than calling megatron-core's ``vocab_parallel_cross_entropy`` because that one works in
place on its logits and has no temperature or padded-vocabulary mask.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from agentrl.algo.logprobs import tf32_matmuls


def _all_reduce(t: Tensor, group, op=dist.ReduceOp.SUM) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _logits(h: Tensor, weight: Tensor, temperature: float, start: int, vocab_size: int) -> Tensor:
    """``[n, V/tp]`` logits of this rank's vocabulary rows; padded rows (index >= vocab_size) at -inf."""
    z = h.float() @ weight.float().t()
    if temperature != 1.0:
        z.div_(temperature)
    pad = start + weight.shape[0] - vocab_size
    if pad > 0:
        z[:, weight.shape[0] - pad :] = float("-inf")
    return z


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, targets, temperature, chunk, start, vocab_size, group, with_entropy, tf32
    ):
        with tf32_matmuls(tf32):
            out = _VocabParallelLogprobs._forward(
                ctx, hidden, weight, targets, temperature, chunk, start, vocab_size, group, with_entropy
            )
        ctx.tf32 = tf32
        return out

    @staticmethod
    def _forward(ctx, hidden, weight, targets, temperature, chunk, start, vocab_size, group, with_entropy):
        n, local = hidden.shape[0], weight.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        target_logit = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        mine = (targets >= start) & (targets < start + local)
        entropy = torch.zeros(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            z = _logits(hidden[a:b], weight, temperature, start, vocab_size)
            top = _all_reduce(z.max(-1).values, group, dist.ReduceOp.MAX)
            sums = _all_reduce((z - top[:, None]).exp().sum(-1), group)
            lse[a:b] = top + sums.log()
            idx = (targets[a:b] - start).clamp(0, local - 1)
            target_logit[a:b] = torch.where(mine[a:b], z.gather(1, idx[:, None]).squeeze(1), 0.0)
            if with_entropy:
                # H = lse - sum_j p_j z_j, the sum split over the ranks' vocabulary rows
                p = (z - lse[a:b, None]).exp()
                entropy[a:b] = torch.nan_to_num(p * z, nan=0.0).sum(-1)
        _all_reduce(target_logit, group)
        if with_entropy:
            entropy = lse - _all_reduce(entropy, group)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.args = (temperature, chunk, start, vocab_size, group)
        return target_logit - lse, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        with tf32_matmuls(ctx.tf32):
            return _VocabParallelLogprobs._backward(ctx, grad_logp)

    @staticmethod
    def _backward(ctx, grad_logp):
        # the entropy is a metric (no bonus term): its gradient is not propagated
        hidden, weight, targets, lse = ctx.saved_tensors
        temperature, chunk, start, vocab_size, group = ctx.args
        local = weight.shape[0]
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for a in range(0, hidden.shape[0], chunk):
            b = min(a + chunk, hidden.shape[0])
            h = hidden[a:b]
            # d logp_target / dz_j = onehot_j - p_j, times 1/T for the temperature's division
            grad = (_logits(h, weight, temperature, start, vocab_size) - lse[a:b, None]).exp_()
            grad.mul_(-grad_logp[a:b, None].float())
            idx = targets[a:b] - start
            rows = ((idx >= 0) & (idx < local)).nonzero().squeeze(1)
            grad[rows, idx[rows]] += grad_logp[a:b][rows].float()
            if temperature != 1.0:
                grad.div_(temperature)
            grad_hidden[a:b] = grad @ weight.float()
            grad_weight += grad.t() @ h.float()
        # every rank's vocabulary rows contribute to the (replicated) hidden state's gradient
        _all_reduce(grad_hidden, group)
        return grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype), *([None] * 8)


def vocab_parallel_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    chunk: int = 1024,
    group=None,
    entropy: bool = False,
    tf32: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-prob of each target token and, with ``entropy``, the (detached) entropy of its distribution.

    hidden: ``[N, H]`` final hidden states, the same on every rank of ``group``.
    weight: ``[V/tp, H]`` this rank's rows of the output projection (rank r: rows from ``r V/tp``).
    targets: ``[N]`` token ids (full-vocabulary indices, < ``vocab_size``).
    vocab_size: the real vocabulary; rows past it (padding to a multiple of tp) are masked out.
    tf32: the logits' products on CUDA's TF32 tensor cores (``agentrl.algo.logprobs.tf32_matmuls``).
    Returns ``[N]`` fp32 (and ``[N]`` entropy)."""
    rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
    logp, ent = _VocabParallelLogprobs.apply(
        hidden, weight, targets, temperature, chunk, rank * weight.shape[0], vocab_size, group, entropy, tf32
    )
    return (logp, ent.detach()) if entropy else logp
