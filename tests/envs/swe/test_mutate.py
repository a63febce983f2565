"""mutate: one-bug variants of real source, one function at a time. Each mutant parses, differs from
the original only on the lines it names, keeps the file's comments and formatting, and the same
inputs always draw the same list."""

import ast
import difflib
import fnmatch
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from agentrl.envs.swe.mutate import TRANSFORMS, mutants

SAMPLE = '''\
"""A module with comments, odd spacing and a non-ASCII line."""

import math  # unused on purpose


def scale(values, factor=2):
    """Multiply every value."""
    out = []
    for v in values:  # the loop
        out.append(v * factor)
    return out


def clamp(x, lo, hi):
    if x < lo:
        return lo
    elif x > hi:
        return hi
    else:
        return x


def total(items):
    # weird spacing on purpose
    result   =   0
    count = 0
    for item in items:
        result += item
    while count > 10 and result:
        count -= 1
    return result - count


def words(text):
    cleaned = text.strip().lower()  # normalise
    parts = sorted(cleaned.split())
    if not parts:
        return []
    if len(parts) > 1: parts = list(reversed(parts))
    label = "naïve—ok"; n = len(label) - len(parts)
    return [p for p in parts if p not in ("a", "the")] + [n]


class Base:
    pass


class Cache(Base, dict):
    """A cache."""

    limit = 3

    def __init__(self, size):
        super().__init__()
        self.size = size

    def __getitem__(self, key):
        if key in self and key is not None:
            return dict.__getitem__(self, key)
        raise KeyError(key)

    @property
    def full(self):
        return (len(self)
                >= self.size)

    def stub(self):
        """Only a docstring."""

    def todo(self):
        raise NotImplementedError


def outer(n):
    def inner(k):
        return k * 2 + 1
    return inner(n) // 3
'''
EVERYTHING = dict(max_per_function=1000)  # every candidate, no draw


def all_mutants(**kwargs):
    return mutants("pkg/sample.py", SAMPLE, **{**EVERYTHING, **kwargs})


def changed_original_lines(old: str, new: str) -> list[tuple[int, int]]:
    """1-based, inclusive line ranges of ``old`` that difflib reports as changed (or inserted before)."""
    matcher = difflib.SequenceMatcher(
        a=old.splitlines(keepends=True), b=new.splitlines(keepends=True), autojunk=False
    )
    return [(i1 + 1, max(i1 + 1, i2)) for tag, i1, i2, _, _ in matcher.get_opcodes() if tag != "equal"]


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_every_transform_has_a_mutant_that_parses_differs_and_stays_on_its_lines(transform):
    found = all_mutants(transforms=(transform,))
    assert found, f"no {transform} mutant in the sample"
    for m in found:
        assert m.transform == transform and m.path == "pkg/sample.py"
        ast.parse(m.source)
        assert m.source != SAMPLE
        for first, last in changed_original_lines(SAMPLE, m.source):
            assert m.lineno <= first and last <= m.end_lineno, (m.description, first, last)
        assert f"line {m.lineno}" in m.description or f"lines {m.lineno}-{m.end_lineno}" in m.description


def line(text: str) -> int:
    """The 1-based number of the sample's line that reads ``text``."""
    return SAMPLE.splitlines().index(text) + 1


def only(transform: str, function: str) -> list:
    return [m for m in all_mutants(transforms=(transform,)) if m.function == function]


def test_edits_touch_only_the_changed_text():
    def lines(m):  # (removed, added) lines of the diff
        diff = list(difflib.unified_diff(SAMPLE.splitlines(), m.source.splitlines(), lineterm="", n=0))[2:]
        return [d[1:] for d in diff if d[0] == "-"], [d[1:] for d in diff if d[0] == "+"]

    (flip,) = [m for m in only("op_flip", "clamp") if "`<` became `>`" in m.description]
    assert lines(flip) == (["    if x < lo:"], ["    if x > lo:"])
    assert flip.description == f"`<` became `>` in clamp (line {line('    if x < lo:')})"
    (chain,) = only("break_chain", "words")
    assert lines(chain) == (
        ["    cleaned = text.strip().lower()  # normalise"],
        ["    cleaned = text.strip()  # normalise"],  # the comment stays
    )
    (zero,) = [
        m
        for m in only("constant_shift", "total")
        if m.lineno == line("    result   =   0") and "`0` became `1`" in m.description
    ]
    assert lines(zero) == (["    result   =   0"], ["    result   =   1"])  # the spacing stays
    minus = only("op_change", "words")  # after a non-ASCII string on the same line: byte columns
    assert any(lines(m)[1] == ['    label = "naïve—ok"; n = len(label) + len(parts)'] for m in minus)
    dropped = [m for m in only("remove_condition", "words") if m.lineno == line("    if not parts:")]
    assert [lines(m) for m in dropped] == [(["    if not parts:", "        return []"], ["    return []"])]
    (negated,) = [m for m in only("invert_if", "words") if m.lineno == line("    if not parts:")]
    assert lines(negated) == (["    if not parts:"], ["    if parts:"])
    # `if` with `else`: negating the condition is swapping the branches, on one line of text
    assert [lines(m) for m in only("invert_if", "clamp") if m.lineno == line("    if x < lo:")] == [
        (["    if x < lo:"], ["    if not x < lo:"])
    ]
    bases = only("remove_base", "Cache")
    assert sorted(lines(m)[1][0] for m in bases) == ["class Cache(Base):", "class Cache(dict):"]
    (prop,) = [m for m in only("remove_method", "Cache") if "`full`" in m.description]
    removed, added = lines(prop)
    assert removed[:2] == ["    @property", "    def full(self):"] and added == []  # the decorator goes too
    assert "\n\n\n    def stub" not in prop.source  # one blank line between the remaining methods
    (swap,) = only("shuffle_statements", "words")
    assert "parts = sorted(cleaned.split())\n    cleaned = text.strip().lower()  # normalise\n" in swap.source


def test_names_follow_qualnames_and_class_level_transforms_name_the_class():
    by_function = Counter(m.function for m in all_mutants())
    assert {"scale", "clamp", "total", "words", "Cache.__init__", "Cache.__getitem__", "Cache.full"} <= set(
        by_function
    )
    assert by_function["outer.<locals>.inner"] and by_function["outer"]
    assert {m.function for m in all_mutants(transforms=("remove_base", "remove_method"))} == {"Cache"}
    # the nested function is its own scope: `outer` never touches `k * 2 + 1`
    assert all("k * 2 + 1" in m.source for m in all_mutants() if m.function == "outer")


def test_stub_functions_and_only_independent_swaps_are_skipped():
    found = all_mutants()
    assert not {m.function for m in found} & {"Cache.stub", "Cache.todo", "Base"}
    assert not [
        m
        for m in found
        if m.transform == "remove_method" and ("`stub`" in m.description or "`todo`" in m.description)
    ]
    assert not [m for m in found if m.transform == "remove_method" and "`__init__`" in m.description]
    swaps = {m.function for m in found if m.transform == "shuffle_statements"}
    # `result = 0` / `count = 0` are independent; a call then an attribute write are not
    assert "total" not in swaps and "Cache.__init__" in swaps


def test_same_inputs_same_list_and_the_seed_draws_when_over_the_cap():
    first = mutants("pkg/sample.py", SAMPLE)
    assert first == mutants("pkg/sample.py", SAMPLE)
    assert max(Counter(m.function for m in first).values()) <= 3
    draws = {tuple(mutants("pkg/sample.py", SAMPLE, seed=seed, max_per_function=1)) for seed in range(8)}
    assert len(draws) > 1
    assert all(len(d) == len(next(iter(draws))) for d in draws)  # one per function with a candidate
    assert mutants("other/sample.py", SAMPLE) != first  # the path is part of the draw's seed


def test_bad_arguments_name_the_value_and_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown transform 'op_flop'.*op_flip"):
        mutants("a.py", SAMPLE, transforms=("op_flip", "op_flop"))
    with pytest.raises(ValueError, match="sequence of names"):
        mutants("a.py", SAMPLE, transforms="op_flip")
    with pytest.raises(ValueError, match="max_per_function must be at least 1, got 0"):
        mutants("a.py", SAMPLE, max_per_function=0)


def test_a_mutant_changes_what_the_function_computes():
    source = "def add(a, b):\n    return a + b\n"
    (m,) = mutants("add.py", source)
    assert m.transform == "op_change" and m.description == "`+` became `-` in add (line 2)"
    original, mutant = {}, {}
    exec(source, original)
    exec(m.source, mutant)
    assert original["add"](2, 3) == 5 and mutant["add"](2, 3) == -1


def test_removal_keeps_one_blank_line_and_a_file_without_final_newline():
    source = "class A:\n    def a(self):\n        return 1\n\n    def b(self):\n        return 2\n"
    (m,) = [m for m in mutants("a.py", source, transforms=("remove_method",)) if "`b`" in m.description]
    assert m.source == "class A:\n    def a(self):\n        return 1\n"  # no trailing blank line left
    source = "def f(d, k):\n    v = d[k]\n    d[k] = v + 1"  # no newline at the end
    (swap,) = mutants("f.py", source, transforms=("shuffle_statements",))
    assert swap.source == "def f(d, k):\n    d[k] = v + 1\n    v = d[k]"


def library_sources() -> list[tuple[str, str]]:
    """A real pure-Python library installed here (click), and two stdlib modules whatever is installed."""
    files = [Path(textwrap.__file__), Path(fnmatch.__file__)]
    try:
        import click
    except ImportError:
        pass
    else:
        # core.py (3,800 lines) is left out only to keep the test fast: each check re-parses a whole file
        files += sorted(p for p in Path(click.__file__).parent.glob("*.py") if p.name != "core.py")
    return [(str(p), p.read_text()) for p in files]


def test_real_library_sources_give_mutants_that_parse_and_stay_on_their_lines():
    counts = Counter()
    for path, text in library_sources():
        old = text.splitlines(keepends=True)
        for m in mutants(path, text, max_per_function=1):
            counts[m.transform] += 1
            ast.parse(m.source)
            new = m.source.splitlines(keepends=True)
            kept_tail = len(old) - m.end_lineno
            assert old[: m.lineno - 1] == new[: m.lineno - 1], m.description
            assert old[m.end_lineno :] == new[len(new) - kept_tail :], m.description
    assert sum(counts.values()) > 50 and len(counts) >= 8, counts
