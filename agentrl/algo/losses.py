"""Policy and value losses, IcePop token weights and the KL penalty.

Conventions: every per-token tensor is ``[B, T]``; ``mask`` is 1 on tokens the policy generated
and is trained on (0 on prompt, tool-output and padding tokens). Each function returns
``(value, metrics)`` with metrics as detached Python floats.
"""

from __future__ import annotations

import torch
from torch import Tensor

from agentrl.algo._checks import (
    as_bool_mask,
    check_2d,
    check_finite,
    check_same_shape,
    masked_float,
    masked_mean,
)


def icepop_weights(
    train_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    low: float = 0.5,
    high: float = 5.0,
) -> tuple[Tensor, dict[str, float]]:
    """IcePop token weights (Ring-1T, arXiv 2510.18855, sec. 3.2 "IcePop").

    The inference engine and the training engine disagree on token probabilities (different
    kernels, precision, MoE routing). IcePop keeps the importance weight
    ``k = p_train / p_rollout = exp(train_logp - rollout_logp)`` where ``low <= k <= high``
    and drops the token (weight 0) where it falls outside: such tokens carry a gradient the
    rollout distribution never sampled from. The weight multiplies the already-clipped PPO term;
    the loss denominator (number of trainable tokens) stays the same.

    Args:
        train_logp: ``[B, T]`` log-probs of the sampled tokens recomputed by the training engine
            before the update (the PPO "old" log-probs).
        rollout_logp: ``[B, T]`` log-probs the inference engine reported when sampling.
        mask: ``[B, T]`` 1 = trainable token.
        low, high: the band; defaults [0.5, 5.0].

    Returns:
        ``(weights [B, T], metrics)``; weights are detached, 0 at mask-0 and out-of-band tokens.
        Metrics: ``icepop_masked_frac`` (of trainable tokens), ``icepop_mean_abs_log_k``,
        ``icepop_k_min``, ``icepop_k_max``.
    """
    check_2d("train_logp", train_logp)
    check_same_shape("train_logp", train_logp, rollout_logp=rollout_logp, mask=mask)
    check_finite("train_logp", train_logp)
    check_finite("rollout_logp", rollout_logp)
    if not 0.0 <= low <= 1.0 <= high:
        raise ValueError(f"IcePop band must satisfy 0 <= low <= 1 <= high; got low={low}, high={high}.")
    trainable = as_bool_mask(mask)
    log_k = (train_logp.detach() - rollout_logp.detach()).float()
    k = torch.exp(log_k)
    keep = trainable & (k >= low) & (k <= high)
    weights = torch.where(keep, k, torch.zeros_like(k))
    n = int(trainable.sum())
    metrics = {
        "icepop_masked_frac": float((trainable & ~keep).sum()) / n if n else 0.0,
        "icepop_mean_abs_log_k": masked_float(log_k.abs(), trainable, "mean", 0.0),
        "icepop_k_min": masked_float(k, trainable, "min", 1.0),
        "icepop_k_max": masked_float(k, trainable, "max", 1.0),
    }
    return weights, metrics


MAX_LOG_RATIO = 20.0
"""|log(new / old)| at most this in the policy losses (a ratio within e^±20)."""
POLICY_KINDS = ("ppo", "gspo", "gmpo", "sapo")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def tis_weights(
    train_logp: Tensor, rollout_logp: Tensor, mask: Tensor, high: float = 5.0
) -> tuple[Tensor, dict[str, float]]:
    """Truncated importance sampling (TIS; Yao et al. 2025, "Your Efficient RL Framework Secretly
    Brings You Off-Policy RL Training"): every trainable token is kept with weight
    ``min(k, high)``, ``k = exp(train_logp - rollout_logp)``; the alternative to IcePop's dropping.

    Returns ``(weights [B, T], metrics)``: detached, 0 off the mask; ``tis_mean_weight`` over the
    trainable tokens (1.0 when there are none).
    """
    check_2d("train_logp", train_logp)
    check_same_shape("train_logp", train_logp, rollout_logp=rollout_logp, mask=mask)
    check_finite("train_logp", train_logp)
    check_finite("rollout_logp", rollout_logp)
    if high < 1:
        raise ValueError(f"high must be >= 1 (the truncation of the weight); got {high}")
    trainable = as_bool_mask(mask)
    k = torch.exp(train_logp.detach().float() - rollout_logp.detach().float())
    weights = torch.where(trainable, k.clamp(max=high), torch.zeros_like(k))
    mean = float(weights[trainable].mean()) if trainable.any() else 1.0
    return weights, {"tis_mean_weight": mean}


def aggregate(per_token: Tensor, mask: Tensor, agg: str) -> Tensor:
    """Reduce a ``[B, T]`` per-token loss over the trainable tokens.

    ``token-mean``: sum over all trainable tokens of the batch / their count. The count is of
    mask-1 tokens and is not reduced by tokens a token weight (IcePop) set to 0.
    ``seq-mean-token-mean``: each row's mean over its trainable tokens, then the mean over rows
    that have any. ``seq-mean-token-sum``: each row's sum, then the mean over rows that have any.
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown agg {agg!r}; choose one of {AGGREGATIONS}.")
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    if agg == "token-mean":
        return per_token.sum() / mask.sum().clamp(min=1)
    row_tokens = mask.sum(1)
    row_sum = per_token.sum(1)
    if agg == "seq-mean-token-mean":
        row_sum = row_sum / row_tokens.clamp(min=1)
    rows = row_tokens > 0
    return torch.where(rows, row_sum, torch.zeros_like(row_sum)).sum() / rows.sum().clamp(min=1)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    kind: str = "ppo",
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    token_weights: Tensor | None = None,
    agg: str = "token-mean",
    **kind_params: float,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped policy-gradient loss of the chosen kind (a scalar to minimise).

    Args:
        logp: ``[B, T]`` log-probs of the sampled tokens under the policy being trained (with grad).
        old_logp: ``[B, T]`` log-probs under the policy that the batch is trained against (the
            training engine's recomputation before the update).
        advantages: ``[B, T]`` per-token advantages (broadcast sequence-level ones first).
        mask: ``[B, T]`` 1 = trainable token.
        kind: ``ppo`` | ``gspo`` | ``gmpo`` | ``sapo``.
        clip_low, clip_high: PPO ratio band ``[1 - clip_low, 1 + clip_high]`` (the asymmetric
            "clip-higher" of DAPO, arXiv 2503.14476, sec. 3.1). Used by ``ppo`` only.
        dual_clip: ``c > 1`` bounds the loss of negative-advantage tokens by ``-c * A``
            (dual-clip PPO, Ye et al. arXiv 1912.09729, eq. 5). ``ppo`` only.
        token_weights: ``[B, T]`` detached per-token weights (IcePop or TIS) multiplying each
            token's term; the denominator is unchanged.
        agg: aggregation for ``ppo`` and ``sapo`` (see ``aggregate``). ``gspo`` and ``gmpo`` are
            sequence-level objectives and aggregate as their papers define.
        kind_params: ``gspo``: ``clip_low`` (3e-4), ``clip_high`` (4e-4) override the band
            when given as ``gspo_clip_low`` / ``gspo_clip_high``; ``gmpo``: ``gmpo_clip`` (0.4,
            in log space); ``sapo``: ``tau_pos`` (1.0), ``tau_neg`` (1.05).

    Per-token terms, with ``r = exp(logp - old_logp)``:
        ``ppo``: ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``; with ``dual_clip`` and
        ``A < 0``: ``min(that, -c A)``.
        ``gspo`` (arXiv 2507.18071, eq. 7 and the GSPO-token form, eq. 13): sequence ratio
        ``s_i = exp(mean_t (logp - old_logp))``, token ratio ``s_it = sg(s_i) exp(logp - sg(logp))``,
        term ``max(-A s_it, -A clip(s_it, 1 - 3e-4, 1 + 4e-4))``; mean over a row's tokens, then
        over rows.
        ``gmpo`` (arXiv 2507.20673, eq. 4): ``l = logp - old_logp``, ``l_c = clip(l, -0.4, 0.4)``,
        ``m = sign(A) min(sign(A) l, sign(A) l_c)``, ``rho_i = exp(mean_t m)``, loss
        ``mean_i(-mean_t(A) rho_i)``. Token weights scale each token's gradient (not the value).
        ``sapo`` (arXiv 2511.20347, eq. 5): soft gate ``g = sigmoid(tau (r - 1)) 4 / tau`` with
        ``tau = tau_pos`` where ``A > 0`` and ``tau_neg`` where ``A < 0``; term ``-g A``.

    Returns:
        ``(loss, metrics)``: ``clip_frac``, ``approx_kl`` (k3 estimator of KL(old || new),
        Schulman 2020 "Approximating KL divergence"), ``ratio_min``, ``ratio_max``, and
        ``icepop_masked_frac`` when ``token_weights`` is given.
    """
    if kind not in POLICY_KINDS:
        raise ValueError(f"unknown policy loss kind {kind!r}; choose one of {POLICY_KINDS}.")
    allowed = {
        "gspo": {"gspo_clip_low", "gspo_clip_high"},
        "gmpo": {"gmpo_clip"},
        "sapo": {"tau_pos", "tau_neg"},
    }
    unknown = set(kind_params) - allowed.get(kind, set())
    if unknown:
        raise ValueError(
            f"policy_loss kind {kind!r} takes no parameter(s) {sorted(unknown)}; "
            f"it accepts {sorted(allowed.get(kind, set())) or 'none'}."
        )
    check_2d("logp", logp)
    check_same_shape(
        "logp", logp, old_logp=old_logp, advantages=advantages, mask=mask, token_weights=token_weights
    )
    for name, x in (("logp", logp), ("old_logp", old_logp), ("advantages", advantages)):
        check_finite(name, x)
    if token_weights is not None:
        check_finite("token_weights", token_weights)
        if token_weights.requires_grad:
            raise ValueError("token_weights must be detached (IcePop/TIS weights carry no gradient).")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (typically 3); got {dual_clip}.")
    trainable = as_bool_mask(mask)
    zeros = torch.zeros_like(logp)
    adv = advantages.detach().to(logp.dtype)
    old = old_logp.detach().to(logp.dtype)
    # Bounded before exp: past e^88 fp32 overflows, and 0 * inf (a zero advantage or IcePop weight)
    # makes the loss NaN. A ratio that far out is clipped, or its gradient is clipped, anyway.
    log_ratio = torch.where(trainable, logp - old, zeros).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    weight = token_weights.to(logp.dtype) if token_weights is not None else None

    if kind == "ppo":
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        per_token = torch.maximum(unclipped, clipped)
        clip_active = clipped > unclipped
        if dual_clip is not None:
            bound = -dual_clip * adv
            dual_active = (adv < 0) & (per_token > bound)
            per_token = torch.where(adv < 0, torch.minimum(per_token, bound), per_token)
            clip_active = clip_active | dual_active
        if weight is not None:
            per_token = per_token * weight
        loss = aggregate(per_token, trainable, agg)
        ratio_for_metrics = ratio
    elif kind == "sapo":
        tau_pos, tau_neg = kind_params.get("tau_pos", 1.0), kind_params.get("tau_neg", 1.05)
        tau = torch.where(adv >= 0, adv.new_tensor(tau_pos), adv.new_tensor(tau_neg))
        gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
        per_token = -gate * adv
        if weight is not None:
            per_token = per_token * weight
        loss = aggregate(per_token, trainable, agg)
        clip_active = torch.zeros_like(trainable)  # a soft gate never clips
        ratio_for_metrics = ratio
    elif kind == "gspo":
        lo, hi = kind_params.get("gspo_clip_low", 3e-4), kind_params.get("gspo_clip_high", 4e-4)
        row_tokens = trainable.sum(1, keepdim=True).clamp(min=1)
        seq_ratio = torch.exp(log_ratio.sum(1, keepdim=True) / row_tokens)  # s_i, [B, 1]
        token_ratio = seq_ratio.detach() * torch.exp(logp - logp.detach())  # s_it, value s_i
        unclipped = -adv * token_ratio
        clipped = -adv * token_ratio.clamp(1.0 - lo, 1.0 + hi)
        per_token = torch.maximum(unclipped, clipped)
        clip_active = clipped > unclipped
        if weight is not None:
            per_token = per_token * weight
        loss = aggregate(per_token, trainable, "seq-mean-token-mean")
        ratio_for_metrics = seq_ratio.expand_as(logp)
    else:  # gmpo
        eps = kind_params.get("gmpo_clip", 0.4)
        sign = torch.sign(adv)
        clipped_log = log_ratio.clamp(-eps, eps)
        m = sign * torch.minimum(sign * log_ratio, sign * clipped_log)
        clip_active = (sign * clipped_log) < (sign * log_ratio)
        if weight is not None:
            # Same value, gradient scaled by the weight: an IcePop-dropped token gets none.
            m = weight * m + (1.0 - weight) * m.detach()
        row_tokens = trainable.sum(1)
        rows = row_tokens > 0
        denom = row_tokens.clamp(min=1)
        rho = torch.exp(torch.where(trainable, m, zeros).sum(1) / denom)
        mean_adv = torch.where(trainable, adv, zeros).sum(1) / denom
        per_row = -mean_adv * rho
        loss = torch.where(rows, per_row, torch.zeros_like(per_row)).sum() / rows.sum().clamp(min=1)
        ratio_for_metrics = rho[:, None].expand_as(logp)

    n = int(trainable.sum())
    with torch.no_grad():
        k3 = (ratio - 1.0) - log_ratio  # KL(old || new) estimator on samples from old
    metrics = {
        "clip_frac": float((clip_active & trainable).sum()) / n if n else 0.0,
        "approx_kl": masked_float(k3, trainable, "mean", 0.0),
        "ratio_min": masked_float(ratio_for_metrics, trainable, "min", 1.0),
        "ratio_max": masked_float(ratio_for_metrics, trainable, "max", 1.0),
    }
    if weight is not None:
        metrics["icepop_masked_frac"] = float((trainable & (weight == 0)).sum()) / n if n else 0.0
    return loss, metrics


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over the masked tokens; 0 when the returns have (nearly) no
    variance to explain (not a huge ratio)."""
    return explained_variance_from_sums(explained_variance_sums(values, returns, mask))


def explained_variance_sums(values: Tensor, returns: Tensor, mask: Tensor) -> dict[str, float]:
    """What the explained variance is computed from, over the masked tokens: their count ``n`` and
    the sums of ``R``, ``R^2``, ``D = R - V`` and ``D^2`` (float64). Sums of parts (micro-batches,
    ranks) add up to the sums of the whole."""
    trainable = as_bool_mask(mask)
    with torch.no_grad():
        r = returns.detach()[trainable].double()
        d = r - values.detach()[trainable].double()
        return {
            "n": float(r.numel()),
            "r": float(r.sum()),
            "r2": float((r * r).sum()),
            "d": float(d.sum()),
            "d2": float((d * d).sum()),
        }


def explained_variance_from_sums(s: dict[str, float]) -> float:
    """``explained_variance`` from ``explained_variance_sums`` (of one batch, or added over parts)."""
    n = s["n"]
    if n < 2:
        return 0.0
    var_r = s["r2"] / n - (s["r"] / n) ** 2
    var_d = s["d2"] / n - (s["d"] / n) ** 2
    return 1.0 - var_d / var_r if var_r > 1e-8 else 0.0


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float | None = 0.2,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss (PPO2 baseline implementation; Engstrom et al. arXiv 2005.12729, sec. 3).

    ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2)``, token-mean over the
    mask; ``clip=None`` gives ``0.5 * (V - R)^2``.

    Args:
        values: ``[B, T]`` current critic outputs (with grad).
        old_values: ``[B, T]`` critic outputs when the batch was collected.
        returns: ``[B, T]`` targets (``gae`` returns).
        mask: ``[B, T]`` 1 = trainable token.

    Returns:
        ``(loss, metrics)``: ``value_explained_var`` (1 - Var(R - V) / Var(R) over the mask),
        ``value_clip_frac``, ``value_mean``, ``return_mean``.
    """
    check_2d("values", values)
    check_same_shape("values", values, old_values=old_values, returns=returns, mask=mask)
    for name, x in (("values", values), ("old_values", old_values), ("returns", returns)):
        check_finite(name, x)
    trainable = as_bool_mask(mask)
    target = returns.detach().to(values.dtype)
    err = (values - target) ** 2
    if clip is None:
        per_token = 0.5 * err
        clip_active = torch.zeros_like(trainable)
    else:
        old = old_values.detach().to(values.dtype)
        clipped = old + (values - old).clamp(-clip, clip)
        err_clipped = (clipped - target) ** 2
        per_token = 0.5 * torch.maximum(err, err_clipped)
        clip_active = err_clipped > err
    loss = masked_mean(per_token, trainable)

    n = int(trainable.sum())
    metrics = {
        "value_explained_var": explained_variance(values, target, trainable),
        "value_clip_frac": float((clip_active & trainable).sum()) / n if n else 0.0,
        "value_mean": masked_float(values, trainable, "mean", 0.0),
        "return_mean": masked_float(target, trainable, "mean", 0.0),
    }
    return loss, metrics


KL_KINDS = ("k1", "k2", "k3")


def kl_penalty(
    logp: Tensor, ref_logp: Tensor, mask: Tensor, kind: str = "k3"
) -> tuple[Tensor, dict[str, float]]:
    """Per-token estimator of KL(pi || pi_ref) on tokens sampled from pi (Schulman 2020, "Approximating KL").

    With ``l = ref_logp - logp``: ``k1 = -l``, ``k2 = l^2 / 2``, ``k3 = exp(l) - 1 - l`` (unbiased,
    non-negative). agentrl recipes default the KL coefficient to 0: IcePop bounds the
    train/inference mismatch that a reference KL was partly standing in for.

    Returns:
        ``(kl [B, T] with 0 at mask-0 positions, metrics {"kl_mean"})``.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {KL_KINDS}.")
    check_2d("logp", logp)
    check_same_shape("logp", logp, ref_logp=ref_logp, mask=mask)
    check_finite("logp", logp)
    check_finite("ref_logp", ref_logp)
    trainable = as_bool_mask(mask)
    # Zeroed off the mask before the estimator: a prompt or tool-output token the policy now finds far
    # less likely than the reference would overflow exp, and the zero that masks it afterwards would
    # still pass 0 * inf = NaN back into logp's gradient.
    log_r = torch.where(trainable, ref_logp.detach().to(logp.dtype) - logp, torch.zeros_like(logp))
    if kind == "k1":
        kl = -log_r
    elif kind == "k2":
        kl = 0.5 * log_r**2
    else:
        kl = torch.exp(log_r) - 1.0 - log_r
    kl = torch.where(trainable, kl, torch.zeros_like(kl))
    return kl, {"kl_mean": masked_float(kl, trainable, "mean", 0.0)}
