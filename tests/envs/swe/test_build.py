"""Tasks built from an sdist by injecting one bug at a time: deterministic, and every row they make
validates (gold resolves, an empty patch and a conftest tamper do not) in a fresh sandbox. The
shipped set validates on a sample spread over its packages."""

import json

import pytest

from agentrl.cli import main
from agentrl.envs.swe import SHIPPED
from agentrl.envs.swe.build import build, write
from agentrl.envs.swe.rows import load_rows
from tests.envs.swe.fixture import make_sdist


def test_build_is_deterministic_and_its_rows_validate(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))
    sdist, _ = make_sdist(tmp_path)
    # the fixture's suite has 4 tests: let a bug fail up to all but one of them
    first = build(
        sdist,
        "mini",
        "1.0",
        out_dir=tmp_path,
        max_tasks=3,
        max_f2p_share=0.75,
        sandboxes=("local",),
        log=lambda _: None,
    )
    again = build(
        sdist,
        "mini",
        "1.0",
        out_dir=tmp_path,
        max_tasks=3,
        max_f2p_share=0.75,
        sandboxes=("local",),
        log=lambda _: None,
    )
    assert first == again and 1 <= len(first) <= 3
    for row in first:
        assert (
            row["FAIL_TO_PASS"]
            and row["PASS_TO_PASS"]
            and not set(row["FAIL_TO_PASS"]) & set(row["PASS_TO_PASS"])
        )
        assert row["hidden_tests"] == sorted({t.split("::")[0] for t in row["FAIL_TO_PASS"]})
        assert "-" in row["patch"] and row["source"]["sdist"] == "sources/mini-1.0.tar.gz"
        assert row["created_by"]["file"] == "mini/ops.py"
    write(first, tmp_path / "tasks.jsonl")
    assert len(load_rows(tmp_path / "tasks.jsonl")) == len(first)
    assert main(["swe", "validate", str(tmp_path / "tasks.jsonl"), "--sandbox", "local"]) == 0
    assert f"{len(first)} of {len(first)} rows as expected" in capsys.readouterr().out


def test_the_shipped_set_validates_on_a_sample(capsys):
    rows = load_rows(SHIPPED)
    repos = {r.repo for r in rows}
    assert {r.split for r in rows} == {"train", "test"}
    train = {r.repo for r in rows if r.split == "train"}
    assert not train & {r.repo for r in rows if r.split == "test"}  # held-out tasks come from other packages
    n = 3 * len(repos)
    assert main(["swe", "validate", str(SHIPPED), "--sample", str(n), "--sandbox", "local"]) == 0
    assert f"{n} of {n} rows as expected" in capsys.readouterr().out


def test_agentrl_swe_build_names_a_missing_sdist(tmp_path, capsys):
    assert main(["swe", "build", "--package", "nosuch==1.0", "--out", str(tmp_path)]) == 2
    assert "no sdist of nosuch==1.0" in capsys.readouterr().err
    assert main(["swe", "build", "--package", "toolz", "--out", str(tmp_path)]) == 2
    assert json.dumps("NAME==VERSION")[1:-1] in capsys.readouterr().err


def test_two_bugs_of_one_file_make_a_harder_task(tmp_path, monkeypatch):
    from agentrl.envs.swe.build import combine

    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))
    sdist, _ = make_sdist(tmp_path)
    singles = build(
        sdist,
        "mini",
        "1.0",
        out_dir=tmp_path,
        max_tasks=4,
        max_f2p_share=0.75,
        per_function=3,
        sandboxes=("local",),
        log=lambda _: None,
    )
    both = combine(singles, sdist, out_dir=tmp_path, n=1, sandboxes=("local",), log=lambda _: None)
    assert len(both) == 1, [s["created_by"] for s in singles]
    (row,) = both
    a, b = (next(s for s in singles if s["instance_id"] == i) for i in row["created_by"]["combined"])
    assert set(a["FAIL_TO_PASS"]) | set(b["FAIL_TO_PASS"]) <= set(row["FAIL_TO_PASS"])  # both fixes needed
    assert row["patch"].count("\n-") >= 2 and row["instance_id"].endswith("__c000")


def test_hint_levels_say_more_about_where_and_never_the_fix():
    from agentrl.envs.swe.build import problem_statement

    args = ("toolz", "itertoolz.Cls.frequencies", "tests/test_x.py::test_f", "assert 1 == 2", 3)
    texts = [problem_statement(*args, hints=h, file="toolz/itertoolz.py") for h in (0, 1, 2)]
    assert "frequencies" not in texts[0] and "itertoolz.py" not in texts[0]
    assert "`itertoolz.Cls.frequencies`" in texts[1] and "itertoolz.py`" not in texts[1]
    assert "`itertoolz.Cls.frequencies` in `toolz/itertoolz.py`" in texts[2]
    assert all("tests/test_x.py::test_f" in t and "assert 1 == 2" in t and "3 tests" in t for t in texts)
    with pytest.raises(ValueError, match="hints must be one of"):
        problem_statement(*args, hints=3)


def test_the_checks_that_must_not_resolve_grade_the_failing_tests_alone():
    from agentrl.envs.swe.grading import validation_checks

    row = next(r for r in load_rows(SHIPPED) if r.repo == "pypi/click")
    checks = validation_checks(row)
    assert [(name, want) for name, _, _, want in checks] == [
        ("gold", True),
        ("empty", False),
        ("conftest tamper", False),
    ]
    assert checks[0][1] is row  # the gold patch must pass the whole set
    for _, graded, _, _ in checks[1:]:
        assert graded.PASS_TO_PASS == () and graded.FAIL_TO_PASS == row.FAIL_TO_PASS
