"""Two kinds with no module of their own: ``matmul``, a 2-D parameter multiplied in the graph (``x @ W``) or the
weight of a module type registered with :func:`auditor.structure.layers.register_layer_spec`; and ``tensor``, a 2-D tensor
of a weights-only checkpoint (no graph), the catch-all guess. Both are viewed as stored; a matmul weight is swept
(truncated in place), neither has a two-module replacement."""

from __future__ import annotations

from ..results import Kind
from .base import LayerKind, Shape


class MatmulKind(LayerKind):
    kind = Kind.MATMUL
    swept = True
    linear_chain = True


class TensorKind(LayerKind):
    kind = Kind.TENSOR

    def guess(self, name: str, shape: Shape) -> tuple[int, int, str] | None:
        return (shape[0], shape[1], "2-D tensor as stored") if len(shape) == 2 else None


MATMUL = MatmulKind()
TENSOR = TensorKind()
