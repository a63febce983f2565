"""Tool calls: OpenAI-style specs, the parsers of the model families users train, and the coding tools.

Parsing never raises on what a model wrote. A malformed call becomes a ``ToolCall`` with ``error``
set, which the environment answers with an observation telling the agent exactly what was wrong;
the episode goes on and the error is counted.

Formats (chosen per model in config, ``PARSERS[name]``):

- ``hermes`` (Hermes, Qwen2.5/Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  several per turn.
- ``glm`` (GLM-4.5 / GLM-5): ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>``;
  values are text, decoded as JSON where the tool's schema wants a non-string type.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
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


def validate_call(call: ToolCall, tools: list[dict[str, Any]]) -> ToolCall:
    """Check a parsed call against the tool specs; sets ``call.error`` with what to fix."""
    if call.error:
        return call
    specs = {t["function"]["name"]: t["function"] for t in tools}
    if call.name not in specs:
        call.error = f"unknown tool {call.name!r}; the available tools are: {', '.join(specs)}."
        return call
    params = specs[call.name].get("parameters", {})
    props, required = params.get("properties", {}), params.get("required", [])
    missing = [r for r in required if r not in call.arguments]
    extra = [a for a in call.arguments if a not in props]
    problems = []
    if missing:
        problems.append(f"missing required argument(s) {missing}")
    if extra:
        problems.append(f"unexpected argument(s) {extra} (it takes {sorted(props) or 'none'})")
    for key, value in call.arguments.items():
        schema = props.get(key)
        if not schema:
            continue
        if "type" in schema and not _type_ok(value, schema["type"]):
            problems.append(f"argument {key!r} must be of type {schema['type']}, got {type(value).__name__}")
        elif "enum" in schema and value not in schema["enum"]:
            problems.append(f"argument {key!r} must be one of {schema['enum']}, got {value!r}")
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


_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _json_error(text: str, e: json.JSONDecodeError) -> str:
    snippet = text[max(0, e.pos - 20) : e.pos + 20].replace("\n", "\\n")
    return f"invalid JSON ({e.msg} at line {e.lineno} column {e.colno}, near {snippet!r})"


def parse_hermes(text: str, tools: list[dict[str, Any]]) -> ParsedTurn:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn."""
    calls = []
    for i, match in enumerate(_BLOCK.finditer(text)):
        body = match.group(1).strip()
        raw = match.group(0)
        call_id = f"call_{i}"
        if not match.group(0).endswith("</tool_call>"):
            calls.append(
                ToolCall("", id=call_id, raw=raw, error="the tool call is not closed with </tool_call>.")
            )
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(
                ToolCall(
                    "",
                    id=call_id,
                    raw=raw,
                    error=f"{_json_error(body, e)}. Write exactly "
                    '<tool_call>{"name": "TOOL", "arguments": {"ARG": "VALUE"}}</tool_call>.',
                )
            )
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(
                ToolCall("", id=call_id, raw=raw, error='the tool call must be a JSON object with a "name".')
            )
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models double-encode the arguments
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                calls.append(
                    ToolCall(obj["name"], id=call_id, raw=raw, error=f"arguments are {_json_error(args, e)}.")
                )
                continue
        if not isinstance(args, dict):
            calls.append(
                ToolCall(obj["name"], id=call_id, raw=raw, error='"arguments" must be a JSON object.')
            )
            continue
        calls.append(validate_call(ToolCall(obj["name"], args, id=call_id, raw=raw), tools))
    content = _BLOCK.sub("", text).strip()
    return ParsedTurn(content, calls)


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def parse_glm(text: str, tools: list[dict[str, Any]]) -> ParsedTurn:
    """``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>``."""
    schemas = {
        t["function"]["name"]: t["function"].get("parameters", {}).get("properties", {}) for t in tools
    }
    calls = []
    for i, match in enumerate(_BLOCK.finditer(text)):
        body, raw, call_id = match.group(1), match.group(0), f"call_{i}"
        if not raw.endswith("</tool_call>"):
            calls.append(
                ToolCall("", id=call_id, raw=raw, error="the tool call is not closed with </tool_call>.")
            )
            continue
        name = body.split("<arg_key>", 1)[0].strip()
        rest = body[len(body.split("<arg_key>", 1)[0]) :]
        args: dict[str, Any] = {}
        error = None
        for key, value in _GLM_ARG.findall(rest):
            key = key.strip()
            want = schemas.get(name, {}).get(key, {}).get("type", "string")
            if want != "string":
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    error = f"argument {key!r} should be {want} but is {_json_error(value, e)}."
            args[key] = value
        leftover = _GLM_ARG.sub("", rest).strip()
        if not name:
            error = "the tool call has no tool name before its first <arg_key>."
        elif leftover:
            error = f"could not read {leftover[:80]!r}; write each argument as <arg_key>NAME</arg_key><arg_value>VALUE</arg_value>."
        call = ToolCall(name, args, id=call_id, raw=raw, error=error)
        calls.append(validate_call(call, tools))
    content = _BLOCK.sub("", text).strip()
    return ParsedTurn(content, calls)


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


# --- the coding tools, run in a sandbox -----------------------------------------------------------


@dataclass
class ToolResult:
    output: str
    exit_code: int = 0
    error: bool = False
    """The call could not be carried out as asked (bad arguments, missing file); told to the agent."""
    timed_out: bool = False
    sandbox_died: bool = False


class CodingTools:
    """``bash`` and ``str_replace_editor`` against a sandbox, with an undo history per file."""

    def __init__(self, sandbox, *, command_timeout: float = 60.0, max_output_chars: int = 10_000):
        self.sandbox = sandbox
        self.command_timeout = command_timeout
        self.max_output_chars = max_output_chars
        self._history: dict[str, list[bytes | None]] = {}

    async def run(self, call: ToolCall) -> ToolResult:
        if call.name == "bash":
            r = await self.sandbox.exec(call.arguments["command"], timeout=self.command_timeout)
            text = r.output
            if r.timed_out:
                text += f"\n[command timed out after {self.command_timeout:g} s and was killed]"
            if r.sandbox_died:
                text += "\n[the sandbox died while running this command]"
            text = truncate(text, self.max_output_chars)
            return ToolResult(
                f"{text}\n[exit code {r.exit_code}]",
                r.exit_code,
                timed_out=r.timed_out,
                sandbox_died=r.sandbox_died,
            )
        if call.name == "str_replace_editor":
            try:
                return ToolResult(truncate(await self._edit(**call.arguments), self.max_output_chars))
            except (ValueError, FileNotFoundError, IsADirectoryError, PermissionError) as e:
                return ToolResult(f"error: {e}", 1, error=True)
        raise ValueError(f"CodingTools cannot run {call.name!r}")

    async def _read(self, path: str) -> bytes | None:
        try:
            return await self.sandbox.read_file(path)
        except (FileNotFoundError, IsADirectoryError):
            return None

    async def _edit(self, command: str, path: str, **kw: Any) -> str:
        if command == "view":
            return await self._view(path, kw.get("view_range"))
        old = await self._read(path)
        if command == "create":
            if "file_text" not in kw:
                raise ValueError("create needs file_text")
            new = kw["file_text"].encode()
        elif command == "undo_edit":
            if not self._history.get(path):
                raise ValueError(f"no edit of {path} to undo")
            previous = self._history[path].pop()
            if previous is None:
                await self.sandbox.exec(f"rm -f -- {_quote(path)}", timeout=30)
                return f"undid the creation of {path}"
            await self.sandbox.write_file(path, previous)
            return f"undid the last edit of {path}"
        else:
            if old is None:
                raise FileNotFoundError(f"{path} does not exist (use command=create to make it)")
            text = old.decode("utf-8", errors="replace")
            if command == "str_replace":
                if "old_str" not in kw:
                    raise ValueError("str_replace needs old_str")
                count = text.count(kw["old_str"])
                if count != 1:
                    where = "does not occur" if count == 0 else f"occurs {count} times; make it unique"
                    raise ValueError(f"old_str {where} in {path}")
                text = text.replace(kw["old_str"], kw.get("new_str", ""), 1)
            elif command == "insert":
                if "insert_line" not in kw or "new_str" not in kw:
                    raise ValueError("insert needs insert_line and new_str")
                lines = text.splitlines(keepends=True)
                at = kw["insert_line"]
                if not 0 <= at <= len(lines):
                    raise ValueError(f"insert_line {at} is outside [0, {len(lines)}]")
                insert = kw["new_str"] if kw["new_str"].endswith("\n") else kw["new_str"] + "\n"
                lines.insert(at, insert)
                text = "".join(lines)
            else:
                raise ValueError(f"unknown editor command {command!r}")
            new = text.encode()
        self._history.setdefault(path, []).append(old)
        await self.sandbox.write_file(path, new)
        if command == "create":
            return f"created {path} ({len(new)} bytes)"
        return f"edited {path}; the changed region now reads:\n" + _excerpt(
            new.decode(), kw.get("new_str", "")
        )

    async def _view(self, path: str, view_range: list[int] | None) -> str:
        data = await self._read(path)
        if data is None:
            r = await self.sandbox.exec(
                f"test -d {_quote(path)} && find {_quote(path)} -maxdepth 2 -not -path '*/.*' | sort",
                timeout=30,
            )
            if r.exit_code != 0:
                raise FileNotFoundError(f"{path} does not exist")
            return r.output
        lines = data.decode("utf-8", errors="replace").splitlines()
        first, last = 1, len(lines)
        if view_range:
            if len(view_range) != 2:
                raise ValueError(f"view_range must be [first, last]; got {view_range}")
            first, last = view_range[0], (len(lines) if view_range[1] == -1 else view_range[1])
            if not 1 <= first <= max(last, 1) or last > len(lines):
                raise ValueError(f"view_range {view_range} is outside the file's {len(lines)} lines")
        return "\n".join(f"{i:6d}\t{lines[i - 1]}" for i in range(first, last + 1))


def _quote(path: str) -> str:
    return "'" + path.replace("'", "'\\''") + "'"


def _excerpt(text: str, anchor: str, context: int = 3) -> str:
    lines = text.splitlines()
    at = text.find(anchor) if anchor else -1
    line = text[:at].count("\n") if at >= 0 else 0
    lo, hi = max(0, line - context), min(len(lines), line + anchor.count("\n") + context + 1)
    return "\n".join(f"{i + 1:6d}\t{lines[i]}" for i in range(lo, hi))
