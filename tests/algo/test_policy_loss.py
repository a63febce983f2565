import math

import pytest
import torch

from agentrl.algo import aggregate, icepop_weights, policy_loss, value_loss


def leaf(old, log_ratios):
    old = torch.tensor(old, dtype=torch.float64)
    logp = (old + torch.tensor(log_ratios, dtype=torch.float64)).requires_grad_(True)
    return logp, old


def test_ppo_clipping_both_sides_hand_derived():
    # clip band [0.8, 1.28]. Per token: max(-A r, -A clip(r)):
    #  A=+1 r=1.5 -> max(-1.5, -1.28) = -1.28  clipped (no gradient)
    #  A=+1 r=0.5 -> max(-0.5, -0.8)  = -0.5   unclipped: d/dlogp = -A r = -0.5
    #  A=-1 r=0.5 -> max(0.5, 0.8)    =  0.8   clipped (no gradient)
    #  A=-1 r=1.5 -> max(1.5, 1.28)   =  1.5   unclipped: d/dlogp = -A r = 1.5
    #  A=+2 r=1.1 -> -2.2 inside the band:     d/dlogp = -2.2
    # token-mean over 5: (-1.28 - 0.5 + 0.8 + 1.5 - 2.2) / 5 = -0.336; gradients / 5.
    logp, old = leaf([[-1.0, -2.0, -1.5, -0.7, -3.0]], [[math.log(r) for r in (1.5, 0.5, 0.5, 1.5, 1.1)]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 2.0]], dtype=torch.float64)
    loss, m = policy_loss(logp, old, adv, torch.ones(1, 5), clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-0.336, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.1, 0.0, 0.3, -0.44]], dtype=torch.float64))
    assert m["clip_frac"] == pytest.approx(2 / 5)
    assert m["ratio_min"] == pytest.approx(0.5) and m["ratio_max"] == pytest.approx(1.5)
    # k3 = mean((r - 1) - log r)
    k3 = sum((r - 1) - math.log(r) for r in (1.5, 0.5, 0.5, 1.5, 1.1)) / 5
    assert m["approx_kl"] == pytest.approx(k3, rel=1e-9)


def test_dual_clip_hand_derived():
    # dual_clip c = 3 caps negative-advantage losses at -c A = 3:
    #  A=-1 r=5 -> max(5, 1.28) = 5 -> min(5, 3) = 3 (no gradient)
    #  A=-1 r=2 -> max(2, 1.28) = 2 -> min(2, 3) = 2 (d/dlogp = -A r = 2)
    #  A=+1 r=5 -> -1.28, dual clip does not apply to A > 0
    # token-mean: (3 + 2 - 1.28) / 3 = 1.24
    logp, old = leaf([[-1.0, -1.0, -1.0]], [[math.log(5), math.log(2), math.log(5)]])
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64)
    loss, m = policy_loss(logp, old, adv, torch.ones(1, 3), dual_clip=3.0)
    assert loss.item() == pytest.approx(1.24, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2 / 3, 0.0]], dtype=torch.float64))
    assert m["clip_frac"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(logp, old, adv, torch.ones(1, 3), dual_clip=0.5)


def test_icepop_weight_keeps_the_denominator():
    # 4 trainable tokens, A = 1, r = 1 (loss -1 each); IcePop drops two (k = 0.1 and 9).
    # token-mean = sum(w * -1) / 4 = -(1 + 2) / 4 = -0.75, not -(1 + 2) / 2.
    train = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0]])
    rollout = -torch.tensor([[math.log(0.1), math.log(1.0), math.log(2.0), math.log(9.0), 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    w, _ = icepop_weights(train, rollout, mask)
    logp = train.clone().requires_grad_(True)
    loss, m = policy_loss(logp, train, torch.ones(1, 5), mask, token_weights=w)
    assert loss.item() == pytest.approx(-0.75)
    assert m["icepop_masked_frac"] == 0.5


def test_gspo_hand_derived():
    # Row 0: log-ratios 0.1, -0.1 -> s = exp(0) = 1, inside [1 - 3e-4, 1 + 4e-4]: per-token -A s = -1.
    # Row 1: log-ratios 0.002, 0.002 -> s = exp(0.002) = 1.002 > 1.0004 with A = +1: clipped, -1.0004.
    # Loss = mean over rows of each row's token mean = (-1 - 1.0004) / 2 = -1.0002.
    # Gradient: row 0 tokens -A s / 2 (row mean) / 2 (rows) = -0.25; row 1 is clipped: 0. Padding: 0.
    logp, old = leaf([[-1.0, -2.0, -5.0], [-1.0, -1.0, -5.0]], [[0.1, -0.1, 0.7], [0.002, 0.002, 0.7]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    loss, m = policy_loss(logp, old, torch.ones(2, 3, dtype=torch.float64), mask, kind="gspo")
    assert loss.item() == pytest.approx(-1.0002, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(
        logp.grad, torch.tensor([[-0.25, -0.25, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    )
    assert m["clip_frac"] == pytest.approx(0.5)
    assert m["ratio_max"] == pytest.approx(math.exp(0.002))


def test_gmpo_hand_derived():
    # Row 0, A = +1, l = [0.6, -0.2]: l_c = [0.4, -0.2]; m = min(l, l_c) = [0.4, -0.2]; rho = e^0.1; loss -e^0.1.
    # Row 1, A = -1, l = [-0.6, 0.2]: m = max(l, l_c) = [-0.4, 0.2]; rho = e^-0.1; loss +e^-0.1.
    # Loss = (-e^0.1 + e^-0.1) / 2 = -sinh(0.1).
    # Gradient: clipped tokens 0; row 0 token 1: -rho / 2 (token mean) / 2 (rows) = -e^0.1 / 4;
    # row 1 token 1: +e^-0.1 / 4.
    logp, old = leaf([[-1.0, -1.0], [-1.0, -1.0]], [[0.6, -0.2], [-0.6, 0.2]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    loss, m = policy_loss(logp, old, adv, torch.ones(2, 2), kind="gmpo")
    assert loss.item() == pytest.approx(-math.sinh(0.1), abs=1e-12)
    loss.backward()
    expected = torch.tensor([[0.0, -math.exp(0.1) / 4], [0.0, math.exp(-0.1) / 4]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected)
    assert m["clip_frac"] == pytest.approx(0.5)


def test_sapo_hand_derived():
    # A = +1, r = e: tau = 1, g = 4 sigmoid(e - 1) = 3.3916296; loss -3.3916296;
    #   d/dlogp = -A * 4 s (1 - s) * r = -1.4022033 (s = sigmoid(e - 1)).
    # A = -1, r = 0.5: tau = 1.05, g = sigmoid(1.05 * -0.5) * 4 / 1.05 = 1.4159383; loss +1.4159383;
    #   d/dlogp = -A * 4 s (1 - s) * r = 0.4670699 (s = sigmoid(-0.525)).
    # token-mean over 2: loss -0.9878456, gradients halved.
    logp, old = leaf([[-1.0, -1.0]], [[1.0, math.log(0.5)]])
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    loss, m = policy_loss(logp, old, adv, torch.ones(1, 2), kind="sapo")
    assert loss.item() == pytest.approx((-3.3916295704020767 + 1.4159383303033666) / 2, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(
        logp.grad, torch.tensor([[-1.4022033496980222 / 2, 0.4670699116426963 / 2]], dtype=torch.float64)
    )
    assert m["clip_frac"] == 0.0


def test_aggregations_hand_derived():
    # Row 0 has 3 tokens (1, 2, 3), row 1 has 1 token (10), row 2 none.
    per_token = torch.tensor([[1.0, 2.0, 3.0], [10.0, 99.0, 99.0], [99.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    assert aggregate(per_token, mask, "token-mean").item() == pytest.approx(16 / 4)
    assert aggregate(per_token, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 10) / 2)
    assert aggregate(per_token, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 10) / 2)
    with pytest.raises(ValueError, match="unknown agg 'sum'"):
        aggregate(per_token, mask, "sum")


def test_value_loss_hand_derived():
    # Token 0: V=1.5, V_old=1.0, R=2.0: (V-R)^2 = 0.25; clipped V = 1.0 + 0.2 = 1.2, (1.2-2)^2 = 0.64;
    #   0.5 * max = 0.32 and the clipped branch is active (no gradient).
    # Token 1: V=0.9, V_old=1.0, R=0.95: both 0.0025 -> 0.00125; d/dV = (V - R) / 2 tokens = -0.025.
    # Token 2 is masked. Mean = (0.32 + 0.00125) / 2 = 0.160625.
    # Explained variance: R - V = [0.5, 0.05], var = 0.050625; var(R) = 0.275625; 1 - ratio = 0.8163265.
    values = torch.tensor([[1.5, 0.9, 7.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 0.95, 0.0]], dtype=torch.float64)
    loss, m = value_loss(values, old, returns, torch.tensor([[1, 1, 0]]), clip=0.2)
    assert loss.item() == pytest.approx(0.160625, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.025, 0.0]], dtype=torch.float64))
    assert m["value_clip_frac"] == 0.5
    assert m["value_explained_var"] == pytest.approx(1 - 0.050625 / 0.275625)
    unclipped, _ = value_loss(values, old, returns, torch.tensor([[1, 1, 0]]), clip=None)
    assert unclipped.item() == pytest.approx((0.125 + 0.00125) / 2, abs=1e-12)


def test_policy_loss_errors_name_the_problem():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="unknown policy loss kind 'dpo'"):
        policy_loss(x, x, x, x + 1, kind="dpo")
    with pytest.raises(ValueError, match=r"takes no parameter\(s\) \['tau_pos'\]"):
        policy_loss(x, x, x, x + 1, kind="ppo", tau_pos=2.0)
    with pytest.raises(ValueError, match="advantages holds 1 non-finite"):
        policy_loss(x, x, torch.tensor([[0.0, float("nan")]]), x + 1)
    with pytest.raises(ValueError, match="token_weights must be detached"):
        policy_loss(x, x, x, x + 1, token_weights=torch.ones(1, 2, requires_grad=True))
    with pytest.raises(ValueError, match=r"old_logp has shape \(1, 3\)"):
        policy_loss(x, torch.zeros(1, 3), x, x + 1)


def test_all_masked_batch_gives_zero_loss_and_zero_gradient():
    for kind in ("ppo", "gspo", "gmpo", "sapo"):
        logp = torch.randn(2, 4, requires_grad=True)
        loss, m = policy_loss(logp, torch.randn(2, 4), torch.randn(2, 4), torch.zeros(2, 4), kind=kind)
        loss.backward()
        assert loss.item() == 0.0 and (logp.grad == 0).all() and m["clip_frac"] == 0.0, kind


@pytest.mark.parametrize("kind", ["ppo", "gspo", "gmpo", "sapo"])
def test_masked_and_icepop_dropped_tokens_get_exactly_zero_logit_gradient(kind):
    # Through a real log_softmax over logits: a token with mask 0 or IcePop weight 0 must
    # contribute nothing, so every logit at its position has gradient exactly 0.
    g = torch.Generator().manual_seed(0)
    B, T, V = 3, 12, 11
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    old = (logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).detach()
    rollout = (old + 1.5 * torch.randn(B, T, generator=g, dtype=torch.float64)).detach()
    mask = torch.rand(B, T, generator=g) < 0.6
    w, _ = icepop_weights(old, rollout, mask)
    assert ((w == 0) & mask).any() and (w > 0).any()  # the draw has both kinds of token
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    loss, _ = policy_loss(logp, old, adv, mask, kind=kind, token_weights=w)
    loss.backward()
    dropped = ~mask | (w == 0)
    assert (logits.grad[dropped] == 0).all()
    assert (logits.grad[~dropped].abs().sum(-1) > 0).any()


@pytest.mark.parametrize("kind", ["ppo", "gspo", "gmpo", "sapo"])
def test_a_ratio_past_fp32s_range_gives_a_finite_loss_and_gradient(kind):
    # exp(90) overflows fp32: a token whose old probability was ~e^-90 must not turn the loss (or its
    # gradient) into NaN, whether its advantage is 0, positive or negative, or IcePop dropped it
    logp = torch.tensor([[0.0, -0.1, 90.0, 95.0], [0.0, 0.0, -95.0, 0.2]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 0.0, -2.0], [2.0, 2.0, -1.0, 1.0]])
    weights = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    for w in (None, weights):
        loss, m = policy_loss(logp, torch.zeros(2, 4), adv, torch.ones(2, 4), kind=kind, token_weights=w)
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), (kind, loss, grad)
        assert all(math.isfinite(v) for v in m.values()), m
