"""Advantage estimators: GAE over trainable tokens and group-relative baselines.

Conventions: ``mask`` is ``[B, T]``, 1 on tokens the policy generated and is trained on, 0 on
prompt, tool-output and padding tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from agentrl.algo._checks import as_bool_mask, check_2d, check_finite, check_same_shape

# Chunk length of the blocked scan in ``discounted_reverse_cumsum``. Within a chunk the discount
# powers are applied by one small matmul; chunks are chained by the same scan one level up.
_SCAN_CHUNK = 64


def discounted_reverse_cumsum(x: Tensor, discount: float) -> Tensor:
    """``y[..., t] = sum_{j >= t} discount**(j - t) * x[..., j]`` along the last dimension.

    Args:
        x: ``[B, N]``.
        discount: the factor per step, in [0, 1].

    Returns ``[B, N]``. Runs in O(log N) sequential steps: the sequence is cut into chunks of
    ``_SCAN_CHUNK``; inside a chunk a ``[C, C]`` matrix of discount powers does the sum, and the
    value at the start of each chunk (a discounted sum over the chunk heads with factor
    ``discount**C``) is found by the same routine one level up. No power larger than
    ``discount**C`` is ever formed, so nothing under- or overflows as it would with the
    ``cumsum(x * d**t) / d**t`` trick on long sequences.
    """
    if discount == 1.0:
        return x.flip(-1).cumsum(-1).flip(-1)
    batch, n = x.shape
    chunk = min(_SCAN_CHUNK, n)
    steps = torch.arange(chunk, device=x.device, dtype=x.dtype)
    # powers[j, k] = discount**(j - k) for j >= k, else 0; local = x_chunk @ powers.
    exponent = steps[:, None] - steps[None, :]
    powers = torch.where(exponent >= 0, torch.full_like(exponent, discount) ** exponent.clamp(min=0), 0.0)
    if n <= chunk:
        return x @ powers
    n_chunks = -(-n // chunk)
    padded = torch.nn.functional.pad(x, (0, n_chunks * chunk - n))
    local = padded.view(batch, n_chunks, chunk) @ powers
    heads = discounted_reverse_cumsum(local[..., 0], discount**chunk)
    next_head = torch.nn.functional.pad(heads[:, 1:], (0, 1))
    tail_power = discount ** (chunk - steps)  # discount**(C - k): from position k to the next chunk's start
    out = local + next_head[..., None] * tail_power
    return out.reshape(batch, n_chunks * chunk)[:, :n]


def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation run over the trainable tokens only.

    GAE (Schulman et al. 2016, arXiv 1506.02438, eq. 16) treats each generated token as an action.
    In an agent trajectory the tool output and the chat template between two assistant turns
    are not actions: the recursion skips them, so the value of the token after a tool
    observation bootstraps the last token before it. For the trainable positions
    ``t_1 < ... < t_n`` of a row::

        delta_k = r(t_k) + gamma * V(t_{k+1}) - V(t_k),   V(t_{n+1}) = 0
        A_k     = delta_k + gamma * lam * A_{k+1}
        returns = A + V                                     (at trainable positions)

    A reward placed at a mask-0 position (e.g. the terminal reward put on the last token of a
    tool observation) is credited to the nearest trainable position before it: the action that
    caused that observation. A nonzero reward before a row's first trainable token has no action
    to credit and is an error.

    Args:
        rewards: ``[B, T]`` per-token rewards (usually all 0 but the last generated token).
        values: ``[B, T]`` critic values V(t); read at trainable positions only.
        mask: ``[B, T]`` 1 = trainable (policy-generated) token.
        gamma: discount per trainable step.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, both ``[B, T]``, exactly 0 at mask-0 positions.
    """
    check_2d("rewards", rewards)
    check_same_shape("rewards", rewards, values=values, mask=mask)
    check_finite("rewards", rewards)
    check_finite("values", values)
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must lie in [0, 1]; got gamma={gamma}, lam={lam}.")
    trainable = as_bool_mask(mask)
    batch, length = rewards.shape
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32

    # Position k of the compacted row holds the k-th trainable token. ``slot[b, t]`` is the
    # compacted index of the last trainable token at or before t (-1 before the first one).
    slot = trainable.to(torch.int64).cumsum(1) - 1
    dump = length  # an extra column that swallows writes we do not want
    reward_slot = torch.where(slot >= 0, slot, dump)
    value_slot = torch.where(trainable, slot, dump)

    compact_rewards = torch.zeros(batch, length + 1, dtype=dtype, device=rewards.device)
    compact_rewards.scatter_add_(1, reward_slot, rewards.to(dtype))
    orphan = compact_rewards[:, dump] != 0
    if bool(orphan.any()):
        row = int(orphan.nonzero()[0])
        first = int(trainable[row].nonzero()[0]) if bool(trainable[row].any()) else None
        raise ValueError(
            f"row {row} has a nonzero reward before its first trainable token (first trainable "
            f"position: {first}); a reward must follow the action that earned it. Put the "
            f"terminal reward on the last generated token, or check the loss mask of that row."
        )
    compact_values = torch.zeros(batch, length + 1, dtype=dtype, device=rewards.device)
    compact_values.scatter_(1, value_slot, values.to(dtype))
    compact_values = compact_values[:, :length]  # past a row's last trainable token: 0 = V(t_{n+1})
    next_values = torch.nn.functional.pad(compact_values[:, 1:], (0, 1))

    deltas = compact_rewards[:, :length] + gamma * next_values - compact_values
    compact_adv = discounted_reverse_cumsum(deltas, gamma * lam)

    advantages = torch.gather(compact_adv, 1, slot.clamp(min=0))
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    advantages = torch.where(trainable, advantages, zero)
    returns = torch.where(trainable, advantages + values.to(dtype), zero)
    return advantages.to(values.dtype), returns.to(values.dtype)


GROUP_KINDS = ("grpo", "rloo", "mean")


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    kind: str = "grpo",
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, dict[str, float]]:
    """Sequence-level advantages from the other samples of the same prompt.

    Kinds:
        ``grpo`` (DeepSeekMath, arXiv 2402.03300, sec. 4.1.2): ``r - mean(group)``, divided by
        ``std(group) + eps`` when ``normalize_std`` (std with Bessel's correction; Dr. GRPO,
        arXiv 2503.20783, argues for ``normalize_std=False``).
        ``rloo`` (Ahmadian et al., arXiv 2402.14740, eq. 6): ``r - mean(other samples of the group)``.
        ``mean``: ``r - mean(group)``, never divided.

    A group of one sample has no baseline: its advantage is 0, and it is counted in
    ``metrics["singleton_groups"]``.

    Args:
        rewards: ``[B]`` one scalar reward per sequence.
        group_ids: ``[B]`` integer id of each sequence's group (samples of the same task).

    Returns:
        ``(advantages [B], metrics)``. Broadcast to ``[B, T]`` with the mask before ``policy_loss``.
    """
    if kind not in GROUP_KINDS:
        raise ValueError(f"unknown group advantage kind {kind!r}; choose one of {GROUP_KINDS}.")
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [B]; got {tuple(rewards.shape)} and {tuple(group_ids.shape)}."
        )
    if group_ids.is_floating_point():
        raise ValueError(f"group_ids must be integers (one id per task); got dtype {group_ids.dtype}.")
    check_finite("rewards", rewards)
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    r = rewards.to(dtype)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0

    def per_group(reduce: str, x: Tensor) -> Tensor:
        out = torch.zeros(n_groups, dtype=dtype, device=r.device)
        return out.scatter_reduce_(0, inverse, x, reduce, include_self=False)

    count = per_group("sum", torch.ones_like(r))
    uniform = per_group("amax", r) == per_group("amin", r)  # includes groups of one
    n, mean = count[inverse], per_group("mean", r)[inverse]
    if kind == "rloo":
        adv = r - (per_group("sum", r)[inverse] - r) / (n - 1).clamp(min=1)
    else:
        adv = r - mean
        if kind == "grpo" and normalize_std:
            std = (per_group("sum", (r - mean) ** 2)[inverse] / (n - 1).clamp(min=1)).sqrt()
            adv = adv / (std + eps)
    # Exactly 0 where there is no signal: a group of one, or every sample got the same reward
    # (r - mean is then a rounding residue that a small std would blow up).
    adv = torch.where(uniform[inverse], torch.zeros_like(adv), adv)

    metrics = {
        "groups": float(n_groups),
        "singleton_groups": float((count == 1).sum()),
        "uniform_reward_groups": float((uniform & (count > 1)).sum()),
        "zero_adv_frac": float((adv == 0).to(dtype).mean()) if adv.numel() else 0.0,
    }
    return adv.to(rewards.dtype), metrics


def place_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Episode rewards as per-token rewards for ``gae``: each row's reward on its last trainable token
    (the end of the policy's last turn), 0 elsewhere; a row with no trainable token gets none.

    Args:
        rewards: ``[B]`` episode rewards.
        mask: ``[B, T]`` 1 = trainable token.
    """
    check_2d("mask", mask)
    trainable = as_bool_mask(mask)
    if rewards.shape != trainable.shape[:1]:
        raise ValueError(f"rewards must be [B] = [{trainable.shape[0]}]; got {list(rewards.shape)}")
    check_finite("rewards", rewards)
    out = torch.zeros(trainable.shape, dtype=torch.float32, device=rewards.device)
    positions = torch.arange(trainable.shape[1], device=trainable.device)
    last = torch.where(trainable, positions, -1).max(1).values
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] = rewards[rows].float()
    return out


def whiten(advantages: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Advantages shifted and scaled to mean 0 and standard deviation 1 over the trainable tokens
    (0 off the mask). With no spread (one token, or all equal) they are only shifted, to 0: no token
    is better than the batch's mean."""
    check_same_shape("advantages", advantages, mask=mask)
    trainable = as_bool_mask(mask)
    values = advantages[trainable]
    if values.numel() == 0:
        return torch.zeros_like(advantages)
    centred = advantages - values.mean()
    spread = float(values.std()) if values.numel() > 1 else 0.0
    if spread > 0:
        centred = centred / (spread + eps)
    return torch.where(trainable, centred, torch.zeros(()))
