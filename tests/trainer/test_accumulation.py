"""Gradient accumulation: micro-batches weighed by their share of the minibatch give the gradient of
the whole minibatch in one pass, for every policy loss and aggregation, with and without the KL
term, and for the critic."""

import copy

import pytest
import torch

from agentrl.models import tiny_chat_model
from agentrl.trainer.backend import LossConfig
from agentrl.trainer.torch_backend import TorchBackend
from tests.trainer.test_trainer import synthetic_batch


def gradients(backend: TorchBackend, train, model) -> torch.Tensor:
    """The gradient ``train()`` leaves on ``model``, with the optimizer step skipped."""
    for opt in (backend.actor_opt, backend.critic_opt):
        opt.step = lambda *a, **k: None
    train()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to float32 rounding, relative to the gradient's scale."""
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


def prepared_batch():
    batch = synthetic_batch(seed=4)
    g = torch.Generator().manual_seed(1)
    rows, width = batch.input_ids.shape
    # one advantage per row (what gmpo needs), rewards as returns, a reference and a spread of ratios
    batch.advantages = torch.where(batch.loss_mask, torch.randn(rows, 1, generator=g), 0.0)
    batch.returns = torch.where(batch.loss_mask, batch.rewards[:, None], 0.0)
    noise = lambda: 0.3 * torch.randn(rows, width, generator=g)  # noqa: E731
    return batch, noise


@pytest.mark.parametrize(
    ("kind", "agg"),
    [
        ("ppo", "token-mean"),
        ("ppo", "seq-mean-token-mean"),
        ("ppo", "seq-mean-token-sum"),
        ("sapo", "seq-mean-token-mean"),
        ("gspo", "token-mean"),
        ("gmpo", "token-mean"),
    ],
)
@pytest.mark.parametrize("kl_coef", [0.0, 0.5])
def test_micro_batches_give_the_gradient_of_the_whole_minibatch(kind, agg, kl_coef):
    model, _ = tiny_chat_model(seed=7)
    loss = LossConfig(kind=kind, agg=agg, kl_coef=kl_coef)
    grads = {}
    for budget in (10_000, 1):  # the three rows in one micro-batch; each row alone
        batch, noise = prepared_batch()  # the same draws for each budget
        backend = TorchBackend(
            copy.deepcopy(model), micro_token_budget=budget, grad_clip=1e9, reference=kl_coef > 0
        )
        assert len(backend._group(batch.lengths.tolist(), [0, 1, 2], budget)) == (1 if budget > 1 else 3)
        logp = backend.logprobs(batch)
        batch.old_logprobs = torch.where(batch.loss_mask, logp + noise(), 0.0)
        batch.ref_logprobs = torch.where(batch.loss_mask, logp + noise(), 0.0)
        torch.manual_seed(0)
        grads[budget] = gradients(backend, lambda b=backend, x=batch: b.train_actor(x, loss), backend.policy)
    same(grads[1], grads[10_000])


def backend_with_a_value_head(model, budget: int) -> TorchBackend:
    """A backend at this micro-batch budget whose value head is not all zeros: values vary."""
    backend = TorchBackend(copy.deepcopy(model), micro_token_budget=budget, grad_clip=1e9)
    torch.manual_seed(0)
    torch.nn.init.normal_(backend.critic.head.weight, std=0.5)
    return backend


def test_the_critic_accumulates_to_the_whole_minibatch_too():
    model, _ = tiny_chat_model(seed=8)
    grads = {}
    for budget in (10_000, 1):
        batch, noise = prepared_batch()
        backend = backend_with_a_value_head(model, budget)
        batch.old_values = torch.where(batch.loss_mask, backend.values(batch) + noise(), 0.0)
        grads[budget] = gradients(
            backend, lambda b=backend, x=batch: b.train_critic(x, LossConfig()), backend.critic
        )
    same(grads[1], grads[10_000])


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_the_logged_metrics_are_the_whole_minibatchs_whatever_the_packing(agg):
    """Fractions and means over tokens, minima and maxima, and the explained variance are those of
    the whole minibatch, not of micro-batches weighed by their share of the loss: the same for one
    micro-batch and for one per row, under either aggregation."""
    from agentrl.algo import explained_variance

    model, _ = tiny_chat_model(seed=9)
    logged = {}
    for budget in (10_000, 1):
        batch, noise = prepared_batch()
        backend = backend_with_a_value_head(model, budget)
        logp = backend.logprobs(batch)
        batch.old_logprobs = torch.where(batch.loss_mask, logp + noise(), 0.0)
        keep = torch.rand(batch.loss_mask.shape, generator=torch.Generator().manual_seed(2)) > 0.3
        batch.token_weights = torch.where(batch.loss_mask & keep, 1.0, 0.0)  # IcePop drops about 30 %
        values = backend.values(batch)
        batch.old_values = torch.where(batch.loss_mask, values, 0.0)
        for opt in (backend.actor_opt, backend.critic_opt):
            opt.step = lambda *a, **k: None  # the weights the metrics are measured at stay put
        logged[budget] = backend.train_critic(batch, LossConfig()) | backend.train_actor(
            batch, LossConfig(agg=agg)
        )
    one, per_row = logged[10_000], logged[1]
    mask = batch.loss_mask
    ratio = torch.exp(logp - batch.old_logprobs)[mask]
    whole = {
        "actor/icepop_masked_frac": float((mask & ~keep).sum() / mask.sum()),
        "actor/ratio_min": float(ratio.min()),
        "actor/ratio_max": float(ratio.max()),
        "critic/value_explained_var": explained_variance(values, batch.returns, mask),
    }
    for key, want in whole.items():
        assert one[key] == pytest.approx(want, rel=1e-4, abs=1e-6), key
        assert per_row[key] == pytest.approx(want, rel=1e-4, abs=1e-6), key
    for key in (
        "actor/entropy",
        "actor/approx_kl",
        "actor/clip_frac",
        "critic/value_mean",
        "actor/policy_loss",
    ):
        assert per_row[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("kind", ["ppo", "gspo"])
def test_the_configured_band_reaches_the_loss_and_unset_takes_the_losss_own(kind):
    """``algo.clip_low`` / ``clip_high`` set the band of ``ppo`` and of ``gspo`` (its own parameters
    in ``policy_loss``); unset, each loss keeps its paper's band (``gspo``'s is 3e-4 / 4e-4)."""
    from agentrl.algo import policy_loss
    from agentrl.config import AlgoConfig, TrainConfig
    from agentrl.trainer.backend import actor_objective
    from agentrl.trainer.build import loss_config

    batch, noise = prepared_batch()
    torch.manual_seed(1)
    logp = torch.where(batch.loss_mask, -1.0 + 0.3 * torch.randn(batch.loss_mask.shape), 0.0)
    batch.old_logprobs = torch.where(batch.loss_mask, logp + noise(), 0.0)
    entropy = torch.zeros_like(logp)

    def clip_frac(**algo) -> float:
        cfg = TrainConfig.model_validate({"algo": AlgoConfig(policy_loss=kind, **algo).model_dump()})
        return actor_objective(logp, entropy, batch, loss_config(cfg), torch.device("cpu"))[1]["clip_frac"]

    mask = batch.loss_mask
    own = {"ppo": {}, "gspo": {"gspo_clip_low": 3e-4, "gspo_clip_high": 4e-4}}[kind]
    want_own = policy_loss(logp, batch.old_logprobs, batch.advantages, mask, kind, **own)[1]["clip_frac"]
    wide = {"clip_low": 0.9, "clip_high": 50.0}
    assert clip_frac() == want_own and clip_frac(**wide) == 0.0 < want_own
