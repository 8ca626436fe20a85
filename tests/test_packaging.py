"""What a non-editable install ships: pyproject.toml lists its packages by hand (the templates live outside the
package tree), so a new subpackage that is not listed would be missing from a wheel while the editable checkout
still imports it."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "auditor").rglob("__init__.py")}
    assert found, "no packages found under auditor/"
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    mapped = {name for name in listed if name in cfg.get("package-dir", {})}
    assert listed - found - mapped == set(), "listed packages that do not exist"
    assert (ROOT / cfg["package-dir"]["auditor.templates"] / "report.html").is_file()
