"""Moved: op costs and the layer graph live in :mod:`auditor.structure.graph`. This module keeps the documented
path ``auditor.graph.set_op_handle`` working for users; nothing inside the package imports it."""

from auditor.structure.graph import OpCall  # noqa: F401
from auditor.structure.graph import OpHandle  # noqa: F401
from auditor.structure.graph import OpTable  # noqa: F401
from auditor.structure.graph import default_ops  # noqa: F401
from auditor.structure.graph import op_handles  # noqa: F401
from auditor.structure.graph import set_op_handle  # noqa: F401
