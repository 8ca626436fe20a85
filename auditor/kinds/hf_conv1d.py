"""transformers' ``Conv1D``: a linear layer whose weight is stored (in, out); viewed transposed as (out, in).

Found only once transformers is imported (importing it costs seconds). Statistics and replacement as Linear; the
function matrix is the stored weight transposed."""

from __future__ import annotations

import math
import sys

import torch
from torch import nn

from ..results import Kind
from . import registry
from ._weights import only_weight
from .base import Cost, LayerSpec, MatrixView, Shape, StoredTransposed
from .linear import LinearKind


def hf_conv1d_type() -> type | None:
    """transformers' ``Conv1D`` (a linear layer stored (in, out)) when transformers is already imported, else None."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:  # pragma: no cover - very old or broken transformers
        return None
    return Conv1D


def _view(mod: nn.Module, name: str, shape: Shape) -> MatrixView:
    i, o = shape
    return MatrixView(Kind.CONV1D_HF, o, i, 1, "stored (in, out); viewed transposed as (out, in)")


def _cost(mod: nn.Module, ins: list[Shape | None], out: Shape | None) -> list[Cost]:
    return [] if out is None else [Cost("weight", "linear", math.prod(out) * mod.weight.shape[0])]


SPEC = LayerSpec(only_weight, _view, _cost)


class HFConv1DKind(StoredTransposed, LinearKind):
    kind = Kind.CONV1D_HF
    label = "Conv1D"
    finds: dict = {}  # filled by _register once transformers is imported
    swept = True
    linear_chain = True
    timed = True

    def accepts(self, mod: nn.Module) -> bool:
        conv1d = hf_conv1d_type()
        return conv1d is not None and isinstance(mod, conv1d)

    def matrices(self, t: torch.Tensor, groups: int, m: int, n: int) -> torch.Tensor:
        return t.t().reshape(1, m, n)


KIND = HFConv1DKind()


def _register() -> None:
    conv1d = hf_conv1d_type()
    if conv1d is not None and conv1d not in KIND.finds:
        KIND.finds[conv1d] = SPEC
        registry.add_type(conv1d, SPEC, KIND, user=False)
