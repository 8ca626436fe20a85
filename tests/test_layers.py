"""Matrix views, parameter counts and MACs on tiny modules whose numbers follow from closed-form formulas."""

import math

import pytest
import torch
from torch import nn

import auditor
from auditor.results import Kind


def one(model, inputs=None, **kw):
    return auditor.audit(model, inputs, spectra=False, **kw)


def test_conv2d_view_and_macs():
    a = one(nn.Sequential(nn.Conv2d(64, 128, 3)), torch.zeros(2, 64, 10, 10))
    (layer,) = a.layers
    assert (layer.m, layer.n, layer.groups) == (128, 576, 1)
    assert layer.params == 128 * 576
    assert layer.view == "(out, in, 3x3) viewed as out x in*3x3"
    assert layer.source.startswith("torch.nn.modules.conv.Conv2d (conv.py:")
    # counted per output position: 2 images x 8 x 8 positions, each 128 x 576 MACs
    assert layer.macs == 2 * 8 * 8 * 128 * 576


def test_linear_macs_exact():
    a = one(nn.Sequential(nn.Linear(1024, 4096)), torch.zeros(8, 1024))
    assert a.layers[0].macs == 33_554_432
    assert a.total_macs == 33_554_432
    assert a.layers[0].macs_at(256) == 8 * 256 * (4096 + 1024)


def test_gpt2_conv1d_view():
    from transformers.pytorch_utils import Conv1D

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = Conv1D(2304, 768)

        def forward(self, x):
            return self.c_attn(x)

    a = one(Block(), torch.zeros(1, 5, 768))
    (layer,) = a.layers
    assert layer.kind == Kind.CONV1D_HF
    assert layer.shape == (768, 2304)  # stored (in, out)
    assert (layer.m, layer.n) == (2304, 768)
    assert layer.macs == 5 * 2304 * 768


def test_embedding_lookups_and_factorized_macs():
    a = one(nn.Sequential(nn.Embedding(50_000, 768)), torch.zeros(2, 64, dtype=torch.long))
    (layer,) = a.layers
    assert (layer.m, layer.n) == (50_000, 768)
    assert layer.macs == 0
    assert layer.lookups == 128
    assert layer.params_at(128) == 6_498_304
    assert layer.macs_at(128) == 128 * 128 * 768  # the E x H projection per token


def test_grouped_and_transposed_convs():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.g = nn.Conv2d(16, 32, 3, groups=4)
            self.t = nn.ConvTranspose2d(32, 8, 2, stride=2)

        def forward(self, x):
            return self.t(self.g(x))

    a = one(M(), torch.zeros(1, 16, 6, 6))
    g, t = a.layer("g"), a.layer("t")
    assert (g.m, g.n, g.groups) == (8, 4 * 9, 4) and g.params == 32 * 4 * 9
    assert g.macs == 1 * 4 * 4 * 32 * 4 * 9
    assert (t.m, t.n, t.groups) == (8, 32 * 4, 1) and t.kind == Kind.CONV_TRANSPOSE
    # a transposed conv costs in x out x k per input position
    assert t.macs == 1 * 4 * 4 * 32 * 8 * 4


def test_conv_transpose_view_matches_direct_reshape():
    from auditor.structure.layers import matrix_view

    conv = nn.ConvTranspose2d(6, 4, 3, groups=2)
    a = one(conv)
    (layer,) = a.layers
    mats = matrix_view(layer, conv.weight.detach())
    assert mats.shape == (2, 2, 3 * 9)
    w = conv.weight.detach()  # (in, out/g, k, k)
    expected = w[3:6].permute(1, 0, 2, 3).reshape(2, 27)
    assert torch.equal(mats[1], expected)


def test_lstm_gru_gate_matrices():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(32, 64, num_layers=2)
            self.gru = nn.GRU(64, 16, batch_first=True)

        def forward(self, x):
            y, _ = self.lstm(x)
            z, _ = self.gru(y.transpose(0, 1))
            return z

    a = one(M(), torch.zeros(7, 3, 32))
    assert a.layer("lstm.weight_ih_l0").m == 256 and a.layer("lstm.weight_ih_l0").n == 32
    assert a.layer("lstm.weight_hh_l1").n == 64
    assert a.layer("gru.weight_ih_l0").m == 48
    positions = 7 * 3
    assert a.layer("lstm.weight_ih_l0").macs == positions * 256 * 32
    assert a.layer("gru.weight_hh_l0").macs == positions * 48 * 16


def test_multihead_attention_in_proj_and_out_proj():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(64, 4, batch_first=True)

        def forward(self, x):
            return self.mha(x, x, x)[0]

    a = one(M(), torch.zeros(2, 10, 64))
    inp = a.layer("mha.in_proj_weight")
    assert (inp.m, inp.n, inp.kind) == (192, 64, Kind.MHA_IN_PROJ)
    assert inp.macs == 2 * 10 * 192 * 64
    assert a.layer("mha.out_proj").macs == 2 * 10 * 64 * 64


def test_matmul_with_a_bare_parameter_is_a_layer():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(32, 16))

        def forward(self, x):
            return x @ self.w.t()

    a = one(M(), torch.zeros(4, 16))
    (layer,) = a.layers
    assert layer.kind == Kind.MATMUL and (layer.m, layer.n) == (32, 16)
    assert layer.macs == 4 * 32 * 16


def test_shares_sum_to_one_and_rest_counts_biases_and_norms():
    m = nn.Sequential(nn.Linear(10, 20), nn.LayerNorm(20), nn.Linear(20, 5))
    a = one(m, torch.zeros(1, 10))
    assert a.total_params == sum(p.numel() for p in m.parameters())
    assert a.rest_params == 20 + 20 + 20 + 5  # two biases, norm weight and bias
    assert math.isclose(sum(l.share for l in a.layers) + a.rest_share, 1.0, rel_tol=1e-12)
    assert [(l.name, l.params) for l in a.layers] == [("0", 200), ("2", 100)]


def test_no_inputs_leaves_macs_out_and_says_so():
    a = one(nn.Sequential(nn.Linear(10, 20)))
    assert a.layers[0].macs is None and a.total_macs is None
    assert any("MACs are left out" in n for n in a.notes)


def test_untraceable_model_falls_back_and_says_why():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 4)

        def forward(self, x):
            if x.shape[0] > 1:  # control flow on a shape: symbolic_trace fails, torch.export specializes it
                x = self.a(x)
            return self.b(x)

    a = one(Branchy(), torch.ones(2, 8))
    assert a.trace_method == "torch.export"
    assert "symbolic_trace failed" in a.trace_summary
    assert a.layer("b").macs == 2 * 4 * 8
    # the reports people read say it in words; the raw exception stays in the JSON's trace_failures
    raw = a.trace_failures[0].split(": ", 1)[1]
    assert raw and raw in a.to_json()
    import html

    for text in (a.to_text(width=120), html.unescape(a.to_html())):
        assert "torch.fx.symbolic_trace could not trace the model's forward code" in text.replace("\n", " ")
        assert raw not in text
    assert raw not in a.to_markdown()


def test_module_walk_when_nothing_traces():
    class Dyn(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x):
            n = int(x.abs().sum().item()) % 3 + 1  # data-dependent loop count defeats both tracers
            for _ in range(n):
                x = self.a(x)
            return x

    a = one(Dyn(), torch.ones(1, 8))
    assert a.trace_method == "module walk"
    assert "module walk" in a.trace_summary and "export failed" in a.trace_summary
    assert a.layers[0].calls == 8 % 3 + 1  # |x| sums to 8 on the first pass
    assert a.layers[0].macs == a.layers[0].calls * 64


@pytest.mark.parametrize("tracer", ["auto", "export"])
def test_layer_graph_follows_data_flow(tracer):
    import networkx as nx
    from digits import DigitsMLP

    a = auditor.audit(DigitsMLP(), torch.zeros(2, 64), spectra=False, tracer=tracer)
    assert a.trace_method == ("torch.export" if tracer == "export" else "torch.fx.symbolic_trace")
    assert a.graph.data_flow
    g = nx.DiGraph()
    g.add_nodes_from(n.name for n in a.graph.nodes)
    g.add_edges_from(a.graph.edges)
    assert nx.is_directed_acyclic_graph(g)
    assert list(nx.topological_sort(g)) == ["input:x", "fc1", "act", "fc2", "act@1", "fc3", "act@2", "head", "output"]
    assert a.graph.node("fc2").role == "weight" and a.graph.node("act@1").role == "nonlinear"


def test_shared_weight_module_is_one_node_with_its_call_count():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Linear(16, 16)

        def forward(self, x):
            for _ in range(3):
                x = torch.tanh(self.block(x))
            return x

    a = one(Shared(), torch.zeros(1, 16))
    assert a.graph.node("block").calls == 3
    assert a.layers[0].calls == 3 and a.layers[0].macs == 3 * 16 * 16


def test_audit_leaves_the_callers_training_mode_alone():
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    m.train()
    one(m, torch.zeros(1, 4))
    assert m.training


def test_tracer_walk_on_request_and_unknown_tracer():
    a = one(nn.Sequential(nn.Linear(4, 4)), torch.zeros(1, 4), tracer="walk")
    assert a.trace_method == "module walk" and a.layers[0].macs == 16
    with pytest.raises(auditor.AuditError, match="unknown tracer"):
        one(nn.Sequential(nn.Linear(4, 4)), tracer="fast")
