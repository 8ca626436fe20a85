"""Where a layer is defined in the user's own code: the statement that gives its parent the module or parameter,
such as ``self.fc1 = nn.Linear(64, 512)`` in the model's class, so code scanning (SARIF) can show a finding beside it.

The weight ``blocks.0.fc.weight`` is looked up from the inside out: ``weight`` on ``blocks.0.fc`` (an ``nn.Linear``,
torch's code: passed over), ``fc`` on ``blocks.0`` (the user's ``Block``: ``self.fc = ...`` found), and if nothing
is found, ``0`` on ``blocks`` and ``blocks`` on the model. Code in the standard library or in installed packages
(torch, transformers) is never the answer: a finding there would point outside the repository. Classes are read
from the file their methods were compiled from, so a model file imported without a ``sys.modules`` entry (as the
command line imports ``file.py:factory``) is found too.

>>> import torch
>>> definition_site(torch.nn.Sequential(torch.nn.Linear(2, 2)), "0.weight") is None  # all of it torch's code
True
"""

from __future__ import annotations

import ast
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["definition_site", "is_library_file"]

_REGISTER = {"add_module": 0, "register_module": 0, "register_parameter": 0, "register_buffer": 0}


@lru_cache(maxsize=None)
def _library_roots() -> tuple[Path, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)}
    return tuple(Path(p).resolve() for p in roots)


def is_library_file(path: str | Path) -> bool:
    """Whether ``path`` lies in the standard library or an installed package (site-packages)."""
    p = Path(path).resolve()
    return any(p.is_relative_to(root) for root in _library_roots()) or "site-packages" in p.parts


def _class_file(cls: type) -> tuple[str, int] | None:
    """(file, a line inside the class) from one of the class's own functions."""
    for value in vars(cls).values():
        fn = getattr(value, "__func__", value)
        code = getattr(fn, "__code__", None)
        if code is not None and code.co_filename and not code.co_filename.startswith("<"):
            return code.co_filename, code.co_firstlineno
    return None


@lru_cache(maxsize=256)
def _parse(path: str) -> ast.Module | None:
    try:
        return ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None


def _class_node(tree: ast.Module, name: str, line: int) -> ast.ClassDef | None:
    """The innermost class named ``name`` whose body holds ``line``."""
    best = None
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name and node.lineno <= line <= (node.end_lineno or line):
            if best is None or node.lineno > best.lineno:
                best = node
    return best


def _assigns(node: ast.AST, attr: str) -> bool:
    """``self.<attr> = ...``, ``self.<attr>: T = ...``, ``setattr(self, "<attr>", ...)`` or
    ``self.add_module("<attr>", ...)`` (and the other ``register_*`` calls)."""
    def is_self_attr(t: ast.AST) -> bool:
        return (isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name)
                and t.value.id == "self")

    if isinstance(node, ast.Assign):
        return any(is_self_attr(t) or (isinstance(t, ast.Tuple) and any(map(is_self_attr, t.elts)))
                   for t in node.targets)
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return is_self_attr(node.target)
    if isinstance(node, ast.Call) and node.args:
        f = node.func
        first = node.args[0]
        if isinstance(f, ast.Name) and f.id == "setattr" and len(node.args) >= 2:
            return (isinstance(first, ast.Name) and first.id == "self" and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value == attr)
        if isinstance(f, ast.Attribute) and f.attr in _REGISTER and isinstance(f.value, ast.Name) \
                and f.value.id == "self":
            return isinstance(first, ast.Constant) and first.value == attr
    return False


@lru_cache(maxsize=4096)
def _assignment(cls: type, attr: str) -> tuple[str, int] | None:
    """Where ``cls`` (or a base class of the user's) sets ``self.<attr>``: (file, line), or None."""
    for klass in cls.__mro__:
        if klass.__module__.startswith(("torch.", "builtins")) or klass is object:
            continue
        where = _class_file(klass)
        if where is None or is_library_file(where[0]):
            continue
        tree = _parse(where[0])
        node = _class_node(tree, klass.__name__, where[1]) if tree is not None else None
        if node is None:
            continue
        hits = [n.lineno for n in ast.walk(node) if _assigns(n, attr)]
        if hits:
            return where[0], min(hits)
    return None


def definition_site(model: Any, param: str) -> tuple[str, int] | None:
    """(absolute file, line) of the statement in the user's code that defines the weight ``param`` (a qualified
    parameter name) or the module holding it; None when it is all library code (or cannot be read)."""
    parts = param.split(".")
    for k in range(len(parts) - 1, -1, -1):
        try:
            owner = model.get_submodule(".".join(parts[:k]))
        except (AttributeError, TypeError):
            continue
        site = _assignment(type(owner), parts[k])
        if site is not None:
            return str(Path(site[0]).resolve()), site[1]
    return None
