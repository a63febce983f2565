"""The episode mechanics of a coding environment: the agent edits a repository in a sandbox through
``CODING_TOOLS`` (``agentrl.tools``), and its diff is graded in a fresh sandbox.

``CodingEpisodeEnv`` holds what ``bugfix-v0`` and ``swe-v0`` (and a user's environment of the same
shape) share: the turn loop (tool calls run in order, malformed ones become observations, ``submit``
ends the episode, a reminder or the end when no tool is called, ``max_turns``), and the end of an
episode: the workspace's diff is read, the episode's sandbox is closed with every process the
agent started, and the diff is graded in a fresh sandbox that started while the old one was read.
Grading sandboxes close in the background; ``close()`` waits for them. A submission whose grading
was cut off (the episode's deadline) is kept: ``grade()`` grades that diff.

A subclass provides ``_new_sandbox()`` (a sandbox for the current task, not started) and
``grade_patch(patch, fresh)`` (which sets ``self.last_grade``, a dict with ``reward``), and calls
``_begin_episode(sandbox, base)`` at the end of its ``reset`` (``base`` is the commit diffs are taken
against).
"""

from __future__ import annotations

import asyncio
from typing import Any

from agentrl.coding_tools import CodingTools
from agentrl.env import StepResult
from agentrl.sandbox import SandboxError
from agentrl.tools import ToolCall, validate_call

REMINDER = "You did not call a tool. Use a tool to make progress, or call submit if you are done."
ON_NO_TOOL_CALL = ("end", "remind")


class CodingEpisodeEnv:
    """Base of the coding environments; see the module doc for what a subclass provides."""

    tools: list[dict[str, Any]]
    max_turns: int
    on_no_tool_call: str
    command_timeout: float
    max_observation_chars: int

    def _init_episode(self, max_turns: int, on_no_tool_call: str) -> None:
        """Checks the shared arguments and sets the state before the first ``reset``."""
        if on_no_tool_call not in ON_NO_TOOL_CALL:
            raise ValueError(f"on_no_tool_call must be 'end' or 'remind'; got {on_no_tool_call!r}")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1; got {max_turns}")
        self.max_turns, self.on_no_tool_call = max_turns, on_no_tool_call
        self.sandbox = None
        self._tools: CodingTools | None = None
        self._base = ""
        self._submitted: str | None = None  # the diff the episode ended with (grade() after the end)
        self._turns, self._done = 0, False
        self.last_grade: dict[str, Any] | None = None
        self._disposing: set[asyncio.Task] = set()  # grading sandboxes being closed

    # -- what a subclass provides --
    def _new_sandbox(self):
        raise NotImplementedError

    async def grade_patch(self, patch: str, fresh=None) -> Any:
        raise NotImplementedError

    def _grade_failed(self, error: str) -> dict[str, Any]:
        """The report of an episode whose workspace could not be read."""
        return {"reward": 0.0, "error": error}

    # -- episode --
    def _begin_episode(self, sandbox, base: str) -> None:
        self.sandbox, self._base = sandbox, base
        self._tools = CodingTools(
            sandbox, command_timeout=self.command_timeout, max_output_chars=self.max_observation_chars
        )
        self._turns, self._done, self.last_grade = 0, False, None
        self._submitted = None

    async def step(self, tool_calls: list[ToolCall]) -> StepResult:
        if self.sandbox is None or self._done:
            raise RuntimeError(
                "step() called before reset() or after the episode ended; call reset(task) first"
            )
        self._turns += 1
        observation, records, errors, submitted = [], [], 0, False
        for call in tool_calls:
            validate_call(call, self.tools)
            record = {"name": call.name, "arguments": call.arguments, "id": call.id, "error": call.error}
            if call.error:  # malformed: the agent reads why, the episode goes on
                errors += 1
                output, exit_code = f"error: {call.error}", None
            elif call.name == "submit":
                submitted, output, exit_code = True, "submitted", 0
            else:
                result = await self._tools.run(call)
                output, exit_code = result.output, result.exit_code
                errors += int(result.error)
                if result.sandbox_died:
                    record.update(output=output, exit_code=exit_code)
                    return await self._finish([*records, record], errors, "env_error")
            record.update(output=output, exit_code=exit_code)
            records.append(record)
            observation.append(
                {"role": "tool", "content": output, "name": call.name or "invalid", "tool_call_id": call.id}
            )
            if submitted:
                break
        if submitted:
            return await self._finish(records, errors, "completed")
        if not tool_calls:
            if self.on_no_tool_call == "end":
                return await self._finish(records, errors, "completed")
            observation.append({"role": "user", "content": REMINDER})
        if self._turns >= self.max_turns:
            return await self._finish(records, errors, "max_turns")
        return StepResult(observation, 0.0, False, {"tool_calls": records, "tool_call_errors": errors})

    async def _finish(self, records: list[dict], errors: int, status: str) -> StepResult:
        self._done = True
        fresh = self._fresh()  # starts while the episode's sandbox is read and closed
        try:
            try:
                patch = self._submitted = await self.sandbox.diff(self._base)
            except SandboxError as e:  # the workspace cannot be read (its sandbox died): nothing to grade
                patch, error = None, f"the workspace could not be read: {e}"
            await self._close_sandbox()  # every process the agent started goes with it, before grading
        except BaseException:  # cancelled (the deadline) before grading took the fresh sandbox
            self._dispose(fresh)
            raise
        if patch is None:
            self._dispose(fresh)
            self.last_grade = self._grade_failed(error)
        else:
            await self.grade_patch(patch, fresh)
        info = {"tool_calls": records, "tool_call_errors": errors, "status": status, "grade": self.last_grade}
        return StepResult([], self.last_grade["reward"], True, info)

    async def grade(self) -> float:
        """Grade the workspace as it is now (``grade_patch`` of its diff); the episode's sandbox stays.
        Once the episode has ended, the diff it ended with is graded."""
        if self.sandbox is not None:
            patch = await self.sandbox.diff(self._base)
        elif self._submitted is not None:
            patch = self._submitted
        else:
            raise RuntimeError("grade() needs a reset() first")
        await self.grade_patch(patch)
        return self.last_grade["reward"]

    # -- grading sandboxes --
    def _fresh(self) -> tuple[Any, asyncio.Future]:
        """A sandbox for grading, starting in the background."""
        sandbox = self._new_sandbox()
        return sandbox, asyncio.ensure_future(sandbox.start())

    def _dispose(self, fresh: tuple[Any, asyncio.Future]) -> None:
        """Close a grading sandbox in the background (``close()`` waits for it)."""
        sandbox, starting = fresh

        async def dispose() -> None:
            await asyncio.gather(starting, return_exceptions=True)
            await sandbox.close()

        task = asyncio.ensure_future(dispose())
        self._disposing.add(task)
        task.add_done_callback(self._disposing.discard)

    async def _close_sandbox(self) -> None:
        """Close the episode's sandbox. A cancellation meanwhile leaves the close running, and
        ``close()`` waits for it: cut half-way, it would leave the sandbox to no one."""
        if self.sandbox is not None:
            sandbox, self.sandbox = self.sandbox, None
            closing = asyncio.ensure_future(sandbox.close())
            self._disposing.add(closing)
            closing.add_done_callback(self._disposing.discard)
            await asyncio.shield(closing)

    async def close(self) -> None:
        await self._close_sandbox()
        while self._disposing:
            await asyncio.gather(*self._disposing, return_exceptions=True)
