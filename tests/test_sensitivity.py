"""Gradient sensitivity (auditor/calibration/tiers/fisher.py) and the search/verification split with its bootstrap interval
(auditor/calibration/measure/verify.py), against closed forms and hand computations on tiny models."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from auditor.calibration import Metric, input_statistics, load_calibration
from auditor.calibration.tiers.fisher import OutputGradients, gradient_costs, output_gradients
from auditor.calibration.data.inputs import Batch, Calibration
from auditor.calibration.measure.metric import Evaluator
from auditor.calibration.statistics.stats import by_name
from auditor.calibration.measure.verify import RESAMPLES, Verifier, split_rows, with_holdout
from auditor.calibration.statistics.whiten import whitened_spectrum
from auditor.structure.layers import ParamTable, collect_layers


class Two(nn.Module):
    """A wide map (16 -> 6) and a tall one (6 -> 24), with an embedding in front."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(10, 16)
        self.wide = nn.Linear(16, 6)
        self.tall = nn.Linear(6, 24)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tall(torch.tanh(self.wide(self.emb(idx))))


def _setup(rows: int = 64):
    model = Two().eval()
    idx = torch.randint(0, 10, (rows, 5), generator=torch.Generator().manual_seed(1))
    cal = load_calibration({"idx": idx}, model, holdout=0.25)
    layers = by_name(collect_layers(model, ParamTable.of(model)))
    stats = input_statistics(model, layers, cal)
    return model, cal, layers, stats


@pytest.mark.parametrize("name", ["wide", "tall", "emb"])
def test_gradient_costs_are_the_tier1_curve_when_every_output_direction_counts_alike(name):
    """With G = I (the loss is the layer's own squared output error) and c = 1 / ||F X^T||^2, the predicted cost at
    rank r is the squared tier-1 layer-output error e(r)^2 exactly: sum_{i>r} q_i u_i^T u_i over the total. A tall
    map carries the gradient back through F, so there G = I arrives as F^T F."""
    model, cal, layers, stats = _setup()
    layer = layers[name]
    w = dict(model.named_parameters())[layer.param]
    inp = stats.layers[name]
    spec = whitened_spectrum(layer, w, inp, align=1)
    f = (w.detach().double().T if name == "emb" else w.detach().double()).numpy()
    out, width = f.shape
    carried = out > width
    second = (f.T @ f) if carried else np.eye(out)
    grads = OutputGradients({name: second * 7}, {name: 7}, {name: carried}, 1.0 / spec.output_norm ** 2, False, 0, 0.0)
    cost = gradient_costs(layer, w, inp, grads)
    assert len(cost) == len(spec.error)
    for r in range(len(cost)):
        assert cost[r] == pytest.approx(spec.error_at(r) ** 2, rel=1e-9, abs=1e-12), r


def test_output_gradients_estimate_the_gauss_newton_matrix():
    """For the last layer of an output-error audit J = I: the random projections' second moment E[w w^T] = I,
    estimated from 2 samples of 4,096 positions x 24 outputs to within a few percent; the scale is 1 / ||Y||^2."""
    model = Two().eval()
    idx = torch.randint(0, 10, (1024, 4), generator=torch.Generator().manual_seed(2))
    cal = Calibration([Batch(kwargs={"idx": idx})], [])
    layers = by_name(collect_layers(model, ParamTable.of(model)))
    g = output_gradients(model, [layers["tall"], layers["wide"]], cal, Metric())
    assert g.passes == 2 and not g.carried["wide"] and g.carried["tall"] and g.count["tall"] == 2 * 4096
    with torch.no_grad():
        y = model(idx).double()
        h = model.wide(model.emb(idx)).tanh().reshape(-1, 6).double()
    assert g.scale == pytest.approx(1.0 / float(y.pow(2).sum()), rel=1e-12)
    mean = g.second["tall"] / g.count["tall"]  # F^T E[w w^T] F: F^T F within the sampling error
    f = model.tall.weight.detach().double().numpy()
    assert np.linalg.norm(mean - f.T @ f) / np.linalg.norm(f.T @ f) < 0.05
    assert not any(p.grad is not None for p in model.parameters())  # no parameter gradient is touched
    del h


def test_split_rows_cuts_the_held_out_rows_in_two_contiguous_parts():
    b1 = Batch(kwargs={"x": torch.arange(6)[:, None].float()})
    b2 = Batch(kwargs={"x": torch.arange(6, 10)[:, None].float()})
    search, verify = split_rows([b1, b2])
    assert [b.kwargs["x"].flatten().tolist() for b in search] == [[0, 1, 2, 3, 4]]
    assert [b.kwargs["x"].flatten().tolist() for b in verify] == [[5], [6, 7, 8, 9]]
    one = Batch(kwargs={"x": torch.zeros(1, 1)})
    assert split_rows([one]) == ([one], [one])  # one row cannot be cut


@pytest.mark.parametrize("kind", ["output", "perplexity"])
def test_verification_value_and_bootstrap_interval_by_hand(kind):
    """The verifier's value equals the evaluator's on the same rows; its interval is the central 90% of the metric
    recomputed on RESAMPLES draws of rows (numpy's default_rng(0)), here recomputed by hand from per-row sums."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10)).eval()
    idx = torch.randint(0, 10, (40, 6), generator=torch.Generator().manual_seed(3))
    verify = [Batch(args=(idx[:25],)), Batch(args=(idx[25:],))]
    new = nn.Sequential(model[0], nn.Linear(8, 10)).eval()
    with torch.no_grad():
        new[1].weight.copy_(model[1].weight * 0.97)
        new[1].bias.copy_(model[1].bias)
    metric = Metric(kind=kind, tolerance=0.05)
    v = Verifier(model, verify, metric, confidence=0.9).measure(new)
    ev = Evaluator(model, Calibration([], verify), metric)
    assert v.value == pytest.approx(ev.measure(new).value, rel=1e-9) and v.rows == 40
    with torch.no_grad():
        y, r = new(idx).double(), model(idx).double()
    if kind == "output":
        num, den = (y - r).pow(2).sum((1, 2)).numpy(), r.pow(2).sum((1, 2)).numpy()

        def value(i):
            return math.sqrt(num[i].sum() / den[i].sum())
    else:
        def nll(z):
            lp = torch.log_softmax(z[:, :-1].float(), -1).double()
            return -lp.gather(-1, idx[:, 1:, None]).squeeze(-1).sum(1).numpy()

        a, b, c = nll(y), nll(r), np.full(40, 5.0)

        def value(i):
            return math.expm1((a[i].sum() - b[i].sum()) / c[i].sum())
    draws = np.random.default_rng(0).integers(0, 40, size=(RESAMPLES, 40))
    vals = np.array([value(d) for d in draws])
    lo, hi = np.quantile(vals, [0.05, 0.95])
    assert v.low == pytest.approx(min(lo, v.value), rel=1e-6) and v.high == pytest.approx(max(hi, v.value), rel=1e-6)
    # beside it the interval for an unseen document: no documents named, so blocks of rows, the length the first lag
    # where the per-row values' autocorrelation falls below 2 / sqrt(40), at least ceil(40^(1/3)) = 4, at most 10
    per_row = np.array([value(np.array([i])) for i in range(40)])
    d = per_row - per_row.mean()
    acf = [float(d[:-k] @ d[k:] / (d @ d)) for k in range(1, 10)]
    lag = next((k for k, r in enumerate(acf, 1) if abs(r) < 2 / math.sqrt(40)), 10)
    block = min(10, max(lag, 4))
    u = v.unseen
    assert (u.kind, u.block, u.groups, u.unit) == ("blocks", block, math.ceil(40 / block), "rows")  # none named

    def blocks(seed):
        starts = np.random.default_rng(seed).integers(0, 40 - block + 1, size=(RESAMPLES, math.ceil(40 / block)))
        return [np.concatenate([np.arange(s, s + block) for s in row])[:40] for row in starts]

    shifts = np.array([value(x) - value(y) for x, y in zip(blocks(0), blocks(1))])
    ulo, uhi = np.quantile(v.value + shifts, [0.05, 0.95])
    assert u.low == pytest.approx(min(ulo, v.value), rel=1e-6) and u.high == pytest.approx(max(uhi, v.value), rel=1e-6)
    assert v.ok is (u.high <= 0.05) and v.straddles is (u.low <= 0.05 < u.high)  # judged on the unseen interval


def test_a_plan_straddling_the_tolerance_is_said_to_and_rows_needed_named():
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(4))
    new = nn.Sequential(nn.Linear(4, 4)).eval()
    with torch.no_grad():
        new[0].weight.copy_(model[0].weight * 0.9)
        new[0].bias.copy_(model[0].bias)
    ver = Verifier(model, [Batch(args=(x,))], Metric(tolerance=1.0))
    v0 = ver.measure(new)
    tol = (v0.low + v0.high) / 2  # a tolerance inside the interval
    v = Verifier(model, [Batch(args=(x,))], Metric(tolerance=tol)).measure(new)
    assert v.straddles and not v.ok and "straddles the tolerance" in v.words(tol)
    u = v.unseen  # the interval judged: for an unseen document (blocks of rows: the rows name no documents)
    assert u.kind == "blocks" and u.low <= v.low <= v.high <= u.high
    half = (u.high - u.low) / 2
    want = min(0.25 * tol, abs(v.value - tol))  # the interval must shrink past the value's distance to the line
    assert v.rows_needed == math.ceil(12 * (half / want) ** 2) > 12


def test_cli_default_is_gradients_and_probe_and_confidence_flags(cli_inproc, tmp_path):
    """The default calibrated audit costs layers by gradients (source "gradient", a predicted curve per planned
    layer); --confidence sets the interval's level; a level outside (0, 1) is one line, exit 2."""
    import json

    from safetensors.torch import save_file
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().data[:400], dtype=torch.float32) / 16.0
    calib = tmp_path / "c.safetensors"
    save_file({"x": x.contiguous()}, str(calib))
    r = cli_inproc("sample_models/digits.py:mlp", "--calibration", calib, "--no-cache", "--confidence", "0.8",
                   "--format", "json", "-o", tmp_path / "o", "-q")
    assert r.returncode == 0, r.stderr
    d = json.loads((tmp_path / "o" / "lowrank-audit.json").read_text())["calibration"]
    assert d["budget"]["source"] == "gradient" and d["layers"]["fc1"]["predicted"]
    assert d["plan_check"]["verification"]["confidence"] == 0.8
    assert d["plan_check"]["basis"].startswith("gradient-predicted")
    bad = cli_inproc("sample_models/digits.py:mlp", "--calibration", calib, "--confidence", "1.5", "-q")
    assert bad.returncode == 2 and bad.stderr.count("\n") <= 2 and "--confidence 1.5" in bad.stderr
    assert "Traceback" not in bad.stderr
