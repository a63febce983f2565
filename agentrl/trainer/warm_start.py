"""The supervised warm start: the environment's demonstrations (``env.demonstration(task)``) played
through the real agent loop, and the solved episodes of a trajectory store (``sft.from_store``),
imitated before RL."""

from __future__ import annotations

import asyncio
from collections import Counter

import torch

from agentrl.config import ConfigError
from agentrl.rollout.from_config import loop_config
from agentrl.rollout.render import Renderer
from agentrl.rollout.scripted import play_demonstration
from agentrl.store import TrajectoryStore
from agentrl.trainer.backend import Batch
from agentrl.trainer.build import Run
from agentrl.trajectory import Trajectory, succeeded


async def demonstration_episodes(run: Run, indices: list[int]) -> list[Trajectory]:
    """The environment's demonstrations on training tasks ``indices``, played through the real loop
    (the same rendering, parsing, tools and grading as the policy's), ``rollout.concurrency`` at a
    time. A task the environment has no demonstration for is skipped."""
    cfg = run.cfg
    renderer = Renderer(run.tokenizer, None)
    loop = loop_config(cfg)
    # a demonstration is never cut short by the policy's budgets
    loop.max_new_tokens, loop.max_context = max(loop.max_new_tokens, 1024), max(loop.max_context, 16384)
    slots = asyncio.Semaphore(cfg.rollout.concurrency)

    async def one(index: int) -> Trajectory | None:
        env = run.make_env()
        task = run.splits.train[index]
        demo = env.demonstration(task)
        if demo is None:
            await env.close()
            return None
        async with slots:
            return await play_demonstration(env, run.tokenizer, task, demo, loop, renderer=renderer)

    played = await asyncio.gather(*(one(i) for i in indices))
    return [t for t in played if t is not None]


def sft_episodes(trajectories: list[Trajectory]) -> tuple[list[Trajectory], int]:
    """The demonstration episodes a warm start trains on, in order, and how many of them meant to
    fail (a noisy demonstrator's slips): those that ended as meant, completed with the reward the
    demonstration expected. An episode cut off by a limit would teach not to finish; one that
    earned another reward than meant did not play as the environment intended."""
    meant = [t.status == "completed" and t.reward == t.extra.get("demo_reward", 1.0) for t in trajectories]
    kept = [t for t, ok in zip(trajectories, meant, strict=True) if ok]
    if not any(succeeded(t.reward) for t in kept):
        rewards = Counter(t.reward for t in trajectories)
        raise RuntimeError(
            f"none of {len(trajectories)} demonstration episodes was a success that ended as meant "
            f"(statuses {dict(Counter(t.status for t in trajectories))}, rewards {dict(rewards)}); "
            "check the environment's demonstration() with `agentrl envs check`"
        )
    return kept, sum(not succeeded(t.reward) for t in kept)


def stored_episodes(run: Run) -> list[Trajectory]:
    """The successful, completed episodes of the store at ``sft.from_store``, checked against the
    run's tokenizer (token ids another tokenizer made would teach nonsense). Left out, and counted in
    the log: another environment's episodes, held-out tasks' (a store ``agentrl eval --store`` or a
    rollout of the test split wrote: imitating them would leak the held-out score), replay branches
    (their prefix is another episode's) and exact duplicates."""
    cfg = run.cfg
    path = cfg.sft.from_store
    if not path:
        return []
    successes = TrajectoryStore(path).read(lambda t: t.status == "completed" and succeeded(t.reward))
    held_out = {t.id for t in run.splits.held_out}
    train_ids: set[str] | None = None  # listed when first needed: a generated split may be long
    episodes, left_out, seen = [], Counter(), set()
    for t in successes:
        data = t.extra.get("task_data")
        split = data.get("split") if isinstance(data, dict) else None
        if t.env_id and t.env_id != cfg.env.id:
            left_out["of another environment"] += 1
            continue
        if not isinstance(split, str):  # the task's data does not say: it must be a training task
            if train_ids is None:
                train_ids = {task.id for task in run.splits.train}
            split = cfg.env.train_split if t.task_id in train_ids else "another split"
        if t.task_id in held_out or split != cfg.env.train_split:
            left_out["of held-out tasks"] += 1
        elif t.extra.get("branch_of"):
            left_out["replay branches"] += 1
        elif (key := tuple(t.input_ids)) in seen:
            left_out["duplicates"] += 1
        elif not same_tokenizer(t, run.tokenizer):
            left_out["made with another tokenizer"] += 1
        else:
            seen.add(key)
            episodes.append(t)
    if left_out:
        run.log(f"sft.from_store: left out {', '.join(f'{n} {why}' for why, n in left_out.items())}")
    if not episodes:
        raise ConfigError(
            f"sft.from_store={path}: the store holds no completed, successful episode of {cfg.env.id}'s "
            f"{cfg.env.train_split} split to imitate" + (f" (left out: {dict(left_out)})" if left_out else "")
        )
    vocab = len(run.tokenizer)
    top = max(max(t.input_ids) for t in episodes)
    if top >= vocab:
        raise ConfigError(
            f"sft.from_store={path}: its episodes hold token id {top}, beyond this model's vocabulary of "
            f"{vocab}: they were made with another tokenizer; collect them with model.name={run.cfg.model.name}"
        )
    return episodes


def same_tokenizer(t: Trajectory, tokenizer) -> bool:
    """Whether ``tokenizer`` reads the episode's first assistant turn back as the text it was: the
    loop decodes each turn's sampled ids into its message, so another tokenizer's ids read as other
    text (a vocabulary of the same size or larger takes them all the same)."""
    span = next((s for s in t.turns if s.role == "assistant"), None)
    message = next((m for m in t.messages if m.get("role") == "assistant"), None)
    if span is None or message is None or not isinstance(message.get("content"), str):
        return True  # nothing to imitate in it, or nothing to compare with
    text = tokenizer.decode(t.input_ids[span.start : span.end], skip_special_tokens=False)
    for special in tokenizer.all_special_tokens:  # the end-of-turn token that closed it
        text = text.removesuffix(special)
    return text == message["content"]


async def warm_start(run: Run) -> None:
    """Supervised warm start on the demonstrations (``sft.episodes``) and stored successes (``sft.from_store``)."""
    cfg = run.cfg
    if cfg.sft.episodes == 0 and not cfg.sft.from_store:
        return
    # Demonstrations use training tasks past the ones RL draws from, when the split holds more.
    size = len(run.splits.train)
    indices = [(run.splits.n_train + i) % size for i in range(cfg.sft.episodes)]
    kept, slipped = sft_episodes(await demonstration_episodes(run, indices)) if indices else ([], 0)
    stored = stored_episodes(run)
    batch = Batch.from_trajectories(kept + stored)
    losses = run.backend.train_sft(batch, epochs=cfg.sft.epochs, lr=cfg.sft.lr, batch_size=cfg.sft.batch_size)
    run.backend.reset_critic()  # the value model starts from the warm-started weights, as with model.init
    run.backend.reset_reference()  # and so does the KL's reference (algo.kl_coef > 0)
    await run.engine.update_weights(run.backend.engine_state_dict())
    torch.save(run.backend.engine_state_dict(), cfg.run_dir / "warm_start.pt")  # model.init= to reuse it
    run.state["sft"] = {
        "episodes": len(kept),
        "slipped": slipped,
        "stored": len(stored),
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }
    sources = [f"{len(kept)} demonstration episodes ({slipped} meant to fail)"] if indices else []
    sources += [f"{len(stored)} stored successes from {cfg.sft.from_store}"] if stored else []
    run.log(f"warm start: {' and '.join(sources)}, SFT loss {losses[0]:.3f} -> {losses[-1]:.3f}")
