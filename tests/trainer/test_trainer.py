"""The PPO trainer: it learns a toy task, zero gradients hold through the backend, IcePop reaches
the loss, a run killed with -9 resumes with no batch lost or seen twice, recipes validate."""

import asyncio
import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agentrl.config import TrainConfig, load_config
from agentrl.env import register
from agentrl.models import tiny_chat_model
from agentrl.store import TrajectoryStore
from agentrl.trainer.backend import Batch, LossConfig
from agentrl.trainer.checkpoint import Checkpoints
from agentrl.trainer.phases import token_weights
from agentrl.trainer.torch_backend import TorchBackend
from agentrl.trainer.updates import backend_settings
from agentrl.trajectory import Trajectory, TurnSpan

ROOT = Path(__file__).resolve().parents[2]
register("magic-word-v0", entry_point="tests.trainer.toy_env:MagicWordEnv")

TOY = [
    "env.id=magic-word-v0",
    "env.eval_tasks=8",
    "env.train_tasks=64",
    "rollout.tasks_per_iteration=16",
    "rollout.n_samples=4",
    "rollout.max_turns=1",
    "rollout.max_new_tokens=8",
    "rollout.max_context=512",
    "optim.actor_lr=3e-3",
    "optim.critic_lr=3e-3",
    "optim.epochs=2",
    "metrics.progress=false",
    "metrics.tensorboard=false",
]


def test_ppo_learns_the_one_right_answer_within_50_iterations(tmp_path, capsys):
    from agentrl.trainer.ppo import main

    overrides = [f"run.output_dir={tmp_path}", "run.iterations=50", "run.seed=0", "metrics.eval_samples=4"]
    summary = main(load_config(TrainConfig, None, [*TOY, *overrides]))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first_solved = next((r["iteration"] for r in records if r["success_rate"] >= 0.9), None)
    assert summary["eval_before"] == 0.0 and summary["eval_after"] == 1.0
    assert first_solved is not None and first_solved < 50, [r["success_rate"] for r in records]
    # metrics.eval_samples: the mean over 4 samples per held-out task, and pass@4, before and after
    assert summary["eval_before_sampled"] < 0.5 < summary["eval_after_sampled"], summary
    for when in ("before", "after"):
        assert summary[f"eval_{when}_sampled"] <= summary[f"eval_{when}_pass_at_n"] <= 1.0, summary
    # agentrl eval: the run's last checkpoint directory as model.init, against the untrained model
    from agentrl.cli import main as cli

    recipe = tmp_path / "toy.yaml"
    recipe.write_text(f"run: {{name: toy-eval, output_dir: {tmp_path}}}\n")
    latest = Checkpoints(tmp_path / "run").latest()
    scores = {}
    for init in (None, latest):
        weights = [f"model.init={init}"] if init else []
        assert cli(["eval", str(recipe), *TOY, "metrics.eval_samples=4", *weights]) == 0
        out, err = capsys.readouterr()
        scores[init] = json.loads(out.strip().splitlines()[-1])
        assert ("note: model.init is not set" in err) == (init is None)
    assert scores[None]["eval_success"] == 0.0 and scores[latest]["eval_success"] == 1.0, scores
    assert scores[latest]["eval_success_sampled"] > scores[None]["eval_success_sampled"], scores
    assert not (tmp_path / "toy-eval").exists()  # eval writes nothing unless asked to store
    late = scores[latest]
    assert late["eval_pass_at_1"] == pytest.approx(late["eval_success_sampled"])  # the same estimate
    assert late["eval_pass_at_4"] == pytest.approx(late["eval_pass_at_n"])
    assert 0.0 <= late["eval_pass_at_1_ci95"] <= 1.0
    store = tmp_path / "eval-store"
    assert (
        cli(
            [
                "eval",
                str(recipe),
                *TOY,
                "metrics.eval_samples=4",
                f"model.init={latest}",
                "--store",
                str(store),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "pass@1 " in printed and "pass@4 " in printed and "(95 % interval over tasks)" in printed
    assert len(TrajectoryStore(store)) == 8 * (1 + 4)  # env.eval_tasks=8: greedy, then 4 samples each
    assert cli(["eval", str(recipe), *TOY, f"model.init={tmp_path / 'nowhere'}"]) == 2
    assert "model.init: cannot load" in capsys.readouterr().err


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_a_group_estimator_learns_the_one_right_answer_with_no_critic(tmp_path, estimator):
    from agentrl.trainer.ppo import main

    overrides = [f"run.output_dir={tmp_path}", "run.iterations=30", f"algo.estimator={estimator}"]
    summary = main(load_config(TrainConfig, None, [*TOY, *overrides]))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    curve = [r["success_rate"] for r in records]
    assert summary["eval_before"] == 0.0 and summary["eval_after"] == 1.0, curve
    # no value model is built, run or trained: only GAE reads one
    assert not [k for r in records for k in r if k.startswith("critic/")]
    state = torch.load(tmp_path / "run" / "checkpoints" / "iter-000030" / "backend.pt", weights_only=False)
    assert "critic" not in state and "policy" in state


def test_greedy_rollouts_train_with_the_log_probs_the_engine_reports_at_temperature_1(tmp_path):
    from agentrl.trainer.ppo import main

    overrides = [f"run.output_dir={tmp_path}", "run.iterations=2", "rollout.temperature=0"]
    main(load_config(TrainConfig, None, [*TOY, *overrides, "env.eval_tasks=2"]))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # the engine's greedy log-probs and the trainer's recomputation are of one distribution
    assert [r["icepop_masked_frac"] for r in records] == [0.0, 0.0]
    assert all(r["logprob_gap_mean_abs"] < 1e-4 for r in records), records


def test_a_batch_with_nothing_to_learn_from_stops_the_run_with_the_reason(tmp_path, capsys):
    from agentrl.cli import main as cli

    args = ["train", str(ROOT / "recipes/quickstart.yaml"), *TOY, f"run.output_dir={tmp_path}"]
    args += ["env.args={}", "env.eval_tasks=2", "sft.episodes=0", "algo.critic_warmup=0"]
    # every episode ends env_error: the held-out evaluation before training says so and why
    assert cli([*args, "env.args.broken=true"]) == 2
    err = capsys.readouterr().err
    assert "held-out evaluation on 2 test tasks: none of its 2 episodes" in err
    assert "statuses {'env_error': 2}" in err and "the service behind this env is down" in err
    assert "agentrl envs check magic-word-v0" in err
    # no episode has room for a turn: the prompts fill the context (evaluation off, so training says it)
    assert cli([*args, "rollout.max_context=64", "env.eval_tasks=0"]) == 2
    err = capsys.readouterr().err
    assert "iteration 0: none of its 64 episodes" in err and "fill rollout.max_context=64 tokens" in err


def test_dropout_is_off_so_the_first_update_starts_at_ratio_one():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    config = Qwen2Config(**shape, num_key_value_heads=2, vocab_size=700, attention_dropout=0.5)
    backend = TorchBackend(Qwen2ForCausalLM(config), micro_token_budget=10_000)
    batch = synthetic_batch()
    batch.old_logprobs = backend.logprobs(batch)
    assert torch.equal(backend.logprobs(batch), batch.old_logprobs)
    assert torch.equal(backend.values(batch), backend.values(batch))
    batch.advantages = torch.where(batch.loss_mask, 1.0, 0.0)
    out = backend.train_actor(batch, LossConfig())
    assert out["actor/ratio_min"] == out["actor/ratio_max"] == 1.0 and out["actor/clip_frac"] == 0.0


def test_rows_without_a_trainable_token_are_not_run_through_the_model():
    model, _ = tiny_chat_model(seed=3)
    backend = TorchBackend(model, micro_token_budget=10_000)
    batch = synthetic_batch()
    batch.loss_mask[1] = False  # a row cut off before the policy's first turn
    seen = []
    backbone = backend.policy.model
    handle = backbone.register_forward_hook(
        lambda m, args, kwargs, out: seen.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    logp = backend.logprobs(batch)
    handle.remove()
    assert seen == [2] and (logp[1] == 0).all() and (logp[0] != 0).any() and (logp[2] != 0).any()


def test_group_advantages_are_not_whitened_again_and_a_uniform_group_keeps_zero():
    from agentrl.trainer.phases import advantages

    def row(trainable: int, reward: float) -> Trajectory:
        n = 3 + trainable
        spans = [TurnSpan(0, 3, "prompt"), TurnSpan(3, n, "assistant")]
        return Trajectory(list(range(1, n + 1)), [0] * 3 + [1] * trainable, [0.0] * n, spans, reward=reward)

    # group 0: a success over 2 tokens, a failure over 6; group 1: two successes over 3 tokens each
    batch = Batch.from_trajectories([row(2, 1.0), row(6, 0.0), row(3, 1.0), row(3, 1.0)], [0, 0, 1, 1])
    algo = load_config(TrainConfig, None, ["algo.estimator=grpo"]).algo
    assert algo.normalize_advantages  # the default, which applies to GAE's advantages only
    adv, returns, metrics = advantages(batch, algo)
    mask = batch.loss_mask
    # (r - mean) / std within the group (Bessel's std of [1, 0] is 0.7071), spread over the row's tokens
    torch.testing.assert_close(adv[0][mask[0]], torch.full((2,), 0.5 / 0.5**0.5), atol=1e-5, rtol=0)
    torch.testing.assert_close(adv[1][mask[1]], torch.full((6,), -0.5 / 0.5**0.5), atol=1e-5, rtol=0)
    assert (adv[2:] == 0).all() and (adv[~mask] == 0).all()
    assert metrics["zero_adv_frac"] == pytest.approx(6 / 14)  # group 1's tokens, as they reach the loss
    assert torch.equal(returns[mask], batch.rewards[:, None].expand_as(mask)[mask])
    # GAE's advantages are whitened over the batch's tokens
    batch.old_values = torch.zeros(mask.shape)
    gae_adv, _, _ = advantages(batch, load_config(TrainConfig).algo)
    assert abs(float(gae_adv[mask].mean())) < 1e-6 and abs(float(gae_adv[mask].std()) - 1) < 1e-5


def synthetic_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    trajectories = []
    for n in (24, 15, 31):
        ids = torch.randint(3, 700, (n,), generator=g).tolist()
        # prompt 4 / assistant 6 / tool 3 / assistant rest
        mask = [0] * 4 + [1] * 6 + [0] * 3 + [1] * (n - 13)
        turns = [
            TurnSpan(0, 4, "prompt"),
            TurnSpan(4, 10, "assistant"),
            TurnSpan(10, 13, "tool"),
            TurnSpan(13, n, "assistant"),
        ]
        logps = [(-1.0 if m else 0.0) for m in mask]
        trajectories.append(Trajectory(ids, mask, logps, turns, reward=float(n % 2)))
    return Batch.from_trajectories(trajectories)


def test_masked_and_icepop_dropped_tokens_get_zero_logit_gradient_through_the_backend(monkeypatch):
    import agentrl.trainer.torch_backend as tb

    model, _ = tiny_chat_model(seed=3)
    backend = TorchBackend(model, actor_lr=1e-9, micro_token_budget=10_000)
    batch = synthetic_batch()
    batch.old_logprobs = backend.logprobs(batch)
    # Rollout log-probs far from the recomputed ones on some tokens: IcePop drops those.
    batch.rollout_logprobs = batch.old_logprobs.clone()
    batch.rollout_logprobs[:, 5] += 3.0  # k = e^-3 < 0.5: dropped
    batch.rollout_logprobs[:, 15] -= 2.0  # k = e^2 = 7.4 > 5: dropped
    batch.rollout_logprobs = torch.where(batch.loss_mask, batch.rollout_logprobs, torch.zeros(()))
    batch.token_weights, metrics = token_weights(batch, load_config(TrainConfig).algo)
    assert metrics["icepop_masked_frac"] > 0
    batch.advantages = torch.where(batch.loss_mask, torch.randn(batch.input_ids.shape), torch.zeros(()))
    recorded = []

    def naive(hidden, weight, targets, temperature=1.0, chunk_size=1024, return_entropy=False, *, tf32=False):
        logits = (hidden @ weight.t()) / temperature
        logits.retain_grad()
        recorded.append(logits)
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
        return (logp, -(logp_all.exp() * logp_all).sum(-1)) if return_entropy else logp

    monkeypatch.setattr(tb, "token_logprobs", naive)
    out = backend.train_actor(batch, LossConfig())
    assert out["actor/icepop_masked_frac"] == pytest.approx(
        metrics["icepop_masked_frac"]
    )  # the weights reached the loss
    (logits,) = recorded
    grad = logits.grad.abs().sum(-1)
    # Row order inside the backend's micro-batch: longest first (31, 24, 15); flat index per token t>=1.
    order = sorted(range(batch.size), key=lambda r: -int(batch.lengths[r]))
    dropped, kept, at = [], [], 0
    for r in order:
        n = int(batch.lengths[r])
        for t in range(1, n):
            trainable = bool(batch.loss_mask[r, t]) and float(batch.token_weights[r, t]) > 0
            (kept if trainable else dropped).append(at + t - 1)
        at += n - 1
    assert (grad[dropped] == 0).all()
    assert (grad[kept] > 0).all()


def test_padding_changes_no_real_token_log_prob_or_value():
    """Rows of different lengths padded into one micro-batch (no padding mask: right padding under
    causal attention) give each real token the log-prob and value it gets alone, and packed rows
    (block-diagonal mask) give the same: no row sees another's tokens or its padding."""
    model, _ = tiny_chat_model(seed=5)
    batch = synthetic_batch(seed=2)
    alone = TorchBackend(model, micro_token_budget=1)  # each row in its own micro-batch, unpadded
    torch.nn.init.normal_(alone.critic.head.weight)  # not the zero head of a fresh critic
    together = {
        kind: TorchBackend(model, micro_token_budget=10_000, packing=kind) for kind in ("padded", "packed")
    }
    assert len(together["padded"]._group(batch.lengths.tolist(), [0, 1, 2], 10_000)) == 1
    for backend in together.values():
        backend.critic.load_state_dict(alone.critic.state_dict())
        for fn in ("logprobs", "values"):
            got, want = getattr(backend, fn)(batch), getattr(alone, fn)(batch)
            for r, n in enumerate(batch.lengths.tolist()):
                torch.testing.assert_close(got[r, :n], want[r, :n], atol=1e-5, rtol=1e-5)


def packings(model, attentions: tuple[str, ...], **kwargs) -> dict[tuple[str, str], TorchBackend]:
    """Backends on copies of ``model`` holding a batch in one micro-batch: padded, and packed with
    each of ``attentions``."""
    import copy

    pairs = [("padded", "auto")] + [("packed", a) for a in attentions]
    return {
        (kind, attention): TorchBackend(
            copy.deepcopy(model), micro_token_budget=10_000, packing=kind, attention=attention, **kwargs
        )
        for kind, attention in pairs
    }


def test_packed_rows_with_flex_attention_match_padded_ones_and_train_the_same():
    """The packed path without a [T, T] mask (FlexAttention with a document mask, what CUDA runs
    when flash-attn is not installed) against the padded path and the dense-mask reference: the
    same log-probs (1e-5 in fp32, 1e-3 under bf16 autocast). FlexAttention has no backward on the
    CPU; benchmarks/gpu_train_step.py compares the gradients on a GPU."""
    from agentrl.trainer.torch_backend import resolve_attention

    assert resolve_attention("auto", torch.device("cpu")) == "dense"
    assert resolve_attention("flex", torch.device("cpu")) == "flex"
    with pytest.raises(ValueError, match="attention must be one of"):
        resolve_attention("paged", torch.device("cpu"))
    model, _ = tiny_chat_model(seed=5)
    batch = synthetic_batch(seed=2)
    mask = batch.loss_mask
    for dtype, tol in (("float32", 1e-5), ("bfloat16", 1e-3)):
        made = packings(model, ("dense", "flex"), dtype=dtype)
        assert made[("packed", "flex")].policy.config._attn_implementation == "flex_attention"
        assert made[("packed", "flex")].critic.backbone.config._attn_implementation == "flex_attention"
        padded = made[("padded", "auto")].logprobs(batch)
        for key in (("packed", "dense"), ("packed", "flex")):
            gap = float((made[key].logprobs(batch) - padded)[mask].abs().max())
            assert gap < tol, (dtype, key, gap)


def test_the_document_block_mask_equals_flex_attentions_own_from_the_whole_mask():
    """The packed FlexAttention path's ``BlockMask``, built from the documents' extents per block,
    is the one ``create_block_mask`` derives from every (q, kv) pair: the same blocks, partial and
    full, in the same order, and the same dense mask; with packs that fill their last block and
    packs that do not, and documents shorter and longer than a block."""
    from torch.nn.attention.flex_attention import create_block_mask

    from agentrl.trainer.torch_backend import document_block_mask

    generator = torch.Generator().manual_seed(0)
    for trial in range(12):
        docs = int(torch.randint(1, 6, (), generator=generator))
        seg = torch.repeat_interleave(torch.arange(docs), torch.randint(1, 300, (docs,), generator=generator))
        if trial % 2:  # a pack padded to whole blocks, as the backend pads it
            seg = torch.cat([seg, torch.full(((-seg.numel()) % 64,), docs)])
        total = seg.numel()

        def same_document_causal(b, h, q, kv, seg=seg):
            return (seg[q] == seg[kv]) & (q >= kv)

        want = create_block_mask(same_document_causal, None, None, total, total, "cpu", BLOCK_SIZE=64)
        got = document_block_mask(seg, block=64)
        assert torch.equal(got.to_dense(), want.to_dense()), trial
        for count, order in (
            ("kv_num_blocks", "kv_indices"),
            ("full_kv_num_blocks", "full_kv_indices"),
            ("q_num_blocks", "q_indices"),
            ("full_q_num_blocks", "full_q_indices"),
        ):
            assert torch.equal(getattr(got, count), getattr(want, count)), (trial, count)
            for row, n in enumerate(getattr(want, count)[0, 0].tolist()):
                assert torch.equal(getattr(got, order)[0, 0, row, :n], getattr(want, order)[0, 0, row, :n])


def flash_attn_stand_in(calls: list):
    """A pure-torch stand-in for flash-attn's kernel module, for the one call the packed path makes.

    ``flash_attn_varlen_func`` has the signature of flash-attn 2.8.3's (``flash_attn_interface.py``;
    transformers reads it to decide which keyword arguments to pass) and its rules: q ``[total, heads,
    dim]``, k and v with fewer heads for GQA, int32 ``cu_seqlens``, fp16/bf16 only, causal within each
    sequence. It upcasts to fp32 like the kernel's accumulator and has a backward (autograd)."""
    import types
    from importlib.machinery import ModuleSpec

    def flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
        softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
        deterministic=False, return_attn_probs=False, block_table=None,
    ):  # fmt: skip
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError("FlashAttention only supports fp16 and bf16 data types")
        assert cu_seqlens_q.dtype == torch.int32 and torch.equal(cu_seqlens_q, cu_seqlens_k)
        assert (dropout_p, tuple(window_size), softcap, alibi_slopes) == (0.0, (-1, -1), 0.0, None)
        bounds = cu_seqlens_q.tolist()
        assert bounds[0] == 0 and bounds[-1] == q.shape[0]
        assert max_seqlen_q == max_seqlen_k == max(b - a for a, b in itertools.pairwise(bounds))
        calls.append(bounds)
        groups = q.shape[1] // k.shape[1]
        out = []
        for a, b in itertools.pairwise(bounds):
            qs, ks, vs = (x[a:b].float().transpose(0, 1) for x in (q, k, v))
            ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
            out.append(
                torch.nn.functional.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=causal, scale=softmax_scale
                ).transpose(0, 1)
            )
        return torch.cat(out).to(q.dtype)

    module = types.ModuleType("flash_attn")
    module.__spec__ = ModuleSpec("flash_attn", None)
    module.__version__ = "2.8.3"
    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module


def test_packed_rows_with_flash_attn_varlen_match_the_dense_mask_in_log_probs_and_gradients(monkeypatch):
    """The packed path on flash-attn's variable-length kernel (what ``attention: auto`` picks on CUDA
    with flash-attn installed and bf16), through transformers' own flash-attention integration with
    the kernel replaced by a pure-torch stand-in: flash-attn cannot be built here. The backend hands
    the kernel each pack's row boundaries once per forward; the log-probs match the padded path's
    and the actor gradients the dense mask's, in bf16 autocast."""
    import sys

    import transformers.modeling_flash_attention_utils as fa_utils
    from transformers.modeling_utils import PreTrainedModel

    from agentrl.trainer.torch_backend import resolve_attention

    cpu = torch.device("cpu")
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed: a clear error, and auto skips it
    with pytest.raises(ValueError, match="flash-attn is not installed.*'flex' or 'auto'"):
        resolve_attention("varlen", cpu, "bfloat16")
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn_stand_in(calls))
    with pytest.raises(ValueError, match="needs dtype 'bfloat16'.*got 'float32'"):
        resolve_attention("varlen", cpu, "float32")
    assert resolve_attention("auto", cpu, "bfloat16") == "dense"
    # transformers checks for CUDA before it takes flash_attention_2, then loads flash-attn's kernel:
    # both seams lead to the stand-in here.
    check = PreTrainedModel._check_and_adjust_attn_implementation
    monkeypatch.setattr(
        PreTrainedModel,
        "_check_and_adjust_attn_implementation",
        lambda self, impl, *a, **k: impl if impl == "flash_attention_2" else check(self, impl, *a, **k),
    )
    kernel = sys.modules["flash_attn"].flash_attn_varlen_func
    process = fa_utils._lazy_define_process_function(kernel)
    monkeypatch.setattr(
        fa_utils,
        "lazy_import_flash_attention",
        lambda *a, **k: ((None, kernel, None, None, None), (process, dict)),
    )
    searched = []  # transformers' per-layer search of the position ids for the row starts
    monkeypatch.setattr(fa_utils, "_is_packed_sequence", lambda *a: searched.append(a) or True)

    model, _ = tiny_chat_model(seed=5)
    batch = synthetic_batch(seed=2)
    made = packings(model, ("dense", "varlen"), dtype="bfloat16", critic=False)
    varlen = made[("packed", "varlen")]
    assert varlen.policy.config._attn_implementation == "flash_attention_2"
    padded = made[("padded", "auto")].logprobs(batch)
    gap = float((varlen.logprobs(batch) - padded)[batch.loss_mask].abs().max())
    assert gap < 1e-3, gap
    lengths = sorted(batch.lengths.tolist(), reverse=True)  # one pack, longest row first
    bounds = [sum(lengths[:k]) for k in range(len(lengths) + 1)]
    layers = model.config.num_hidden_layers
    assert calls == [bounds] * layers  # each layer got the rows' boundaries: no row saw another
    assert not searched  # given by the backend, not searched for again in each layer

    grads = {}
    batch.old_logprobs = padded
    batch.advantages = torch.where(batch.loss_mask, torch.randn(batch.input_ids.shape), torch.zeros(()))
    for key in (("packed", "dense"), ("packed", "varlen")):
        backend = made[key]
        backend.actor_opt.step = lambda *a, **k: None  # keep the gradients, skip the update
        backend.train_actor(batch, LossConfig())
        grads[key[1]] = torch.cat(
            [p.grad.flatten() for p in backend.policy.parameters() if p.grad is not None]
        )
    assert len(calls) == 2 * layers  # the actor's forward ran on the kernel too
    gap = float((grads["varlen"] - grads["dense"]).norm() / grads["dense"].norm())
    assert gap < 2e-2, gap


def test_reset_critic_starts_the_value_model_from_the_current_policy():
    model, _ = tiny_chat_model(seed=4)
    backend = TorchBackend(model, critic_lr=1e-3, adam_eps=1e-5)
    with torch.no_grad():  # stand-in for a warm start: the policy moves after the backend was built
        for p in model.parameters():
            p.add_(0.01)
    body = model.base_model_prefix

    def same_backbone():
        policy = {k.removeprefix(body + "."): v for k, v in model.state_dict().items() if k.startswith(body)}
        critic = backend.critic.backbone.state_dict()
        return all(torch.equal(policy[k], critic[k]) for k in critic)

    assert not same_backbone()
    backend.reset_critic()
    assert same_backbone() and float(backend.critic.head.weight.detach().abs().sum()) == 0.0
    assert backend.critic_opt.param_groups[0]["params"][0] is next(backend.critic.parameters())
    assert backend.critic_opt.param_groups[0]["lr"] == 1e-3
    assert backend.critic_opt.param_groups[0]["eps"] == backend.actor_opt.param_groups[0]["eps"] == 1e-5


def test_reset_reference_anchors_the_kl_to_the_current_policy():
    model, _ = tiny_chat_model(seed=7)
    backend = TorchBackend(model, reference=True, critic=False)
    with torch.no_grad():  # stand-in for a warm start after the backend was built
        for p in model.parameters():
            p.add_(0.01)
    batch = synthetic_batch()
    assert not torch.allclose(backend.ref_logprobs(batch), backend.logprobs(batch))
    backend.reset_reference()
    torch.testing.assert_close(backend.ref_logprobs(batch), backend.logprobs(batch))
    assert not any(p.requires_grad for p in backend.reference.parameters())
    TorchBackend(model, critic=False).reset_reference()  # no reference: nothing to do


def steps_taken(opt) -> int:
    return max(int(s["step"]) for s in opt.state.values())


def test_critic_epochs_set_the_critic_steps_and_its_schedule_spans_them():
    model, _ = tiny_chat_model(seed=5)
    backend = TorchBackend(
        model, epochs=1, critic_epochs=3, minibatches=3, schedule="cosine", total_steps=3, critic_lr=1e-3
    )
    batch = synthetic_batch()
    batch.old_logprobs = backend.logprobs(batch)
    batch.old_values = backend.values(batch)
    batch.advantages = torch.where(batch.loss_mask, torch.ones(batch.input_ids.shape), torch.zeros(()))
    batch.returns = batch.advantages.clone()
    backend.train_critic(batch, LossConfig(value_clip=None))
    backend.train_actor(batch, LossConfig())

    assert (steps_taken(backend.critic_opt), steps_taken(backend.actor_opt)) == (9, 3)
    # both cosine schedules end together, the critic's after its 9 steps, the actor's after its 3
    assert backend.critic_sched.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)
    assert backend.actor_sched.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)
    backend = TorchBackend(model, epochs=1, minibatches=3, schedule="cosine", total_steps=6, critic_lr=1e-3)
    backend.train_critic(batch, LossConfig(value_clip=None))
    assert backend.critic_sched.get_last_lr()[0] == pytest.approx(5e-4)  # default: the actor's epochs


def test_the_actors_schedule_spans_the_iterations_after_the_critics_warmup():
    # 4 iterations, the first 2 critic-only: the actor steps twice, and its cosine must reach 0 then
    overrides = ["run.iterations=4", "algo.critic_warmup=2", "optim.schedule=cosine", "optim.epochs=1"]
    settings = backend_settings(load_config(TrainConfig, None, [*overrides, "optim.minibatches=1"]))
    assert (settings["total_steps"], settings["critic_total_steps"]) == (2, 4)
    model, _ = tiny_chat_model(seed=5)
    keep = ("schedule", "total_steps", "critic_total_steps", "epochs", "minibatches")
    backend = TorchBackend(model, actor_lr=1e-3, critic_lr=1e-3, **{k: settings[k] for k in keep})
    batch = synthetic_batch()
    batch.old_logprobs = backend.logprobs(batch)
    batch.old_values = backend.values(batch)
    batch.advantages = torch.where(batch.loss_mask, torch.ones(batch.input_ids.shape), torch.zeros(()))
    batch.returns = batch.advantages.clone()
    for it in range(4):
        backend.train_critic(batch, LossConfig(value_clip=None))
        if it >= 2:
            backend.train_actor(batch, LossConfig())
    assert backend.actor_sched.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)
    assert backend.critic_sched.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)


def test_a_supervised_step_holds_at_most_batch_size_episodes():
    model, _ = tiny_chat_model(seed=5)
    backend = TorchBackend(model)
    batch = synthetic_batch()  # 3 episodes
    taken = []
    step = backend._step
    backend._step = lambda *args: (
        taken.append([len(m) for m in backend._minibatches(batch, args[-1])]) or step(*args)
    )
    for size, steps in ((1, 3), (2, 2), (3, 1), (8, 1)):
        taken.clear()
        backend.train_sft(batch, epochs=1, lr=1e-4, batch_size=size)
        assert len(taken) == 1 and len(taken[0]) == steps and max(taken[0]) <= size, (size, taken)


def test_recipes_all_validate():
    recipes = sorted((ROOT / "recipes").glob("*.yaml"))
    assert recipes
    for path in recipes:
        import yaml

        data = yaml.safe_load(path.read_text())
        header = path.read_text().splitlines()[0]
        assert header.startswith("#"), (
            f"{path.name} needs a header saying what it trains and how to launch it"
        )
        assert isinstance(data, dict)
        load_config(TrainConfig, str(path))  # every recipe, for train and for rollout, is a TrainConfig


# The quickstart recipe cut down to seconds (the full run's figures are in the README).
SMALL_QUICKSTART = [
    "sandbox.kind=local",
    "sft.episodes=4",
    "sft.epochs=1",
    "env.eval_tasks=2",
    "rollout.tasks_per_iteration=2",
    "rollout.n_samples=2",
    "rollout.max_new_tokens=24",
    "metrics.progress=false",
]


def test_quickstart_two_iteration_smoke(tmp_path):
    from agentrl.cli import main

    code = main(
        ["train", str(ROOT / "recipes/quickstart.yaml"), f"run.output_dir={tmp_path}", "run.iterations=2"]
        + SMALL_QUICKSTART
    )
    assert code == 0
    run = tmp_path / "quickstart"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]
    for key in (
        "reward_mean",
        "success_rate",
        "statuses",
        "truncation_rate",
        "zero_adv_frac",
        "icepop_masked_frac",
        "actor/clip_frac",
        "actor/approx_kl",
        "actor/entropy",
        "logprob_gap_mean_abs",
        "critic/value_loss",
        "critic/value_explained_var",
        "critic/explained_var_before",
        "rollout_tokens_per_s",
        "train_tokens_per_s",
        "turns_mean",
        "length_mean",
    ):
        assert key in records[-1], key
    summary = json.loads((run / "summary.json").read_text())
    assert 0.0 <= summary["eval_before"] <= 1.0 and 0.0 <= summary["eval_after"] <= 1.0
    assert Checkpoints(run).latest().name == "iter-000002"
    # The warm-started weights are kept; a run can start from them (model.init) without a warm start.
    from agentrl.rollout.from_config import env_factory, load_policy

    cfg = load_config(
        TrainConfig, str(ROOT / "recipes/quickstart.yaml"), [f"model.init={run / 'warm_start.pt'}"]
    )
    warm = torch.load(run / "warm_start.pt", weights_only=True)
    loaded = load_policy(cfg, env_factory(cfg)())[0].state_dict()
    assert warm.keys() == loaded.keys() and all(torch.equal(warm[k], loaded[k]) for k in warm)
    plain = load_config(TrainConfig, str(ROOT / "recipes/quickstart.yaml"))
    fresh = load_policy(plain, env_factory(plain)())[0].state_dict()
    assert not all(torch.equal(warm[k], fresh[k]) for k in warm)  # the warm start changed the weights
    code = main(
        [
            "train",
            str(ROOT / "recipes/quickstart.yaml"),
            f"run.output_dir={tmp_path}",
            "run.name=from-warm",
            "run.iterations=1",
            f"model.init={run / 'warm_start.pt'}",
            "sft.episodes=0",
            "sandbox.kind=local",
            "env.eval_tasks=2",
            "rollout.tasks_per_iteration=1",
            "rollout.n_samples=2",
            "rollout.max_new_tokens=24",
            "metrics.progress=false",
            "algo.critic_warmup=0",
        ]
    )
    assert code == 0 and not (tmp_path / "from-warm" / "warm_start.pt").exists()
    record = json.loads((tmp_path / "from-warm" / "metrics.jsonl").read_text().splitlines()[-1])
    assert "actor/policy_loss" in record
    assert main(["train", str(ROOT / "recipes/quickstart.yaml"), f"model.init={tmp_path}/nothing.pt"]) == 2


def test_warm_start_imitates_the_slipped_fixes_of_a_noisy_expert(tmp_path):
    from agentrl.trainer.build import setup
    from agentrl.trainer.warm_start import demonstration_episodes, sft_episodes

    def episodes(miss: float, n: int):
        overrides = [f"env.args.expert_miss={miss}", f"run.output_dir={tmp_path}", "sandbox.kind=local"]
        cfg = load_config(TrainConfig, str(ROOT / "recipes/quickstart.yaml"), overrides)

        async def go():
            run = await setup(cfg, log=lambda *_: None)
            try:
                return await demonstration_episodes(run, [cfg.env.train_tasks + i for i in range(n)])
            finally:
                run.store.close()
                await run.engine.close()

        return asyncio.run(go())

    (trajectory,) = episodes(1.0, 1)
    trajectory.validate()
    # the slipped fix applies (no editor error), fails the tests, and every assistant token is trained on
    assert (
        trajectory.reward == 0.0
        and trajectory.status == "completed"
        and trajectory.extra["demo_reward"] == 0.0
    )
    assert not any(c.get("error") for c in trajectory.tool_calls)
    spans = [s for s in trajectory.turns if s.role == "assistant"]
    assert len(spans) == 3 and all(all(trajectory.loss_mask[s.start : s.end]) for s in spans)
    # the warm start keeps the slipped episodes alongside the solved ones, in order
    played = episodes(0.5, 8)
    kept, slipped = sft_episodes(played)
    assert kept == played and 0 < slipped < 8
    assert (
        slipped == sum(t.reward == 0.0 for t in played) == sum(t.extra["demo_reward"] == 0.0 for t in played)
    )
    # an episode cut off by a limit, or one that earned another reward than meant, is left out
    cut = dataclasses.replace(played[0], status="max_turns")
    assert sft_episodes([cut, *played[1:]])[0] == played[1:]
    solved = next(t for t in played if t.reward == 1.0)
    unmeant = dataclasses.replace(solved, reward=0.0)
    assert sft_episodes([unmeant, *played])[0] == played
    with pytest.raises(
        RuntimeError, match="none of 1 demonstration episodes was a success that ended as meant"
    ):
        sft_episodes([unmeant])


def test_a_warm_start_needs_demonstrations_or_a_store(tmp_path, capsys):
    from agentrl.cli import main

    out = f"run.output_dir={tmp_path}"
    assert (
        main(["train", str(ROOT / "recipes/quickstart.yaml"), out, "env.id=magic-word-v0", "env.args={}"])
        == 2
    )
    err = capsys.readouterr().err
    assert "sft.episodes=512: environment magic-word-v0 has no demonstration(task) to warm-start from" in err
    assert "sft.from_store=PATH" in err


def test_bad_train_config_names_the_key(capsys):
    from agentrl.cli import main

    assert main(["train", str(ROOT / "recipes/quickstart.yaml"), "optim.actor_lrr=1e-3"]) == 2
    assert "unknown key 'optim.actor_lrr'. Did you mean 'optim.actor_lr'?" in capsys.readouterr().err
    assert main(["train", str(ROOT / "recipes/quickstart.yaml"), "algo.policy_loss=dpo"]) == 2
    assert "'algo.policy_loss': Input should be 'ppo', 'gspo', 'gmpo' or 'sapo'" in capsys.readouterr().err
    assert main(["train", str(ROOT / "recipes/quickstart.yaml"), "env.args.expert_run_test=false"]) == 2
    expected = "takes no argument 'expert_run_test'. Did you mean env.args.expert_run_tests?"
    assert expected in capsys.readouterr().err
    # a check across sections names the settings and the way out, without echoing the whole config
    assert (
        main(["train", str(ROOT / "recipes/quickstart.yaml"), "algo.estimator=grpo", "rollout.n_samples=1"])
        == 2
    )
    err = capsys.readouterr().err
    assert "estimator grpo needs rollout.n_samples >= 2 (a group baseline)." in err and "'run'" not in err
    recipe = str(ROOT / "recipes/quickstart.yaml")  # its algo.critic_warmup is 1
    assert main(["train", recipe, "algo.estimator=rloo"]) == 2
    err = capsys.readouterr().err
    assert "algo.critic_warmup=1 trains only the critic" in err and "set algo.critic_warmup=0" in err
    assert main(["train", recipe, "algo.policy_loss=gmpo"]) == 2
    assert "use estimator grpo or rloo with gmpo" in capsys.readouterr().err
    # a setting the chosen loss would ignore, or a dual-clip bound that bounds nothing
    for bad, message in [
        ("algo.policy_loss=sapo algo.clip_high=0.3", "policy_loss sapo does not use algo.clip_high=0.3"),
        ("algo.policy_loss=gspo algo.dual_clip=3", "policy_loss gspo does not use algo.dual_clip=3.0"),
        ("algo.policy_loss=gspo algo.agg=token-mean", "policy_loss gspo does not use algo.agg=token-mean"),
        ("algo.dual_clip=0.5", "'algo.dual_clip': Input should be greater than 1"),
    ]:
        assert main(["train", recipe, *bad.split()]) == 2
        assert message in capsys.readouterr().err, bad
    # numbers that are not finite, a ratio band below 0, a run outside its output directory
    for bad, message in [
        ("optim.actor_lr=.inf", "'optim.actor_lr': Input should be a finite number (got inf)"),
        ("algo.clip_low=5", "'algo.clip_low': Input should be less than 1 (got 5)"),
        ("run.name=..", "'run.name': must name a directory inside run.output_dir"),
        ("run.name=/tmp/x", "'run.name': must name a directory inside run.output_dir"),
    ]:
        assert main(["train", recipe, bad]) == 2
        assert message in capsys.readouterr().err, bad


def test_rollout_sampling_settings_reach_the_agent_loop_and_evaluation_is_greedy():
    from agentrl.rollout.from_config import loop_config

    cfg = load_config(
        TrainConfig, str(ROOT / "recipes/quickstart.yaml"), ["rollout.top_k=3", "rollout.top_p=0.8"]
    )
    sampled = loop_config(cfg)
    assert (sampled.temperature, sampled.top_p, sampled.top_k, sampled.seed) == (0.5, 0.8, 3, 0)
    greedy = loop_config(cfg, greedy=True)
    assert greedy.temperature == 0.0 and greedy.seed is None


RESUMABLE = """
import sys
from agentrl.env import register
from agentrl.config import TrainConfig, load_config
from agentrl.trainer.ppo import main
register("magic-word-v0", entry_point="tests.trainer.toy_env:MagicWordEnv")
main(load_config(TrainConfig, None, sys.argv[1:]))
"""


# The Megatron backend's cases run in the slow suite (make test-slow): about 25 s of three runs each.
@pytest.mark.parametrize(
    "backend",
    [
        "torch",
        pytest.param("megatron", marks=pytest.mark.slow),
        pytest.param("megatron-distributed-optimizer", marks=pytest.mark.slow),
    ],
)
def test_kill_9_mid_iteration_then_resume_loses_and_repeats_no_batch(tmp_path, backend):
    args = [*TOY, "run.iterations=6", "env.eval_tasks=2", "rollout.tasks_per_iteration=6"]
    if backend.startswith("megatron"):
        pytest.importorskip("megatron.core", reason="the megatron extra is not installed")
        args.append("trainer.backend=megatron")
        if backend.endswith("distributed-optimizer"):
            args.append("trainer.megatron.distributed_optimizer=true")
    else:
        args.append(f"trainer.backend={backend}")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def run(out, *extra):
        return subprocess.Popen(
            [sys.executable, "-c", RESUMABLE, *args, f"run.output_dir={out}", *extra],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    # Reference: the same run, uninterrupted.
    assert run(tmp_path / "ref").wait(timeout=600) == 0
    reference = [
        json.loads(line)["tasks"] for line in (tmp_path / "ref/run/metrics.jsonl").read_text().splitlines()
    ]
    assert len(reference) == 6

    # Killed with -9 while iteration 3 runs, then resumed.
    metrics = tmp_path / "killed/run/metrics.jsonl"
    child = run(tmp_path / "killed")
    deadline = time.time() + 600
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.05)
    time.sleep(0.3)  # into iteration 3
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    done_before = len(metrics.read_text().splitlines())
    assert 3 <= done_before < 6
    (tmp_path / "killed/run/checkpoints/iter-000099.tmp").mkdir()  # a half-written checkpoint is ignored
    assert run(tmp_path / "killed", "run.resume=true").wait(timeout=600) == 0
    resumed = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in resumed] == list(range(6))
    assert [r["tasks"] for r in resumed] == reference


def test_a_warm_start_from_a_store_imitates_its_successes_only(tmp_path, capsys):
    from agentrl.cli import main
    from agentrl.env import make
    from agentrl.models import env_corpus, tiny_tokenizer
    from agentrl.store import TrajectoryStore

    tok = tiny_tokenizer(corpus=env_corpus(make("magic-word-v0")))  # the run's, as a rollout's would be
    prompt = tok.encode("Say the magic word.", add_special_tokens=False)
    answer = tok.encode(" assert", add_special_tokens=False) + [tok.eos_token_id]
    store = TrajectoryStore(tmp_path / "store")
    episodes = [  # (reward, status, env, task, extra, a token to tell it apart)
        (1.0, "completed", "magic-word-v0", "train-1", {}, 0),
        (1.0, "completed", "magic-word-v0", "train-2", {}, 1),
        (0.0, "completed", "magic-word-v0", "train-3", {}, 2),
        (1.0, "max_turns", "magic-word-v0", "train-4", {}, 3),
        (1.0, "completed", "magic-word-v0", "train-2", {}, 1),  # the same episode again
        (1.0, "completed", "other-v0", "train-5", {}, 4),
        (1.0, "completed", "magic-word-v0", "test-0", {}, 5),  # held out: env.eval_tasks=2 below
        (1.0, "completed", "magic-word-v0", "test-7", {}, 8),  # of the held-out split, past those 2
        (1.0, "completed", "magic-word-v0", "t-9", {"task_data": {"split": "test"}}, 6),
        (1.0, "completed", "magic-word-v0", "train-6", {"branch_of": "w0-00000:1"}, 7),
    ]
    for reward, status, env, task, extra, k in episodes:
        ids = prompt + [k + 5] + answer
        n = len(ids)
        spans = [TurnSpan(0, len(prompt) + 1, "prompt"), TurnSpan(len(prompt) + 1, n, "assistant")]
        mask = [0] * (len(prompt) + 1) + [1] * len(answer)
        t = Trajectory(ids, mask, [0.0] * n, spans, reward=reward, status=status, env_id=env, task_id=task)
        t.extra.update(extra)
        t.messages = [{"role": "assistant", "content": tok.decode(ids[len(prompt) + 1 : -1])}]
        store.append(t)
    # the same ids, written by another tokenizer: its turn read back here is not the text it was
    t.task_id, t.messages = "train-7", [{"role": "assistant", "content": "the magic word"}]
    del t.extra["branch_of"]
    store.append(t)
    store.close()
    recipe = tmp_path / "toy.yaml"
    recipe.write_text("run: {name: from-store, iterations: 1}\n")
    args = [
        "train",
        str(recipe),
        *TOY,
        f"run.output_dir={tmp_path}",
        "env.eval_tasks=2",
        "metrics.eval_every=0",
    ]
    assert main([*args, f"sft.from_store={tmp_path / 'store'}", "sft.epochs=1"]) == 0
    out = capsys.readouterr().out
    assert "warm start: 2 stored successes from" in out
    assert (
        "sft.from_store: left out 1 duplicates, 1 of another environment, 3 of held-out tasks, 1 replay "
        "branches, 1 made with another tokenizer" in out
    )
    assert main([*args, f"sft.from_store={tmp_path / 'nothing'}"]) == 2
    assert f"sft.from_store={tmp_path / 'nothing'} is not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([*args, "run.overwrite=true", f"sft.from_store={tmp_path / 'empty'}"]) == 2
    assert (
        "holds no completed, successful episode of magic-word-v0's train split to imitate"
        in capsys.readouterr().err
    )
