"""The extension points of layers.py and graph.py: module types as LayerSpecs, op costs as handles, the graph's plain
data (data_flow, chains), the trace method enum. Exact numbers from closed-form formulas on tiny modules."""

import json
import math

import pytest
import torch
from torch import nn

import auditor
from auditor.structure import graph
from auditor.structure.layers import Cost, LayerSpec, MatrixView, ParamTable, collect_layers, register_layer_spec, spec_for
from auditor.results import Kind
from auditor.structure.trace import Method, trace


def one(model, inputs=None, **kw):
    return auditor.audit(model, inputs, spectra=False, **kw)


class TensorDot(nn.Module):
    """A linear map stored (in, out) and applied by tensordot, an op the auditor has no handle for."""

    def __init__(self, i: int, o: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(i, o))

    def forward(self, x):
        return torch.tensordot(x, self.w, dims=([x.dim() - 1], [0]))


TENSORDOT_SPEC = LayerSpec(
    weights=lambda mod: ("w",),
    view=lambda mod, name, shape: MatrixView(Kind.MATMUL, shape[1], shape[0], 1, "(in, out) as stored"),
    cost=lambda mod, ins, out: [] if out is None else [Cost("w", "tensordot", math.prod(out) * mod.w.shape[0])],
)


@pytest.fixture
def tensordot_spec():
    register_layer_spec(TensorDot, TENSORDOT_SPEC)
    try:
        yield
    finally:
        register_layer_spec(TensorDot, None)


def test_unknown_module_weight_is_rest_and_its_op_is_listed_unsupported():
    a = one(nn.Sequential(TensorDot(32, 48)), torch.zeros(5, 32))
    assert a.layers == [] and a.rest_params == 32 * 48
    assert a.unsupported_ops == {"tensordot": 1}  # a matrix read by an op we cannot cost: listed, not zero


@pytest.mark.parametrize("tracer", ["auto", "walk"])
def test_registered_layer_spec_views_and_costs_a_custom_module(tensordot_spec, tracer):
    a = one(nn.Sequential(TensorDot(32, 48), nn.ReLU(), TensorDot(48, 8)), torch.zeros(5, 32), tracer=tracer)
    assert a.trace_method == ("module walk" if tracer == "walk" else "torch.fx.symbolic_trace")
    first, second = a.layer("0.w"), a.layer("2.w")
    assert (first.kind, first.m, first.n, first.view) == (Kind.MATMUL, 48, 32, "(in, out) as stored")
    assert first.module_type == "TensorDot" and first.params == 1536
    assert first.macs == 5 * 48 * 32 and second.macs == 5 * 8 * 48
    assert [(u.site, u.op, u.calls) for u in first.uses] == [("0", "tensordot", 1)]
    assert a.unsupported_ops == {}
    assert a.rest_params == 0


def test_spec_lookup_follows_the_mro_and_forgets_on_none(tensordot_spec):
    class Sub(TensorDot):
        pass

    assert spec_for(Sub(2, 3)) is TENSORDOT_SPEC
    register_layer_spec(TensorDot, None)
    assert spec_for(Sub(2, 3)) is None
    with pytest.raises(TypeError):
        register_layer_spec(int, TENSORDOT_SPEC)


def test_builtin_specs_cover_the_module_types_layers_and_graph_share():
    m = nn.Sequential(nn.Linear(4, 6), nn.Conv1d(6, 10, 3, groups=2), nn.Embedding(7, 5), nn.GRU(5, 3))
    layers = collect_layers(m, ParamTable.of(m))
    got = {k: (str(l.kind), l.m, l.n, l.groups) for k, l in layers.items()}
    assert got == {"0.weight": ("linear", 6, 4, 1), "1.weight": ("conv", 5, 9, 2), "2.weight": ("embedding", 7, 5, 1),
                   "3.weight_ih_l0": ("rnn", 9, 5, 1), "3.weight_hh_l0": ("rnn", 9, 3, 1)}
    costs = graph.module_costs(m[1], [(2, 6, 12)], (2, 10, 10))
    assert costs == [Cost("weight", "conv", 2 * 10 * 10 * 3 * 3)]


class Einsum(nn.Module):
    def __init__(self, equation: str, shape: tuple[int, ...]):
        super().__init__()
        self.equation = equation
        self.w = nn.Parameter(torch.randn(*shape))

    def forward(self, x):
        return torch.einsum(self.equation, x, self.w)


@pytest.mark.parametrize("tracer", ["auto", "export"])
@pytest.mark.parametrize(("equation", "x", "macs"), [
    ("bi,oi->bo", (3, 8), 3 * 16 * 8),
    ("...i,oi->...o", (2, 5, 8), 2 * 5 * 16 * 8),
    ("bti,oi", (2, 5, 8), 2 * 5 * 16 * 8),  # implicit output: b, o, t
])
def test_a_parameter_used_through_einsum_is_found_with_inputs(tracer, equation, x, macs):
    a = one(Einsum(equation, (16, 8)), torch.zeros(*x), tracer=tracer)
    (layer,) = a.layers
    assert (layer.name, layer.kind, layer.m, layer.n) == ("w", Kind.MATMUL, 16, 8)
    assert layer.macs == macs
    assert a.rest_params == 0 and a.unsupported_ops == {}


def test_einsum_without_inputs_finds_the_same_layer():
    (layer,) = one(Einsum("bi,oi->bo", (16, 8))).layers
    assert (layer.name, layer.m, layer.n, layer.macs) == ("w", 16, 8, None)


def test_three_operand_einsum_is_listed_unsupported_not_zero():
    class Three(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.randn(8, 4))
            self.b = nn.Parameter(torch.randn(4, 6))

        def forward(self, x):
            return torch.einsum("bi,ij,jk->bk", x, self.a, self.b)

    a = one(Three(), torch.zeros(3, 8))
    assert a.unsupported_ops == {"einsum": 1}
    assert {l.name for l in a.layers} == {"a", "b"}


def test_set_op_handle_costs_a_new_op():
    def tensordot(call: graph.OpCall):
        w = call.shape(1)
        if call.out is None or w is None:
            return None
        return [Cost(canon, call.op, math.prod(call.out) * w[0]) for canon in call.weights.values()]

    graph.set_op_handle("aten::tensordot", tensordot)
    try:
        a = one(TensorDot(32, 48), torch.zeros(5, 32))
        (layer,) = a.layers
        assert (layer.kind, layer.m, layer.n) == (Kind.MATMUL, 32, 48)  # stored as read, no module spec
        assert layer.macs == 5 * 48 * 32 and a.unsupported_ops == {}
        assert "tensordot" in graph.op_handles()
    finally:
        graph.set_op_handle("tensordot", None)
    assert "tensordot" not in graph.op_handles()


def tensordot_handle(call):
    w = call.shape(1)
    return None if call.out is None or w is None else [
        Cost(canon, call.op, math.prod(call.out) * w[0]) for canon in call.weights.values()]


def test_build_returns_new_records_and_reads_only_the_op_table_it_is_given():
    m = TensorDot(32, 48)
    table = ParamTable.of(m)
    layers = collect_layers(m, table)
    assert layers == {}  # a bare parameter: a layer only once an op with a matrix handle reads it
    ops = graph.default_ops()
    ops.set("aten::tensordot", tensordot_handle)
    tr = trace(m, auditor.structure.trace.ExampleInputs.of(torch.zeros(5, 32)))
    g = graph.build(tr, m, table, layers, ops=ops)
    (layer,) = g.layers.values()
    assert (layer.param, layer.macs, [(u.site, u.op, u.calls) for u in layer.uses]) == (
        "w", 5 * 48 * 32, [("TensorDot", "tensordot", 1)])
    assert layers == {} and "tensordot" not in graph.op_handles()  # nothing it was handed changed, nor the default
    plain = graph.build(tr, m, table, layers)  # the default table: no handle, the read is listed as unsupported
    assert (plain.layers, plain.unsupported) == ({}, {"tensordot": 1})


def test_an_audit_copies_the_op_table_when_it_starts():
    """A handle set while an audit runs (here: from inside a handle) changes the next audit, not this one."""
    calls = []
    builtin = graph.op_handles()["einsum"]

    def einsum_then_unset(call):
        calls.append(call.op)
        graph.set_op_handle("einsum", None)  # the default table loses einsum; this audit's copy keeps it
        return builtin(call)

    graph.set_op_handle("einsum", einsum_then_unset)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(4, 6))

        def forward(self, x):
            return torch.einsum("bi,ij->bj", torch.einsum("bi,ij->bj", x, self.a), self.b)

    try:
        first = one(Two(), torch.zeros(3, 8), tracer="symbolic")
        assert calls == ["einsum", "einsum"] and first.unsupported_ops == {}
        assert {l.name: l.macs for l in first.layers} == {"a": 3 * 4 * 8, "b": 3 * 6 * 4}
        second = one(Two(), torch.zeros(3, 8), tracer="symbolic")
        assert calls == ["einsum", "einsum"] and second.unsupported_ops == {"einsum": 2}
    finally:
        graph.set_op_handle("einsum", builtin)
    assert graph.op_handles()["einsum"] is builtin and "einsum" in graph.DEFAULT_OPS.matrix_ops


def test_einsum_macs_closed_form():
    assert graph.einsum_macs("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]) == 4
    assert graph.einsum_macs("ij,ij->", [(3, 4), (3, 4)]) == 12
    assert graph.einsum_macs("i,j,k->ijk", [(1,), (2,), (3,)]) is None


def test_graph_result_chains_with_data_flow():
    m = nn.Sequential(nn.Linear(512, 64), nn.Linear(64, 512))
    x = torch.zeros(1, 512)
    table = ParamTable.of(m)
    layers = collect_layers(m, table)
    g = graph.build(trace(m, auditor.structure.trace.ExampleInputs.of(x)), m, table, layers)
    assert (g.data_flow, g.chains, g.macs_known, g.unsupported) == (True, [("0", "1")], True, {})
    assert g.layers["0.weight"].macs == 512 * 64
    assert (layers["0.weight"].macs, layers["0.weight"].uses) == (None, [])  # the given records are only read


def test_module_walk_has_no_data_flow_and_no_chains():
    m = nn.Sequential(nn.Linear(512, 64), nn.Linear(64, 512))
    table = ParamTable.of(m)
    layers = collect_layers(m, table)
    g = graph.build(trace(m, None, tracer="walk"), m, table, layers)
    assert (g.data_flow, g.chains) == (False, [])
    assert list(g.graph.edges) == [("0", "1")]  # call order, kept for the picture
    assert graph.chained_linear_pairs(g.graph, g.layers) == []
    assert [f.code for f in one(m, tracer="walk").findings if f.code == "LR007"] == []


def test_llama_walk_gives_no_chained_linear_findings():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, vocab_size=100)
    a = one(transformers.LlamaForCausalLM(cfg))
    assert a.trace_method == Method.WALK
    assert [f for f in a.findings if f.code == "LR007"] == []  # q_proj -> k_proj in call order is no chain


def test_method_is_a_str_enum_with_unchanged_values():
    assert [m.value for m in Method] == ["torch.fx.symbolic_trace", "torch.export", "module walk", "weights only"]
    assert Method("module walk") is Method.WALK and Method.WALK == "module walk"
    assert f"{Method.EXPORT}" == str(Method.EXPORT) == "torch.export"
    assert json.dumps({"m": Method.SYMBOLIC}) == '{"m": "torch.fx.symbolic_trace"}'
    assert Method.SYMBOLIC.data_flow and not Method.WALK.data_flow
    assert one(nn.Sequential(nn.Linear(2, 2)), tracer="walk").trace_method is Method.WALK
