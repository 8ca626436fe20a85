"""The layer graph and MACs, read off the traced fx graph.

Each fx node that reads a parameter through a weight op (linear, matmul, conv, embedding, recurrent) becomes a use
of that weight, with MACs from the shapes seen in the graph. The networkx graph keeps weight ops, activations and the
other ops that matter, and collapses shape-only ops (view, transpose, dropout, ...), so edges follow data flow between
the nodes a reviewer cares about. A node is a module (or an op outside any leaf module) and knows how often it runs.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
from torch import nn

from .layers import ParamTable, _hf_conv1d_type, _join, layer_for_graph_param
from .results import Kind, Layer, Use
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
LINEAR_OPS = frozenset({"linear", "addmm", "mm", "matmul", "bmm", "baddbmm", "__matmul__", "einsum"})
CONV_OPS = frozenset({"conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d",
                      "conv_transpose2d", "conv_transpose3d"})
EMBED_OPS = frozenset({"embedding", "embedding_bag", "_embedding_bag"})
RNN_OPS = frozenset({"lstm", "gru", "rnn_tanh", "rnn_relu"})
WEIGHT_OPS = LINEAR_OPS | CONV_OPS | EMBED_OPS | RNN_OPS


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


def _numel(shape: tuple[int, ...] | None) -> int | None:
    return None if shape is None else math.prod(shape)


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
    graph: nx.DiGraph
    unsupported: dict[str, int] = field(default_factory=dict)  # op name -> count of param reads we could not cost
    macs_known: bool = False


class _Collector:
    def __init__(self, table: ParamTable, layers: dict[str, Layer]):
        self.table = table
        self.layers = layers
        self.unsupported: dict[str, int] = {}

    def add(self, canon: str, site: str, op: str, macs_linear: int, lookups: int) -> Layer | None:
        layer = self.layers.get(canon)
        if layer is None:
            if op in LINEAR_OPS:
                names = self.table.names_of(canon)
                layer = layer_for_graph_param(canon, self.table.tensor(canon), op, names[1:])
                if layer is None:
                    return None
                self.layers[canon] = layer
            else:
                return None
        for u in layer.uses:
            if u.site == site and u.op == op:
                u.calls += 1
                break
        else:
            layer.uses.append(Use(site=site, op=op, calls=1))
        layer.macs_linear += macs_linear
        layer.lookups += lookups
        return layer

    def add_module_call(self, path: str, mod: nn.Module, ins: list, out: tuple | None) -> bool:
        """Record one call of a leaf module as a use of each weight it owns; True if it owns any."""
        costs = module_costs(mod, ins, out)
        for pname, op, macs, lookups in costs:
            canon = self.table.canonical.get(_join(path, pname))
            if canon:
                self.add(canon, path, op, macs, lookups)
        return bool(costs)


def _owner(param: str) -> str:
    return param.rsplit(".", 1)[0] if "." in param else ""


def module_costs(mod: nn.Module, ins: list, out: tuple | None) -> list[tuple[str, str, int, int]]:
    """(local param name, op, macs_linear, lookups) for one call of a leaf module, from its input/output shapes."""
    x = ins[0] if ins else None
    res: list[tuple[str, str, int, int]] = []
    conv1d = _hf_conv1d_type()
    if isinstance(mod, nn.Linear) and out is not None:
        res.append(("weight", "linear", math.prod(out) * mod.in_features, 0))
    elif conv1d is not None and isinstance(mod, conv1d) and out is not None:
        res.append(("weight", "linear", math.prod(out) * mod.weight.shape[0], 0))
    elif isinstance(mod, nn.modules.conv._ConvNd):
        k = math.prod(mod.weight.shape[1:])
        if mod.transposed and x is not None:
            res.append(("weight", "conv_transpose", math.prod(x) * k, 0))
        elif out is not None:
            res.append(("weight", "conv", math.prod(out) * k, 0))
    elif isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and x is not None:
        res.append(("weight", "embedding", 0, math.prod(x)))
    elif isinstance(mod, nn.RNNBase) and x is not None:
        positions = math.prod(x) // x[-1]
        for pname, p in mod.named_parameters(recurse=False):
            if p.dim() == 2:
                res.append((pname, mod.mode.lower(), positions * p.numel(), 0))
    elif isinstance(mod, nn.MultiheadAttention) and len(ins) >= 3 and all(s is not None for s in ins[:3]):
        q, k, v = ins[:3]
        e = mod.embed_dim
        if mod.in_proj_weight is not None:
            res.append(("in_proj_weight", "linear", (math.prod(q) + math.prod(k) + math.prod(v)) * e, 0))
        else:
            res.append(("q_proj_weight", "linear", math.prod(q) * e, 0))
            res.append(("k_proj_weight", "linear", math.prod(k) * mod.kdim, 0))
            res.append(("v_proj_weight", "linear", math.prod(v) * mod.vdim, 0))
        res.append(("out_proj.weight", "linear", math.prod(q) * e, 0))
    return res


def _function_costs(node: torch.fx.Node, op: str, params: dict[int, str]) -> list[tuple[str, int, int]]:
    """(canonical param, macs_linear, lookups) for a call_function/call_method weight op."""
    args = list(node.args)
    out = _meta_shape(node)
    res: list[tuple[str, int, int]] = []

    def shp(i: int) -> tuple[int, ...] | None:
        return _meta_shape(args[i]) if i < len(args) else None

    if op in RNN_OPS:
        x = shp(0)
        if x is None:
            return [(p, 0, 0) for p in params.values()]
        positions = math.prod(x) // x[-1]
        flat = [a for a in args if isinstance(a, (list, tuple))]
        for lst in flat:
            for a in lst:
                s = _meta_shape(a)
                canon = params.get(id(a))
                if canon is not None and s is not None and len(s) == 2:
                    res.append((canon, positions * math.prod(s), 0))
        return res
    for i, canon in params.items():
        if not isinstance(i, int) or i >= len(args):
            continue
        w = shp(i)
        if op in EMBED_OPS:
            idx = 1 if i == 0 else 0
            res.append((canon, 0, _numel(shp(idx)) or 0))
        elif out is None or w is None:
            res.append((canon, 0, 0))
        elif op == "linear":
            res.append((canon, math.prod(out) * w[-1], 0))
        elif op in ("addmm", "baddbmm"):
            k = w[-2] if i == 2 else w[-1]
            res.append((canon, math.prod(out) * k, 0))
        elif op in ("mm", "matmul", "bmm", "__matmul__"):
            k = w[-2] if i == 1 and len(w) >= 2 else w[-1]
            res.append((canon, math.prod(out) * k, 0))
        elif op in CONV_OPS:
            transposed = op.startswith("conv_transpose") or (
                op in ("convolution", "_convolution") and len(args) > 6 and bool(args[6])
            )
            k = math.prod(w[1:])
            x = shp(0)
            res.append((canon, (math.prod(x) if transposed and x else math.prod(out)) * k, 0))
    return res


def build(trace: TraceResult, model: nn.Module, table: ParamTable, layers: dict[str, Layer]) -> GraphResult:
    col = _Collector(table, layers)
    if trace.method == Method.WALK:
        g = _walk_graph(trace, model, col)
    else:
        g = _fx_graph(trace, model, table, col)
    macs_known = trace.has_shapes
    for layer in layers.values():
        if macs_known:
            layer.macs = layer.macs_linear
        else:
            layer.macs = None
            layer.macs_linear = 0
            layer.lookups = 0
    return GraphResult(g, col.unsupported, macs_known)


def _walk_graph(trace: TraceResult, model: nn.Module, col: _Collector) -> nx.DiGraph:
    g = nx.DiGraph(method=trace.method)
    modules = dict(model.named_modules())
    prev: str | None = None
    if trace.module_calls:
        for path, ins, out in trace.module_calls:
            mod = modules[path]
            costs = col.add_module_call(path, mod, ins, out)
            _bump(g, path, type(mod).__name__, "weight" if costs else "module")
            if prev is not None and prev != path:
                g.add_edge(prev, path)
            prev = path
        return g
    # no inputs: modules with weights in registration order, each called once as far as we know
    for layer in col.layers.values():
        site = layer.name if layer.kind != Kind.RNN else _owner(layer.param)
        col.add(layer.param, site, str(layer.kind), 0, 0)
        _bump(g, site, layer.module_type, "weight")
        if prev is not None and prev != site:
            g.add_edge(prev, site)
        prev = site
    return g


def _bump(g: nx.DiGraph, node: str, kind: str, role: str) -> None:
    if node in g:
        g.nodes[node]["calls"] += 1
    else:
        g.add_node(node, kind=kind, role=role, calls=1)


def _fx_graph(trace: TraceResult, model: nn.Module, table: ParamTable, col: _Collector) -> nx.DiGraph:
    assert trace.graph is not None
    g = nx.DiGraph(method=trace.method)
    modules = dict(model.named_modules())  # the user's modules: an exported graph module has none of them
    leafish = {p for p, m in modules.items() if not list(m.children())}
    carried: dict[str, str | None] = {}  # fx node name -> canonical param it carries (through pass-through ops)
    reps: dict[str, frozenset[str]] = {}  # fx node name -> graph nodes it stands for
    calls_of: dict[str, int] = {}  # parameterless module path -> calls seen so far (symbolic_trace)

    def param_of(a: Any) -> str | None:
        return carried.get(a.name) if isinstance(a, torch.fx.Node) else None

    def inputs_of(node: torch.fx.Node) -> frozenset[str]:
        acc: set[str] = set()
        for a in node.all_input_nodes:
            acc |= reps.get(a.name, frozenset())
        return frozenset(acc)

    for node in trace.graph.nodes:
        if node.op == "placeholder":
            fqn = trace.placeholder_params.get(node.name)
            if fqn is not None:
                carried[node.name] = table.canonical.get(fqn)
                reps[node.name] = frozenset()
            elif node.name in trace.placeholder_params.values():  # pragma: no cover
                reps[node.name] = frozenset()
            else:
                gid = f"input:{node.target}"
                g.add_node(gid, kind="input", role="io", calls=1)
                reps[node.name] = frozenset({gid})
            continue
        if node.op == "get_attr":
            carried[node.name] = table.canonical.get(str(node.target))
            reps[node.name] = frozenset()
            continue
        if node.op == "output":
            g.add_node("output", kind="output", role="io", calls=1)
            for src in inputs_of(node):
                g.add_edge(src, "output")
            continue

        srcs = inputs_of(node)
        if node.op == "call_module":
            mod = modules[str(node.target)]
            path = str(node.target)
            if isinstance(mod, PASS_THROUGH_MODULES):
                reps[node.name] = srcs
                continue
            ins = [_meta_shape(a) for a in node.args] + [_meta_shape(v) for v in node.kwargs.values()]
            costs = col.add_module_call(path, mod, ins, _meta_shape(node))
            has_params = any(True for _ in mod.parameters())
            role = "weight" if costs else ("module" if has_params else "nonlinear")
            if has_params:
                gid = path
                _bump(g, gid, type(mod).__name__, role)
            else:
                calls_of[path] = calls_of.get(path, -1) + 1
                gid = _per_call(path, calls_of[path])
                g.add_node(gid, kind=type(mod).__name__, role=role, calls=1)
        else:
            op = op_name(node)
            flat = list(node.args) + list(node.kwargs.values())
            params: dict[Any, str] = {}
            for i, a in enumerate(flat):
                p = param_of(a)
                if p is not None:
                    params[i] = p
                if isinstance(a, (list, tuple)):
                    for b in a:
                        pb = param_of(b)
                        if pb is not None:
                            params[id(b)] = pb
            if op in PASS_THROUGH:
                src_param = param_of(node.args[0]) if node.args else None
                if src_param is not None:
                    carried[node.name] = src_param
                reps[node.name] = srcs
                continue
            if op in ("mul", "div", "add", "sub", "truediv", "neg") and not any(
                isinstance(a, torch.fx.Node) and reps.get(a.name) for a in node.args[1:]
            ) and not params:
                reps[node.name] = srcs  # scaling or shifting by a constant: no new node
                continue
            stack_site = _site(node, "")
            if op in WEIGHT_OPS and params:
                costs = _function_costs(node, op, params)
                used = []
                for canon, macs, lookups in costs:
                    site = stack_site or _owner(canon)
                    if col.add(canon, site, op, macs, lookups) is not None:
                        used.append(site)
                if used:
                    gid = used[0]
                    _bump(g, gid, op, "weight")
                else:
                    gid = stack_site if stack_site in leafish and stack_site else node.name
                    _bump(g, gid, op, "op")
            else:
                for p in set(params.values()):
                    if p in col.layers:
                        col.unsupported[op] = col.unsupported.get(op, 0) + 1
                if stack_site and stack_site in leafish:
                    # an activation or norm module decomposed into ops: one node per call
                    has_params = any(True for _ in modules[stack_site].parameters())
                    gid = stack_site if has_params else _per_call(stack_site, _call_index(node))
                    if gid not in g:
                        mod = modules[stack_site]
                        g.add_node(gid, kind=type(mod).__name__, role=_role(mod), calls=1)
                else:
                    gid = node.name
                    g.add_node(gid, kind=op, role="nonlinear" if op in NONLINEAR else "op", calls=1)
        for src in srcs:
            if src != gid:
                g.add_edge(src, gid)
        reps[node.name] = frozenset({gid})
    return g


def _role(mod: nn.Module) -> str:
    if any(True for _ in mod.parameters(recurse=False)):
        return "module"
    return "nonlinear"


def chained_linear_pairs(g: nx.DiGraph, layers: dict[str, Layer]) -> list[tuple[str, str]]:
    """Pairs (a, b) of weight nodes where a feeds only b and b reads only a: two linear maps with nothing
    nonlinear between them, which multiply out to one linear map."""
    linear_kinds = {Kind.LINEAR, Kind.CONV1D_HF, Kind.MATMUL}
    site_kind: dict[str, Kind] = {}
    for layer in layers.values():
        for u in layer.uses:
            site_kind.setdefault(u.site, layer.kind)
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
