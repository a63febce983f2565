"""Tool calls: OpenAI-style specs, and the parsers of the model families users train (the coding
tools that run the calls in a sandbox are ``agentrl.coding_tools``).

Parsing never raises on what a model wrote, and takes time linear in its length (``str.find`` scans,
no regex that can backtrack). A malformed call becomes a ``ToolCall`` with ``error`` set, which the
environment answers with an observation telling the agent exactly what was wrong; the episode goes
on and the error is counted.

Formats (chosen per model in config, ``PARSERS[name]``):

- ``hermes`` (Hermes, Qwen2.5/Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  several per turn.
- ``glm`` (GLM-4.5 / GLM-5): ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>``;
  values are text, decoded as JSON where the tool's schema wants a non-string type.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

# --- specs ------------------------------------------------------------------------------------


def function_spec(
    name: str, description: str, properties: dict[str, Any], required: list[str]
) -> dict[str, Any]:
    """An OpenAI-style tool spec (what chat templates take as ``tools=``)."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


BASH = function_spec(
    "bash",
    "Run a bash command in the repository and return its output (stdout and stderr) and exit code. "
    "Each call starts a fresh shell in the repository root; long-running commands time out.",
    {"command": {"type": "string", "description": "The command line to run."}},
    ["command"],
)
EDITOR = function_spec(
    "str_replace_editor",
    "View, create and edit files. `view` shows a file with line numbers (or lists a directory); "
    "`create` writes a new file; `str_replace` replaces one exact, unique occurrence of old_str "
    "with new_str; `insert` adds new_str after line insert_line; `undo_edit` reverts the last edit of a file.",
    {
        "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "undo_edit"]},
        "path": {"type": "string", "description": "File or directory, relative to the repository root."},
        "file_text": {"type": "string", "description": "Content of the new file (create)."},
        "old_str": {"type": "string", "description": "Exact text to replace (str_replace)."},
        "new_str": {"type": "string", "description": "Replacement (str_replace) or text to insert (insert)."},
        "insert_line": {"type": "integer", "description": "Line after which to insert (insert); 0 = top."},
        "view_range": {
            "type": "array",
            "items": {"type": "integer"},
            "description": "[first, last] lines to view (1-based, last = -1 for the end).",
        },
    },
    ["command", "path"],
)
SUBMIT = function_spec("submit", "Submit your work and end the episode.", {}, [])
CODING_TOOLS = [BASH, EDITOR, SUBMIT]


def spec_problems(spec: Any) -> list[str]:
    """What is wrong with a tool spec (empty when valid): the shape chat templates and parsers rely on."""
    if (
        not isinstance(spec, dict)
        or spec.get("type") != "function"
        or not isinstance(spec.get("function"), dict)
    ):
        return [f"a tool spec must be {{'type': 'function', 'function': {{...}}}}; got {str(spec)[:120]}"]
    fn = spec["function"]
    problems = []
    name = fn.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*", name or ""):
        problems.append(f"function name must be an identifier; got {name!r}")
    params = fn.get("parameters")
    if not isinstance(params, dict) or params.get("type") != "object":
        problems.append(f"{name}: parameters must be a JSON schema with type 'object'; got {params!r}")
        return problems
    props = params.get("properties", {})
    if not isinstance(props, dict):
        problems.append(f"{name}: parameters.properties must be an object")
        return problems
    for prop, schema in props.items():
        if not isinstance(schema, dict) or schema.get("type") not in _TYPES:
            problems.append(f"{name}.{prop}: schema needs a JSON type in {sorted(_TYPES)}; got {schema!r}")
    missing = [r for r in params.get("required", []) if r not in props]
    if missing:
        problems.append(f"{name}: required parameters {missing} are not in properties")
    return problems


# --- calls and parsers ---------------------------------------------------------------------------


@dataclass
class ToolCall:
    """One tool call as the model wrote it; ``error`` says why it cannot be run (then name/arguments may be partial)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str = ""
    error: str | None = None
    raw: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "arguments": self.arguments,
            "id": self.id,
            "error": self.error,
            "raw": self.raw,
        }


_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def _type_ok(value: Any, json_type: str) -> bool:
    if json_type in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, _TYPES.get(json_type, (object,)))


def clip(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: error messages quote what the model wrote, not all of it."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _value_problem(value: Any, schema: dict[str, Any], what: str) -> str | None:
    """What is wrong with ``value`` under ``schema`` (its type, enum, and an array's length and
    items), or None. Items are checked too: a tool reads them as the schema promised."""
    if "type" in schema and not _type_ok(value, schema["type"]):
        return f"{what} must be of type {schema['type']}, got {type(value).__name__}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{what} must be one of {schema['enum']}, got {clip(value)}"
    if isinstance(value, list):
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        if len(value) < low or (high is not None and len(value) > high):
            if low == high:
                want = f"exactly {low}"
            elif high is None:
                want = f"at least {low}"
            else:
                want = f"at most {high}" if low == 0 else f"{low} to {high}"
            return f"{what} must hold {want} items, got {len(value)}"
        items = schema.get("items")
        if isinstance(items, dict):
            for i, item in enumerate(value):
                if problem := _value_problem(item, items, f"item {i} of {what}"):
                    return problem
    return None


def validate_call(call: ToolCall, tools: list[dict[str, Any]]) -> ToolCall:
    """Check a parsed call against the tool specs; sets ``call.error`` with what to fix."""
    if call.error:
        return call
    specs = {t["function"]["name"]: t["function"] for t in tools}
    if call.name not in specs:
        call.error = f"unknown tool {clip(call.name)}; the available tools are: {', '.join(specs)}."
        return call
    params = specs[call.name].get("parameters", {})
    props, required = params.get("properties", {}), params.get("required", [])
    missing = [r for r in required if r not in call.arguments]
    extra = [a for a in call.arguments if a not in props]
    problems = []
    if missing:
        problems.append(f"missing required argument(s) {missing}")
    if extra:
        problems.append(f"unexpected argument(s) {clip(extra, 200)} (it takes {sorted(props) or 'none'})")
    for key, value in call.arguments.items():
        schema = props.get(key)
        if schema and (problem := _value_problem(value, schema, f"argument {key!r}")):
            problems.append(problem)
    if problems:
        call.error = f"tool {call.name!r}: " + "; ".join(problems) + "."
    return call


@dataclass
class ParsedTurn:
    """What an assistant turn said: the text outside tool calls, and the calls (malformed ones included)."""

    content: str
    calls: list[ToolCall]

    @property
    def errors(self) -> int:
        return sum(1 for c in self.calls if c.error)


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_KEY, _KEY_END, _VALUE, _VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_SPACE = re.compile(r"\s*")


def _blocks(text: str) -> tuple[list[tuple[str, str, bool]], str]:
    """The ``<tool_call>`` blocks of ``text`` as (body, raw, closed), and the text outside them, stripped.

    A block runs to the first ``</tool_call>`` after it opens, or, unclosed, to the end of the text.
    One left-to-right scan with ``str.find``: time linear in ``len(text)`` whatever the model wrote.
    """
    blocks, outside, pos = [], [], 0
    while (start := text.find(_OPEN, pos)) >= 0:
        outside.append(text[pos:start])
        end = text.find(_CLOSE, start + len(_OPEN))
        pos = len(text) if end < 0 else end + len(_CLOSE)
        body = text[start + len(_OPEN) : len(text) if end < 0 else end]
        blocks.append((body, text[start:pos], end >= 0))
    outside.append(text[pos:])
    return blocks, "".join(outside).strip()


MAX_CALLS_PER_TURN = 256
"""Calls read from one turn; past it, one error call says how many there were. No model writes this
many on purpose; the limit bounds the parse time (and the env's work) of a turn that repeats a call."""


def _read_blocks(
    blocks: list[tuple[str, str, bool]], read: Callable[[str, str, str], ToolCall]
) -> list[ToolCall]:
    """``read(body, raw, call_id)`` of each closed block; an error call for each unclosed one."""
    calls = []
    for i, (body, raw, closed) in enumerate(blocks[:MAX_CALLS_PER_TURN]):
        if closed:
            calls.append(read(body, raw, f"call_{i}"))
        else:
            calls.append(
                ToolCall("", id=f"call_{i}", raw=raw, error=f"the tool call is not closed with {_CLOSE}.")
            )
    if len(blocks) > MAX_CALLS_PER_TURN:
        error = (
            f"this turn has {len(blocks)} tool calls and only the first {MAX_CALLS_PER_TURN} were read; "
            f"make at most {MAX_CALLS_PER_TURN} calls per turn."
        )
        calls.append(
            ToolCall("", id=f"call_{MAX_CALLS_PER_TURN}", raw=blocks[MAX_CALLS_PER_TURN][1], error=error)
        )
    return calls


def _json_error(text: str, e: json.JSONDecodeError) -> str:
    snippet = text[max(0, e.pos - 20) : e.pos + 20].replace("\n", "\\n")
    return f"invalid JSON ({e.msg} at line {e.lineno} column {e.colno}, near {snippet!r})"


class _NotFinite(ValueError):
    pass


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _NotFinite(text)
    return value


def _no_constant(name: str) -> float:
    raise _NotFinite(name)


def _loads(text: str) -> tuple[Any, str | None]:
    """``json.loads(text)`` and None, or None and what is wrong with the JSON; never raises. NaN,
    Infinity and numbers beyond a float's range are wrong too: no tool takes them, and a
    trajectory holding one could not be stored as JSON."""
    try:
        return json.loads(text, parse_float=_finite_float, parse_constant=_no_constant), None
    except _NotFinite as e:
        return None, f"invalid JSON (the number {str(e)[:40]!r} is not finite); write a finite number"
    except json.JSONDecodeError as e:
        return None, _json_error(text, e)
    except RecursionError:
        depth = sys.getrecursionlimit()
        return None, (
            f"invalid JSON (the value starting {text.lstrip()[:20]!r} nests arrays or objects more than "
            f"about {depth} levels deep); nest them less deeply"
        )
    except ValueError:  # Python's limit on the digits of an integer
        digits = sys.get_int_max_str_digits()
        return None, f"invalid JSON (an integer longer than {digits} digits); write long numbers as strings"


_HERMES_FORMAT = '<tool_call>{"name": "TOOL", "arguments": {"ARG": "VALUE"}}</tool_call>'


def _hermes_call(body: str, raw: str, call_id: str, tools: list[dict[str, Any]]) -> ToolCall:
    obj, problem = _loads(body.strip())
    if problem:
        return ToolCall("", id=call_id, raw=raw, error=f"{problem}. Write exactly {_HERMES_FORMAT}.")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", id=call_id, raw=raw, error='the tool call must be a JSON object with a "name".')
    name = obj["name"]
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models double-encode the arguments
        args, problem = _loads(args) if args.strip() else ({}, None)
        if problem:
            return ToolCall(name, id=call_id, raw=raw, error=f"arguments are {problem}.")
    if not isinstance(args, dict):
        return ToolCall(name, id=call_id, raw=raw, error='"arguments" must be a JSON object.')
    return validate_call(ToolCall(name, args, id=call_id, raw=raw), tools)


def parse_hermes(text: str, tools: list[dict[str, Any]]) -> ParsedTurn:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn."""
    blocks, content = _blocks(text)
    return ParsedTurn(content, _read_blocks(blocks, partial(_hermes_call, tools=tools)))


_GLM_ARG = f"{_KEY}NAME{_KEY_END}{_VALUE}VALUE{_VALUE_END}"


def _glm_call(
    body: str, raw: str, call_id: str, schemas: dict[str, dict[str, Any]], tools: list[dict[str, Any]]
) -> ToolCall:
    """One GLM call body, read pair by pair with ``str.find`` (a regex over it can backtrack for minutes)."""
    first = body.find(_KEY)
    name = (body if first < 0 else body[:first]).strip()
    types = schemas.get(name, {})
    args: dict[str, Any] = {}
    junk, broken, bad_value = [], None, None
    pos = len(body) if first < 0 else first
    while (k := body.find(_KEY, pos)) >= 0:
        junk.append(body[pos:k])
        key_end = body.find(_KEY_END, k)
        if key_end < 0:
            broken = f"{_KEY} is not closed with {_KEY_END} (near {body[k : k + 40]!r})"
            break
        key = body[k + len(_KEY) : key_end].strip()
        v = _SPACE.match(body, key_end + len(_KEY_END)).end()
        if not body.startswith(_VALUE, v):
            broken = f"argument {clip(key)} is not followed by {_VALUE} (found {body[v : v + 40]!r})"
            break
        value_end = body.find(_VALUE_END, v)
        if value_end < 0:
            broken = f"the value of argument {clip(key)} is not closed with {_VALUE_END}"
            break
        value = body[v + len(_VALUE) : value_end]
        pos = value_end + len(_VALUE_END)
        want = types.get(key, {}).get("type", "string")
        if want != "string":
            decoded, problem = _loads(value)
            if problem:
                bad_value = f"argument {clip(key)} should be {want} but is {problem}."
            else:
                value = decoded
        args[key] = value
    else:
        junk.append(body[pos:])
    leftover = "".join(junk).strip()
    if not name:
        error = f"the tool call has no tool name before its first {_KEY}."
    elif broken:
        error = f"{broken}; write each argument as {_GLM_ARG}."
    elif leftover:
        error = f"could not read {leftover[:80]!r}; write each argument as {_GLM_ARG}."
    else:
        error = bad_value
    return validate_call(ToolCall(name, args, id=call_id, raw=raw, error=error), tools)


def parse_glm(text: str, tools: list[dict[str, Any]]) -> ParsedTurn:
    """``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>``."""
    schemas = {
        t["function"]["name"]: t["function"].get("parameters", {}).get("properties", {}) for t in tools
    }
    blocks, content = _blocks(text)
    return ParsedTurn(content, _read_blocks(blocks, partial(_glm_call, schemas=schemas, tools=tools)))


def render_hermes(calls: list[ToolCall]) -> str:
    """Tool calls as a Hermes/Qwen model writes them (the inverse of ``parse_hermes``)."""
    return "\n".join(
        "<tool_call>\n"
        + json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)
        + "\n</tool_call>"
        for c in calls
    )


def render_glm(calls: list[ToolCall]) -> str:
    """Tool calls as a GLM-4.5/5 model writes them (the inverse of ``parse_glm``)."""
    out = []
    for c in calls:
        args = "".join(
            f"<arg_key>{k}</arg_key><arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>"
            for k, v in c.arguments.items()
        )
        out.append(f"<tool_call>{c.name}{args}</tool_call>")
    return "\n".join(out)


RENDERERS: dict[str, Callable[[list[ToolCall]], str]] = {"hermes": render_hermes, "glm": render_glm}
PARSERS: dict[str, Callable[[str, list[dict[str, Any]]], ParsedTurn]] = {
    "hermes": parse_hermes,
    "glm": parse_glm,
}


def get_parser(name: str) -> Callable[[str, list[dict[str, Any]]], ParsedTurn]:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call format {name!r}; known formats: {', '.join(PARSERS)}.")
    return PARSERS[name]


# --- observations -----------------------------------------------------------------------------


def truncate(text: str, max_chars: int, head_fraction: float = 0.5) -> str:
    """Keep the head and the tail of a long observation with a marker saying how much was cut."""
    if len(text) <= max_chars:
        return text
    head = int(max_chars * head_fraction)
    tail = max_chars - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} characters cut ...]\n{text[len(text) - tail :]}"
