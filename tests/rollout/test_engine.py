import asyncio
import copy
import re

import pytest
import torch

from agentrl.models import tiny_chat_model
from agentrl.rollout.engine import SamplingParams
from agentrl.rollout.local import LocalEngine


@pytest.fixture(scope="module")
def tiny():
    return tiny_chat_model()


def reference_logprobs(model, prompt, output, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    scale = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / scale, -1)
    return [float(lp[len(prompt) - 1 + i, tok]) for i, tok in enumerate(output)]


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.7, top_p=0.9, top_k=40),
        dict(temperature=1.0),
        dict(temperature=0.0),
    ],
)
def test_logprobs_equal_a_separate_forward_pass(tiny, params):
    model, tok = tiny
    engine = LocalEngine(model)

    async def go():
        prompts = [tok.encode("def add(a, b):\n" * (i + 1), add_special_tokens=False) for i in range(6)]
        gens = await asyncio.gather(
            *(
                engine.generate(p, SamplingParams(max_new_tokens=24, seed=i, **params))
                for i, p in enumerate(prompts)
            )
        )
        for p, g in zip(prompts, gens, strict=True):
            assert len(g.logprobs) == len(g.output_ids) > 0
            ref = reference_logprobs(model, p, g.output_ids, params["temperature"])
            assert max(abs(a - b) for a, b in zip(ref, g.logprobs, strict=True)) < 1e-4
        # Six requests that arrived together were decoded as one batch.
        assert engine.stats["batches"] == 1 and engine.stats["max_batch"] == 6
        await engine.close()

    asyncio.run(go())


def test_rows_that_finish_early_leave_the_batch_and_change_no_other_row(tiny):
    """Requests of one batch that stop at different steps (length or stop token) get what each gets
    alone, and the model stops computing their rows: fewer row-steps than rows x steps."""
    model, tok = tiny
    prompts = [tok.encode("def f(x):\n    return x" * (i + 1), add_special_tokens=False) for i in range(8)]
    params = [
        SamplingParams(
            max_new_tokens=2 + 4 * i, temperature=0.0 if i % 3 == 0 else 0.8, seed=i, top_k=50 * (i % 2)
        )
        for i in range(8)
    ]

    async def generate(requests):
        engine = LocalEngine(model)
        gens = await asyncio.gather(*(engine.generate(p, sp) for p, sp in requests))
        await engine.close()
        return gens, engine.stats

    async def go():
        alone_stop = (await generate([(prompts[5], params[5])]))[0][0].output_ids[3]
        params[5].stop_token_ids = [alone_stop]  # request 5 stops on its own 4th token (or earlier)
        together, stats = await generate(list(zip(prompts, params, strict=True)))
        assert stats["batches"] == 1 and stats["max_batch"] == 8
        assert stats["row_steps"] < 8 * max(sp.max_new_tokens for sp in params)
        assert together[5].finish_reason == "stop" and len(together[5].output_ids) <= 4
        for p, sp, g in zip(prompts, params, together, strict=True):
            alone = (await generate([(p, sp)]))[0][0]
            assert g.output_ids == alone.output_ids
            assert g.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
            assert g.logprobs == pytest.approx(
                reference_logprobs(model, p, g.output_ids, sp.temperature), abs=1e-4
            )
            if g.finish_reason == "length":
                assert len(g.output_ids) == sp.max_new_tokens

    asyncio.run(go())


def test_seeded_sampling_is_reproducible_and_stop_tokens_stop(tiny):
    model, tok = tiny
    engine = LocalEngine(model)

    async def go():
        prompt = tok.encode("hello", add_special_tokens=False)
        a = await engine.generate(prompt, SamplingParams(max_new_tokens=16, seed=3))
        b = await engine.generate(prompt, SamplingParams(max_new_tokens=16, seed=3))
        assert a.output_ids == b.output_ids and a.finish_reason == "length"
        stop = a.output_ids[4]
        c = await engine.generate(prompt, SamplingParams(max_new_tokens=16, seed=3, stop_token_ids=[stop]))
        assert c.output_ids[-1] == stop and c.finish_reason == "stop"
        assert c.output_ids == a.output_ids[: a.output_ids.index(stop) + 1]
        await engine.close()

    asyncio.run(go())


def test_update_weights_swaps_weights_and_bumps_version(tiny):
    model, tok = tiny
    engine = LocalEngine(model)
    other, _ = tiny_chat_model(seed=1)

    async def go():
        prompt = tok.encode("x = 1", add_special_tokens=False)
        before = await engine.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0))
        version = await engine.update_weights(other.state_dict())
        after = await engine.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0))
        assert before.weight_version == "0" and version == after.weight_version == "1"
        assert after.logprobs == pytest.approx(
            reference_logprobs(other, prompt, after.output_ids, 0), abs=1e-4
        )
        await engine.close()

    asyncio.run(go())


def test_the_embedded_engine_holds_bf16_weights_where_the_trainer_computes_in_bf16(tiny):
    """``model.dtype``: ``auto`` is float32 on the CPU, so the engine's copy stays fp32 here; bfloat16
    (what ``auto`` is on CUDA) gives a bf16 copy, which decodes, reports fp32 log-probs close to the
    fp32 model's, and takes the trainer's fp32 weights on update, cast."""
    from agentrl.config import TrainConfig, load_config
    from agentrl.rollout.local import from_config

    model, tok = tiny
    prompt = tok.encode("def add(a, b):", add_special_tokens=False)
    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    assert from_config(model, load_config(TrainConfig)).model.dtype == torch.float32
    engine = from_config(model, load_config(TrainConfig, overrides=["model.dtype=bfloat16"]))
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the trainer's copy is untouched
    other, _ = tiny_chat_model(seed=1)

    async def go():
        for weights in (model, other):
            if weights is other:
                assert await engine.update_weights(other.state_dict()) == "1"
                assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
            got = await engine.generate(prompt, greedy)
            assert got.logprobs and all(isinstance(x, float) for x in got.logprobs)
            ref = reference_logprobs(weights, prompt, got.output_ids, 0)
            assert max(abs(a - b) for a, b in zip(ref, got.logprobs, strict=True)) < 0.02
        await engine.close()

    asyncio.run(go())


def test_update_weights_from_disk_file_or_model_directory(tiny, tmp_path):
    from agentrl.rollout.engine import Engine

    model, tok = tiny
    engine = LocalEngine(copy.deepcopy(model))
    assert isinstance(engine, Engine)
    other, _ = tiny_chat_model(seed=1)
    torch.save(other.state_dict(), tmp_path / "weights.pt")
    third, _ = tiny_chat_model(seed=2)
    third.save_pretrained(tmp_path / "hf")

    async def go():
        prompt = tok.encode("x = 1", add_special_tokens=False)
        greedy = SamplingParams(max_new_tokens=8, temperature=0)
        for source, path, version in (
            (other, tmp_path / "weights.pt", "disk-1"),
            (third, tmp_path / "hf", "hf-2"),
        ):
            assert await engine.update_weights(path=str(path), version=version) == version
            out = await engine.generate(prompt, greedy)
            assert out.weight_version == version
            assert out.logprobs == pytest.approx(
                reference_logprobs(source, prompt, out.output_ids, 0), abs=1e-4
            )
        with pytest.raises(ValueError, match="a state_dict or a path, one of them"):
            await engine.update_weights(other.state_dict(), path=str(tmp_path / "weights.pt"))
        with pytest.raises(FileNotFoundError, match="holds no"):
            await engine.update_weights(path=str(tmp_path))
        await engine.close()

    asyncio.run(go())


def test_smollm2_real_model_logprobs():
    from agentrl.models import smollm2, smollm2_path

    try:
        smollm2_path()
    except ImportError as e:
        pytest.skip(str(e))

    model, tok = smollm2()
    engine = LocalEngine(model)

    async def go():
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True, tokenize=False
        )
        ids = tok.encode(prompt, add_special_tokens=False)
        g = await engine.generate(ids, SamplingParams(max_new_tokens=12, temperature=0.8, seed=0))
        assert g.logprobs == pytest.approx(reference_logprobs(model, ids, g.output_ids, 0.8), abs=1e-4)
        await engine.close()

    asyncio.run(go())


def test_preallocated_cache_layer_matches_concatenation_and_grows():
    from agentrl.rollout.local import _PreallocatedLayer

    g = torch.Generator().manual_seed(0)
    layer, keys, values = _PreallocatedLayer(reserve=2), [], []
    for n in (3, 1, 1, 1, 2):  # the third single token overflows the reserve; the buffer grows
        k, v = torch.randn(2, 4, n, 8, generator=g), torch.randn(2, 4, n, 8, generator=g)
        keys.append(k)
        values.append(v)
        got_k, got_v = layer(k, v)
        assert torch.equal(got_k, torch.cat(keys, dim=2)) and torch.equal(got_v, torch.cat(values, dim=2))
    index = torch.tensor([1])
    got_k, got_v = layer.select(index)
    assert torch.equal(got_k, torch.cat(keys, dim=2)[index]) and torch.equal(
        got_v, torch.cat(values, dim=2)[index]
    )


@pytest.mark.parametrize("flaw", ["missing", "unexpected", "shape"])
def test_weights_that_do_not_fit_are_refused_and_leave_the_served_ones_whole(tiny, flaw):
    model, tok = tiny
    engine = LocalEngine(copy.deepcopy(model))
    served = {k: v.clone() for k, v in engine.model.state_dict().items()}
    weights = {k: v + 1.0 for k, v in tiny_chat_model(seed=1)[0].state_dict().items()}
    key = "model.layers.0.mlp.down_proj.weight"
    named = {
        "missing": f"missing ['{key}']",
        "unexpected": "unexpected ['extra.weight']",
        "shape": f"{key} is {[*weights[key].shape[:-1], 3]} where the served model's is {list(weights[key].shape)}",
    }[flaw]
    if flaw == "missing":
        del weights[key]
    elif flaw == "unexpected":
        weights["extra.weight"] = torch.zeros(2)
    else:
        weights[key] = weights[key][..., :3]

    async def go():
        with pytest.raises(RuntimeError, match=re.escape(named)):
            await engine.update_weights(weights, version="bad")
        assert engine.weight_version == "0"
        # and the engine serves on
        out = await engine.generate(
            tok.encode("x", add_special_tokens=False), SamplingParams(max_new_tokens=2)
        )
        assert out.weight_version == "0"
        await engine.close()

    asyncio.run(go())
    changed = [k for k, v in engine.model.state_dict().items() if not torch.equal(v, served[k])]
    assert changed == []


def test_a_bucket_of_a_broadcast_lands_whole_or_not_at_all(tiny):
    model, _ = tiny
    engine = LocalEngine(copy.deepcopy(model))
    served = {k: v.clone() for k, v in engine.model.state_dict().items()}
    bucket = {
        "model.norm.weight": torch.full_like(served["model.norm.weight"], 2.0),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(3, 3),
    }

    async def go():
        with pytest.raises(
            ValueError, match=r"model.layers.0.mlp.down_proj.weight \[3, 3\] \(served: \[64, 128\]\)"
        ):
            await engine.assign(bucket, version="bad")
        with pytest.raises(KeyError, match="no tensors named \\['nope'\\]"):
            await engine.assign({"nope": torch.zeros(1), "model.norm.weight": bucket["model.norm.weight"]})
        assert engine.weight_version == "0"
        assert await engine.assign({"model.norm.weight": bucket["model.norm.weight"]}, version="5") == "5"
        await engine.close()

    asyncio.run(go())
    state = engine.model.state_dict()
    assert [k for k in state if not torch.equal(state[k], served[k])] == ["model.norm.weight"]


async def _once_decoding(engine, batches: int) -> None:
    """Until the engine has started its ``batches``-th batch (its decoding thread is stepping)."""
    for _ in range(1000):
        if engine.stats["batches"] >= batches:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the batch did not start")


def test_a_cancelled_request_stops_decoding_and_the_next_one_does_not_wait_for_it(tiny):
    """An abort cancels the caller's task: the batch it ran alone in stops at the next step and
    frees the engine, instead of decoding on to max_new_tokens while later requests wait."""
    model, tok = tiny
    engine = LocalEngine(model)
    steps = 2000

    async def go():
        prompt = tok.encode("def f(x):", add_special_tokens=False)
        task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=steps, seed=0)))
        await _once_decoding(engine, 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        after = await engine.generate(prompt, SamplingParams(max_new_tokens=3, seed=0))
        await engine.close()
        return after

    after = asyncio.run(go())
    assert len(after.output_ids) == 3 and after.finish_reason == "length"
    # Without the stop: the cancelled request's 2000 row-steps, then the next one's 3.
    assert engine.stats["row_steps"] < steps, engine.stats


def test_a_cancelled_request_leaves_its_batch_and_changes_no_other_row(tiny):
    model, tok = tiny
    steps = 300
    prompts = [tok.encode("x = 1\n" * (i + 1), add_special_tokens=False) for i in range(3)]
    params = [SamplingParams(max_new_tokens=steps, temperature=0.8, seed=i) for i in range(3)]

    async def go():
        engine = LocalEngine(model)
        tasks = [asyncio.create_task(engine.generate(p, sp)) for p, sp in zip(prompts, params, strict=True)]
        await _once_decoding(engine, 1)
        tasks[1].cancel()
        first, last = await tasks[0], await tasks[2]
        assert tasks[1].cancelled()
        alone = [await engine.generate(prompts[i], params[i]) for i in (0, 2)]
        await engine.close()
        return [first, last], alone, engine.stats

    together, alone, stats = asyncio.run(go())
    for g, a in zip(together, alone, strict=True):
        assert g.finish_reason == "length" and len(g.output_ids) == steps
        assert g.output_ids == a.output_ids
        assert g.logprobs == pytest.approx(a.logprobs, abs=1e-4)
    # The batch ran 3 rows until the cancelled one left, then 2; then the two alone.
    assert stats["batches"] == 3 and stats["row_steps"] - 2 * steps < 3 * steps, stats
