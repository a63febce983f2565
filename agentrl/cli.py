"""The ``agentrl`` command."""

from __future__ import annotations

import argparse
import sys

import agentrl


def _quickstart(args: argparse.Namespace) -> int:
    from agentrl import toy

    print(
        "agentrl quickstart: the PPO trainer on bugfix-v0 does not exist yet, so this runs the most\n"
        "end-to-end path that does: PPO + critic + GAE over trainable tokens + IcePop (no KL) on a toy\n"
        "two-turn token task with a tool observation between the turns (agentrl/toy.py), on the CPU."
    )
    result = toy.run(toy.ToyConfig(iterations=args.iterations, seed=args.seed))
    print(
        f"done: greedy score {result['greedy_score_before']:.3f} -> {result['greedy_score_after']:.3f} "
        f"(fraction of answer tokens right) in {result['train_seconds']:.1f}s"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentrl", description="Reinforcement learning for tool-using coding agents."
    )
    parser.add_argument("--version", action="version", version=f"agentrl {agentrl.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    quick = commands.add_parser("quickstart", help="run the main job on this machine")
    quick.add_argument("--iterations", type=int, default=60, help="training iterations (default 60)")
    quick.add_argument("--seed", type=int, default=0)
    quick.set_defaults(func=_quickstart)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
