"""agentrl replay --reexec: the recorded tool calls run again in a fresh env, the first divergence
found. End to end with a real environment from another package (linecount-v0) in a real
bubblewrap sandbox; the comparison's cases with fake envs."""

import asyncio
import gzip
import json

import pytest

from agentrl.cli import main
from agentrl.env import StepResult, Task, make
from agentrl.models import tiny_tokenizer
from agentrl.replay.episodes import ReplayError
from agentrl.replay.reexec import describe, env_turn_limit, find_task, reexec
from agentrl.rollout.agent_loop import LoopConfig, run_episode
from agentrl.rollout.scripted import ScriptedEngine
from agentrl.store import TrajectoryStore
from tests.rollout.fakes import EchoEnv, FixedEngine

pytest.importorskip("agentrl_example_env", reason="make setup installs tests/example_env")


def bash(command: str) -> str:
    return f'<tool_call>\n{{"name": "bash", "arguments": {{"command": "{command}"}}}}\n</tool_call>'


SUBMIT = '<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def needs_bwrap():
    from agentrl.sandboxes.local import bwrap_works

    works, why = bwrap_works()
    if not works:
        pytest.skip(f"bubblewrap cannot run here: {why}")


def record(tok, env_id: str, task: Task, script: list[str], store, **cfg):
    env = make(env_id, sandbox="local")
    engine = ScriptedEngine(tok, script=script)
    t = asyncio.run(run_episode(env, engine, tok, task, LoopConfig(**cfg)))
    with TrajectoryStore(store) as s:
        s.append(t)
    return t


def test_a_deterministic_episode_replays_identically_and_a_clock_diverges(tmp_path, tok, capsys):
    needs_bwrap()
    env = make("linecount-v0", sandbox="local")
    task = env.tasks("train")[3]
    store = tmp_path / "store"
    good = record(
        tok,
        "linecount-v0",
        task,
        [bash("cat data.txt"), bash("wc -l < data.txt > answer.txt"), SUBMIT],
        store,
    )
    assert good.reward == 1.0 and good.status == "completed"
    assert good.extra["task_data"] == task.data  # the loop stored the task's data with the episode
    record(tok, "linecount-v0", task, [bash("ls"), bash("date +%s%N"), bash("true"), SUBMIT], store)

    assert main(["replay", str(store), "--id", "w0-00000:1", "--reexec", "--sandbox", "local"]) == 0
    out = capsys.readouterr().out
    assert "replayed 3 turns, 3 tool calls" in out
    assert (
        "identical: every exit code, output and observation as recorded; the env gave reward 1 (recorded 1)"
        in out
    )

    # The clock's output differs on the second turn: the replay stops there and shows both values.
    assert main(["replay", str(store), "--id", "w0-00000:2", "--reexec", "--sandbox", "local"]) == 1
    out = capsys.readouterr().out
    assert "replayed 2 turns, 2 tool calls" in out
    assert "first divergence: turn 2: observation differs" in out
    assert "--- recorded" in out and "+++ re-executed" in out


def test_a_changed_recording_is_found_at_its_turn(tmp_path, tok, capsys):
    """The store is edited (the first observation of episode 1 rewritten): replay finds it on turn 1."""
    needs_bwrap()
    env = make("linecount-v0", sandbox="local")
    task = env.tasks("test")[0]
    store = tmp_path / "store"
    record(tok, "linecount-v0", task, [bash("cat data.txt"), SUBMIT], store)
    shard = next(store.glob("*.jsonl.gz"))
    record_ = json.loads(gzip.decompress(shard.read_bytes()))
    messages = (
        json.loads(record_["messages"]) if isinstance(record_["messages"], str) else record_["messages"]
    )
    tool = next(m for m in messages if m["role"] == "tool")
    tool["content"] = "item 0\n[exit code 0]"
    record_["messages"] = json.dumps(messages) if isinstance(record_["messages"], str) else messages
    shard.write_bytes(gzip.compress((json.dumps(record_) + "\n").encode()))

    assert main(["replay", str(store), "--id", "w0-00000:1", "--reexec", "--sandbox", "local"]) == 1
    out = capsys.readouterr().out
    assert "first divergence: turn 1: observation differs" in out
    assert '-  "content": "item 0\\n[exit code 0]"' in out


class CountingEnv(EchoEnv):
    """Records its tool calls like the coding envs; the exit code of call 2 of each step flips with
    a counter kept across episodes (state an env should not carry, a cause of divergence)."""

    runs = 0

    async def reset(self, task):
        CountingEnv.runs += 1
        return await super().reset(task)

    async def step(self, tool_calls):
        result = await super().step(tool_calls)
        result.info["tool_calls"] = [
            {"name": c.name, "arguments": c.arguments, "output": f"ran {c.name}", "exit_code": 0}
            for c in tool_calls
        ]
        if len(tool_calls) > 1:
            result.info["tool_calls"][1]["exit_code"] = CountingEnv.runs % 2
        return result


def episode(tok, env, texts: list[str], **cfg):
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    engine = FixedEngine([*tok.encode("\n".join(texts), add_special_tokens=False), eot])
    return asyncio.run(run_episode(env, engine, tok, Task("train-2", {"n": 2}), LoopConfig(**cfg)))


def test_the_first_differing_exit_code_is_named_by_turn_and_call(tok):
    t = episode(tok, CountingEnv(3), [bash("ls"), bash("pwd")])
    assert t.status == "completed" and len(t.tool_calls) == 6  # 3 turns of 2 calls
    result = asyncio.run(reexec(CountingEnv(3), t, find_task(CountingEnv(3), t, ["train"])))
    d = result.divergence
    assert (d.turn, d.call, d.name, d.what, d.recorded, d.now) == (1, 2, "bash", "exit_code", 1, 0)
    assert "first divergence: turn 1, call 2 (bash): exit_code differs" in describe(result, t)


def test_an_episode_the_loop_cut_short_is_replayed_up_to_where_it_stopped(tok):
    t = episode(tok, EchoEnv(10), [bash("ls")], max_turns=2)
    assert t.status == "max_turns"
    result = asyncio.run(reexec(EchoEnv(10), t, Task("train-2", {"n": 2})))
    assert result.divergence is None and result.turns == 2
    assert result.notes == ["the recorded episode ended max_turns; the env did not end it, as recorded"]
    # An env that now ends the episode early diverges there.
    result = asyncio.run(reexec(EchoEnv(1), t, Task("train-2", {"n": 2})))
    assert (result.divergence.turn, result.divergence.what) == (1, "end")


def test_an_env_that_raises_on_replay_is_a_divergence_unless_it_raised_so_when_recorded(tok):
    t = episode(tok, EchoEnv(5, fail_at=2), [bash("ls")])
    assert t.status == "env_error"
    again = asyncio.run(reexec(EchoEnv(5, fail_at=2), t, Task("train-2")))
    assert again.divergence is None and again.turns == 1
    now = asyncio.run(reexec(EchoEnv(5, fail_at=1), t, Task("train-2")))
    assert (now.divergence.turn, now.divergence.what) == (1, "error")
    assert now.divergence.now == "RuntimeError: the environment broke"


def test_a_task_without_stored_data_is_searched_for_and_a_missing_one_named(tok):
    t = episode(tok, EchoEnv(2), [bash("ls")])
    del t.extra["task_data"]
    assert find_task(EchoEnv(), t, ["test", "train"]) == Task("train-2", {})
    t.task_id = "train-99"
    with pytest.raises(ReplayError, match=r"task 'train-99' of environment echo-v0 is in none of its splits"):
        find_task(EchoEnv(), t, ["train", "test", "nope"])


def test_reexec_input_errors_are_one_line(tmp_path, tok, capsys):
    store = tmp_path / "store"
    t = episode(tok, EchoEnv(2), [bash("ls")])
    with TrajectoryStore(store) as s:
        s.append(t)
    assert main(["replay", str(store), "--reexec"]) == 2
    assert "--reexec needs --id" in capsys.readouterr().err
    assert main(["replay", str(store), "--sandbox", "local"]) == 2
    assert "--sandbox local is for --reexec" in capsys.readouterr().err
    # echo-v0 is a test double, not a registered environment: the registry's message names it.
    assert main(["replay", str(store), "--id", "w0-00000:1", "--reexec"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "echo-v0" in err and len(err.splitlines()) == 1
    # A run directory whose settings this version does not read, or are not JSON: named, one line.
    run = tmp_path / "run" / "trajectories"
    with TrajectoryStore(run) as s:
        s.append(t)
    for settings, named in [
        (
            '{"env": {"id": "echo-v0"}, "algo": {"kl_coeff": 0.1}}',
            "unknown key 'algo.kl_coeff'. Did you mean 'algo.kl_coef'?",
        ),
        ('{"env": ', "Expecting value"),
    ]:
        (run.parent / "config.json").write_text(settings)
        assert main(["replay", str(run), "--id", "w0-00000:1", "--reexec"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {run.parent / 'config.json'} is not a run config this version reads (")
        assert named in err and len(err.splitlines()) == 1 and "pydantic" not in err, err


def test_a_bugfix_episode_replays_identically_until_its_task_file_is_altered(
    tmp_path, tok, capsys, monkeypatch
):
    """The expert's bugfix-v0 episode (tests, view, fix, tests, submit) through the real loop in a
    bubblewrap sandbox: zero divergences; with the buggy file altered (one line added on top), the
    view of turn 2 is the first to differ."""
    needs_bwrap()
    import dataclasses

    from agentrl.envs.bugfix import BugfixEnv
    from agentrl.rollout.scripted import play_demonstration

    env = make("bugfix-v0", sandbox="local")
    task = env.tasks("test")[5]
    demo = env.demonstration(task)
    t = asyncio.run(play_demonstration(env, tok, task, demo, LoopConfig(max_turns=8)))
    assert t.status == "completed" and t.reward == demo.reward
    store = tmp_path / "store"
    with TrajectoryStore(store) as s:
        s.append(t)
    replay = ["replay", str(store), "--id", "w0-00000:1", "--reexec", "--sandbox", "local"]
    assert main(replay) == 0
    out = capsys.readouterr().out
    assert "replayed 5 turns, 5 tool calls" in out and "identical:" in out

    generate = BugfixEnv._generate

    def altered(self, split, index):
        spec = generate(self, split, index)
        files = dict(spec.files)
        files[spec.fix["path"]] = "# altered\n" + files[spec.fix["path"]]
        return dataclasses.replace(spec, files=files)

    monkeypatch.setattr(BugfixEnv, "_generate", altered)
    assert main(replay) == 1
    out = capsys.readouterr().out
    assert "first divergence: turn 2, call 1 (str_replace_editor): output differs" in out
    assert "+     1\t# altered" in out and "replayed 2 turns, 2 tool calls" in out


def test_durations_tools_print_are_not_divergences_unless_exact(tok):
    """pytest and unittest print their wall-clock time; it differs on every run."""

    class TimedEnv(EchoEnv):
        runs = 0

        async def step(self, tool_calls):
            TimedEnv.runs += 1
            result = await super().step(tool_calls)
            result.info["tool_calls"] = [
                {
                    "name": "bash",
                    "output": f"3 passed in 0.0{TimedEnv.runs}s\nRan 3 tests in 0.00{TimedEnv.runs}s",
                    "exit_code": 0,
                }
            ]
            return result

    t = episode(tok, TimedEnv(2), [bash("pytest")])
    assert asyncio.run(reexec(TimedEnv(2), t, Task("train-2", {"n": 2}))).divergence is None
    exact = asyncio.run(reexec(TimedEnv(2), t, Task("train-2", {"n": 2}), exact=True)).divergence
    assert (exact.turn, exact.what) == (1, "output")


class LimitedEnv(EchoEnv):
    """Ends the episode itself at its turn limit with status max_turns, as the coding envs do."""

    def __init__(self, max_turns: int):
        super().__init__(episode_len=100)
        self.max_turns = max_turns

    async def step(self, tool_calls):
        result = await super().step(tool_calls)
        if self.steps >= self.max_turns:
            return StepResult([], 0.5, True, {"status": "max_turns"})
        return result


def test_an_episode_the_env_ended_at_its_turn_limit_replays_identically_under_that_limit(tok):
    t = episode(tok, LimitedEnv(2), [bash("ls")], max_turns=2)
    assert t.status == "max_turns" and t.reward == 0.5 and env_turn_limit(t) == 2
    result = asyncio.run(reexec(LimitedEnv(2), t, Task("train-2", {"n": 2})))
    assert result.divergence is None and result.turns == 2 and result.reward == 0.5
    # Ended by the loop's limit while the env went on: an env that now ends it there differs.
    cut = episode(tok, LimitedEnv(5), [bash("ls")], max_turns=2)
    assert cut.status == "max_turns" and env_turn_limit(cut) is None
    d = asyncio.run(reexec(LimitedEnv(2), cut, Task("train-2", {"n": 2}))).divergence
    assert (d.turn, d.what) == (2, "end") and "by the loop's turn limit" in d.recorded


@pytest.mark.parametrize("run_dir", [False, True])
def test_a_bugfix_episode_that_ended_max_turns_replays_identically(tmp_path, tok, capsys, run_dir):
    """The real env ends the episode at rollout.max_turns, as the loop does: no divergence, from a
    run directory (its config gives the limit) or a bare store (the episode shows it)."""
    needs_bwrap()
    from agentrl.config import TrainConfig

    env = make("bugfix-v0", sandbox="local", max_turns=2)
    task = env.tasks("train")[0]
    engine = ScriptedEngine(tok, script=[bash("ls"), bash("ls")])
    t = asyncio.run(run_episode(env, engine, tok, task, LoopConfig(max_turns=2)))
    assert t.status == "max_turns"
    store = tmp_path / "run" / "trajectories" if run_dir else tmp_path / "store"
    with TrajectoryStore(store) as s:
        s.append(t)
    if run_dir:
        cfg = TrainConfig.model_validate(
            {"env": {"id": "bugfix-v0"}, "sandbox": {"kind": "local"}, "rollout": {"max_turns": 2}}
        )
        (store.parent / "config.json").write_text(cfg.model_dump_json())
    assert main(["replay", str(store), "--id", "w0-00000:1", "--reexec", "--sandbox", "local"]) == 0
    out = capsys.readouterr().out
    assert "replayed 2 turns, 2 tool calls" in out and "identical:" in out


def test_a_bare_store_rebuilds_the_env_with_the_turn_limit_the_episode_ran_under(tmp_path, tok, capsys):
    """An episode that ran past the env's default turn limit (12) and completed: a bare store has no
    config, so the limit comes from the episode; under the default the env would end it at turn 12."""
    needs_bwrap()
    env = make("bugfix-v0", sandbox="local", max_turns=14)
    task = env.tasks("train")[0]
    engine = ScriptedEngine(tok, script=[bash("ls")] * 12 + [SUBMIT])
    t = asyncio.run(run_episode(env, engine, tok, task, LoopConfig(max_turns=14)))
    assert t.status == "completed" and t.extra["max_turns"] == 14 and env_turn_limit(t) is None
    with TrajectoryStore(tmp_path / "store") as s:
        s.append(t)
    assert (
        main(["replay", str(tmp_path / "store"), "--id", "w0-00000:1", "--reexec", "--sandbox", "local"]) == 0
    )
    out = capsys.readouterr().out
    assert "max_turns 14 (as the episode recorded it)" in out
    assert "replayed 13 turns, 13 tool calls" in out and "identical:" in out
