"""lowrank-auditor: audit a PyTorch model before replacing its weights W (m x n) by low-rank products A B.

>>> from auditor import lrmath
>>> lrmath.break_even(4096, 4096)
2048.0

``import auditor`` does not import torch; ``auditor.audit`` does, on first use.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

from .config import FailOn, Settings  # noqa: E402
from .errors import AuditError, ExitCode  # noqa: E402
from .options import AuditOptions, LoadOptions, Tracer  # noqa: E402
from .results import Audit  # noqa: E402

__all__ = ["Audit", "AuditError", "AuditOptions", "ExitCode", "FailOn", "LoadOptions", "Settings", "Tracer", "audit",
           "audit_source", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("audit", "audit_source"):
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'auditor' has no attribute {name!r}")
