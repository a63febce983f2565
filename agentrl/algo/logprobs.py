"""Memory-bounded log-probabilities of target tokens straight from the last hidden states.

A long agent trajectory (T = 32k tokens) times a real vocabulary (V = 150k) makes the
``[T, V]`` logits the largest tensor of a training step by far: 19 GB in fp32, held once for the
forward and again for its gradient. ``token_logprobs`` never holds more than
``[chunk_size, V]`` of them: the forward keeps only the per-token log-normaliser, and the
backward recomputes each chunk's logits to form its gradient (the same trade as "cut
cross-entropy", Wijmans et al. arXiv 2411.09009, done chunk-wise).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from agentrl.algo._checks import check_finite


@contextlib.contextmanager
def tf32_matmuls(enabled: bool = True):
    """fp32 matrix products on CUDA's TF32 tensor cores inside: inputs rounded to 10 mantissa bits,
    fp32 accumulation and output. For the LM head of a bf16 run, whose logits are kept in fp32
    (their size makes a bf16 rounding of them matter) but whose inputs come from bf16 layers: full
    fp32 products run about an order of magnitude slower than tensor cores on a GPU. The setting is
    the process's: it is restored on leaving, and has no effect on the CPU."""
    if not enabled:
        yield
        return
    matmul = torch.backends.cuda.matmul
    # torch >= 2.9 names the setting fp32_precision; its older flag must not be mixed with it
    name, value = ("fp32_precision", "tf32") if hasattr(matmul, "fp32_precision") else ("allow_tf32", True)
    before = getattr(matmul, name)
    setattr(matmul, name, value)
    try:
        yield
    finally:
        setattr(matmul, name, before)


def _chunk_logits(hidden: Tensor, weight: Tensor, temperature: float) -> Tensor:
    logits = hidden.float() @ weight.float().t()
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """Forward keeps the per-row log-normaliser (and entropy); backward recomputes logits per chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, return_entropy, tf32):
        with tf32_matmuls(tf32):
            out = _ChunkedTokenLogprobs._forward(
                ctx, hidden, weight, targets, temperature, chunk_size, return_entropy
            )
        ctx.tf32 = tf32
        return out

    @staticmethod
    def _forward(ctx, hidden, weight, targets, temperature, chunk_size, return_entropy):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n if return_entropy else 0, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            logits = _chunk_logits(hidden[start:end], weight, temperature)
            chunk_lse = torch.logsumexp(logits, dim=-1)
            lse[start:end] = chunk_lse
            logp[start:end] = logits.gather(1, targets[start:end, None]).squeeze(1) - chunk_lse
            if return_entropy:
                # H = lse - sum_j p_j z_j
                probs = (logits - chunk_lse[:, None]).exp_()
                entropy[start:end] = chunk_lse - probs.mul_(logits).sum(-1)
                del probs
            del logits
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk_size, ctx.return_entropy = temperature, chunk_size, return_entropy
        return (logp, entropy) if return_entropy else logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        with tf32_matmuls(ctx.tf32):
            return _ChunkedTokenLogprobs._backward(ctx, grad_logp, grad_entropy)

    @staticmethod
    def _backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # an entropy returned as a metric only has a zero gradient: skip its term
        with_entropy = ctx.return_entropy and grad_entropy is not None and bool(grad_entropy.any())
        grad_hidden = torch.zeros_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            h = hidden[start:end]
            g_logp = grad_logp[start:end, None].float()
            # In the logits buffer, in place: z -> log p -> p.
            log_probs = _chunk_logits(h, weight, temperature).sub_(lse[start:end, None])
            if with_entropy:
                # dH/dz_j = -p_j (log p_j + H);  d logp_target / dz_j = onehot_j - p_j
                g_ent = grad_entropy[start:end, None].float()
                probs = log_probs.exp()
                grad = log_probs.add_(entropy[start:end, None]).mul_(probs).mul_(-g_ent)
                grad.sub_(probs.mul_(g_logp))
                del probs
            else:
                grad = log_probs.exp_().mul_(-g_logp)
            rows = torch.arange(end - start, device=grad.device)
            grad[rows, targets[start:end]] += g_logp.squeeze(1)
            if temperature != 1.0:
                grad.div_(temperature)
            if need_h:
                grad_hidden[start:end] = (grad @ weight.float()).to(hidden.dtype)
            if need_w:
                grad_weight.addmm_(grad.t(), h.float())
            del grad, log_probs
        if need_w:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    *,
    tf32: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """``log_softmax(hidden @ weight.T / temperature)`` gathered at ``targets``, chunk by chunk.

    Equal to the naive computation (to fp32 rounding) in value and in gradient with respect to
    ``hidden`` and ``weight``; neither the forward nor the backward holds the full ``[N, V]``
    logits, only ``[chunk_size, V]`` at a time. Logits are formed in fp32 whatever the input
    dtype. Divide by the sampling temperature to match what the inference engine reported
    (SGLang's logprobs are ``log_softmax(logits / temperature)``).

    Args:
        hidden: ``[..., H]`` final hidden states (after the last norm).
        weight: ``[V, H]`` output embedding (LM head) weight.
        targets: ``[...]`` token id whose log-prob is wanted at each position (the next token).
        temperature: logits are divided by it.
        chunk_size: rows of logits formed at once.
        return_entropy: also return the entropy of each position's distribution (differentiable).
        tf32: form the logits (forward and backward) with TF32 products on CUDA (``tf32_matmuls``);
            they stay fp32.

    Returns:
        ``logp [...]`` in fp32, or ``(logp, entropy)`` when ``return_entropy``.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets has shape {tuple(targets.shape)} but hidden has leading shape {tuple(hidden.shape[:-1])}; "
            "pass one target id per hidden state."
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be [V, H] with H = {hidden.shape[-1]} (hidden size); got {tuple(weight.shape)}."
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (use 1.0 for greedy requests); got {temperature}.")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}.")
    check_finite("hidden", hidden)
    vocab = weight.shape[0]
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        bad = int(targets.max()) if int(targets.max()) >= vocab else int(targets.min())
        raise ValueError(f"targets holds token id {bad}, outside the vocabulary [0, {vocab}).")
    lead = targets.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).long()
    out = _ChunkedTokenLogprobs.apply(
        flat_hidden,
        weight,
        flat_targets,
        float(temperature),
        int(chunk_size),
        bool(return_entropy),
        bool(tf32),
    )
    if return_entropy:
        logp, entropy = out
        return logp.view(lead), entropy.view(lead)
    return out.view(lead)
