"""The pure pieces the trainer's phases are built from: where an episode's reward goes, whitening
over trainable tokens, truncated importance weights."""

import pytest
import torch

from agentrl.algo import gae, place_rewards, tis_weights, whiten


def test_the_reward_goes_on_the_last_trainable_token():
    mask = torch.tensor(
        [[0, 1, 1, 0, 1, 0, 0], [1, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool
    )
    placed = place_rewards(torch.tensor([1.0, -0.5, 2.0]), mask)
    expected = torch.zeros(3, 7)
    expected[0, 4], expected[1, 1] = 1.0, -0.5  # the row with no trainable token gets none
    assert torch.equal(placed, expected)
    # with gamma = lam = 1 and zero values, every trainable token's advantage is the episode's reward
    adv, ret = gae(placed, torch.zeros(3, 7), mask, 1.0, 1.0)
    assert torch.equal(adv[mask], torch.tensor([1.0, 1.0, 1.0, -0.5, -0.5]))
    assert torch.equal(ret, adv)
    with pytest.raises(ValueError, match=r"rewards must be \[B\] = \[3\]"):
        place_rewards(torch.tensor([1.0]), mask)
    with pytest.raises(ValueError, match="rewards"):
        place_rewards(torch.tensor([float("nan"), 0.0, 0.0]), mask)


def test_whitening_is_over_trainable_tokens_only():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([[1.0, 2.0, 100.0], [3.0, -7.0, 0.0]])
    out = whiten(adv, mask)
    assert out[mask].mean().abs() < 1e-6 and (out[mask].std() - 1).abs() < 1e-5
    assert torch.equal(out[~mask], torch.zeros(3))  # padding stays 0, whatever was there
    assert torch.allclose(out[mask], (adv[mask] - 2.0) / adv[mask].std())
    # no spread (one token, or all equal): centred to 0 (no token beats the mean), and never divided
    one = torch.tensor([[1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    assert torch.equal(whiten(adv, one), torch.zeros(2, 3))
    flat = torch.full((2, 3), 0.5)
    assert torch.equal(whiten(flat, mask), torch.zeros(2, 3))
    assert torch.equal(whiten(adv, torch.zeros_like(mask)), torch.zeros(2, 3))  # no trainable token


def test_tis_keeps_every_token_and_truncates_its_weight():
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    rollout = torch.log(torch.tensor([[0.5, 0.5, 0.01, 0.5]]))
    train = torch.log(torch.tensor([[0.25, 0.5, 0.5, 0.9]]))
    weights, metrics = tis_weights(train, rollout, mask, high=5.0)
    assert torch.allclose(weights, torch.tensor([[0.5, 1.0, 5.0, 0.0]]))  # 50x is cut at 5; pad 0
    assert metrics["tis_mean_weight"] == pytest.approx((0.5 + 1.0 + 5.0) / 3)
    assert tis_weights(train, rollout, torch.zeros_like(mask))[1]["tis_mean_weight"] == 1.0
    with pytest.raises(ValueError, match="high must be >= 1"):
        tis_weights(train, rollout, mask, high=0.5)
