import pytest
import torch

from agentrl.algo import token_logprobs
from tests.algo.reference import naive_token_logprobs


def inputs(n=300, h=16, v=97, dtype=torch.float32, seed=0, lead=None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*(lead or (n,)), h, generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) * 0.5).to(dtype).requires_grad_(True)
    targets = torch.randint(0, v, lead or (n,), generator=g)
    return hidden, weight, targets


@pytest.mark.parametrize("temperature,chunk", [(1.0, 64), (0.7, 64), (1.3, 1), (1.0, 10_000)])
def test_matches_naive_in_value_and_gradient(temperature, chunk):
    hidden, weight, targets = inputs()
    upstream = torch.randn(300, generator=torch.Generator().manual_seed(1))
    logp = token_logprobs(hidden, weight, targets, temperature=temperature, chunk_size=chunk)
    (logp * upstream).sum().backward()
    got = (logp.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    ref_logp, _ = naive_token_logprobs(hidden, weight, targets, temperature)
    (ref_logp * upstream).sum().backward()
    torch.testing.assert_close(got[0], ref_logp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], hidden.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2], weight.grad, rtol=1e-5, atol=1e-5)


def test_entropy_matches_naive_in_value_and_gradient():
    hidden, weight, targets = inputs(lead=(3, 50))  # [B, T, H] input
    g = torch.Generator().manual_seed(2)
    up_logp, up_ent = torch.randn(3, 50, generator=g), torch.randn(3, 50, generator=g)
    logp, ent = token_logprobs(hidden, weight, targets, temperature=0.9, chunk_size=32, return_entropy=True)
    assert logp.shape == ent.shape == (3, 50)
    (logp * up_logp + ent * up_ent).sum().backward()
    got = (logp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    ref_logp, ref_ent = naive_token_logprobs(hidden, weight, targets, 0.9)
    (ref_logp * up_logp + ref_ent * up_ent).sum().backward()
    for a, b in zip(got, (ref_logp.detach(), ref_ent.detach(), hidden.grad, weight.grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_entropy_only_gradient():
    hidden, weight, targets = inputs(n=40)
    _, ent = token_logprobs(hidden, weight, targets, chunk_size=16, return_entropy=True)
    ent.sum().backward()
    got = hidden.grad.clone()
    hidden.grad = weight.grad = None
    naive_token_logprobs(hidden, weight, targets)[1].sum().backward()
    torch.testing.assert_close(got, hidden.grad, rtol=1e-5, atol=1e-5)


def test_entropy_as_a_metric_leaves_the_logprob_gradient_as_it_is():
    hidden, weight, targets = inputs(n=60)
    logp, ent = token_logprobs(hidden, weight, targets, temperature=0.5, chunk_size=16, return_entropy=True)
    logp.sum().backward()  # the entropy is only read, as the trainer's metric
    got = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    token_logprobs(hidden, weight, targets, temperature=0.5, chunk_size=16).sum().backward()
    torch.testing.assert_close(got[0], hidden.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], weight.grad, rtol=1e-6, atol=1e-6)
    ref = naive_token_logprobs(hidden, weight, targets, 0.5)[1].detach()
    torch.testing.assert_close(ent.detach(), ref, rtol=1e-4, atol=1e-4)


def test_bf16_inputs_give_fp32_logprobs_close_to_naive():
    hidden, weight, targets = inputs(dtype=torch.bfloat16)
    logp = token_logprobs(hidden, weight, targets, chunk_size=64)
    assert logp.dtype == torch.float32
    logp.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    ref, _ = naive_token_logprobs(hidden.detach(), weight.detach(), targets)
    torch.testing.assert_close(logp.detach(), ref, rtol=1e-5, atol=1e-5)


def test_bad_inputs():
    hidden, weight, targets = inputs(n=8)
    with pytest.raises(ValueError, match="token id 97, outside the vocabulary"):
        token_logprobs(hidden, weight, torch.full((8,), 97))
    with pytest.raises(ValueError, match="targets has shape"):
        token_logprobs(hidden, weight, targets[:5])
    with pytest.raises(ValueError, match=r"weight must be \[V, H\] with H = 16"):
        token_logprobs(hidden, weight.t(), targets)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(hidden, weight, targets, temperature=0.0)
    bad = hidden.detach().clone()
    bad[3, 2] = float("inf")
    with pytest.raises(ValueError, match="hidden holds 1 non-finite"):
        token_logprobs(bad, weight, targets)


@pytest.mark.parametrize("head", ["token_logprobs", "vocab_parallel_logprobs"])
def test_tf32_forms_every_chunk_of_logits_in_both_passes_and_restores_the_setting(monkeypatch, head):
    """``tf32=True`` (a bf16 run on CUDA) puts the head's fp32 products on TF32 for each chunk of
    logits the forward forms and each the backward forms again, and leaves the setting as it found
    it; the logits stay fp32. On the CPU, TF32 changes no number."""
    import agentrl.algo.logprobs as one_device
    import agentrl.trainer.megatron_logprobs as vocab_parallel

    module, name = (one_device, "_chunk_logits") if head == "token_logprobs" else (vocab_parallel, "_logits")
    matmul = torch.backends.cuda.matmul
    seen = []
    form = getattr(module, name)

    def recorded(*args):
        seen.append(matmul.fp32_precision)
        return form(*args)

    monkeypatch.setattr(module, name, recorded)

    def run(tf32: bool):
        hidden, weight, targets = inputs(n=40)
        if head == "token_logprobs":
            logp = token_logprobs(hidden, weight, targets, chunk_size=16, tf32=tf32)
        else:
            logp = vocab_parallel.vocab_parallel_logprobs(
                hidden, weight, targets, vocab_size=weight.shape[0], chunk=16, tf32=tf32
            )
        assert logp.dtype == torch.float32
        logp.sum().backward()
        return logp.detach(), hidden.grad, weight.grad

    before = matmul.fp32_precision
    plain = run(False)
    assert seen == [before] * 6  # 3 chunks of 16 rows, formed in the forward and again in the backward
    seen.clear()
    fast = run(True)
    assert seen == ["tf32"] * 6 and matmul.fp32_precision == before
    for a, b in zip(plain, fast, strict=True):
        assert torch.equal(a, b)
