"""The tool-call parsers on hostile model output: never raise, linear time, and on what a plain regex
reading accepts, the same calls as that reading."""

import contextlib
import json
import random
import re
import signal
import sys
import time

import pytest

from agentrl.tools import (
    CODING_TOOLS,
    ParsedTurn,
    ToolCall,
    function_spec,
    parse_glm,
    parse_hermes,
    render_glm,
    render_hermes,
    validate_call,
)

PARSERS = {"hermes": parse_hermes, "glm": parse_glm}
RENDERERS = {"hermes": render_hermes, "glm": render_glm}
# One tool with every JSON type, so typed GLM values are decoded on every path.
PROBE = function_spec(
    "probe",
    "Every JSON type.",
    {
        "s": {"type": "string"},
        "i": {"type": "integer"},
        "n": {"type": "number"},
        "b": {"type": "boolean"},
        "a": {"type": "array"},
        "o": {"type": "object"},
        "z": {"type": "null"},
    },
    [],
)
TOOLS = [*CODING_TOOLS, PROBE]
BOUND_S = 0.05  # the bound: one parse of 100 KB of model output within 50 ms

TAGS = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]
JSON_BITS = [
    *'{}[]:,"\\',
    '"name"',
    '"arguments"',
    '"parameters"',
    '"bash"',
    '"command"',
    '"ls"',
    '"str_replace_editor"',
    '"probe"',
    '"insert_line"',
    "0",
    "-1",
    "3.5",
    "1e308",
    "1e999",
    "true",
    "null",
    "NaN",
    '"\\ud800"',
    '"\\u00e9"',
    '"{\\"command\\": 1}"',
]
WORDS = ["bash", "str_replace_editor", "submit", "probe", "command", "path", "insert_line", "view_range"]


def _unicode(rng: random.Random, n: int) -> str:
    """Any code points, lone surrogates and controls included."""
    return "".join(chr(rng.randrange(0x110000)) for _ in range(n))


def _value(rng: random.Random, json_type: str, enum=None):
    if enum:
        return rng.choice(enum)
    if json_type == "integer":
        return rng.randint(-(10**40), 10**40)
    if json_type == "number":
        return rng.choice([rng.uniform(-1e6, 1e6), rng.randint(-5, 5), 1e300])
    if json_type == "boolean":
        return rng.random() < 0.5
    if json_type == "array":
        return [rng.randint(-3, 99) for _ in range(rng.randint(0, 4))]
    if json_type == "object":
        return {_text(rng, 5): [_text(rng, 5), rng.randint(0, 9), None] for _ in range(rng.randint(0, 3))}
    if json_type == "null":
        return None
    return _text(rng, 40)


def _text(rng: random.Random, n: int) -> str:
    """Text a value may hold in both formats: anything but the tags that close a call or a value."""
    bits = [*TAGS[::2], "{", '"', "\\", "\n", " ", "\t", "é", "\u3000", "$(ls)", "'"]
    out = "".join(rng.choice(bits) if rng.random() < 0.3 else _unicode(rng, 1) for _ in range(n))
    return out.replace("</", "<")


def _call(rng: random.Random) -> ToolCall:
    """A valid call of one of TOOLS: every required argument, some optional ones."""
    fn = rng.choice(TOOLS)["function"]
    params = fn["parameters"]
    args = {}
    for key, schema in params["properties"].items():
        if key in params["required"] or rng.random() < 0.4:
            args[key] = _value(rng, schema["type"], schema.get("enum"))
    return ToolCall(fn["name"], args)


def _piece(rng: random.Random) -> str:
    kind = rng.randrange(10)
    if kind == 0:
        return rng.choice(TAGS)
    if kind == 1:
        return rng.choice(JSON_BITS)
    if kind == 2:
        return rng.choice(WORDS)
    if kind == 3:
        return rng.choice([" ", "\n", "\t", "\u3000", "\x0b"]) * rng.randint(1, 50)
    if kind == 4:
        return _unicode(rng, rng.randint(1, 30))
    if kind == 5:  # past the JSON decoder's recursion limit, or just under it
        return rng.choice(["[", "{", '{"a":', '"', "[{"]) * rng.randint(500, 3000)
    if kind == 6:  # around Python's 4,300-digit limit on int()
        return rng.choice(["", "-"]) + "9" * rng.randint(4000, 5000)
    if kind == 7:
        return rng.choice(list(RENDERERS.values()))([_call(rng)])
    if kind == 8:  # a short run of tags, repeated: what makes a regex with nested wildcards backtrack
        unit = "".join(
            rng.choice(TAGS[2:]) + rng.choice(["", " ", "a", "\n"]) for _ in range(rng.randint(1, 3))
        )
        return unit * rng.randint(20, 300)
    return rng.choice(TAGS) + rng.choice(WORDS) + rng.choice(TAGS)


def _mutate(rng: random.Random, text: str) -> str:
    for _ in range(rng.randint(1, 4)):
        i, j = sorted(rng.randrange(len(text) + 1) for _ in range(2))
        op = rng.randrange(4)
        if op == 0:
            text = text[:i] + text[j:]
        elif op == 1:
            text = text[:i] + _piece(rng) + text[i:]
        elif op == 2:
            text = text[:j] + text[i:j] + text[j:]
        else:
            text = text[:i]
    return text


def corpus(n: int, seed: int = 0) -> list[str]:
    """``n`` strings: tag/JSON/unicode soup, and valid renderings, mutated or clean, with text around."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        if k % 3 == 0:
            text = "".join(_piece(rng) for _ in range(rng.randint(1, 40)))
        else:
            render = RENDERERS["hermes" if k % 2 else "glm"]
            text = _text(rng, 20) + render([_call(rng) for _ in range(rng.randint(1, 3))]) + _text(rng, 20)
            if k % 3 == 1:
                text = _mutate(rng, text)
        out.append(text)
    return out


def _check(turn: ParsedTurn, text: str) -> None:
    """What a parse must give whatever the text: calls in order, errors counted and readable."""
    assert isinstance(turn, ParsedTurn) and isinstance(turn.content, str)
    assert [c.id for c in turn.calls] == [f"call_{i}" for i in range(len(turn.calls))]
    assert turn.errors == sum(1 for c in turn.calls if c.error)
    for c in turn.calls:
        assert isinstance(c, ToolCall) and c.raw.startswith("<tool_call>")
        assert isinstance(c.name, str) and isinstance(c.arguments, dict)
        if c.error:
            assert isinstance(c.error, str) and 0 < len(c.error) < 1000, c.error
        else:
            assert validate_call(ToolCall(c.name, c.arguments), TOOLS).error is None


@contextlib.contextmanager
def _no_hang(seconds: float = 5.0):
    """Fail, rather than hang the suite, if a parse does not return."""

    def fire(signum, frame):
        raise TimeoutError(f"the parse did not return within {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _timed(parse, text: str) -> float:
    """Seconds one parse takes, its result checked; a slow one is timed twice more and the best kept,
    so a pause of the process on a shared machine is not read as a hang (backtracking is slow every time)."""
    best = float("inf")
    for _ in range(3):
        with _no_hang():
            t0 = time.perf_counter()
            turn = parse(text, TOOLS)
            best = min(best, time.perf_counter() - t0)
        _check(turn, text)
        if best < BOUND_S:
            break
    return best


def test_ten_thousand_fuzzed_strings_never_raise_nor_hang():
    texts = corpus(10_000)
    slow = []
    for text in texts:
        for fmt, parse in PARSERS.items():
            took = _timed(parse, text)
            if took >= BOUND_S:
                slow.append((fmt, len(text), took, text[:120]))
    assert not slow, slow


def _fill(piece: str, head: str = "", tail: str = "", size: int = 100_000) -> str:
    """``head + piece * k + tail`` of at least ``size`` characters."""
    return head + piece * (size // len(piece) + 1) + tail


ADVERSARIAL = {
    "glm key then open value, repeated": _fill(
        "<arg_key>a</arg_key> <arg_value>", "<tool_call>bash", "</tool_call>"
    ),
    "glm keys without values": _fill("<arg_key>a</arg_key>", "<tool_call>bash", "</tool_call>"),
    "glm keys never closed": _fill("<arg_key>a", "<tool_call>bash", "</tool_call>"),
    "glm close-key runs before one value": _fill(
        "a</arg_key> ", "<tool_call>bash<arg_key>", "<arg_value>x</tool_call>"
    ),
    "glm value never closed": _fill(
        "x<arg_key>a</arg_key>", "<tool_call>bash<arg_key>a</arg_key><arg_value>", "</tool_call>"
    ),
    "glm whitespace run after a key": _fill(
        " \n\t", "<tool_call>bash<arg_key>command</arg_key>", "</tool_call>"
    ),
    "glm values without keys": _fill("<arg_value>x</arg_value>", "<tool_call>bash", "</tool_call>"),
    "glm huge integer": _fill(
        "9",
        "<tool_call>str_replace_editor<arg_key>command</arg_key><arg_value>insert</arg_value>"
        "<arg_key>path</arg_key><arg_value>a</arg_value><arg_key>insert_line</arg_key><arg_value>",
        "</arg_value></tool_call>",
    ),
    "glm deep nesting": _fill(
        "[",
        "<tool_call>str_replace_editor<arg_key>view_range</arg_key><arg_value>",
        "</arg_value></tool_call>",
    ),
    "unclosed call": _fill("x", "<tool_call>"),
    "thousands of openers": _fill("<tool_call>"),
    "thousands of empty calls": _fill("<tool_call></tool_call>"),
    "thousands of closers": _fill("</tool_call>", "<tool_call>"),
    "hermes deep nesting": _fill("[", '<tool_call>{"name": "bash", "arguments": ', "</tool_call>"),
    "hermes deep objects": _fill('{"a":', "<tool_call>", "</tool_call>"),
    "hermes deep nesting, double-encoded": _fill(
        "[", '<tool_call>{"name": "bash", "arguments": "', '"}</tool_call>'
    ),
    "hermes huge integer": _fill(
        "7", '<tool_call>{"name": "bash", "arguments": {"command": ', "}}</tool_call>"
    ),
    "hermes huge name": _fill("x", '<tool_call>{"name": "', '", "arguments": {}}</tool_call>'),
    "hermes unterminated string": _fill('\\"', '<tool_call>{"name": "'),
    "many small calls": _fill(
        render_hermes([ToolCall("bash", {"command": "ls"})]) + render_glm([ToolCall("submit")])
    ),
    "random unicode": _unicode(random.Random(1), 100_000),
    "surrogates and nulls": _fill("\ud800\udfff\x00<tool_call>\udc80"),
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_100kb_adversarial_input_parses_within_50ms(name):
    text = ADVERSARIAL[name]
    assert len(text) >= 100_000
    for parse in PARSERS.values():
        with _no_hang():
            parse(text, TOOLS)  # warm up
        took = _timed(parse, text)
        assert took < BOUND_S, f"{parse.__name__} took {took * 1000:.0f} ms on {name!r} ({len(text)} chars)"


def test_failures_say_what_was_wrong():
    hermes = parse_hermes(ADVERSARIAL["hermes deep nesting"], TOOLS).calls[0].error
    assert hermes.startswith('invalid JSON (the value starting \'{"name": "bash", "ar\' nests arrays')
    assert "levels deep); nest them less deeply. Write exactly <tool_call>{" in hermes
    digits = sys.get_int_max_str_digits()
    hermes = parse_hermes(ADVERSARIAL["hermes huge integer"], TOOLS).calls[0].error
    assert f"an integer longer than {digits} digits); write long numbers as strings" in hermes
    hermes = parse_hermes(ADVERSARIAL["hermes deep nesting, double-encoded"], TOOLS).calls[0].error
    assert hermes.startswith("arguments are invalid JSON (the value starting '[[[")
    glm = parse_glm(ADVERSARIAL["glm huge integer"], TOOLS).calls[0].error
    assert glm.startswith("argument 'insert_line' should be integer but is invalid JSON (an integer longer")
    glm = parse_glm(ADVERSARIAL["glm deep nesting"], TOOLS).calls[0].error
    assert glm.startswith(
        "argument 'view_range' should be array but is invalid JSON (the value starting '[[["
    )
    glm = parse_glm(ADVERSARIAL["glm keys without values"], TOOLS).calls[0].error
    assert glm.startswith("argument 'a' is not followed by <arg_value> (found '<arg_key>a</arg_key>")
    assert glm.endswith("write each argument as <arg_key>NAME</arg_key><arg_value>VALUE</arg_value>.")
    glm = parse_glm(ADVERSARIAL["glm value never closed"], TOOLS).calls[0].error
    assert glm.startswith("the value of argument 'a' is not closed with </arg_value>")
    glm = parse_glm(ADVERSARIAL["unclosed call"], TOOLS).calls[0].error
    assert glm == "the tool call is not closed with </tool_call>."
    glm = parse_glm("<tool_call>bash<arg_key>command</tool_call>", TOOLS).calls[0]
    assert glm.error.startswith("<arg_key> is not closed with </arg_key> (near '<arg_key>command')")
    # what the model wrote is quoted, not repeated whole
    name = parse_hermes(ADVERSARIAL["hermes huge name"], TOOLS).calls[0].error
    assert name.startswith("unknown tool 'xxxx") and "x..." in name and len(name) < 200
    args = parse_hermes('<tool_call>{"name": "bash", "arguments": {"command": ["ls"]}}</tool_call>', TOOLS)
    assert args.calls[0].error == "tool 'bash': argument 'command' must be of type string, got list."


# --- a plain regex reading as the reference (it backtracks, so only on short strings) ------------

_REF_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)
_REF_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_PROPS = {t["function"]["name"]: t["function"]["parameters"]["properties"] for t in TOOLS}


def _ref_hermes(body: str):
    obj = json.loads(body.strip())
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    return (obj["name"], args) if isinstance(args, dict) else None


def _ref_glm(body: str):
    head = body.split("<arg_key>", 1)[0]
    rest, name = body[len(head) :], head.strip()
    if not name or _REF_PAIR.sub("", rest).strip():
        return None
    args = {}
    for key, value in _REF_PAIR.findall(rest):
        want = _PROPS.get(name, {}).get(key.strip(), {}).get("type", "string")
        args[key.strip()] = value if want == "string" else json.loads(value)
    return name, args


def reference(text: str, fmt: str):
    """(content, [(name, arguments) of each accepted call, None for each rejected one])."""
    calls = []
    for body, close in _REF_BLOCK.findall(text):
        try:
            call = close and (_ref_hermes if fmt == "hermes" else _ref_glm)(body)
        except (ValueError, RecursionError):  # JSONDecodeError and Python's int-digit limit
            call = None
        if call and validate_call(ToolCall(*call), TOOLS).error:
            call = None
        calls.append(call or None)
    return _REF_BLOCK.sub("", text).strip(), calls


@pytest.mark.parametrize("fmt", ["hermes", "glm"])
def test_same_calls_as_a_regex_reading_on_short_strings(fmt):
    texts = [t for t in corpus(3_000, seed=1) if len(t) < 600]
    accepted = 0
    for text in texts:
        turn = PARSERS[fmt](text, TOOLS)
        got = [None if c.error else (c.name, c.arguments) for c in turn.calls]
        assert (turn.content, got) == reference(text, fmt), text
        accepted += sum(1 for c in got if c)
    assert len(texts) > 1000 and accepted > 300  # the comparison covers accepted calls, not only errors


@pytest.mark.parametrize("fmt", ["hermes", "glm"])
def test_random_calls_round_trip_through_render_and_parse(fmt):
    rng = random.Random(2)
    for _ in range(1_000):
        calls = [_call(rng) for _ in range(rng.randint(1, 4))]
        turn = PARSERS[fmt](RENDERERS[fmt](calls), TOOLS)
        assert turn.errors == 0, [c.error for c in turn.calls]
        assert [(c.name, c.arguments) for c in turn.calls] == [(c.name, c.arguments) for c in calls]
