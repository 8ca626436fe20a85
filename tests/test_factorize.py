"""factorize(): exact parameter counts, outputs of the two-module layers, whitened init, save and load."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from auditor.calibration import input_statistics, load_calibration
from auditor.calibration.statistics.stats import by_name
from auditor.calibration.statistics.whiten import truncated_weight
from auditor.errors import AuditError
from auditor.factorize import count_params, factorize, load_factorized, resolve_plan, save_factorized
from auditor.structure.layers import ParamTable, collect_layers


def _digits(n: int) -> torch.Tensor:
    from sklearn.datasets import load_digits

    return torch.tensor(load_digits().data[:n], dtype=torch.float32) / 16.0


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_parameter_count_is_exact_and_the_input_untouched(digits_mlp):
    model = digits_mlp[0]
    before = _state(model)
    plan = {"fc1": 24, "fc2": 16, "fc3": 8}
    new = factorize(model, plan)
    # each planned layer: - m*n + r*(m+n); biases stay
    dense = 64 * 512 + 512 + 512 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10
    expected = dense - 512 * 64 + 24 * 576 - 512 * 512 + 16 * 1024 - 256 * 512 + 8 * 768
    assert count_params(model) == dense == 429_834
    assert count_params(new) == expected == 40_202
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert isinstance(new.fc2, nn.Sequential) and new.fc2[0].weight.shape == (16, 512)
    assert new.fc2[0].bias is None and new.fc2[1].bias is not None


def test_two_linears_compute_the_truncated_weight(digits_mlp):
    model = digits_mlp[0]
    x = _digits(200)
    cal = load_calibration({"x": x}, model, holdout=0)
    layers = by_name(collect_layers(model, ParamTable.of(model)))
    stats = input_statistics(model, layers, cal)
    for calibration in (None, stats):
        new = factorize(model, {"fc2": 12}, calibration)
        w_r = truncated_weight(layers["fc2"], model.fc2.weight, 12, None if calibration is None else stats.layers["fc2"])
        h = torch.relu(model.fc1(x))
        with torch.no_grad():
            torch.testing.assert_close(new.fc2(h), nn.functional.linear(h, w_r, model.fc2.bias), rtol=1e-4, atol=1e-5)
    # at full rank the factorization reproduces the dense layer
    full = factorize(model, {"fc3": 256})
    with torch.no_grad():
        torch.testing.assert_close(full(x), model(x), rtol=1e-4, atol=1e-4)


def test_whitened_init_keeps_outputs_closer_than_plain_svd(digits_mlp):
    model = digits_mlp[0]
    x = _digits(400)
    cal = load_calibration({"x": x}, model, holdout=0)
    with torch.no_grad():
        ref = model(x)
        plain = (factorize(model, {"fc2": 8})(x) - ref).norm()
        white = (factorize(model, {"fc2": 8}, cal)(x) - ref).norm()
    assert white < plain


@pytest.mark.parametrize("conv", [
    nn.Conv2d(6, 12, 3, padding=1, stride=2),
    nn.Conv2d(6, 12, (3, 1), padding="same", groups=3, bias=False, padding_mode="reflect"),
    nn.Conv1d(4, 8, 5, dilation=2, groups=2),
    nn.Conv3d(2, 6, 2, stride=(1, 2, 2)),
])
def test_conv_factorization(conv):
    torch.manual_seed(0)
    net = nn.Sequential(conv)
    layers = by_name(collect_layers(net, ParamTable.of(net)))
    layer = layers["0"]
    r = min(layer.m, layer.n) - 1
    new = factorize(net, {"0": r})
    g = conv.groups
    dense = count_params(net)
    assert count_params(new) == dense - g * layer.m * layer.n + g * r * (layer.m + layer.n)
    x = torch.randn(2, conv.in_channels, *([12] * len(conv.kernel_size)))
    w_r = truncated_weight(layer, conv.weight, r, None)
    ref = conv._conv_forward(x, w_r, conv.bias)
    with torch.no_grad():
        torch.testing.assert_close(new(x), ref, rtol=1e-4, atol=1e-5)
    full = factorize(net, {"0": min(layer.m, layer.n)})
    with torch.no_grad():
        torch.testing.assert_close(full(x), net(x), rtol=1e-4, atol=1e-5)


def test_embedding_factorization():
    torch.manual_seed(1)
    emb = nn.Embedding(50, 16, padding_idx=0)
    net = nn.Sequential(emb)
    new = factorize(net, {"0": 6})
    assert count_params(new) == 6 * (50 + 16) and isinstance(new[0][0], nn.Embedding)
    ids = torch.randint(0, 50, (4, 7))
    layer = by_name(collect_layers(net, ParamTable.of(net)))["0"]
    with torch.no_grad():
        torch.testing.assert_close(new(ids), truncated_weight(layer, emb.weight, 6, None)[ids], rtol=1e-5, atol=1e-6)
    full = factorize(net, {"0": 16})
    with torch.no_grad():
        torch.testing.assert_close(full(ids), net(ids), rtol=1e-5, atol=1e-5)


def test_hf_conv1d_factorization():
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(2)
    c = Conv1D(24, 10)  # nf=out 24, nx=in 10; weight stored (in, out)
    nn.init.normal_(c.bias)
    net = nn.Sequential(c)
    new = factorize(net, {"0": 4})
    assert count_params(new) == 24 * 10 + 24 - 240 + 4 * 34
    assert [type(m) for m in new[0]] == [nn.Linear, nn.Linear] and new[0][0].weight.shape == (4, 10)
    x = torch.randn(3, 5, 10)
    # the rank-4 Eckart-Young truncation of the stored (in, out) weight, from a float64 SVD: y = x W_4 + b
    u, s, vh = torch.linalg.svd(c.weight.detach().double(), full_matrices=False)
    w4 = (u[:, :4] * s[:4]) @ vh[:4]
    with torch.no_grad():  # float32 layers against float64: 1e-4 relative is float32 rounding, not a rank error
        torch.testing.assert_close(new(x).double(), x.double() @ w4 + c.bias.double(), rtol=1e-4, atol=1e-5)
    full = factorize(net, {"0": 10})
    with torch.no_grad():
        torch.testing.assert_close(full(x), net(x), rtol=1e-4, atol=1e-5)


def test_save_and_load_round_trip(tmp_path, digits_cnn):
    model = digits_cnn[0]
    x = _digits(64).reshape(-1, 1, 8, 8)
    cal = load_calibration({"x": x}, model, holdout=0)
    plan = {"conv2": 16, "fc1": 24}
    new = factorize(model, plan, cal)
    save_factorized(new, plan, tmp_path / "out", source="digits.py:cnn")
    back = load_factorized(model, tmp_path / "out")
    with torch.no_grad():
        assert torch.equal(back(x), new(x))
    removed = sum(l.params - l.params_at(r) for l, r in resolve_plan(model, plan).values())  # m*n - r*(m+n)
    assert count_params(back) == count_params(new) == count_params(model) - removed
    (tmp_path / "bad").mkdir()
    with pytest.raises(AuditError, match="plan.json does not exist"):
        load_factorized(model, tmp_path / "bad")


def test_plan_errors(digits_mlp):
    model = digits_mlp[0]
    with pytest.raises(AuditError, match="Did you mean fc2"):
        factorize(model, {"fc22": 8})
    with pytest.raises(AuditError, match="not an integer in 1..512"):
        factorize(model, {"fc2": 600})
    with pytest.raises(AuditError, match="not an integer"):
        factorize(model, {"fc2": 0})
    lstm = nn.Sequential(nn.LSTM(8, 8))
    with pytest.raises(AuditError, match="rewrites Linear"):
        factorize(lstm, {"0.weight_ih_l0": 2})

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(20, 8)
            self.head = nn.Linear(8, 20, bias=False)
            self.head.weight = self.emb.weight

    with pytest.raises(AuditError, match="shares its weight"):
        factorize(Tied(), {"emb": 4})


def test_a_module_reached_twice_is_replaced_once():
    lin = nn.Linear(16, 16)
    net = nn.Sequential(lin, nn.ReLU(), lin)
    new = factorize(net, {"0": 4})
    assert new[0] is new[2] and count_params(new) == 4 * 32 + 16


def test_surgery_takes_factors_or_a_truncation_callable_and_knows_no_calibration(digits_mlp):
    """auditor.surgery (below calibration) replaces layers with the factors it is handed: a mapping and a callable
    give the bits calibration.apply's whitened factorize writes; none gives the structure only."""
    from auditor import surgery
    from auditor.calibration.apply import truncation

    model = digits_mlp[0]
    cal = load_calibration({"x": _digits(256)}, model, holdout=0)
    plan = {"fc1": 24, "fc3": 8}
    resolved = surgery.checked_plan(model, plan)
    stats = input_statistics(model, [l for l, _ in resolved.values()], cal)
    want = factorize(model, plan, stats).state_dict()
    calls: list[tuple[str, tuple[int, ...], int]] = []
    whitened = truncation(stats)

    def spy(name, layer, weight, rank):
        calls.append((name, tuple(weight.shape), rank))
        return whitened(name, layer, weight, rank)

    by_callable = surgery.apply_plan(model, plan, spy).state_dict()
    assert calls == [("fc1", (512, 64), 24), ("fc3", (256, 512), 8)]  # each planned layer once, in plan order
    table = {n: whitened(n, l, model.get_submodule(n).weight, r) for n, (l, r) in resolved.items()}
    by_table = surgery.apply_plan(model, plan, table).state_dict()
    for got in (by_callable, by_table):
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    shell = surgery.apply_plan(model, plan)  # the structure only: the shapes of the factors, their values untouched
    assert {k: tuple(v.shape) for k, v in shell.state_dict().items()} == {k: tuple(v.shape) for k, v in want.items()}
    assert count_params(shell) == count_params(model) - sum(l.params - l.params_at(r) for l, r in resolved.values())
    with pytest.raises(AuditError, match="not a factorizable layer"):
        surgery.apply_plan(model, {"fc9": 2}, table)


def test_a_shared_copy_holds_the_models_own_tensors_and_the_same_outputs(digits_mlp):
    """share=True (for measuring a plan): the layers left dense are the model's own parameters, not copies; the
    factorized model computes what the unshared copy computes."""
    model = digits_mlp[0]
    x = _digits(32)
    plan = {"fc2": 16}
    shared, copied = factorize(model, plan, share=True), factorize(model, plan)
    assert shared.fc1.weight is model.fc1.weight and copied.fc1.weight is not model.fc1.weight
    assert shared.fc2[0].weight is not model.fc2.weight
    with torch.no_grad():
        assert torch.equal(shared(x), copied(x))


def test_a_saved_library_model_names_its_fit_in_plan_json(tmp_path, digits_mlp):
    """``auditor.factorize``'s copy carries the fit it was made with; ``save_factorized`` writes it into plan.json as
    ``lowrank-audit factorize`` does (the default fit with calibration, "svd" without)."""
    import auditor

    model = digits_mlp[0]
    cal = load_calibration({"x": _digits(200)}, model, holdout=0.25)
    for calibration, fit in ((cal, "sequential"), (None, "svd")):
        new = auditor.factorize(model, {"fc2": 32}, calibration=calibration)
        out = save_factorized(new, {"fc2": 32}, tmp_path / fit, source="digits.py:mlp")
        assert json.loads((out / "plan.json").read_text())["fit"] == getattr(new, "lowrank_fit") == fit
