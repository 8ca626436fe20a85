"""lowrank-auditor: audit a PyTorch model before replacing its weights W (m x n) by low-rank products A B.

>>> from auditor import lrmath
>>> lrmath.break_even(4096, 4096)
2048.0

``import auditor`` does not import torch; ``auditor.audit`` does, on first use. ``auditor.factorize`` is the
function :func:`auditor.api.factorize`; the earlier module path keeps working for imports
(``from auditor.factorize import load_factorized``, see :mod:`auditor.factorize`):

>>> import auditor
>>> type(auditor.factorize).__name__, auditor.factorize.__module__
('function', 'auditor.api')
"""

from __future__ import annotations

import os as _os

# The earlier public module paths (auditor.load, auditor.folder, ...) live in compat/ and are imported by their old
# names: the folder is searched after this one's own modules
__path__.append(_os.path.join(_os.path.dirname(__file__), "compat"))

# First: the import system binds a submodule on its package when it loads it, so the old path is loaded here, once,
# and the function below takes the name
from . import factorize as _factorize_path  # noqa: F401
from ._version import __version__
from .api import Audit, audit, audit_source, factorize
from .config import FailOn, Settings
from .errors import AuditError, ExitCode
from .options import AuditOptions, LoadOptions, Tracer

__all__ = ["Audit", "AuditError", "AuditOptions", "ExitCode", "FailOn", "LoadOptions", "Settings", "Tracer", "audit",
           "audit_source", "factorize", "__version__"]
