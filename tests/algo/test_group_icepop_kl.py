import math

import pytest
import torch

from agentrl.algo import group_advantages, icepop_weights, kl_penalty
from agentrl.algo.losses import KL_KINDS

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 2.0, 2.0], dtype=torch.float64)
GROUPS = torch.tensor([7, 7, 7, 7, 3, 9, 9])  # ids need not be 0..G-1


def test_grpo_hand_derived():
    # Group 7: rewards 1,0,0,1 -> mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3);
    # A = +-0.5 / (sqrt(1/3) + eps) = +-0.8660254. Group 3 has one sample -> 0. Group 9 is uniform -> 0.
    adv, metrics = group_advantages(REWARDS, GROUPS, "grpo", eps=0.0)
    a = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a, 0, 0, 0], dtype=torch.float64))
    assert metrics == {
        "groups": 3.0,
        "singleton_groups": 1.0,
        "uniform_reward_groups": 1.0,
        "zero_adv_frac": 3 / 7,
    }


def test_grpo_without_std_equals_mean_kind():
    adv, _ = group_advantages(REWARDS, GROUPS, "grpo", normalize_std=False)
    mean_adv, _ = group_advantages(REWARDS, GROUPS, "mean")
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0], dtype=torch.float64)
    assert torch.equal(adv, expected) and torch.equal(mean_adv, expected)


def test_rloo_hand_derived():
    # Group 7: r=1 -> 1 - (0+0+1)/3 = 2/3; r=0 -> 0 - (1+0+1)/3 = -2/3. Singleton -> 0; uniform -> 0.
    adv, metrics = group_advantages(REWARDS, GROUPS, "rloo")
    torch.testing.assert_close(
        adv, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0], dtype=torch.float64)
    )
    assert metrics["singleton_groups"] == 1.0


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="unknown group advantage kind 'ppo'"):
        group_advantages(REWARDS, GROUPS, "ppo")
    with pytest.raises(ValueError, match="group_ids must be integers"):
        group_advantages(REWARDS, GROUPS.double())
    with pytest.raises(ValueError, match="rewards holds 1 non-finite"):
        group_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))


def test_icepop_band_hand_derived():
    # k = exp(train - rollout) = 0.4 (below), 1.0 and 4.0 (inside), 6.0 (above); the 5th token is prompt.
    k = torch.tensor([[0.4, 1.0, 4.0, 6.0, 1.0]], dtype=torch.float64)
    rollout = torch.tensor([[-1.0, -2.0, -3.0, -0.5, -1.0]], dtype=torch.float64)
    train = rollout + k.log()
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    w, m = icepop_weights(train, rollout, mask, low=0.5, high=5.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 4.0, 0.0, 0.0]], dtype=torch.float32))
    assert m["icepop_masked_frac"] == 0.5  # 2 of the 4 trainable tokens
    assert m["icepop_mean_abs_log_k"] == pytest.approx(
        (math.log(2.5) + 0 + math.log(4) + math.log(6)) / 4, rel=1e-6
    )
    assert m["icepop_k_min"] == pytest.approx(0.4) and m["icepop_k_max"] == pytest.approx(6.0)
    # The band edges are inside: k == low and k == high keep their weight.
    edge = torch.tensor([[0.5, 5.0]]).log()
    w, m = icepop_weights(edge, torch.zeros(1, 2), torch.ones(1, 2))
    torch.testing.assert_close(w, torch.tensor([[0.5, 5.0]]))
    assert not w.requires_grad


def test_icepop_all_masked_and_errors():
    w, m = icepop_weights(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))
    assert (w == 0).all() and m["icepop_masked_frac"] == 0.0
    with pytest.raises(ValueError, match="rollout_logp holds 1 non-finite value"):
        icepop_weights(torch.zeros(1, 2), torch.tensor([[0.0, -float("inf")]]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="IcePop band"):
        icepop_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), low=2.0, high=5.0)


def test_kl_penalty_estimators_hand_derived():
    # p = 0.5, p_ref = 0.25: l = log(p_ref / p) = -log 2.
    # k1 = log 2 = 0.6931; k2 = (log 2)^2 / 2 = 0.2402; k3 = 0.5 - 1 + log 2 = 0.1931.
    logp = torch.tensor([[math.log(0.5), 0.0]])
    ref = torch.tensor([[math.log(0.25), -3.0]])
    mask = torch.tensor([[1, 0]])
    expected = {"k1": math.log(2), "k2": math.log(2) ** 2 / 2, "k3": 0.5 - 1 + math.log(2)}
    for kind, value in expected.items():
        kl, m = kl_penalty(logp, ref, mask, kind)
        assert kl[0, 0].item() == pytest.approx(value, rel=1e-6) and kl[0, 1].item() == 0.0
        assert m["kl_mean"] == pytest.approx(value, rel=1e-6)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(logp, ref, mask, "k4")


def test_kl_penalty_gradient_stays_finite_past_a_masked_token_far_from_the_reference():
    # The last token is a tool observation (mask 0) that the policy now finds e^94 times less likely
    # than the reference: exp(ref_logp - logp) overflows there, and masking afterwards would leave
    # 0 * inf = NaN in logp's gradient. Off the mask the gradient is exactly 0.
    logp = torch.tensor([[-1.1, -0.9, -95.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0, -0.5]])
    mask = torch.tensor([[1, 1, 0]])
    for kind in KL_KINDS:
        kl, _ = kl_penalty(logp, ref, mask, kind)
        (grad,) = torch.autograd.grad(kl.sum(), logp)
        assert torch.isfinite(grad).all(), (kind, grad)
        assert grad[0, 2].item() == 0.0 and grad[0, 0].item() != 0.0


def test_uniform_group_is_exactly_zero_even_with_rounding():
    # mean(0.1, 0.1, 0.1) = 0.10000000000000002 in float64: r - mean is a rounding residue that
    # std normalisation with eps=0 would turn into +-1. The advantage must be exactly 0.
    adv, m = group_advantages(
        torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64), torch.tensor([0, 0, 0]), eps=0.0
    )
    assert adv.tolist() == [0.0, 0.0, 0.0] and m["uniform_reward_groups"] == 1.0
