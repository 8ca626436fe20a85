"""``nn.Linear`` (and quantized Linear, listed and counted only): W (out, in) as stored; y = W x.

Statistics: the input vectors, every leading dimension flattened, at the batch's real positions. Replacement:
Linear(in, r, bias=False) then Linear(r, out, bias as before)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..results import Kind, Layer
from ._weights import call_weight, linear_pair, only_weight
from .base import Cost, Feeds, LayerKind, LayerSpec, MatrixView, Shape, rows_hook


def _view(mod: nn.Module, name: str, shape: Shape) -> MatrixView:
    return MatrixView(Kind.LINEAR, shape[0], shape[1])


def _cost(mod: nn.Module, ins: list[Shape | None], out: Shape | None) -> list[Cost]:
    return [] if out is None else [Cost("weight", "linear", math.prod(out) * mod.in_features)]


SPEC = LayerSpec(only_weight, _view, _cost)


class LinearKind(LayerKind):
    kind = Kind.LINEAR
    label = "Linear"
    finds = {nn.Linear: SPEC,
             # quantized modules keep their weight packed and hand it out by a call: listed, counted, spectra skipped
             torch.ao.nn.quantized.Linear: LayerSpec(lambda m: ("weight",), _view, _cost, call_weight)}
    swept = True
    linear_chain = True
    gradient_sensitivity = True
    cut_to_rank1 = True
    timed = True

    def accepts(self, mod: nn.Module) -> bool:
        return isinstance(mod, nn.Linear)

    def statistics(self, path: str, mod: nn.Module, layers: list[Layer], feeds: Feeds) -> None:
        for layer in layers:
            feeds.hook(mod, rows_hook(feeds.rows(layer, layer.n, shared=True), feeds))

    def replace(self, layer, mod, r, a, b):
        return linear_pair(layer.n, layer.m, r, getattr(mod, "bias", None), a, b, mod.weight)


KIND = LinearKind()
