"""Apply a plan: a new module in which every planned layer is two, with the factors it is given.

- Linear (and transformers' Conv1D) -> Linear(in, r, bias=False) then Linear(r, out, bias as before);
- Conv1d/2d/3d -> the same convolution with r outputs per group (no bias), then a 1x1 convolution to the original
  outputs (groups kept, bias as before);
- Embedding -> Embedding(V, r) then Linear(r, dim, bias=False);
- a kind registered in :mod:`auditor.kinds` -> what its ``replace`` builds (each replacement lives in its kind's
  module). Kinds that say they cannot be factorized (LSTM/GRU/RNN gates, MultiheadAttention's in_proj) are refused.

Each planned layer stores groups * r * (m + n) numbers instead of groups * m * n, so the new module has exactly
``dense - sum(m*n*groups) + sum(r*(m+n)*groups)`` parameters. The factors come from the caller: a mapping
``{layer name: (a, b)}``, a truncation callable ``(name, layer, weight, rank) -> (a, b)`` (the plain or whitened
SVD of :func:`auditor.calibration.apply.factorize`), or none (the structure only, for loading saved weights). This
module knows nothing of calibration; it sits below it, so calibration's plan search and plan check build factorized
models with it.

Only real floating-point weights (float16, bfloat16, float32, float64) are factorized: complex, quantized, integer,
boolean and float8 layers are refused with one line (AuditError), as are tied weights (under either name). Ranks at
or above break-even are allowed here (the full rank reproduces the layer); ``lowrank-audit factorize`` refuses them
unless told otherwise.
"""

from __future__ import annotations

import copy
import difflib
import fnmatch
from typing import Callable, Mapping, Union

import numpy as np
import torch
from torch import nn

from . import kinds
from .errors import AuditError
from .results import Layer
from .structure.layers import ParamTable, collect_layers

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")  # the weights factorize() decomposes

Factors = tuple[np.ndarray, np.ndarray]  # a (groups, out, r) and b (groups, r, in), F ~ a b
Truncation = Callable[[str, Layer, torch.Tensor, int], Factors]  # (layer name, layer, its weight, rank) -> factors
FactorSource = Union[Truncation, Mapping[str, Factors], None]  # None: the structure only (uninitialised factors)
Resolved = dict[str, tuple[Layer, int]]  # Layer.name -> (layer, rank)


def _tied_use(key: str, layers: dict[str, Layer]) -> Layer | None:
    """The layer whose tensor ``key`` (a parameter name, or its module's path) names under another name."""
    for layer in layers.values():
        for alias in layer.aliases:
            if key in (alias, alias.rpartition(".")[0]):
                return layer
    return None


def tied_message(key: str, layer: Layer, where: str = "plan") -> AuditError:
    """``key`` names a second use of ``layer``'s tensor (a tied weight): say which names share it and what to do."""
    names = ", ".join([layer.param, *layer.aliases])
    return AuditError(f"{where} {key!r} names a tied weight: one tensor with the names {names}, audited as layer "
                      f"{layer.name}; factorizing one use would untie it",
                      f"Leave it out of the plan, or untie the weights in the model first (the audit reviews the "
                      f"tensor as {layer.name!r}, LR006)")


def _unknown(key: str, layers: dict[str, Layer], named: dict[str, Layer]) -> AuditError:
    tied = _tied_use(key, layers)
    if tied is not None:
        return tied_message(key, tied)
    close = difflib.get_close_matches(key, list(named), n=3)
    return AuditError(f"plan names {key!r}, which is not a factorizable layer of the model",
                      f"Did you mean {', '.join(close)}?" if close else "Check the layer names in the audit")


def resolve_plan(model: nn.Module, plan: dict[str, int], layers: dict[str, Layer] | None = None) -> Resolved:
    """Plan entries (layer or parameter names -> rank) checked against the model: ``Layer.name -> (layer, rank)``."""
    if layers is None:
        layers = collect_layers(model, ParamTable.of(model))
    named = {layer.name: layer for layer in layers.values()}
    by_param = {layer.param: layer for layer in layers.values()}
    out: Resolved = {}
    for key, rank in plan.items():
        layer = named.get(key) or by_param.get(key)
        if layer is None:
            raise _unknown(key, layers, named)
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 1 <= int(rank) <= layer.max_rank:
            raise AuditError(f"plan rank {rank!r} for {layer.name} is not an integer in 1..{layer.max_rank}",
                             "Give a positive integer rank no larger than min(m, n)")
        out[layer.name] = (layer, int(rank))
    return out


def _dtype_of(layer: Layer, mod: nn.Module | None) -> str:
    w = getattr(mod, "weight", None) if mod is not None else None
    if isinstance(w, torch.Tensor):
        return str(w.dtype).removeprefix("torch.")
    return layer.dtype  # a quantized module's weight is a method; the layer table read its packed dtype


def check_dtype(name: str, layer: Layer, mod: nn.Module | None = None) -> None:
    """Refuse a layer whose weights are not real floating point: complex (the imaginary part would be dropped),
    quantized (packed integers and scales), integer, boolean or float8 (no factor could be stored in it)."""
    dtype = _dtype_of(layer, mod)
    quantized = dtype.startswith(("qint", "quint")) or (mod is not None and ".quantized" in type(mod).__module__)
    if dtype in FLOAT_DTYPES and not quantized:
        return
    if dtype.startswith("complex"):
        fix = "Leave it out of the plan: a complex map needs complex factors, which factorize() does not write"
        what = f"{name} has {dtype} (complex) weights; factorize() decomposes real weights only"
    elif quantized:
        fix = "Factorize the floating-point model before quantizing it, or leave the layer out of the plan"
        what = f"{name} is quantized ({dtype}); factorize() decomposes floating-point weights only"
    else:
        fix = "Cast the model to float32 (or float16, bfloat16) first, or leave the layer out of the plan"
        what = (f"{name} has {dtype} weights; factorize() decomposes floating-point weights "
                f"({', '.join(FLOAT_DTYPES)}) only")
    raise AuditError(what, fix)


def check_layers(model: nn.Module, resolved: Resolved) -> None:
    """Every planned layer can be rewritten: a supported module, real floating-point weights, not tied elsewhere."""
    for name, (layer, _) in resolved.items():
        mod = _module(model, layer)
        check_dtype(name, layer, mod)
        kind = kinds.for_kind(layer.kind)
        if mod is None or not kind.accepts(mod):
            why = f": {kind.cannot_factorize}" if kind.cannot_factorize else ""
            raise AuditError(f"factorize() rewrites {kinds.rewritable_labels()} layers; {name} is "
                             f"{layer.module_type} ({layer.kind}){why}", "Leave it out of the plan")
        others = [a for a in layer.aliases if model.get_submodule(a.rpartition(".")[0]) is not mod]
        if others:
            names = ", ".join([layer.param, *layer.aliases])
            raise AuditError(f"{name} shares its weight with {', '.join(others)} (one tensor with the names "
                             f"{names}): factorizing it at one use would untie it",
                             "Leave tied weights out of the plan, or untie them in the model first")


def _module(model: nn.Module, layer: Layer) -> nn.Module | None:
    if not kinds.for_kind(layer.kind).factorizable:
        return None
    try:
        return model.get_submodule(kinds.for_kind(layer.kind).module_path(layer)[0])
    except AttributeError:
        return None


def checked_plan(model: nn.Module, plan: dict[str, int], layers: dict[str, Layer] | None = None) -> Resolved:
    """:func:`resolve_plan`, then :func:`check_layers`: a plan every layer of which can be rewritten."""
    resolved = resolve_plan(model, plan, layers)
    check_layers(model, resolved)
    return resolved


def check_targets(model: nn.Module, patterns: list[str], layers: dict[str, Layer] | None = None) -> None:
    """Before any costly work: every layer a plan pattern matches can be factorized (:func:`check_layers`), and a
    pattern naming only a tied weight's second name says so. Patterns are matched as the plan review matches them
    (fnmatch on the layer or parameter name)."""
    if layers is None:
        layers = collect_layers(model, ParamTable.of(model))
    hit: Resolved = {}
    for pattern in patterns:
        matched = [l for l in layers.values()
                   if fnmatch.fnmatchcase(l.name, pattern) or fnmatch.fnmatchcase(l.param, pattern)]
        if not matched:
            tied = [l for l in layers.values() for a in l.aliases
                    if fnmatch.fnmatchcase(a, pattern) or fnmatch.fnmatchcase(a.rpartition(".")[0], pattern)]
            if tied:
                raise tied_message(pattern, tied[0], "plan pattern")
        hit.update((l.name, (l, 1)) for l in matched)
    check_layers(model, hit)


def _paths_of(model: nn.Module, mod: nn.Module) -> list[str]:
    return [p for p, m in model.named_modules(remove_duplicate=False) if m is mod]


def _set(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    owner._modules[child] = new


def _factors_of(source: FactorSource, name: str, layer: Layer, weight: torch.Tensor, r: int) -> Factors | None:
    if source is None:
        return None
    if callable(source):
        return source(name, layer, weight, r)
    return source[name]


def replace_layers(model: nn.Module, resolved: Resolved, factors: FactorSource = None, *,
                   share: bool = False, built: Callable[[str, nn.Module], None] | None = None) -> nn.Module:
    """A deep copy of ``model`` with each layer of a checked plan (:func:`checked_plan`) replaced by its kind's two
    modules, holding the factors ``factors`` gives (see the module docstring); ``model`` is left untouched.
    ``share``: the copy holds ``model``'s own parameters and buffers (only the new factors are allocated): for
    measuring a plan, never for a model that is trained or changed. ``built(layer name, replacement)`` is called
    as each replacement is in place, before the next layer's factors are made."""
    new = copy.deepcopy(model, {id(t): t for t in (*model.parameters(), *model.buffers())} if share else None)
    for name, (layer, r) in resolved.items():
        path, attr = kinds.for_kind(layer.kind).module_path(layer)
        old = new.get_submodule(path)
        ab = _factors_of(factors, name, layer, getattr(old, attr), r)
        a, b = ab if ab is not None else (None, None)
        replacement = kinds.for_kind(layer.kind).replace(layer, old, r, a, b)
        replacement.train(old.training)
        for p in _paths_of(new, old):  # a module reached by several paths is replaced at each
            _set(new, p, replacement)
        if built is not None:
            built(name, replacement)
    return new


def apply_plan(model: nn.Module, plan: dict[str, int], factors: FactorSource = None, *,
               layers: dict[str, Layer] | None = None, share: bool = False) -> nn.Module:
    """A deep copy of ``model`` with each planned layer (``{layer name: rank}``) replaced by two, holding
    ``factors``' factors (none: the structure only); ``model`` is left untouched. The plan is checked first.
    ``share``: see :func:`replace_layers`."""
    return replace_layers(model, checked_plan(model, plan, layers), factors, share=share)


def count_params(model: nn.Module) -> int:
    """Unique parameters (tied tensors once)."""
    return ParamTable.of(model).total
