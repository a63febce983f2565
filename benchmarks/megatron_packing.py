"""The Megatron backend's PPO step with packed rows kept apart by THD ``cu_seqlens`` (each row's
causal attention on its own) against the block-diagonal mask over the whole pack, same batch.

    .venv/bin/python benchmarks/megatron_packing.py [--rows 8] [--low 512] [--high 2048] [--repeats 2]

One process, fp32, TP=1, a tiny Qwen2-shaped model (``gpu_train_step.SMALL``) whose cost is
mostly attention, agent-like rows of ``low``-``high`` tokens packed into micro-batches of
``--budget`` tokens. Prints each path's best step time, the bytes one forward pass over the batch
keeps for its backward pass, the largest log-prob gap between the two, and the ratios.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_train_step import SMALL, make_batch, make_policy, ppo_step, timed

from agentrl.trainer.megatron_backend import MegatronBackend


def saved_bytes(backend: MegatronBackend, batch) -> int:
    """Bytes the policy's forward pass over every micro-batch keeps for its backward pass."""
    total = 0

    def keep(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    from agentrl.trainer.updates import pack

    for rows in pack(batch.lengths.tolist(), list(range(batch.size)), backend.budget):
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            backend._hidden(backend.policy, batch, rows)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--low", type=int, default=512)
    parser.add_argument("--high", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=4096, help="tokens per micro-batch")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    device = torch.device("cpu")
    batch = make_batch(args.rows, args.low, args.high, SMALL["vocab_size"])
    policy = make_policy(SMALL, device)
    print(
        f"{args.rows} rows, {int(batch.lengths.sum())} tokens ({args.low}-{args.high} each), "
        f"micro-batches of <= {args.budget} tokens; {torch.get_num_threads()} threads"
    )
    seconds, kept, logps = {}, {}, {}
    for attention in ("mask", "rows"):
        backend = MegatronBackend(
            copy.deepcopy(policy), micro_token_budget=args.budget, minibatches=2, attention=attention
        )
        logps[attention] = backend.logprobs(batch)
        kept[attention] = saved_bytes(backend, batch)
        seconds[attention] = timed(lambda b=backend: ppo_step(b, copy.copy(batch)), device, args.repeats)
        print(
            f"{attention:>4}: PPO step {seconds[attention]:.2f} s, "
            f"forward keeps {kept[attention] / 2**20:.1f} MiB for the backward pass"
        )
    print(
        f"largest log-prob gap, rows against mask: {float((logps['rows'] - logps['mask']).abs().max()):.2e}"
    )
    print(
        f"rows / mask: step time {seconds['rows'] / seconds['mask']:.2f}x, kept bytes {kept['rows'] / kept['mask']:.2f}x"
    )


if __name__ == "__main__":
    main()
