"""agentrl replay on stores the real agent loop wrote: the list, filters, transcripts of every
status, and every bad input answered with one line (never a traceback)."""

import asyncio
import copy
import gzip
import json
import re
import shutil
from io import StringIO

import pytest
from rich.console import Console

from agentrl.cli import main
from agentrl.env import Task
from agentrl.models import tiny_tokenizer
from agentrl.replay.episodes import ReplayError, find, parse_filter, read, resolve
from agentrl.replay.transcript import MASKED, TRAINED, list_view, transcript
from agentrl.rollout.agent_loop import LoopConfig, run_episode
from agentrl.rollout.engine import Generation
from agentrl.store import TrajectoryStore
from agentrl.trajectory import STATUSES, Trajectory, TurnSpan
from tests.rollout.fakes import EchoEnv, FixedEngine


class AbortingEngine(FixedEngine):
    """The server drops the request (``/abort_request``) after one good turn."""

    async def generate(self, input_ids, params):
        if self.calls:
            self.calls.append(list(input_ids))
            return Generation([], [], "abort", self.weight_version)
        return await super().generate(input_ids, params)


class ToolEnv(EchoEnv):
    """EchoEnv whose steps record tool calls the way the coding envs do (output, exit code)."""

    async def step(self, tool_calls):
        result = await super().step(tool_calls)
        result.info["tool_calls"] = [
            {
                "name": "bash",
                "arguments": {"command": f"ls [bold]{self.steps}"},
                "id": "c",
                "error": None,
                "output": f"listing {self.steps}",
                "exit_code": self.steps - 1,
            }
        ]
        return result


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def by_status(tok):
    """One trajectory of each status, each from the real loop with a fake env and engine."""
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    call = tok.encode(
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>',
        add_special_tokens=False,
    )
    words = tok.encode("word " * 40, add_special_tokens=False) + [eot]

    async def one(env, engine, **cfg):
        return await run_episode(env, engine, tok, Task("train-7"), LoopConfig(**cfg))

    async def go():
        runs = {
            "completed": one(ToolEnv(3), FixedEngine([*call, eot])),
            "max_turns": one(ToolEnv(10), FixedEngine([*call, eot]), max_turns=2),
            "truncated_context": one(EchoEnv(10), FixedEngine(words), max_context=150),
            "timeout": one(EchoEnv(10, step_delay=0.15), FixedEngine([eot]), deadline_s=0.2),
            "engine_error": one(EchoEnv(3), FixedEngine([eot], fail=RuntimeError("CUDA error"))),
            "env_error": one(EchoEnv(5, fail_at=2), FixedEngine([eot])),
            "aborted": one(EchoEnv(5), AbortingEngine([eot])),
        }
        return {k: await v for k, v in runs.items()}

    out = asyncio.run(go())
    assert {k: t.status for k, t in out.items()} == {k: k for k in out}
    assert set(out) == set(STATUSES)
    return out


@pytest.fixture
def store(tmp_path, by_status):
    """A run directory whose store holds the seven episodes (in STATUSES order), iterations 0 and 1."""
    path = tmp_path / "run" / "trajectories"
    with TrajectoryStore(path) as s:
        for i, status in enumerate(STATUSES):
            t = by_status[status]
            t.extra["iteration"] = i % 2
            if status == "completed":
                t.extra["grade"] = {"reward": 1.0, "applied": True, "output": "5 passed"}
            s.append(t)
    return path


def cli(capsys, *args):
    code = main(["replay", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_list_shows_every_episode_with_its_fields(store, capsys, by_status):
    code, out, err = cli(capsys, store.parent)  # a run directory
    assert code == 0 and err == ""
    rows = out.splitlines()[1:-1]
    assert len(rows) == len(STATUSES)
    for i, (row, status) in enumerate(zip(rows, STATUSES, strict=True)):
        t = by_status[status]
        turns = sum(s.role == "assistant" for s in t.turns)
        assert row.split() == [
            f"w0-00000:{i + 1}",
            "train-7",
            status,
            f"{t.reward:.3g}",
            str(turns),
            str(len(t)),
            str(t.num_trainable),
        ]
    assert out.splitlines()[-1].startswith("7 episodes (")
    assert cli(capsys, store)[1] == out  # the store itself


def test_a_store_copied_elsewhere_lists_the_same(store, tmp_path, capsys):
    copy = tmp_path / "elsewhere" / "copied"
    shutil.copytree(store, copy)
    assert cli(capsys, copy)[1].replace(str(copy), "") == cli(capsys, store)[1].replace(str(store), "")


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("status=timeout", ["timeout"]),
        ("status=timeout|max_turns", ["max_turns", "timeout"]),
        ("reward=0,status=engine_error|completed", ["engine_error"]),
        ("iteration=1", ["truncated_context", "timeout", "engine_error"]),
        ("task=train-*,status=aborted", ["aborted"]),
        ("status=completed,status=aborted", ["completed", "aborted"]),
    ],
)
def test_filters(store, capsys, spec, expected):
    code, out, _ = cli(capsys, store, "--filter", spec)
    assert code == 0
    assert [row.split()[2] for row in out.splitlines()[1:-1]] == sorted(expected, key=STATUSES.index)
    assert out.rstrip().endswith("of 7")


@pytest.mark.parametrize("status", STATUSES)
def test_each_status_replays(store, capsys, status, by_status):
    i = STATUSES.index(status) + 1
    code, out, err = cli(capsys, store, "--id", f"w0-00000:{i}")
    assert code == 0 and err == ""
    t = by_status[status]
    assert f"status {status} · reward {t.reward:g}" in out
    assert f"tokens {len(t)}: {t.num_trainable} trained, {len(t) - t.num_trainable} masked" in out
    assert len(re.findall(r"^turn \d+ ─", out, re.M)) == len(t.finish_reasons)
    if "error" in t.extra:
        assert f"error: {t.extra['error']}" in out


def test_transcript_shows_tool_calls_exit_codes_timings_and_the_grade(store, capsys, by_status):
    code, out, _ = cli(capsys, store, "--id", "w0-00000:1")
    t = by_status["completed"]
    assert code == 0
    assert "task train-7" in out  # the prompt's user message
    assert out.count("→ bash") == 3 and "listing 2" in out
    assert "exit 0" in out and "exit 1" in out and "exit 2" in out
    assert '"command": "ls [bold]1"' in out  # printed as text, never read as rich markup
    assert re.search(r"generate \d+\.\d\d s, tool \d+\.\d\d s", out)
    assert f"weights {t.weight_versions[0]}" in out
    assert "grading report:" in out and "  output: 5 passed" in out and "  applied: true" in out


def test_one_turn_and_its_bounds(store, capsys):
    code, out, _ = cli(capsys, store, "--id", "w0-00000:1", "--turn", "2")
    assert code == 0 and "\nturn 2 ─" in out and "turn 1 " not in out and "listing 2" in out
    assert "listing 1" not in out and "prompt" not in out
    code, _, err = cli(capsys, store, "--id", "w0-00000:1", "--turn", "4")
    assert code == 2 and err == "error: --turn 4: episode w0-00000:1 has 3 assistant turns (1 to 3)\n"
    code, _, err = cli(capsys, store, "--turn", "1")
    assert code == 2 and "--turn 1 needs --id" in err


def test_trained_and_masked_tokens_are_styled_apart(store, by_status):
    episodes, _ = read(store)
    styles = {}
    for name in (TRAINED, MASKED):
        probe = Console(file=StringIO(), force_terminal=True, color_system="standard")
        probe.print("x", style=name, end="")
        styles[name] = probe.file.getvalue().split("x")[0]
    assert styles[TRAINED] != styles[MASKED]
    console = Console(file=StringIO(), force_terminal=True, color_system="standard", width=200)
    transcript(console, episodes[0], tokens=True)
    text = console.file.getvalue()
    t = by_status["completed"]
    first = next(s for s in t.turns if s.role == "assistant")
    assert styles[TRAINED] + str(t.input_ids[first.start]) in text  # a sampled token id
    assert styles[MASKED] + str(t.input_ids[0]) in text  # a prompt token id
    assert styles[MASKED] + "listing 1" in text  # a tool's output


def test_unknown_id_suggests_close_ones(store, capsys):
    code, out, err = cli(capsys, store, "--id", "w0-00000:12")
    assert code == 2 and out == ""
    assert err.startswith("error: no episode 'w0-00000:12'") and re.search(r"closest: [^;]*w0-00000:1\b", err)
    assert "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "spec,message",
    [
        (
            "stauts=timeout",
            "--filter key 'stauts' is unknown (did you mean status?); valid keys: status, reward, iteration, task, env",
        ),
        ("status=timeot", "--filter status='timeot' is not a status (did you mean timeout?)"),
        ("reward=high", "--filter reward='high' is not a number"),
        ("iteration=1.5", "--filter iteration='1.5' is not an integer"),
        ("status", "--filter item 'status' is not key=value"),
        (",,,", "--filter ',,,' holds no key=value item, e.g. status=timeout,reward=0; keys: status, "),
    ],
)
def test_a_bad_filter_names_the_key_or_value(store, capsys, spec, message):
    code, out, err = cli(capsys, store, "--filter", spec)
    assert code == 2 and out == "" and err.startswith("error: " + message) and err.count("\n") == 1


def test_missing_empty_and_file_paths(tmp_path, capsys):
    code, _, err = cli(capsys, tmp_path / "nope")
    assert code == 2 and "nope does not exist; give a run directory" in err
    (tmp_path / "empty").mkdir()
    code, _, err = cli(capsys, tmp_path / "empty")
    assert code == 2 and "holds no trajectory shards (*.jsonl.gz): the store is empty" in err
    (tmp_path / "f.txt").write_text("x")
    code, _, err = cli(capsys, tmp_path / "f.txt")
    assert code == 2 and "is a file" in err
    for e in (err,):
        assert "Traceback" not in e


def test_a_filter_that_matches_nothing_says_so(store, capsys):
    code, out, err = cli(capsys, store, "--filter", "iteration=9")
    assert code == 1 and out == "" and "no episode of 7 matches --filter iteration=9" in err


def test_a_corrupted_shard_is_reported_with_file_and_line_and_the_rest_shown(store, capsys):
    shard = store / "w0-00000.jsonl.gz"
    members, data, pos = [], shard.read_bytes(), 0
    # the store writes one gzip member per record: find each member's bounds by re-compressing
    for t in TrajectoryStore(store).records():
        n = len(
            gzip.compress(json.dumps(t, separators=(",", ":")).encode() + b"\n", compresslevel=6, mtime=0)
        )
        members.append((pos, pos + n))
        pos += n
    assert pos == len(data)
    start, end = members[2]  # the third record: damage its compressed body
    broken = data[: start + 12] + bytes(b ^ 0xFF for b in data[start + 12 : end - 8]) + data[end - 8 :]
    shard.write_bytes(broken + b"\x1f\x8b\x08garbage")  # and a torn record at the end
    code, out, err = cli(capsys, store)
    assert code == 0
    warnings = err.splitlines()
    assert len(warnings) == 2
    assert warnings[0].startswith(f"warning: {store}/w0-00000.jsonl.gz line 3 (byte offset {start}): ")
    assert "line 8" in warnings[1] and "skipped" in warnings[1]
    ids = [row.split()[0] for row in out.splitlines()[1:-1]]
    assert ids == ["w0-00000:1", "w0-00000:2", *[f"w0-00000:{i}" for i in range(4, 8)]]
    assert out.splitlines()[-1].endswith("; 2 damaged records skipped")
    code, out, _ = cli(capsys, store, "--id", "w0-00000:4")
    assert code == 0 and "status timeout" in out


def test_a_json_object_that_is_not_a_trajectory_is_damage(tmp_path, capsys):
    with TrajectoryStore(tmp_path) as s:
        s.append({"hello": "world"})
        s.append(
            Trajectory(
                [1, 2],
                [0, 1],
                [0.0, -0.5],
                [TurnSpan(0, 1, "prompt"), TurnSpan(1, 2, "assistant")],
                task_id="t-1",
            )
        )
    episodes, damage = read(resolve(tmp_path))
    assert [e.id for e in episodes] == ["w0-00000:2"]
    assert [(d.line, d.why) for d in damage] == [(1, "not a trajectory record (missing 'input_ids')")]
    with pytest.raises(ReplayError, match=r"no episode 'w0-00000:1'"):
        find(episodes, "w0-00000:1", tmp_path)


def test_parse_filter_combines_keys_with_and():
    keep = parse_filter("status=completed,reward=1")
    episodes = [
        type("E", (), {"status": s, "reward": r})()
        for s, r in [("completed", 1.0), ("completed", 0.0), ("timeout", 1.0)]
    ]
    assert [keep(e) for e in episodes] == [True, False, False]


class GradedEnv(ToolEnv):
    """Ends with a grading report in its info, as the coding envs do."""

    async def step(self, tool_calls):
        result = await super().step(tool_calls)
        if result.done:
            result.info["grade"] = {"reward": self.reward, "applied": True, "output": "3 passed"}
        return result


def test_a_pool_store_records_the_iteration_and_the_grade(tmp_path, tok, capsys):
    from agentrl.rollout.pool import RolloutPool

    eot = tok.convert_tokens_to_ids("<|im_end|>")
    store = TrajectoryStore(tmp_path / "trajectories")
    pool = RolloutPool(
        lambda: GradedEnv(2), FixedEngine([eot]), tok, store=store, n_samples=2, progress=False
    )
    for iteration in (0, 1):
        asyncio.run(pool.run([Task(f"train-{iteration}")], extra={"iteration": iteration}))
    store.close()
    code, out, _ = cli(capsys, tmp_path, "--filter", "iteration=1")
    rows = out.splitlines()[1:-1]
    assert code == 0 and len(rows) == 2 and {r.split()[1] for r in rows} == {"train-1"}
    code, out, _ = cli(capsys, tmp_path, "--id", rows[0].split()[0])
    assert code == 0 and "grading report:" in out and "output: 3 passed" in out and "iteration 1" in out


def test_the_fast_read_matches_parsing_every_record_whole(store, tmp_path):
    from agentrl.replay.episodes import _fields

    texts = [t for *_, t in TrajectoryStore(store).scan(parse=False)]
    assert len(texts) == len(STATUSES)
    for text in texts:
        whole = json.loads(text)
        fields, tokens, trained = _fields(text)
        assert (tokens, trained) == (len(whole["input_ids"]), sum(whole["loss_mask"]))
        assert fields == {
            k: v for k, v in whole.items() if k not in ("input_ids", "loss_mask", "rollout_logprobs")
        }
    # fields in another order (another writer): parsed whole, the same counts
    reordered = dict(reversed(list(json.loads(texts[0]).items())))
    other = tmp_path / "other"
    with TrajectoryStore(other) as s:
        s.append(reordered)
        s.append(
            {**reordered, "loss_mask": [2] * len(reordered["input_ids"])}
        )  # counted wrong fast: parsed whole
    episodes, damage = read(other)
    whole = json.loads(texts[0])
    assert [(e.tokens, e.trained) for e in episodes] == [
        (len(whole["input_ids"]), sum(whole["loss_mask"])),
        (len(whole["input_ids"]), 2 * len(whole["input_ids"])),
    ]
    assert damage == []


def test_a_record_whose_json_breaks_after_the_tokens_is_damage(tmp_path, by_status, capsys):
    text = by_status["completed"].to_record()
    line = json.dumps(text, separators=(",", ":")).encode()
    broken = line[: line.index(b',"status"')] + b',"status":}\n'
    path = tmp_path / "s"
    path.mkdir()
    (path / "w0-00000.jsonl.gz").write_bytes(gzip.compress(broken) + gzip.compress(line + b"\n"))
    code, out, err = cli(capsys, path)
    assert code == 0 and "w0-00000.jsonl.gz line 1 (byte offset 0): not a trajectory record" in err
    assert out.splitlines()[1].split()[0] == "w0-00000:2"


def test_html_is_one_self_contained_page_with_tokens_styled_by_mask(store, tmp_path, capsys, by_status):
    out_file = tmp_path / "episode.html"
    code, out, _ = cli(capsys, store, "--id", "w0-00000:1", "--html", out_file)
    assert code == 0 and out == f"wrote {out_file}\n"
    page = out_file.read_text()
    assert page.startswith("<!DOCTYPE html>") and "listing 3" in page
    assert not re.search(r"(src|href)=|https?://|@import", page)  # nothing fetched from anywhere
    t = by_status["completed"]
    spans = {s.role: s for s in t.turns}
    styles = set()
    for i in (spans["prompt"].start, spans["assistant"].start):
        m = re.search(rf'<span class="tok" data-i="{i}" style="([^"]*)">{t.input_ids[i]} </span>', page)
        assert m, i
        styles.add(m.group(1))
    assert len(styles) == 2  # trained and masked ids styled apart (no tokenizer saved: ids shown)
    code, _, err = cli(capsys, store, "--html", out_file)
    assert code == 2 and "needs --id" in err
    code, _, err = cli(capsys, store, "--id", "w0-00000:1", "--turn", "1", "--html", out_file)
    assert code == 2 and "--turn 1 chooses what the terminal transcript shows; --html " in err
    code, _, err = cli(capsys, store, "--id", "w0-00000:1", "--html", tmp_path / "no" / "x.html")
    assert code == 2 and err.startswith("error: --html ") and "No such file or directory" in err


def test_a_store_with_no_intact_episode_says_so(tmp_path, capsys):
    (tmp_path / "w0-00000.jsonl.gz").write_bytes(b"")  # a writer opened it, nothing written yet
    code, out, err = cli(capsys, tmp_path)
    assert code == 1 and out == "" and err == f"{tmp_path}: the store holds no episodes yet\n"
    (tmp_path / "w0-00000.jsonl.gz").write_bytes(gzip.compress(b"[1, 2]\n") + b"\x1f\x8b\x08 torn")
    code, out, err = cli(capsys, tmp_path)
    lines = err.splitlines()
    assert code == 2 and out == "" and len(lines) == 3
    assert (
        lines[0].startswith("warning: ")
        and "line 1 (byte offset 0): not a trajectory record (a JSON list, not an object)" in lines[0]
    )
    assert "line 2" in lines[1]
    assert lines[2] == (
        f"error: {tmp_path}: no intact episode (2 damaged records, each named above); "
        "restore its shards from a copy, or give another store"
    )
    (tmp_path / "w0-00000.jsonl.gz").write_bytes(gzip.compress(b"garbage\n"))
    code, out, err = cli(capsys, tmp_path)
    assert code == 2 and out == "" and len(err.splitlines()) == 2
    assert err.splitlines()[1].startswith(f"error: {tmp_path}: no intact episode (1 damaged record, ")


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--reexec", "--from-turn", "2"], "--reexec and --from-turn 2"),
        (["--from-turn", "2", "--html", "x.html"], "--from-turn 2 and --html x.html"),
    ],
)
def test_reexec_from_turn_and_html_are_one_at_a_time(store, capsys, flags, named):
    code, out, err = cli(capsys, store, "--id", "w0-00000:1", *flags)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"error: {named} cannot be combined: ") and err.endswith("; give one\n")


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--turn", "2", "--reexec"], "--turn 2; --reexec"),
        (["--tokens", "--from-turn", "2"], "--tokens; --from-turn 2"),
        (["--turn", "1", "--tokens", "--reexec"], "--turn 1 and --tokens; --reexec"),
    ],
)
def test_transcript_options_beside_an_action_that_prints_none_are_refused(store, capsys, flags, named):
    code, out, err = cli(capsys, store, "--id", "w0-00000:1", *flags)
    head, action = named.split("; ")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err == (
        f"error: {head} chooses what the terminal transcript shows; {action} prints no transcript, "
        "so give it alone\n"
    )
    code, out, err = cli(capsys, store, "--tokens")
    assert code == 2 and out == "" and err == "error: --tokens needs --id: which episode to show?\n"


def test_filter_and_id_together_is_an_input_error(store, capsys):
    code, _, err = cli(capsys, store, "--id", "w0-00000:1", "--filter", "status=completed")
    assert code == 2 and err == "error: --filter chooses the episodes to list; give it without --id\n"


def stored(tmp_path, *records):
    """A store in ``tmp_path/s`` holding ``records`` (dicts, written as they are, not validated)."""
    path = tmp_path / "s"
    with TrajectoryStore(path) as s:
        for record in records:
            s.append(record)
    return path


def test_a_record_whose_spans_break_the_invariants_cannot_be_shown(tmp_path, capsys, by_status):
    record = by_status["completed"].to_record()
    n = len(record["input_ids"])
    quoted = [dict(s) for s in record["turns"]]
    quoted[1]["role"] = 'assistant" onmouseover="alert(1)'
    past = [dict(s) for s in record["turns"]]
    past[-1]["end"] = n + 5
    path = stored(tmp_path, {**record, "turns": quoted}, {**record, "turns": past})
    for i, why in ((1, "turns[1].role = 'assistant\" onmouseover="), (2, f"input_ids has {n} tokens")):
        for flags in ([], ["--tokens"], ["--html", tmp_path / "x.html"]):
            code, out, err = cli(capsys, path, "--id", f"w0-00000:{i}", *flags)
            assert code == 2 and out == "" and err.count("\n") == 1, (i, flags, err)
            assert err.startswith(f"error: episode w0-00000:{i} cannot be shown: ") and why in err
    assert not (tmp_path / "x.html").exists()


def test_the_page_escapes_a_span_role_even_where_the_record_is_not_checked(tmp_path, monkeypatch, by_status):
    from agentrl.replay.html import page

    record = by_status["completed"].to_record()
    turns = [dict(s) for s in record["turns"]]
    turns[1]["role"] = 'assistant" onmouseover="alert(1)'
    (episode,), _ = read(stored(tmp_path, {**record, "turns": turns}))
    monkeypatch.setattr(Trajectory, "validate", lambda self: self)
    html = page(episode)
    assert 'data-role="assistant&quot; onmouseover=&quot;alert(1)"' in html
    assert 'onmouseover="' not in html


def test_control_characters_in_what_the_agent_and_tools_wrote_are_shown_escaped(tmp_path, by_status):
    bad = "red \x1b[31mtext\x1b[0m, title \x1b]0;x\x07, csi \x9b2J, cr \r back\nline 2"
    shown = r"red \x1b[31mtext\x1b[0m, title \x1b]0;x\x07, csi \x9b2J, cr \x0d back" + "\nline 2"
    t = copy.deepcopy(by_status["completed"])
    t.task_id = f"task {bad}"
    t.messages = [{"role": "user", "content": bad}, {"role": "assistant", "content": bad}]
    t.tool_calls = [
        {"turn": 0, "name": f"bash{bad}", "arguments": {"command": bad}, "output": bad, "error": bad}
    ]
    t.extra = {"error": bad, "grade": {bad: bad}, bad: bad}
    store = stored(tmp_path, t.to_record())
    episodes, _ = read(store)
    console = Console(
        file=StringIO(), width=400, highlight=False, soft_wrap=True
    )  # not a terminal: no styles
    transcript(console, episodes[0])
    text = console.file.getvalue()
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", text)  # no control character but \t \n
    assert text.count(shown) >= 4  # the prompt, the assistant, the tool output, the error
    assert r"bash" + shown.split("\n")[0] in text
    listed = StringIO()
    list_view(listed, episodes)
    assert r"task red \x1b[31m" in listed.getvalue() and "\x1b" not in listed.getvalue()


def test_a_file_of_the_store_that_cannot_be_read_is_named(store, capsys):
    (store / "x.jsonl.gz").mkdir()
    code, out, err = cli(capsys, store)
    assert code == 2 and out == ""
    assert err == (
        f"error: cannot read {store / 'x.jsonl.gz'}: Is a directory; a store reads every *.jsonl.gz in "
        "it as a shard: make it readable, or move it out\n"
    )


def test_a_lone_surrogate_in_the_text_is_written_escaped_into_the_page(tmp_path, capsys, by_status):
    t = copy.deepcopy(by_status["completed"])
    t.messages[-1]["content"] = "bytes \udcff that were not UTF-8"
    path = stored(tmp_path, t.to_record())
    out_file = tmp_path / "page.html"
    code, out, err = cli(capsys, path, "--id", "w0-00000:1", "--html", out_file)
    assert code == 0 and err == "" and out == f"wrote {out_file}\n"
    assert "bytes \\udcff that were not UTF-8" in out_file.read_text(encoding="utf-8")


def test_a_record_whose_extra_is_not_a_json_object_is_damage(tmp_path, capsys, by_status):
    record = by_status["completed"].to_record()
    good = {**record, "extra": json.dumps({"iteration": 1})}
    path = stored(tmp_path, {**record, "extra": "[1"}, {**record, "extra": "[1]"}, good)
    code, out, err = cli(capsys, path, "--filter", "iteration=1")
    assert code == 0 and [row.split()[0] for row in out.splitlines()[1:-1]] == ["w0-00000:3"]
    warnings = err.splitlines()
    assert len(warnings) == 2
    assert "line 1 (byte offset 0): not a trajectory record (extra is not JSON: Expecting " in warnings[0]
    assert "line 2 " in warnings[1] and "(extra is a JSON list, not an object); skipped" in warnings[1]


def test_seed_without_from_turn_is_an_input_error(store, capsys):
    code, out, err = cli(capsys, store, "--id", "w0-00000:1", "--seed", "3")
    assert code == 2 and out == ""
    assert err == "error: --seed 3 is for --from-turn: the sampling seed of the re-run\n"
