"""Does the value model learn from a run's stored episodes? A diagnostic for the critic, offline.

    .venv/bin/python benchmarks/critic_fit.py runs/quickstart [--lr 3e-3 1e-3] [--epochs 8] [--train 256]

Builds the run's policy from its ``warm_start.pt``, makes a fresh value model from it (as the
trainer does), trains it on the first ``--train`` stored episodes (Monte Carlo returns, as GAE
with gamma = lambda = 1 gives) and, after each epoch, prints the explained variance of the
returns of the remaining episodes (never trained on) and the mean value on tokens after a tool
error (an episode that has seen one never succeeded in bugfix-v0 runs so far) against the mean
elsewhere: a critic that carries information tells the two apart. One row per learning rate, all
in the same run, so the rates compare against each other.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from agentrl.algo import explained_variance
from agentrl.config import AlgoConfig, TrainConfig
from agentrl.rollout.from_config import env_factory, load_policy
from agentrl.store import TrajectoryStore
from agentrl.trainer.backend import Batch, LossConfig
from agentrl.trainer.phases import advantages
from agentrl.trainer.torch_backend import TorchBackend


def prepared(trajectories) -> Batch:
    """The episodes as a batch with the trainer's returns for gamma = lambda = 1 (values at 0)."""
    batch = Batch.from_trajectories(trajectories)
    batch.old_values = torch.zeros(batch.input_ids.shape)
    algo = AlgoConfig(estimator="gae", gamma=1.0, lam=1.0, normalize_advantages=False)
    batch.advantages, batch.returns, _ = advantages(batch, algo)
    return batch


def after_tool_error(trajectories, batch: Batch) -> torch.Tensor:
    """Trainable tokens that come after the first tool observation reporting an error."""
    out = torch.zeros(batch.input_ids.shape, dtype=torch.bool)
    for k, t in enumerate(trajectories):
        tool_turns = [span for span in t.turns if span.role == "tool"]
        for call, span in zip(t.tool_calls, tool_turns, strict=False):
            if call.get("error") or (call.get("output") or "").startswith("error"):
                out[k, span.end :] = True
                break
    return out & batch.loss_mask


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--lr", type=float, nargs="+", default=[3e-3, 1e-3])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--minibatches", type=int, default=4)
    parser.add_argument("--train", type=int, default=256)
    args = parser.parse_args()
    run = args.run_dir
    for needed in ("config.json", "warm_start.pt", "trajectories"):
        if not (run / needed).exists():
            print(f"error: {run / needed} is missing; give the directory of a run that had a warm start")
            return 2
    cfg = TrainConfig.model_validate(json.loads((run / "config.json").read_text()))
    cfg.model.init = str(run / "warm_start.pt")  # the run's policy, built as the trainer builds it
    trajectories = list(TrajectoryStore(run / "trajectories").read())
    if len(trajectories) <= args.train:
        print(f"error: {len(trajectories)} stored episodes; --train {args.train} leaves none to test on")
        return 2
    train, test = prepared(trajectories[: args.train]), prepared(trajectories[args.train :])
    errors = after_tool_error(trajectories[args.train :], test)
    print(
        f"{run}: train on {train.size} episodes, test on {test.size} "
        f"({int(test.loss_mask.sum())} tokens, {int(errors.sum())} after a tool error, "
        f"mean return there {float(test.returns[errors].mean()) if errors.any() else float('nan'):.3f})"
    )
    for lr in args.lr:
        torch.manual_seed(0)
        policy, _ = load_policy(cfg, env_factory(cfg)())
        backend = TorchBackend(
            policy, critic_lr=lr, epochs=1, minibatches=args.minibatches, seed=cfg.run.seed
        )
        print(f"\ncritic lr {lr:g}, {args.minibatches} steps per epoch")
        print("| epoch | test explained variance | V after a tool error | V elsewhere |")
        print("|---|---|---|---|")
        for epoch in range(args.epochs):
            backend.train_critic(train, LossConfig(value_clip=None))
            values = backend.values(test)
            ev = explained_variance(values, test.returns, test.loss_mask)
            rest = test.loss_mask & ~errors
            print(
                f"| {epoch + 1} | {ev:.3f} | {float(values[errors].mean()) if errors.any() else float('nan'):.3f} "
                f"| {float(values[rest].mean()):.3f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
