"""docs/design.md maps every module of the package: each ``auditor/**.py`` is named there by its path under
``auditor/`` (``calibration/tiers/rounding.py``, top-level ones as ``recover.py``), so a newcomer finds every file on the
map. The built-in rules, one module per code, are named once as a family (``rules/builtin/lrNNN.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import auditor

PKG = Path(auditor.__file__).resolve().parent
DESIGN = PKG.parent / "docs" / "design.md"
FAMILIES = {re.compile(r"rules/builtin/lr\d{3}\.py"): "rules/builtin/lrNNN.py"}  # module pattern -> its name there


def named(rel: str, text: str) -> bool:
    """Whether ``text`` names the module ``rel`` as a whole path (``layers.py`` is not named by ``speed/layers.py``)."""
    rel = next((name for pattern, name in FAMILIES.items() if pattern.fullmatch(rel)), rel)
    return re.search(r"(?<![\w/.])" + re.escape(rel) + r"(?![\w/])", text) is not None


def test_the_matcher_wants_the_whole_path():
    text = "speed/layer_timing.py and calibration/tiers/cluster.py; rules/builtin/lrNNN.py"
    assert named("calibration/tiers/cluster.py", text) and named("rules/builtin/lr020.py", text)
    assert not named("cluster.py", text) and not named("layer_timing.py", text) and not named("speed/model.py", text)


def test_every_module_is_on_the_design_map():
    text = DESIGN.read_text(encoding="utf-8")
    modules = sorted(p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py"))
    assert len(modules) > 100
    assert [m for m in modules if not named(m, text)] == [], "add each to the module map in docs/design.md"


# basenames that more than one module has, each with the reason it stays (a traceback shows the basename first)
SHARED_BASENAMES = {
    "__init__.py": "every package has one",
    "graph.py": "compat/graph.py is the public path auditor.graph kept for users (a re-export of structure/graph.py)",
    "layers.py": "compat/layers.py is the public path auditor.layers kept for users (re-exports of structure/layers.py)",
    "folder.py": "compat/folder.py is the public path auditor.folder kept for users (a re-export of artifacts/folder.py)",
    "export.py": "compat/export.py is the public path auditor.export kept for users (a re-export of artifacts/export.py)",
    "suggest.py": "compat/suggest.py is the public path auditor.suggest kept for users (planning/suggest.py's names)",
    "base.py": "kinds/base.py and render/base.py: to be renamed by their owners (issue 30)",
    "registry.py": "kinds/registry.py and rules/registry.py: to be renamed by their owners (issue 30)",
}


def test_no_other_basename_is_used_twice():
    seen: dict[str, list[str]] = {}
    for p in sorted(PKG.rglob("*.py")):
        seen.setdefault(p.name, []).append(p.relative_to(PKG).as_posix())
    twice = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert sorted(set(twice) - set(SHARED_BASENAMES)) == [], twice
    assert sorted(set(SHARED_BASENAMES) - set(twice)) == [], "unique now: remove from SHARED_BASENAMES"


MAX_MODULES = 15  # modules a package directory holds directly (the top level included): a newcomer scans it at once
# package directory -> why it holds more for now; an entry no longer needed fails too, so the table only shrinks
CROWDED = {
    "rules/builtin": "one module per rule (lrNNN.py), named on the map as one family",
}


def test_no_package_directory_holds_more_than_15_modules():
    counts = {(d.relative_to(PKG).as_posix() if d != PKG else "."): len(list(d.glob("*.py")))
              for d in [PKG, *sorted(PKG.rglob("*"))] if d.is_dir() and (d / "__init__.py").is_file()}
    assert counts["."] <= MAX_MODULES and counts["cli"] == 7
    over = {d: n for d, n in counts.items() if n > MAX_MODULES}
    assert sorted(set(over) - set(CROWDED)) == [], over
    assert sorted(set(CROWDED) - set(over)) == [], "no longer over the limit: remove from CROWDED"
