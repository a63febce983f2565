"""The rollout side of a run, built from its config (``agentrl.config.TrainConfig``) the same way
for ``agentrl train``, ``agentrl rollout`` and ``agentrl eval``: the environment factory (with the run's
sandbox and turn limit), its task splits, the policy and tokenizer on ``run.device``, the agent
loop's settings."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from agentrl.config import ConfigError, TrainConfig, make_env
from agentrl.env import AgentEnv, Task, make
from agentrl.rollout.agent_loop import LoopConfig

EVAL_TASKS = 32  # held-out tasks when env.eval_tasks is not set (all, when the split holds fewer)


@dataclass
class Splits:
    """The run's tasks: the environment's training split (all of it, for demonstrations past the
    first ``n_train``) and its held-out tasks."""

    train: Sequence[Task]
    n_train: int
    held_out: list[Task]


def env_factory(cfg: TrainConfig) -> Callable[[], AgentEnv]:
    """A factory of the run's environment: ``env.args``, plus the run's sandbox choice and turn limit
    when the environment's factory takes ``sandbox`` / ``max_turns``. Checks everything once, here
    (an unknown id or argument, a setting given twice, no sandbox backend), before anything is built."""
    from agentrl.config import env_factory_params
    from agentrl.sandbox import NoSandboxError, resolve_kind, set_defaults

    if cfg.sandbox.docker.hosts:  # every Docker sandbox of the run spreads over these daemons
        set_defaults("docker", hosts=list(cfg.sandbox.docker.hosts))
    args = dict(cfg.env.args)
    for key, setting in (("sandbox", "sandbox.kind"), ("max_turns", "rollout.max_turns")):
        if key in args:
            raise ConfigError(
                f"env.args.{key}={args[key]!r}: the run sets it from {setting}; set that instead "
                f"(e.g. {setting}={args[key]}) and drop env.args.{key}"
            )
    takes = env_factory_params(cfg.env.id)  # an unknown id stops here
    if "sandbox" in takes:
        try:
            args["sandbox"] = resolve_kind(cfg.sandbox.kind)
        except NoSandboxError as e:
            raise ConfigError(str(e)) from None
    if "max_turns" in takes:
        args["max_turns"] = cfg.rollout.max_turns
    make_env(cfg.env.id, args, "env.args")  # an unknown or bad argument stops here
    return lambda: make(cfg.env.id, **args)


def splits(cfg: TrainConfig, env: AgentEnv) -> Splits:
    """The training and held-out tasks, with the counts checked against what the env's splits hold."""

    def split(name: str, key: str) -> Sequence[Task]:
        try:
            tasks = env.tasks(name)
            len(tasks)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"{key}={name!r}: environment {cfg.env.id} has no such split ({e})") from None
        return tasks

    train = split(cfg.env.train_split, "env.train_split")
    n_train = cfg.env.train_tasks or len(train)
    if n_train > len(train):
        raise ConfigError(
            f"env.train_tasks={n_train}, but the {cfg.env.train_split!r} split of {cfg.env.id} holds "
            f"{len(train)} tasks; set env.train_tasks <= {len(train)} (or leave it unset: all of them)"
        )
    n_eval = cfg.env.eval_tasks
    if n_eval == 0:
        return Splits(train, n_train, [])
    held = split(cfg.env.eval_split, "env.eval_split")
    if n_eval is None:
        n_eval = min(EVAL_TASKS, len(held))
    elif n_eval > len(held):
        raise ConfigError(
            f"env.eval_tasks={n_eval}, but the {cfg.env.eval_split!r} split of {cfg.env.id} holds "
            f"{len(held)} tasks; set env.eval_tasks <= {len(held)}"
        )
    return Splits(train, n_train, fetch(held, 0, n_eval, f"env.eval_tasks={n_eval}", cfg.env.eval_split, cfg))


def fetch(
    tasks: Sequence[Task], start: int, stop: int, setting: str, split: str, cfg: TrainConfig
) -> list[Task]:
    """``tasks[start:stop]``; an env that finds fewer tasks than it listed (and says how many) stops
    with a ``ConfigError`` naming ``setting``."""
    try:
        return list(tasks[start:stop])
    except (IndexError, ValueError) as e:
        raise ConfigError(f"{setting}: the {split!r} split of {cfg.env.id}: {e}") from None


def loop_config(cfg: TrainConfig, *, greedy: bool = False) -> LoopConfig:
    r = cfg.rollout
    return LoopConfig(
        max_turns=r.max_turns,
        max_context=r.max_context,
        max_new_tokens=r.max_new_tokens,
        temperature=0.0 if greedy else r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        tool_format=r.tool_format,
        deadline_s=r.deadline_s,
        seed=None if greedy else cfg.run.seed,
    )


def load_policy(cfg: TrainConfig, env: AgentEnv | None = None):
    """``(policy, tokenizer)`` of ``model.name`` (the tiny model's tokenizer trained on ``env``'s
    corpus), with ``model.init``'s weights when set, on ``run.device``."""
    from agentrl.device import resolve_device
    from agentrl.models import (
        LOAD_ERRORS,
        checkpoint_policy,
        env_corpus,
        load_error,
        load_model,
        tiny_chat_model,
    )

    device = resolve_device(cfg.run.device)  # cuda where there is none stops here, before loading

    corpus = env_corpus(env) if env is not None else None
    if cfg.model.name == "tiny":
        policy, tokenizer = tiny_chat_model(
            seed=cfg.run.seed, hidden=cfg.model.tiny_hidden, layers=cfg.model.tiny_layers, corpus=corpus
        )
    else:
        try:
            policy, tokenizer = load_model(cfg.model.name, corpus=corpus)
        except (ImportError, OSError, ValueError) as e:
            raise ConfigError(f"model.name={cfg.model.name}: {e}") from None
    if cfg.model.init:
        try:
            if Path(cfg.model.init).is_dir():  # a run's checkpoint directory: the actor's weights in it
                state = checkpoint_policy(cfg.model.init)
            else:
                state = torch.load(cfg.model.init, map_location="cpu", weights_only=True)
            policy.load_state_dict(state)
        except LOAD_ERRORS as e:
            raise ConfigError(
                f"model.init: cannot load {cfg.model.init} into the {cfg.model.name} model: {load_error(e)}"
            ) from None
    return policy.to(device), tokenizer


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rollout_pool(cfg: TrainConfig, make_env: Callable[[], AgentEnv], engine, tokenizer, store=None):
    """The pool that collects a run's episodes (``rollout`` settings, ``metrics.progress``), for
    ``agentrl train`` and ``agentrl rollout`` alike."""
    from agentrl.rollout.pool import RolloutPool

    return RolloutPool(
        make_env,
        engine,
        tokenizer,
        loop_config(cfg),
        store=store,
        concurrency=cfg.rollout.concurrency,
        n_samples=cfg.rollout.n_samples,
        progress=cfg.metrics.progress,
    )
