"""End to end: a 2-iteration PPO run with ``engine.kind: sglang`` pointed at ``agentrl serve local``,
weights synced by disk, trained by the PyTorch or the Megatron backend. The engine's version
advances at each sync, and every rollout's log-probs equal the trainer's recomputation with the
weights it was sampled from (fp32, 1e-4)."""

import json

import pytest
import torch

from agentrl.config import TrainConfig, load_config
from agentrl.env import register
from agentrl.registry import BACKENDS
from agentrl.rollout.from_config import env_factory, load_policy
from agentrl.rollout.serve_local import local_server
from agentrl.store import TrajectoryStore
from agentrl.trainer.backend import Batch
from agentrl.trainer.checkpoint import Checkpoints
from tests.rollout.http_servers import serving

register("magic-word-v0", entry_point="tests.trainer.toy_env:MagicWordEnv")

TOY = [
    "env.id=magic-word-v0",
    "env.eval_tasks=2",
    "env.train_tasks=16",
    "rollout.tasks_per_iteration=4",
    "rollout.n_samples=2",
    "rollout.max_turns=1",
    "rollout.max_new_tokens=8",
    "rollout.max_context=512",
    "rollout.temperature=0.9",
    "optim.actor_lr=3e-3",
    "optim.critic_lr=3e-3",
    "metrics.progress=false",
    "metrics.tensorboard=false",
    "run.iterations=2",
]


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_two_iterations_against_serve_local_with_weight_sync_by_disk(tmp_path, backend):
    from agentrl.trainer.ppo import main

    if backend == "megatron":
        pytest.importorskip("megatron.core")

    probe_cfg = load_config(TrainConfig, None, TOY)
    served_model, tok = load_policy(probe_cfg, env_factory(probe_cfg)())  # the policy's shape and tokenizer
    # Other weights than the trainer's: the run must push its own before the first rollout.
    torch.nn.init.normal_(served_model.model.embed_tokens.weight)
    server = local_server(served_model, tok, "tiny-magic", max_context=1024)
    with serving(server) as url:
        cfg = load_config(
            TrainConfig,
            None,
            [
                *TOY,
                f"run.output_dir={tmp_path}",
                "engine.kind=sglang",
                f"engine.url={url}",
                "engine.model_path=tiny-magic",
                f"trainer.backend={backend}",
            ],
        )
        summary = main(cfg)
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1] and "eval_after" in summary
    # 1 at start (the policy pushed), then one more after each iteration's update.
    assert server.engine.weight_version == "3" and server.engine.stats["requests"] > 0
    assert server.model_path == str((run / "engine_weights" / "weights-3").resolve())
    # Each iteration's rollouts come from one version: "1" (the pushed policy), then "2".
    trajectories = list(TrajectoryStore(run / "trajectories").read())
    versions = [{v for v in t.weight_versions} for t in trajectories]
    assert versions[:8] == [{"1"}] * 8 and versions[8:16] == [{"2"}] * 8, versions
    # The trainer's recomputation (its backend, fp32) with the weights of iteration 1's rollouts (the
    # checkpoint after iteration 0) gives the log-probs the server reported, token by token.
    trainer = BACKENDS.factory(backend)(load_policy(cfg, env_factory(cfg)())[0], cfg)
    Checkpoints(run).load(run / "checkpoints" / "iter-000001", trainer)
    batch = Batch.from_trajectories(trajectories[8:16])
    recomputed = trainer.logprobs(batch, cfg.rollout.temperature)
    gap = (recomputed - batch.rollout_logprobs)[batch.loss_mask].abs()
    assert gap.numel() > 0 and float(gap.max()) < 1e-4, float(gap.max())
    # Collection and sync alternate: no token was sampled with weights older than the trainer's.
    assert [r["offpolicy_tokens"] for r in records] == [0, 0]
    # Both iterations, as the trainer logged them (iteration 0: the weights pushed at start).
    assert records[0]["logprob_gap_mean_abs"] < 1e-5 and records[1]["logprob_gap_mean_abs"] < 1e-5


def test_offpolicy_tokens_are_those_of_turns_sampled_with_another_version():
    from agentrl.trainer.phases import offpolicy_tokens
    from agentrl.trajectory import Trajectory, TurnSpan

    # prompt 2 | assistant 3 (version "1") | tool 1 | assistant 4 (version "2")
    turns = [
        TurnSpan(0, 2, "prompt"),
        TurnSpan(2, 5, "assistant"),
        TurnSpan(5, 6, "tool"),
        TurnSpan(6, 10, "assistant"),
    ]
    mask = [0, 0, 1, 1, 1, 0, 1, 1, 1, 1]
    t = Trajectory(list(range(10)), mask, [0.0] * 10, turns, weight_versions=["1", "2"])
    assert offpolicy_tokens([t], "2") == (3, 7) and offpolicy_tokens([t], "1") == (4, 7)
    assert offpolicy_tokens([t, t], "3") == (14, 14)
