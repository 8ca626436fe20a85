"""Imports run one way: the import graph of the ``auditor`` package has no circle, and no module imports one of a
higher layer than its own.

Every import counts, wherever it is written: at module level, inside a function (a lazy import ties the modules
just the same) and inside ``if TYPE_CHECKING:`` (a type annotation names the module, and a reader must understand
it). What does not count is the implicit import of a parent package (``import auditor.x`` runs
``auditor/__init__.py`` first): that is how Python loads packages, not a dependency the code chose.

``LAYERS`` lists the layers from the top down; a module may import modules of its own layer (without a circle) and
of the layers below it. Every module of the package must be in exactly one layer: a new module picks its room.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

import auditor

PKG = Path(auditor.__file__).resolve().parent

# Modules kept only so that a public path users import still works (each re-exports names from the module's new home):
# they live in compat/ and are imported by their old names (auditor/__init__.py puts compat/ on the package's path)
SHIMS = ("factorize", "recover", "graph", "layers", "load", "folder", "export", "suggest")

# From the top down, one layer per package or top-level module. A name covers the module and, for a package, every
# module inside it (the longest name wins).
LAYERS: list[tuple[str, tuple[str, ...]]] = [(name.removeprefix("auditor.") or "auditor", (name,)) for name in (
    "auditor.__main__",
    "auditor.cli",  # one module per command, the shared flags and the parser
    "auditor",  # auditor/__init__.py
    # the moved modules' public paths, kept for users (SHIMS, in compat/)
    *(f"auditor.{name}" for name in SHIMS),
    "auditor.api",  # the front object over the plain result
    "auditor.pipeline",
    "auditor.render",  # one module per report format
    "auditor.render.parts",  # what the formats are built from: tables, pages, sections, charts, fitting, escaping
    "auditor.verdict",  # the verdict, --fail-on and the baseline diff
    "auditor.rules",
    "auditor.artifacts",  # what factorize writes: the output folder, the exported program
    "auditor.speed",  # --measure-speed: times the modules surgery writes
    "auditor.calibration",  # the stage on top: the tiers composed into the calibration report, the plan check
    "auditor.calibration.tiers",  # tier 1, floors, sensitivity, rounding, the plan search
    "auditor.calibration.recovery",  # the recovery fine-tune of a frontier plan
    "auditor.calibration.apply",  # factorize with the data's factors
    "auditor.calibration.references",  # the dense model measured once: the evaluators and the verifier
    "auditor.calibration.session",  # what every tier measures with
    "auditor.calibration.measure",  # the metric, its evaluators, the verification interval
    "auditor.calibration.metrics",  # one module per metric kind and their registry
    "auditor.calibration.statistics",  # input statistics, streamed by block; whitened spectra
    "auditor.calibration.data",  # the calibration batches, text, hashes
    "auditor.surgery",  # plan application: a layer replaced by its factors, given or from a truncation callable
    "auditor.planning",  # plans read and reviewed, suggested ranks, layer groups
    "auditor.spectra",
    "auditor.quantize",  # round-to-nearest integer codes with their bytes, the multiple-choice knapsack
    "auditor.structure",  # trace, op costs and the layer graph, the module walk, definition sites
    "auditor.sources",  # source strings -> models: factories, Hugging Face, checkpoints, tensor refs
    "auditor.kinds",  # one module per layer kind and their registry
    "auditor.results",
    "auditor.calresults",
    "auditor.speedresults",  # what a speed measurement found, plain data
    "auditor.options",
    "auditor.config",
    "auditor.progress",
    "auditor.lrmath",
    "auditor.errors",
    "auditor._env",
    "auditor._version",
)]


def modules(root: Path = PKG) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` file of the package (``auditor/__init__.py`` is ``auditor``); a module
    of compat/ by the name it is imported as (``compat/load.py`` is ``auditor.load``), its package by none."""

    def name(p: Path) -> str:
        parts = p.relative_to(root.parent).with_suffix("").parts
        if parts[1:2] == ("compat",):
            parts = parts[:1] + parts[2:]
        return ".".join(parts).removesuffix(".__init__")

    return {name(p): p for p in sorted(root.rglob("*.py"))
            if "templates" not in p.relative_to(root).parts and p.relative_to(root).as_posix() != "compat/__init__.py"}


def imports_of(path: Path, module: str) -> list[tuple[str, list[str], int, str]]:
    """(absolute module, names imported from it, line, where) for every import statement of a file; ``where`` is
    "top", "function" (inside a def, class or any nested block) or "type-checking" (under ``if TYPE_CHECKING:``).
    Relative imports are resolved against ``module`` (a package's ``__init__`` is the package itself)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for stmt in node.body for n in ast.walk(stmt)}
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        where = "type-checking" if id(node) in typing_only else "top" if id(node) in top else "function"
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno, where) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level > len(package):
                    raise ValueError(f"{path}:{node.lineno}: relative import above the top package")
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.append((base, [a.name for a in node.names], node.lineno, where))
    return sorted(out, key=lambda t: t[2])


def import_graph(mods: dict[str, Path], root: Path = PKG) -> nx.DiGraph:
    """Module -> module edges within ``mods``; each edge keeps where it was written (``file:line (where)``).
    ``from X import name`` is an edge to ``X.name`` when that is a module, else to ``X`` (its longest prefix that
    is a module)."""

    def known(name: str) -> str | None:
        parts = name.split(".")
        while parts and ".".join(parts) not in mods:
            parts.pop()
        return ".".join(parts) if parts else None

    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for mod, path in mods.items():
        for base, names, line, where in imports_of(path, mod):
            targets = [f"{base}.{n}" if f"{base}.{n}" in mods else known(base) for n in names] or [known(base)]
            for t in targets:
                if t is not None and t != mod:
                    g.add_edge(mod, t)
                    g.edges[mod, t].setdefault("at", []).append(f"{path.relative_to(root.parent)}:{line} ({where})")
    return g


def layer_of(mod: str, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> list[int]:
    """The indices of the layers that claim ``mod`` (the longest matching name wins within a layer list)."""
    best = max((len(n) for _, names in layers for n in names if mod == n or mod.startswith(n + ".")), default=0)
    return [i for i, (_, names) in enumerate(layers) for n in names
            if len(n) == best and (mod == n or mod.startswith(n + "."))]


def circles(g: nx.DiGraph) -> list[str]:
    """One line per strongly connected component of more than one module: its size and one circle through it."""
    out = []
    for comp in sorted(nx.strongly_connected_components(g), key=lambda c: (-len(c), sorted(c))):
        if len(comp) > 1:
            cycle = [a for a, _ in nx.find_cycle(g.subgraph(comp), source=min(comp))]
            hops = [f"{a} -> {b} [{g.edges[a, b]['at'][0]}]" for a, b in zip(cycle, cycle[1:] + cycle[:1])]
            out.append(f"{len(comp)} modules in one circle, e.g. " + "; ".join(hops))
    return out


def arrows_up(g: nx.DiGraph, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> list[str]:
    """Every edge from a module to one of a higher layer (a smaller index), with where it is written."""
    out = []
    for a, b in sorted(g.edges):
        (la,), (lb,) = layer_of(a, layers), layer_of(b, layers)
        if lb < la:
            out.append(f"{a} ({layers[la][0]}) imports {b} ({layers[lb][0]}) at {', '.join(g.edges[a, b]['at'])}")
    return out


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    return import_graph(modules())


def test_every_module_is_in_exactly_one_layer(graph):
    bad = {m: [LAYERS[i][0] for i in layer_of(m)] for m in graph if len(layer_of(m)) != 1}
    assert bad == {}, "add each module to one layer of LAYERS: " + repr(bad)
    names = [n for _, ns in LAYERS for n in ns]
    unused = [n for n in names if not any(m == n or m.startswith(n + ".") for m in graph)]
    assert unused == [] and len(names) == len(set(names))


def test_no_import_circles(graph):
    found = circles(graph)
    assert found == [], "\n".join(found)


def test_imports_run_one_way(graph):
    found = arrows_up(graph)
    assert found == [], f"{len(found)} arrows up:\n" + "\n".join(found)


def test_the_graph_counts_every_import_and_the_checks_catch_circles_and_arrows_up(tmp_path):
    pkg = tmp_path / "auditor"
    (pkg / "render").mkdir(parents=True)
    files = {
        "__init__.py": "from .results import Audit\n",
        "results.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .render.html import page\n",
        "errors.py": "import os\n",
        "pipeline.py": "from . import errors, __version__\nimport auditor.results as r\n",
        "render/__init__.py": "from .html import page\n",
        "render/html.py": "from ..errors import AuditError\ndef page():\n    from ..pipeline import audit\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    mods = modules(pkg)
    assert sorted(mods) == ["auditor", "auditor.errors", "auditor.pipeline", "auditor.render", "auditor.render.html",
                            "auditor.results"]
    assert imports_of(pkg / "render/html.py", "auditor.render.html") == [
        ("auditor.errors", ["AuditError"], 1, "top"), ("auditor.pipeline", ["audit"], 3, "function")]
    g = import_graph(mods, pkg)
    assert sorted(g.edges) == [
        ("auditor", "auditor.results"), ("auditor.pipeline", "auditor"), ("auditor.pipeline", "auditor.errors"),
        ("auditor.pipeline", "auditor.results"), ("auditor.render", "auditor.render.html"),
        ("auditor.render.html", "auditor.errors"), ("auditor.render.html", "auditor.pipeline"),
        ("auditor.results", "auditor.render.html")]
    assert g.edges["auditor.results", "auditor.render.html"]["at"] == ["auditor/results.py:3 (type-checking)"]
    found = circles(g)
    assert found == ["4 modules in one circle, e.g. auditor -> auditor.results [auditor/__init__.py:1 (top)]; "
                     "auditor.results -> auditor.render.html [auditor/results.py:3 (type-checking)]; "
                     "auditor.render.html -> auditor.pipeline [auditor/render/html.py:3 (function)]; "
                     "auditor.pipeline -> auditor [auditor/pipeline.py:1 (top)]"]
    layers = [("api", ("auditor",)), ("pipeline", ("auditor.pipeline",)), ("report", ("auditor.render",)),
              ("model", ("auditor.results",)), ("core", ("auditor.errors",))]
    assert arrows_up(g, layers) == [
        "auditor.pipeline (pipeline) imports auditor (api) at auditor/pipeline.py:1 (top)",
        "auditor.render.html (report) imports auditor.pipeline (pipeline) at auditor/render/html.py:3 (function)",
        "auditor.results (model) imports auditor.render.html (report) at auditor/results.py:3 (type-checking)"]


def test_renderers_and_results_import_no_torch_networkx_or_pipeline():
    """The plain-data and report modules stay light: no torch or networkx at run time (typing-only imports are
    free), so reading and rendering a saved audit needs neither; the api layer imports them only when called."""
    mods = modules()
    plain = [m for m in mods if m.startswith("auditor.render") or m in (
        "auditor.results", "auditor.calresults", "auditor.options", "auditor.verdict.policy", "auditor.config")]
    assert "auditor.render.html" in plain and "auditor.results" in plain
    heavy = ("torch", "networkx", "auditor.pipeline")
    bad = [(m, base, line) for m in [*plain, "auditor", "auditor.api"] for base, _, line, where in imports_of(mods[m], m)
           if (where == "top" or where == "function" and m in plain) and base.split(".")[0] in heavy[:2]
           or where == "top" and base.startswith(heavy[2])]
    assert bad == []


def test_the_moved_modules_public_paths_are_re_exports_that_nothing_inside_imports(graph):
    """``auditor.load`` / ``auditor.graph`` / ``auditor.layers`` / ``auditor.recover`` / ``auditor.folder`` /
    ``auditor.export`` / ``auditor.suggest`` re-export (the same objects) from their new homes, define nothing of
    their own, live in compat/, and no module of the package imports them."""
    import importlib

    import auditor.artifacts.export
    import auditor.artifacts.folder
    import auditor.calibration.recovery
    import auditor.kinds.base
    import auditor.planning.suggest
    import auditor.sources
    import auditor.structure.graph
    import auditor.structure.layers

    homes = {"load": [auditor.sources], "graph": [auditor.structure.graph],
             "layers": [auditor.structure.layers, auditor.kinds.base], "recover": [auditor.calibration.recovery],
             "folder": [auditor.artifacts.folder], "export": [auditor.artifacts.export],
             "suggest": [auditor.planning.suggest]}
    for name in [s for s in SHIMS if s != "factorize"]:
        shim = importlib.import_module(f"auditor.{name}")
        assert Path(shim.__file__) == PKG / "compat" / f"{name}.py"
        tree = ast.parse(Path(shim.__file__).read_text(encoding="utf-8"))
        assert all(isinstance(n, ast.ImportFrom) for n in tree.body[1:]), name  # a docstring, then imports only
        public = [n for n in vars(shim) if not n.startswith("_")]
        assert public and all(any(getattr(h, n, None) is getattr(shim, n) for h in homes[name]) for n in public)
        assert [m for m in graph.predecessors(f"auditor.{name}")] == [], name
    assert auditor.graph.set_op_handle is auditor.structure.graph.set_op_handle
    assert auditor.recover.recover is auditor.calibration.recovery.recover


def test_auditor_factorize_is_a_function_and_the_old_module_path_still_imports(graph):
    """``auditor.factorize`` is a plain function; ``from auditor.factorize import ...`` reaches the names of the
    module that was there (now in surgery, calibration.apply and artifacts.folder), each the object of its home, looked up on
    first use. Only ``auditor/__init__.py`` imports the path (it loads it first, so the function keeps the name)."""
    import importlib
    import types

    shim = sys.modules["auditor.factorize"]
    assert type(auditor.factorize) is types.FunctionType and auditor.factorize.__module__ == "auditor.api"
    assert type(shim) is types.ModuleType and shim.__file__ == str(PKG / "compat" / "factorize.py")
    homes = {n: sorted(h for h, names in shim._HOMES.items() if n in names) for n in shim.__all__}
    assert all(len(h) == 1 for h in homes.values())
    assert all(getattr(shim, n) is getattr(importlib.import_module(h[0]), n) for n, h in homes.items())
    assert {"factorize", "load_factorized", "save_factorized", "count_params", "resolve_plan"} <= set(shim.__all__)
    assert "SUPPORTED" not in shim.__all__ and "predicted_params" not in shim.__all__  # kinds' and gone
    with pytest.raises(AttributeError, match="has no attribute 'SUPPORTED'"):
        shim.SUPPORTED  # noqa: B018
    assert list(graph.predecessors("auditor.factorize")) == ["auditor"]
    assert sorted(graph.successors("auditor.factorize")) == [
        "auditor.artifacts.folder", "auditor.calibration.apply", "auditor.surgery"]  # its homes, named for readers


@pytest.mark.parametrize("first", [
    "import auditor.factorize as m",  # the path first, by an import statement
    "from auditor.calibration.tiers import budget; from auditor.factorize import load_factorized",  # a module of the homes
    "import auditor; f = auditor.factorize; import auditor.factorize as m; assert f is m",  # the attribute first
])
def test_every_import_order_leaves_auditor_factorize_the_function(first):
    code = (f"{first}\nimport auditor, torch, types\nfrom auditor.factorize import factorize, save_factorized\n"
            "from auditor.calibration.apply import factorize as home\n"
            "assert type(auditor.factorize) is types.FunctionType and factorize is home and save_factorized\n"
            "net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))\n"
            "print(sum(p.numel() for p in auditor.factorize(net, {'0': 2}).parameters()))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=PKG.parent)
    assert (run.returncode, run.stdout, run.stderr) == (0, "76\n", "")  # 8*2 + 2*8 + 8 + 36
