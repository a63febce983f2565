"""One PPO step of the PyTorch backend on a GPU, padded against packed rows, each against a plain
forward + backward of the same model on the same tokens and the bf16 matmul peak, all measured in
this run.

    .venv/bin/python benchmarks/gpu_train_step.py            # on a GPU: Qwen2-0.5B shape, 32 rows of 2k-8k
    .venv/bin/python benchmarks/gpu_train_step.py --small    # anywhere: a tiny model, a few short rows

The policy (and its critic, a copy) has the Qwen2-0.5B shape with random weights, trained under
bf16 autocast. One step is what the trainer does with a batch: recompute log-probs and values,
train the critic and the actor (``--epochs`` each, ``--minibatches`` per epoch). Tokens/s counts
the batch's tokens once per step. A step's model FLOPs are 2·N·tokens per forward pass and
4·N·tokens per backward pass (N the parameters without the embedding), plus attention's
(4·layers·hidden·Σlen² per forward, twice that backward, halved for causality); their rate over
the matmul peak measured here is the step's fraction of peak. The plain step is one forward and
backward of the policy with SDPA's causal kernel on rows padded to the longest, no PPO.

Goals on an H200 (the seams issue): packed ≥ 2× the padded tokens/s measured before it (11.7k),
and the PPO step's fraction of peak ≥ 0.85× the plain step's. On a GPU the script also checks
that the packed path's gradients (FlexAttention, or flash-attn's varlen kernel) match the dense
mask's on a few rows before timing anything, and times the LM head alone with fp32 and with
TF32 products (the PPO step's head keeps fp32 logits; in bf16 on CUDA it forms them with TF32).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from agentrl.algo import token_logprobs
from agentrl.trainer.backend import Batch, LossConfig
from agentrl.trainer.torch_backend import TorchBackend, resolve_attention
from agentrl.trainer.updates import bucket
from agentrl.trajectory import Trajectory, TurnSpan

QWEN2_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151_936,
    max_position_embeddings=32_768,
    tie_word_embeddings=True,
)
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def make_policy(shape: dict, device: torch.device, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**shape, attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).to(device)


def make_batch(rows: int, low: int, high: int, vocab: int, seed: int = 0) -> Batch:
    """Agent-like rows: a prompt, then assistant turns (trained on) and tool results, alternating."""
    g = torch.Generator().manual_seed(seed)
    trajectories = []
    for _ in range(rows):
        n = int(torch.randint(low, high + 1, (1,), generator=g))
        prompt = n // 4
        spans, mask, at = [TurnSpan(0, prompt, "prompt")], [0] * prompt, prompt
        turn = max(1, (n - prompt) // 6)
        k = 0
        while at < n:
            size = min(turn, n - at)
            kind = "assistant" if k % 2 == 0 else "tool"
            spans.append(TurnSpan(at, at + size, kind))
            mask += [int(kind == "assistant")] * size
            at, k = at + size, k + 1
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        trajectories.append(
            Trajectory(ids, mask, [(-0.7 if m else 0.0) for m in mask], spans, reward=float(k % 2))
        )
    batch = Batch.from_trajectories(trajectories)
    batch.advantages = torch.where(batch.loss_mask, torch.randn(batch.input_ids.shape, generator=g), 0.0)
    batch.returns = torch.where(batch.loss_mask, batch.rewards[:, None].expand_as(batch.loss_mask), 0.0)
    return batch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_peak(device: torch.device, small: bool) -> float:
    """FLOP/s of a large bf16 matmul (fp32 on the CPU), the best of a few."""
    n = 512 if small else 8192
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        sync(device)
        best = min(best, (time.perf_counter() - t) / 10)
    return 2 * n**3 / best


def step_flops(policy, batch: Batch, forwards: int, backwards: int) -> float:
    config = policy.config
    params = sum(p.numel() for name, p in policy.named_parameters() if "embed_tokens" not in name)
    tokens = int(batch.lengths.sum())
    squares = float((batch.lengths.double() ** 2).sum())
    attention = 4 * config.num_hidden_layers * config.hidden_size * squares / 2  # causal: half
    forward = 2 * params * tokens + attention
    return forwards * forward + backwards * 2 * forward


def ppo_step(backend: TorchBackend, batch: Batch) -> None:
    batch.old_logprobs = backend.logprobs(batch)
    batch.old_values = backend.values(batch)
    backend.train_critic(batch, LossConfig(value_clip=None))
    backend.train_actor(batch, LossConfig())


def plain_step(policy, batch: Batch, device: torch.device, budget: int) -> None:
    """One forward and backward of the policy over the batch's rows with SDPA's causal kernel, in
    groups of similar length of at most ``budget`` tokens, each padded to its longest row (the
    whole batch padded at once would hold [rows, longest, vocab] logits)."""
    lengths = batch.lengths.tolist()
    for rows in bucket(lengths, list(range(batch.size)), budget):
        width = max(lengths[r] for r in rows)
        ids = batch.input_ids[rows, :width].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = policy(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="mean"
            )
        loss.backward()
        del logits, loss
    policy.zero_grad(set_to_none=True)


def head_precision(policy, device: torch.device, tokens: int, repeats: int) -> dict:
    """The LM head alone, as the trainer runs it (``token_logprobs`` forward and backward over
    ``tokens`` hidden states), with full fp32 products and with TF32 ones (what a bf16 run on CUDA
    uses): the best seconds of each and the largest log-prob gap between them. Hidden states are
    scaled so that the logits spread like a trained model's (std about 4), not a random one's."""
    weight = policy.get_output_embeddings().weight.detach().float()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, weight.shape[1], generator=g).to(device)
    hidden *= 4.0 / float((hidden[:256] @ weight.t()).std())
    targets = torch.randint(0, weight.shape[0], (tokens,), generator=g).to(device)
    out = {}
    for tf32 in (False, True):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)

        def once(h=h, w=w, tf32=tf32):
            token_logprobs(h, w, targets, tf32=tf32).sum().backward()

        seconds = timed(once, device, repeats)
        with torch.no_grad():
            out[tf32] = (seconds, token_logprobs(hidden, weight, targets, tf32=tf32))
    gap = float((out[True][1] - out[False][1]).abs().max())
    return {"fp32_s": out[False][0], "tf32_s": out[True][0], "gap": gap}


def timed(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up (compilation, allocator)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def check_packed_gradients(policy, batch: Batch, device: torch.device, attention: str) -> float:
    """Largest relative gap between the packed path's actor gradients and the dense mask's."""
    grads = {}
    small = batch.rows(list(range(min(4, batch.size))))
    for kind in ("dense", attention):
        backend = TorchBackend(
            copy.deepcopy(policy), packing="packed", attention=kind, dtype="bfloat16", critic=False
        )
        small.old_logprobs = backend.logprobs(small)
        backend.actor_opt.step = lambda *a, **k: None  # keep the gradients, skip the update
        backend.train_actor(small, LossConfig())
        grads[kind] = torch.cat(
            [p.grad.float().flatten() for p in backend.policy.parameters() if p.grad is not None]
        )
    return float((grads[attention] - grads["dense"]).norm() / grads["dense"].norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a tiny model and short rows (CPU smoke run)")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--minibatches", type=int, default=4)
    parser.add_argument("--budget", type=int, default=None, help="tokens per micro-batch")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    shape = SMALL if args.small else QWEN2_05B
    rows = args.rows or (4 if args.small else 32)
    low, high = (32, 128) if args.small else (2048, 8192)
    budget = args.budget or (512 if args.small else 16_384)
    batch = make_batch(rows, low, high, shape["vocab_size"])
    tokens = int(batch.lengths.sum())
    peak = matmul_peak(device, args.small)
    print(
        f"device {device}; {rows} rows, {tokens} tokens ({low}-{high} each); matmul peak {peak / 1e12:.3g} TFLOP/s"
    )
    policy = make_policy(shape, device)
    attention = resolve_attention("auto", device, "bfloat16" if device.type == "cuda" else "float32")
    if device.type == "cuda":
        gap = check_packed_gradients(policy, batch, device, attention)
        print(f"packed ({attention}) actor gradients against the dense mask's: relative gap {gap:.2e}")
    head = head_precision(policy, device, min(budget, 8192), args.repeats)
    print(
        f"LM head, {min(budget, 8192)} tokens forward + backward: fp32 {head['fp32_s']:.3f} s, "
        f"TF32 {head['tf32_s']:.3f} s ({head['fp32_s'] / head['tf32_s']:.2f}x); "
        f"largest log-prob gap {head['gap']:.1e}"
    )
    passes = 2 + 2 * args.epochs  # log-probs, values; then critic and actor: forward + backward each
    flops = step_flops(policy, batch, forwards=passes, backwards=2 * args.epochs)
    results = {}
    for packing in ("padded", "packed"):
        backend = TorchBackend(
            copy.deepcopy(policy),
            epochs=args.epochs,
            minibatches=args.minibatches,
            micro_token_budget=budget,
            packing=packing,
            dtype="bfloat16" if device.type == "cuda" else "float32",
        )
        seconds = timed(lambda b=backend: ppo_step(b, batch), device, args.repeats)
        results[packing] = seconds
        what = f"packed ({backend.attention})" if packing == "packed" else "padded"
        print(
            f"PPO step, {what}: {seconds:.2f} s, {tokens / seconds:,.0f} tokens/s, "
            f"{flops / seconds / peak:.3f} of peak"
        )
        del backend
    plain_flops = step_flops(policy, batch, forwards=1, backwards=1)
    plain = timed(lambda: plain_step(policy, batch, device, budget), device, args.repeats)
    print(
        f"plain forward + backward (SDPA causal, padded): {plain:.2f} s, {plain_flops / plain / peak:.3f} of peak"
    )
    best = min(results.values())
    ppo_fraction, plain_fraction = flops / best / peak, plain_flops / plain / peak
    print(f"packed / padded tokens/s: {results['padded'] / results['packed']:.2f}x")
    print(f"PPO step's fraction of peak / the plain step's: {ppo_fraction / plain_fraction:.2f}x")


if __name__ == "__main__":
    main()
