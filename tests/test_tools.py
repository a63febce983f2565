import asyncio

import pytest

from agentrl.coding_tools import CodingTools
from agentrl.sandbox import make_sandbox
from agentrl.tools import (
    CODING_TOOLS,
    MAX_CALLS_PER_TURN,
    ToolCall,
    function_spec,
    get_parser,
    parse_glm,
    parse_hermes,
    render_glm,
    render_hermes,
    spec_problems,
    truncate,
    validate_call,
)


def test_hermes_several_calls_nested_quotes_and_newlines():
    text = (
        "I will look first.\n"
        '<tool_call>\n{"name": "bash", "arguments": {"command": "grep -n \\"def f\\" a.py\\necho \'done\'"}}\n</tool_call>\n'
        '<tool_call>{"name": "str_replace_editor", "arguments": {"command": "view", "path": "a.py", '
        '"view_range": [1, 5]}}</tool_call>'
    )
    turn = parse_hermes(text, CODING_TOOLS)
    assert turn.content == "I will look first."
    assert [c.name for c in turn.calls] == ["bash", "str_replace_editor"] and turn.errors == 0
    assert turn.calls[0].arguments["command"] == "grep -n \"def f\" a.py\necho 'done'"
    assert turn.calls[1].arguments["view_range"] == [1, 5]
    assert [c.id for c in turn.calls] == ["call_0", "call_1"]


@pytest.mark.parametrize(
    "body,error",
    [
        ('{"name": "bash", "arguments": {"command": "ls"}', "invalid JSON"),
        ('{"arguments": {"command": "ls"}}', 'must be a JSON object with a "name"'),
        ('{"name": "bash", "arguments": ["ls"]}', '"arguments" must be a JSON object'),
        ('{"name": "bash", "arguments": "{\\"command\\": 1"}', "arguments are invalid JSON"),
        (
            '{"name": "python", "arguments": {"code": "1"}}',
            "unknown tool 'python'; the available tools are: bash, str_replace_editor, submit",
        ),
        ('{"name": "bash", "arguments": {}}', "missing required argument(s) ['command']"),
        ('{"name": "bash", "arguments": {"command": "ls", "cwd": "/"}}', "unexpected argument(s) ['cwd']"),
        (
            '{"name": "bash", "arguments": {"command": 5}}',
            "argument 'command' must be of type string, got int",
        ),
        (
            '{"name": "str_replace_editor", "arguments": {"command": "delete", "path": "a"}}',
            "must be one of ['view'",
        ),
        (
            '{"name": "str_replace_editor", "arguments": {"command": "view", "path": "a", "view_range": [1, 1e999]}}',
            "the number '1e999' is not finite",
        ),
        ('{"name": "bash", "arguments": {"command": "ls", "n": NaN}}', "the number 'NaN' is not finite"),
        # the items of an array, as its schema types them: the editor reads them as line numbers
        (
            '{"name": "str_replace_editor", "arguments": {"command": "view", "path": "a", "view_range": ["1", "2"]}}',
            "tool 'str_replace_editor': item 0 of argument 'view_range' must be of type integer, got str.",
        ),
        (
            '{"name": "str_replace_editor", "arguments": {"command": "view", "path": "a", "view_range": [1.5, 2]}}',
            "item 0 of argument 'view_range' must be of type integer, got float",
        ),
        (
            '{"name": "str_replace_editor", "arguments": {"command": "view", "path": "a", "view_range": [[1], 2]}}',
            "item 0 of argument 'view_range' must be of type integer, got list",
        ),
        (
            '{"name": "str_replace_editor", "arguments": {"command": "view", "path": "a", "view_range": [1, null]}}',
            "item 1 of argument 'view_range' must be of type integer, got NoneType",
        ),
    ],
)
def test_hermes_malformed_calls_become_errors(body, error):
    turn = parse_hermes(f"<tool_call>{body}</tool_call>", CODING_TOOLS)
    assert len(turn.calls) == 1 and turn.errors == 1
    assert error in turn.calls[0].error


def test_hermes_double_encoded_arguments_and_unclosed_call():
    turn = parse_hermes(
        '<tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"}</tool_call>', CODING_TOOLS
    )
    assert turn.calls[0].arguments == {"command": "ls"} and turn.errors == 0
    turn = parse_hermes('text <tool_call>{"name": "bash", "arguments": {"command": "ls"}}', CODING_TOOLS)
    assert turn.errors == 1 and "not closed" in turn.calls[0].error
    assert parse_hermes("no calls here", CODING_TOOLS).calls == []


def test_glm_format_with_typed_values():
    text = (
        "Let me check.<tool_call>str_replace_editor\n<arg_key>command</arg_key>\n<arg_value>view</arg_value>\n"
        "<arg_key>path</arg_key>\n<arg_value>pkg/a.py</arg_value>\n<arg_key>view_range</arg_key>\n"
        "<arg_value>[2, 4]</arg_value>\n</tool_call><tool_call>bash<arg_key>command</arg_key>"
        '<arg_value>echo "a\nb" | wc -l</arg_value></tool_call>'
    )
    turn = parse_glm(text, CODING_TOOLS)
    assert turn.errors == 0 and turn.content == "Let me check."
    assert turn.calls[0].arguments == {"command": "view", "path": "pkg/a.py", "view_range": [2, 4]}
    assert turn.calls[1].arguments == {"command": 'echo "a\nb" | wc -l'}


@pytest.mark.parametrize(
    "text,error",
    [
        ("<tool_call><arg_key>command</arg_key><arg_value>ls</arg_value></tool_call>", "no tool name"),
        (
            "<tool_call>bash<arg_key>command</arg_key><arg_value>ls</arg_value> junk</tool_call>",
            "could not read 'junk'",
        ),
        (
            "<tool_call>str_replace_editor<arg_key>command</arg_key><arg_value>insert</arg_value><arg_key>path</arg_key>"
            "<arg_value>a</arg_value><arg_key>insert_line</arg_key><arg_value>two</arg_value></tool_call>",
            "should be integer",
        ),
        ("<tool_call>bash</tool_call>", "missing required argument(s) ['command']"),
    ],
)
def test_glm_malformed(text, error):
    turn = parse_glm(text, CODING_TOOLS)
    assert turn.errors == 1 and error in turn.calls[0].error


@pytest.mark.parametrize("fmt", ["hermes", "glm"])
def test_render_then_parse_round_trips(fmt):
    calls = [
        ToolCall("bash", {"command": "python3 -c \"print('x')\"\nls"}),
        ToolCall(
            "str_replace_editor",
            {"command": "insert", "path": "a.py", "insert_line": 3, "new_str": "  y = {1: 2}\n"},
        ),
        ToolCall("submit", {}),
    ]
    text = {"hermes": render_hermes, "glm": render_glm}[fmt](calls)
    turn = get_parser(fmt)(text, CODING_TOOLS)
    assert turn.errors == 0
    assert [(c.name, c.arguments) for c in turn.calls] == [(c.name, c.arguments) for c in calls]
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'; known formats: hermes, glm"):
        get_parser("xml")


def test_specs_and_truncation():
    assert all(spec_problems(t) == [] for t in CODING_TOOLS)
    assert spec_problems({"type": "function", "function": {"name": "x y", "parameters": {"type": "object"}}})
    assert (
        "required parameters ['b']"
        in spec_problems(
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {"type": "object", "properties": {}, "required": ["b"]},
                },
            }
        )[0]
    )
    text = "a" * 50 + "b" * 50
    cut = truncate(text, 20)
    assert cut.startswith("a" * 10) and cut.endswith("b" * 10) and "[... 80 characters cut ...]" in cut
    assert truncate("short", 20) == "short"


def test_editor_operations_in_a_sandbox():
    async def go():
        async with make_sandbox("local") as sb:
            tools = CodingTools(sb)

            async def edit(**args):
                return await tools.run(ToolCall("str_replace_editor", args))

            r = await edit(command="create", path="pkg/a.py", file_text="x = 1\ny = 2\nx = 1\n")
            assert not r.error and "created pkg/a.py" in r.output
            r = await edit(command="str_replace", path="pkg/a.py", old_str="x = 1", new_str="x = 3")
            assert r.error and "occurs 2 times; make it unique" in r.output
            r = await edit(command="str_replace", path="pkg/a.py", old_str="y = 2", new_str="y = 5")
            assert not r.error and "y = 5" in r.output
            r = await edit(command="insert", path="pkg/a.py", insert_line=0, new_str="# top")
            assert (await sb.read_file("pkg/a.py")).decode() == "# top\nx = 1\ny = 5\nx = 1\n"
            r = await edit(command="view", path="pkg/a.py", view_range=[2, 3])
            assert r.output == "     2\tx = 1\n     3\ty = 5"
            await edit(command="undo_edit", path="pkg/a.py")
            await edit(command="undo_edit", path="pkg/a.py")
            assert (await sb.read_file("pkg/a.py")).decode() == "x = 1\ny = 2\nx = 1\n"
            r = await edit(command="view", path="missing.py")
            assert r.error and "does not exist" in r.output
            r = await edit(command="view", path="pkg")
            assert "pkg/a.py" in r.output
            r = await tools.run(ToolCall("bash", {"command": "echo hi; exit 3"}))
            assert r.output == "hi\n\n[exit code 3]" and r.exit_code == 3

    asyncio.run(go())


def test_editor_edge_cases_keep_the_file_as_grep_and_git_see_it():
    """Bytes that are not UTF-8 survive an edit elsewhere in the file; lines are counted at newlines
    only (a form feed is not a line end); an insert after a last line without its newline does not
    join the two; a multi-line old_str matches a CRLF file; a file over the read limit is refused
    without being read; NUL bytes and lone surrogates are errors the agent reads, not exceptions."""

    async def go():
        async with make_sandbox("local") as sb:
            tools = CodingTools(sb)

            async def edit(**args):
                return await tools.run(ToolCall("str_replace_editor", args))

            await sb.write_file("lat.py", b"# caf\xe9\nx = 1\n")
            r = await edit(command="str_replace", path="lat.py", old_str="x = 1", new_str="x = 2")
            assert not r.error and await sb.read_file("lat.py") == b"# caf\xe9\nx = 2\n"
            await sb.write_file("ff.py", b"a = 1  # \x0c page\nb = 2\n")
            r = await edit(command="view", path="ff.py")
            assert r.output.count("\n") == 1 and r.output.endswith("     2\tb = 2")
            r = await edit(command="insert", path="ff.py", insert_line=1, new_str="c = 3")
            assert await sb.read_file("ff.py") == b"a = 1  # \x0c page\nc = 3\nb = 2\n"
            await sb.write_file("end.py", b"x = 1")
            r = await edit(command="insert", path="end.py", insert_line=1, new_str="y = 2")
            assert not r.error and await sb.read_file("end.py") == b"x = 1\ny = 2\n"
            await sb.write_file("crlf.py", b"def f():\r\n    return 1\r\n")
            r = await edit(
                command="str_replace",
                path="crlf.py",
                old_str="def f():\n    return 1",
                new_str="def f():\n    return 2",
            )
            assert not r.error and await sb.read_file("crlf.py") == b"def f():\r\n    return 2\r\n"
            await tools.run(ToolCall("bash", {"command": "truncate -s 40M big.txt"}))
            r = await edit(command="view", path="big.txt")
            assert r.error and "big.txt is 41943040 bytes, more than the editor reads (16 MiB)" in r.output
            r = await tools.run(ToolCall("bash", {"command": "echo a\x00b"}))
            assert r.error and "NUL byte" in r.output
            r = await tools.run(ToolCall("bash", {"command": "echo \ud800"}))
            assert r.error and "'\\ud800'" in r.output
            r = await edit(command="create", path="s.py", file_text="x = '\ud800'")
            assert r.error and "file_text holds '\\ud800'" in r.output

    asyncio.run(go())


def test_an_edit_in_a_dead_sandbox_reports_it_as_bash_does():
    from agentrl.sandbox import SandboxDied

    class Dead:
        async def read_file(self, path):
            raise SandboxDied("the container is gone")

    r = asyncio.run(
        CodingTools(Dead()).run(ToolCall("str_replace_editor", {"command": "view", "path": "a.py"}))
    )
    assert r.sandbox_died and r.error and "the container is gone" in r.output


@pytest.mark.parametrize("fmt", ["hermes", "glm"])
def test_calls_past_the_per_turn_limit_become_one_error(fmt):
    render, parse = {"hermes": render_hermes, "glm": render_glm}[fmt], get_parser(fmt)
    turn = parse(render([ToolCall("submit")] * MAX_CALLS_PER_TURN), CODING_TOOLS)
    assert len(turn.calls) == MAX_CALLS_PER_TURN and turn.errors == 0
    turn = parse("ok " + render([ToolCall("submit")] * (MAX_CALLS_PER_TURN + 5)) + " done", CODING_TOOLS)
    assert turn.content == "ok " + "\n" * (MAX_CALLS_PER_TURN + 4) + " done"  # the text around every call
    assert len(turn.calls) == MAX_CALLS_PER_TURN + 1 and turn.errors == 1
    assert turn.calls[-1].id == f"call_{MAX_CALLS_PER_TURN}"
    assert turn.calls[-1].error == (
        f"this turn has {MAX_CALLS_PER_TURN + 5} tool calls and only the first {MAX_CALLS_PER_TURN} were "
        f"read; make at most {MAX_CALLS_PER_TURN} calls per turn."
    )


def test_editor_mistakes_are_errors_the_agent_reads_and_change_nothing():
    async def go():
        async with make_sandbox("local") as sb:
            tools = CodingTools(sb)

            async def edit(**args):
                return await tools.run(ToolCall("str_replace_editor", args))

            await sb.write_file("a.py", "x = 1\ny = 2\n")
            mistakes = [
                ({"command": "create", "path": "b.py"}, "error: create needs file_text"),
                ({"command": "undo_edit", "path": "a.py"}, "error: no edit of a.py to undo"),
                (
                    {"command": "str_replace", "path": "nope.py", "old_str": "x"},
                    "error: nope.py does not exist",
                ),
                (
                    {"command": "str_replace", "path": "a.py", "new_str": "x"},
                    "error: str_replace needs old_str",
                ),
                (
                    {"command": "insert", "path": "a.py", "new_str": "z = 3"},
                    "error: insert needs insert_line and new_str",
                ),
                (
                    {"command": "insert", "path": "a.py", "insert_line": 3, "new_str": "z"},
                    "error: insert_line 3 is outside [0, 2]",
                ),
                (
                    {"command": "view", "path": "a.py", "view_range": [1]},
                    "error: view_range must be [first, last]",
                ),
                (
                    {"command": "view", "path": "a.py", "view_range": [2, 5]},
                    "error: view_range [2, 5] is outside the file's 2 lines",
                ),
                (
                    {"command": "view", "path": "a.py", "view_range": [0, 1]},
                    "error: view_range [0, 1] is outside",
                ),
                # what validate_call rejects, should a caller run the tools without it
                (
                    {"command": "view", "path": "a.py", "view_range": ["1", "2"]},
                    "error: view_range must be [first, last], two integers; got ['1', '2']",
                ),
                (
                    {"command": "view", "path": "a.py", "view_range": [1, None]},
                    "error: view_range must be [first, last], two integers; got [1, None]",
                ),
                (
                    {"command": "insert", "path": "a.py", "insert_line": "1", "new_str": "z"},
                    "error: insert_line must be an integer; got '1'",
                ),
            ]
            for args, message in mistakes:
                r = await edit(**args)
                assert r.error and r.exit_code == 1 and r.output.startswith(message), (args, r.output)
            assert await sb.read_file("a.py") == b"x = 1\ny = 2\n"
            assert (await tools.run(ToolCall("bash", {"command": "ls"}))).output.split() == [
                "a.py",
                "[exit",
                "code",
                "0]",
            ]
            # undoing a creation removes the file; an edit is undone to the bytes before it
            await edit(command="create", path="new.py", file_text="n = 1\n")
            r = await edit(command="undo_edit", path="new.py")
            assert r.output == "undid the creation of new.py"
            assert (await edit(command="view", path="new.py")).error
            r = await edit(command="view", path="a.py", view_range=[2, -1])
            assert r.output == "     2\ty = 2"

    asyncio.run(go())


def test_an_array_schema_with_a_length_or_typed_items_is_checked_item_by_item():
    tool = function_spec(
        "probe",
        "Arrays with a length and typed items.",
        {
            "pair": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
            "some": {"type": "array", "items": {"type": "string"}, "minItems": 1},
            "few": {"type": "array", "maxItems": 2},
            "nested": {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}}},
        },
        [],
    )

    def error(**arguments):
        return validate_call(ToolCall("probe", arguments), [tool]).error

    assert error(pair=[1, 2], some=["a"], few=[], nested=[[True], []]) is None
    assert error(pair=[1]) == "tool 'probe': argument 'pair' must hold exactly 2 items, got 1."
    assert error(some=[]) == "tool 'probe': argument 'some' must hold at least 1 items, got 0."
    assert error(few=[1, 2, 3]) == "tool 'probe': argument 'few' must hold at most 2 items, got 3."
    assert (
        error(pair=[1, True]) == "tool 'probe': item 1 of argument 'pair' must be of type integer, got bool."
    )
    assert error(nested=[[True], [1]]) == (
        "tool 'probe': item 0 of item 1 of argument 'nested' must be of type boolean, got int."
    )
