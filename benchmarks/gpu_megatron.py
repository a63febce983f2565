"""One PPO step of the Megatron backend beside the PyTorch backend's, on the same batch and model,
with the bf16 matmul peak measured in this run.

    .venv/bin/python benchmarks/gpu_megatron.py            # on a GPU: Qwen2-0.5B shape, 32 rows of 2k-8k
    .venv/bin/python benchmarks/gpu_megatron.py --small    # anywhere: a tiny model, a few short rows

Needs ``pip install agentrl[megatron]`` (megatron-core; on a GPU machine with Python 3.12 the
0.19 wheel). One process, TP=1: the Megatron backend runs megatron-core's local layer spec (no
Transformer Engine) with packed rows kept apart by THD ``cu_seqlens`` (each row's causal attention
on its own, no ``[T, T]`` mask), bf16 autocast over
fp32 weights, with megatron-core's distributed optimizer (``trainer.megatron.distributed_optimizer``,
as the recipe; one rank: its code path on CUDA, no sharding), then again with torch AdamW
(``--no-distributed-optimizer``: only the latter). The PyTorch backend runs its fastest packing (padded rows, or packed with
FlexAttention / flash-attn varlen). One step is what the trainer does with a batch: log-probs,
values, a critic and an actor update. Tokens/s counts the batch's tokens once per step; the
fraction of peak uses the FLOP count of ``gpu_train_step.py``. The backends are built one at a
time; each one's log-probs on the batch's first rows are compared with the PyTorch backend's (the
largest gap is printed).
"""

from __future__ import annotations

import argparse
import copy
import sys
import traceback
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
        default="none",
        choices=["none", "selective", "full"],
        help="the Megatron backend's activation recomputation (default none, as the PyTorch backend; "
        "each row's attention keeps no [heads, S, S] scores)",
    )
    parser.add_argument(
        "--no-distributed-optimizer",
        dest="distributed_optimizer",
        action="store_false",
        help="leave out the Megatron backend's run with megatron-core's distributed optimizer",
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    shape = SMALL if args.small else QWEN2_05B
    rows = args.rows or (4 if args.small else 32)
    low, high = (32, 128) if args.small else (2048, 8192)
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
    common = dict(minibatches=args.minibatches, micro_token_budget=budget, dtype=dtype)
    megatron = f"megatron (local spec, rows by cu_seqlens, recompute {args.recompute})"
    # the recipe's optimizer first: under a time limit the run without it is the one left out
    optimizers = [True, False] if args.distributed_optimizer else [False]
    builders = {"torch (padded)": lambda: TorchBackend(copy.deepcopy(policy), **common)}
    for sharded in optimizers:
        name = megatron + (", distributed optimizer" if sharded else "")
        builders[name] = lambda sharded=sharded: MegatronBackend(
            copy.deepcopy(policy), recompute=args.recompute, distributed_optimizer=sharded, **common
        )
    head = batch.rows(list(range(min(2, batch.size))))
    results, reference, failed = {}, None, []
    for name, build in builders.items():
        try:  # a Megatron run that fails is reported and the next one still runs
            backend = build()  # one at a time: each holds a policy, a critic and their Adam moments
            logps = backend.logprobs(head)
            if reference is None:
                reference = logps
            else:
                gap = float((logps - reference).abs().max())
                print(f"log-probs, {name} against torch, first rows: largest gap {gap:.2e}")
            seconds = timed(lambda b=backend: ppo_step(b, copy.copy(batch)), device, args.repeats)
        except Exception as e:
            if reference is None:
                raise
            failed.append(name)
            print(f"PPO step, {name}: failed: {type(e).__name__}: {e}")
            traceback.print_exc()
            continue
        finally:
            backend = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        results[name] = seconds
        print(
            f"PPO step, {name}: {seconds:.2f} s, {tokens / seconds:,.0f} tokens/s, {flops / seconds / peak:.3f} of peak"
        )
    plain = results.pop("torch (padded)")
    for name, seconds in results.items():
        print(f"{name} / torch tokens/s: {plain / seconds:.2f}x")
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
