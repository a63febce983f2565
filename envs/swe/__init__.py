"""``swe-v0``: fix a bug in a real open-source Python library, graded by its hidden tests.

Each task is a row of a dataset (``envs/swe/rows.py``): a released sdist, the diff that injects
the bug, the issue text, the tests that must go from failing to passing (FAIL_TO_PASS) and those
that must keep passing (PASS_TO_PASS). The agent's sandbox holds the starting tree in its
workspace (``/testbed`` in Docker) as a git repository with one commit and nothing else: no other
ref, no reflog, no remote, no caches, no ``*.egg-info``, the hidden test files removed. Tools:
``bash``, ``str_replace_editor``, ``submit``. The submission is the workspace's ``git diff`` against
that commit (untracked files included), graded in a fresh sandbox (``envs/swe/grading.py``) with
swebench's own report: reward 1 iff resolved.

Arguments (``env.args``): ``tasks`` (a .jsonl or .parquet file of rows; default the shipped set),
``max_turns``, ``command_timeout``, ``grade_timeout``, ``partial_credit`` (reward the share of
FAIL_TO_PASS that passes, off by default), ``on_no_tool_call`` (``remind`` or ``end``),
``max_observation_chars``, ``sandbox_config`` (the sandbox backend's settings).
"""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path
from typing import Any

from agentrl.coding_env import CodingEpisodeEnv
from agentrl.env import Demonstration, DemoTurn, Observation, Task
from agentrl.envs.swe import grading
from agentrl.envs.swe.rows import SweRow, load_rows
from agentrl.envs.swe.tree import trees
from agentrl.sandbox import make_sandbox, resolve_kind
from agentrl.tools import CODING_TOOLS, ToolCall

SHIPPED = Path(__file__).parent / "tasks" / "tasks.jsonl"
SYSTEM_PROMPT = (
    "You are a careful software engineer. You work in a repository through tools: run shell commands "
    "with `bash`, read and edit files with `str_replace_editor`, and call `submit` when you are done."
)
PROMPT = """The repository of {repo} {version} is in the current directory. A user reports:

{problem}

Fix the library's source so that the behaviour is correct. The tests that check this are not in the
repository; do not add or edit tests. When you are done, call `submit`."""
# One commit, no reflog, no remote, no hooks, nothing else git keeps: the fix cannot be recovered
# from the repository (the tree is uploaded without a .git; the one the sandbox made is replaced).
GIT_INIT = (
    "rm -rf .git && git init -q -b main . && git add -A -f && "
    "git -c user.name=agentrl -c user.email=agentrl@localhost commit -q --no-verify -m 'starting tree' && "
    "rm -rf .git/logs .git/hooks .git/description .git/info/exclude .git/COMMIT_EDITMSG && "
    "git rev-parse HEAD"
)


@functools.lru_cache(maxsize=8)
def _git_dir(path: Path) -> str | None:
    """The object store of the git repository that holds ``path`` (a checkout agentrl runs from, whose
    history has the task file and the sdists in it), or None outside one."""
    for parent in (path.resolve(), *path.resolve().parents):
        git = parent / ".git"
        if git.is_dir():
            return str(git)
        if git.is_file():  # a worktree's or submodule's: "gitdir: X", its objects in X's commondir
            text = git.read_text(errors="replace").strip()
            if not text.startswith("gitdir:"):
                return None
            gitdir = (parent / text.split(":", 1)[1].strip()).resolve()
            common = gitdir / "commondir"
            if common.is_file():
                gitdir = (gitdir / common.read_text().strip()).resolve()
            return str(gitdir)
    return None


def _rows(path: str) -> tuple[SweRow, ...]:
    return tuple(load_rows(path))


class SweEnv(CodingEpisodeEnv):
    """An ``AgentEnv``; one sandbox per episode, made at ``reset``; grading in a fresh one."""

    deterministic = True

    def __init__(
        self,
        sandbox: str = "auto",
        sandbox_config: dict[str, Any] | None = None,
        tasks: str | None = None,
        max_turns: int = 30,
        command_timeout: float = 120.0,
        grade_timeout: float = 900.0,
        partial_credit: bool = False,
        on_no_tool_call: str = "remind",
        max_observation_chars: int = 10_000,
    ):
        self._init_episode(max_turns, on_no_tool_call)
        self.path = str(Path(tasks).resolve()) if tasks else str(SHIPPED)
        self.rows = {row.instance_id: row for row in _rows(self.path)}
        self.backend = resolve_kind(sandbox)
        self.sandbox_config = dict(sandbox_config or {})
        self.command_timeout, self.grade_timeout = command_timeout, grade_timeout
        self.partial_credit = bool(partial_credit)
        self.max_observation_chars = max_observation_chars
        self.tools = list(CODING_TOOLS)
        self.row: SweRow | None = None

    # -- tasks --
    def tasks(self, split: str) -> list[Task]:
        splits = sorted({row.split for row in self.rows.values()})
        if split not in splits:
            raise ValueError(f"split {split!r} is not in {self.path}; its splits are {splits}")
        return [Task(i, {"instance_id": i}) for i, row in self.rows.items() if row.split == split]

    def row_of(self, task: Task) -> SweRow:
        instance = task.data.get("instance_id", task.id)
        if instance not in self.rows:
            raise ValueError(f"task {instance!r} is not a row of {self.path}")
        return self.rows[instance]

    def demonstration(self, task: Task) -> Demonstration:
        """The scripted expert: apply the gold patch with ``git apply`` through ``bash``, then submit."""
        row = self.row_of(task)
        patch = row.patch if row.patch.endswith("\n") else row.patch + "\n"
        apply = ToolCall(
            "bash", {"command": f"git apply - <<'AGENTRL_PATCH'\n{patch}AGENTRL_PATCH"}, id="call_0"
        )
        return Demonstration([DemoTurn([apply]), DemoTurn([ToolCall("submit", {}, id="call_0")])], reward=1.0)

    def corpus(self) -> list[str]:
        """Text for a tokenizer trained for this environment: tool specs, prompts and gold patches."""
        texts = [json.dumps(t) for t in CODING_TOOLS]
        for row in list(self.rows.values())[:64]:
            texts += [self._prompt(row), row.patch]
        return texts

    def _prompt(self, row: SweRow) -> str:
        return PROMPT.format(repo=row.repo, version=row.version, problem=row.problem_statement.strip())

    def observation(self, task: Task) -> Observation:
        row = self.row_of(task)
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": self._prompt(row)},
        ]
        return Observation(messages=messages, tools=list(self.tools))

    # -- episode --
    def _check_backend(self, row: SweRow) -> None:
        if row.from_image and self.backend != "docker":
            raise ValueError(
                f"{row.instance_id} is an image row (its repository is in the image {row.image}); it runs "
                f"on the docker sandbox, not {self.backend!r}: set sandbox.kind=docker"
            )

    def _sandbox(self, row: SweRow):
        config = dict(self.sandbox_config)
        if self.backend == "docker":
            config.setdefault("image", row.image)
        if self.backend == "local":  # the task file and the sdists (the original source: the fix)
            data = {str(Path(self.path).parent)} | {
                str(r.sdist.parent) for r in self.rows.values() if r.sdist
            }
            data |= {git for d in data if (git := _git_dir(Path(d)))}  # their history holds them too
            config["hidden_paths"] = tuple(sorted(data | set(config.get("hidden_paths", ()))))
        return make_sandbox(self.backend, **config)

    def _new_sandbox(self):
        return self._sandbox(self.row)

    def _grade_failed(self, error: str) -> dict[str, Any]:
        return {"instance_id": self.row.instance_id, "reward": 0.0, "error": error}

    async def reset(self, task: Task) -> Observation:
        await self._close_sandbox()
        self.row = self.row_of(task)
        self._check_backend(self.row)
        self.sandbox = sandbox = self._sandbox(self.row)  # closed by the next reset or close
        await sandbox.start()
        if self.row.from_image:  # the image holds the repository: back to base_commit, history dropped
            # ignored files (the image's build products) stay in the tree, out of the commit
            init = GIT_INIT.replace("git add -A -f", "git add -A")
            setup = f"git reset -q --hard {self.row.base_commit} && git clean -fdq && {init}"
        else:
            _, agent_tree = await asyncio.to_thread(trees, self.row)
            await sandbox.upload(str(agent_tree), sandbox.workdir)
            setup = GIT_INIT
        setup = await sandbox.exec(setup, timeout=300)
        if setup.exit_code != 0:
            raise RuntimeError(f"{self.row.instance_id}: workspace setup failed: {setup.output[-500:]}")
        self._begin_episode(sandbox, setup.output.split()[-1])
        return self.observation(task)

    async def grade_patch(self, patch: str, fresh=None, row: SweRow | None = None) -> dict[str, Any]:
        """Grade ``patch`` against ``row`` (the episode's by default) in a fresh sandbox; the report
        is returned and kept as ``self.last_grade``."""
        row = row or self.row
        try:  # a sandbox handed in is disposed of whatever happens, a cancellation included
            if row is None:
                raise RuntimeError("grade_patch() needs a reset() first, or a row")
            self._check_backend(row)
            full_tree = None if row.from_image else (await asyncio.to_thread(trees, row))[0]
            if fresh is None:
                sandbox = self._sandbox(row)
                fresh = sandbox, asyncio.ensure_future(sandbox.start())
            sandbox, starting = fresh
            await starting
            if row.from_image:
                report = await grading.grade_image_row(sandbox, row, patch, timeout=self.grade_timeout)
            else:
                report = await grading.grade(
                    sandbox,
                    row,
                    full_tree,
                    patch,
                    timeout=self.grade_timeout,
                    partial_credit=self.partial_credit,
                )
        finally:
            if fresh is not None:
                self._dispose(fresh)
        self.last_grade = report
        return report
