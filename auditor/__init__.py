"""lowrank-auditor: audit a PyTorch model before replacing its weights W (m x n) by low-rank products A B.

>>> from auditor import lrmath
>>> lrmath.break_even(4096, 4096)
2048.0
"""

__version__ = "0.1.0"

from .config import Settings  # noqa: E402
from .core import Audit, audit, audit_source  # noqa: E402
from .errors import AuditError  # noqa: E402

__all__ = ["Audit", "AuditError", "Settings", "audit", "audit_source", "__version__"]
