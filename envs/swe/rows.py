"""Task rows of ``swe-v0``: SWE-bench's fields plus what a source without a git remote needs.

A row (one line of a JSON-lines file, or a parquet row; read with ``datasets``):

- ``instance_id``, ``repo`` (``pypi/toolz``), ``version``, ``problem_statement``;
- ``FAIL_TO_PASS``, ``PASS_TO_PASS``: pytest node ids relative to the source root (lists, or JSON
  strings of lists, as SWE-bench stores them);
- ``patch``: the gold fix, a unified diff against the task's starting tree; ``test_patch``: applied
  after the agent's patch at grading (may be empty);
- ``log_parser`` (``parse_log_pytest``), ``eval_type`` (``pass_and_fail``), ``image`` (the sandbox
  image), ``test_cmd`` (the pytest invocation without test ids);
- ``source``: ``{"sdist": PATH, "sha256": HEX}``, PATH relative to the dataset file. The sdist's
  single top-level directory is the **source root**: it becomes the workspace, and every patch
  path and test id is relative to it;
- ``bug_patch``: the diff from the pristine tree to the starting tree (the injected bug);
- ``hidden_tests``: files removed from the agent's tree and put back at grading;
- ``split`` (``train`` when absent); optional ``hints``, ``created_by`` (ignored by grading).

A missing or malformed field stops loading with the instance id and the field's name.

**Image rows** (SWE-bench's published layout): a row with ``base_commit`` and ``eval_script`` and no
``source`` names a Docker image that already holds the repository at ``/testbed`` at
``base_commit``; it needs no ``test_cmd``, ``bug_patch`` or ``hidden_tests``, and is graded by its own
``eval_script`` (which applies ``test_patch`` and prints swebench's markers).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COMMON = (
    "instance_id",
    "repo",
    "version",
    "problem_statement",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
    "patch",
    "test_patch",
    "log_parser",
    "eval_type",
    "image",
)
REQUIRED = (*COMMON, "test_cmd", "source", "bug_patch", "hidden_tests")  # a row with an offline source
IMAGE_REQUIRED = (*COMMON, "base_commit", "eval_script")  # a row whose image holds the repository
EVAL_TYPES = ("pass_and_fail",)


class RowError(ValueError):
    """A task row that cannot be used; the message names the row and the field."""


@dataclass(frozen=True)
class SweRow:
    instance_id: str
    repo: str
    version: str
    problem_statement: str
    FAIL_TO_PASS: tuple[str, ...]
    PASS_TO_PASS: tuple[str, ...]
    patch: str
    test_patch: str
    log_parser: str
    eval_type: str
    image: str
    test_cmd: str
    sdist: Path | None
    """The pristine source archive (absolute: resolved against the dataset file's folder); None for
    an image row."""
    sha256: str
    bug_patch: str
    hidden_tests: tuple[str, ...]
    split: str = "train"
    base_commit: str = ""
    """Image rows: the commit ``/testbed`` is at in the image."""
    eval_script: str = ""
    """Image rows: the script that grades (SWE-bench's ``eval.sh``)."""
    hints: str = ""
    created_by: dict[str, Any] = field(default_factory=dict)

    @property
    def from_image(self) -> bool:
        """The repository comes with the image (SWE-bench's layout), not from an sdist."""
        return self.sdist is None

    def to_swebench(self, eval_script: str = "") -> dict[str, Any]:
        """The row as ``swebench.harness.utils.make_test_spec`` takes it."""
        return {
            "instance_id": self.instance_id,
            "repo": self.repo,
            "version": self.version,
            "image": self.image,
            "FAIL_TO_PASS": list(self.FAIL_TO_PASS),
            "PASS_TO_PASS": list(self.PASS_TO_PASS),
            "log_parser": self.log_parser,
            "eval_type": self.eval_type,
            "eval_script": eval_script or self.eval_script,
        }

    def check_sha256(self) -> None:
        """Stop unless the sdist is there with the row's hash (both hashes in the message)."""
        if self.sdist is None:
            raise RowError(f"{self.instance_id}: an image row has no sdist")
        if not self.sdist.is_file():
            raise RowError(f"{self.instance_id}: source.sdist {self.sdist} does not exist")
        actual = hashlib.sha256(self.sdist.read_bytes()).hexdigest()
        if actual != self.sha256:
            raise RowError(
                f"{self.instance_id}: source.sdist {self.sdist} has sha256 {actual}, but the row says "
                f"{self.sha256}; the archive is not the one the task was built from"
            )


def _id_list(value: Any, name: str, where: str, allow_empty: bool) -> tuple[str, ...]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RowError(f"{where}: field {name!r} is a string but not a JSON list ({e})") from None
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v.strip() for v in value):
        raise RowError(f"{where}: field {name!r} must be a list of non-empty strings; got {value!r:.200}")
    if not value and not allow_empty:
        raise RowError(f"{where}: field {name!r} is empty")
    return tuple(value)


def _log_parser(name: str, where: str) -> str:
    """``name`` when swebench's ``PARSER_REGISTRY`` has that parser (grading would fail on it only
    after the tests ran), else a ``RowError`` naming the closest."""
    import difflib

    from swebench.harness.grading import PARSER_REGISTRY

    if name not in PARSER_REGISTRY:
        close = difflib.get_close_matches(name, list(PARSER_REGISTRY), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise RowError(
            f"{where}: field 'log_parser' is {name!r}, which swebench's PARSER_REGISTRY does not hold; "
            f"{hint}e.g. 'parse_log_pytest'"
        )
    return name


def _created_by(value: Any, where: str) -> dict[str, Any]:
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        return {"note": value}
    if not isinstance(value, dict):
        raise RowError(
            f"{where}: field 'created_by' must be an object (or a note); got {type(value).__name__}"
        )
    return dict(value)


def _split(value: Any, where: str) -> str:
    if value is None or value == "":
        return "train"
    if not isinstance(value, str) or not value.strip():
        raise RowError(f"{where}: field 'split' must be a non-empty string; got {value!r:.200}")
    return value


def _relative(path: str, name: str, where: str) -> str:
    if not path or path.startswith("/") or posixpath.normpath(path) != path or ".." in path.split("/"):
        raise RowError(f"{where}: field {name!r} holds {path!r}, not a path inside the source root")
    return path


def parse_row(raw: dict[str, Any], base: Path, index: int = 0) -> SweRow:
    """Check one row and make it a ``SweRow``; ``base``: the folder source paths are relative to."""
    instance = raw.get("instance_id")
    where = f"row {index} ({instance})" if isinstance(instance, str) and instance else f"row {index}"
    if raw.get("source") is None and raw.get("eval_script") is not None:
        return _parse_image_row(raw, where)
    missing = [name for name in REQUIRED if raw.get(name) is None]
    if missing:
        raise RowError(f"{where}: missing field(s) {', '.join(missing)}")
    for name in ("instance_id", "repo", "version", "problem_statement", "patch", "log_parser", "image"):
        if not isinstance(raw[name], str) or not raw[name].strip():
            raise RowError(f"{where}: field {name!r} must be a non-empty string; got {raw[name]!r:.200}")
    for name in ("test_patch", "bug_patch", "test_cmd"):
        if not isinstance(raw[name], str):
            raise RowError(f"{where}: field {name!r} must be a string; got {type(raw[name]).__name__}")
    if raw.get("hints") is not None and not isinstance(raw["hints"], str):
        raise RowError(f"{where}: field 'hints' must be a string; got {type(raw['hints']).__name__}")
    if not raw["test_cmd"].strip():
        raise RowError(
            f"{where}: field 'test_cmd' is empty; e.g. python -m pytest -rA --tb=no -p no:cacheprovider"
        )
    if raw["eval_type"] not in EVAL_TYPES:
        raise RowError(f"{where}: field 'eval_type' is {raw['eval_type']!r}; swe-v0 grades {EVAL_TYPES}")
    source = raw["source"]
    if isinstance(source, str):
        try:
            source = json.loads(source)
        except json.JSONDecodeError:
            source = None
    if not isinstance(source, dict) or not isinstance(source.get("sdist"), str) or not source.get("sdist"):
        raise RowError(
            f"{where}: field 'source' must be {{'sdist': PATH, 'sha256': HEX}}; got {raw['source']!r:.200}"
        )
    digest = source.get("sha256")
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise RowError(f"{where}: field 'source.sha256' must be 64 lower-case hex digits; got {digest!r}")
    f2p = _id_list(raw["FAIL_TO_PASS"], "FAIL_TO_PASS", where, allow_empty=False)
    p2p = _id_list(raw["PASS_TO_PASS"], "PASS_TO_PASS", where, allow_empty=True)
    hidden = tuple(
        _relative(p, "hidden_tests", where)
        for p in _id_list(raw["hidden_tests"], "hidden_tests", where, allow_empty=True)
    )
    for test in (*f2p, *p2p):
        _relative(test.split("::", 1)[0], "FAIL_TO_PASS/PASS_TO_PASS", where)
    split = _split(raw.get("split"), where)
    created_by = _created_by(raw.get("created_by"), where)
    return SweRow(
        instance_id=raw["instance_id"],
        repo=raw["repo"],
        version=str(raw["version"]),
        problem_statement=raw["problem_statement"],
        FAIL_TO_PASS=f2p,
        PASS_TO_PASS=p2p,
        patch=raw["patch"],
        test_patch=raw["test_patch"],
        log_parser=_log_parser(raw["log_parser"], where),
        eval_type=raw["eval_type"],
        image=raw["image"],
        test_cmd=raw["test_cmd"],
        sdist=(base / source["sdist"]).resolve(),
        sha256=digest,
        bug_patch=raw["bug_patch"],
        hidden_tests=hidden,
        split=split,
        hints=raw.get("hints") or "",
        created_by=created_by,
    )


def _parse_image_row(raw: dict[str, Any], where: str) -> SweRow:
    missing = [name for name in IMAGE_REQUIRED if raw.get(name) is None]
    if missing:
        raise RowError(
            f"{where}: missing field(s) {', '.join(missing)} (an image row: it has an eval_script)"
        )
    for name in (
        "instance_id",
        "repo",
        "version",
        "problem_statement",
        "patch",
        "log_parser",
        "image",
        "eval_script",
    ):
        if not isinstance(raw[name], str) or not raw[name].strip():
            raise RowError(f"{where}: field {name!r} must be a non-empty string; got {raw[name]!r:.200}")
    commit = raw["base_commit"]
    if (
        not isinstance(commit, str)
        or not 7 <= len(commit) <= 40
        or any(c not in "0123456789abcdef" for c in commit)
    ):
        raise RowError(f"{where}: field 'base_commit' must be a git commit in hex; got {commit!r}")
    if raw["eval_type"] not in EVAL_TYPES:
        raise RowError(f"{where}: field 'eval_type' is {raw['eval_type']!r}; swe-v0 grades {EVAL_TYPES}")
    for name in ("test_patch", "test_cmd", "hints"):
        if raw.get(name) is not None and not isinstance(raw[name], str):
            raise RowError(f"{where}: field {name!r} must be a string; got {type(raw[name]).__name__}")
    return SweRow(
        instance_id=raw["instance_id"],
        repo=raw["repo"],
        version=str(raw["version"]),
        problem_statement=raw["problem_statement"],
        FAIL_TO_PASS=_id_list(raw["FAIL_TO_PASS"], "FAIL_TO_PASS", where, allow_empty=False),
        PASS_TO_PASS=_id_list(raw["PASS_TO_PASS"], "PASS_TO_PASS", where, allow_empty=True),
        patch=raw["patch"],
        test_patch=raw.get("test_patch") or "",
        log_parser=_log_parser(raw["log_parser"], where),
        eval_type=raw["eval_type"],
        image=raw["image"],
        test_cmd=raw.get("test_cmd") or "",
        sdist=None,
        sha256="",
        bug_patch="",
        hidden_tests=(),
        split=_split(raw.get("split"), where),
        hints=raw.get("hints") or "",
        base_commit=commit,
        eval_script=raw["eval_script"],
    )


def load_rows(path: str | Path) -> list[SweRow]:
    """Every row of a JSON-lines or parquet file (read with ``datasets``), checked; duplicate ids stop."""
    path = Path(path)
    if not path.is_file():
        raise RowError(f"no task file at {path}; pass a .jsonl or .parquet file of swe-v0 rows")
    kind = "parquet" if path.suffix == ".parquet" else "json"
    empty = RowError(f"{path} holds no task rows; pass a .jsonl or .parquet file of swe-v0 rows")
    # datasets fails on an empty file with a bare StopIteration
    if path.stat().st_size == 0 or (kind == "json" and not path.read_bytes().strip()):
        raise empty
    import datasets

    datasets.disable_progress_bars()
    try:
        table = datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as e:  # a malformed line: datasets says where
        if kind == "json" and _empty_json(path):  # `[]` or `{}`: datasets finds "no data"
            raise empty from None
        message = (str(e).splitlines() or [type(e).__name__])[0]
        raise RowError(f"{path}: cannot be read as {kind} rows: {message[:500]}") from e
    rows, seen = [], set()
    for index, raw in enumerate(table):
        try:
            row = parse_row(raw, path.parent, index)
        except RowError as e:
            raise RowError(f"{path}: {e}") from None
        if row.instance_id in seen:
            raise RowError(f"{path}: row {index}: instance_id {row.instance_id!r} appears twice")
        seen.add(row.instance_id)
        rows.append(row)
    if not rows:
        raise empty
    return rows


def _empty_json(path: Path) -> bool:
    """Whether the file is one empty JSON array or object (small by definition; larger is not read)."""
    if path.stat().st_size > 4096:
        return False
    try:
        return json.loads(path.read_bytes()) in ([], {})
    except ValueError:
        return False
