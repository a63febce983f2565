"""Slow, obvious reference implementations the fast RL maths is checked against."""

from __future__ import annotations

import torch


def gae_loop(rewards, values, mask, gamma=1.0, lam=1.0):
    """GAE over trainable tokens, one row and one token at a time, straight from the definition."""
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    ret = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        credited = [0.0] * T
        last = None
        for t in range(T):
            if mask[b, t]:
                last = t
            r = float(rewards[b, t])
            if r != 0.0:
                assert last is not None
                credited[last] += r
        next_value, next_adv = 0.0, 0.0
        for t in reversed(range(T)):
            if not mask[b, t]:
                continue
            v = float(values[b, t])
            delta = credited[t] + gamma * next_value - v
            next_adv = delta + gamma * lam * next_adv
            adv[b, t] = next_adv
            ret[b, t] = next_adv + v
            next_value = v
    return adv, ret


def naive_token_logprobs(hidden, weight, targets, temperature=1.0):
    logits = (hidden.float() @ weight.float().t()) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def agent_mask(batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """A realistic agent-trajectory mask: prompt, then alternating assistant / tool segments, then padding."""
    mask = torch.zeros(batch, length, dtype=torch.bool)
    for b in range(batch):
        t = int(torch.randint(1, max(2, length // 8), (1,), generator=generator))
        end = length - int(torch.randint(0, max(1, length // 8), (1,), generator=generator))
        while t < end:
            n = int(torch.randint(1, max(2, length // 16), (1,), generator=generator))
            mask[b, t : min(t + n, end)] = True
            t += n + int(torch.randint(1, max(2, length // 16), (1,), generator=generator))
    return mask
