"""Rendering stored episodes for a terminal: the list view and one episode's transcript (rich).

The transcript goes turn by turn: the assistant's text (the tokens the policy sampled and is
trained on, style ``trained``), then its tool calls and what they returned, with exit codes and
the turn's generate and tool seconds (style ``masked``: observations are never trained on), then
the episode's status, reward, token counts and the grading report when one was recorded.
Everything the agent or a tool wrote is printed as plain text, never read as rich markup, with
its control characters but newline and tab shown escaped (``\x1b``): an escape sequence in a
model's text or a tool's output would otherwise act on the terminal that shows it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from typing import Any, TextIO

from rich.console import Console
from rich.rule import Rule
from rich.text import Text

from agentrl.replay.episodes import Damage, Episode, ReplayError
from agentrl.trajectory import NOT_TRAINABLE, STATUSES, Trajectory

TRAINED = "bold green"
"""Style of text and token ids the policy sampled (loss mask 1)."""
MASKED = "dim"
"""Style of prompt and observation text and ids (loss mask 0)."""
STATUS_STYLE = {
    s: "green" if s == "completed" else "red" if s in NOT_TRAINABLE else "yellow" for s in STATUSES
}
MAX_LINES = 40
"""Lines of one message or tool output shown; the rest is counted, not printed."""
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c not in (0x09, 0x0A)}


def plain(text: object) -> str:
    """``text`` with its control characters (C0, DEL, C1) but newline and tab escaped, ``\\x1b``."""
    return str(text).translate(_CONTROL)


# -- list view --
def list_view(out: TextIO, episodes: Iterable[Episode]) -> Counter:
    """One line per episode (id, task, status, reward, turns, tokens); plain text, so that 10,000 lines
    print in well under a second and pipe into grep. Returns the status counts."""
    counts: Counter = Counter()
    lines = [
        f"{'id':<16} {'task':<28} {'status':<17} {'reward':>7} {'turns':>5} {'tokens':>7} {'trained':>7}"
    ]
    for e in episodes:
        counts[e.status] += 1
        lines.append(
            f"{e.id:<16} {plain(e.task):<28} {plain(e.status):<17} {e.reward:>7.3g} {e.turns:>5} {e.tokens:>7} {e.trained:>7}"
        )
    out.write("\n".join(lines) + "\n")
    return counts


def summary_line(counts: Counter, damage: list[Damage]) -> str:
    total = sum(counts.values())
    parts = ", ".join(f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    text = f"{total} episode{'s' * (total != 1)}" + (f" ({parts})" if parts else "")
    if damage:
        text += f"; {len(damage)} damaged record{'s' * (len(damage) != 1)} skipped"
    return text


# -- transcript --
def _clip(text: str, max_lines: int = MAX_LINES) -> str:
    text = plain(text)
    lines = text.splitlines()
    if len(lines) <= max_lines:
        return text.rstrip("\n")
    return "\n".join(lines[:max_lines]) + f"\n… {len(lines) - max_lines} more lines"


def turn_messages(messages: list[dict[str, Any]]) -> tuple[list[dict], list[tuple[dict, list[dict]]]]:
    """Split the chat into the prompt's messages and, per assistant message, it and what followed it."""
    prompt: list[dict] = []
    turns: list[tuple[dict, list[dict]]] = []
    for m in messages:
        if m.get("role") == "assistant":
            turns.append((m, []))
        elif turns:
            turns[-1][1].append(m)
        else:
            prompt.append(m)
    return prompt, turns


def _seconds(timing: dict[str, float]) -> str:
    parts = [f"{name.removesuffix('_s')} {value:.2f} s" for name, value in timing.items()]
    return ", ".join(parts)


def _tokens(trajectory: Trajectory, start: int, end: int) -> Text:
    text = Text()
    for i in range(start, end):
        text.append(str(trajectory.input_ids[i]), TRAINED if trajectory.loss_mask[i] else MASKED)
        text.append(" ")
    return text


def _span_counts(trajectory: Trajectory, start: int, end: int) -> str:
    trained = sum(trajectory.loss_mask[start:end])
    return f"tokens [{start}, {end}): {trained} trained, {end - start - trained} masked"


def _message(console: Console, m: dict[str, Any]) -> None:
    who = plain(str(m.get("role", "?")) + (f" ({m['name']})" if m.get("name") else ""))
    console.print(Text(f"{who}:", style="bold"), Text(_clip(str(m.get("content", ""))), style=MASKED))


def _tool_call(console: Console, call: dict[str, Any]) -> None:
    args = json.dumps(call.get("arguments", {}), ensure_ascii=False)
    head = Text("→ ", style="cyan")
    head.append(plain(call.get("name") or "invalid"), style="bold cyan")
    head.append(f" {plain(args)}")
    console.print(head)
    if call.get("error"):
        console.print(Text(f"  malformed call: {plain(call['error'])}", style="red"))
    exit_code = call.get("exit_code")
    status = Text("  ")
    if exit_code is None:
        status.append("exit code: not recorded", style=MASKED)
    else:
        status.append(f"exit {exit_code}", style="green" if exit_code == 0 else "red")
    if "duration_s" in call:
        status.append(f" · {call['duration_s']:.2f} s", style=MASKED)
    console.print(status)
    if "output" in call:
        console.print(Text(_clip(str(call["output"])), style=MASKED), style=MASKED)


def transcript(console: Console, episode: Episode, *, turn: int | None = None, tokens: bool = False) -> None:
    """Print one episode turn by turn (``turn``: only that one, counted from 1), then its outcome."""
    t = episode.trajectory()
    prompt, turns = turn_messages(t.messages)
    spans = [s for s in t.turns if s.role == "assistant"]
    n = max(len(turns), len(spans), len(t.finish_reasons))
    if turn is not None and not 1 <= turn <= n:
        raise ReplayError(
            f"--turn {turn}: episode {episode.id} has {n} assistant turn{'s' * (n != 1)}"
            + (f" (1 to {n})" if n else "")
        )
    calls: dict[int, list[dict]] = {}
    for call in t.tool_calls:
        calls.setdefault(int(call.get("turn", -1)), []).append(call)
    observations = {s.start: s for s in t.turns if s.role == "tool"}

    console.print(Rule(Text(plain(f"{episode.id}  {t.env_id}  {t.task_id}"), style="bold")))
    console.print(
        Text("style: ", style="bold"),
        Text("trained (loss mask 1)", style=TRAINED),
        Text(" · "),
        Text("masked (loss mask 0)", style=MASKED),
    )
    if turn is None:
        first = next((s for s in t.turns if s.role == "prompt"), None)
        console.print(Rule(Text("prompt", style="bold"), align="left"))
        if first:
            console.print(Text(_span_counts(t, first.start, first.end), style=MASKED))
        for m in prompt:
            _message(console, m)
        if tokens and first:
            console.print(_tokens(t, first.start, first.end))
    for k in range(n):
        if turn is not None and k != turn - 1:
            continue
        span = spans[k] if k < len(spans) else None
        head = []
        if span:
            head.append(_span_counts(t, span.start, span.end))
        if k < len(t.finish_reasons):
            head.append(f"finish {t.finish_reasons[k]}")
        if k < len(t.weight_versions):
            head.append(f"weights {t.weight_versions[k]}")
        if k < len(t.timings):
            head.append(_seconds(t.timings[k]))
        console.print(Rule(Text(f"turn {k + 1}", style="bold"), align="left"))
        console.print(Text(plain(" · ".join(head)), style=MASKED))
        message, after = turns[k] if k < len(turns) else ({}, [])
        console.print(
            Text("assistant:", style="bold"), Text(_clip(str(message.get("content", ""))), style=TRAINED)
        )
        if tokens and span:
            console.print(_tokens(t, span.start, span.end))
        for call in calls.get(k, []):
            _tool_call(console, call)
        # Observations the tool records do not hold (a reminder, another env's messages).
        recorded = bool(calls.get(k))
        for m in after:
            if not (recorded and m.get("role") == "tool"):
                _message(console, m)
        obs = observations.get(span.end) if span else None
        if obs:
            console.print(Text(f"  observation {_span_counts(t, obs.start, obs.end)}", style=MASKED))
            if tokens:
                console.print(_tokens(t, obs.start, obs.end))
    _outcome(console, t)


def _outcome(console: Console, t: Trajectory) -> None:
    console.print(Rule(Text("outcome", style="bold"), align="left"))
    line = Text("status ", style="bold")
    line.append(t.status, style=STATUS_STYLE.get(t.status, ""))
    line.append(f" · reward {t.reward:g} · tokens {len(t)}: ")
    line.append(f"{t.num_trainable} trained", style=TRAINED)
    line.append(", ")
    line.append(f"{len(t) - t.num_trainable} masked", style=MASKED)
    line.append(f" · {len(t.finish_reasons)} turns · {len(t.tool_calls)} tool calls")
    console.print(line)
    extra = dict(t.extra)
    for key in ("error", "grade_error", "close_error"):
        if key in extra:
            console.print(Text(f"{key.replace('_', ' ')}: {plain(extra.pop(key))}", style="red"))
    grade = extra.pop("grade", None)
    if grade is not None:
        console.print(Text("grading report:", style="bold"))
        for key, value in grade.items() if isinstance(grade, dict) else [("report", grade)]:
            shown = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            console.print(Text(f"  {plain(key)}: ", style="bold"), Text(_clip(shown), style=MASKED), sep="")
    if extra:
        shown = (f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in sorted(extra.items()))
        console.print(Text(plain(", ".join(shown)), style=MASKED))
