"""Issue 13 for layers and graph: weights under weight_norm / spectral_norm / parametrize are audited as their
effective matrix, the root module gets a name, odd trees (cycles, lazy, zero-sized, float8, sparse, quantized) are
refused or listed with a reason, never a traceback."""

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import auditor
from auditor.structure.layers import ParamTable, check_tree, collect_layers, storage_skip_reason


def one(model, inputs=None, **kw):
    return auditor.audit(model, inputs, spectra=False, **kw)


def _old_weight_norm(m):
    with pytest.warns(FutureWarning):
        return torch.nn.utils.weight_norm(m)


class Sym(nn.Module):
    """One Linear(8, 4) under a weight wrapper."""

    def __init__(self, wrap):
        super().__init__()
        self.fc = wrap(nn.Linear(8, 4))

    def forward(self, x):
        return self.fc(x)


WRAPS = {
    "parametrizations.weight_norm": (parametrizations.weight_norm, ["fc.parametrizations.weight.original0",
                                                                    "fc.parametrizations.weight.original1"], 4 + 32),
    "parametrizations.spectral_norm": (parametrizations.spectral_norm, ["fc.parametrizations.weight.original"], 32),
    "weight_norm": (_old_weight_norm, ["fc.weight_g", "fc.weight_v"], 4 + 32),
    "spectral_norm": (torch.nn.utils.spectral_norm, ["fc.weight_orig"], 32),
}


@pytest.mark.parametrize("tracer", ["auto", "export", "walk"])
@pytest.mark.parametrize("wrap", sorted(WRAPS))
def test_normed_linear_is_audited_as_its_effective_weight(wrap, tracer):
    fn, stored, stored_numel = WRAPS[wrap]
    model = Sym(fn)
    a = one(model, torch.zeros(3, 8), tracer=tracer)
    (layer,) = a.layers
    assert (layer.name, layer.param, layer.module_type, layer.m, layer.n) == ("fc", "fc.weight", "Linear", 4, 8)
    assert a.total_params == stored_numel + 4  # the stored parameters and the bias; the effective weight is not stored
    assert a.rest_params == a.total_params - 32
    assert layer.macs == 3 * 4 * 8
    assert [(u.site, u.op, u.calls) for u in layer.uses] == [("fc", "linear", 1)]
    assert layer.view == "(out, in) as stored; the effective weight, stored as " + ", ".join(stored)
    assert a.unsupported_ops == {}


def test_effective_weight_spectrum_is_the_matrix_the_module_multiplies_by():
    model = Sym(parametrizations.weight_norm)
    with torch.no_grad():
        model.fc.parametrizations.weight.original0.mul_(torch.arange(1.0, 5.0).reshape(4, 1))
    a = auditor.audit(model, cache=False)
    with torch.no_grad():
        effective = model.fc.weight.double()
    np.testing.assert_allclose(a.spectra["fc"].sigma[0], torch.linalg.svdvals(effective).numpy(), rtol=1e-5)


def test_spectral_norm_in_training_mode_is_not_power_iterated_by_the_audit():
    model = Sym(parametrizations.spectral_norm)
    model.train()
    u = model.fc.parametrizations.weight[0]._u.clone()
    one(model, torch.zeros(3, 8))
    assert torch.equal(model.fc.parametrizations.weight[0]._u, u) and model.training


def test_parametrized_conv_and_a_custom_parametrization():
    class Symmetric(nn.Module):
        def forward(self, w):
            return w.triu() + w.triu(1).transpose(0, 1)

    conv = parametrizations.weight_norm(nn.Conv2d(3, 8, 3))
    lin = nn.Linear(6, 6, bias=False)
    parametrize.register_parametrization(lin, "weight", Symmetric())
    a = one(nn.Sequential(conv), torch.zeros(2, 3, 6, 6))
    (c,) = a.layers
    assert (c.m, c.n, c.module_type) == (8, 27, "Conv2d") and c.macs == 2 * 4 * 4 * 8 * 27
    b = one(nn.Sequential(lin), torch.zeros(5, 6))
    (layer,) = b.layers
    assert (layer.name, layer.m, layer.n, layer.macs) == ("0", 6, 6, 5 * 36)
    assert b.total_params == 36  # parametrizations.weight.original


@pytest.mark.parametrize("inputs", [None, torch.zeros(2, 8)])
def test_a_root_linear_is_named_after_its_class(inputs):
    a = one(nn.Linear(8, 4), inputs)
    (layer,) = a.layers
    assert (layer.name, layer.param) == ("Linear", "weight")
    assert [u.site for u in layer.uses] == ["Linear"]
    assert "" not in a.graph.nodes
    assert layer.macs == (None if inputs is None else 2 * 4 * 8)


@pytest.mark.parametrize("depth", [0, 1])
def test_a_module_cycle_is_a_clear_error(depth):
    m = nn.Sequential(nn.Linear(4, 4), nn.Sequential())
    (m if depth == 0 else m[1]).add_module("loop", m)
    with pytest.raises(auditor.AuditError, match=r"module '(1\.)?loop' \(Sequential\) is registered inside itself"):
        ParamTable.of(m)
    with pytest.raises(auditor.AuditError):
        check_tree(m)


def test_a_shared_module_is_no_cycle():
    shared = nn.Linear(4, 4)
    m = nn.Sequential(shared, nn.Sequential(shared))
    check_tree(m)
    assert ParamTable.of(m).total == 20


def test_lazy_linear_is_a_clear_error():
    with pytest.raises(auditor.AuditError, match=r"parameter '0.weight' is not initialized yet .*Run the model once"):
        one(nn.Sequential(nn.LazyLinear(4)))


@pytest.mark.parametrize(("shape", "total"), [((8, 0), 0), ((0, 4), 4)])
def test_a_zero_sized_weight_is_skipped_with_a_note(shape, total):
    m = nn.Sequential(nn.Linear(*shape), nn.Linear(3, 2))
    table = ParamTable.of(m)
    layers = collect_layers(m, table)
    assert list(layers) == ["1.weight"]
    assert table.notes == [f"Skipped 0.weight: zero-sized weight {shape[::-1]}, nothing to factorize."]
    a = one(m)
    assert [l.name for l in a.layers] == ["1"] and a.total_params == total + 8
    b = one(nn.Sequential(nn.Linear(*shape)), torch.zeros(2, shape[0]))  # traced: not a bare matrix either
    assert b.layers == [] and b.unsupported_ops == {}


def test_float8_and_sparse_weights_are_listed_with_a_skip_reason():
    f8 = nn.Linear(8, 4)
    f8.weight.data = f8.weight.data.to(torch.float8_e4m3fn)
    sp = nn.Linear(8, 4)
    sp.weight = nn.Parameter(sp.weight.data.to_sparse())
    m = nn.Sequential(f8, sp)
    table = ParamTable.of(m)
    layers = collect_layers(m, table)
    assert [(l.name, l.dtype, l.m, l.n) for l in layers.values()] == [("0", "float8_e4m3fn", 4, 8),
                                                                      ("1", "float32", 4, 8)]
    assert storage_skip_reason(table.tensor("0.weight")) == (
        "float8_e4m3fn storage: upcast to float32 or bfloat16 before a spectral audit")
    assert storage_skip_reason(table.tensor("1.weight")) == "stored sparse_coo: densify before a spectral audit"
    assert storage_skip_reason(nn.Linear(2, 2).weight) is None


def test_quantized_linear_is_listed_counted_and_costed():
    q = torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2)),
                                               {nn.Linear}, dtype=torch.qint8)
    a = one(q, torch.zeros(3, 8))
    assert [(l.name, l.dtype, l.m, l.n, l.macs) for l in a.layers] == [("0", "qint8", 4, 8, 3 * 4 * 8),
                                                                       ("2", "qint8", 2, 4, 3 * 2 * 4)]
    assert a.total_params == 32 + 8  # packed weights; packed biases are not counted
    assert storage_skip_reason(ParamTable.of(q).tensor("0.weight")) == (
        "quantized (qint8): dequantize before a spectral audit")
