"""``nn.MultiheadAttention``'s input projections: ``in_proj_weight`` (q, k, v stacked: (3*embed, embed)) or the
separate ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``. (``out_proj`` is a Linear submodule, but the
functional attention reads its weight directly, so its cost is counted here.)

Statistics: the query (self-attention); with distinct query, key and value the three Grams are summed and the layer
is marked approximate. Measured for their spectra and tier-1 curves, but the fused attention call reads the weight
itself: there is no two-module replacement, so no suggestion to factorize and no sweep."""

from __future__ import annotations

import math
from typing import Any, Callable

from torch import nn

from ..results import Kind, Layer
from .base import Cost, Feed, Feeds, LayerKind, LayerSpec, MatrixView, NamedByParameter, Shape

_WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")


def _weights(mod: nn.Module) -> list[str]:
    return [n for n in _WEIGHTS if getattr(mod, n, None) is not None]


def _view(mod: nn.Module, name: str, shape: Shape) -> MatrixView:
    view = "q, k, v stacked: (3*embed, embed)" if name == "in_proj_weight" else "(embed, kdim) as stored"
    return MatrixView(Kind.MHA_IN_PROJ, shape[0], shape[1], 1, view)


def _cost(mod: nn.Module, ins: list[Shape | None], out: Shape | None) -> list[Cost]:
    if len(ins) < 3 or any(s is None for s in ins[:3]):
        return []
    q, k, v = (math.prod(s) for s in ins[:3])  # type: ignore[arg-type]
    e = mod.embed_dim
    if mod.in_proj_weight is not None:
        res = [Cost("in_proj_weight", "linear", (q + k + v) * e)]
    else:
        res = [Cost("q_proj_weight", "linear", q * e), Cost("k_proj_weight", "linear", k * mod.kdim),
               Cost("v_proj_weight", "linear", v * mod.vdim)]
    # the functional attention reads out_proj.weight directly: its module is never called
    return res + [Cost("out_proj.weight", "linear", q * e)]


SPEC = LayerSpec(_weights, _view, _cost)


def _first(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, i: int) -> Any:
    return args[i] if len(args) > i else kwargs.get(name)


def _hook(group: dict[str, Feed]) -> Callable[..., None]:
    def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        q, k, v = (_first(args, kwargs, n, i) for i, n in enumerate(("query", "key", "value")))
        if "in_proj_weight" in group:
            acc = group["in_proj_weight"]
            acc.add_rows(q.reshape(-1, acc.n))
            if not (k is q and v is q):
                rows = acc.rows
                acc.add_rows(k.reshape(-1, acc.n))
                acc.add_rows(v.reshape(-1, acc.n))
                acc.rows = rows
                acc.approximate = ("query, key and value differ: their Grams are summed, so the layer-output "
                                   "error is an estimate")
        for attr, t in (("q_proj_weight", q), ("k_proj_weight", k), ("v_proj_weight", v)):
            if attr in group:
                group[attr].add_rows(t.reshape(-1, group[attr].n))

    return hook


class MHAInProjKind(NamedByParameter, LayerKind):
    kind = Kind.MHA_IN_PROJ
    finds = {nn.MultiheadAttention: SPEC}
    cannot_factorize = ("MultiheadAttention reads its input projection inside the fused attention call, and "
                        "factorize() has no two-module replacement for it")

    def statistics(self, path: str, mod: nn.Module, layers: list[Layer], feeds: Feeds) -> None:
        group = {self.module_path(layer)[1]: feeds.rows(layer, layer.n, shared=True) for layer in layers}
        feeds.hook(mod, _hook(group), with_kwargs=True)


KIND = MHAInProjKind()
