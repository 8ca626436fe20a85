"""Find every factorizable weight of a module tree and describe it as a matrix view.

Module types are one table: a :class:`LayerSpec` per module type says which weights the module owns, how each is
viewed as ``groups`` matrices of m x n (and its :class:`~auditor.results.Kind`), and what one call costs given the
call's input and output shapes. :func:`collect_layers` and :func:`auditor.graph.module_costs` both read that table;
:func:`register_layer_spec` adds a user's own module type::

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
import math
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from .errors import AuditError
from .results import Kind, Layer

Shape = tuple[int, ...]


@dataclass(frozen=True)
class MatrixView:
    """How one stored weight is read as ``groups`` matrices of ``m`` x ``n``; ``view`` says it in words."""

    kind: Kind
    m: int
    n: int
    groups: int = 1
    view: str = "(out, in) as stored"


@dataclass(frozen=True)
class Cost:
    """What one call of a module costs for one of its weights (``param`` is the name local to the module)."""

    param: str
    op: str
    macs: int = 0  # multiply-accumulates by the weight
    lookups: int = 0  # rows gathered (embeddings)


@dataclass(frozen=True)
class LayerSpec:
    """How the auditor reads one module type.

    ``weights(mod)``: local names of the factorizable weights the module owns (attributes, possibly computed).
    ``view(mod, name, shape)``: the matrix view of one of them, from its stored shape.
    ``cost(mod, ins, out)``: the :class:`Cost` of one call for each weight, from the call's input shapes (None
    where unknown) and output shape; a weight read by the call but not costed here gets no use.
    ``tensor(mod, name)``: the weight itself (default ``getattr(mod, name)``; quantized modules call ``weight()``).
    """

    weights: Callable[[nn.Module], Iterable[str]]
    view: Callable[[nn.Module, str, Shape], MatrixView]
    cost: Callable[[nn.Module, list[Shape | None], Shape | None], list[Cost]]
    tensor: Callable[[nn.Module, str], torch.Tensor | None] = lambda mod, name: getattr(mod, name, None)


_SPECS: dict[type, LayerSpec] = {}
_USER_TYPES: set[type] = set()  # registered by users: traced as leaf modules, so their spec costs each call


def register_layer_spec(module_type: type, spec: LayerSpec | None) -> None:
    """Teach the auditor a module type (subclasses included, unless they have a spec of their own); None forgets it.

    Registering a type again replaces its spec; the most derived registered class in a module's MRO wins. A
    registered type is a leaf for ``torch.fx.symbolic_trace`` (its calls are costed by ``spec.cost``, its weights
    viewed by ``spec.view``); torch.export and the module walk see it as they see any module."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"register_layer_spec needs an nn.Module subclass, got {module_type!r}")
    if spec is None:
        _SPECS.pop(module_type, None)
        _USER_TYPES.discard(module_type)
    else:
        _SPECS[module_type] = spec
        _USER_TYPES.add(module_type)
    spec_for_type.cache_clear()


def is_user_leaf(mod: nn.Module) -> bool:
    """Whether the module's type (or a base) was registered with :func:`register_layer_spec`."""
    return any(base in _USER_TYPES for base in type(mod).__mro__)


@lru_cache(maxsize=None)
def spec_for_type(cls: type) -> LayerSpec | None:
    _register_hf_conv1d()
    for base in cls.__mro__:
        spec = _SPECS.get(base)
        if spec is not None:
            return spec
    return None


def spec_for(mod: nn.Module) -> LayerSpec | None:
    """The spec of the module's type (or of its nearest registered base class), None if it owns no weights we know."""
    return spec_for_type(type(mod))


# ---- the built-in module types ---------------------------------------------------------------------------------
def _only_weight(mod: nn.Module) -> tuple[str, ...]:
    """("weight",) if the module has one: a parameter, a parametrized weight or a hook-computed tensor. Reading
    a parametrized weight would compute it (and run spectral_norm's power iteration in training mode), so the
    presence is checked without reading it."""
    if parametrize.is_parametrized(mod, "weight"):
        return ("weight",)
    w = mod._parameters.get("weight", mod.__dict__.get("weight"))
    if not isinstance(w, torch.Tensor) or isinstance(w, nn.parameter.UninitializedParameter):
        return ()
    return ("weight",)


def _linear_view(mod: nn.Module, name: str, shape: Shape) -> MatrixView:
    return MatrixView(Kind.LINEAR, shape[0], shape[1])


def _linear_cost(mod: nn.Module, ins: list[Shape | None], out: Shape | None) -> list[Cost]:
    return [] if out is None else [Cost("weight", "linear", math.prod(out) * mod.in_features)]


def _conv1d_hf_view(mod: nn.Module, name: str, shape: Shape) -> MatrixView:
    i, o = shape
    return MatrixView(Kind.CONV1D_HF, o, i, 1, "stored (in, out); viewed transposed as (out, in)")


def _conv1d_hf_cost(mod: nn.Module, ins: list[Shape | None], out: Shape | None) -> list[Cost]:
    return [] if out is None else [Cost("weight", "linear", math.prod(out) * mod.weight.shape[0])]


def _conv_view(mod: nn.Module, name: str, shape: Shape) -> MatrixView:
    g = mod.groups
    k = math.prod(shape[2:])
    ks = "x".join(str(s) for s in shape[2:])
    if mod.transposed:
        cin, cout_g = shape[0], shape[1]
        m, n = cout_g, (cin // g) * k
        view = f"(in, out/g, {ks}) viewed as out/g x in/g*{ks} per group"
        kind = Kind.CONV_TRANSPOSE
    else:
        cout, cin_g = shape[0], shape[1]
        m, n = cout // g, cin_g * k
        view = f"(out, in/g, {ks}) viewed as out/g x in/g*{ks} per group"
        kind = Kind.CONV
    if g == 1:
        view = view.replace("/g", "").replace(" per group", "")
    return MatrixView(kind, m, n, g, view)


def _conv_cost(mod: nn.Module, ins: list[Shape | None], out: Shape | None) -> list[Cost]:
    x = ins[0] if ins else None
    kernel = math.prod(mod.kernel_size)
    if mod.transposed:  # weight (in, out/g, *kernel): each input element meets out/g * kernel weights
        k = mod.out_channels // mod.groups * kernel
        return [] if x is None else [Cost("weight", "conv_transpose", math.prod(x) * k)]
    k = mod.in_channels // mod.groups * kernel  # weight (out, in/g, *kernel)
    return [] if out is None else [Cost("weight", "conv", math.prod(out) * k)]


def _embedding_view(mod: nn.Module, name: str, shape: Shape) -> MatrixView:
    return MatrixView(Kind.EMBEDDING, shape[0], shape[1], 1, "(num_embeddings, dim) as stored")


def _embedding_cost(mod: nn.Module, ins: list[Shape | None], out: Shape | None) -> list[Cost]:
    x = ins[0] if ins else None
    return [] if x is None else [Cost("weight", "embedding", 0, math.prod(x))]


def _rnn_weights(mod: nn.Module) -> list[str]:
    return [n for n, p in mod.named_parameters(recurse=False) if p.dim() == 2]


def _rnn_view(mod: nn.Module, name: str, shape: Shape) -> MatrixView:
    gates = {"LSTM": 4, "GRU": 3}.get(mod.mode, 1)
    return MatrixView(Kind.RNN, shape[0], shape[1], 1, f"{gates} gate matrices stacked: ({gates}*hidden, in)")


def _rnn_cost(mod: nn.Module, ins: list[Shape | None], out: Shape | None) -> list[Cost]:
    x = ins[0] if ins else None
    if x is None:
        return []
    positions = math.prod(x) // x[-1]
    return [Cost(n, mod.mode.lower(), positions * p.numel())
            for n, p in mod.named_parameters(recurse=False) if p.dim() == 2]


_MHA_WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")


def _mha_weights(mod: nn.Module) -> list[str]:
    return [n for n in _MHA_WEIGHTS if getattr(mod, n, None) is not None]


def _mha_view(mod: nn.Module, name: str, shape: Shape) -> MatrixView:
    view = "q, k, v stacked: (3*embed, embed)" if name == "in_proj_weight" else "(embed, kdim) as stored"
    return MatrixView(Kind.MHA_IN_PROJ, shape[0], shape[1], 1, view)


def _mha_cost(mod: nn.Module, ins: list[Shape | None], out: Shape | None) -> list[Cost]:
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


def _call_weight(mod: nn.Module, name: str) -> torch.Tensor | None:
    w = getattr(mod, name, None)
    return w() if callable(w) else w


LINEAR_SPEC = LayerSpec(_only_weight, _linear_view, _linear_cost)
CONV_SPEC = LayerSpec(_only_weight, _conv_view, _conv_cost)

for _type, _spec in (
    (nn.Linear, LINEAR_SPEC),
    (nn.modules.conv._ConvNd, CONV_SPEC),
    (nn.Embedding, LayerSpec(_only_weight, _embedding_view, _embedding_cost)),
    (nn.EmbeddingBag, LayerSpec(_only_weight, _embedding_view, _embedding_cost)),
    (nn.RNNBase, LayerSpec(_rnn_weights, _rnn_view, _rnn_cost)),
    (nn.MultiheadAttention, LayerSpec(_mha_weights, _mha_view, _mha_cost)),
    # quantized modules keep their weight packed and hand it out by a call: listed, counted, spectra skipped
    (torch.ao.nn.quantized.Linear, LayerSpec(lambda m: ("weight",), _linear_view, _linear_cost, _call_weight)),
    (torch.ao.nn.quantized.modules.conv._ConvNd, LayerSpec(lambda m: ("weight",), _conv_view, _conv_cost,
                                                           _call_weight)),
):
    _SPECS[_type] = _spec


def _register_hf_conv1d() -> None:
    """transformers' Conv1D, only once transformers is imported (importing it costs seconds)."""
    conv1d = hf_conv1d_type()
    if conv1d is not None and conv1d not in _SPECS:
        _SPECS[conv1d] = LayerSpec(_only_weight, _conv1d_hf_view, _conv1d_hf_cost)
        spec_for_type.cache_clear()


def hf_conv1d_type() -> type | None:
    """transformers' ``Conv1D`` (a linear layer stored (in, out)) when transformers is already imported, else None."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:  # pragma: no cover - very old or broken transformers
        return None
    return Conv1D


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
        full = _join(path, local)
        if full in self.canonical:
            return
        stored = _stored_params(mod, local)
        if stored is not None:
            value = _effective(mod, local)
            if value is None:
                return
            canon = [self.canonical[_join(path, s)] for s in stored if _join(path, s) in self.canonical]
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
            cpath = _join(path, name)
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
        return [_join(prefix, n) for n, _ in mod.parametrizations[local].named_parameters()]
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


def _join(prefix: str, name: str) -> str:
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
        canon = table.canonical.get(_join(path, local))
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
            name = table.site(path) if pname == "weight" else _join(path, pname)
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


def _conv_transpose_matrices(t: torch.Tensor, g: int, m: int, n: int) -> torch.Tensor:
    k = math.prod(t.shape[2:])
    cin_g = t.shape[0] // g
    return t.reshape(g, cin_g, m, k).permute(0, 2, 1, 3).reshape(g, m, n)


# How a stored tensor of each kind becomes (groups, m, n); kinds not listed reshape as stored.
MATRICES_OF_KIND: dict[Kind, Callable[[torch.Tensor, int, int, int], torch.Tensor]] = {
    Kind.CONV_TRANSPOSE: _conv_transpose_matrices,
    Kind.CONV1D_HF: lambda t, g, m, n: t.t().reshape(1, m, n),
}


def matrix_view(layer: Layer, t: torch.Tensor) -> torch.Tensor:
    """The tensor as ``groups`` matrices of m x n (singular values do not depend on transposition)."""
    g, m, n = layer.groups, layer.m, layer.n
    f = MATRICES_OF_KIND.get(layer.kind)
    return f(t, g, m, n) if f is not None else t.reshape(g, m, n)


def spec_types() -> Sequence[type]:
    """The module types with a spec, built-in and registered (transformers' Conv1D once transformers is loaded)."""
    _register_hf_conv1d()
    return tuple(_SPECS)
