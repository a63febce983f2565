"""The coding tools run in a sandbox: ``bash`` and ``str_replace_editor`` (view, create,
str_replace, insert, undo_edit), whose specs are ``agentrl.tools.BASH`` and ``EDITOR``.

A call the tool cannot carry out as asked (bad arguments, a missing file, a path outside the
workspace, a file the editor does not read) is a ``ToolResult`` with ``error`` set, which the agent
reads; only a dead sandbox ends the episode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentrl.sandbox import SandboxDied, to_bytes
from agentrl.tools import ToolCall, clip, truncate


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
            command = call.arguments["command"]
            if "\x00" in command:  # no argument of a process can carry one
                return ToolResult(
                    "error: the command holds a NUL byte (\\x00); no shell can run it", 1, error=True
                )
            try:
                command.encode("utf-8")
            except UnicodeEncodeError as e:
                return ToolResult(
                    f"error: the command holds {command[e.start : e.end]!r}, which is not a character "
                    "UTF-8 can write",
                    1,
                    error=True,
                )
            r = await self.sandbox.exec(command, timeout=self.command_timeout)
            text = truncate(r.output, self.max_output_chars)
            for note in r.notes(self.command_timeout):  # timeout, OOM, fork bomb, SIGKILL, dead sandbox
                text += f"\n{note}"
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
            except SandboxDied as e:  # as bash reports it: the episode ends, the agent is told why
                return ToolResult(f"error: the sandbox died: {e}", 1, error=True, sandbox_died=True)
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
            new = _encode(kw["file_text"], "file_text")
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
            # Bytes that are not UTF-8 come back as they were (surrogateescape), the rest of the file too
            text = old.decode("utf-8", errors="surrogateescape")
            if command == "str_replace":
                if "old_str" not in kw:
                    raise ValueError("str_replace needs old_str")
                old_str, new_str = kw["old_str"], kw.get("new_str", "")
                count = text.count(old_str)
                if count == 0 and "\r\n" in text and "\n" in old_str and "\r\n" not in old_str:
                    # a file with CRLF line ends, and lines given as the agent reads them
                    old_str, new_str = old_str.replace("\n", "\r\n"), new_str.replace("\n", "\r\n")
                    count = text.count(old_str)
                if count != 1:
                    where = "does not occur" if count == 0 else f"occurs {count} times; make it unique"
                    raise ValueError(f"old_str {where} in {path}")
                text = text.replace(old_str, new_str, 1)
            elif command == "insert":
                if "insert_line" not in kw or "new_str" not in kw:
                    raise ValueError("insert needs insert_line and new_str")
                lines = _lines(text)
                at = kw["insert_line"]
                if not _integer(at):
                    raise ValueError(f"insert_line must be an integer; got {clip(at)}")
                if not 0 <= at <= len(lines):
                    raise ValueError(f"insert_line {at} is outside [0, {len(lines)}]")
                if at == len(lines) and lines and not lines[-1].endswith("\n"):
                    lines[-1] += "\n"  # after a last line without its newline: not joined to it
                insert = kw["new_str"] if kw["new_str"].endswith("\n") else kw["new_str"] + "\n"
                lines.insert(at, insert)
                text = "".join(lines)
            else:
                raise ValueError(f"unknown editor command {command!r}")
            new = _encode(text, "new_str")
        self._history.setdefault(path, []).append(old)
        await self.sandbox.write_file(path, new)
        if command == "create":
            return f"created {path} ({len(new)} bytes)"
        return f"edited {path}; the changed region now reads:\n" + _excerpt(
            new.decode(errors="replace"), kw.get("new_str", "")
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
        lines = [line.rstrip("\n") for line in _lines(data.decode("utf-8", errors="replace"))]
        first, last = 1, len(lines)
        if view_range:
            if not isinstance(view_range, list) or len(view_range) != 2 or not all(map(_integer, view_range)):
                raise ValueError(f"view_range must be [first, last], two integers; got {clip(view_range)}")
            first, last = view_range[0], (len(lines) if view_range[1] == -1 else view_range[1])
            if not 1 <= first <= max(last, 1) or last > len(lines):
                raise ValueError(f"view_range {view_range} is outside the file's {len(lines)} lines")
        return "\n".join(f"{i:6d}\t{lines[i - 1]}" for i in range(first, last + 1))


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _lines(text: str) -> list[str]:
    """The file's lines as grep and ``sed -n`` count them: split at newlines only, each keeping its
    own (``str.splitlines`` also splits at form feeds and other separators a file may hold)."""
    lines = text.split("\n")
    return [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])


def _encode(text: str, what: str) -> bytes:
    """``text`` as the sandbox writes it (``to_bytes``); a ``ValueError`` the agent reads otherwise."""
    try:
        return to_bytes(text)
    except UnicodeEncodeError as e:  # a lone surrogate from the call's JSON
        raise ValueError(
            f"{what} holds {text[e.start : e.end]!r}, which is not a character UTF-8 can write"
        ) from None


def _quote(path: str) -> str:
    return "'" + path.replace("'", "'\\''") + "'"


def _excerpt(text: str, anchor: str, context: int = 3) -> str:
    lines = [line.rstrip("\n") for line in _lines(text)]
    at = text.find(anchor) if anchor else -1
    line = text[:at].count("\n") if at >= 0 else 0
    lo, hi = max(0, line - context), min(len(lines), line + anchor.count("\n") + context + 1)
    return "\n".join(f"{i + 1:6d}\t{lines[i]}" for i in range(lo, hi))
