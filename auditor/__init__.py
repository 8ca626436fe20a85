"""lowrank-auditor: audit a PyTorch model before replacing its weights W (m x n) by low-rank products A B.

>>> from auditor import lrmath
>>> lrmath.break_even(4096, 4096)
2048.0

``import auditor`` does not import torch; ``auditor.audit`` does, on first use. ``auditor.factorize`` is both the
module of that name and, called, :func:`auditor.api.factorize`:

>>> import auditor, auditor.factorize as m
>>> callable(auditor.factorize), auditor.factorize is m, m.factorize.__module__
(True, True, 'auditor.factorize')
"""

from __future__ import annotations

import sys
import types
from typing import Any

from ._version import __version__
from .api import Audit, FactorizeModule, audit, audit_source
from .config import FailOn, Settings
from .errors import AuditError, ExitCode
from .options import AuditOptions, LoadOptions, Tracer

__all__ = ["Audit", "AuditError", "AuditOptions", "ExitCode", "FailOn", "LoadOptions", "Settings", "Tracer", "audit",
           "audit_source", "factorize", "__version__"]


class _Package(types.ModuleType):
    """The package's own module class: when the import system binds the submodule ``auditor.factorize`` here, the
    module is made callable (:class:`auditor.api.FactorizeModule`), so the attribute is the module and the
    top-level function at once, whichever import comes first."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "factorize" and type(value) is types.ModuleType:
            value.__class__ = FactorizeModule
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    if name == "factorize":  # first use: import the module (torch with it), which binds it here
        import auditor.factorize  # not `from . import`: that would look the attribute up here again

        return sys.modules[f"{__name__}.factorize"]
    raise AttributeError(f"module 'auditor' has no attribute {name!r}")
