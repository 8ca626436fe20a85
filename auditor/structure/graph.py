"""The layer graph and MACs, read off the traced fx graph.

Each fx node that reads a parameter through a weight op (linear, matmul, einsum, conv, embedding, recurrent) becomes
a use of that weight, with MACs from the shapes seen in the graph. What an op costs is looked up in one table,
``{op name: handle}`` (an :class:`OpTable`); users extend the default table with :func:`set_op_handle`, and each
audit builds its graph with a copy of it (:func:`default_ops`), so a handle set while an audit runs does not change
it halfway. An op that reads a layer's weight and has no handle (or whose handle cannot cost the call) is counted in
``GraphResult.unsupported``, never silently as zero. A module call is costed by its
:class:`~auditor.kinds.base.LayerSpec`.

:func:`build` reads the layer records it is given and returns new ones (uses, call counts, MACs filled in, and the
2-D parameters multiplied by no known module added as ``Kind.MATMUL`` layers), with the chained linear pairs.

The networkx graph keeps weight ops, activations and the other ops that matter, and collapses shape-only ops (view,
transpose, dropout, ...), so edges follow data flow between the nodes a reviewer cares about. A node is a module
(or an op outside any leaf module) and knows how often it runs. The module walk (no tracer worked) has no data flow:
its edges follow call order, and ``GraphResult.data_flow`` is False so that no rule reads a chain into them.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import networkx as nx
import torch
from torch import nn

from .. import kinds
from .layers import Cost, ParamTable, Shape, join_path, layer_for_graph_param, spec_for
from ..results import Layer, Use
from .trace import Method, TraceResult

# Ops that only move, reshape or copy data (or drop it out at eval time): collapsed in the layer graph, and a
# parameter seen through them is still that parameter.
PASS_THROUGH = frozenset(
    """view reshape _unsafe_view transpose t permute flatten unflatten unsqueeze squeeze contiguous clone dropout
    alias to _to_copy type_as float half bfloat16 double detach expand expand_as getitem split split_with_sizes chunk
    slice select size _assert_tensor_metadata lift_fresh_copy identity feature_dropout native_dropout
    """.split()
)
PASS_THROUGH_MODULES = (nn.Dropout, nn.Identity, nn.Flatten, nn.Unflatten)
NONLINEAR = frozenset(
    """relu relu_ gelu silu sigmoid tanh softmax log_softmax elu leaky_relu hardtanh hardswish hardsigmoid mish
    softplus glu pow exp erf celu selu prelu relu6 silu_ gelu_ sin cos layer_norm group_norm batch_norm rms_norm
    native_layer_norm scaled_dot_product_attention max_pool2d avg_pool2d adaptive_avg_pool2d max_pool1d
    """.split()
)
SCALING = frozenset({"mul", "div", "add", "sub", "truediv", "neg"})
# ops that read a parameter without multiplying by it as a matrix (positional tables added, tokens concatenated)
ELEMENTWISE = SCALING | frozenset({"add_", "mul_", "cat", "stack", "where", "index_select", "gather", "expand",
                                   "repeat", "sum", "mean", "norm", "layer_norm", "rms_norm", "group_norm"})


# ---- op costs: one table ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpCall:
    """One call of an op that reads at least one weight, as a cost handle sees it.

    ``inputs``: the positional arguments, then the keyword values, each a shape (tuple) for a tensor (None where
    unknown), a list of those for a list argument, or the constant itself (an einsum equation, a flag).
    ``weights``: position in ``inputs`` (or ``(position, index)`` inside a list argument) -> canonical weight name.
    ``out``: the output's shape (None for a tuple output or where unknown).
    """

    op: str
    inputs: tuple[Any, ...]
    out: Shape | None
    weights: dict[int | tuple[int, int], str]

    def shape(self, key: int | tuple[int, int]) -> Shape | None:
        v: Any = self.inputs
        for i in (key,) if isinstance(key, int) else key:
            if not isinstance(v, (list, tuple)) or i >= len(v):
                return None
            v = v[i]
        return v if isinstance(v, tuple) and all(isinstance(s, int) for s in v) else None


# A handle returns one Cost per weight it costs (Cost.param = the canonical name), or None when it cannot cost the
# call (then the op is listed in GraphResult.unsupported and its weights get a use with no MACs).
OpHandle = Callable[[OpCall], "list[Cost] | None"]



def op_key(name: str) -> str:
    """``aten::einsum``, ``aten::einsum.default``, ``einsum`` -> ``einsum``: the name the graph reports."""
    return name.split("::")[-1].split(".")[0]


@dataclass
class OpTable:
    """Op name -> cost handle, and the ops whose 2-D weights become layers when no module spec claims them.

    >>> t = OpTable()
    >>> t.set("aten::tensordot", lambda call: None, matrix=False)
    >>> ("tensordot" in t, "tensordot" in t.matrix_ops, "tensordot" in t.copy())
    (True, False, True)
    """

    handles: dict[str, OpHandle] = field(default_factory=dict)
    matrix_ops: set[str] = field(default_factory=set)

    def set(self, op: str, handle: OpHandle | None, *, matrix: bool = True) -> None:
        """Cost ``op`` with ``handle`` (None removes it); ``matrix``: see :func:`set_op_handle`."""
        key = op_key(op)
        self.matrix_ops.discard(key)
        if handle is None:
            self.handles.pop(key, None)
            return
        self.handles[key] = handle
        if matrix:
            self.matrix_ops.add(key)

    def copy(self) -> "OpTable":
        return OpTable(dict(self.handles), set(self.matrix_ops))

    def __contains__(self, op: object) -> bool:
        return op in self.handles


DEFAULT_OPS = OpTable()  # the built-in handles and the users' own (set_op_handle); each audit copies it


def set_op_handle(op: str, handle: OpHandle | None, *, matrix: bool = True) -> None:
    """Cost op ``op`` (``"aten::einsum"``, ``"einsum"``, ...) with ``handle`` in every audit started afterwards;
    None removes the op's handle.

    ``matrix``: a 2-D parameter this op reads, owned by no module with a spec, is a factorizable layer
    (``Kind.MATMUL``), as for ``x @ W``."""
    DEFAULT_OPS.set(op, handle, matrix=matrix)


def op_handles() -> dict[str, OpHandle]:
    """A copy of the default op table's handles."""
    return dict(DEFAULT_OPS.handles)


def default_ops() -> OpTable:
    """A copy of the default op table: the one table an audit's graph is built with."""
    return DEFAULT_OPS.copy()


def _each_weight(call: OpCall, macs_of: Callable[[int | tuple[int, int], Shape, Shape], int]) -> list[Cost] | None:
    """Apply ``macs_of(key, weight shape, out shape)`` to every weight; None if a shape is unknown."""
    if call.out is None:
        return None
    res = []
    for key, canon in call.weights.items():
        w = call.shape(key)
        if w is None:
            return None
        res.append(Cost(canon, call.op, macs_of(key, w, call.out)))
    return res


def _linear(call: OpCall) -> list[Cost] | None:
    return _each_weight(call, lambda i, w, out: math.prod(out) * w[-1])


def _addmm(call: OpCall) -> list[Cost] | None:  # addmm(bias, a, b), baddbmm(bias, a, b)
    return _each_weight(call, lambda i, w, out: math.prod(out) * (w[-2] if i == 2 else w[-1]))


def _matmul(call: OpCall) -> list[Cost] | None:  # the weight on the right contracts its rows
    return _each_weight(call, lambda i, w, out: math.prod(out) * (w[-2] if i == 1 and len(w) >= 2 else w[-1]))


def _conv(call: OpCall) -> list[Cost] | None:
    transposed = call.op.startswith("conv_transpose") or (
        call.op in ("convolution", "_convolution") and len(call.inputs) > 6 and bool(call.inputs[6])
    )
    x = call.shape(0)
    if transposed and x is None:
        return None
    # per output position (per input position when transposed): every weight of one output (input) channel
    return _each_weight(call, lambda i, w, out: (math.prod(x) if transposed else math.prod(out)) * math.prod(w[1:]))


def _embedding(call: OpCall) -> list[Cost] | None:
    res = []
    for key, canon in call.weights.items():
        idx = call.shape(1 if key == 0 else 0)  # F.embedding(ids, weight); aten.embedding(weight, ids)
        if idx is None:
            return None
        res.append(Cost(canon, call.op, 0, math.prod(idx)))
    return res


def _rnn(call: OpCall) -> list[Cost] | None:
    x = call.shape(0)
    if x is None:
        return None
    positions = math.prod(x) // x[-1]
    res = []
    for key, canon in call.weights.items():
        s = call.shape(key)
        if s is not None and len(s) == 2:  # the gate matrices; biases are not layers
            res.append(Cost(canon, call.op, positions * math.prod(s)))
    return res


def einsum_macs(equation: str, shapes: list[Shape]) -> int | None:
    """Multiply-adds of a two-operand einsum: every output element sums over the contracted letters. None for
    other operand counts (the cost then depends on the contraction order)."""
    if len(shapes) != 2:
        return None
    eq = equation.replace(" ", "")
    lhs, _, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != 2:
        return None
    sizes: dict[str, int] = {}
    for term, shape in zip(terms, shapes):
        letters = term.replace("...", "")
        explicit = shape[len(shape) - len(letters):] if "..." in term else shape
        if len(explicit) != len(letters):
            return None
        sizes.update(zip(letters, explicit))
    if "->" not in eq:  # implicit output: the letters seen once
        rhs = "".join(sorted(c for c in sizes if lhs.count(c) == 1))
    contracted = [c for c in sizes if c not in rhs]
    return math.prod(sizes[c] for c in contracted)


def _einsum(call: OpCall) -> list[Cost] | None:
    if call.out is None or not call.inputs or not isinstance(call.inputs[0], str):
        return None
    operands = call.inputs[1:]
    if len(operands) == 1 and isinstance(operands[0], list):  # einsum(eq, [a, b])
        operands = tuple(operands[0])
    shapes = [s for s in operands if isinstance(s, tuple)]
    if len(shapes) != len(operands):
        return None
    per_out = einsum_macs(call.inputs[0], shapes)
    if per_out is None:
        return None
    return [Cost(canon, call.op, math.prod(call.out) * per_out) for canon in call.weights.values()]


for _ops, _handle, _matrix in (
    (("linear",), _linear, True),
    (("addmm", "baddbmm"), _addmm, True),
    (("mm", "matmul", "bmm", "__matmul__"), _matmul, True),
    (("einsum",), _einsum, True),
    (("conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d", "conv_transpose2d",
      "conv_transpose3d"), _conv, False),
    (("embedding", "embedding_bag", "_embedding_bag"), _embedding, False),
    (("lstm", "gru", "rnn_tanh", "rnn_relu"), _rnn, False),
):
    for _op in _ops:
        DEFAULT_OPS.set(_op, _handle, matrix=_matrix)


# ---- fx helpers ---------------------------------------------------------------------------------------------------
def op_name(node: torch.fx.Node) -> str:
    t = node.target
    if node.op == "call_method":
        return str(t)
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    if t is operator.matmul:
        return "matmul"
    return getattr(t, "__name__", str(t))


def _meta_shape(node: Any) -> tuple[int, ...] | None:
    if not isinstance(node, torch.fx.Node):
        return None
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        try:
            return tuple(int(s) for s in val.shape)
        except TypeError:  # symbolic sizes
            return None
    tm = node.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "shape"):
        return tuple(int(s) for s in tm.shape)
    return None


def _site(node: torch.fx.Node, fallback: str) -> str:
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        path = re.sub(r"@\d+$", "", str(path))
        # strict export may prefix paths as L['self'].a.b; keep the dotted tail
        path = re.sub(r"^L\['self'\]\.?", "", path)
        return path
    return fallback


def _call_index(node: torch.fx.Node) -> int:
    """Which call of its innermost module this node belongs to (torch.export marks repeats as key@N)."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        m = re.search(r"@(\d+)$", str(list(stack.keys())[-1]))
        if m:
            return int(m.group(1))
    return 0


def _per_call(path: str, idx: int) -> str:
    """A parameterless module (an activation) called several times is one graph node per call, so the graph
    keeps the data flow instead of folding every use into a cycle."""
    return path if idx == 0 else f"{path}@{idx}"


@dataclass
class GraphResult:
    """The layer graph and what could not be costed. Plain data beside the networkx graph."""

    graph: nx.DiGraph
    unsupported: dict[str, int] = field(default_factory=dict)  # op name -> count of weight reads not costed
    macs_known: bool = False
    data_flow: bool = True  # False for the module walk: edges follow call order, not data
    chains: list[tuple[str, str]] = field(default_factory=list)  # chained linear maps; empty without data flow
    layers: dict[str, Layer] = field(default_factory=dict)  # new records: the given layers with uses and MACs


class _Collector:
    """What the graph adds to each layer, kept apart from the records it was given: uses by (site, op) with their
    call counts, linear MACs and lookups; plus the layers found only in the graph (bare 2-D parameters)."""

    def __init__(self, table: ParamTable, layers: dict[str, Layer], ops: OpTable):
        self.table = table
        self.layers = dict(layers)  # the given records (read, never changed) and the graph's own, in order
        self.ops = ops
        self.unsupported: dict[str, int] = {}
        self.uses: dict[str, dict[tuple[str, str], int]] = {
            k: {(u.site, u.op): u.calls for u in l.uses} for k, l in layers.items()}
        self.macs_linear = {k: l.macs_linear for k, l in layers.items()}
        self.lookups = {k: l.lookups for k, l in layers.items()}

    def add(self, canon: str, site: str, op: str, macs_linear: int, lookups: int) -> Layer | None:
        site = self.table.site(site)
        layer = self.layers.get(canon)
        if layer is None:
            if op not in self.ops.matrix_ops or canon in self.table.skipped:
                return None
            names = self.table.names_of(canon)
            layer = layer_for_graph_param(canon, self.table.tensor(canon), op, names[1:])
            if layer is None:
                return None
            self.layers[canon] = layer
            self.uses[canon] = {(u.site, u.op): u.calls for u in layer.uses}
            self.macs_linear[canon], self.lookups[canon] = layer.macs_linear, layer.lookups
        uses = self.uses[canon]
        uses[(site, op)] = uses.get((site, op), 0) + 1
        self.macs_linear[canon] += macs_linear
        self.lookups[canon] += lookups
        return layer

    def records(self, macs_known: bool) -> dict[str, Layer]:
        """New layer records: each given (or found) layer with its uses, MACs and lookups."""
        out = {}
        for k, l in self.layers.items():
            uses = [Use(site=s, op=o, calls=n) for (s, o), n in self.uses[k].items()]
            ml, lk = (self.macs_linear[k], self.lookups[k]) if macs_known else (0, 0)
            out[k] = replace(l, uses=uses, aliases=list(l.aliases), macs=ml if macs_known else None, macs_linear=ml,
                             lookups=lk)
        return out

    def add_module_call(self, path: str, mod: nn.Module, ins: list, out: tuple | None) -> bool:
        """Record one call of a leaf module as a use of each weight it owns; True if it owns any."""
        costs = module_costs(mod, ins, out)
        for c in costs:
            canon = self.table.canonical.get(join_path(path, c.param))
            if canon:
                self.add(canon, path, c.op, c.macs, c.lookups)
        return bool(costs)

    def unsupported_op(self, op: str) -> None:
        self.unsupported[op] = self.unsupported.get(op, 0) + 1


def _owner(param: str) -> str:
    return param.rsplit(".", 1)[0] if "." in param else ""


def module_costs(mod: nn.Module, ins: list, out: tuple | None) -> list[Cost]:
    """One :class:`Cost` (local param name, op, MACs, lookups) per weight for one call of a leaf module, from the
    module's :class:`~auditor.structure.layers.LayerSpec` and the call's shapes."""
    spec = spec_for(mod)
    return [] if spec is None else spec.cost(mod, ins, out)


def build(trace: TraceResult, model: nn.Module, table: ParamTable, layers: dict[str, Layer],
          ops: OpTable | None = None) -> GraphResult:
    """The layer graph of a trace, costed with ``ops`` (a copy of the default table when None). ``layers`` is only
    read: ``GraphResult.layers`` holds new records with the uses and MACs, plus the 2-D parameters multiplied by no
    known module as ``Kind.MATMUL`` layers; the chained linear pairs are computed here, once."""
    col = _Collector(table, layers, ops if ops is not None else default_ops())
    data_flow = trace.method != Method.WALK
    if data_flow:
        g = _FxGraphBuilder(trace, model, col).run()
    else:
        g = _walk_graph(trace, model, col)
    g.graph["data_flow"] = data_flow
    macs_known = trace.has_shapes
    records = col.records(macs_known)
    chains = chained_linear_pairs(g, records) if data_flow else []
    return GraphResult(g, col.unsupported, macs_known, data_flow, chains, records)


def _walk_graph(trace: TraceResult, model: nn.Module, col: _Collector) -> nx.DiGraph:
    g = nx.DiGraph(method=str(trace.method))
    modules = dict(model.named_modules())
    site = col.table.site
    prev: str | None = None
    if trace.module_calls:
        for path, ins, out in trace.module_calls:
            mod = modules[path]
            costs = col.add_module_call(path, mod, ins, out)
            _bump(g, site(path), type(mod).__name__, "weight" if costs else "module")
            if prev is not None and prev != site(path):
                g.add_edge(prev, site(path))
            prev = site(path)
        return g
    # no inputs: modules with weights in registration order, each called once as far as we know
    for layer in col.layers.values():
        where = site(kinds.for_kind(layer.kind).graph_site(layer))
        col.add(layer.param, where, str(layer.kind), 0, 0)
        _bump(g, where, layer.module_type, "weight")
        if prev is not None and prev != where:
            g.add_edge(prev, where)
        prev = where
    return g


def _bump(g: nx.DiGraph, node: str, kind: str, role: str) -> None:
    if node in g:
        g.nodes[node]["calls"] += 1
    else:
        g.add_node(node, kind=kind, role=role, calls=1)


class _CarriedWeights:
    """Which weight an fx value is: followed through pass-through ops, and through the ops that compute an effective
    weight from its stored parameters (weight_norm's g * v / |v|, spectral_norm's W / sigma)."""

    def __init__(self, table: ParamTable):
        self.table = table
        self.carried: dict[str, str | None] = {}  # fx node name -> canonical weight it carries

    def param_of(self, a: Any) -> str | None:
        return self.carried.get(a.name) if isinstance(a, torch.fx.Node) else None

    def weights_read(self, node: torch.fx.Node) -> dict[int | tuple[int, int], str]:
        flat = list(node.args) + list(node.kwargs.values())
        params: dict[int | tuple[int, int], str] = {}
        for i, a in enumerate(flat):
            p = self.param_of(a)
            if p is not None:
                params[i] = p
            if isinstance(a, (list, tuple)):
                for j, b in enumerate(a):
                    pb = self.param_of(b)
                    if pb is not None:
                        params[(i, j)] = pb
        return params

    def effective_of(self, weights: dict[Any, str], srcs: frozenset[str]) -> str | None:
        """The effective weight this value computes, if it reads only that weight's stored parameters (or the
        weight itself) and no data: weight_norm's g * v / |v|, spectral_norm's W / sigma."""
        if not weights or srcs:
            return None
        found = {self.table.derived_of.get(p, p if p in self.table.computed else None) for p in weights.values()}
        return found.pop() if len(found) == 1 and None not in found else None


class _OpCosts:
    """The cost of an op reading weights, from its handle (:mod:`auditor.structure.ops`); a weight it cannot cost,
    or a matrix no module claims, is listed as an unsupported op, never counted as zero."""

    def __init__(self, trace: TraceResult, col: _Collector):
        self.trace = trace
        self.col = col
        self.table = col.table

    def bare_matrix(self, canon: str, op: str) -> bool:
        """A 2-D parameter of no known module, read by an op that may multiply by it (not elementwise arithmetic,
        not concatenation): it would be a layer if the op had a handle."""
        if op in ELEMENTWISE or canon in self.table.skipped or canon not in self.table.keys:
            return False
        return self.table.tensor(canon).dim() == 2

    def costs(self, node: torch.fx.Node, op: str, weights: dict[Any, str]) -> list[Cost]:
        """The op's handle on the call; a weight it cannot cost gets a use without MACs and the op is listed."""
        if not self.trace.has_shapes:  # no MACs reported: only the uses matter
            return [Cost(canon, op) for canon in weights.values()]
        inputs = tuple(_shape_or_value(a) for a in list(node.args) + list(node.kwargs.values()))
        call = OpCall(op, inputs, _meta_shape(node), dict(weights))
        res = self.col.ops.handles[op](call)
        if res is None:
            if any(canon in self.col.layers or op in self.col.ops.matrix_ops for canon in weights.values()):
                self.col.unsupported_op(op)
            return [Cost(canon, op) for canon in weights.values()]
        return res


class _FxGraphBuilder:
    """Reads an fx graph node by node, one method per node kind, into the layer graph.

    ``weights`` follows which weight an fx value is (:class:`_CarriedWeights`), ``op_costs`` costs the ops that read
    them (:class:`_OpCosts`); ``reps`` maps an fx value to the layer-graph nodes it stands for.
    """

    def __init__(self, trace: TraceResult, model: nn.Module, col: _Collector):
        assert trace.graph is not None
        self.trace = trace
        self.col = col
        self.table = col.table
        self.g = nx.DiGraph(method=str(trace.method))
        self.modules = dict(model.named_modules())  # the user's modules: an exported graph module has none of them
        self.leafish = {p for p, m in self.modules.items() if not list(m.children())}
        self.weights = _CarriedWeights(col.table)
        self.carried = self.weights.carried  # fx node name -> canonical weight it carries
        self.op_costs = _OpCosts(trace, col)
        self.reps: dict[str, frozenset[str]] = {}  # fx node name -> graph nodes it stands for
        self.calls_of: dict[str, int] = {}  # parameterless module path -> calls seen so far (symbolic_trace)

    def run(self) -> nx.DiGraph:
        handlers = {"placeholder": self.placeholder, "get_attr": self.get_attr, "output": self.output,
                    "call_module": self.call_module, "call_function": self.call_function,
                    "call_method": self.call_function}
        for node in self.trace.graph.nodes:  # type: ignore[union-attr]
            handlers[node.op](node)
        return self.g

    # -- helpers
    def inputs_of(self, node: torch.fx.Node) -> frozenset[str]:
        acc: set[str] = set()
        for a in node.all_input_nodes:
            acc |= self.reps.get(a.name, frozenset())
        return frozenset(acc)

    def link(self, node: torch.fx.Node, srcs: frozenset[str], gid: str) -> None:
        for src in srcs:
            if src != gid:
                self.g.add_edge(src, gid)
        self.reps[node.name] = frozenset({gid})

    # -- one method per node kind
    def placeholder(self, node: torch.fx.Node) -> None:
        fqn = self.trace.placeholder_params.get(node.name)
        if fqn is not None:
            self.carried[node.name] = self.table.canonical.get(fqn)
            self.reps[node.name] = frozenset()
        elif node.name in self.trace.placeholder_buffers:  # a buffer is state, not data flowing in
            self.reps[node.name] = frozenset()
        else:
            gid = f"input:{node.target}"
            self.g.add_node(gid, kind="input", role="io", calls=1)
            self.reps[node.name] = frozenset({gid})

    def get_attr(self, node: torch.fx.Node) -> None:
        self.carried[node.name] = self.table.canonical.get(str(node.target))
        self.reps[node.name] = frozenset()

    def output(self, node: torch.fx.Node) -> None:
        self.g.add_node("output", kind="output", role="io", calls=1)
        for src in self.inputs_of(node):
            self.g.add_edge(src, "output")

    def call_module(self, node: torch.fx.Node) -> None:
        srcs = self.inputs_of(node)
        path = str(node.target)
        mod = self.modules[path]
        if isinstance(mod, PASS_THROUGH_MODULES):
            self.reps[node.name] = srcs
            return
        eff = self.weights.effective_of(self.weights.weights_read(node), srcs)
        if eff is not None:  # a parametrization module computing a weight (symbolic_trace of its owner)
            self.carried[node.name] = eff
            self.reps[node.name] = srcs
            return
        ins = [_meta_shape(a) for a in node.args] + [_meta_shape(v) for v in node.kwargs.values()]
        costs = self.col.add_module_call(path, mod, ins, _meta_shape(node))
        has_params = any(True for _ in mod.parameters()) or spec_for(mod) is not None and bool(costs)
        role = "weight" if costs else ("module" if has_params else "nonlinear")
        if has_params:
            gid = self.table.site(path)
            _bump(self.g, gid, type(mod).__name__, role)
        else:
            self.calls_of[path] = self.calls_of.get(path, -1) + 1
            gid = _per_call(path, self.calls_of[path])
            self.g.add_node(gid, kind=type(mod).__name__, role=role, calls=1)
        self.link(node, srcs, gid)

    def call_function(self, node: torch.fx.Node) -> None:
        """call_function and call_method: pass-through, effective-weight arithmetic, scaling, weight ops, others."""
        srcs = self.inputs_of(node)
        op = op_name(node)
        weights = self.weights.weights_read(node)
        if op in PASS_THROUGH:
            src_param = self.weights.param_of(node.args[0]) if node.args else None
            if src_param is not None:
                self.carried[node.name] = src_param
            self.reps[node.name] = srcs
            return
        eff = self.weights.effective_of(weights, srcs)
        if eff is not None:
            self.carried[node.name] = eff
            self.reps[node.name] = srcs
            return
        if op in SCALING and not weights and not any(
            isinstance(a, torch.fx.Node) and self.reps.get(a.name) for a in node.args[1:]
        ):
            self.reps[node.name] = srcs  # scaling or shifting by a constant: no new node
            return
        stack_site = _site(node, "")
        if weights and op in self.col.ops:
            gid = self.weight_op(node, op, weights, stack_site)
        else:
            gid = self.other_op(node, op, weights, stack_site)
        self.link(node, srcs, gid)

    def weight_op(self, node: torch.fx.Node, op: str, weights: dict[Any, str], stack_site: str) -> str:
        costs = self.op_costs.costs(node, op, weights)
        used = []
        for c in costs:
            site = stack_site or _owner(c.param)
            if self.col.add(c.param, site, c.op, c.macs, c.lookups) is not None:
                used.append(self.table.site(site))
        if used:
            _bump(self.g, used[0], op, "weight")
            return used[0]
        gid = stack_site if stack_site in self.leafish and stack_site else node.name
        _bump(self.g, gid, op, "op")
        return gid

    def other_op(self, node: torch.fx.Node, op: str, weights: dict[Any, str], stack_site: str) -> str:
        # a layer's weight, or a matrix no module claims, read by an op with no cost handle: listed, not zero
        if any(p in self.col.layers or self.op_costs.bare_matrix(p, op) for p in set(weights.values())):
            self.col.unsupported_op(op)
        if stack_site and stack_site in self.leafish:
            # an activation or norm module decomposed into ops: one node per call
            mod = self.modules[stack_site]
            has_params = any(True for _ in mod.parameters())
            gid = stack_site if has_params else _per_call(stack_site, _call_index(node))
            if gid not in self.g:
                self.g.add_node(gid, kind=type(mod).__name__, role=_role(mod), calls=1)
            return gid
        self.g.add_node(node.name, kind=op, role="nonlinear" if op in NONLINEAR else "op", calls=1)
        return node.name


def _shape_or_value(a: Any) -> Any:
    if isinstance(a, torch.fx.Node):
        return _meta_shape(a)
    if isinstance(a, (list, tuple)):
        return [_shape_or_value(b) for b in a]
    return a


def _role(mod: nn.Module) -> str:
    if any(True for _ in mod.parameters(recurse=False)):
        return "module"
    return "nonlinear"


def chained_linear_pairs(g: nx.DiGraph, layers: dict[str, Layer]) -> list[tuple[str, str]]:
    """Pairs (a, b) of weight nodes where a feeds only b and b reads only a: two linear maps with nothing
    nonlinear between them, which multiply out to one linear map. Empty for a graph without data flow (the module
    walk links modules in call order: q_proj -> k_proj is no chain)."""
    if not g.graph.get("data_flow", True):
        return []
    site_kind: dict[str, str] = {}
    for layer in layers.values():
        for u in layer.uses:
            site_kind.setdefault(u.site, str(layer.kind))
    linear_kinds = {k for k in set(site_kind.values()) if kinds.for_kind(k).linear_chain}
    pairs = []
    for b in g.nodes:
        if site_kind.get(b) not in linear_kinds:
            continue
        preds = list(g.predecessors(b))
        if len(preds) != 1:
            continue
        a = preds[0]
        if site_kind.get(a) in linear_kinds and list(g.successors(a)) == [b] and a != b:
            pairs.append((a, b))
    return sorted(pairs)
