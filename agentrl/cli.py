"""The ``agentrl`` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import agentrl


def _quickstart(args: argparse.Namespace) -> int:
    from agentrl.config import ConfigError, TrainConfig, load_config
    from agentrl.envs.bugfix import docker_ready
    from agentrl.trainer.ppo import main

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"
    if not recipe.exists():
        print(
            f"error: {recipe} not found: run the quickstart from a clone of the repository", file=sys.stderr
        )
        return 2
    sandbox = "docker" if docker_ready() else "local"
    overrides = [f"env.args.sandbox={sandbox}", f"run.seed={args.seed}", *args.overrides]
    if args.iterations is not None:
        overrides.append(f"run.iterations={args.iterations}")
    print(
        "agentrl quickstart: a tiny policy is trained to fix one-function bugs in bugfix-v0 on this CPU\n"
        f"  sandbox: {sandbox}; recipe: recipes/quickstart.yaml\n"
        "  1. warm start: supervised on the scripted expert's episodes (played through the real loop)\n"
        "  2. held-out success of the greedy policy\n"
        "  3. PPO + critic (GAE over the policy's tokens) + IcePop, no KL, on sampled episodes\n"
        "  4. held-out success again; metrics.jsonl and curve.png in runs/quickstart/",
        flush=True,
    )
    try:
        summary = main(load_config(TrainConfig, str(recipe), overrides))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gain = summary["eval_after"] - summary["eval_before"]
    print(
        f"done: held-out success {summary['eval_before']:.3f} -> {summary['eval_after']:.3f} ({gain:+.3f}) "
        f"in {summary['seconds'] / 60:.1f} min; {summary['run_dir']}/curve.png"
    )
    if "eval_after_sampled" in summary:
        before, after = summary["eval_before_sampled"], summary["eval_after_sampled"]
        print(f"      sampled held-out success {before:.3f} -> {after:.3f} ({after - before:+.3f})")
    return 0


def _sandbox_build(args: argparse.Namespace) -> int:
    from agentrl.sandboxes.images import BASE_IMAGE, ImageBuildError, build_base_image

    try:
        build_base_image(args.tag or BASE_IMAGE, force=args.force)
    except ImageBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _sandbox_gc(args: argparse.Namespace) -> int:
    from agentrl.sandbox import SandboxError
    from agentrl.sandboxes.docker import gc

    try:
        removed = gc(everything=args.all, run=args.run)
    except SandboxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for short_id, reason in removed:
        print(f"removed {short_id} ({reason})")
    print(f"{len(removed)} sandbox container(s) removed")
    return 0


def _sandbox_doctor(args: argparse.Namespace) -> int:
    from agentrl.sandboxes.docker import doctor
    from agentrl.sandboxes.local import bwrap_works

    checks = doctor()
    ok, detail = bwrap_works()
    checks.append(("bubblewrap (local backend)", ok, detail if not ok else f"works ({detail})"))
    checks.append(("local backend", True, "always available (isolation 'bwrap' when it works, else 'none')"))
    for name, good, text in checks:
        print(f"[{'ok' if good else '--'}] {name}: {text}")
    docker_ok = all(good for name, good, _ in checks if name.startswith(("docker", "image")))
    print(f"docker backend: {'usable' if docker_ok else 'not usable here'}; local backend: usable")
    return 0


def _envs_list(args: argparse.Namespace) -> int:
    from agentrl.env import list_envs, spec

    for env_id in list_envs():
        s = spec(env_id)
        defaults = f"  defaults {s.defaults}" if s.defaults else ""
        print(f"{env_id}  {s.entry_point}{defaults}")
    return 0


def _envs_check(args: argparse.Namespace) -> int:
    from agentrl.env import EnvCheckError, check_env, make

    overrides = {"sandbox": args.sandbox} if args.sandbox else {}
    try:
        env = make(args.id, **overrides)
    except KeyError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    task = env.task("train", 0) if hasattr(env, "task") else None
    if task is None:
        print(f"error: {args.id} has no task(split, index) method to draw a task from", file=sys.stderr)
        return 2
    try:
        passed = check_env(env, task)
    except EnvCheckError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    for line in passed:
        print(f"ok  {line}")
    print(f"{args.id}: all checks passed")
    return 0


def _rollout(args: argparse.Namespace) -> int:
    from agentrl.rollout.run import ConfigError, main

    try:
        main(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _train(args: argparse.Namespace) -> int:
    from agentrl.config import ConfigError, TrainConfig, load_config
    from agentrl.trainer.ppo import main

    try:
        cfg = load_config(TrainConfig, args.config, args.overrides)
        main(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _eval(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from agentrl.config import ConfigError, TrainConfig, load_config
    from agentrl.trainer.setup import evaluate_weights

    try:
        cfg = load_config(TrainConfig, args.config, args.overrides)
        result = asyncio.run(evaluate_weights(cfg))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"model.init": cfg.model.init, **result}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentrl", description="Reinforcement learning for tool-using coding agents."
    )
    parser.add_argument("--version", action="version", version=f"agentrl {agentrl.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    quick = commands.add_parser("quickstart", help="run the main job on this machine")
    quick.add_argument("--iterations", type=int, default=None, help="PPO iterations (default: the recipe's)")
    quick.add_argument("--seed", type=int, default=0)
    quick.add_argument("overrides", nargs="*", help="key.sub=value overrides of recipes/quickstart.yaml")
    quick.set_defaults(func=_quickstart)

    sandbox = commands.add_parser("sandbox", help="sandbox images, cleanup and checks")
    sandbox_commands = sandbox.add_subparsers(dest="sandbox_command", metavar="ACTION", required=True)
    build = sandbox_commands.add_parser(
        "build", help="build the base image offline (debootstrap + docker import)"
    )
    build.add_argument("--tag", default=None, help="image tag (default agentrl/base:bookworm)")
    build.add_argument("--force", action="store_true", help="rebuild even when present")
    build.set_defaults(func=_sandbox_build)
    gc = sandbox_commands.add_parser("gc", help="remove sandbox containers whose creating process is gone")
    gc.add_argument("--all", action="store_true", help="remove every agentrl sandbox container")
    gc.add_argument("--run", default=None, help="remove every container of this run id")
    gc.set_defaults(func=_sandbox_gc)
    doc = sandbox_commands.add_parser(
        "doctor", help="which sandbox backends work here, and how to fix those that do not"
    )
    doc.set_defaults(func=_sandbox_doctor)

    envs = commands.add_parser("envs", help="list registered environments, or check one")
    envs.set_defaults(func=_envs_list)
    envs_commands = envs.add_subparsers(dest="envs_command", metavar="ACTION")
    check = envs_commands.add_parser("check", help="run the conformance checker on an environment")
    check.add_argument("id", help="environment id, e.g. bugfix-v0")
    check.add_argument("--sandbox", choices=["docker", "local"], default=None, help="sandbox backend to use")
    check.set_defaults(func=_envs_check)

    rollout = commands.add_parser("rollout", help="collect trajectories into a store, without training")
    rollout.add_argument("config", help="YAML file (e.g. recipes/rollout_bugfix_tiny.yaml)")
    rollout.add_argument("overrides", nargs="*", help="key=value or loop.key=value overrides")
    rollout.set_defaults(func=_rollout)

    train = commands.add_parser("train", help="train with PPO (or GRPO, ...) from a recipe")
    train.add_argument("config", help="YAML recipe (e.g. recipes/quickstart.yaml)")
    train.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. run.resume=true")
    train.set_defaults(func=_train)

    evaluate = commands.add_parser(
        "eval", help="held-out success of saved weights (model.init=FILE or a checkpoint directory)"
    )
    evaluate.add_argument("config", help="YAML recipe the weights were trained with")
    evaluate.add_argument(
        "overrides", nargs="*", help="key.sub=value overrides, e.g. model.init=... metrics.eval_samples=4"
    )
    evaluate.set_defaults(func=_eval)
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
