"""Functions a reader can hold in their head (issue 30): no function in ``auditor/`` is longer than 60 lines (from
its ``def`` line to its last line, docstring included) or takes more than 8 parameters (``self``/``cls`` excluded,
``*args`` and ``**kwargs`` counted once each). A longer one is split into named steps; more parameters go into a
small parameter dataclass.

``EXCEPTIONS`` lists each function allowed over a limit, with the reason. An entry that is no longer over either
limit (or no longer exists) fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import auditor

PKG = Path(auditor.__file__).resolve().parent
MAX_LINES = 60
MAX_PARAMS = 8

# "path under auditor/:qualified name" -> why it may stay over a limit
EXCEPTIONS: dict[str, str] = {}


def params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The parameters a caller can pass: ``self``/``cls`` left out, ``*args`` and ``**kwargs`` one each."""
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def sizes(source: str) -> dict[str, tuple[int, int]]:
    """Every function of a module's source (methods and nested functions too) by qualified name: (lines from its
    ``def`` line to its last, parameters)."""
    out: dict[str, tuple[int, int]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                out[name] = (child.end_lineno - child.lineno + 1, params(child))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def measured() -> dict[str, tuple[int, int]]:
    return {f"{path.relative_to(PKG).as_posix()}:{name}": size
            for path in sorted(PKG.rglob("*.py")) for name, size in sizes(path.read_text(encoding="utf-8")).items()}


def over(size: tuple[int, int]) -> bool:
    return size[0] > MAX_LINES or size[1] > MAX_PARAMS


def test_the_counter_counts_lines_and_parameters_as_documented() -> None:
    src = ("class C:\n"
           "    def m(self, a, /, b, *args, c, **kw):\n"
           "        def inner(x=1):\n"
           "            return x\n"
           "        return inner()\n"
           "    @classmethod\n"
           "    def k(cls):\n"
           "        pass\n"
           "async def f(self_like, b):\n"
           "    '''doc'''\n"
           "\n"
           "    return b\n")
    assert sizes(src) == {"C.m": (4, 5), "C.m.inner": (2, 1), "C.k": (2, 0), "f": (4, 2)}
    assert over((61, 0)) and over((1, 9)) and not over((60, 8))


def test_no_function_over_60_lines_or_8_parameters() -> None:
    found = measured()
    assert len(found) > 500  # the walk reached the package
    bad = [f"{name}: {lines} lines, {n} parameters" for name, (lines, n) in found.items()
           if over((lines, n)) and name not in EXCEPTIONS]
    assert bad == [], "split into named steps, or pass a parameter dataclass (see EXCEPTIONS for the few allowed)"


def test_every_exception_is_still_needed() -> None:
    found = measured()
    stale = [name for name in EXCEPTIONS if name not in found or not over(found[name])]
    assert stale == [], "within the limits now (or gone): remove from EXCEPTIONS"
    assert [name for name, why in EXCEPTIONS.items() if not why.strip()] == [], "each exception says why"


MAX_CLASS_LINES = 150
MAX_LONG_CLASSES = 0  # no class runs past MAX_CLASS_LINES (issue 53; 2 allowed by issue 36)
# "path under auditor/:class" -> why it is long for now; an entry no longer long fails too, so the table only shrinks
LONG_CLASSES: dict[str, str] = {}


def long_classes() -> dict[str, int]:
    """Every class of auditor/ over :data:`MAX_CLASS_LINES` lines (``class`` line to its last), by path and name."""
    return {f"{path.relative_to(PKG).as_posix()}:{node.name}": node.end_lineno - node.lineno + 1  # type: ignore[operator]
            for path in sorted(PKG.rglob("*.py")) for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES}  # type: ignore[operator]


def test_classes_are_split_by_responsibility_before_they_run_past_150_lines() -> None:
    found = long_classes()
    assert sorted(set(found) - set(LONG_CLASSES)) == [], found
    assert sorted(set(LONG_CLASSES) - set(found)) == [], "no longer long: remove from LONG_CLASSES"
    assert len(LONG_CLASSES) <= MAX_LONG_CLASSES
