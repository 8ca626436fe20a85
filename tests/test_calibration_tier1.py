"""Tier 1: input statistics by hooks and the whitened layer-output error, against float64 measurements on the data."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from auditor.calibration import input_statistics, load_calibration, tier1, whitened_spectrum
from auditor.calibration.statistics.stats import by_name, conv_patches
from auditor.calibration.statistics.whiten import function_matrices, truncated_weight
from auditor.errors import AuditError
from auditor.structure.layers import ParamTable, collect_layers


def _digits(n: int | None = None) -> torch.Tensor:
    from sklearn.datasets import load_digits

    d = load_digits().data
    return torch.tensor(d if n is None else d[:n], dtype=torch.float32) / 16.0


def _capture_inputs(model: nn.Module, name: str, batches) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    h = model.get_submodule(name).register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    with torch.no_grad():
        for b in batches:
            model(*b.args, **b.kwargs)
    h.remove()
    return seen


def _measured_error(mod: nn.Module, w_r: torch.Tensor, inputs: list[torch.Tensor]) -> float:
    """||y(W) - y(W_r)|| / ||y(W) - bias|| through the module's own forward, in float64."""
    dense = _f64(mod)
    trunc = _f64(mod)
    with torch.no_grad():
        trunc.weight.copy_(w_r.double())
        if getattr(dense, "bias", None) is not None:
            dense.bias.zero_()
            trunc.bias.zero_()
        num = sum(float((dense(x.double()) - trunc(x.double())).pow(2).sum()) for x in inputs)
        den = sum(float(dense(x.double()).pow(2).sum()) for x in inputs)
    return math.sqrt(num / den)


def _f64(mod: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(mod).double()


@pytest.mark.parametrize("name, ranks", [("fc2", [1, 4, 7, 16, 64]), ("fc1", [3, 16, 40]), ("head", [2, 5, 9])])
def test_linear_error_formula_equals_measured_error(digits_mlp, name, ranks):
    model = digits_mlp[0]
    cal = load_calibration({"x": _digits(600)}, model, holdout=0.25)
    layers = by_name(collect_layers(model, ParamTable.of(model)))
    stats = input_statistics(model, layers, cal)
    assert stats.layers[name].rows == 450 and not stats.missing
    layer, mod = layers[name], model.get_submodule(name)
    spec = whitened_spectrum(layer, mod.weight, stats.layers[name])
    inputs = _capture_inputs(model, name, cal.fit)
    for r in ranks:
        measured = _measured_error(mod, truncated_weight(layer, mod.weight.double(), r, stats.layers[name]), inputs)
        assert spec.error_at(r) == pytest.approx(measured, rel=1e-6, abs=1e-12)
        # the textbook form, sqrt(sum of dropped whitened sigma^2) / ||W X||, differs only by the damping's share
        # (fc2 sees 450 rows for 512 inputs: its X^T X is singular and damped)
        assert spec.dropped_sigma_error(r) == pytest.approx(measured, rel=1e-3)
    # whitening beats the plain SVD truncation on the data at every rank
    for r in ranks:
        plain = _measured_error(mod, truncated_weight(layer, mod.weight.double(), r, None), inputs)
        assert spec.error_at(r) <= plain * (1 + 1e-9)
    assert spec.error[0] == 1.0 and spec.error[-1] == pytest.approx(0.0, abs=1e-6)
    assert spec.ranks_for["0.01"] == spec.rank_for(0.01)
    r1 = spec.rank_for(0.01)
    assert spec.error_at(r1) <= 0.01 < spec.error_at(r1 - 1)


def test_x_transpose_x_against_float64_reference(digits_mlp):
    model = digits_mlp[0]
    x = _digits(100)
    cal = load_calibration({"x": x}, model, holdout=0)
    stats = input_statistics(model, by_name(collect_layers(model, ParamTable.of(model))), cal)
    x64 = x.double()
    np.testing.assert_allclose(stats.layers["fc1"].gram[0], (x64.T @ x64).numpy(), rtol=1e-12, atol=1e-12)
    h = torch.relu(x64 @ model.fc1.weight.double().T + model.fc1.bias.double()).detach()
    # the hook sees the float32 activations; their Gram in float64 matches to float32 rounding
    np.testing.assert_allclose(stats.layers["fc2"].gram[0], (h.T @ h).numpy(), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("conv", [
    nn.Conv2d(3, 8, 3, padding=1),
    nn.Conv2d(4, 6, (3, 2), stride=(2, 1), dilation=(1, 2), padding=(2, 1), groups=2, padding_mode="reflect"),
    nn.Conv2d(3, 5, 3, padding="same", dilation=2, padding_mode="circular"),
    nn.Conv1d(4, 6, 5, stride=2, padding=3, groups=2),
    nn.Conv3d(2, 4, (2, 3, 3), stride=(1, 2, 1), padding=(1, 1, 0)),
])
def test_conv_patches_reproduce_the_convolution(conv):
    torch.manual_seed(0)
    nd = len(conv.kernel_size)
    x = torch.randn(2, conv.in_channels, *([7] * nd), dtype=torch.float64)
    conv = conv.double()
    p = conv_patches(conv, x)  # (rows, C * K)
    g = conv.groups
    w = conv.weight.reshape(g, conv.out_channels // g, -1)
    pg = p.reshape(p.shape[0], g, -1)
    y = torch.einsum("rgi,goi->rgo", pg, w).reshape(p.shape[0], -1) + conv.bias
    ref = conv(x)  # (N, out, *L) -> (N * L, out)
    ref = ref.reshape(2, conv.out_channels, -1).permute(0, 2, 1).reshape(-1, conv.out_channels)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)


def test_conv2d_error_formula_equals_measured_error(digits_cnn):
    model = digits_cnn[0]
    cal = load_calibration({"x": _digits(300).reshape(-1, 1, 8, 8)}, model, holdout=0)
    layers = by_name(collect_layers(model, ParamTable.of(model)))
    stats = input_statistics(model, layers, cal)
    assert stats.layers["conv2"].rows == 300 * 8 * 8 and stats.layers["conv2"].width == 32 * 9
    inputs = _capture_inputs(model, "conv2", cal.fit)
    layer, mod = layers["conv2"], model.conv2
    spec = whitened_spectrum(layer, mod.weight, stats.layers["conv2"])
    for r in (1, 6, 17, 31):
        measured = _measured_error(mod, truncated_weight(layer, mod.weight.double(), r, stats.layers["conv2"]), inputs)
        assert spec.error_at(r) == pytest.approx(measured, rel=1e-6)


def test_grouped_strided_conv_error_formula():
    torch.manual_seed(1)
    net = nn.Sequential(nn.Conv2d(4, 8, 3, stride=2, padding=1, dilation=2, groups=2, padding_mode="replicate"))
    x = torch.randn(16, 4, 9, 9)
    cal = load_calibration([x], net, holdout=0)
    layers = by_name(collect_layers(net, ParamTable.of(net)))
    stats = input_statistics(net, layers, cal)
    assert stats.layers["0"].gram.shape == (2, 18, 18)
    spec = whitened_spectrum(layers["0"], net[0].weight, stats.layers["0"])
    for r in (1, 2, 3):
        w_r = truncated_weight(layers["0"], net[0].weight.double(), r, stats.layers["0"])
        assert spec.error_at(r) == pytest.approx(_measured_error(net[0], w_r, [x]), rel=1e-6)


def test_embedding_counts_and_error():
    torch.manual_seed(2)
    emb = nn.Embedding(40, 12)
    net = nn.Sequential(emb)
    ids = torch.randint(0, 20, (30, 9)) ** 1
    ids[0, :5] = 3  # uneven counts
    cal = load_calibration({"input": ids}, net, holdout=0, batch_size=8)
    layers = by_name(collect_layers(net, ParamTable.of(net)))
    stats = input_statistics(net, layers, cal)
    inp = stats.layers["0"]
    assert inp.diagonal and inp.rows == ids.numel() and inp.width == 40
    np.testing.assert_array_equal(inp.gram, torch.bincount(ids.reshape(-1), minlength=40).double().numpy())
    assert any("fewer than its input width" in w for w in stats.warnings) is (ids.numel() < 40)
    spec = whitened_spectrum(layers["0"], emb.weight, inp)
    for r in (1, 4, 11):
        w_r = truncated_weight(layers["0"], emb.weight.double(), r, inp)
        y, y_r = emb.weight.detach().double()[ids], w_r[ids]
        measured = float((y - y_r).detach().norm() / y.detach().norm())
        assert spec.error_at(r) == pytest.approx(measured, rel=1e-6)


def test_lstm_hidden_statistics_against_a_step_by_step_cell():
    torch.manual_seed(3)
    lstm = nn.LSTM(5, 7, num_layers=2, batch_first=True)
    net = nn.Sequential(lstm)
    x = torch.randn(4, 6, 5, dtype=torch.float64)
    lstm.double()
    cal = load_calibration([x], net, holdout=0)
    layers = by_name(collect_layers(net, ParamTable.of(net)))
    stats = input_statistics(net, layers, cal)
    seq = x
    for layer in range(2):
        cell = nn.LSTMCell(seq.shape[-1], 7).double()
        with torch.no_grad():
            for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(cell, k).copy_(getattr(lstm, f"{k}_l{layer}"))
        h = c = torch.zeros(4, 7, dtype=torch.float64)
        prev, outs = [], []
        for t in range(6):
            prev.append(h)
            h, c = cell(seq[:, t], (h, c))
            outs.append(h)
        xin = seq.reshape(-1, seq.shape[-1])
        hin = torch.stack(prev, 1).reshape(-1, 7)
        np.testing.assert_allclose(stats.layers[f"0.weight_ih_l{layer}"].gram[0], (xin.T @ xin).detach().numpy(),
                                   rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(stats.layers[f"0.weight_hh_l{layer}"].gram[0], (hin.T @ hin).detach().numpy(),
                                   rtol=1e-10, atol=1e-10)
        seq = torch.stack(outs, 1)


def test_self_attention_in_proj_statistics():
    torch.manual_seed(4)
    net = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    x = torch.randn(3, 5, 16)
    cal = load_calibration([x], net, holdout=0)
    layers = by_name(collect_layers(net, ParamTable.of(net)))
    stats = input_statistics(net, layers, cal)
    inp = stats.layers["self_attn.in_proj_weight"]
    assert inp.rows == 15 and not inp.approximate
    xr = x.reshape(-1, 16).double()
    np.testing.assert_allclose(inp.gram[0], (xr.T @ xr).numpy(), rtol=1e-10, atol=1e-10)
    # out_proj is read by the attention function directly, never called: listed as missing, with the reason
    assert stats.missing["self_attn.out_proj"] == "never called on the calibration inputs"


def test_tier1_suggested_rank_is_aligned_below_break_even(digits_mlp):
    model = digits_mlp[0]
    cal = load_calibration({"x": _digits(800)}, model)
    layers = by_name(collect_layers(model, ParamTable.of(model)))
    _, spectra = tier1(model, layers, cal, align=8, target=0.01)
    for name, spec in spectra.items():
        layer = layers[name]
        if spec.suggested is not None:
            assert spec.suggested >= spec.rank_for(0.01)
            assert spec.suggested * (layer.m + layer.n) < layer.m * layer.n
            assert spec.suggested % 8 == 0 or spec.suggested + 8 > layer.break_even
        else:
            assert spec.verdict == "keep dense"


def test_function_matrix_of_an_embedding_is_its_transpose():
    emb = nn.Embedding(10, 4)
    net = nn.Sequential(emb)
    layers = by_name(collect_layers(net, ParamTable.of(net)))
    assert function_matrices(layers["0"], emb.weight).shape == (1, 4, 10)


def test_bad_calibration_inputs(tmp_path, digits_mlp):
    from safetensors.torch import save_file

    model = digits_mlp[0]
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    with pytest.raises(AuditError, match="is empty"):
        load_calibration(empty, model)
    save_file({"x": torch.zeros(0, 64)}, str(tmp_path / "zero.safetensors"))
    with pytest.raises(AuditError, match="zero rows"):
        load_calibration(tmp_path / "zero.safetensors", model)
    bad = torch.rand(20, 64)
    bad[3, 5] = float("nan")
    save_file({"x": bad}, str(tmp_path / "nan.safetensors"))
    with pytest.raises(AuditError, match="NaN"):
        load_calibration(tmp_path / "nan.safetensors", model)
    save_file({"x": torch.rand(20, 63)}, str(tmp_path / "shape.safetensors"))
    with pytest.raises(AuditError, match="do not fit DigitsMLP.forward") as e:
        load_calibration(tmp_path / "shape.safetensors", model)
    assert "\n" not in str(e.value)
    save_file({"x": torch.rand(20, 64), "y": torch.rand(19, 64)}, str(tmp_path / "rows.safetensors"))
    with pytest.raises(AuditError, match="disagree on the batch size"):
        load_calibration(tmp_path / "rows.safetensors", model)
    save_file({"x": torch.rand(20, 64), "labels": torch.rand(20, 64)}, str(tmp_path / "names.safetensors"))
    with pytest.raises(AuditError, match="labels"):
        load_calibration(tmp_path / "names.safetensors", model)
    with pytest.raises(AuditError, match="does not exist"):
        load_calibration(tmp_path / "missing.safetensors", model)


def test_pt_file_and_function_sources(tmp_path, digits_mlp):
    model = digits_mlp[0]
    x = _digits(64)
    torch.save({"x": x}, tmp_path / "cal.pt")
    cal = load_calibration(tmp_path / "cal.pt", model, holdout=0.25, batch_size=16)
    assert (cal.fit_rows, cal.holdout_rows, len(cal.fit), len(cal.holdout)) == (48, 16, 3, 1)
    src = tmp_path / "batches.py"
    src.write_text("import torch\ndef batches():\n    return [torch.ones(4, 64) * i for i in range(8)]\n")
    cal = load_calibration(f"{src}:batches", model, holdout=0.25)
    assert (len(cal.fit), len(cal.holdout)) == (6, 2) and len(cal.digest) == 64
    torch.testing.assert_close(cal.holdout[0].args[0], torch.ones(4, 64) * 6)


def test_synthetic_token_ids_warn_and_text_does_not():
    import inspect

    net = nn.Sequential(nn.Embedding(500, 8))
    torch.manual_seed(5)
    random_ids = torch.randint(0, 500, (16, 64))
    assert "uniformly at random" in " ".join(load_calibration({"input": random_ids}, net).warnings)
    text = inspect.getsource(inspect).encode()[: 16 * 64]  # real text, one byte per token
    ids = torch.tensor(list(text)).reshape(16, 64)
    assert load_calibration({"input": ids}, net).warnings == []


def test_layers_reading_one_input_share_its_gram():
    class QKV(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(6, 6) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.q(x) + self.k(x) * self.v(x)
            return self.o(torch.tanh(y))

    torch.manual_seed(6)
    net = QKV()
    xs = [torch.randn(5, 6) for _ in range(3)]
    stats = input_statistics(net, by_name(collect_layers(net, ParamTable.of(net))), load_calibration(xs, net, holdout=0))
    x = torch.cat(xs).double()
    ref = (x.T @ x).numpy()
    for name in ("q", "k", "v"):
        np.testing.assert_allclose(stats.layers[name].gram[0], ref, rtol=1e-12)
        assert stats.layers[name].rows == 15
    with torch.no_grad():
        h = torch.cat([torch.tanh(net.q(a) + net.k(a) * net.v(a)) for a in xs]).double()
    np.testing.assert_allclose(stats.layers["o"].gram[0], (h.T @ h).numpy(), rtol=1e-5, atol=1e-6)


def test_statistics_save_and_load(tmp_path, digits_cnn):
    from auditor.calibration import InputStatistics

    model = digits_cnn[0]
    cal = load_calibration({"x": _digits(40).reshape(-1, 1, 8, 8)}, model, holdout=0)
    stats = input_statistics(model, by_name(collect_layers(model, ParamTable.of(model))), cal)
    stats.save(tmp_path / "s.npz")
    back = InputStatistics.load(tmp_path / "s.npz")
    assert back.digest == cal.digest and back.warnings == stats.warnings and set(back.layers) == set(stats.layers)
    for k, v in stats.layers.items():
        assert np.array_equal(back.layers[k].gram, v.gram) and back.layers[k].rows == v.rows


def test_bidirectional_gru_hidden_statistics():
    torch.manual_seed(7)
    gru = nn.GRU(3, 4, bidirectional=True).double()
    x = torch.randn(5, 2, 3, dtype=torch.float64)  # (time, batch, in)
    h0 = torch.randn(2, 2, 4, dtype=torch.float64)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gru = gru

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.gru(x, h0)[0]

    net = Net()
    stats = input_statistics(net, by_name(collect_layers(net, ParamTable.of(net))), load_calibration([x], net, holdout=0))
    for d, sfx in enumerate(["", "_reverse"]):
        cell = nn.GRUCell(3, 4).double()
        with torch.no_grad():
            for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(cell, k).copy_(getattr(gru, f"{k}_l0{sfx}"))
            h, prev = h0[d], []
            for t in (range(5) if d == 0 else range(4, -1, -1)):
                prev.append(h)
                h = cell(x[t], h)
        hin = torch.cat(prev)
        np.testing.assert_allclose(stats.layers[f"gru.weight_hh_l0{sfx}"].gram[0], (hin.T @ hin).numpy(), rtol=1e-10)


def test_held_out_source_and_share_as_text(tmp_path, digits_mlp):
    from safetensors.torch import save_file

    model = digits_mlp[0]
    save_file({"x": _digits(40)}, str(tmp_path / "fit.safetensors"))
    save_file({"x": _digits(60)[40:]}, str(tmp_path / "held.safetensors"))
    cal = load_calibration(tmp_path / "fit.safetensors", model, holdout=str(tmp_path / "held.safetensors"))
    assert (cal.fit_rows, cal.holdout_rows) == (40, 20)
    assert load_calibration(tmp_path / "fit.safetensors", model, holdout="0.25").holdout_rows == 10
    with pytest.raises(AuditError, match="not in \\[0, 1\\)"):
        load_calibration(tmp_path / "fit.safetensors", model, holdout=1.5)
