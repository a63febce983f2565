"""Procedural generator of small Python projects with exactly one bug and a pytest suite that exposes it.

A task is a package of ``n_modules`` modules, each holding a few functions drawn from the
templates below (names and constants drawn too), a test module per source module, and one bug
injected into one function. Every bug kind is a textual edit of one function; a generated task
is checked in-process before it is returned: all tests pass on the correct code, and at least
one fails on the buggy code.

Splits: a task belongs to the held-out split ``test`` exactly when the hash of its content with the
drawn names left out (``BugfixTask.key``: package, module and function names) falls in the first
tenth of the hash space, and to ``train`` otherwise. So the splits share no task, not even one renamed:
the same functions, constants and bug under other names are the same task. Train task ``index`` is
drawn from a seed made of both, re-drawn until it lands in ``train``. The held-out tasks are also
distinct from each other: test task ``i`` is the ``i``-th new key met in one seeded stream of draws, so a
held-out score counts each task once, and a layout too narrow to hold as many held-out tasks as asked
for stops with the number it holds (``HeldOutExhausted``).

Hidden checks: besides its tests, each function is checked on ``HIDDEN_PER_FUNCTION`` inputs drawn
from the task's hash (``Function.hidden``), with the correct code's results as expected values. The
grader evaluates them with the tests; they appear in no file the agent sees, so a patch that
special-cases the tests' inputs instead of fixing the code fails them.
"""

from __future__ import annotations

import hashlib
import random
import re
import textwrap
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

BUG_KINDS = (
    "wrong_operator",
    "off_by_one",
    "wrong_constant",
    "swapped_args",
    "missing_edge_case",
    "wrong_comparison",
)
SPLITS = ("train", "test")
PACKAGES = ("toolkit", "calc", "helpers", "mylib", "utilkit", "corelib", "numkit", "basics")
MODULES = ("mathops", "stats", "text_utils", "units", "scoring", "series", "finance", "measures", "sequences")


@dataclass
class Function:
    name: str
    code: str
    """Correct source (a complete ``def``)."""
    tests: list[str]
    """Test bodies (``assert ...`` lines) that pass on the correct code."""
    bugs: dict[str, tuple[str, str]]
    """kind -> (correct snippet, buggy snippet): the buggy code replaces the snippet in ``code``."""
    hidden: Callable[[random.Random], str]
    """Draws the arguments of one hidden check as call text (``"([1, 2], 3)"``): inputs of the kind
    the tests stand for, leaving out what they leave open (ties, negative counts). The grader
    compares the function's result on them with the correct code's; the agent never sees them."""


def _pick(rng: random.Random, names: tuple[str, ...]) -> str:
    return rng.choice(names)


# --- templates: each draws names and constants, and knows its own bugs and tests ----------------


def _ints(rng: random.Random, shortest: int, longest: int, lo: int = -20, hi: int = 20) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(shortest, longest))]


def _clamp_args(rng: random.Random) -> str:
    lo = rng.randint(-20, 10)
    hi = lo + rng.randint(1, 25)
    return f"({rng.randint(lo - 10, hi + 10)}, {lo}, {hi})"


def _last_n_args(rng: random.Random) -> str:
    items = _ints(rng, 0, 7, 0, 9)
    return f"({items}, {rng.randint(0, len(items))})"


def _word(rng: random.Random, shortest: int, longest: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(shortest, longest)))


def _fit_width_args(rng: random.Random) -> str:
    return f"({_word(rng, 0, 10)!r}, {rng.randint(0, 12)})"


def t_scale(rng):
    name = _pick(rng, ("scale", "scale_all", "multiply_each", "times_each"))
    k = rng.randint(2, 9)
    values = [rng.randint(-9, 9) for _ in range(3)]
    code = f"def {name}(values, factor):\n    return [v * factor for v in values]\n"
    tests = [
        f"assert {name}({values}, {k}) == {[v * k for v in values]}",
        f"assert {name}([1, 2, 3], {k}) == [{k}, {2 * k}, {3 * k}]",
        f"assert {name}([], {k}) == []",
    ]
    bugs = {"wrong_operator": ("v * factor", "v + factor")}
    return Function(name, code, tests, bugs, lambda r: f"({_ints(r, 1, 6)}, {r.randint(-5, 9)})")


def t_sum_to(rng):
    name = _pick(rng, ("sum_to", "triangle", "sum_up_to", "total_to"))
    n, m = rng.randint(4, 12), rng.randint(13, 99)
    code = f"def {name}(n):\n    total = 0\n    for i in range(1, n + 1):\n        total += i\n    return total\n"
    tests = [
        f"assert {name}({n}) == {n * (n + 1) // 2}",
        f"assert {name}({m}) == {m * (m + 1) // 2}",
        f"assert {name}(1) == 1",
        f"assert {name}(0) == 0",
    ]
    return Function(
        name,
        code,
        tests,
        {"off_by_one": ("range(1, n + 1)", "range(1, n)"), "wrong_operator": ("total += i", "total *= i")},
        lambda r: f"({r.randint(2, 150)})",
    )


def t_clamp(rng):
    name = _pick(rng, ("clamp", "bound", "limit", "clip_value"))
    lo, hi = rng.randint(-10, 0), rng.randint(5, 20)
    inside = rng.randint(lo, hi)
    code = f"def {name}(x, lo, hi):\n    if x < lo:\n        return lo\n    if x > hi:\n        return hi\n    return x\n"
    tests = [
        f"assert {name}({inside}, {lo}, {hi}) == {inside}",
        f"assert {name}({lo - 3}, {lo}, {hi}) == {lo}",
        f"assert {name}({hi + 4}, {lo}, {hi}) == {hi}",
        f"assert {name}(3, {lo}, {hi}) == 3",
    ]
    return Function(
        name,
        code,
        tests,
        {
            "wrong_comparison": ("if x > hi:", "if x < hi:"),
            "swapped_args": ("    if x < lo:\n        return lo\n", "    if x < lo:\n        return hi\n"),
        },
        _clamp_args,
    )


def t_linear(rng):
    name = _pick(rng, ("convert", "to_units", "calibrate", "rescale"))
    a, b = rng.randint(2, 9), rng.randint(3, 40)
    code = f"def {name}(value):\n    return value * {a} + {b}\n"
    tests = [
        f"assert {name}(0) == {b}",
        f"assert {name}(10) == {10 * a + b}",
        f"assert {name}(-2) == {-2 * a + b}",
    ]
    return Function(
        name,
        code,
        tests,
        {"wrong_constant": (f"+ {b}", f"+ {b + rng.randint(1, 3)}"), "wrong_operator": (f"+ {b}", f"- {b}")},
        lambda r: f"({r.randint(-50, 50)})",
    )


def t_safe_divide(rng):
    name = _pick(rng, ("safe_divide", "divide_or", "checked_ratio", "div_default"))
    d = rng.randint(-9, -1)
    code = f"def {name}(a, b, default={d}):\n    if b == 0:\n        return default\n    return a / b\n"
    tests = [
        f"assert {name}(9, 3) == 3",
        f"assert {name}(5, 0) == {d}",
        f"assert {name}(1, 0, default=7) == 7",
    ]
    return Function(
        name,
        code,
        tests,
        {
            "missing_edge_case": (
                "    if b == 0:\n        return default\n    return a / b",
                "    return a / b",
            ),
            "swapped_args": ("return a / b", "return b / a"),
        },
        lambda r: f"({r.randint(-30, 30)}, {r.choice((0, r.randint(-6, -1), r.randint(1, 6)))})",
    )


def t_count_at_least(rng):
    name = _pick(rng, ("count_at_least", "count_passing", "num_above", "tally_min"))
    t = rng.randint(3, 8)
    values = [rng.randint(0, 12) for _ in range(4)]
    code = f"def {name}(values, threshold):\n    return sum(1 for v in values if v >= threshold)\n"
    tests = [
        f"assert {name}({values}, {t}) == {sum(v >= t for v in values)}",
        f"assert {name}([{t - 1}, {t}, {t + 1}], {t}) == 2",
        f"assert {name}([], {t}) == 0",
        f"assert {name}([{t}, {t}], {t}) == 2",
    ]
    bugs = {"wrong_comparison": ("v >= threshold", "v > threshold")}
    return Function(name, code, tests, bugs, lambda r: f"({_ints(r, 0, 6, 0, 15)}, {r.randint(0, 15)})")


def t_percent(rng):
    name = _pick(rng, ("percent", "share", "percentage", "pct_of"))
    part, whole = rng.randint(1, 4), rng.choice((5, 8, 10, 20))
    part2, whole2 = rng.randint(1, 19), rng.choice((2, 4, 25, 40, 50))
    code = f"def {name}(part, whole):\n    return part / whole * 100\n"
    tests = [
        f"assert {name}({part}, {whole}) == {part / whole * 100!r}",
        f"assert {name}({part2}, {whole2}) == {part2 / whole2 * 100!r}",
        f"assert {name}(0, {whole}) == 0",
    ]
    bugs = {"swapped_args": ("part / whole", "whole / part")}
    return Function(name, code, tests, bugs, lambda r: f"({r.randint(0, 50)}, {r.randint(1, 60)})")


def t_last_n(rng):
    name = _pick(rng, ("last_n", "tail", "take_last", "most_recent"))
    items = [rng.randint(0, 9) for _ in range(rng.randint(3, 6))]
    n = rng.randint(1, len(items) - 1)
    code = f"def {name}(items, n):\n    if n <= 0:\n        return []\n    return items[-n:]\n"
    tests = [
        f"assert {name}({items}, {n}) == {items[-n:]}",
        f"assert {name}([1, 2, 3, 4], 2) == [3, 4]",
        f"assert {name}([1, 2, 3], 0) == []",
        f"assert {name}([], 3) == []",
    ]
    return Function(
        name,
        code,
        tests,
        {
            "missing_edge_case": (
                "    if n <= 0:\n        return []\n    return items[-n:]",
                "    return items[-n:]",
            ),
            "off_by_one": ("items[-n:]", "items[-n + 1:]"),
        },
        _last_n_args,
    )


def t_is_leap(rng):
    name = _pick(rng, ("is_leap", "leap_year", "has_feb_29", "is_leap_year"))
    leap = 4 * rng.randint(400, 550)
    leap += 4 if leap % 100 == 0 else 0
    century = rng.choice((1700, 1800, 1900, 2100, 2200, 2300))
    quad = rng.choice((1600, 2000, 2400))
    plain = rng.randint(1601, 2199)
    plain += 1 if plain % 4 == 0 else 0
    code = f"def {name}(year):\n    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n"
    tests = [
        f"assert {name}({leap}) is True",
        f"assert {name}({century}) is False",
        f"assert {name}({quad}) is True",
        f"assert {name}({plain}) is False",
    ]
    return Function(
        name,
        code,
        tests,
        {
            "missing_edge_case": ("(year % 100 != 0 or year % 400 == 0)", "year % 100 != 0"),
            "wrong_constant": ("year % 400 == 0", "year % 300 == 0"),
        },
        lambda r: f"({r.choice((100 * r.randint(1, 30), r.randint(1, 3000)))})",
    )


def t_argmax(rng):
    name = _pick(rng, ("argmax", "index_of_max", "best_index", "peak_index"))
    values = [rng.randint(0, 20) for _ in range(4)] + [25]
    code = (
        f"def {name}(values):\n    best = 0\n    for i in range(1, len(values)):\n"
        f"        if values[i] > values[best]:\n            best = i\n    return best\n"
    )
    tests = [f"assert {name}({values}) == 4", f"assert {name}([7]) == 0", f"assert {name}([9, 1, 3]) == 0"]
    return Function(
        name,
        code,
        tests,
        {
            "off_by_one": ("range(1, len(values))", "range(1, len(values) - 1)"),
            "wrong_comparison": ("values[i] > values[best]", "values[i] < values[best]"),
        },
        lambda r: f"({r.sample(range(-30, 30), r.randint(1, 7))})",  # distinct: no tie to break
    )


def t_average(rng):
    name = _pick(rng, ("average", "mean", "mean_of", "avg"))
    vals = [rng.randint(1, 9) * 2 for _ in range(3)]
    code = (
        f"def {name}(values):\n    if not values:\n        return 0.0\n    return sum(values) / len(values)\n"
    )
    tests = [
        f"assert {name}({vals}) == {sum(vals) / 3!r}",
        f"assert {name}([]) == 0.0",
        f"assert {name}([5]) == 5",
    ]
    return Function(
        name,
        code,
        tests,
        {
            "missing_edge_case": (
                "    if not values:\n        return 0.0\n    return sum(values) / len(values)",
                "    return sum(values) / len(values)",
            ),
            "wrong_operator": ("sum(values) / len(values)", "sum(values) * len(values)"),
        },
        lambda r: f"({_ints(r, 0, 6)})",
    )


def t_fit_width(rng):
    name = _pick(rng, ("fit_width", "pad_to", "fixed_width", "left_justify"))
    w = rng.randint(4, 8)
    short = _word(rng, 1, 3)
    code = f"def {name}(text, width, fill='.'):\n    return text[:width].ljust(width, fill)\n"
    tests = [
        f"assert {name}({short!r}, {w}) == {short!r} + '.' * {w - len(short)}",
        f"assert {name}('x' * {w + 3}, {w}) == 'x' * {w}",
    ]
    bugs = {"swapped_args": ("ljust(width, fill)", "ljust(fill, width)")}
    return Function(name, code, tests, bugs, _fit_width_args)


def t_discount(rng):
    name = _pick(rng, ("apply_discount", "discounted", "sale_price", "net_price"))
    pct = rng.choice((10, 20, 25, 50))
    price = rng.choice((40, 80, 200))
    code = f"def {name}(price, percent):\n    return price * (100 - percent) / 100\n"
    tests = [
        f"assert {name}({price}, {pct}) == {price * (100 - pct) / 100!r}",
        f"assert {name}({price}, 0) == {price}",
    ]
    return Function(
        name,
        code,
        tests,
        {
            "wrong_constant": ("(100 - percent) / 100", "(100 - percent) / 10"),
            "wrong_operator": ("100 - percent", "100 + percent"),
        },
        lambda r: f"({r.randint(1, 500)}, {r.randint(0, 100)})",
    )


TEMPLATES: tuple[Callable[[random.Random], Function], ...] = (
    t_scale,
    t_sum_to,
    t_clamp,
    t_linear,
    t_safe_divide,
    t_count_at_least,
    t_percent,
    t_last_n,
    t_is_leap,
    t_argmax,
    t_average,
    t_fit_width,
    t_discount,
)
TEMPLATE_NAMES = tuple(t.__name__.removeprefix("t_") for t in TEMPLATES)
"""The names the ``templates`` knob takes (``scale``, ``sum_to``, ...)."""


# --- tasks --------------------------------------------------------------------------------------


@dataclass
class BugfixTask:
    id: str
    split: str
    package: str
    files: dict[str, str]
    """Path -> content of every file of the project."""
    test_files: list[str]
    n_tests: int
    bug_kind: str
    buggy_path: str
    fix: dict[str, str]
    """``{"path", "old", "new"}``: the edit that fixes the bug (the scripted expert's)."""
    failing_tests: list[str] = field(default_factory=list)
    content_hash: str = ""
    """Hash of the files, names and all."""
    key: str = ""
    """Hash of the task with its drawn names left out: what the splits and held-out distinctness go by."""
    hidden: list[tuple[str, str, Any]] = field(default_factory=list)
    """Hidden checks, ``HIDDEN_PER_FUNCTION`` per function: (module, call, the correct code's result),
    on inputs drawn from the task's hash. The expected values never enter a sandbox, the calls only
    the grading one: a patch that carries the tests' answers instead of the fix fails these."""


HIDDEN_PER_FUNCTION = 3
_EXPOSE_TRIES = 200


def _hidden_checks(
    package: str,
    layout: dict[str, list[Function]],
    sources: dict[str, str],
    target: tuple[Function, str],
    rng: random.Random,
) -> list[tuple[str, str, Any]]:
    """``HIDDEN_PER_FUNCTION`` checks per function; when none of the buggy function's exposes its bug
    (``target``: the function, its module's buggy source), one more that does, if the draws find one,
    so that keeping the bug and special-casing the tests fails."""
    found = []
    target_fn, buggy_source = target
    for module, functions in layout.items():
        correct = _namespace(sources[module], module)
        for fn in functions:
            calls = [f"{fn.name}{fn.hidden(rng)}" for _ in range(HIDDEN_PER_FUNCTION)]
            if fn is target_fn:
                buggy = _namespace(buggy_source, module)
                if all(_outcome(c, buggy) == _outcome(c, correct) for c in calls):
                    for _ in range(_EXPOSE_TRIES):
                        call = f"{fn.name}{fn.hidden(rng)}"
                        if _outcome(call, buggy) != _outcome(call, correct):
                            calls.append(call)
                            break
            found += [(f"{package}.{module}", call, eval(call, dict(correct))) for call in calls]
    return found


def _namespace(source: str, module: str) -> dict:
    found: dict = {}
    exec(compile(source, module, "exec"), found)
    return found


def _outcome(call: str, namespace: dict) -> tuple[bool, Any]:
    """(whether ``call`` returned, and what) in ``namespace``."""
    try:
        return True, eval(call, dict(namespace))
    except Exception:
        return False, None


def _module_source(functions: list[Function]) -> str:
    return "\n\n".join(f.code for f in functions)


def _test_source(package: str, module: str, functions: list[Function]) -> str:
    imports = ", ".join(f.name for f in functions)
    parts = [f"from {package}.{module} import {imports}\n"]
    for f in functions:
        for i, line in enumerate(f.tests):
            parts.append(f"\ndef test_{f.name}_{i}():\n    {line}\n")
    return "\n".join(parts)


def _run_tests(sources: dict[str, str], tests: dict[str, str]) -> list[str]:
    """Failing test names when the tests run in-process against ``sources`` (module name -> code)."""
    failing = []
    namespaces = {module: _namespace(code, module) for module, code in sources.items()}
    for module, code in tests.items():
        ns = dict(namespaces[module])
        body = code.split("\n", 1)[1]  # drop the import line: the names are already in ns
        exec(compile(body, f"test_{module}", "exec"), ns)
        for name, fn in list(ns.items()):
            if name.startswith("test_") and callable(fn):
                try:
                    fn()
                except Exception:
                    failing.append(f"test_{module}.py::{name}")
    return failing


def _draw(
    rng: random.Random,
    n_modules: int,
    n_functions: int,
    packages: tuple[str, ...] = PACKAGES,
    module_names: tuple[str, ...] = MODULES,
    template_pool: tuple[Callable[[random.Random], Function], ...] = TEMPLATES,
    single_bug: bool = False,
) -> BugfixTask | None:
    package = rng.choice(packages)
    modules = rng.sample(module_names, n_modules)
    templates = rng.sample(template_pool, n_modules * n_functions)
    layout: dict[str, list[Function]] = {}
    used: set[str] = set()
    for i, module in enumerate(modules):
        layout[module] = []
        for template in templates[i * n_functions : (i + 1) * n_functions]:
            fn = template(rng)
            if fn.name in used:
                return None
            used.add(fn.name)
            layout[module].append(fn)
    module = rng.choice(modules)
    target = rng.choice(layout[module])
    kinds = sorted(target.bugs)
    kind = kinds[0] if single_bug else rng.choice(kinds)
    correct_snippet, buggy_snippet = target.bugs[kind]
    if target.code.count(correct_snippet) != 1:
        return None
    buggy_code = target.code.replace(correct_snippet, buggy_snippet)
    sources = {m: _module_source(fns) for m, fns in layout.items()}
    tests = {m: _test_source(package, m, fns) for m, fns in layout.items()}
    if _run_tests(sources, tests):
        raise AssertionError(f"template tests fail on correct code: {sources}")
    buggy_sources = dict(sources)
    buggy_sources[module] = sources[module].replace(target.code, buggy_code)
    if buggy_sources[module].count(buggy_snippet) != 1:
        return None  # the expert's edit must be unambiguous
    failing = _run_tests(buggy_sources, tests)
    if not failing:
        return None  # this draw of constants does not expose the bug
    files = {f"{package}/__init__.py": f'"""The {package} package."""\n'}
    for m in modules:
        files[f"{package}/{m}.py"] = buggy_sources[m]
        files[f"tests/test_{m}.py"] = tests[m]
    files["tests/__init__.py"] = ""
    n_tests = sum(len(f.tests) for fns in layout.values() for f in fns)
    digest = hashlib.sha256("\0".join(f"{k}\0{v}" for k, v in sorted(files.items())).encode()).hexdigest()
    return BugfixTask(
        id="",
        split="",
        package=package,
        files=files,
        test_files=sorted(p for p in files if p.startswith("tests/")),
        n_tests=n_tests,
        bug_kind=kind,
        buggy_path=f"{package}/{module}.py",
        fix={"path": f"{package}/{module}.py", "old": buggy_snippet, "new": correct_snippet},
        failing_tests=[f"tests/{name}" for name in failing],
        content_hash=digest,
        key=_nameless_key([layout[m] for m in modules], target, kind),
        hidden=_hidden_checks(
            package, layout, sources, (target, buggy_sources[module]), random.Random(digest)
        ),
    )


def _nameless_key(modules: list[list[Function]], target: Function, kind: str) -> str:
    """Hash of a draw with its names replaced by their places (``f0``, ``f1``, ...; the package's and
    modules' names, which only the paths and imports carry, left out). The places follow an order of
    the draw's own, not the drawing order: the functions of each module sorted by their text with
    their name left out, and the modules by theirs, so that the same functions drawn in another
    order are the same task."""

    def text(fn: Function) -> str:
        rename = re.compile(rf"\b{re.escape(fn.name)}\b")
        bugs = [x for k in sorted(fn.bugs) for x in (k, *fn.bugs[k])]
        return "\0".join(rename.sub("f", x) for x in (fn.code, *fn.tests, *bugs))

    modules = sorted((sorted(fns, key=text) for fns in modules), key=lambda fns: [text(fn) for fn in fns])
    parts, place = [kind, str([fn for fns in modules for fn in fns].index(target))], 0
    for functions in modules:
        parts.append("module")
        for fn in functions:
            rename = re.compile(rf"\b{re.escape(fn.name)}\b")
            new = f"f{place}"
            parts += [rename.sub(new, fn.code), *(rename.sub(new, t) for t in fn.tests)]
            parts += [rename.sub(new, x) for k in sorted(fn.bugs) for x in (k, *fn.bugs[k])]
            place += 1
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def fails_after(task: BugfixTask, old: str, new: str) -> bool:
    """Whether some test still fails (or the code no longer runs) once ``old`` becomes ``new`` in the
    buggy file, the tests run in-process."""
    files = dict(task.files)
    files[task.fix["path"]] = files[task.fix["path"]].replace(old, new, 1)
    prefix = f"{task.package}/"
    sources = {p[len(prefix) : -3]: c for p, c in files.items() if p.startswith(prefix) and p.count("/") == 1}
    sources.pop("__init__", None)
    tests = {p[len("tests/test_") : -3]: c for p, c in files.items() if p.startswith("tests/test_")}
    try:
        return bool(_run_tests(sources, tests))
    except Exception:
        return True


def split_of(key: str) -> str:
    """The split of a task with this ``BugfixTask.key``."""
    return "test" if int(key[:8], 16) < 0x19999999 else "train"  # first tenth of the hash space


class HeldOutExhausted(IndexError):
    """The held-out split holds fewer distinct tasks than were asked for under these arguments (an
    ``IndexError``: a split listed as longer ends here)."""

    def __init__(self, held: int, draws: int):
        self.held = held
        super().__init__(
            f"the held-out split holds {held} distinct task(s) under these arguments (no new one in "
            f"{draws:,} draws): ask for at most {held}, or widen the draw (more templates, packages or "
            "modules do not count: names are left out when tasks are compared)"
        )


HELD_OUT_PATIENCE = 20_000
"""Draws without a new held-out task after which the held-out split counts as exhausted."""


class _HeldOut:
    """The held-out split under one set of arguments: the draws (by attempt number) that gave a new key,
    in order, found as far as asked for."""

    def __init__(self):
        self.lock = threading.Lock()
        self.attempts: list[int] = []
        self.keys: set[str] = set()
        self.next_attempt = 0
        self.exhausted = False


_HELD_OUT: dict[str, _HeldOut] = {}


def generate(
    split: str,
    index: int,
    *,
    n_modules: int = 2,
    n_distractors: int = 2,
    seed: int = 0,
    packages: tuple[str, ...] | None = None,
    modules: tuple[str, ...] | None = None,
    templates: tuple[str, ...] | None = None,
    single_bug: bool = False,
) -> BugfixTask:
    """Task ``index`` of ``split``; the same arguments always give the same task.

    ``n_modules`` source modules, each with ``1 + n_distractors`` functions (one of all of them buggy).
    ``packages`` / ``modules``: the names the package and its modules are drawn from (default:
    ``PACKAGES`` / ``MODULES``); one name each gives every task the same file layout.
    ``templates``: the function templates drawn from, by name (default: all of ``TEMPLATE_NAMES``).
    ``single_bug``: each template injects only the first of its bug kinds (in alphabetical order),
    so a function's template, which its name tells, also tells the fix.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}; got {split!r}")
    package_names, module_names, template_names = check_layout(
        n_modules, n_distractors, packages, modules, templates, single_bug
    )
    if index < 0:
        raise ValueError(f"index must be >= 0; got {index}")
    n_functions = 1 + n_distractors
    names = "" if (package_names, module_names) == (PACKAGES, MODULES) else f"/{package_names}/{module_names}"
    if template_names != TEMPLATE_NAMES:
        names += f"/{template_names}"
    if single_bug:
        names += "/single-bug"
    pool = tuple(TEMPLATES[TEMPLATE_NAMES.index(n)] for n in template_names)

    def draw(stream: str, attempt: int) -> BugfixTask | None:
        rng = random.Random(f"bugfix/{seed}/{stream}/{n_modules}/{n_distractors}{names}/{attempt}")
        return _draw(rng, n_modules, n_functions, package_names, module_names, pool, single_bug)

    if split == "test":
        held = _HELD_OUT.setdefault(f"{seed}/{n_modules}/{n_distractors}{names}", _HeldOut())
        with held.lock:
            task = _held_out(held, index, lambda attempt: draw("test", attempt))
    else:
        for attempt in range(10_000):
            task = draw(f"{split}/{index}", attempt)
            if task is not None and split_of(task.key) == split:
                break
        else:  # pragma: no cover (nine in ten draws land in train)
            raise RuntimeError(f"could not draw task {split}/{index}")
    task.id = f"{split}-{index:06d}-m{n_modules}d{n_distractors}" + (f"-s{seed}" if seed else "")
    if names:
        task.id += "-n" + hashlib.sha256(names.encode()).hexdigest()[:6]
    task.split = split
    return task


def _held_out(held: _HeldOut, index: int, draw: Callable[[int], BugfixTask | None]) -> BugfixTask:
    """Held-out task ``index``: the draw that gave the ``index``-th new key in the test stream."""
    if index < len(held.attempts):
        task = draw(held.attempts[index])
        assert task is not None
        return task
    last = held.next_attempt
    while not held.exhausted:
        attempt = held.next_attempt
        held.next_attempt += 1
        task = draw(attempt)
        if task is not None and split_of(task.key) == "test" and task.key not in held.keys:
            held.keys.add(task.key)
            held.attempts.append(attempt)
            last = held.next_attempt
            if len(held.attempts) > index:
                return task
        elif held.next_attempt - last >= HELD_OUT_PATIENCE:
            held.exhausted = True
    raise HeldOutExhausted(len(held.attempts), HELD_OUT_PATIENCE)


def check_layout(
    n_modules: int, n_distractors: int, packages=None, modules=None, templates=None, single_bug=False
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """Validate the knobs of ``generate`` (its layout and ``single_bug``); returns the package, module and
    template name pools."""
    if not isinstance(single_bug, bool):
        raise ValueError(f"single_bug must be true or false; got {single_bug!r}")
    package_names = _names("packages", packages, PACKAGES)
    module_names = _names("modules", modules, MODULES)
    template_names = _names("templates", templates, TEMPLATE_NAMES)
    unknown = [n for n in template_names if n not in TEMPLATE_NAMES]
    if unknown:
        raise ValueError(f"unknown templates {unknown}; the templates are {list(TEMPLATE_NAMES)}")
    if not 1 <= n_modules <= len(module_names):
        raise ValueError(
            f"n_modules must be in [1, {len(module_names)}] (the number of module names); got {n_modules}"
        )
    n_functions = 1 + n_distractors
    if n_distractors < 0 or n_modules * n_functions > len(template_names):
        raise ValueError(
            f"n_modules * (1 + n_distractors) must be at most {len(template_names)} (the number of function "
            f"templates); got {n_modules} * {n_functions}"
        )
    return package_names, module_names, template_names


def _names(what: str, names, default: tuple[str, ...]) -> tuple[str, ...]:
    if names is None:
        return default
    if isinstance(names, str) or not names:
        raise ValueError(f"{what} must be a non-empty list of names, e.g. [{default[0]!r}]; got {names!r}")
    names = tuple(names)
    bad = [n for n in names if not (isinstance(n, str) and n.isidentifier() and n.islower() and n != "tests")]
    if bad or len(set(names)) != len(names):
        raise ValueError(
            f"{what} must be distinct lower-case Python identifiers other than 'tests'; got {list(names)!r}"
        )
    return names


def describe(task: BugfixTask, name_failing_test: bool) -> str:
    hint = ""
    if name_failing_test:
        hint = (
            f" The failing test{'s are' if len(task.failing_tests) > 1 else ' is'}: "
            + ", ".join(task.failing_tests)
            + "."
        )
    return textwrap.dedent(
        f"""\
        The test suite of the `{task.package}` package in this repository fails: there is one bug in the
        package's source code (the tests are correct). Find the bug and fix it.{hint}
        Run the tests with `python3 -m pytest -q`. When they pass, call the submit tool."""
    )
