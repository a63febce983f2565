import pytest
import torch

from agentrl.algo import discounted_reverse_cumsum, gae
from tests.algo.reference import agent_mask, gae_loop

# One row: prompt (0,1) / assistant (2,3) / tool output (4,5) / assistant (6,7) / padding (8,9).
MASK = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1, 0, 0]])
# Values at mask-0 positions are garbage (9.0): the recursion must never read them.
VALUES = torch.tensor([[9.0, 9.0, 1.0, 2.0, 9.0, 9.0, 3.0, 4.0, 9.0, 9.0]], dtype=torch.float64)


def terminal_reward(position=7, value=1.0):
    r = torch.zeros(1, 10, dtype=torch.float64)
    r[0, position] = value
    return r


def test_gae_hand_derived_gamma_lambda_one():
    # Trainable positions 2, 3, 6, 7 with V = 1, 2, 3, 4; reward 1 on position 7.
    # delta_2 = 0 + V(3) - V(2) = 1;  delta_3 = 0 + V(6) - V(3) = 1  (V(6), not the tool token's 9)
    # delta_6 = 0 + V(7) - V(6) = 1;  delta_7 = 1 + 0 - V(7) = -3
    # A_7 = -3, A_6 = 1 - 3 = -2, A_3 = 1 - 2 = -1, A_2 = 1 - 1 = 0; returns = A + V = 1 everywhere.
    adv, ret = gae(terminal_reward(), VALUES, MASK)
    assert adv.tolist() == [[0, 0, 0, -1, 0, 0, -2, -3, 0, 0]]
    assert ret.tolist() == [[0, 0, 1, 1, 0, 0, 1, 1, 0, 0]]


def test_gae_hand_derived_gamma_lambda_half():
    # gamma = lam = 0.5, so gamma * lam = 0.25.
    # delta_2 = 0.5*2 - 1 = 0;  delta_3 = 0.5*3 - 2 = -0.5;  delta_6 = 0.5*4 - 3 = -1;  delta_7 = 1 - 4 = -3
    # A_7 = -3;  A_6 = -1 + 0.25*(-3) = -1.75;  A_3 = -0.5 + 0.25*(-1.75) = -0.9375
    # A_2 = 0 + 0.25*(-0.9375) = -0.234375;  returns = A + V = 0.765625, 1.0625, 1.25, 1.0
    adv, ret = gae(terminal_reward(), VALUES, MASK, gamma=0.5, lam=0.5)
    assert adv.tolist() == [[0, 0, -0.234375, -0.9375, 0, 0, -1.75, -3.0, 0, 0]]
    assert ret.tolist() == [[0, 0, 0.765625, 1.0625, 0, 0, 1.25, 1.0, 0, 0]]


def test_reward_on_observation_goes_to_the_action_before_it():
    # 0.5 on tool token 5 belongs to position 3 (the call that produced it); 1.0 on padding 9 to 7.
    rewards = terminal_reward(9, 1.0) + terminal_reward(5, 0.5)
    expected_rewards = terminal_reward(7, 1.0) + terminal_reward(3, 0.5)
    for gamma, lam in [(1.0, 1.0), (0.9, 0.8)]:
        got = gae(rewards, VALUES, MASK, gamma, lam)
        want = gae(expected_rewards, VALUES, MASK, gamma, lam)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_reward_before_first_trainable_token_is_an_error():
    with pytest.raises(ValueError, match="row 0 has a nonzero reward before its first trainable token"):
        gae(terminal_reward(1, 1.0), VALUES, MASK)


def test_all_masked_row_and_single_token_row():
    mask = torch.tensor([[0, 0, 0, 0], [0, 0, 1, 0]])
    values = torch.tensor([[5.0, 5.0, 5.0, 5.0], [5.0, 5.0, 0.25, 5.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.95)
    # Row 0: nothing trainable, all zeros. Row 1: one action at 2, reward 2 credited to it,
    # delta = 2 + 0.9*0 - 0.25 = 1.75 = A; return = 2.
    assert adv.tolist() == [[0, 0, 0, 0], [0, 0, 1.75, 0]]
    assert ret.tolist() == [[0, 0, 0, 0], [0, 0, 2.0, 0]]
    with pytest.raises(ValueError, match="row 0"):
        gae(torch.tensor([[0.0, 1.0, 0.0, 0.0]]), values[:1], mask[:1])


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.95), (0.5, 1.0), (0.0, 1.0)])
def test_gae_matches_per_token_loop_on_random_agent_batches(gamma, lam):
    g = torch.Generator().manual_seed(int(gamma * 100 + lam * 10))
    B, T = 6, 300  # T > the scan chunk, so the blocked scan runs two levels
    mask = agent_mask(B, T, g)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64) * (torch.rand(B, T, generator=g) < 0.05)
    first = mask.float().argmax(1)
    rewards[torch.arange(T)[None, :] < first[:, None]] = 0.0  # no reward before the first action
    adv, ret = gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = gae_loop(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-10, atol=1e-10)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_gae_float32_matches_loop():
    g = torch.Generator().manual_seed(3)
    mask = agent_mask(4, 2000, g)
    values = torch.randn(4, 2000, generator=g)
    rewards = torch.zeros(4, 2000)
    rewards[:, -1] = torch.randn(4, generator=g)
    adv, _ = gae(rewards, values, mask, 0.99, 0.95)
    ref, _ = gae_loop(rewards, values, mask, 0.99, 0.95)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 7, 64, 65, 4097])
def test_discounted_reverse_cumsum_long_sequences(n):
    x = torch.randn(3, n, dtype=torch.float64)
    for d in (0.0, 0.3, 0.999):
        ref = torch.zeros_like(x)
        acc = torch.zeros(3, dtype=torch.float64)
        for t in reversed(range(n)):
            acc = x[:, t] + d * acc
            ref[:, t] = acc
        torch.testing.assert_close(discounted_reverse_cumsum(x, d), ref, rtol=1e-9, atol=1e-9)


def test_bad_inputs_name_the_argument():
    with pytest.raises(
        ValueError, match=r"values holds 1 non-finite value\(s\) \(first nan at index \(0, 3\)\)"
    ):
        bad = VALUES.clone()
        bad[0, 3] = float("nan")
        gae(terminal_reward(), bad, MASK)
    with pytest.raises(ValueError, match="rewards holds 1 non-finite"):
        gae(terminal_reward(7, float("inf")), VALUES, MASK)
    with pytest.raises(ValueError, match="mask must hold only 0 and 1"):
        gae(terminal_reward(), VALUES, MASK * 2)
    with pytest.raises(ValueError, match=r"values has shape \(1, 9\)"):
        gae(terminal_reward(), VALUES[:, :9], MASK)
    with pytest.raises(ValueError, match="gamma and lam must lie in"):
        gae(terminal_reward(), VALUES, MASK, gamma=1.5)
