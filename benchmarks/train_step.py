"""Speed of one PPO training step of the PyTorch backend, padded rows without a padding mask
against the same rows with a dense padding mask (the baseline), both run here.

    .venv/bin/python benchmarks/train_step.py [--rows 64] [--hidden 128] [--layers 3] [--repeats 3]

The batch is shaped like a quickstart iteration: 64 episodes of 420-727 tokens, a quarter of them
trainable. One step is what the trainer does with a batch: recompute log-probs and values, train
the critic (4 epochs) and the actor (2 epochs), 4 minibatches each. Right-padded rows under causal
attention need no mask (a real token sees only real tokens before it); SDPA then runs its causal
kernel. The two must agree on every real token's log-prob; the script checks that first.
Goal: faster than the baseline (ratio > 1).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import agentrl.trainer.torch_backend as tb
from agentrl.models import tiny_chat_model
from agentrl.trainer.backend import Batch, LossConfig
from agentrl.trajectory import Trajectory, TurnSpan

UNMASKED = tb._padded_inputs


def masked_padded_inputs(batch: Batch, rows: list[int], device) -> dict[str, torch.Tensor]:
    """The baseline: the backend's right-padded rows, plus a ``[rows, width]`` padding mask."""
    kwargs = UNMASKED(batch, rows, device)
    width = kwargs["input_ids"].shape[1]
    attention = torch.arange(width)[None, :] < batch.lengths[rows][:, None]
    return kwargs | {"attention_mask": attention.long().to(device)}


def quickstart_batch(rows: int, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    trajectories = []
    for _ in range(rows):
        n = int(torch.randint(420, 728, (1,), generator=g))
        prompt = int(n * 0.55)  # prompt and the viewed file, then three assistant turns and two results
        spans, mask, at = [TurnSpan(0, prompt, "prompt")], [0] * prompt, prompt
        rest = n - prompt
        for k, share in enumerate((0.15, 0.2, 0.25, 0.2, 0.2)):
            size = rest - (at - prompt) if k == 4 else int(rest * share)
            kind = "assistant" if k % 2 == 0 else "tool"
            spans.append(TurnSpan(at, at + size, kind))
            mask += [int(kind == "assistant")] * size
            at += size
        ids = torch.randint(3, 700, (n,), generator=g).tolist()
        logps = [(-0.5 if m else 0.0) for m in mask]
        reward = float(torch.rand((), generator=g) < 0.5)
        trajectories.append(Trajectory(ids, mask, logps, spans, reward=reward))
    batch = Batch.from_trajectories(trajectories)
    batch.advantages = torch.where(batch.loss_mask, torch.randn(batch.input_ids.shape, generator=g), 0.0)
    batch.returns = torch.where(batch.loss_mask, batch.rewards[:, None].expand_as(batch.loss_mask), 0.0)
    return batch


def step(backend: tb.TorchBackend, batch: Batch) -> float:
    start = time.perf_counter()
    batch.old_logprobs = backend.logprobs(batch, 0.5)
    batch.old_values = backend.values(batch)
    backend.train_critic(batch, LossConfig(temperature=0.5))
    backend.train_actor(batch, LossConfig(temperature=0.5))
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    batch = quickstart_batch(args.rows)
    unmasked = UNMASKED

    def backend() -> tb.TorchBackend:
        model, _ = tiny_chat_model(seed=0, hidden=args.hidden, layers=args.layers)
        return tb.TorchBackend(
            model,
            actor_lr=1e-4,
            critic_lr=1e-3,
            epochs=2,
            critic_epochs=4,
            minibatches=4,
            micro_token_budget=4096,
        )

    # the same log-probs on every real token, with and without the mask
    tb._padded_inputs = masked_padded_inputs
    want = backend().logprobs(batch, 0.5)
    tb._padded_inputs = unmasked
    got = backend().logprobs(batch, 0.5)
    diff = float((got - want).abs().max())
    print(f"largest log-prob difference, no mask vs mask: {diff:.2e}")
    if diff > 1e-4:
        print("FAILED: the unmasked rows do not give the masked rows' log-probs")
        return 1
    times: dict[str, list[float]] = {"mask": [], "no mask": []}
    for _ in range(args.repeats):  # interleaved, so that a slow stretch of the machine hits both
        for name, fn in (("mask", masked_padded_inputs), ("no mask", unmasked)):
            tb._padded_inputs = fn
            times[name].append(step(backend(), batch))
    tb._padded_inputs = unmasked
    base, new = (statistics.median(times[k]) for k in ("mask", "no mask"))
    tokens = int(batch.lengths.sum())
    print(f"{args.rows} rows, {tokens} tokens, tiny model hidden {args.hidden} x {args.layers} layers")
    print(f"one training step, median of {args.repeats}: mask {base:.2f} s, no mask {new:.2f} s")
    print(f"speed-up: {base / new:.2f}x (goal > 1)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
