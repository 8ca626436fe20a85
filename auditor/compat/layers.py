"""Moved: the module walk and the parameter table live in :mod:`auditor.structure.layers`, the module specs in
:mod:`auditor.kinds`. This module keeps the documented path ``auditor.layers.register_layer_spec`` working for
users; nothing inside the package imports it."""

from .kinds.base import Cost  # noqa: F401
from .kinds.base import LayerSpec  # noqa: F401
from .kinds.base import MatrixView  # noqa: F401
from .kinds.base import Shape  # noqa: F401
from .structure.layers import ParamTable  # noqa: F401
from .structure.layers import collect_layers  # noqa: F401
from .structure.layers import matrix_view  # noqa: F401
from .structure.layers import register_layer_spec  # noqa: F401
from .structure.layers import spec_for  # noqa: F401
