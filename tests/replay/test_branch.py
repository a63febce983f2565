"""agentrl replay RUN --id ID --from-turn N: the recorded turns before N replayed, the policy from N."""

import asyncio

import pytest

from agentrl.env import Task
from agentrl.models import tiny_tokenizer
from agentrl.replay.branch import PrefixEngine, sampling_weights
from agentrl.rollout.agent_loop import LoopConfig, run_episode
from tests.rollout.fakes import EchoEnv, FixedEngine


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def ids(tok, text):
    return [*tok.encode(text, add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]


def test_the_branch_keeps_the_recorded_turns_before_n_and_generates_from_n(tok):
    task = Task("train-1")
    recorded = asyncio.run(run_episode(EchoEnv(4), FixedEngine(ids(tok, "first")), tok, task, LoopConfig()))
    spans = [s for s in recorded.turns if s.role == "assistant"]
    assert len(spans) == 4
    policy = FixedEngine(ids(tok, "other words"))
    engine = PrefixEngine(recorded, 3, policy)
    branch = asyncio.run(run_episode(EchoEnv(4), engine, tok, task, LoopConfig()))
    assert engine.diverged is None and len(policy.calls) == 2  # turns 3 and 4
    cut = spans[2].start
    assert branch.input_ids[:cut] == recorded.input_ids[:cut]
    assert branch.rollout_logprobs[:cut] == recorded.rollout_logprobs[:cut]
    new = [s for s in branch.turns if s.role == "assistant"][2]
    assert branch.input_ids[new.start : new.end] == ids(tok, "other words")
    assert policy.calls[0] == recorded.input_ids[:cut]  # the policy saw the recorded prompt


def test_an_env_that_answers_differently_before_n_stops_the_branch(tok):
    task = Task("train-1")
    recorded = asyncio.run(run_episode(EchoEnv(4), FixedEngine(ids(tok, "first")), tok, task, LoopConfig()))
    engine = PrefixEngine(recorded, 3, FixedEngine(ids(tok, "x")))
    branch = asyncio.run(run_episode(EchoEnv(4, obs_text="changed"), engine, tok, task, LoopConfig()))
    assert engine.diverged == 2 and branch.status == "engine_error"


def test_the_weights_that_sampled_an_episode_are_chosen_when_kept(tmp_path):
    # one written by the PyTorch backend, one by the Megatron backend (its policy beside its splits)
    for name, file in (("iter-000002", "backend.pt"), ("iter-000004", "policy.pt")):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
        (tmp_path / "checkpoints" / name / file).write_bytes(b"")
    (tmp_path / "checkpoints/iter-000006").mkdir()  # no weights in it
    (tmp_path / "checkpoints/iter-000006/megatron-tp0.pt").write_bytes(b"")
    assert sampling_weights(tmp_path, 2) == (
        str(tmp_path / "checkpoints/iter-000002"),
        "the weights that sampled it (iter-000002)",
    )
    init, why = sampling_weights(tmp_path, 3)
    assert init == str(tmp_path / "checkpoints/iter-000004") and "the sampling one is not kept" in why
    assert sampling_weights(tmp_path, 0)[0] == str(tmp_path / "checkpoints/iter-000004")
    (tmp_path / "warm_start.pt").write_bytes(b"")
    assert sampling_weights(tmp_path, 0)[0] == str(tmp_path / "warm_start.pt")


def test_a_config_json_that_is_not_an_object_is_one_line_with_or_without_settings(tmp_path, tok, capsys):
    from agentrl.cli import main
    from agentrl.store import TrajectoryStore

    t = asyncio.run(run_episode(EchoEnv(2), FixedEngine(ids(tok, "hi")), tok, Task("train-0"), LoopConfig()))
    run = tmp_path / "run"
    with TrajectoryStore(run / "trajectories") as s:
        s.append(t)
    (run / "config.json").write_text("[1, 2]")
    errors = []
    for settings in ([], ["--set", "rollout.temperature=0"]):
        assert main(["replay", str(run), "--id", "w0-00000:1", "--from-turn", "1", *settings]) == 2
        errors.append(capsys.readouterr().err)
    assert (
        errors[0]
        == errors[1]
        == (
            f"error: {run / 'config.json'} is not the JSON that `agentrl train` writes (a JSON list, not an "
            "object of settings); give the run directory of an `agentrl train` run\n"
        )
    )
