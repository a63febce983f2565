"""bugfix-v0 on both sandbox backends: the expert earns 1, doing nothing or editing the tests earns 0."""

import asyncio
import itertools
import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from agentrl.env import Task, make
from agentrl.envs.bugfix import expert_turns
from agentrl.envs.bugfix.generator import BUG_KINDS, TEMPLATE_NAMES, TEMPLATES, _run_tests, describe, generate
from agentrl.tools import CODING_TOOLS, ToolCall, parse_hermes, render_hermes
from tests.conftest import require_docker


@pytest.fixture(params=["local", "docker"])
def backend(request):
    if request.param == "docker":
        require_docker()
    return request.param


def run(coro):
    return asyncio.run(coro)


def test_thousands_of_distinct_tasks_and_disjoint_splits():
    train = [generate("train", i) for i in range(2000)]
    test = [generate("test", i) for i in range(200)]
    train_hashes = {t.content_hash for t in train}
    assert len(train_hashes) == 2000 and len({t.id for t in train}) == 2000
    assert not {t.key for t in train} & {t.key for t in test}
    assert len({t.key for t in test}) == 200  # each held-out task once
    assert set(Counter(t.bug_kind for t in train)) == set(BUG_KINDS)
    assert generate("train", 7) == generate("train", 7)  # deterministic
    with pytest.raises(ValueError, match="split must be one of"):
        generate("valid", 0)


@pytest.mark.parametrize("n_modules,n_distractors", [(1, 0), (2, 2), (3, 3)])
def test_every_task_fails_as_given_and_passes_with_the_fix(n_modules, n_distractors):
    for i in range(60):
        task = generate("train", i, n_modules=n_modules, n_distractors=n_distractors)
        package = task.package
        sources = {
            p.split("/")[1][:-3]: c
            for p, c in task.files.items()
            if p.startswith(f"{package}/") and "__init__" not in p
        }
        tests = {p.split("/")[1][5:-3]: c for p, c in task.files.items() if p.startswith("tests/test_")}
        assert len(sources) == n_modules
        assert task.n_tests == sum(c.count("\ndef test_") for c in tests.values())
        assert _run_tests(sources, tests)  # the bug shows
        module = task.fix["path"].split("/")[1][:-3]
        sources[module] = sources[module].replace(task.fix["old"], task.fix["new"])
        assert _run_tests(sources, tests) == []  # the fix fixes it


QUICKSTART_DRAW = {
    "n_modules": 1,
    "n_distractors": 0,
    "packages": ["calc"],
    "modules": ["mathops"],
    "single_bug": True,
    "templates": [
        *("scale", "sum_to", "clamp", "count_at_least", "percent"),
        *("last_n", "is_leap", "argmax", "average", "fit_width"),
    ],
}


def _nameless(task) -> str:
    """The task's files with its function's name blanked: what a renamed copy shares (one function)."""
    (name,) = re.findall(r"^def (\w+)", task.files[task.buggy_path], re.M)
    blank = re.compile(rf"\b{name}\b|(?<=test_){name}(?=_\d)")
    return "\0".join(f"{path}\0{blank.sub('F', text)}" for path, text in sorted(task.files.items()))


def test_a_renamed_task_is_the_same_task_and_never_crosses_the_split():
    """With one package, one module and one function drawn from few templates, the same function,
    constants and bug come back under other names; the split and held-out distinctness go by the task
    with its names left out. (Split on the exact files, 48 of the quickstart's 64 held-out tasks were
    renamed copies of its 1,024 training tasks, and the 64 held 34 distinct tasks.)"""
    train = [generate("train", i, **QUICKSTART_DRAW) for i in range(1024)]
    test = [generate("test", i, **QUICKSTART_DRAW) for i in range(64)]
    train_contents = {_nameless(t) for t in train}
    assert len(train_contents) < len({t.content_hash for t in train})  # renamed copies are drawn
    assert not {_nameless(t) for t in test} & train_contents
    assert len({_nameless(t) for t in test}) == 64
    # the key is what was checked by hand above: equal exactly when the nameless files are equal
    pairs = {}
    for t in train + test:
        assert pairs.setdefault(t.key, _nameless(t)) == _nameless(t)
    assert len(pairs) == len({_nameless(t) for t in train + test})


def test_the_same_functions_drawn_in_another_order_are_the_same_task():
    """Two functions per module from two templates: a training task whose functions are a held-out
    task's in the other order (names aside) is the same task, and must not be drawn for training.
    (Keyed in drawing order, 362 of the first 4,000 training tasks were such copies of the 87
    held-out ones, which held 81 distinct tasks.)"""
    draw = dict(n_modules=1, n_distractors=1, templates=("discount", "safe_divide"))
    draw |= dict(packages=("calc",), modules=("mathops",))

    def functions(t) -> frozenset[str]:  # each function's code and tests, its name blanked
        src, tests = t.files["calc/mathops.py"], t.files["tests/test_mathops.py"]
        out = set()
        for name in re.findall(r"^def (\w+)", src, re.M):
            body = re.search(rf"^def {name}\b.*?(?=^def |\Z)", src, re.M | re.S).group(0)
            asserts = sorted(line.strip() for line in tests.splitlines() if re.search(rf"\b{name}\(", line))
            out.add(re.sub(rf"\b{name}\b", "F", body.strip() + "\n" + "\n".join(asserts)))
        return frozenset(out)

    test = [generate("test", i, **draw) for i in range(30)]
    held = {functions(t) for t in test}
    assert len(held) == len(test)  # distinct up to order, each once
    train = [generate("train", i, **draw) for i in range(1500)]
    assert not [t.id for t in train if functions(t) in held]


def _template(code: str) -> str:
    """The code of a one-function source with its name blanked (``code`` is the fixed file)."""
    (name,) = re.findall(r"^def (\w+)", code, re.M)
    return re.sub(rf"\b{name}\b", "F", code)


def test_the_quickstart_draw_holds_every_template_out():
    """Each template draws its tests' inputs, so each has hundreds to thousands of tasks up to names, and
    the held-out split, one task per key, holds every template about equally (with fixed inputs, five
    templates had 1 to 16 tasks each, none to two of them held out, and two templates filled 47 of 64)."""
    templates = {
        _template(TEMPLATES[TEMPLATE_NAMES.index(t)](random.Random(0)).code): t
        for t in QUICKSTART_DRAW["templates"]
    }
    held = Counter()
    for i in range(640):
        task = generate("test", i, **QUICKSTART_DRAW)
        fixed = task.files[task.buggy_path].replace(task.fix["old"], task.fix["new"])
        held[templates[_template(fixed)]] += 1
    assert set(held) == set(QUICKSTART_DRAW["templates"])
    assert all(0.05 * 640 <= n <= 0.16 * 640 for n in held.values()), held


def test_a_narrow_draw_holds_few_held_out_tasks_and_says_how_many(monkeypatch):
    from agentrl.envs.bugfix import generator

    monkeypatch.setattr(generator, "HELD_OUT_PATIENCE", 2_000)
    narrow = {**QUICKSTART_DRAW, "templates": ["safe_divide", "discount"], "single_bug": False}
    everything = {generate("train", i, **narrow).key for i in range(800)}
    held = []
    with pytest.raises(generator.HeldOutExhausted, match=r"holds \d+ distinct task") as e:
        for i in range(100):
            held.append(generate("test", i, **narrow))
    assert e.value.held == len(held) == len({t.key for t in held}) > 0
    assert not everything & {t.key for t in held}
    # safe_divide: 9 defaults x 2 bugs; discount: (4 rates x 3 prices) x 2 bugs
    assert len(everything) + len(held) == 9 * 2 + 4 * 3 * 2
    assert generate("test", 0, **narrow) == held[0]  # the split stays as found
    # a run that asks for more held-out tasks than the layout holds stops with one line naming both
    from agentrl.config import ConfigError, TrainConfig, load_config
    from agentrl.rollout.from_config import splits

    cfg = load_config(
        TrainConfig,
        str(Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"),
        ["env.eval_tasks=50", "env.args.templates=[safe_divide, discount]", "env.args.single_bug=false"],
    )
    with pytest.raises(ConfigError, match=rf"env.eval_tasks=50: .*holds {len(held)} distinct"):
        splits(cfg, make("bugfix-v0", sandbox="local", **cfg.env.args))


def test_a_task_drawn_by_another_generator_is_refused_not_rebuilt_as_another():
    """A stored task carries its key: rebuilt by a generator (or env arguments) that now draws another
    task at its index, it stops with a line saying so, instead of replaying against another task."""
    env = make("bugfix-v0", sandbox="local", n_modules=1, n_distractors=0)
    task = env.task("test", 3)
    assert env.task_spec(task).key.startswith(task.data["key"])
    older = Task(task.id, {"split": "test", "index": 3})  # a store written before tasks carried keys
    assert env.task_spec(older) == env.task_spec(task)
    moved = Task(task.id, {**task.data, "key": "0" * 16})
    with pytest.raises(ValueError, match="drawn as another task .*without --reexec"):
        env.task_spec(moved)


def test_name_pools_fix_the_layout_and_keep_tasks_distinct():
    default = generate("train", 5)
    assert generate("train", 5, packages=None, modules=None) == default  # the default draw is unchanged
    fixed = [
        generate("train", i, n_modules=1, n_distractors=0, packages=["calc"], modules=["mathops"])
        for i in range(300)
    ]
    assert {t.fix["path"] for t in fixed} == {"calc/mathops.py"}
    # one layout leaves templates x bug kinds x drawn names and constants: fewer distinct contents
    assert len({t.content_hash for t in fixed}) > 200 and len({t.id for t in fixed}) == 300
    assert fixed[0].id != generate("train", 0, n_modules=1, n_distractors=0).id
    held_out = {
        generate("test", i, n_modules=1, n_distractors=0, packages=["calc"], modules=["mathops"]).content_hash
        for i in range(50)
    }
    assert not held_out & {t.content_hash for t in fixed}
    for bad in ("calc", [], ["Calc"], ["tests"], ["a", "a"]):
        with pytest.raises(ValueError, match="packages must be"):
            generate("train", 0, packages=bad)
    with pytest.raises(ValueError, match="n_modules must be in"):
        make("bugfix-v0", sandbox="local", n_modules=2, modules=["mathops"])


def test_template_pool_restricts_the_functions_drawn():
    pool = ["scale", "sum_to", "argmax"]
    tasks = [generate("train", i, n_modules=1, n_distractors=1, templates=pool) for i in range(60)]
    assert generate("train", 3, templates=None) == generate("train", 3)  # the default draw is unchanged
    drawn = Counter(t.files[t.buggy_path].split("(")[0].removeprefix("def ") for t in tasks)
    # every module holds two functions of the pool's three templates, whatever names they drew
    allowed = {"scale", "scale_all", "multiply_each", "times_each", "sum_to", "triangle", "sum_up_to"}
    allowed |= {"total_to", "argmax", "index_of_max", "best_index", "peak_index"}
    assert set(drawn) <= allowed and len(drawn) > 3
    assert {t.fix["new"] for t in tasks} <= {
        "v * factor",
        "range(1, n + 1)",
        "total += i",
        "range(1, len(values))",
        "values[i] > values[best]",
    }
    assert tasks[0].id != generate("train", 0, n_modules=1, n_distractors=1).id  # the pool is part of the id
    with pytest.raises(ValueError, match=r"unknown templates \['scales'\]; the templates are \['scale'"):
        generate("train", 0, templates=["scales"])
    with pytest.raises(ValueError, match="at most 3 .*number of function templates"):
        make("bugfix-v0", sandbox="local", n_modules=2, n_distractors=1, templates=pool)


def test_single_bug_makes_the_template_tell_the_fix():
    pool = ["sum_to", "clamp", "argmax"]  # two bug kinds each
    both = [generate("train", i, n_modules=1, n_distractors=0, templates=pool) for i in range(90)]
    single = [
        generate("train", i, n_modules=1, n_distractors=0, templates=pool, single_bug=True) for i in range(90)
    ]
    assert generate("train", 4, single_bug=False) == generate("train", 4)  # the default draw is unchanged
    assert len({t.bug_kind for t in both}) == 4  # off_by_one, wrong_operator, wrong_comparison, swapped_args
    # the first kind of each template, alphabetically: sum_to off_by_one, clamp swapped_args, argmax off_by_one
    assert {(t.files[t.buggy_path].split("(")[0], t.fix["new"]) for t in single} <= {
        (f"def {name}", "range(1, n + 1)") for name in ("sum_to", "triangle", "sum_up_to", "total_to")
    } | {
        (f"def {name}", "    if x < lo:\n        return lo\n")
        for name in ("clamp", "bound", "limit", "clip_value")
    } | {
        (f"def {name}", "range(1, len(values))")
        for name in ("argmax", "index_of_max", "best_index", "peak_index")
    }
    assert {t.bug_kind for t in single} == {"off_by_one", "swapped_args"}
    assert single[0].id != both[0].id  # part of the id
    env = make("bugfix-v0", sandbox="local", n_modules=1, n_distractors=0, templates=pool, single_bug=True)
    assert env.task_spec(env.task("train", 7)) == single[7]
    with pytest.raises(ValueError, match="single_bug must be true or false; got 'yes'"):
        make("bugfix-v0", sandbox="local", single_bug="yes")
    with pytest.raises(ValueError, match="single_bug must be true or false; got 1"):
        generate("train", 0, single_bug=1)


def expert_episode(env, task, fmt_through_parser=True, run_tests=True):
    async def go():
        await env.reset(task)
        result = None
        for calls in expert_turns(env.spec, run_tests):
            if fmt_through_parser:  # as a model would write them, through the Hermes parser
                calls = parse_hermes(render_hermes(calls), CODING_TOOLS).calls
            result = await env.step(calls)
        return result

    return go()


def test_expert_solves_and_nothing_fails_on_both_backends(backend):
    async def go():
        env = make("bugfix-v0", sandbox=backend)
        try:
            for task in env.tasks("train")[:3] + env.tasks("test")[:1]:
                result = await expert_episode(env, task)
                assert result.done and result.reward == 1.0 and result.info["status"] == "completed", task.id
                result = await expert_episode(env, task, run_tests=False)  # view, fix, submit
                assert result.reward == 1.0 and env._turns == 3, task.id
                await env.reset(task)
                result = await env.step([ToolCall("submit", {})])
                assert result.done and result.reward == 0.0
        finally:
            await env.close()

    run(go())


def test_editing_the_tests_earns_nothing(backend):
    async def go():
        env = make("bugfix-v0", sandbox=backend)
        task = env.task("train", 1)
        try:
            await env.reset(task)
            spec = env.spec
            # Rewrite every test to pass, add a conftest that skips everything, then submit.
            for path in spec.test_files:
                if "__init__" not in path:
                    await env.sandbox.write_file(path, "def test_ok():\n    assert True\n")
            await env.sandbox.write_file(
                "conftest.py",
                "import pytest\n\ndef pytest_collection_modifyitems(items):\n    items.clear()\n",
            )
            r = await env.sandbox.exec("python3 -m pytest -q", timeout=60)
            assert r.exit_code in (0, 5)  # the hack "works" in the workspace...
            result = await env.step([ToolCall("submit", {})])
            assert result.reward == 0.0  # ...and earns nothing
            # The real fix plus the test hack still earns 1: only the hack is dropped.
            await env.reset(task)
            fix = env.spec.fix
            await env.step(
                [
                    ToolCall(
                        "str_replace_editor",
                        {
                            "command": "str_replace",
                            "path": fix["path"],
                            "old_str": fix["old"],
                            "new_str": fix["new"],
                        },
                    )
                ]
            )
            await env.sandbox.write_file(env.spec.test_files[-1], "def test_extra():\n    assert False\n")
            result = await env.step([ToolCall("submit", {})])
            assert result.reward == 1.0
        finally:
            await env.close()

    run(go())


def _call_in_process(spec, fixed: bool, checks_=None) -> str:
    """What the plain grader's caller prints for ``spec``'s ``checks_`` (its tests' by default; fixed or
    not), run here on the generated sources."""
    import json
    import sys
    import types

    from agentrl.envs.bugfix import checks

    files = dict(spec.files)
    if fixed:
        files[spec.fix["path"]] = files[spec.fix["path"]].replace(spec.fix["old"], spec.fix["new"])
    results = []
    for check in checks(spec) if checks_ is None else checks_:
        module = types.ModuleType(check.module)
        sys.modules.pop(check.module, None)
        exec(compile(files[check.module.replace(".", "/") + ".py"], check.module, "exec"), vars(module))
        try:
            results.append(repr(eval(check.call, dict(vars(module)))))
        except BaseException:
            results.append(None)
    return "some output\n" + json.dumps(results) + "\n"


def test_the_plain_graders_checks_fail_exactly_the_tests_that_fail():
    """Each generated test becomes one call and one expected value; compared outside the process, they
    fail exactly the tests that the generator found failing on the buggy code, and none on the fix."""
    from agentrl.envs.bugfix import _verdict, checks

    for i in range(150):
        spec = generate("train", i, n_modules=1 + i % 3, n_distractors=i % 3)
        assert len(checks(spec)) == spec.n_tests
        passed, failing = _verdict(checks(spec), _call_in_process(spec, fixed=False))
        assert failing == spec.failing_tests and passed == spec.n_tests - len(failing)
        assert _verdict(checks(spec), _call_in_process(spec, fixed=True)) == (spec.n_tests, [])
    assert _verdict(checks(spec), "no result line")[1] == [c.test for c in checks(spec)]
    deep = "[" * 100_000 + "]" * 100_000  # printed by the package's code: no verdict, and no crash
    assert _verdict(checks(spec), _call_in_process(spec, fixed=True) + deep + "\n") == (spec.n_tests, [])


def test_hidden_checks_pass_on_the_fix_and_expose_the_bug():
    """Each function gets its hidden checks, drawn from the task and the same every time; all pass on
    the fix, and on the buggy code some of the buggy function's fail (and no other's), so keeping the
    bug behind the tests' own answers cannot pass. The task itself is drawn as before: the checks come
    from a generator of their own."""
    from agentrl.envs.bugfix import _verdict, hidden_checks
    from agentrl.envs.bugfix.generator import HIDDEN_PER_FUNCTION, _draw

    for i in range(150):
        spec = generate("train", i, n_modules=1 + i % 3, n_distractors=i % 3)
        hidden = hidden_checks(spec)
        functions = (1 + i % 3) ** 2  # modules x (the buggy function or a correct one + distractors)
        assert len(hidden) - HIDDEN_PER_FUNCTION * functions in (0, 1)
        assert all(c.test.startswith("hidden::") for c in hidden)
        assert _verdict(hidden, _call_in_process(spec, True, hidden)) == (len(hidden), [])
        buggy = spec.fix["path"][:-3].replace("/", ".")
        _, failing = _verdict(hidden, _call_in_process(spec, False, hidden))
        assert failing and all(t.startswith(f"hidden::{buggy}::") for t in failing), (i, failing)
    seed = next(seed for seed in range(100) if _draw(random.Random(seed), 2, 2))
    assert _draw(random.Random(seed), 2, 2).hidden == _draw(random.Random(seed), 2, 2).hidden


# Docker's case runs in the slow suite (make test-slow): 50 s, and the grader is the same code on both.
@pytest.mark.parametrize("backend", ["local", pytest.param("docker", marks=pytest.mark.slow)], indirect=True)
def test_python_grader_agrees_with_pytest(backend):
    """The plain-Python grader gives pytest's verdict on the fix, no edit, the other bug's fix, a broken
    module, a module that exits at import, and code that prints a fake summary; a bad name is refused."""
    fake = "print('3 passed')\nprint('99 passed 0 failed')\n"
    edits = {
        "expert fix": lambda spec, src: src.replace(spec.fix["old"], spec.fix["new"]),
        "no edit": lambda spec, src: src,
        "other edit": lambda spec, src: src.replace("return", "return -1 *", 1),
        "syntax error": lambda spec, src: src + "\ndef broken(:\n",
        "exit at import": lambda spec, src: "import sys\nsys.exit(0)\n" + src,
        "fake summary": lambda spec, src: fake + src,
        "fix and fake summary": lambda spec, src: fake + src.replace(spec.fix["old"], spec.fix["new"]),
    }

    async def go():
        envs = {g: make("bugfix-v0", sandbox=backend, grader=g) for g in ("pytest", "python")}
        verdicts = {g: {} for g in envs}
        try:
            for task in envs["pytest"].tasks("train")[:2]:
                for grader, env in envs.items():
                    for label, edit in edits.items():
                        await env.reset(task)
                        path = env.spec.fix["path"]
                        source = env.spec.files[path]
                        await env.sandbox.write_file(path, edit(env.spec, source))
                        verdicts[grader][task.id, label] = await env.grade()
        finally:
            for env in envs.values():
                await env.close()
        return verdicts

    verdicts = run(go())
    assert verdicts["python"] == verdicts["pytest"]
    solved = {label for (_, label), v in verdicts["python"].items() if v == 1.0}
    assert solved == {"expert fix", "fix and fake summary"}
    with pytest.raises(ValueError, match="grader must be 'pytest' or 'python'"):
        make("bugfix-v0", grader="unittest")


def test_concurrent_grades_in_unisolated_local_sandboxes_keep_their_own_files():
    """Without bubblewrap the local sandboxes share the host's /tmp: episodes graded at once must not
    read one another's patch or test log (each right fix earns 1, each unedited task 0). The plain
    Python grader: started as root, an unisolated sandbox's user may not reach this environment's
    pytest (a Python under /root), only the system's python3."""

    async def one(task, fix: bool) -> float:
        env = make("bugfix-v0", sandbox="local", sandbox_config={"isolation": "none"}, grader="python")
        try:
            await env.reset(task)
            if fix:
                path = env.spec.fix["path"]
                source = env.spec.files[path]
                await env.sandbox.write_file(path, source.replace(env.spec.fix["old"], env.spec.fix["new"]))
            return await env.grade()
        finally:
            await env.close()

    async def go():
        tasks = make("bugfix-v0").tasks("train")[:12]
        fixes = [i % 3 != 0 for i in range(len(tasks))]
        rewards = await asyncio.gather(*(one(t, f) for t, f in zip(tasks, fixes, strict=True)))
        return [float(f) for f in fixes], rewards

    expected, rewards = run(go())
    assert rewards == expected


def test_malformed_calls_no_calls_and_turn_budget():
    async def go():
        env = make("bugfix-v0", sandbox="local", max_turns=3, name_failing_test=False)
        try:
            obs = await env.reset(env.task("train", 2))
            assert "failing test" not in obs.messages[-1]["content"]
            turn = parse_hermes(
                '<tool_call>{"name": "bash", "arguments": {"command": "ls"</tool_call>', CODING_TOOLS
            )
            result = await env.step(turn.calls)
            assert not result.done and result.info["tool_call_errors"] == 1
            assert result.observation[0]["content"].startswith("error: invalid JSON")
            result = await env.step([])
            assert not result.done and result.observation[-1]["role"] == "user"  # a reminder
            result = await env.step([ToolCall("bash", {"command": "true"})])
            assert result.done and result.info["status"] == "max_turns" and result.reward == 0.0
        finally:
            await env.close()
        env = make("bugfix-v0", sandbox="local", on_no_tool_call="end")
        try:
            await env.reset(env.task("train", 2))
            result = await env.step([])
            assert result.done and result.reward == 0.0
        finally:
            await env.close()
        with pytest.raises(ValueError, match="on_no_tool_call must be 'end' or 'remind'"):
            make("bugfix-v0", on_no_tool_call="ignore")

    run(go())


def test_noisy_expert_slips_on_its_fix_by_one_token_and_the_slip_fails():
    from agentrl.envs.bugfix import _SLIPS, near_miss_edit
    from agentrl.envs.bugfix.generator import fails_after

    specs = [generate("train", i) for i in range(300)]
    misses = [near_miss_edit(s) for s in specs]
    # every kind of every template but linear (whose fixes are bare constants) has a slip
    assert sum(m is None for m in misses) < 0.1 * len(specs)
    assert all(s.id.startswith("train") for s, m in zip(specs, misses, strict=True) if m is None)
    for spec, miss in zip(specs, misses, strict=True):
        if miss is None:
            continue
        old, new = miss
        assert old == spec.fix["old"] and new != spec.fix["new"] and new != old
        assert fails_after(spec, old, new) and not fails_after(spec, old, spec.fix["new"])
        assert any(spec.fix["new"].replace(x, y, 1) == new for x, y in _SLIPS)  # one slip
    # the same bug kind slips the same way, whatever the task
    one = [generate("train", i, n_modules=1, n_distractors=0, templates=("scale",)) for i in range(12)]
    assert {near_miss_edit(s)[1] for s in one} == {"v / factor"}

    def slips(spec, miss):
        turns = expert_turns(spec, run_tests=False, miss=miss)
        return [any(c.arguments.get("new_str", spec.fix["new"]) != spec.fix["new"] for c in t) for t in turns]

    marked = [slips(s, 0.5) for s in specs]
    assert all(m in ([False] * 3, [False, True, False]) for m in marked)  # the fix only
    assert 0.35 < sum(any(m) for m in marked) / len(specs) < 0.6
    assert not any(any(slips(s, 0.0)) for s in specs)
    # the environment's demonstration means reward 0 exactly when its fix slipped
    env = make("bugfix-v0", expert_run_tests=False, expert_miss=0.5)
    tasks = env.tasks("train")[:40]
    demos = [env.demonstration(t) for t in tasks]
    assert [d.reward for d in demos] == [0.0 if any(slips(env.task_spec(t), 0.5)) else 1.0 for t in tasks]
    assert 0 < sum(d.reward == 0.0 for d in demos) < len(demos)
    with pytest.raises(ValueError, match="miss is the share of tasks"):
        expert_turns(specs[0], miss=-0.1)


def test_the_tokenizer_corpus_holds_what_the_expert_writes_and_the_prompt_shows():
    """A tokenizer trained on the env's corpus learns the calls its demonstrations teach: a call it
    never saw (submit, before) comes out as single characters, and a tiny model miscounts a run of
    one-brace tokens (`{`, `}`, `}` wrote `}}}` in most of one warm start's submit calls)."""
    from agentrl.models import tiny_tokenizer

    args = {"n_modules": 1, "n_distractors": 0, "packages": ["calc"], "modules": ["mathops"]}
    env = make("bugfix-v0", compact_tools=True, expert_run_tests=False, **args)
    corpus = env.corpus()
    assert json.dumps(env.tools[0]) in corpus  # the compact specs the prompt shows, not the full ones
    tok = tiny_tokenizer(corpus=corpus)
    tasks = env.tasks("train")[:10]
    assert describe(env.task_spec(tasks[0]), env.name_failing_test) in corpus  # its own layout's tasks
    for task in tasks:
        for turn in env.demonstration(task).turns:
            text = render_hermes(turn.calls)
            pieces = [tok.decode([i]) for i in tok.encode(text, add_special_tokens=False)]
            runs = [a for a, b in itertools.pairwise(pieces) if a == b and a in "{}"]
            assert not runs, (text, pieces)
    submit = tok.encode(render_hermes([ToolCall("submit", {})]), add_special_tokens=False)
    assert "submit" in [tok.decode([i]) for i in submit]


def test_slipped_fix_applies_and_earns_nothing_in_the_sandbox():
    async def go():
        env = make("bugfix-v0", sandbox="local", max_turns=4, n_modules=1, n_distractors=0)
        try:
            for task in env.tasks("train")[:3]:
                await env.reset(task)
                for calls in expert_turns(env.spec, run_tests=False, miss=1.0):
                    result = await env.step(calls)
                    assert not result.observation or "error" not in result.observation[0]["content"]
                assert result.reward == 0.0 and result.info["status"] == "completed"
        finally:
            await env.close()

    run(go())
