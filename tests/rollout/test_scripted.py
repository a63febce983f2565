"""Scripted turns behind the real agent loop: the engine's turn counting, and a demonstration's
turns played with their trainable flags."""

import asyncio

import pytest

from agentrl.env import Demonstration, DemoTurn, Task
from agentrl.models import tiny_tokenizer
from agentrl.rollout.agent_loop import LoopConfig
from agentrl.rollout.engine import SamplingParams
from agentrl.rollout.scripted import ScriptedEngine, demonstration_texts, play_demonstration
from agentrl.tools import ToolCall
from tests.rollout.fakes import EchoEnv


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_each_longer_input_is_the_next_turn_and_a_retried_one_the_same(tok):
    engine = ScriptedEngine(tok, script=["one", "two"])
    eot = [engine.eot_id]

    def say(ids, max_new_tokens=64):
        out = asyncio.run(engine.generate(ids, SamplingParams(max_new_tokens=max_new_tokens)))
        return tok.decode(out.output_ids[:-1]) if out.finish_reason == "stop" else out.finish_reason

    assert say([5, 6]) == "one"
    assert say([5, 6]) == "one"  # the same request again
    assert say([5, 6, 7, 8]) == "two"
    assert say([5, 6, 7, 8, 9]) == ""  # past the script: an empty turn
    out = asyncio.run(
        ScriptedEngine(tok, script=["one two three"]).generate([1], SamplingParams(max_new_tokens=2))
    )
    assert out.finish_reason == "length" and len(out.output_ids) == 2 and out.output_ids[-1:] != eot
    assert out.logprobs == [0.0, 0.0]


def test_a_turn_played_but_not_imitated_keeps_loss_mask_zero(tok):
    bash = lambda c: [ToolCall("bash", {"command": c}, id="call_0")]  # noqa: E731
    demo = Demonstration(
        [
            DemoTurn(bash("ls")),
            DemoTurn(bash("rm -rf build"), "A detour.", trainable=False),
            DemoTurn(bash("make")),
        ],
        reward=1.0,
    )
    t = asyncio.run(play_demonstration(EchoEnv(3), tok, Task("train-0"), demo, LoopConfig(max_turns=3)))
    assert t.status == "completed" and t.extra["demo_reward"] == 1.0
    turns = [s for s in t.turns if s.role == "assistant"]
    assert len(turns) == 3
    texts = [tok.decode(t.input_ids[s.start : s.end]) for s in turns]
    assert "rm -rf build" in texts[1] and "A detour." in texts[1]
    for span, trained in zip(turns, (True, False, True), strict=True):
        mask = t.loss_mask[span.start : span.end]
        assert mask == [int(trained)] * len(mask), (span, mask)
        assert all(lp == 0.0 for lp in t.rollout_logprobs[span.start : span.end])
    assert sum(t.loss_mask) == sum(s.end - s.start for s in (turns[0], turns[2]))


def test_a_tool_format_that_does_not_exist_is_named():
    with pytest.raises(ValueError, match="tool_format must be one of .*; got 'xml'"):
        demonstration_texts(Demonstration([]), "xml")
