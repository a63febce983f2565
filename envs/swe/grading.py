"""Grading a ``swe-v0`` submission in a fresh sandbox, never the one the agent used.

1. The full starting tree (pristine source + ``bug_patch``, hidden tests included) goes into the
   fresh sandbox's workspace.
2. The agent's diff is filtered to the package's non-test source (``agentrl.patches``): tests,
   ``conftest.py``, test and build configuration, start-up hooks, anything at a hidden test path,
   files outside the source directories and binary patches are dropped and listed in the report.
3. It is applied with ``git apply``, else ``git apply --3way``, else ``patch --fuzz=2``; the
   report says which worked. Then the row's ``test_patch``.
4. ``test_cmd`` runs on the FAIL_TO_PASS and PASS_TO_PASS ids with a cleared environment (no
   ``PYTEST_ADDOPTS``/``PYTEST_PLUGINS``/``PYTHONPATH``; ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``,
   ``PYTHONHASHSEED=0``, ``TZ=UTC``), no bytecode written or read, under a timeout, with
   ``--junitxml``. The log gets swebench's markers and the exit code.
5. ``swebench.harness.grading.get_eval_report`` with the row's ``log_parser`` decides; the junit
   report must agree (every graded test present and passed: a skipped or xfailed test is not a
   pass), or the verdict is "not resolved" with the disagreeing ids in the report; so must the
   exit code (0).

The package's source runs inside the test process, so a fix could patch the runner itself; a kept
patch whose added lines reach for it (``_pytest``, ``import pytest``, ``os._exit``, junit, forged
``PASSED`` text) is graded but never rewarded (``runner_tamper`` in the report). A determined
enough forgery in plain Python can still get past a static check: this is the limit of grading
in-process test suites, as SWE-bench does.

Reward 1 iff resolved; with ``partial_credit`` the share of FAIL_TO_PASS that passed (when every
PASS_TO_PASS passed).
"""

from __future__ import annotations

import secrets
import shlex
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path
from typing import Any

from agentrl.envs.swe.rows import SweRow
from agentrl.patches import filter_patch, runner_tamper

SUBMISSION = ".agentrl-submission.patch"
TEST_PATCH = ".agentrl-test.patch"
# the directories of a tree that hold the package's source (the agent may edit what is under them)
NOT_SOURCE = ("tests", "test", "testing", "docs", "doc", "examples", "benchmarks", "ci", ".github")


def source_dirs(tree: Path) -> list[str]:
    """The package directories at the top of ``tree`` (and under ``src/``): what a fix may edit."""
    found = []
    for base in (tree, tree / "src", tree / "lib"):  # lib/: e.g. matplotlib's layout
        if not base.is_dir():
            continue
        for child in sorted(base.iterdir()):
            if child.is_dir() and child.name not in NOT_SOURCE and (child / "__init__.py").is_file():
                found.append(str(child.relative_to(tree)))
    for module in sorted(tree.glob("*.py")):  # single-module distributions (e.g. parse.py, tabulate)
        if module.name not in ("setup.py", "conftest.py", "noxfile.py") and not module.name.startswith(
            "test"
        ):
            found.append(module.name)
    return found


def _apply_script(patch_file: str, marker: str, ignored_too: bool = True) -> str:
    """Try the three ways to apply, resetting the tree between them; prints ``marker METHOD``.
    ``ignored_too=False`` keeps ignored files (an image's build products) when resetting."""
    clean = "-fdxq" if ignored_too else "-fdq"
    reset = f"git reset -q --hard && git clean {clean} -e {SUBMISSION} -e {TEST_PATCH}"
    return (
        f"if git apply --whitespace=nowarn {patch_file} 2>/dev/null; then echo {marker} apply; "
        f"elif {reset} && git apply --3way --whitespace=nowarn {patch_file} 2>/dev/null "
        f"&& ! git diff --name-only --diff-filter=U | grep -q .; then echo {marker} 3way; "
        f"elif {reset} && patch -p1 --fuzz=2 --batch --forward --no-backup-if-mismatch "
        f"-i {patch_file} >/dev/null 2>&1; then echo {marker} patch; "
        f"else {reset}; echo {marker} failed; fi; rm -f {patch_file}"
    )


def _filtered(
    row: SweRow, patch: str, dirs: list[str], hidden: tuple[str, ...] = ()
) -> tuple[str, dict[str, Any], list[str]]:
    """The patch kept for grading, the report begun (what was dropped and why), and the kept lines
    that reach into the test runner (graded all the same, so the report shows what the tests did,
    but never rewarded)."""
    kept, dropped = filter_patch(patch, dirs, hidden)
    report: dict[str, Any] = {
        "instance_id": row.instance_id,
        "resolved": False,
        "reward": 0.0,
        "dropped_paths": [f"{p} ({why})" for p, why in dropped],
        "apply_method": None,
    }
    tamper = runner_tamper(kept, dirs)
    if tamper:
        report["runner_tamper"] = tamper
    return kept, report, tamper


def _apply_method(output: str, nonce: str) -> str:
    """How the submission applied, from the apply script's ``NONCE-APPLY METHOD`` line."""
    marker = f"{nonce}-APPLY "
    return output.split(marker, 1)[1].split("\n", 1)[0].strip() if marker in output else "failed"


def junit_statuses(xml_text: str) -> dict[tuple[str, str], str]:
    """(classname, name) -> passed | failed | error | skipped, from pytest's junit report."""
    statuses: dict[tuple[str, str], str] = {}
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError:
        return statuses
    for case in root.iter("testcase"):
        kinds = {child.tag for child in case}
        status = (
            "error"
            if "error" in kinds
            else "failed"
            if "failure" in kinds
            else "skipped"
            if "skipped" in kinds
            else "passed"
        )
        key = (case.get("classname", ""), case.get("name", ""))
        if statuses.get(key) in ("failed", "error"):
            continue  # a test reported twice (e.g. a failing subtest, then the test): failure wins
        statuses[key] = status
    return statuses


def junit_key(node_id: str) -> tuple[str, str]:
    """The (classname, name) pytest's junit report gives the test of ``node_id``."""
    base, bracket, params = node_id.partition("[")  # parameters may hold "::" themselves
    parts = base.split("::")
    module = parts[0][:-3] if parts[0].endswith(".py") else parts[0]
    classname = ".".join([module.replace("/", "."), *parts[1:-1]])
    return classname, parts[-1] + bracket + params


def eval_script(row: SweRow, run: str) -> str:
    """The script recorded with the test spec (what grading ran, for the report and swebench)."""
    return "\n".join(
        [
            "#!/bin/bash",
            "set -uxo pipefail",
            "cd /testbed",
            f"git apply {SUBMISSION}  # the filtered submission (or --3way, or patch --fuzz=2)",
            f"git apply {TEST_PATCH}" if row.test_patch.strip() else ": no test patch",
            ": '>>>>> Start Test Output'",
            run,
            ": '>>>>> End Test Output'",
        ]
    )


# A cleared environment for a test run: no PYTEST_ADDOPTS, PYTEST_PLUGINS or PYTHONPATH, no plugin
# found by entry point, no user site, no bytecode written, a fixed hash seed and time zone.
CLEAR_ENV = (
    'env -i PATH="$PATH" HOME="$HOME" LANG=C.UTF-8 TZ=UTC PYTHONHASHSEED=0 '
    "PYTHONDONTWRITEBYTECODE=1 PYTHONNOUSERSITE=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "
    '${TMPDIR:+TMPDIR="$TMPDIR"} '
)
# Where a sandbox has python3 but no python (Debian's image), python is python3.
PYTHON_SHIM = (
    "command -v python >/dev/null || { mkdir -p /tmp/agentrl-bin && "
    'ln -sf "$(command -v python3)" /tmp/agentrl-bin/python; PATH="/tmp/agentrl-bin:$PATH"; }'
)


def test_command(row: SweRow, junit: str) -> str:
    """The test run on the row's ids with a cleared environment and a junit report."""
    ids = " ".join(shlex.quote(t) for t in (*row.FAIL_TO_PASS, *row.PASS_TO_PASS))
    return f"{CLEAR_ENV}{row.test_cmd} --junitxml={junit} {ids}"


async def grade(
    sandbox,
    row: SweRow,
    full_tree: Path,
    patch: str,
    timeout: float = 600.0,
    partial_credit: bool = False,
) -> dict[str, Any]:
    """Grade ``patch`` (the agent's ``git diff``) in ``sandbox`` (fresh, started); returns the report
    (``reward``, ``resolved``, ``tests_status``, ``dropped_paths``, ``apply_method``, ...)."""
    kept, report, tamper = _filtered(row, patch, source_dirs(full_tree), row.hidden_tests)
    nonce = secrets.token_hex(8)
    await sandbox.upload(str(full_tree), sandbox.workdir)
    if kept:
        await sandbox.write_file(SUBMISSION, kept)
    if row.test_patch.strip():
        await sandbox.write_file(TEST_PATCH, row.test_patch)
    commit = (
        f"git add -A -f -- . ':!{SUBMISSION}' ':!{TEST_PATCH}' && "
        "git -c user.name=agentrl -c user.email=agentrl@localhost "
        "commit -q --no-verify -m start >/dev/null"
    )
    steps = [f"{{ {commit}; }} || {{ echo {nonce}-SETUP failed; exit 3; }}"]
    if kept:
        steps.append(_apply_script(SUBMISSION, f"{nonce}-APPLY"))
    if row.test_patch.strip():
        steps.append(
            f"git apply --whitespace=nowarn {TEST_PATCH} || {{ echo {nonce}-TESTPATCH failed; exit 3; }}; "
            f"rm -f {TEST_PATCH}"
        )
    junit = f"/tmp/agentrl-junit-{nonce}.xml"
    run = test_command(row, junit)
    steps += [
        "find . -name __pycache__ -prune -exec rm -rf {} +",
        PYTHON_SHIM,
        f"echo {nonce}-START",
        f"{run} 2>&1",
        f"code=$?; echo; echo {nonce}-EXIT $code",
        f"cat {junit} 2>/dev/null; rm -f {junit}",
    ]
    script = "\n".join(steps)
    result = await sandbox.exec(script, timeout=timeout, output_cap=64 * 2**20)
    output = result.output
    if f"{nonce}-SETUP failed" in output or f"{nonce}-TESTPATCH failed" in output:
        report["error"] = "the grading tree could not be set up: " + output[-500:]
        return report
    if kept:
        report["apply_method"] = _apply_method(output, nonce)
    if result.timed_out or f"{nonce}-EXIT" not in output:
        report["error"] = (
            f"the tests did not finish within {timeout:g} s"
            if result.timed_out
            else "the test run died: " + output[-500:]
        )
        report["log_tail"] = output[-2000:]
        return report
    before_exit, after_exit = output.rsplit(f"{nonce}-EXIT ", 1)
    log = before_exit.split(f"{nonce}-START", 1)[-1]
    code_text, _, junit_text = after_exit.partition("\n")
    exit_code = int(code_text.strip()) if code_text.strip().lstrip("-").isdigit() else None
    report["exit_code"] = exit_code
    from swebench.harness.constants import END_TEST_OUTPUT, START_TEST_OUTPUT, TEST_EXIT_CODE
    from swebench.harness.grading import get_eval_report
    from swebench.harness.utils import make_test_spec

    spec = make_test_spec(row.to_swebench(eval_script(row, run)))
    with tempfile.TemporaryDirectory(prefix="agentrl-swe-grade-") as tmp:
        log_path = Path(tmp) / "test_output.txt"
        log_path.write_text(f"{START_TEST_OUTPUT}\n{log}\n{END_TEST_OUTPUT}\n{TEST_EXIT_CODE}: {exit_code}\n")
        prediction = {"instance_id": row.instance_id, "model_name_or_path": "agentrl", "model_patch": kept}
        swe = get_eval_report(spec, prediction, str(log_path), include_tests_status=True)[row.instance_id]
    statuses = junit_statuses(junit_text)
    graded = (*row.FAIL_TO_PASS, *row.PASS_TO_PASS)
    junit_passed = {t: statuses.get(junit_key(t)) == "passed" for t in graded}
    tests_status = swe.get("tests_status", {})
    log_passed = set()
    for kind in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        log_passed |= set(tests_status.get(kind, {}).get("success", []))
    disagree = sorted(t for t in graded if (t in log_passed) != junit_passed[t])
    resolved = bool(swe.get("resolved")) and not disagree and exit_code == 0 and not tamper
    report.update(
        resolved=resolved,
        tests_status=tests_status,
        junit_disagrees=disagree,
        log_tail=log[-2000:],
    )
    if resolved:
        report["reward"] = 1.0
    elif partial_credit and not tamper and all(junit_passed[t] and t in log_passed for t in row.PASS_TO_PASS):
        passed = sum(junit_passed[t] and t in log_passed for t in row.FAIL_TO_PASS)
        report["reward"] = passed / len(row.FAIL_TO_PASS)
    return report


# The package directories of the tree in the current directory (as ``source_dirs`` finds them).
LIST_SOURCE_DIRS = (
    'for d in */ src/*/ lib/*/; do d=${d%/}; case "$d" in tests|test|testing|docs|doc|examples|benchmarks|ci) continue;; esac; '
    '[ -f "$d/__init__.py" ] && echo "DIR $d"; done; '
    'for f in *.py; do case "$f" in setup.py|conftest.py|noxfile.py|test*) ;; *) [ -f "$f" ] && echo "DIR $f";; esac; done'
)


async def grade_image_row(sandbox, row: SweRow, patch: str, timeout: float = 1800.0) -> dict[str, Any]:
    """Grade ``patch`` for an image row (SWE-bench's layout) in ``sandbox``, a fresh container of
    the row's image: the filtered patch applied in /testbed, then the row's own ``eval_script``
    (with swebench's exit-code line added), and swebench's report on its log."""
    listing = await sandbox.exec(LIST_SOURCE_DIRS, timeout=60)
    dirs = [line[4:] for line in listing.output.splitlines() if line.startswith("DIR ")]
    kept, report, tamper = _filtered(row, patch, dirs)
    nonce = secrets.token_hex(8)
    from swebench.harness.grading import get_eval_report
    from swebench.harness.utils import make_test_spec

    spec = make_test_spec(row.to_swebench())
    steps = [
        f"git reset -q --hard {row.base_commit} && git clean -fdq || {{ echo {nonce}-SETUP failed; exit 3; }}"
    ]
    if kept:
        await sandbox.write_file(SUBMISSION, kept)
        steps = [
            f"git reset -q --hard {row.base_commit} && git clean -fdq -e {SUBMISSION} "
            f"|| {{ echo {nonce}-SETUP failed; exit 3; }}",
            _apply_script(SUBMISSION, f"{nonce}-APPLY", ignored_too=False),
        ]
    steps += [
        f"echo {nonce}-START",
        f"bash -s <<'AGENTRL_EVAL_{nonce}' 2>&1\n{spec.eval_script}AGENTRL_EVAL_{nonce}",
    ]
    result = await sandbox.exec("\n".join(steps), timeout=timeout, output_cap=64 * 2**20)
    output = result.output
    if f"{nonce}-SETUP failed" in output:
        report["error"] = "the image's repository could not be reset to base_commit: " + output[-500:]
        return report
    if kept:
        report["apply_method"] = _apply_method(output, nonce)
    if result.timed_out or f"{nonce}-START" not in output:
        report["error"] = (
            f"the eval script did not finish within {timeout:g} s" if result.timed_out else output[-500:]
        )
        return report
    log = output.split(f"{nonce}-START", 1)[1]
    with tempfile.TemporaryDirectory(prefix="agentrl-swe-grade-") as tmp:
        log_path = Path(tmp) / "test_output.txt"
        log_path.write_text(log)
        prediction = {"instance_id": row.instance_id, "model_name_or_path": "agentrl", "model_patch": kept}
        swe = get_eval_report(spec, prediction, str(log_path), include_tests_status=True)[row.instance_id]
    resolved = bool(swe.get("resolved")) and not tamper
    report.update(resolved=resolved, tests_status=swe.get("tests_status", {}), log_tail=log[-2000:])
    report["reward"] = 1.0 if resolved else 0.0
    return report


# A submission that adds a conftest.py turning every report into a pass: grading must not count it.
CONFTEST_TAMPER = (
    "diff --git a/conftest.py b/conftest.py\nnew file mode 100644\n--- /dev/null\n+++ b/conftest.py\n"
    "@@ -0,0 +1,6 @@\n+import pytest\n+@pytest.hookimpl(hookwrapper=True)\n"
    "+def pytest_runtest_makereport(item, call):\n+    out = yield\n+    report = out.get_result()\n"
    '+    report.outcome = "passed"\n'
)


def validation_checks(row: SweRow) -> list[tuple[str, SweRow, str, bool]]:
    """What makes a row sound, as (name, row to grade, patch, resolved wanted): its gold patch
    resolves it; an empty patch and a conftest that rewrites reports as passes do not.
    ``agentrl swe validate`` and the builder (which keeps only rows that pass them in every backend)
    both check these. A patch that must not resolve the row is graded on its FAIL_TO_PASS tests
    alone (an sdist row): any of them failing decides it, and a suite of thousands of
    PASS_TO_PASS tests need not run again for it."""
    failing = row if row.from_image else replace(row, PASS_TO_PASS=())
    return [
        ("gold", row, row.patch, True),
        ("empty", failing, "", False),
        ("conftest tamper", failing, CONFTEST_TAMPER, False),
    ]
