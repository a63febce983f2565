"""One PPO step of the Megatron backend beside the PyTorch backend's, on the same batch and model,
with the bf16 matmul peak measured in this run.

    .venv/bin/python benchmarks/gpu_megatron.py            # on a GPU: Qwen2-0.5B shape, 32 rows of 2k-8k
    .venv/bin/python benchmarks/gpu_megatron.py --small    # anywhere: a tiny model, a few short rows

Needs ``pip install agentrl[megatron]`` (megatron-core; on a GPU machine with Python 3.12 the
0.19 wheel). One process, TP=1: the Megatron backend runs megatron-core's local layer spec (no
Transformer Engine) with packed rows under an explicit block-diagonal mask, bf16 autocast over
fp32 weights, torch AdamW. The PyTorch backend runs its fastest packing (padded rows, or packed
with FlexAttention / flash-attn varlen). One step is what the trainer does with a batch: log-probs,
values, a critic and an actor update. Tokens/s counts the batch's tokens once per step; the
fraction of peak uses the FLOP count of ``gpu_train_step.py``. Before timing, the script checks that
the two backends' log-probs agree on the batch's first rows (the largest gap is printed).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_train_step import QWEN2_05B, SMALL, make_batch, make_policy, matmul_peak, ppo_step, step_flops, timed

from agentrl.trainer.megatron_backend import MegatronBackend
from agentrl.trainer.torch_backend import TorchBackend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a tiny model and short rows (CPU smoke run)")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--minibatches", type=int, default=4)
    parser.add_argument("--budget", type=int, default=None, help="tokens per micro-batch")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--recompute",
        default="selective",
        choices=["none", "selective", "full"],
        help="the Megatron backend's activation recomputation (default selective: without it the local "
        "spec keeps every layer's [heads, S, S] attention scores, about 5.6 GB a layer at S = 8192)",
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    shape = SMALL if args.small else QWEN2_05B
    rows = args.rows or (4 if args.small else 32)
    low, high = (32, 128) if args.small else (2048, 8192)
    # the dense mask and the local spec's [heads, S, S] scores grow with the pack's square
    budget = args.budget or (512 if args.small else 8192)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    batch = make_batch(rows, low, high, shape["vocab_size"])
    tokens = int(batch.lengths.sum())
    peak = matmul_peak(device, args.small)
    print(
        f"device {device}; {rows} rows, {tokens} tokens ({low}-{high} each); matmul peak {peak / 1e12:.3g} TFLOP/s"
    )
    policy = make_policy(shape, device)
    flops = step_flops(policy, batch, forwards=4, backwards=2)
    common = dict(minibatches=args.minibatches, micro_token_budget=budget)
    backends = {
        f"megatron (local spec, dense mask, recompute {args.recompute})": MegatronBackend(
            copy.deepcopy(policy), dtype=dtype, recompute=args.recompute, **common
        ),
        "torch (padded)": TorchBackend(copy.deepcopy(policy), dtype=dtype, **common),
    }
    head = batch.rows(list(range(min(2, batch.size))))
    logps = [b.logprobs(head) for b in backends.values()]
    print(
        f"log-probs, megatron against torch, first rows: largest gap {float((logps[0] - logps[1]).abs().max()):.2e}"
    )
    results = {}
    for name, backend in backends.items():
        seconds = timed(lambda b=backend: ppo_step(b, copy.copy(batch)), device, args.repeats)
        results[name] = seconds
        print(
            f"PPO step, {name}: {seconds:.2f} s, {tokens / seconds:,.0f} tokens/s, {flops / seconds / peak:.3f} of peak"
        )
    mega, plain = results.values()
    print(f"megatron / torch tokens/s: {plain / mega:.2f}x")


if __name__ == "__main__":
    main()
