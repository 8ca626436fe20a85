"""Find every factorizable weight of a module tree and describe it as a matrix view. Dispatch on module types.

Tied or shared tensors (GPT-2's lm_head and wte, ALBERT's shared layers) are one record keyed by tensor identity,
with every other name listed as an alias; parameters are counted once.
"""

from __future__ import annotations

import inspect
import math
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from .results import Kind, Layer


@dataclass
class ParamTable:
    """Every unique parameter tensor of a model, by identity, with all of its names."""

    names: dict[int, list[str]] = field(default_factory=dict)  # id(tensor) -> names, first = canonical
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    canonical: dict[str, str] = field(default_factory=dict)  # any name -> canonical name
    keys: dict[str, int] = field(default_factory=dict)  # canonical name -> id(tensor)

    @classmethod
    def of(cls, model: nn.Module) -> "ParamTable":
        table = cls()
        for name, p in model.named_parameters(remove_duplicate=False):
            key = id(p)
            if key not in table.names:
                table.names[key] = []
                table.tensors[key] = p
                table.keys[name] = key
            table.names[key].append(name)
            table.canonical[name] = table.names[key][0]
        return table

    @property
    def total(self) -> int:
        return sum(t.numel() for t in self.tensors.values())

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors[self.keys[self.canonical[name]]]

    def names_of(self, name: str) -> list[str]:
        """Every name of the tensor, the canonical one first."""
        return self.names[self.keys[self.canonical[name]]]


def _hf_conv1d_type() -> type | None:
    """transformers' Conv1D, only if transformers is already imported (importing it costs seconds)."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:  # pragma: no cover - very old or broken transformers
        return None
    return Conv1D


@lru_cache(maxsize=None)
def _class_source(cls: type) -> str:
    name = f"{cls.__module__}.{cls.__qualname__}"
    try:
        file = inspect.getsourcefile(cls)
        line = inspect.getsourcelines(cls)[1]
    except (OSError, TypeError):
        return name
    return f"{name} ({Path(file).name}:{line})" if file else name


def _source(mod: nn.Module) -> str:
    """The owning module's class and where it is defined."""
    return _class_source(type(mod))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def module_weights(path: str, mod: nn.Module) -> list[tuple[str, Kind, int, int, int, str]]:
    """(param name, kind, m, n, groups, view) for each factorizable weight owned directly by ``mod``."""
    out: list[tuple[str, Kind, int, int, int, str]] = []
    conv1d = _hf_conv1d_type()
    if isinstance(mod, nn.Linear) and not isinstance(mod.weight, nn.parameter.UninitializedParameter):
        o, i = mod.weight.shape
        out.append(("weight", Kind.LINEAR, o, i, 1, "(out, in) as stored"))
    elif conv1d is not None and isinstance(mod, conv1d):
        i, o = mod.weight.shape
        out.append(("weight", Kind.CONV1D_HF, o, i, 1, "stored (in, out); viewed transposed as (out, in)"))
    elif isinstance(mod, nn.modules.conv._ConvNd):
        w = mod.weight
        g = mod.groups
        k = math.prod(w.shape[2:])
        ks = "x".join(str(s) for s in w.shape[2:])
        if mod.transposed:
            cin, cout_g = w.shape[0], w.shape[1]
            m, n = cout_g, (cin // g) * k
            view = f"(in, out/g, {ks}) viewed as out/g x in/g*{ks} per group"
            kind = Kind.CONV_TRANSPOSE
        else:
            cout, cin_g = w.shape[0], w.shape[1]
            m, n = cout // g, cin_g * k
            view = f"(out, in/g, {ks}) viewed as out/g x in/g*{ks} per group"
            kind = Kind.CONV
        if g == 1:
            view = view.replace("/g", "").replace(" per group", "")
        out.append(("weight", kind, m, n, g, view))
    elif isinstance(mod, (nn.Embedding, nn.EmbeddingBag)):
        v, h = mod.weight.shape
        out.append(("weight", Kind.EMBEDDING, v, h, 1, "(num_embeddings, dim) as stored"))
    elif isinstance(mod, nn.RNNBase):
        gates = {"LSTM": 4, "GRU": 3}.get(mod.mode, 1)
        for pname, p in mod.named_parameters(recurse=False):
            if p.dim() == 2:
                m, n = p.shape
                out.append((pname, Kind.RNN, m, n, 1, f"{gates} gate matrices stacked: ({gates}*hidden, in)"))
    elif isinstance(mod, nn.MultiheadAttention):
        for pname in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
            p = getattr(mod, pname, None)
            if p is not None:
                m, n = p.shape
                view = "q, k, v stacked: (3*embed, embed)" if pname == "in_proj_weight" else "(embed, kdim) as stored"
                out.append((pname, Kind.MHA_IN_PROJ, m, n, 1, view))
    return out


def collect_layers(model: nn.Module, table: ParamTable) -> dict[str, Layer]:
    """Layer records keyed by canonical parameter name, in module order."""
    layers: dict[str, Layer] = {}
    for path, mod in model.named_modules():
        for pname, kind, m, n, g, view in module_weights(path, mod):
            full = _join(path, pname)
            canon = table.canonical.get(full)
            if canon is None or canon in layers:
                continue  # not a parameter (or a tied tensor already recorded under its first name)
            t = table.tensor(canon)
            names = table.names_of(canon)
            layers[canon] = Layer(
                name=path if pname == "weight" else full,
                param=canon,
                kind=kind,
                module_type=type(mod).__name__,
                shape=tuple(t.shape),
                m=m,
                n=n,
                groups=g,
                view=view,
                dtype=_dtype(t),
                aliases=names[1:],
                source=_source(mod),
            )
    return layers


def layer_for_graph_param(canon: str, t: torch.Tensor, op: str, aliases: list[str]) -> Layer | None:
    """A record for a 2-D parameter used directly by a matmul-like op in the graph, with no module we know."""
    if t.dim() != 2:
        return None
    m, n = t.shape
    return Layer(
        name=canon,
        param=canon,
        kind=Kind.MATMUL,
        module_type=f"op:{op}",
        shape=tuple(t.shape),
        m=m,
        n=n,
        view="2-D parameter as stored",
        dtype=_dtype(t),
        aliases=aliases,
    )


def matrix_view(layer: Layer, t: torch.Tensor) -> torch.Tensor:
    """The tensor as ``groups`` matrices of m x n (singular values do not depend on transposition)."""
    g, m, n = layer.groups, layer.m, layer.n
    if layer.kind == Kind.CONV_TRANSPOSE:
        k = math.prod(t.shape[2:])
        cin_g = t.shape[0] // g
        return t.reshape(g, cin_g, m, k).permute(0, 2, 1, 3).reshape(g, m, n)
    if layer.kind == Kind.CONV1D_HF:
        return t.t().reshape(1, m, n)
    return t.reshape(g, m, n)
