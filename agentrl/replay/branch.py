"""A stored episode re-run by the policy from one of its turns (``agentrl replay RUN --id ID
--from-turn N``): what would the policy do there now, or with other weights or sampling?

The episode is played again through the real agent loop in a fresh environment of the run: its
first N − 1 assistant turns are the recorded tokens (``PrefixEngine`` answers them with the
recorded ids and log-probs, and the env runs their tool calls again), and from turn N on the
policy generates. Every prompt the loop builds before turn N must equal the recorded tokens; if the
environment answers differently there, the branch stops with the turn (``agentrl replay --reexec``
shows what changed). The new episode is stored in the same store beside the original (writer
``replay``: shards ``replay-NNNNN.jsonl.gz``) with ``extra.branch_of`` (the original's id),
``extra.from_turn`` and ``extra.weights``.

The policy is the run's model with, by default, the weights that sampled the original episode (the
checkpoint after as many updates as the episode's iteration: ``checkpoints/iter-NNNNNN``, or
``warm_start.pt`` for iteration 0), else the latest checkpoint; ``model.init=PATH`` chooses others.
The engine, sampling settings and sandbox are the run's, any of them overridable with
``key=value`` settings (``engine.kind=sglang engine.url=...``, ``rollout.temperature=0``).
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

from agentrl.replay.episodes import Episode, ReplayError, read
from agentrl.rollout.engine import EngineError, Generation, SamplingParams
from agentrl.trajectory import Trajectory


class PrefixEngine:
    """The recorded assistant turns before ``from_turn`` (1-based), then ``engine``'s."""

    def __init__(self, recorded: Trajectory, from_turn: int, engine: Any):
        self.recorded, self.from_turn, self.engine = recorded, from_turn, engine
        self.spans = [s for s in recorded.turns if s.role == "assistant"]
        self.turn = 0
        self.diverged: int | None = None

    @property
    def weight_version(self) -> str:
        return getattr(self.engine, "weight_version", "")

    async def generate(self, input_ids: list[int], params: SamplingParams) -> Generation:
        k = self.turn
        if k >= self.from_turn - 1:
            self.turn += 1
            return await self.engine.generate(input_ids, params)
        span = self.spans[k]
        if list(input_ids) != self.recorded.input_ids[: span.start]:
            self.diverged = k + 1
            raise EngineError(f"the prompt of turn {k + 1} differs from the recorded one")
        self.turn += 1
        t = self.recorded
        return Generation(
            t.input_ids[span.start : span.end],
            t.rollout_logprobs[span.start : span.end],
            t.finish_reasons[k] if k < len(t.finish_reasons) else "stop",
            t.weight_versions[k] if k < len(t.weight_versions) else "recorded",
        )

    async def update_weights(self, *args: Any, **kwargs: Any) -> str:
        return await self.engine.update_weights(*args, **kwargs)

    async def health(self) -> bool:
        return await self.engine.health()

    async def close(self) -> None:
        await self.engine.close()


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


def run_config(run_dir: Path, overrides: list[str]):
    from agentrl.config import ConfigError, TrainConfig, read_settings, validate_settings

    config = run_dir / "config.json"
    if not config.is_file():
        raise ReplayError(
            f"--from-turn needs the run's settings (its model, engine and environment): {run_dir} has no "
            "config.json; give the run directory of an `agentrl train` run"
        )
    try:
        saved = json.loads(config.read_text())
    except ValueError as e:
        raise ReplayError(f"{config} is not the JSON that `agentrl train` writes ({e})") from None
    if not isinstance(saved, dict):  # the settings given with --set merge into an object only
        raise ReplayError(
            f"{config} is not the JSON that `agentrl train` writes (a JSON {type(saved).__name__}, not an "
            "object of settings); give the run directory of an `agentrl train` run"
        )
    try:
        return validate_settings(
            TrainConfig, _merge(saved, read_settings(None, overrides, TrainConfig)), str(config), overrides
        )
    except ConfigError as e:
        raise ReplayError(str(e)) from None


def sampling_weights(run_dir: Path, iteration: int | None) -> tuple[str | None, str]:
    """``(model.init, why)``: the weights that sampled an episode of ``iteration``, else the latest."""
    from agentrl.models import holds_policy

    checkpoints = run_dir / "checkpoints"
    if isinstance(iteration, int):
        exact = checkpoints / f"iter-{iteration:06d}"
        if iteration > 0 and holds_policy(exact):
            return str(exact), f"the weights that sampled it ({exact.name})"
        if iteration == 0 and (run_dir / "warm_start.pt").is_file():
            return str(run_dir / "warm_start.pt"), "the weights that sampled it (warm_start.pt)"
    saved = sorted(p for p in checkpoints.glob("iter-*") if holds_policy(p))
    if saved:
        return str(saved[-1]), f"the latest checkpoint ({saved[-1].name}; the sampling one is not kept)"
    return None, "the run's initial model (no checkpoint or warm start saved)"


async def branch(
    store: Path, episode: Episode, from_turn: int, overrides: list[str], seed: int | None = None
) -> tuple[Trajectory, str, str]:
    """Re-run ``episode`` from assistant turn ``from_turn`` and store it; ``(branch, its id, weights)``."""
    from agentrl.config import ConfigError
    from agentrl.registry import ENGINES
    from agentrl.replay.reexec import find_task
    from agentrl.rollout.agent_loop import run_episode
    from agentrl.rollout.from_config import env_factory, load_policy, loop_config
    from agentrl.store import TrajectoryStore

    t = episode.trajectory()
    turns = sum(s.role == "assistant" for s in t.turns)
    if not 1 <= from_turn <= max(turns, 1):
        raise ReplayError(
            f"--from-turn {from_turn}: episode {episode.id} has {turns} assistant turns (1 to {turns})"
        )
    if store.name != "trajectories":
        raise ReplayError(
            f"--from-turn needs a run directory (its config.json names the model and engine); {store} "
            "is a bare store"
        )
    run_dir = store.parent
    init, why = sampling_weights(run_dir, episode.iteration)
    if init is not None and not any(o.startswith("model.init=") for o in overrides):
        overrides = [f"model.init={init}", *overrides]
    else:
        why = "model.init as given" if init is not None else why
    cfg = run_config(run_dir, overrides)
    if cfg.env.id != t.env_id:
        raise ReplayError(f"the episode is of environment {t.env_id!r} but the run trains {cfg.env.id!r}")
    try:
        make_env = env_factory(cfg)
        env = make_env()
        policy, tokenizer = load_policy(cfg, make_env())
        engine = ENGINES.factory(cfg.engine.kind)(policy, cfg)
    except ConfigError as e:
        raise ReplayError(str(e)) from None
    task = find_task(env, t, [cfg.env.train_split, cfg.env.eval_split, "train", "test"])
    loop = loop_config(cfg)
    # a fresh seed when none is given, recorded with the branch: it can be re-run exactly, and the
    # store's seed column stays one type (datasets cannot cast a shard of nulls to the others' ints)
    loop.seed = seed if seed is not None else secrets.randbelow(2**31)
    prefixed = PrefixEngine(t, from_turn, engine)
    try:
        new = await run_episode(env, prefixed, tokenizer, task, loop, sample_index=t.sample_index)
    finally:
        await engine.close()
    if prefixed.diverged is not None:
        raise ReplayError(
            f"the environment answered differently before turn {from_turn}: the prompt of turn "
            f"{prefixed.diverged} is not the recorded one, so there is no branch point; "
            f"`agentrl replay {run_dir} --id {episode.id} --reexec` shows the first difference"
        )
    new.extra.update(branch_of=episode.id, from_turn=from_turn, weights=why)
    with TrajectoryStore(store, writer="replay") as s:
        s.append(new)
    mine = [e for e in read(store)[0] if e.id.startswith("replay-")]
    return new, mine[-1].id, why
