import asyncio
import contextlib

import pytest

from agentrl.env import Task, make
from agentrl.envs.bugfix import BugfixEnv
from agentrl.models import tiny_chat_model
from agentrl.rollout.agent_loop import LoopConfig, run_episode
from agentrl.rollout.engine import EngineError
from agentrl.rollout.local import LocalEngine
from agentrl.rollout.render import Renderer
from agentrl.rollout.scripted import ScriptedEngine, demonstration_texts
from agentrl.tools import PARSERS
from tests.rollout.fakes import EchoEnv, FixedEngine, RecordingEngine


@pytest.fixture(scope="module")
def tiny():
    return tiny_chat_model()


def run(coro):
    return asyncio.run(coro)


def test_token_in_token_out_with_the_tiny_model(tiny):
    model, tok = tiny
    engine = RecordingEngine(LocalEngine(model))
    env = EchoEnv(episode_len=4)
    traj = run(run_episode(env, engine, tok, Task("t1"), LoopConfig(max_new_tokens=12, seed=0)))
    assert traj.status == "completed" and traj.reward == 1.0 and env.closed == 1
    spans = [s for s in traj.turns if s.role == "assistant"]
    assert len(spans) == len(engine.generations) == 4
    for span, gen in zip(spans, engine.generations, strict=True):
        assert traj.input_ids[span.start : span.end] == gen.output_ids  # exactly the sampled ids
        assert traj.rollout_logprobs[span.start : span.end] == gen.logprobs
    trainable = {i for s in spans for i in range(s.start, s.end)}
    assert all((m == 1) == (i in trainable) for i, m in enumerate(traj.loss_mask))
    assert all(lp == 0.0 for i, lp in enumerate(traj.rollout_logprobs) if i not in trainable)


def test_every_request_is_the_exact_history(tiny):
    _, tok = tiny
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    engine = FixedEngine(tok.encode("thinking", add_special_tokens=False) + [eot])
    traj = run(run_episode(EchoEnv(episode_len=3), engine, tok, Task("t"), LoopConfig()))
    starts = [s.start for s in traj.turns if s.role == "assistant"]
    assert [len(c) for c in engine.calls] == starts
    assert all(call == traj.input_ids[: len(call)] for call in engine.calls)


def test_observation_tokens_match_the_chat_template(tiny):
    _, tok = tiny
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    engine = FixedEngine(tok.encode("hi there", add_special_tokens=False) + [eot])
    traj = run(run_episode(EchoEnv(episode_len=2), engine, tok, Task("t"), LoopConfig()))
    # With a canonical assistant turn, the held ids equal the template's rendering of the messages.
    messages = [{k: v for k, v in m.items() if k in ("role", "content")} for m in traj.messages]
    rendered = tok.apply_chat_template(
        messages[:4], tools=run_env_tools(), add_generation_prompt=True, tokenize=False
    )
    assert tok.decode(traj.input_ids[: traj.turns[2].end]) == rendered
    assert traj.extra["retokenization_drift_turns"] == 0


def run_env_tools():
    from agentrl.tools import CODING_TOOLS

    return CODING_TOOLS


def test_retokenization_drift_is_counted_not_hidden(tiny):
    _, tok = tiny
    newline = tok.encode("\n", add_special_tokens=False)
    assert (
        len(newline) == 1 and tok.encode("\n\n", add_special_tokens=False) != newline * 2
    )  # the round trip differs
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    sampled = newline * 2 + [eot]
    traj = run(run_episode(EchoEnv(episode_len=2), FixedEngine(sampled), tok, Task("t"), LoopConfig()))
    for span in (s for s in traj.turns if s.role == "assistant"):
        assert traj.input_ids[span.start : span.end] == sampled  # kept as sampled, not re-encoded
    assert traj.extra["retokenization_drift_turns"] == 2


def test_budgets_and_failures_each_give_their_status(tiny):
    _, tok = tiny
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    words = tok.encode("word " * 40, add_special_tokens=False) + [eot]

    async def episode(env, engine, **cfg):
        traj = await run_episode(env, engine, tok, Task("t"), LoopConfig(**cfg))
        assert env.closed >= 1, "the env must be closed whatever happened"
        return traj.validate()

    async def go():
        # context: the prompt plus two turns overflow the window
        probe = await episode(EchoEnv(1), FixedEngine([eot]))
        p = probe.turns[0].end
        t = await episode(EchoEnv(10), FixedEngine(words), max_context=p + 60)
        assert t.status == "truncated_context" and len(t) <= p + 60
        assert t.finish_reasons[-1] == "length" or t.turns[-1].role == "assistant"
        # max turns (and the env is graded on the way out)
        env = EchoEnv(10)
        t = await episode(env, FixedEngine([eot]), max_turns=3)
        assert t.status == "max_turns" and len(t.finish_reasons) == 3 and t.reward == 0.5 and env.graded == 1
        # deadline
        t = await episode(EchoEnv(10, step_delay=0.2), FixedEngine([eot]), deadline_s=0.5)
        assert t.status == "timeout"
        # engine error (not transient: no retry)
        t = await episode(EchoEnv(3), FixedEngine([eot], fail=RuntimeError("CUDA error")))
        assert t.status == "engine_error" and "CUDA error" in t.extra["error"] and t.reward == 0.0
        # transient engine errors are retried
        t = await episode(EchoEnv(2), FixedEngine([eot], transient_failures=2), engine_retries=3)
        assert t.status == "completed" and t.extra["engine_retries"] == 2
        # sandbox errors at reset are retried (the episode has run no tool call yet)
        t = await episode(EchoEnv(2, reset_failures=2), FixedEngine([eot]))
        assert t.status == "completed" and t.extra["reset_retries"] == 2
        t = await episode(EchoEnv(2, reset_failures=5), FixedEngine([eot]))
        assert t.status == "env_error" and "would not start" in t.extra["error"]
        # env error
        t = await episode(EchoEnv(5, fail_at=2), FixedEngine([eot]))
        assert t.status == "env_error" and "the environment broke" in t.extra["error"]
        # cancellation
        env = EchoEnv(100, step_delay=0.05)
        task = asyncio.ensure_future(run_episode(env, FixedEngine([eot]), tok, Task("t"), LoopConfig()))
        await asyncio.sleep(0.3)
        task.cancel()
        t = await task
        assert t.status == "aborted" and env.closed == 1 and t.validate()

    run(go())


def test_an_env_that_breaks_the_episode_contract_costs_that_episode_not_the_run(tiny):
    _, tok = tiny
    eot = tok.convert_tokens_to_ids("<|im_end|>")

    class OwnStatus(EchoEnv):
        def __init__(self, status=None, reward=1.0, grade=0.5, episode_len=1):
            super().__init__(episode_len=episode_len, reward=reward)
            self.status, self.grade_value = status, grade

        async def step(self, tool_calls):
            result = await super().step(tool_calls)
            if self.status is not None:
                result.info["status"] = self.status
            return result

        async def grade(self):
            return self.grade_value

    async def episode(env, **cfg):
        return (await run_episode(env, FixedEngine([eot]), tok, Task("t"), LoopConfig(**cfg))).validate()

    async def go():
        t = await episode(OwnStatus("solved"))
        assert t.status == "env_error" and t.reward == 0.0
        assert "info['status'] = 'solved', which is not one of" in t.extra["error"]
        assert (await episode(OwnStatus("max_turns"))).status == "max_turns"  # one of the loop's own
        t = await episode(OwnStatus(reward=float("nan")))
        assert t.status == "env_error" and "step() returned reward nan" in t.extra["error"]
        t = await episode(OwnStatus(reward="1"))  # a number in a string is read as one
        assert t.status == "completed" and t.reward == 1.0
        # a grade on the way out of a cut-off episode that is not a number: no grade, not trained
        t = await episode(OwnStatus(grade=None, episode_len=5), max_turns=1)
        assert t.status == "env_error" and t.reward == 0.0
        assert t.extra["error"] == (
            "grade() of the max_turns episode failed: ValueError: grade() returned reward None; "
            "a reward must be a finite number"
        )

    run(go())


def test_a_parser_that_raises_costs_a_tool_call_error_not_the_episode(tiny, monkeypatch):
    _, tok = tiny
    eot = tok.convert_tokens_to_ids("<|im_end|>")

    def broken(text, tools):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setitem(PARSERS, "broken", broken)
    engine = FixedEngine(tok.encode("<tool_call>[[[", add_special_tokens=False) + [eot])
    traj = run(run_episode(EchoEnv(episode_len=2), engine, tok, Task("t"), LoopConfig(tool_format="broken")))
    # still trainable: completed with the env's reward, each turn's failure counted as one call error
    assert traj.status == "completed" and traj.reward == 1.0
    assert traj.extra["tool_call_errors"] == 2
    calls = [m["tool_calls"] for m in traj.messages if m["role"] == "assistant"]
    assert len(calls) == 2 and all(len(c) == 1 for c in calls)
    assert "could not be read (RecursionError: maximum recursion depth" in calls[0][0]["error"]


def test_engine_error_class_is_kept():
    e = EngineError("x", transient=True)
    assert e.transient


@pytest.mark.parametrize("backend", ["local", "docker"])
def test_scripted_expert_as_an_engine_solves_bugfix(tiny, backend):
    if backend == "docker":
        from tests.conftest import require_docker

        require_docker()
    _, tok = tiny

    async def go():
        factory = lambda: make("bugfix-v0", sandbox=backend)  # noqa: E731
        envs = factory()
        for i in range(2):
            task = envs.task("train", i)
            engine = ScriptedEngine(tok, script=demonstration_texts(envs.demonstration(task), "hermes"))
            traj = await run_episode(factory(), engine, tok, task, LoopConfig(max_context=16384))
            assert traj.status == "completed" and traj.reward == 1.0, (task.id, traj.extra)
            assert traj.extra["tool_call_errors"] == 0 and len(traj.finish_reasons) == 5

    run(go())


HEADER_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@pytest.mark.parametrize("template", ["chatml", "headers"])
def test_a_script_plays_its_turns_in_order_whatever_the_chat_template(tiny, template):
    """The scripted engine tells the turn from the calls of its episode, not from a chat format's
    markers: with a template that has no ChatML generation prompt (header tokens, as Llama 3's), the
    first turn played was the script's last."""
    import copy

    _, tok = tiny
    if template == "headers":
        tok = copy.deepcopy(tok)
        tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"]})
        tok.add_special_tokens({"eos_token": "<|eot_id|>"})
        tok.chat_template = HEADER_TEMPLATE
    script = ["first", "second", "third"]
    engine = ScriptedEngine(tok, script=script)
    traj = run(run_episode(EchoEnv(episode_len=3), engine, tok, Task("t"), LoopConfig()))
    played = [tok.decode(traj.input_ids[s.start : s.end - 1]) for s in traj.turns if s.role == "assistant"]
    assert played == script


class CancelOnStep(EchoEnv):
    """Cancels the episode's task as its third step finishes: the same loop turn as the step's end."""

    outer = None

    async def step(self, calls):
        result = await super().step(calls)
        if self.steps == 3:
            asyncio.get_running_loop().call_soon(self.outer.cancel)
        await asyncio.sleep(0)
        return result


class SlowReset(EchoEnv):
    async def reset(self, task):
        await asyncio.sleep(5)
        return await super().reset(task)


class StepTimesOut(EchoEnv):
    async def step(self, calls):
        raise TimeoutError("the sandbox did not answer")


class GradesSlowly(EchoEnv):
    grading = None

    async def grade(self):
        self.grading.set()
        await asyncio.sleep(30)
        return 0.5


class EchoesSurrogate(EchoEnv):
    async def step(self, calls):
        result = await super().step(calls)
        for m in result.observation:
            m["content"] = "error: src/\udcff.py does not exist"
        return result


def test_cancellation_deadlines_and_env_timeouts_end_the_right_way(tiny):
    """A cancellation that lands as a step ends is not lost; a reset that outlives the deadline is
    the env's failure (no prompt: nothing to grade or train), and so is a TimeoutError an env
    raises itself; a cancellation while the env grades still closes the env; an observation
    echoing a lone surrogate is read, not an env_error."""
    _, tok = tiny
    eot = tok.convert_tokens_to_ids("<|im_end|>")

    async def go():
        env = CancelOnStep(episode_len=1000)
        task = asyncio.ensure_future(
            run_episode(env, FixedEngine([eot]), tok, Task("t"), LoopConfig(max_turns=15))
        )
        env.outer = task
        t = await task
        assert (t.status, env.steps, env.closed) == ("aborted", 3, 1)
        env = SlowReset(3)
        t = await run_episode(env, FixedEngine([eot]), tok, Task("t"), LoopConfig(deadline_s=0.2))
        assert t.status == "env_error" and "reset() did not finish" in t.extra["error"]
        assert env.graded == 0 and env.closed == 1 and len(t) == 0
        env = StepTimesOut(3)
        t = await run_episode(env, FixedEngine([eot]), tok, Task("t"), LoopConfig())
        assert t.status == "env_error" and "the sandbox did not answer" in t.extra["error"]
        env = GradesSlowly(10)
        env.grading = asyncio.Event()
        task = asyncio.ensure_future(
            run_episode(env, FixedEngine([eot]), tok, Task("t"), LoopConfig(max_turns=2))
        )
        await env.grading.wait()
        task.cancel()
        t = await task
        assert t.status == "aborted" and env.closed == 1 and t.reward == 0.0
        t = await run_episode(EchoesSurrogate(3), FixedEngine([eot]), tok, Task("t"), LoopConfig())
        assert t.status == "completed" and "\ufffd" in tok.decode(t.input_ids)

    run(go())


def test_an_end_of_turn_that_is_not_one_token_is_refused_by_name(tiny):
    _, tok = tiny
    with pytest.raises(ValueError, match=r"loop.end_of_turn='</turn>' is not one token of the tokenizer"):
        Renderer(tok, "</turn>")


def test_a_task_given_twice_in_one_rollout_gets_other_samples_the_second_time(tiny):
    from agentrl.rollout.pool import RolloutPool

    _, tok = tiny
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    pool = RolloutPool(
        lambda: EchoEnv(1), FixedEngine([eot]), tok, LoopConfig(seed=3), n_samples=2, progress=False
    )
    out = run(pool.run([Task("a"), Task("b"), Task("a")]))
    assert [(t.task_id, t.sample_index) for t in out] == [
        ("a", 0),
        ("a", 1),
        ("b", 0),
        ("b", 1),
        ("a", 2),
        ("a", 3),
    ]


# A chat template of the kind Qwen3's is: the last assistant turn is rendered with an (empty) think
# block, earlier ones without, so an assistant turn renders differently once messages follow it.
LAST_TURN_THINKS = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and loop.last -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def test_a_template_that_renders_the_last_assistant_turn_apart_still_runs_multi_turn(tiny):
    """Observations are rendered after a prefix whose text does not change when messages follow:
    token in, token out, with the template's own text for each observation."""
    import copy

    _, tok = tiny
    tok = copy.deepcopy(tok)
    tok.chat_template = LAST_TURN_THINKS
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    t = run(run_episode(EchoEnv(3), FixedEngine([eot]), tok, Task("t"), LoopConfig()))
    assert t.status == "completed" and len(t.finish_reasons) == 3
    masked = tok.decode([i for i, s in zip(t.input_ids, t.loss_mask, strict=True) if not s])
    assert "\n<|im_start|>tool\nok 2<|im_end|>\n<|im_start|>assistant\n" in masked


def test_a_template_that_takes_no_tool_messages_still_builds_a_renderer(tiny):
    """Some templates raise on a role they do not know; an env of theirs sends its observations as
    user turns, and the renderer's probe with a tool message must not stop it from being built."""
    import copy

    _, tok = tiny
    tok = copy.deepcopy(tok)
    tok.chat_template = (
        "{%- for m in messages -%}"
        "{%- if m.role not in ('user', 'assistant', 'system') -%}{{ raise_exception('no role ' + m.role) }}{%- endif -%}"
        "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' }}{%- endif -%}"
    )
    render = Renderer(tok, None)
    ids = render.observation([{"role": "user", "content": "ok 1"}], after_eot=True)
    assert tok.decode(ids) == "\n<|im_start|>user\nok 1<|im_end|>\n<|im_start|>assistant\n"


class RaisingEngine(FixedEngine):
    """Raises each of ``errors`` in turn (an engine's own timeout, a dropped connection), then answers."""

    def __init__(self, output_ids, errors):
        super().__init__(output_ids)
        self.errors = list(errors)

    async def generate(self, input_ids, params):
        if self.errors:
            self.calls.append(list(input_ids))
            raise self.errors.pop(0)
        return await super().generate(input_ids, params)


def test_an_engine_timeout_or_lost_connection_is_retried_and_named_when_it_persists(tiny):
    _, tok = tiny
    eot = tok.convert_tokens_to_ids("<|im_end|>")

    def episode(engine, retries):
        return run(run_episode(EchoEnv(2), engine, tok, Task("t"), LoopConfig(engine_retries=retries)))

    t = episode(RaisingEngine([eot], [TimeoutError(), ConnectionResetError("peer reset")]), 3)
    assert t.status == "completed" and t.extra["engine_retries"] == 2
    t = episode(RaisingEngine([eot], [TimeoutError("read timed out")] * 3), 3)
    assert t.status == "engine_error" and t.extra["error"].endswith("the engine timed out: read timed out")
    t = episode(RaisingEngine([eot], [ConnectionRefusedError("refused")] * 2), 2)
    assert t.status == "engine_error" and "engine unreachable: refused" in t.extra["error"]


def test_an_observation_with_no_room_left_ends_the_episode_without_half_of_it(tiny):
    _, tok = tiny
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    probe = run(run_episode(EchoEnv(1), FixedEngine([eot]), tok, Task("t"), LoopConfig()))
    room = probe.turns[0].end + 1 + 30  # the prompt, one answer, not the long observation after it
    t = run(
        run_episode(
            EchoEnv(3, obs_text="output " * 200),
            FixedEngine([eot]),
            tok,
            Task("t"),
            LoopConfig(max_context=room),
        )
    )
    assert t.status == "truncated_context" and t.validate()
    assert t.turns[-1].role == "assistant" and len(t) == probe.turns[0].end + 1


class GradeFails(EchoEnv):
    async def grade(self):
        raise RuntimeError("the grading sandbox would not start")


def test_a_cut_off_episode_whose_grade_fails_is_an_env_error_not_a_reward_of_0(tiny):
    _, tok = tiny
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    env = GradeFails(10)
    t = run(run_episode(env, FixedEngine([eot]), tok, Task("t"), LoopConfig(max_turns=2)))
    assert t.status == "env_error" and t.reward == 0.0 and env.closed == 1
    assert t.extra["error"] == (
        "grade() of the max_turns episode failed: RuntimeError: the grading sandbox would not start"
    )
    # and for a deadline cut
    t = run(
        run_episode(
            GradeFails(10, step_delay=0.2), FixedEngine([eot]), tok, Task("t"), LoopConfig(deadline_s=0.3)
        )
    )
    assert t.status == "env_error" and t.extra["error"].startswith("grade() of the timeout episode failed")


class StallsAtTheEnd(BugfixEnv):
    """bugfix-v0 whose end of episode (inside step()) runs past any deadline once: in the grading of
    the submission, or in closing the episode's sandbox before it."""

    def __init__(self, stall: str, **kwargs):
        super().__init__(**kwargs)
        self.stall, self.gradings, self.grading_sandboxes = stall, 0, []

    def _fresh(self):
        fresh = super()._fresh()
        self.grading_sandboxes.append(fresh[0])
        return fresh

    async def _close_sandbox(self):
        if self.stall == "closing" and self._done:
            self.stall = None
            await asyncio.sleep(3600)
        await super()._close_sandbox()

    async def grade_patch(self, patch, fresh=None):
        self.gradings += 1
        if self.stall == "grading":
            self.stall = None
            try:
                await asyncio.sleep(3600)
            finally:
                self._dispose(fresh)
        return await super().grade_patch(patch, fresh)


@pytest.mark.parametrize("stall", ["grading", "closing"])
def test_a_submission_whose_end_the_deadline_cuts_is_graded_after_it(tiny, stall):
    """The deadline lands while step() ends a correct submission's episode: the episode is a timeout
    whose reward is the grade of the diff it submitted (graded even once the sandbox it was read from
    is gone), and every grading sandbox is closed, the one started for the cut grading too."""
    _, tok = tiny
    probe = make("bugfix-v0", sandbox="local")
    task = probe.task("train", 0)
    demo = demonstration_texts(probe.demonstration(task), "hermes")
    fix, submit = demo[2], demo[-1]
    assert '"str_replace"' in fix and '"submit"' in submit
    env = StallsAtTheEnd(stall, sandbox="local")
    engine = ScriptedEngine(tok, script=[fix, submit])
    # 3 s: a reset and one edit take a fraction of it; the stall would take an hour
    t = run(run_episode(env, engine, tok, task, LoopConfig(deadline_s=3.0)))
    assert (t.status, t.reward) == ("timeout", 1.0), t.extra
    assert env.gradings == (2 if stall == "grading" else 1) and env.sandbox is None

    async def alive():
        return [await sb.alive() for sb in env.grading_sandboxes]

    assert run(alive()) == [False, False]


def test_a_malformed_view_range_is_an_error_the_agent_reads_and_the_episode_goes_on(tiny):
    """Line numbers that are not integers: an observation naming the argument, not an env_error."""
    _, tok = tiny
    probe = make("bugfix-v0", sandbox="local")
    task = probe.task("train", 0)
    demo = demonstration_texts(probe.demonstration(task), "hermes")
    view = (
        '<tool_call>{"name": "str_replace_editor", "arguments": {"command": "view", '
        '"path": "mylib/stats.py", "view_range": ["1", "2"]}}</tool_call>'
    )
    engine = ScriptedEngine(tok, script=[view, demo[2], demo[-1]])
    t = run(run_episode(make("bugfix-v0", sandbox="local"), engine, tok, task, LoopConfig(max_context=16384)))
    assert (t.status, t.reward, t.extra["tool_call_errors"]) == ("completed", 1.0, 1), t.extra
    assert t.messages[3]["role"] == "tool" and t.messages[3]["content"] == (
        "error: tool 'str_replace_editor': item 0 of argument 'view_range' must be of type integer, got str."
    )


def test_a_turn_may_fill_the_context_exactly_with_its_end_of_turn(tiny):
    """max_context is what an episode may hold: a turn that ends on its last token is stepped (its
    submit counts); a turn cut at the limit, unfinished, ends the episode as truncated_context."""
    _, tok = tiny
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    submit = tok.encode(
        '<tool_call>{"name": "submit", "arguments": {}}</tool_call>', add_special_tokens=False
    )
    prompt = run(run_episode(EchoEnv(1), FixedEngine([eot]), tok, Task("t"), LoopConfig())).turns[0].end
    full = prompt + len(submit) + 1

    env = EchoEnv(5)
    t = run(run_episode(env, FixedEngine([*submit, eot]), tok, Task("t"), LoopConfig(max_context=full)))
    assert (t.status, t.reward, env.steps, env.graded, len(t)) == ("completed", 1.0, 1, 0, full)
    # the same turn without its end-of-turn token: cut by the limit, not given to the env
    env = EchoEnv(5)
    t = run(run_episode(env, FixedEngine([*submit, eot]), tok, Task("t"), LoopConfig(max_context=full - 1)))
    assert (t.status, t.finish_reasons, env.steps, env.graded) == ("truncated_context", ["length"], 0, 1)
    # a turn that fills the context and gets an observation: no room to answer it
    env = EchoEnv(5)
    talk = tok.encode("hello", add_special_tokens=False) + [eot]
    t = run(run_episode(env, FixedEngine(talk), tok, Task("t"), LoopConfig(max_context=prompt + len(talk))))
    assert (t.status, env.steps, len(t)) == ("truncated_context", 1, prompt + len(talk))


class OutputEngine(FixedEngine):
    """Returns ``output_ids`` with the log-probs ``logprobs``, as an engine in trouble might."""

    def __init__(self, output_ids, logprobs):
        super().__init__(output_ids)
        self.logprobs = logprobs

    async def generate(self, input_ids, params):
        gen = await super().generate(input_ids, params)
        gen.logprobs = list(self.logprobs)
        return gen


def test_engine_output_a_trajectory_cannot_hold_ends_that_episode_as_an_engine_error(tiny):
    _, tok = tiny
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [*tok.encode("hi", add_special_tokens=False), eot]
    n = len(ids)

    def episode(logprobs, output_ids=ids):
        env = EchoEnv(2)
        t = run(run_episode(env, OutputEngine(output_ids, logprobs), tok, Task("t"), LoopConfig()))
        assert env.closed == 1 and t.validate() is t
        return t

    bad = [
        ([float("nan")] + [-0.1] * (n - 1), "logprobs[0] = nan; a log-prob must be finite and <= 0"),
        ([-0.1] * (n - 1) + [float("-inf")], f"logprobs[{n - 1}] = -inf"),
        ([-0.1, 0.5] + [-0.1] * (n - 2), "logprobs[1] = 0.5"),
        ([-0.1] * (n - 1), f"returned {n} token ids but {n - 1} log-probs"),
    ]
    for logprobs, error in bad:
        t = episode(logprobs)
        assert t.status == "engine_error" and t.reward == 0.0 and t.num_trainable == 0
        assert error in t.extra["error"] and t.extra["engine_retries"] == 0, t.extra
    t = episode([-0.1] * n, output_ids=[*ids[:-1], -1])
    assert t.status == "engine_error" and f"output_ids[{n - 1}] = -1, which is not a" in t.extra["error"]
    # a log-prob a rounding above 0 is a sampled token of probability 1
    t = episode([-0.1, 1e-6] + [-0.2] * (n - 2))
    assert t.status == "completed" and t.rollout_logprobs[t.turns[1].start + 1] == 0.0


def test_a_trajectory_that_breaks_an_invariant_at_the_end_is_kept_without_its_tokens(tiny, monkeypatch):
    """Past the per-turn checks (here: switched off), the episode still ends as an engine_error, its
    tokens dropped; run_episode does not raise."""
    from agentrl.rollout import agent_loop

    _, tok = tiny
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    monkeypatch.setattr(agent_loop, "_checked", lambda gen: gen)
    t = run(run_episode(EchoEnv(2), OutputEngine([eot], [float("nan")]), tok, Task("t"), LoopConfig()))
    assert t.status == "engine_error" and len(t) == 0 and t.turns == [] and t.validate() is t
    assert t.extra["error"].startswith("TrajectoryError: rollout_logprobs[") and "= nan" in t.extra["error"]


def test_an_episode_sandbox_whose_close_is_cancelled_is_closed_all_the_same(tiny):
    env = make("bugfix-v0", sandbox="local")

    async def go():
        await env.reset(env.task("train", 0))
        sandbox = env.sandbox
        close = sandbox.close

        async def slow_close():
            await asyncio.sleep(0.5)
            await close()

        sandbox.close = slow_close
        closing = asyncio.ensure_future(env._close_sandbox())
        await asyncio.sleep(0.1)
        closing.cancel()  # the episode's deadline, while its sandbox closes
        with contextlib.suppress(asyncio.CancelledError):
            await closing
        await env.close()  # waits for the close the cancellation left running
        return await sandbox.alive()

    assert run(go()) is False
