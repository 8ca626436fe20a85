"""Find every factorizable weight of a module tree and describe it as a matrix view.

Module types are one table, kept by :mod:`auditor.kinds` (each kind module lists the types it finds): a
:class:`LayerSpec` per module type says which weights the module owns, how each is viewed as ``groups`` matrices of
m x n (and its kind), and what one call costs given the call's input and output shapes. :func:`collect_layers` and
:func:`auditor.structure.graph.module_costs` both read that table; :func:`register_layer_spec` adds a user's own module type
whose weights are plain matrices (a kind with statistics, sweeps and a replacement is a
:class:`auditor.kinds.LayerKind`)::

    register_layer_spec(LowRankLinear, LayerSpec(
        weights=lambda mod: ("u", "v"),
        view=lambda mod, name, shape: MatrixView(Kind.MATMUL, shape[0], shape[1]),
        cost=lambda mod, ins, out: [Cost("u", "matmul", math.prod(out) * mod.rank),
                                    Cost("v", "matmul", math.prod(out[:-1]) * mod.rank * mod.in_features)]))

Tied or shared tensors (GPT-2's lm_head and wte, ALBERT's shared layers) are one record keyed by tensor identity,
with every other name listed as an alias; parameters are counted once.

A weight under ``torch.nn.utils.parametrize`` (``parametrizations.weight_norm``, ``spectral_norm``, ...) or under
the older ``weight_norm`` / ``spectral_norm`` hooks is audited as its effective weight, the matrix the module
multiplies by, under the module's name (``<module>.weight``); the parameters actually stored (``weight_g``,
``weight_v``, ``parametrizations.weight.original``, ...) are what the model's parameter count holds.

A weight owned by the root module itself (the model *is* an ``nn.Linear``) is named after the root's class
(``Linear``), since its module path is empty.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from ..errors import AuditError
from ..kinds import registry
from ..kinds.base import Cost, LayerSpec, MatrixView, Shape
from ..kinds.hf_conv1d import hf_conv1d_type
from ..kinds.registry import is_user_leaf, spec_types
from ..results import Kind, Layer


def register_layer_spec(module_type: type, spec: LayerSpec | None) -> None:
    """Teach the auditor a module type (subclasses included, unless they have a spec of their own); None forgets it.

    Registering a type again replaces its spec; the most derived registered class in a module's MRO wins. A
    registered type is a leaf for ``torch.fx.symbolic_trace`` (its calls are costed by ``spec.cost``, its weights
    viewed by ``spec.view``); torch.export and the module walk see it as they see any module. The kind of each weight
    is what its view says (``Kind.MATMUL`` for a weight with no behaviour of its own); a kind that also reads
    statistics, sweeps and factorizes is a :class:`auditor.kinds.LayerKind` given to :func:`auditor.kinds.register`."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"register_layer_spec needs an nn.Module subclass, got {module_type!r}")
    if spec is None:
        registry.remove_type(module_type)
    else:
        registry.add_type(module_type, spec, None, user=True)


def spec_for_type(cls: type) -> LayerSpec | None:
    return registry.spec_for_type(cls)


def spec_for(mod: nn.Module) -> LayerSpec | None:
    """The spec of the module's type (or of its nearest registered base class), None if it owns no weights we know."""
    return registry.spec_for_type(type(mod))


# ---- the parameter table -----------------------------------------------------------------------------------------
@dataclass
class ParamTable:
    """Every unique parameter tensor of a model, by identity, with all of its names; plus the weights a module
    computes (parametrized, weight-normed) or keeps outside its parameters (quantized, packed)."""

    names: dict[Any, list[str]] = field(default_factory=dict)  # storage key -> names, first = canonical
    tensors: dict[Any, torch.Tensor] = field(default_factory=dict)
    canonical: dict[str, str] = field(default_factory=dict)  # any name -> canonical name
    keys: dict[str, Any] = field(default_factory=dict)  # canonical name -> storage key
    computed: dict[str, torch.Tensor] = field(default_factory=dict)  # effective weight name -> its value
    stored_as: dict[str, list[str]] = field(default_factory=dict)  # effective weight -> canonical stored params
    derived_of: dict[str, str] = field(default_factory=dict)  # stored canonical param -> effective weight name
    packed: dict[str, torch.Tensor] = field(default_factory=dict)  # non-parameter weights that hold storage
    skipped: dict[str, str] = field(default_factory=dict)  # weight name -> why it is not a layer
    root_name: str = "model"  # the name of the root module when it owns a weight itself

    @classmethod
    def of(cls, model: nn.Module) -> "ParamTable":
        """Raises :class:`AuditError` on a module cycle or on uninitialized (lazy) parameters."""
        check_tree(model)
        table = cls(root_name=_orig_class(model).__name__)
        for name, p in model.named_parameters(remove_duplicate=False):
            if isinstance(p, nn.parameter.UninitializedParameter):
                raise AuditError(
                    f"parameter {name!r} is not initialized yet (a lazy module such as LazyLinear)",
                    "Run the model once on an example input before auditing, so lazy modules get their shapes",
                )
            key = _storage_key(p)
            if key not in table.names:
                table.names[key] = []
                table.tensors[key] = p
                table.keys[name] = key
            table.names[key].append(name)
            table.canonical[name] = table.names[key][0]
        for path, mod in model.named_modules():
            spec = spec_for(mod)
            if spec is not None:
                for local in spec.weights(mod):
                    table._adopt(path, mod, local, spec)
        return table

    def _adopt(self, path: str, mod: nn.Module, local: str, spec: LayerSpec) -> None:
        """Record a weight the module owns that is not itself a parameter: effective or packed."""
        full = join_path(path, local)
        if full in self.canonical:
            return
        stored = _stored_params(mod, local)
        if stored is not None:
            value = _effective(mod, local)
            if value is None:
                return
            canon = [self.canonical[join_path(path, s)] for s in stored if join_path(path, s) in self.canonical]
            self.computed[full] = value
            self.stored_as[full] = canon
            for c in canon:
                self.derived_of[c] = full
            self.canonical[full] = full
            return
        t = spec.tensor(mod, local)
        if isinstance(t, torch.Tensor) and t.is_quantized:
            self.packed[full] = t
            self.canonical[full] = full

    @property
    def total(self) -> int:
        """Unique stored elements: parameters and packed (quantized) weights; effective weights are not stored."""
        return sum(t.numel() for t in self.tensors.values()) + sum(t.numel() for t in self.packed.values())

    def tensor(self, name: str) -> torch.Tensor:
        if name in self.computed:
            return self.computed[name]
        if name in self.packed:
            return self.packed[name]
        return self.tensors[self.keys[self.canonical[name]]]

    def names_of(self, name: str) -> list[str]:
        """Every name of the tensor, the canonical one first."""
        if name in self.computed or name in self.packed:
            return [name]
        return self.names[self.keys[self.canonical[name]]]

    def site(self, path: str) -> str:
        """A module path as a name: the root module's empty path becomes :attr:`root_name`."""
        return path or self.root_name

    @property
    def notes(self) -> list[str]:
        """One line per weight that was found but not made a layer, saying why."""
        return [f"Skipped {name}: {why}." for name, why in self.skipped.items()]


def _storage_key(p: torch.Tensor) -> Any:
    """What makes two parameters one tensor: the same object, or two Parameter objects viewing the same bytes of one
    storage (same offset, shape, stride and dtype: ``b.weight = nn.Parameter(a.weight.data)``). Meta and empty
    tensors have no storage to compare and are keyed by identity."""
    if p.device.type == "meta" or p.numel() == 0 or p.layout != torch.strided:
        return id(p)
    try:
        ptr = p.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
        return id(p)
    if not ptr:
        return id(p)
    return (p.device.type, p.device.index, ptr, p.storage_offset(), tuple(p.shape), p.stride(), p.dtype)


def check_tree(model: nn.Module) -> None:
    """Refuse a module tree with a cycle (a module registered as its own descendant): torch would recurse forever
    in ``eval()``, ``named_modules`` would silently hide it. Call before anything else touches the model."""
    on_path: set[int] = set()
    done: set[int] = set()
    stack: list[tuple[str, nn.Module, Iterable]] = [("", model, iter(model._modules.items()))]
    on_path.add(id(model))
    while stack:
        path, mod, children = stack[-1]
        for name, child in children:
            if child is None:
                continue
            cpath = join_path(path, name)
            if id(child) in on_path:
                raise AuditError(
                    f"module {cpath!r} ({type(child).__name__}) is registered inside itself: the module tree has "
                    "a cycle",
                    "Register each submodule under a parent that is not one of its own descendants",
                )
            if id(child) not in done:
                on_path.add(id(child))
                stack.append((cpath, child, iter(child._modules.items())))
                break
        else:
            stack.pop()
            on_path.discard(id(mod))
            done.add(id(mod))


def _stored_params(mod: nn.Module, local: str) -> list[str] | None:
    """Local names of the parameters a computed weight is made from, or None if the weight is not computed."""
    if parametrize.is_parametrized(mod, local):
        prefix = f"parametrizations.{local}"
        return [join_path(prefix, n) for n, _ in mod.parametrizations[local].named_parameters()]
    for hook in mod._forward_pre_hooks.values():
        if isinstance(hook, WeightNorm) and hook.name == local:
            return [f"{local}_g", f"{local}_v"]
        if isinstance(hook, SpectralNorm) and hook.name == local:
            return [f"{local}_orig"]
    return None


def _effective(mod: nn.Module, local: str) -> torch.Tensor | None:
    """The weight the module multiplies by, computed once in eval mode (no power iteration, no buffer updates)."""
    with torch.no_grad():
        if parametrize.is_parametrized(mod, local):
            plist = mod.parametrizations[local]
            modes = [(m, m.training) for m in plist.modules()]
            for m, _ in modes:
                m.training = False
            try:
                value = getattr(mod, local)
            finally:
                for m, was in modes:
                    m.training = was
            return value.detach()
        for hook in mod._forward_pre_hooks.values():
            if isinstance(hook, WeightNorm) and hook.name == local:
                return hook.compute_weight(mod).detach()
            if isinstance(hook, SpectralNorm) and hook.name == local:
                return hook.compute_weight(mod, do_power_iteration=False).detach()
    return None


def _orig_class(mod: nn.Module) -> type:
    """The user's class: parametrize swaps in a generated subclass (ParametrizedLinear) that names nothing."""
    cls = type(mod)
    if parametrize.is_parametrized(mod) and cls.__module__ == parametrize.__name__ and len(cls.__bases__) == 1:
        return cls.__bases__[0]
    return cls


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
    return _class_source(_orig_class(mod))


def join_path(prefix: str, name: str) -> str:
    """A dotted module or parameter path: ``name`` under ``prefix`` (``name`` itself at the top)."""
    return f"{prefix}.{name}" if prefix else name


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def storage_skip_reason(t: torch.Tensor) -> str | None:
    """Why a weight's values cannot be read as a dense float matrix (float8, sparse, quantized), or None."""
    if t.is_quantized:
        return f"quantized ({_dtype(t)}): dequantize before a spectral audit"
    if t.layout != torch.strided:
        return f"stored {str(t.layout).replace('torch.', '')}: densify before a spectral audit"
    if t.dtype.is_floating_point and t.dtype.itemsize == 1:
        return f"{_dtype(t)} storage: upcast to float32 or bfloat16 before a spectral audit"
    return None


def module_weights(path: str, mod: nn.Module, table: ParamTable) -> list[tuple[str, str, MatrixView]]:
    """(local name, canonical name, matrix view) for each factorizable weight owned directly by ``mod``; the
    shapes come from the table, so a computed weight is never computed twice."""
    spec = spec_for(mod)
    if spec is None:
        return []
    out = []
    for local in spec.weights(mod):
        canon = table.canonical.get(join_path(path, local))
        if canon is None:
            continue  # not a parameter, nor a weight the table adopted (a buffer, say)
        t = table.tensor(canon)
        if t.dim() < 2:
            continue
        out.append((local, canon, spec.view(mod, local, tuple(t.shape))))
    return out


def collect_layers(model: nn.Module, table: ParamTable) -> dict[str, Layer]:
    """Layer records keyed by canonical parameter name, in module order. A weight with a zero-sized side is left
    out and recorded in ``table.skipped`` (see :attr:`ParamTable.notes`)."""
    layers: dict[str, Layer] = {}
    for path, mod in model.named_modules():
        for pname, canon, v in module_weights(path, mod, table):
            if canon in layers or canon in table.skipped:
                continue  # a tied tensor already recorded under its first name
            t = table.tensor(canon)
            kind, m, n, g, view = v.kind, v.m, v.n, v.groups, v.view
            if m * n * g == 0:
                table.skipped[canon] = f"zero-sized weight {tuple(t.shape)}, nothing to factorize"
                continue
            if canon in table.computed:
                stored = ", ".join(table.stored_as[canon]) or "no parameters"
                view = f"{view}; the effective weight, stored as {stored}"
            name = table.site(path) if pname == "weight" else join_path(path, pname)
            layers[canon] = Layer(
                name=name,
                param=canon,
                kind=kind,
                module_type=_orig_class(mod).__name__,
                shape=tuple(t.shape),
                m=m,
                n=n,
                groups=g,
                view=view,
                dtype=_dtype(t),
                aliases=table.names_of(canon)[1:],
                source=_source(mod),
            )
    return layers


def layer_for_graph_param(canon: str, t: torch.Tensor, op: str, aliases: list[str]) -> Layer | None:
    """A record for a 2-D parameter used directly by a matmul-like op in the graph, with no module we know."""
    if t.dim() != 2 or 0 in t.shape:
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
    return registry.for_kind(layer.kind).matrices(t, layer.groups, layer.m, layer.n)


__all__ = ["Cost", "LayerSpec", "MatrixView", "ParamTable", "Shape", "collect_layers", "hf_conv1d_type",
           "is_user_leaf", "join_path", "matrix_view", "module_weights", "register_layer_spec", "spec_for", "spec_types"]
