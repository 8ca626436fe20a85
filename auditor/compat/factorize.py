"""Moved: plan application lives in :mod:`auditor.surgery` (below calibration) and
:mod:`auditor.calibration.apply` (the factors from the data), the output folder in
:mod:`auditor.artifacts.folder`. This module keeps the documented import path working for users
(``from auditor.factorize import load_factorized``); nothing inside the package imports it but ``auditor/__init__.py``, which loads it first so that the import system
finds it loaded and leaves the package's attribute ``auditor.factorize`` the function :func:`auditor.api.factorize`.
Each name is looked up in its home on first use, so ``import auditor`` stays without torch.

>>> from auditor.factorize import load_factorized, count_params
>>> load_factorized.__module__, count_params.__module__
('auditor.artifacts.folder', 'auditor.surgery')
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the homes, for readers and the layering test
    from auditor.calibration.apply import factorize  # noqa: F401
    from auditor.artifacts.folder import load_factorized, save_factorized  # noqa: F401
    from auditor.surgery import count_params, resolve_plan  # noqa: F401

_HOMES = {
    "auditor.surgery": ("FLOAT_DTYPES", "check_dtype", "check_layers", "check_targets", "count_params",
                        "resolve_plan", "tied_message"),
    "auditor.calibration.apply": ("factorize",),
    "auditor.artifacts.folder": ("EXPORT_FILES", "FORMAT", "FORMAT_VERSION", "MARKER", "MAX_PLAN_BYTES",
                                 "MODEL_FILE", "OUTPUT_FILES", "PLAN_FILE", "TOOL", "load_factorized",
                                 "previous_output", "read_meta", "read_plan", "save_factorized", "write_factorized"),
}
_HOME = {name: home for home, names in _HOMES.items() for name in names}  # name -> the module that defines it
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'auditor.factorize' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)
