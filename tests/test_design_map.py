"""docs/design.md maps every module of the package: each ``auditor/**.py`` is named there by its path under
``auditor/`` (``calibration/rounding.py``, top-level ones as ``recover.py``), so a newcomer finds every file on the
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
    text = "speed/layer_timing.py and calibration/cluster.py; rules/builtin/lrNNN.py"
    assert named("calibration/cluster.py", text) and named("rules/builtin/lr020.py", text)
    assert not named("cluster.py", text) and not named("layer_timing.py", text) and not named("speed/model.py", text)


def test_every_module_is_on_the_design_map():
    text = DESIGN.read_text(encoding="utf-8")
    modules = sorted(p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py"))
    assert len(modules) > 100
    assert [m for m in modules if not named(m, text)] == [], "add each to the module map in docs/design.md"
