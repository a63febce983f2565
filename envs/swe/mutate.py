"""Inject one bug into real Python source with an AST transform, one function at a time.

``mutants(path, source)`` parses a file, visits every function and method (nested ones too) and
every class, and returns candidate files that each differ from ``source`` by one small change.
Only the text of the changed node is rewritten, so a mutant's diff is a few lines and keeps the
file's comments and formatting; each candidate is re-parsed and kept only when the edited
function parses to exactly the intended tree. Pure: standard-library ``ast`` only, no I/O.

Transforms (``TRANSFORMS``, in this order):

- ``op_change``: an operator to a neighbour in its family: ``+``↔``-``, ``*``↔``/``, ``//``→``/``,
  ``%``→``//``, ``**``→``*``, ``<<``↔``>>``, ``&``↔``|``, and the comparison boundaries
  ``<``↔``<=``, ``>``↔``>=``; augmented assignments too (``+=``→``-=``). Skipped when an operand is
  a string literal (concatenation and ``%``-formatting are not arithmetic).
- ``op_flip``: ``==``↔``!=``, ``<``↔``>``, ``<=``↔``>=``, ``in``↔``not in``, ``is``↔``is not``,
  ``and``↔``or``.
- ``operand_swap``: ``a - b`` → ``b - a`` for ``-``, ``/``, ``//``, ``%``, ``**``, ``<<``, ``>>``,
  ``@``, for ``+`` when an operand is a str/list/tuple literal (concatenation does not commute),
  and for ``in``/``not in`` unless a side is a container literal (``{1, 2} in x`` only raises).
  Ordering comparisons are left to ``op_flip``: ``b < a`` is ``a > b``.
- ``break_chain``: the last call of a chain of two or more calls is dropped (``x.strip().lower()``
  → ``x.strip()``).
- ``constant_shift``: an int literal ``n`` → ``n + 1`` and ``n - 1`` (two candidates; 0 only → 1).
- ``invert_if``: an ``if`` condition is negated. With an ``else`` this is the same program as
  swapping the two branches, and it touches only the condition's text.
- ``remove_loop``: a ``for``/``while`` statement is removed.
- ``remove_condition``: an ``if`` without ``elif``/``else`` is replaced by its body.
- ``remove_assignment``: an assignment (plain, augmented, annotated) is removed.
- ``remove_wrapper``: ``f(x)`` → ``x`` for ``f`` in ``WRAPPERS`` (one positional argument).
- ``shuffle_statements``: two adjacent simple statements of a block swap places when the swap can
  change behaviour: one writes a name the other reads or writes, or one is a statement expression
  (a call) and the other is one too or sets an attribute or an item.
- ``remove_base``: one base class is removed (not ``object`` nor ``Generic[...]``); class-level.
- ``remove_method``: one method other than ``__init__`` is removed; class-level.

A removed statement that leaves its block empty becomes ``pass``; one that sat between two blank
lines takes one of them along. Functions whose body is only a docstring, ``pass``, ``...`` or
``raise NotImplementedError`` are neither mutated nor removed.
"""

from __future__ import annotations

import ast
import bisect
import copy
import random
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from typing import NamedTuple

TRANSFORMS: tuple[str, ...] = (
    "op_change",
    "op_flip",
    "operand_swap",
    "break_chain",
    "constant_shift",
    "invert_if",
    "remove_loop",
    "remove_condition",
    "remove_assignment",
    "remove_wrapper",
    "shuffle_statements",
    "remove_base",
    "remove_method",
)
WRAPPERS = frozenset(
    {
        "list",
        "tuple",
        "set",
        "frozenset",
        "dict",
        "sorted",
        "reversed",
        "iter",
        "str",
        "int",
        "float",
        "bool",
        "abs",
    }
)
"""Callees that ``remove_wrapper`` strips: conversions and copies whose absence still runs."""


@dataclass(frozen=True)
class Mutant:
    path: str
    """The file's path as given to ``mutants``."""
    function: str
    """Qualified name of the mutated function or class: ``merge``, ``Cache.__getitem__``,
    ``outer.<locals>.inner``; the class's own name for ``remove_base``/``remove_method``."""
    transform: str
    """One of ``TRANSFORMS``."""
    lineno: int
    """First line of the original source that the change touches (1-based)."""
    end_lineno: int
    """Last line of the original source that the change touches; every other line is unchanged."""
    source: str
    """The whole new file text."""
    description: str
    """Short text for logs, e.g. "`==` became `!=` in merge (line 41)"; never shown to the agent."""


def mutants(
    path: str,
    source: str,
    *,
    transforms: Sequence[str] = TRANSFORMS,
    seed: int = 0,
    max_per_function: int = 3,
) -> list[Mutant]:
    """Candidate one-bug variants of ``source``, in source order, the same list for the same inputs.

    A function (or class) with more than ``max_per_function`` candidates keeps that many, drawn
    with ``random.Random(f"{seed}/{path}/{qualname}")``. Raises ``SyntaxError`` when ``source``
    does not parse.
    """
    if isinstance(transforms, str):
        raise ValueError(
            f"transforms must be a sequence of names, got the string {transforms!r}; pass a tuple"
        )
    unknown = [t for t in transforms if t not in TRANSFORMS]
    if unknown:
        raise ValueError(f"unknown transform {unknown[0]!r}; valid transforms: {', '.join(TRANSFORMS)}")
    if max_per_function < 1:
        raise ValueError(f"max_per_function must be at least 1, got {max_per_function}")
    chosen = [t for t in TRANSFORMS if t in transforms]
    src = _Source(source)
    out = []
    for qualname, scope in _scopes(ast.parse(source)):
        if src.scope_span(scope) is None:
            continue  # shares its first line with other code: cannot be re-parsed on its own
        sites = _sites(src, scope, chosen)
        order = list(range(len(sites)))
        if len(sites) > max_per_function:
            random.Random(f"{seed}/{path}/{qualname}").shuffle(order)
        kept: dict[int, tuple[int, int, str]] = {}
        for i in order:
            if len(kept) == max_per_function:
                break
            edit = _verify(src, scope, sites[i][1])
            if edit is not None:
                kept[i] = edit
        for i in sorted(kept):
            transform, site = sites[i]
            start, end, text = kept[i]
            first, last = src.line_of(start), src.line_of(max(start, end - 1))
            lines = f"line {first}" if first == last else f"lines {first}-{last}"
            where = f"from class {qualname}" if transform in _CLASS_RULES else f"in {qualname}"
            out.append(
                Mutant(
                    path=path,
                    function=qualname,
                    transform=transform,
                    lineno=first,
                    end_lineno=last,
                    source=source[:start] + text + source[end:],
                    description=f"{site.what} {where} ({lines})",
                )
            )
    return out


# --- source text: AST positions (1-based lines, UTF-8 byte columns) to str offsets ---------------

_COMMENT = re.compile(r"#[^\n]*")
_TRAILER = re.compile(r"[ \t\f\r]*(#[^\n]*)?\n?")


class _Source:
    def __init__(self, text: str):
        self.text = text
        self.starts = [0] + [m.end() for m in re.finditer("\n", text)]

    def line(self, n: int) -> str:
        return self.text[self.line_start(n) : self.line_end(n)]

    def line_start(self, n: int) -> int:
        return self.starts[n - 1]

    def line_end(self, n: int) -> int:
        """Offset just past line ``n``'s newline."""
        return self.starts[n] if n < len(self.starts) else len(self.text)

    def line_of(self, offset: int) -> int:
        return bisect.bisect_right(self.starts, offset)

    def offset(self, lineno: int, col: int) -> int:
        line = self.line(lineno)
        if not line.isascii():
            col = len(line.encode()[:col].decode("utf-8", errors="ignore"))
        return self.line_start(lineno) + col

    def span(self, node: ast.AST) -> tuple[int, int]:
        start = self.offset(node.lineno, node.col_offset)
        if getattr(node, "decorator_list", None):
            first = node.decorator_list[0].lineno
            start = self.line_start(first) + len(self.indent(first))
        return start, self.offset(node.end_lineno, node.end_col_offset)

    def segment(self, node: ast.AST) -> str:
        return self.text[slice(*self.span(node))]

    def indent(self, n: int) -> str:
        line = self.line(n)
        return line[: len(line) - len(line.lstrip(" \t\f"))]

    def whole_lines(self, start: int, end: int) -> bool:
        """No other code on the lines of ``text[start:end]``."""
        head = self.text[self.line_start(self.line_of(start)) : start]
        return (
            not head.strip()
            and _TRAILER.fullmatch(self.text, end, self.line_end(self.line_of(end))) is not None
        )

    def scope_span(self, scope: ast.AST) -> tuple[int, int, bool] | None:
        """(start, end, indented) of the whole lines of a def/class, or None if it shares a line."""
        start, end = self.span(scope)
        if not self.whole_lines(start, end):
            return None
        first = self.line_of(start)
        return self.line_start(first), self.line_end(scope.end_lineno), bool(self.indent(first))


def _lines(text: str) -> list[str]:
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


# --- scopes and the nodes inside one function ------------------------------------------------------

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)
_OPAQUE = (*_DEFS, ast.ClassDef, ast.JoinedStr)  # nested scopes are visited on their own
_ATOMIC = (ast.expr_context, ast.operator, ast.cmpop, ast.boolop, ast.unaryop)


def _scopes(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    def visit(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, ast.AST]]:
        for node in body:
            if isinstance(node, (*_DEFS, ast.ClassDef)):
                qualname = prefix + node.name
                yield qualname, node
                yield from visit(node.body, qualname + (".<locals>." if isinstance(node, _DEFS) else "."))
                continue
            for _, value in ast.iter_fields(node):
                if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                    yield from visit(value, prefix)
                elif isinstance(value, list):
                    for item in value:
                        if isinstance(item, (ast.excepthandler, ast.match_case)):
                            yield from visit(item.body, prefix)

    yield from visit(tree.body, "")


def _walk(
    roots: list[tuple[ast.AST, ast.AST, str, int | None]],
) -> Iterator[tuple[ast.AST, ast.AST, str, int | None]]:
    """(node, parent, field, index) in source order, not entering nested defs, classes, f-strings."""
    stack = [r for r in reversed(roots) if not isinstance(r[0], _OPAQUE)]
    while stack:
        node, parent, field, index = stack.pop()
        yield node, parent, field, index
        children = []
        for name, value in ast.iter_fields(node):
            if name in ("annotation", "returns"):
                continue
            if isinstance(value, list):
                children += [
                    (child, node, name, i) for i, child in enumerate(value) if isinstance(child, ast.AST)
                ]
            elif isinstance(value, ast.AST):
                children.append((value, node, name, None))
        stack += [c for c in reversed(children) if not isinstance(c[0], (*_OPAQUE, *_ATOMIC))]


def _is_stub(fn: ast.AST) -> bool:
    def trivial(stmt: ast.stmt) -> bool:
        if isinstance(stmt, ast.Pass) or (
            isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
        ):
            return True  # docstring or `...`
        if not isinstance(stmt, ast.Raise):
            return False
        exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"

    return all(trivial(s) for s in fn.body)


# --- candidate sites: what changes in the text (alternatives, tried in order) and in the tree ------


class _Site(NamedTuple):
    what: str
    alternatives: list[tuple[int, int, str]]
    """(start, end, text) replacements of the original text; the first giving the intended tree wins."""
    change: Callable[[], Callable[[], None]]
    """Applies the intended change to the original tree in place and returns its undo."""


def _assign(node: ast.AST, **fields) -> Callable[[], None]:
    old = {name: getattr(node, name) for name in fields}
    for name, value in fields.items():
        setattr(node, name, value)
    return partial(_assign, node, **old)


def _splice(items: list, i: int, j: int, new: list) -> Callable[[], None]:
    old = items[i:j]
    items[i:j] = new
    return partial(_splice, items, i, i + len(new), old)


def _put(parent: ast.AST, field: str, index: int | None, value: ast.AST) -> Callable[[], None]:
    if index is None:
        return _assign(parent, **{field: value})
    return _splice(getattr(parent, field), index, index + 1, [value])


def _verify(src: _Source, scope: ast.AST, site: _Site) -> tuple[int, int, str] | None:
    undo = site.change()
    try:
        expected = ast.dump(scope)
    finally:
        undo()
    start, end, indented = src.scope_span(scope)
    for a, b, text in site.alternatives:
        if src.text[a:b] == text:
            continue
        segment = src.text[start:a] + text + src.text[b:end]
        try:
            tree = ast.parse("if 1:\n" + segment if indented else segment)
        except (SyntaxError, ValueError):
            continue
        node = tree.body[0].body[0] if indented else tree.body[0]
        if ast.dump(node) == expected:
            return a, b, text
    return None


def _render(src: _Source, node: ast.AST, new: ast.AST) -> list[tuple[int, int, str]]:
    a, b = src.span(node)
    text = ast.unparse(new)
    return [(a, b, text), (a, b, f"({text})")]


def _unwrap(src: _Source, node: ast.AST, child: ast.AST) -> list[tuple[int, int, str]]:
    """Replace ``node`` by its sub-node ``child``, keeping the child's own text when it fits."""
    a, b = src.span(node)
    text = src.segment(child)
    return [(a, b, text), (a, b, f"({text})"), *_render(src, node, child)]


def _token_edit(
    src: _Source, left: ast.AST, right: ast.AST, old: str, new: str
) -> tuple[int, int, str] | None:
    """Replace the operator token ``old`` between two operands, leaving everything around it."""
    a, b = src.span(left)[1], src.span(right)[0]
    masked = _COMMENT.sub(lambda m: " " * len(m.group()), src.text[a:b])
    core = masked.strip(" \t\f\r\n\\()")
    if " ".join(core.split()) != old:
        return None
    start = a + len(masked) - len(masked.lstrip(" \t\f\r\n\\()"))
    return start, start + len(core), new


def _merge(src: _Source, edits: list[tuple[int, int, str]]) -> tuple[int, int, str]:
    pieces = [edits[0][2]]
    for (_, end, _), (start, _, text) in pairwise(edits):
        pieces += [src.text[end:start], text]
    return edits[0][0], edits[-1][1], "".join(pieces)


# fmt: off
_SYMBOL = {
    ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
    ast.Pow: "**", ast.LShift: "<<", ast.RShift: ">>", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^",
    ast.MatMult: "@", ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
    ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not", ast.And: "and", ast.Or: "or",
}
_OP_CHANGE = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
    ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult, ast.LShift: ast.RShift, ast.RShift: ast.LShift,
    ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd, ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
}
_OP_FLIP = {
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.Gt, ast.Gt: ast.Lt, ast.LtE: ast.GtE, ast.GtE: ast.LtE,
    ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.And: ast.Or, ast.Or: ast.And,
}
# fmt: on
_CONTAINERS = (ast.List, ast.Tuple, ast.Set, ast.Dict, ast.ListComp, ast.SetComp, ast.DictComp)
_NON_COMMUTATIVE = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.LShift, ast.RShift, ast.MatMult)


def _is_text(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr) or (
        isinstance(node, ast.Constant) and isinstance(node.value, str | bytes)
    )


def _operators(table: dict, src: _Source, node: ast.AST, parent, field, index) -> Iterator[_Site]:
    """``op_change`` and ``op_flip``: one operator replaced through ``table``."""
    if isinstance(node, ast.Compare):
        for k, op in enumerate(node.ops):
            new = table.get(type(op))
            if new is None:
                continue
            left = node.left if k == 0 else node.comparators[k - 1]
            old_s, new_s = _SYMBOL[type(op)], _SYMBOL[new]
            edit = _token_edit(src, left, node.comparators[k], old_s, new_s)
            mutated = copy.copy(node)
            mutated.ops = [*node.ops[:k], new(), *node.ops[k + 1 :]]
            alternatives = [edit] if edit else []
            yield _Site(
                f"`{old_s}` became `{new_s}`",
                alternatives + _render(src, node, mutated),
                partial(_assign, node, ops=mutated.ops),
            )
        return
    if isinstance(node, ast.BinOp):
        operands, suffix = [node.left, node.right], ""
    elif isinstance(node, ast.AugAssign):
        operands, suffix = [node.target, node.value], "="
    elif isinstance(node, ast.BoolOp):
        operands, suffix = node.values, ""
    else:
        return
    new = table.get(type(node.op))
    if new is None or any(_is_text(o) for o in operands):
        return
    old_s, new_s = _SYMBOL[type(node.op)] + suffix, _SYMBOL[new] + suffix
    edits = [_token_edit(src, a, b, old_s, new_s) for a, b in pairwise(operands)]
    mutated = copy.copy(node)
    mutated.op = new()
    alternatives = [_merge(src, edits)] if None not in edits else []
    yield _Site(
        f"`{old_s}` became `{new_s}`",
        alternatives + _render(src, node, mutated),
        partial(_assign, node, op=new()),
    )


def _operand_swap(src: _Source, node: ast.AST, parent, field, index) -> Iterator[_Site]:
    if isinstance(node, ast.BinOp):
        left, right = node.left, node.right
        concat = isinstance(node.op, ast.Add) and any(
            _is_text(o) or isinstance(o, ast.List | ast.Tuple) for o in (left, right)
        )
        if not (isinstance(node.op, _NON_COMMUTATIVE) or concat) or (
            isinstance(node.op, ast.Mod) and _is_text(left)
        ):
            return
        mutated = ast.BinOp(left=right, op=node.op, right=left)
        change = partial(_assign, node, left=right, right=left)
        symbol = _SYMBOL[type(node.op)]
    elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.In | ast.NotIn):
        left, right = node.left, node.comparators[0]
        if isinstance(right, _CONTAINERS) or isinstance(left, _CONTAINERS):
            return  # `{1, 2} in x` only raises
        mutated = ast.Compare(left=right, ops=node.ops, comparators=[left])
        change = partial(_assign, node, left=right, comparators=[left])
        symbol = _SYMBOL[type(node.ops[0])]
    else:
        return
    if ast.dump(left) == ast.dump(right):
        return
    (a, b), (c, d) = src.span(left), src.span(right)
    alternatives = []
    if not set(src.text[b:c]) & set("()#"):
        alternatives.append((a, d, src.text[c:d] + src.text[b:c] + src.text[a:b]))
    yield _Site(f"operands of `{symbol}` swapped", alternatives + _render(src, node, mutated), change)


def _break_chain(src: _Source, node: ast.AST, parent, field, index) -> Iterator[_Site]:
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Call)
    ):
        inner = node.func.value
        yield _Site(
            f"`.{node.func.attr}()` dropped from a call chain",
            _unwrap(src, node, inner),
            partial(_put, parent, field, index, inner),
        )


def _constant_shift(src: _Source, node: ast.AST, parent, field, index) -> Iterator[_Site]:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        a, b = src.span(node)
        for new in (node.value + 1, node.value - 1) if node.value > 0 else (node.value + 1,):
            yield _Site(
                f"`{src.text[a:b]}` became `{new}`", [(a, b, str(new))], partial(_assign, node, value=new)
            )


def _invert_if(src: _Source, node: ast.AST, parent, field, index) -> Iterator[_Site]:
    if not isinstance(node, ast.If):
        return
    test = node.test
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        new, alternatives = test.operand, _unwrap(src, test, test.operand)
    else:
        new = ast.UnaryOp(op=ast.Not(), operand=test)
        a, b = src.span(test)
        text = src.text[a:b]
        alternatives = [(a, b, f"not {text}"), (a, b, f"not ({text})"), *_render(src, test, new)]
    yield _Site("`if` condition negated", alternatives, partial(_assign, node, test=new))


def _removal(
    src: _Source, parent: ast.AST, field: str, index: int
) -> tuple[list[tuple[int, int, str]], Callable]:
    """Delete the lines of statement ``index`` of a block, or put ``pass`` in its place."""
    block = getattr(parent, field)
    a, b = src.span(block[index])
    if len(block) > 1 and src.whole_lines(a, b):
        first, last = src.line_of(a), src.line_of(b)
        start, end = src.line_start(first), src.line_end(last)
        if first > 1 and not src.line(first - 1).strip():
            # keep one blank line where the statement sat between two, not two in a row
            if end == len(src.text):
                while first > 1 and not src.line(first - 1).strip():
                    first -= 1
                start = src.line_start(first)
            elif not src.line(last + 1).strip():
                end = src.line_end(last + 1)
        return [(start, end, "")], partial(_splice, block, index, index + 1, [])
    return [(a, b, "pass")], partial(_splice, block, index, index + 1, [ast.Pass()])


def _remove_loop(src: _Source, node: ast.AST, parent, field, index) -> Iterator[_Site]:
    if isinstance(node, ast.For | ast.AsyncFor | ast.While):
        kind = "while" if isinstance(node, ast.While) else "for"
        yield _Site(f"`{kind}` loop removed", *_removal(src, parent, field, index))


def _remove_assignment(src: _Source, node: ast.AST, parent, field, index) -> Iterator[_Site]:
    if isinstance(node, ast.Assign | ast.AugAssign) or (isinstance(node, ast.AnnAssign) and node.value):
        target = ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node.target)
        target = target if len(target) <= 40 else target[:37] + "..."
        yield _Site(f"assignment to `{target}` removed", *_removal(src, parent, field, index))


def _remove_condition(src: _Source, node: ast.AST, parent, field, index) -> Iterator[_Site]:
    if not isinstance(node, ast.If) or node.orelse:
        return
    if isinstance(parent, ast.If) and field == "orelse" and src.line(node.lineno).lstrip().startswith("elif"):
        return
    first = node.body[0]
    a, b = src.span(node)
    if first.lineno == node.test.end_lineno:  # `if c: x = 1`
        alternatives = [(a, b, src.text[src.span(first)[0] : b])]
    elif src.whole_lines(a, b):
        start, end = src.line_start(node.lineno), src.line_end(src.line_of(b))
        inner, outer = src.indent(first.lineno), src.indent(node.lineno)
        body = _lines(src.text[src.line_start(first.lineno) : end])
        text = "".join(outer + line[len(inner) :] if line.startswith(inner) else line for line in body)
        rendered = "".join(
            outer + line + "\n" for stmt in node.body for line in ast.unparse(stmt).split("\n")
        )
        alternatives = [(start, end, text), (start, end, rendered)]
    else:
        return
    yield _Site(
        "`if` check dropped (its body kept)",
        alternatives,
        partial(_splice, getattr(parent, field), index, index + 1, node.body),
    )


def _remove_wrapper(src: _Source, node: ast.AST, parent, field, index) -> Iterator[_Site]:
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in WRAPPERS
        and len(node.args) == 1
        and not node.keywords
        and not isinstance(node.args[0], ast.Starred)
    ):
        arg = node.args[0]
        yield _Site(
            f"`{node.func.id}(...)` unwrapped",
            _unwrap(src, node, arg),
            partial(_put, parent, field, index, arg),
        )


_SIMPLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Delete, ast.Assert)


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    if isinstance(node, ast.Subscript):
        return _dotted(node.value)
    return None


def _effects(stmt: ast.stmt) -> tuple[set[str], set[str], bool]:
    """(read, written, mutates objects) of a simple statement, names dotted: ``d[k] = v`` writes ``d``.

    A statement expression mutates objects and writes whatever it touches, as its calls may.
    """
    targets = [
        n for t in getattr(stmt, "targets", None) or [getattr(stmt, "target", None)] if t for n in ast.walk(t)
    ]
    written = {_dotted(n) for n in targets if isinstance(getattr(n, "ctx", None), ast.Store | ast.Del)}
    inner = {id(n.value) for n in ast.walk(stmt) if isinstance(n, ast.Attribute)}  # part of a longer chain
    read = {
        _dotted(n)
        for n in ast.walk(stmt)
        if isinstance(n, ast.Name | ast.Attribute) and isinstance(n.ctx, ast.Load) and id(n) not in inner
    }
    if isinstance(stmt, ast.AugAssign):
        read |= written
    mutates = isinstance(stmt, ast.Expr) or any(
        isinstance(n, ast.Attribute | ast.Subscript) and not isinstance(n.ctx, ast.Load) for n in targets
    )
    if isinstance(stmt, ast.Expr):
        written |= read
    return read - {None}, written - {None}, mutates


def _overlap(xs: set[str], ys: set[str]) -> bool:
    return any(x == y or x.startswith(y + ".") or y.startswith(x + ".") for x in xs for y in ys)


def _dependent(first: ast.stmt, second: ast.stmt) -> bool:
    """Whether swapping two simple statements can change behaviour (a light, syntactic check)."""
    (r1, w1, m1), (r2, w2, m2) = _effects(first), _effects(second)
    calls = (isinstance(first, ast.Expr) and m2) or (isinstance(second, ast.Expr) and m1)
    return calls or _overlap(w1, r2 | w2) or _overlap(w2, r1)


def _shuffle_statements(src: _Source, node: ast.AST, parent, field, index) -> Iterator[_Site]:
    if index is None or not isinstance(node, ast.stmt):
        return
    block = getattr(parent, field)
    if index + 1 >= len(block):
        return
    first, second = node, block[index + 1]
    for stmt in (first, second):
        if not isinstance(stmt, _SIMPLE) or (
            isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
        ):
            return
        if any(isinstance(n, ast.Yield | ast.YieldFrom) for n in ast.walk(stmt)):
            return
        if not src.whole_lines(*src.span(stmt)):
            return
    if ast.dump(first) == ast.dump(second):
        return
    if not _dependent(first, second):
        return  # independent: the swap would not change behaviour
    a, m = src.line_start(first.lineno), src.line_end(first.end_lineno)
    c, d = src.line_start(second.lineno), src.line_end(second.end_lineno)
    lower = src.text[c:d]
    text = (lower if lower.endswith("\n") else lower + "\n") + src.text[m:c] + src.text[a:m]
    if not lower.endswith("\n"):
        text = text[:-1]
    yield _Site(
        "two adjacent statements swapped",
        [(a, d, text)],
        partial(_splice, block, index, index + 2, [second, first]),
    )


def _remove_base(src: _Source, cls: ast.ClassDef) -> Iterator[_Site]:
    opening = re.compile(r"class\s+" + re.escape(cls.name) + r"\s*\(").match(
        src.text, src.offset(cls.lineno, cls.col_offset)
    )
    if opening is None or not cls.bases:
        return
    args = sorted([*cls.bases, *cls.keywords], key=lambda n: src.span(n)[0])
    close = src.span(args[-1])[1]
    masked = _COMMENT.sub(lambda m: " " * len(m.group()), src.text[close : close + 200])
    skipped = len(masked) - len(masked.lstrip(" \t\f\r\n\\,"))
    if masked[skipped : skipped + 1] != ")":
        return
    start, end = opening.end() - 1, close + skipped + 1
    for i, base in enumerate(cls.bases):
        if _dotted(base) == "object" or (
            isinstance(base, ast.Subscript) and _dotted(base) in ("Generic", "typing.Generic")
        ):
            continue
        rest = [src.segment(n) for n in args if n is not base]
        text = f"({', '.join(rest)})" if rest else ""
        yield _Site(
            f"base `{src.segment(base)}` removed",
            [(start, end, text)],
            partial(_splice, cls.bases, i, i + 1, []),
        )


def _remove_method(src: _Source, cls: ast.ClassDef) -> Iterator[_Site]:
    for i, item in enumerate(cls.body):
        if isinstance(item, _DEFS) and item.name != "__init__" and not _is_stub(item):
            yield _Site(f"method `{item.name}` removed", *_removal(src, cls, "body", i))


_FUNCTION_RULES: dict[str, Callable[..., Iterator[_Site]]] = {
    "op_change": partial(_operators, _OP_CHANGE),
    "op_flip": partial(_operators, _OP_FLIP),
    "operand_swap": _operand_swap,
    "break_chain": _break_chain,
    "constant_shift": _constant_shift,
    "invert_if": _invert_if,
    "remove_loop": _remove_loop,
    "remove_condition": _remove_condition,
    "remove_assignment": _remove_assignment,
    "remove_wrapper": _remove_wrapper,
    "shuffle_statements": _shuffle_statements,
}
_CLASS_RULES: dict[str, Callable[[_Source, ast.ClassDef], Iterator[_Site]]] = {
    "remove_base": _remove_base,
    "remove_method": _remove_method,
}


def _sites(src: _Source, scope: ast.AST, chosen: list[str]) -> list[tuple[str, _Site]]:
    """(transform, site) of one function or class, in source order."""
    if isinstance(scope, ast.ClassDef):
        return [(t, site) for t in chosen if t in _CLASS_RULES for site in _CLASS_RULES[t](src, scope)]
    if _is_stub(scope):
        return []
    rules = [(t, _FUNCTION_RULES[t]) for t in chosen if t in _FUNCTION_RULES]
    roots = [(stmt, scope, "body", i) for i, stmt in enumerate(scope.body)]
    return [(t, site) for node, *slot in _walk(roots) for t, rule in rules for site in rule(src, node, *slot)]
