"""Moved: the module walk and the parameter table live in :mod:`auditor.structure.layers`, the module specs in
:mod:`auditor.kinds`. This module keeps the documented path ``auditor.layers.register_layer_spec`` working for
users; nothing inside the package imports it."""

from auditor.kinds.base import Cost  # noqa: F401
from auditor.kinds.base import LayerSpec  # noqa: F401
from auditor.kinds.base import MatrixView  # noqa: F401
from auditor.kinds.base import Shape  # noqa: F401
from auditor.structure.layers import ParamTable  # noqa: F401
from auditor.structure.layers import collect_layers  # noqa: F401
from auditor.structure.layers import matrix_view  # noqa: F401
from auditor.structure.layers import register_layer_spec  # noqa: F401
from auditor.structure.layers import spec_for  # noqa: F401
