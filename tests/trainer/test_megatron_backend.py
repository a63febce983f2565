"""The Megatron backend against the PyTorch backend on the same HF weights (fp32, CPU, TP=1), and at
TP=2, PP=2 and DP=2 (two gloo processes) against one process, with torch AdamW or Megatron's
distributed optimizer; HF <-> Megatron conversion bit-exact."""

from __future__ import annotations

import copy
from re import escape

import pytest
import torch

pytest.importorskip("megatron.core")

from agentrl.models import checkpoint_policy
from agentrl.trainer.backend import Batch, LossConfig, TrainBackend
from agentrl.trainer.megatron_backend import MegatronBackend
from agentrl.trainer.megatron_convert import RECOMPUTE, hf_to_megatron, megatron_to_hf
from agentrl.trainer.torch_backend import TorchBackend
from agentrl.trajectory import Trajectory, TurnSpan

VOCAB = 97  # odd: at tp=2 the vocabulary is padded by one row that must never count


def tiny_hf(kind: str, seed: int = 0):
    """A random 2-layer model: ``llama`` (untied lm_head, no biases, rope_theta 500000) or ``qwen2``
    (tied embeddings, q/k/v biases). 4 query heads over 2 key/value groups (GQA)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False, rope_theta=500000.0))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True, rope_theta=10000.0))
    with torch.no_grad():  # RMSNorm weights of ones and zero biases would hide a misplaced tensor
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.float().train()


def ppo_batch(seed: int = 0) -> Batch:
    """Three rows (24, 15, 31 tokens) with prompt / assistant / tool / assistant spans, advantages,
    returns, old values and IcePop weights (one token dropped per row)."""
    g = torch.Generator().manual_seed(seed)
    trajectories = []
    for n in (24, 15, 31):
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        mask = [0] * 4 + [1] * 6 + [0] * 3 + [1] * (n - 13)
        turns = [TurnSpan(0, 4, "prompt"), TurnSpan(4, 10, "assistant"), TurnSpan(10, 13, "tool")]
        turns.append(TurnSpan(13, n, "assistant"))
        logps = [(-4.0 if m else 0.0) for m in mask]
        trajectories.append(Trajectory(ids, mask, logps, turns, reward=float(n % 2)))
    batch = Batch.from_trajectories(trajectories)
    shape = batch.input_ids.shape
    batch.advantages = torch.randn(shape, generator=g) * batch.loss_mask
    batch.returns = torch.randn(shape, generator=g) * batch.loss_mask
    batch.old_values = torch.randn(shape, generator=g) * 0.1 * batch.loss_mask
    weights = batch.loss_mask.float()
    weights[:, 5] = 0.0
    batch.token_weights = weights
    return batch


def _head(backend) -> torch.nn.Linear | None:
    """The value head (None on a pipeline stage before the last)."""
    if isinstance(backend, TorchBackend):
        return backend.critic.head
    layer = getattr(backend.critic, "output_layer", None)
    return None if layer is None else layer.linear


def run_step(backend, batch: Batch) -> dict[str, object]:
    """Log-probs and values before, one critic and one actor update, the policy's HF weights after."""
    head = _head(backend)
    if head is not None:
        with torch.no_grad():  # a value head that is not all zeros, the same in every backend
            head.weight.copy_(torch.linspace(-0.5, 0.5, head.weight.numel()).view(1, -1))
            head.bias.fill_(0.25)
    batch = copy.copy(batch)
    out: dict[str, object] = {"logprobs": backend.logprobs(batch), "values": backend.values(batch)}
    batch.old_logprobs = out["logprobs"] + 0.05 * batch.loss_mask  # ratios away from 1: clipping acts
    out |= backend.train_critic(batch, LossConfig())
    out |= backend.train_actor(batch, LossConfig())
    out["weights"] = backend.engine_state_dict()
    return out


def _backend(kind: str, model, **kw):
    args = dict(actor_lr=1e-2, critic_lr=1e-2, micro_token_budget=40, grad_clip=0.5, weight_decay=0.01)
    return kind(model, **args, **kw)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_megatron_hf_is_bit_exact_at_every_tp(kind):
    model = tiny_hf(kind)
    hf = model.state_dict()
    for tp in (1, 2):
        shards = [hf_to_megatron(hf, model.config, tp, r) for r in range(tp)]
        back = megatron_to_hf(shards, model.config)
        assert set(back) == set(hf)
        assert all(torch.equal(back[k], hf[k]) for k in hf), kind
    # a TP shard holds whole key/value groups: rank 1's first query rows are HF's query head 2
    d = 8
    rank1 = hf_to_megatron(hf, model.config, 2, 1)["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(rank1[: 2 * d], hf["model.layers.0.self_attn.q_proj.weight"][2 * d : 4 * d])
    assert torch.equal(rank1[2 * d : 3 * d], hf["model.layers.0.self_attn.k_proj.weight"][d : 2 * d])


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_megatron_matches_the_torch_backend_through_one_ppo_step(kind):
    model = tiny_hf(kind)
    batch = ppo_batch()
    want = run_step(_backend(TorchBackend, copy.deepcopy(model)), batch)
    megatron = _backend(MegatronBackend, copy.deepcopy(model))
    assert isinstance(megatron, TrainBackend)
    got = run_step(megatron, batch)
    torch.testing.assert_close(got["logprobs"], want["logprobs"], atol=1e-4, rtol=0)
    torch.testing.assert_close(got["values"], want["values"], atol=1e-5, rtol=0)
    for key in (
        "critic/value_loss",
        "critic/grad_norm",
        "actor/policy_loss",
        "actor/grad_norm",
        "actor/entropy",
    ):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    assert want["actor/grad_norm"] > 0.5  # the clip acted: the clipped step is compared too
    moved = 0.0
    for name, w in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, atol=1e-5, rtol=0, msg=name)
        moved = max(moved, float((w - model.state_dict()[name]).abs().max()))
    assert moved > 1e-3  # the step changed the weights by far more than the tolerance


def test_a_kl_term_to_the_reference_matches_the_torch_backend():
    """``algo.kl_coef > 0`` builds a frozen reference: one PPO step moves the policy from it, the
    next step's KL term and its gradient agree with the torch backend's; after ``reset_reference``
    the policy is its own reference again."""
    model = tiny_hf("qwen2")
    batch = ppo_batch()
    kl = LossConfig(kl_coef=0.5)
    results = []
    for kind in (TorchBackend, MegatronBackend):
        backend = _backend(kind, copy.deepcopy(model), reference=True)
        run_step(backend, batch)  # the policy moves; the reference does not
        step = copy.copy(batch)
        step.old_logprobs = backend.logprobs(step)
        step.ref_logprobs = backend.ref_logprobs(step)
        out = backend.train_actor(step, kl) | {"weights": backend.engine_state_dict()}
        backend.reset_reference()
        step.old_logprobs = backend.logprobs(step)
        step.ref_logprobs = backend.ref_logprobs(step)
        out["kl_after_reset"] = backend.train_actor(step, kl)["actor/kl_mean"]
        results.append(out)
    want, got = results
    assert want["actor/kl_mean"] > 1e-3
    for key in ("actor/kl_mean", "actor/policy_loss", "actor/grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    for name, w in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, atol=1e-5, rtol=0, msg=name)
    assert abs(got["kl_after_reset"]) < 1e-6 and abs(want["kl_after_reset"]) < 1e-6


def _saved_bytes(backend: MegatronBackend, batch: Batch) -> int:
    """Bytes the policy's forward pass keeps for its backward pass."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        backend._hidden(backend.policy, batch, list(range(batch.size)))
    return total


def test_recomputed_activations_keep_less_and_give_the_same_step():
    model = tiny_hf("llama")
    batch = ppo_batch()
    backends = {mode: _backend(MegatronBackend, copy.deepcopy(model), recompute=mode) for mode in RECOMPUTE}
    kept = {mode: _saved_bytes(b, batch) for mode, b in backends.items()}
    assert kept["full"] < kept["selective"] < kept["none"], kept
    want = run_step(backends["none"], batch)
    for mode in ("selective", "full"):
        got = run_step(backends[mode], batch)
        for key in ("critic/value_loss", "critic/grad_norm", "actor/policy_loss", "actor/grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-6), (mode, key)
        for name, w in want["weights"].items():
            torch.testing.assert_close(got["weights"][name], w, atol=1e-6, rtol=0, msg=f"{mode} {name}")
    with pytest.raises(ValueError, match=r"recompute='some'.*none, selective, full"):
        MegatronBackend(copy.deepcopy(model), recompute="some")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_rows_by_cu_seqlens_match_the_mask_and_keep_no_square_of_the_pack(kind):
    """``attention="rows"`` (THD ``PackedSeqParams``, each row's causal attention on its own, the
    default) against the block-diagonal mask (the reference): the same log-probs, values and
    step, with activations recomputed too; the forward keeps less (no ``[heads, T, T]`` scores over
    the pack). The 40-token budget packs the 31-token row alone and the 24- and 15-token rows
    together, so both of megatron's THD RoPE cases run (one row: the pack's length; several)."""
    model = tiny_hf(kind)
    batch = ppo_batch()
    for recompute in ("none", "selective"):
        mask = _backend(MegatronBackend, copy.deepcopy(model), attention="mask", recompute=recompute)
        rows = _backend(MegatronBackend, copy.deepcopy(model), attention="rows", recompute=recompute)
        if recompute == "none":
            assert _saved_bytes(rows, batch) < _saved_bytes(mask, batch)
        want, got = run_step(mask, batch), run_step(rows, batch)
        torch.testing.assert_close(got["logprobs"], want["logprobs"], atol=1e-5, rtol=0)
        torch.testing.assert_close(got["values"], want["values"], atol=1e-5, rtol=0)
        for key in ("critic/value_loss", "critic/grad_norm", "actor/policy_loss", "actor/grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), (recompute, key)
        for name, w in want["weights"].items():
            torch.testing.assert_close(got["weights"][name], w, atol=1e-5, rtol=0, msg=f"{recompute} {name}")
    with pytest.raises(ValueError, match="attention='thd': use rows or mask"):
        MegatronBackend(copy.deepcopy(model), attention="thd")


@pytest.mark.parametrize(
    "kind, change, named",
    [
        ("llama", {"attention_bias": True}, "attention_bias=True"),
        ("llama", {"mlp_bias": True}, "mlp_bias=True"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 4}, "use_sliding_window=True"),
    ],
)
def test_an_architecture_the_converter_does_not_map_is_refused_by_name(kind, change, named):
    """Each of these computes another function in the Megatron model built here (a bias it has no
    place for, SiLU in place of the model's activation, full attention in place of a window)."""
    model = tiny_hf(kind)
    for key, value in change.items():
        setattr(model.config, key, value)
    with pytest.raises(ValueError, match=f"the model's {escape(named)}.* is not mapped to Megatron"):
        MegatronBackend(model)


def test_an_hf_weight_with_no_megatron_counterpart_is_refused():
    model = tiny_hf("llama")
    hf = dict(model.state_dict(), **{"model.layers.0.self_attn.o_proj.bias": torch.zeros(32)})
    with pytest.raises(ValueError, match=r"no Megatron counterpart: model.layers.0.self_attn.o_proj.bias"):
        hf_to_megatron(hf, model.config)


def test_bad_sizes_stop_with_the_values_named():
    model = tiny_hf("qwen2")
    with pytest.raises(ValueError, match=r"tp=1 \* pp=1 \* dp=2 = 2 ranks, but 1 processes"):
        MegatronBackend(model, dp=2)
    with pytest.raises(ValueError, match=r"tp=1 \* pp=2 \* dp=1 = 2 ranks, but 1 processes"):
        MegatronBackend(model, pp=2)


def test_run_device_cpu_where_torch_sees_a_gpu_stops_a_megatron_run_with_one_line(monkeypatch):
    from agentrl.config import ConfigError, TrainConfig, load_config
    from agentrl.trainer.megatron_backend import from_config

    cfg = load_config(TrainConfig, None, ["trainer.backend=megatron", "run.device=cpu"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    with pytest.raises(ConfigError, match="run.device=cpu: trainer.backend=megatron trains on the GPU"):
        from_config(tiny_hf("qwen2"), cfg)


def _worker(rank: int, world: int, store_path: str, cases: list, out_path: str) -> None:
    import torch.distributed as dist

    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.set_num_threads(1)
    got = [
        run_step(
            _backend(MegatronBackend, tiny_hf(kind), tp=tp, pp=pp, dp=dp, recompute=re, attention=at),
            ppo_batch(),
        )
        for kind, tp, pp, dp, re, at in cases
    ]
    if rank == 0:
        torch.save(got, out_path)
    dist.barrier()
    dist.destroy_process_group()


def test_tp2_pp2_and_dp2_match_one_process(tmp_path):
    """Two gloo processes (tensor-parallel: Llama with its padded vocabulary, Qwen2 with its split
    q/k/v biases; pipeline-parallel: Llama, and Qwen2 with its embedding tied across the stages;
    data-parallel) give the log-probs, values, losses, gradient norms and updated weights of one
    process on the same global batch; with activations recomputed too (whole layers at TP=2,
    core attention at PP=2), against one process that keeps them; and with packed rows kept apart
    by ``cu_seqlens`` (TP=2, PP=2) against one process with the mask."""
    import torch.multiprocessing as mp

    cases = [
        ("llama", 2, 1, 1, "none", "mask"),
        ("qwen2", 2, 1, 1, "none", "mask"),
        ("llama", 1, 2, 1, "none", "mask"),
        ("qwen2", 1, 2, 1, "none", "mask"),
        ("qwen2", 1, 1, 2, "none", "mask"),
        ("llama", 2, 1, 1, "full", "mask"),
        ("qwen2", 1, 2, 1, "selective", "mask"),
        ("qwen2", 2, 1, 1, "none", "rows"),
        ("llama", 1, 2, 1, "selective", "rows"),
    ]
    out = tmp_path / "out.pt"
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), cases, str(out)), nprocs=2, join=True)
    for (kind, tp, pp, dp, re, at), got in zip(cases, torch.load(out, weights_only=False), strict=True):
        want = run_step(_backend(MegatronBackend, tiny_hf(kind), attention="mask"), ppo_batch())
        case = f"{kind} tp={tp} pp={pp} dp={dp} recompute={re} attention={at}"
        torch.testing.assert_close(got["logprobs"], want["logprobs"], atol=1e-5, rtol=0, msg=case)
        torch.testing.assert_close(got["values"], want["values"], atol=1e-5, rtol=0, msg=case)
        for key in ("critic/value_loss", "critic/grad_norm", "actor/policy_loss", "actor/grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (case, key)
        for name, w in want["weights"].items():
            torch.testing.assert_close(got["weights"][name], w, atol=1e-5, rtol=0, msg=f"{case} {name}")


def _adam_moments(backend) -> int:
    """How many numbers of Adam state the backend's actor optimizer keeps on this rank."""
    if backend.sharded:
        return backend.actor_opt.moments()
    return sum(t.numel() for st in backend.actor_opt.state.values() for t in st.values() if t.dim() > 0)


def _sharded_worker(rank: int, world: int, store_path: str, ckpt: str, out_path: str) -> None:
    import torch.distributed as dist

    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.set_num_threads(1)
    got: dict[str, object] = {}
    backend = _backend(MegatronBackend, tiny_hf("qwen2"), dp=2, warmup_steps=3, distributed_optimizer=True)
    got["sft"] = backend.train_sft(ppo_batch(seed=4), epochs=2, lr=1e-2, batch_size=2)
    backend.save(f"{ckpt}/before")  # before the PPO optimizers' first update: no moments yet
    got["first"] = run_step(backend, ppo_batch())
    moments: list[int] = [0] * world
    dist.all_gather_object(moments, _adam_moments(backend))
    got["moments"] = moments
    backend.save(ckpt)
    got["second"] = run_step(backend, ppo_batch(seed=3))
    for at, key, seed in ((f"{ckpt}/before", "loaded first", 0), (ckpt, "loaded second", 3)):
        loaded = _backend(
            MegatronBackend, tiny_hf("qwen2", seed=1), dp=2, warmup_steps=3, distributed_optimizer=True
        )
        loaded.load(at)
        got[key] = run_step(loaded, ppo_batch(seed=seed))
    # the tied embedding over two pipeline stages: its copy is counted once in megatron's norm too
    got["pp2"] = run_step(
        _backend(MegatronBackend, tiny_hf("qwen2"), pp=2, distributed_optimizer=True), ppo_batch()
    )
    if rank == 0:
        torch.save(got, out_path)
    dist.barrier()
    dist.destroy_process_group()


def _same_step(got: dict, want: dict, case: str, atol: float = 1e-5) -> None:
    """Losses, norms and learning rate to a relative ``atol``; weights to 10 x ``atol``: at lr 1e-2,
    Adam's step on a weight whose gradient is near zero turns float32's other summation order (two
    processes against one) into up to 1.6e-5 on an AMD EPYC (under 1e-5 on a Xeon). A shard updated
    wrongly is off by about a whole step, 1e-2."""
    for key in ("critic/value_loss", "critic/grad_norm", "actor/policy_loss", "actor/grad_norm", "actor/lr"):
        assert got[key] == pytest.approx(want[key], rel=atol, abs=1e-7), (case, key)
    for name, w in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, atol=10 * atol, rtol=0, msg=f"{case} {name}")


def test_the_distributed_optimizer_keeps_half_the_moments_at_dp2_and_takes_the_same_steps(tmp_path):
    """``distributed_optimizer=True`` (megatron-core's, run on CPU under ``megatron_cpu``) at DP=2:
    a warm start, then PPO steps with a warm-up schedule give the losses, gradient norms and weights
    of one process with torch AdamW; each rank keeps about half of Adam's moments; its checkpoint
    (moments gathered on data-parallel rank 0) resumes into the same next step, and refuses a backend
    without it. At PP=2 the tied embedding's copy is counted once in the norm."""
    import torch.multiprocessing as mp

    ckpt, out = tmp_path / "ckpt", tmp_path / "out.pt"
    (ckpt / "before").mkdir(parents=True)
    mp.spawn(_sharded_worker, args=(2, str(tmp_path / "store"), str(ckpt), str(out)), nprocs=2, join=True)
    got = torch.load(out, weights_only=False)

    one = _backend(MegatronBackend, tiny_hf("qwen2"), warmup_steps=3)
    sft = one.train_sft(ppo_batch(seed=4), epochs=2, lr=1e-2, batch_size=2)
    assert got["sft"] == pytest.approx(sft, rel=1e-5)
    _same_step(got["first"], run_step(one, ppo_batch()), "dp=2 first step")
    full = _adam_moments(one)
    assert full == 2 * sum(p.numel() for p in one.policy.parameters())
    moments = got["moments"]
    assert all(m <= 0.55 * full for m in moments) and sum(moments) >= full, (moments, full)
    _same_step(got["second"], run_step(one, ppo_batch(seed=3)), "dp=2 second step")
    _same_step(got["loaded first"], got["first"], "dp=2 resumed before any update", atol=0)
    _same_step(got["loaded second"], got["second"], "dp=2 resumed", atol=0)
    _same_step(got["pp2"], run_step(_backend(MegatronBackend, tiny_hf("qwen2")), ppo_batch()), "pp=2 tied")
    with pytest.raises(ValueError, match="distributed_optimizer=true: resume with that setting"):
        _backend(MegatronBackend, tiny_hf("qwen2"), warmup_steps=3).load(str(ckpt))


def test_a_loaded_checkpoint_continues_exactly_as_the_saved_backend(tmp_path):
    """Weights, both optimizers' moments, schedules and the minibatch order come back: a backend built
    from other weights and loaded takes the same next step as the one that saved."""
    batch = ppo_batch(seed=3)
    saved = _backend(MegatronBackend, tiny_hf("llama"), minibatches=2, warmup_steps=3)
    run_step(saved, batch)
    saved.save(str(tmp_path))
    # beside the backend's own file, the policy under the HF model's names (model.init, eval, replay)
    policy, served = checkpoint_policy(tmp_path), saved.engine_state_dict()
    assert policy.keys() == served.keys() and all(torch.equal(policy[k], v) for k, v in served.items())
    loaded = _backend(MegatronBackend, tiny_hf("llama", seed=1), minibatches=2, warmup_steps=3)
    loaded.load(str(tmp_path))
    after = [run_step(b, batch) for b in (saved, loaded)]
    for key in ("critic/value_loss", "actor/policy_loss", "actor/grad_norm", "actor/lr"):
        assert after[1][key] == after[0][key], key
    for name, w in after[0]["weights"].items():
        assert torch.equal(after[1]["weights"][name], w), name
    with pytest.raises(FileNotFoundError, match="not written by the Megatron backend"):
        loaded.load(str(tmp_path / "elsewhere"))


def test_quickstart_trains_on_the_megatron_backend_and_resumes(tmp_path):
    """The quickstart recipe, two iterations with ``trainer.backend=megatron``, then resumed for a
    third: the engine's rollout log-probs are the ones Megatron recomputes (the weight sync works)."""
    import json
    from pathlib import Path

    from agentrl.cli import main
    from tests.trainer.test_trainer import SMALL_QUICKSTART

    recipe = str(Path(__file__).resolve().parents[2] / "recipes/quickstart.yaml")
    args = [recipe, f"run.output_dir={tmp_path}", "trainer.backend=megatron", *SMALL_QUICKSTART]
    assert main(["train", *args, "run.iterations=2"]) == 0
    run = tmp_path / "quickstart"
    assert (run / "checkpoints/iter-000002/megatron-tp0.pt").stat().st_size > 0
    assert main(["train", *args, "run.iterations=3", "run.resume=true"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2]
    assert all(r["logprob_gap_mean_abs"] < 1e-4 for r in records)
    assert all("critic/value_loss" in r for r in records)
    # its checkpoint is a model.init, as a PyTorch backend's is
    assert main(["eval", recipe, *SMALL_QUICKSTART, f"model.init={run / 'checkpoints/iter-000003'}"]) == 0


@pytest.mark.parametrize(
    "sizes, files",
    [
        (["trainer.megatron.tp=2"], ["megatron-tp0.pt", "megatron-tp1.pt"]),
        (["trainer.megatron.dp=2", "trainer.megatron.distributed_optimizer=true"], ["megatron-tp0.pt"]),
    ],
    ids=["tp2", "dp2-distributed-optimizer"],
)
def test_torchrun_trains_the_quickstart_driven_by_rank_0(tmp_path, sizes, files):
    """``torchrun --nproc-per-node 2 ... trainer.megatron.tp=2`` (or ``dp=2`` with the distributed
    optimizer): rank 0 runs the trainer and the rollouts, rank 1 follows its backend calls; each
    tensor-parallel shard's checkpoint file is written (the optimizer's moments gathered into it);
    the run ends cleanly and the engine's log-probs are the ones the split model recomputes."""
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from tests.trainer.test_trainer import SMALL_QUICKSTART

    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        f"--master-port={port}",
    ]
    command += ["-m", "agentrl.cli", "train", "recipes/quickstart.yaml", f"run.output_dir={tmp_path}"]
    command += ["run.iterations=2", "trainer.backend=megatron", *sizes, *SMALL_QUICKSTART]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "quickstart"
    assert sorted(p.name for p in (run / "checkpoints/iter-000002").glob("megatron-*")) == files
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]
    assert all(r["logprob_gap_mean_abs"] < 1e-4 for r in records)


def test_vocab_parallel_logprobs_equal_token_logprobs_with_temperature_and_padding():
    """One rank holding the whole (padded) vocabulary: the log-probs, entropies and both gradients
    are those of ``agentrl.algo.token_logprobs`` over the real rows; the padded rows count nowhere."""
    from agentrl.algo import token_logprobs
    from agentrl.trainer.megatron_logprobs import vocab_parallel_logprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB + 3, 16, generator=g)  # 3 padded rows, never a target
    weight[VOCAB:] = 5.0  # large logits: counted in the normaliser, they would show
    weight.requires_grad_(True)
    targets = torch.randint(0, VOCAB, (37,), generator=g)
    got = vocab_parallel_logprobs(
        hidden, weight, targets, vocab_size=VOCAB, temperature=0.7, chunk=8, entropy=True
    )
    want = token_logprobs(hidden, weight[:VOCAB], targets, 0.7, 8, True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    coef = torch.randn(37, generator=g)
    grads = [torch.autograd.grad((lp * coef).sum(), (hidden, weight)) for lp in (got[0], want[0])]
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[0][1], grads[1][1], atol=1e-5, rtol=1e-5)
    assert float(grads[0][1][VOCAB:].abs().max()) == 0.0
