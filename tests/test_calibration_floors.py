"""Tier 2 (measured floors) and tier 3 (a budgeted plan checked all at once) on the trained digits models."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from auditor.calibration import load_calibration, measure_floors, plan_for_budget, tier1
from auditor.calibration.tiers.budget import curves_from_floors, curves_from_spectra
from auditor.calibration.measure.metric import Evaluator, Metric
from auditor.calibration.statistics.stats import by_name
from auditor.calibration.tiers.sweep import block_of, floor_from_points
from auditor import lrmath
from auditor.factorize import count_params, factorize
from auditor.structure.layers import ParamTable, collect_layers


def _data(image: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    return (x.reshape(-1, 1, 8, 8) if image else x), torch.tensor(d.target)


@pytest.fixture(scope="module")
def mlp_setup():
    from digits import mlp

    model = mlp()[0]
    x, y = _data()
    cal = load_calibration({"x": x[:1200]}, model, holdout=0.25, batch_size=300)
    layers = by_name(collect_layers(model, ParamTable.of(model)))
    stats, spectra = tier1(model, layers, cal, align=8)
    return model, cal, layers, stats, spectra, y[:1200][-300:]


def test_measured_floors_equal_a_brute_force_sweep(mlp_setup):
    model, cal, layers, stats, spectra, _ = mlp_setup
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for tol in (0.01, 0.05):
        fast = measure_floors(model, layers, cal, tol, align=8, stats=stats, spectra=spectra)
        brute = measure_floors(model, layers, cal, tol, align=8, stats=stats, search="all", prefix_cache=False)
        assert {k: f.floor for k, f in fast.floors.items()} == {k: f.floor for k, f in brute.floors.items()}
        assert fast.evaluations < brute.evaluations / 2
        for name, f in fast.floors.items():
            b = dict(brute.floors[name].points)
            for r, v in f.points:  # replaying the prefix from the cache gives the numbers a full forward gives
                assert v == pytest.approx(b[r], rel=1e-6, abs=1e-9)
            if f.floor is not None:
                assert f.metric_at_floor <= tol and all(v <= tol for r, v in brute.floors[name].points if r >= f.floor)
                assert f.compression == pytest.approx(layers[name].compression(f.floor))
            if f.cliff_rank is not None:
                assert f.cliff_rank == f.floor - 8 and f.cliff_metric > tol
    # the known numbers at 1% output error: fc2 holds from rank 8, fc1 from 24, head (break-even 9.6) never
    fl = measure_floors(model, layers, cal, 0.01, align=8, stats=stats, spectra=spectra).floors
    assert (fl["fc1"].floor, fl["fc2"].floor, fl["fc3"].floor, fl["head"].floor) == (24, 8, 8, None)
    assert fl["head"].keep_dense and "keep dense (measured)" in fl["head"].reason
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_user_metric_accuracy_cliff(mlp_setup):
    model, cal, layers, stats, spectra, labels = mlp_setup

    def accuracy(m: nn.Module, batches: list) -> float:
        right = sum(int((m(**b).argmax(1) == labels[300 * i: 300 * (i + 1)]).sum()) for i, b in enumerate(batches))
        return right / len(labels)

    only = {"fc2": layers["fc2"]}
    fast = measure_floors(model, only, cal, 0.01, align=2, metric=accuracy, stats=stats, spectra=spectra)
    brute = measure_floors(model, only, cal, 0.01, align=2, metric=accuracy, stats=stats, search="all")
    f = fast.floors["fc2"]
    assert fast.higher_is_better and fast.reference == pytest.approx(accuracy(model, [b.kwargs for b in cal.holdout]))
    assert f.floor == brute.floors["fc2"].floor
    acc = dict(brute.floors["fc2"].points)
    assert acc[f.floor] >= fast.reference - 0.01 > f.cliff_metric == acc[f.floor - 2]
    assert acc[2] < fast.reference - 0.2  # a sharp cliff: rank 2 loses over 20 points
    assert len(f.points) <= 12


def test_cnn_floors_with_prefix_cache_equal_full_forward():
    from digits import cnn

    model = cnn()[0]
    x, _ = _data(image=True)
    cal = load_calibration({"x": x[:600]}, model, holdout=0.5, batch_size=100)
    layers = by_name(collect_layers(model, ParamTable.of(model)))
    layers = {k: layers[k] for k in ("conv2", "fc1")}
    stats, spectra = tier1(model, layers, cal, align=4)
    a = measure_floors(model, layers, cal, 0.02, align=4, stats=stats, spectra=spectra)
    b = measure_floors(model, layers, cal, 0.02, align=4, stats=stats, spectra=spectra, prefix_cache=False)
    assert a.prefix_cache and not b.prefix_cache
    for name in layers:
        assert a.floors[name].points == b.floors[name].points
    assert block_of(model, "conv2") == "conv2"


def test_block_is_the_deepest_list_element():
    net = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    assert block_of(net, "1.0") == "1.0"

    class Enc(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.ModuleDict({"ff": nn.Linear(4, 4)}) for _ in range(2)])
            self.head = nn.Linear(4, 2)

    enc = Enc()
    assert block_of(enc, "layers.1.ff") == "layers.1" and block_of(enc, "head") == "head"


def test_floor_rule_needs_every_larger_rank_to_hold():
    assert floor_from_points({8: False, 16: True, 24: False, 32: True, 40: True}) == 32
    assert floor_from_points({8: True, 16: True}) == 8
    assert floor_from_points({8: True, 16: False}) is None


def test_budgeted_plan_is_measured_all_at_once(mlp_setup):
    model, cal, layers, stats, spectra, _ = mlp_setup
    floors = measure_floors(model, layers, cal, 0.02, align=8, stats=stats, spectra=spectra)
    curves = curves_from_floors(floors, layers)
    plan = plan_for_budget(model, layers, cal, curves, tolerance=0.02, stats=stats)
    assert plan.ok and plan.metric <= 0.02 and plan.plan
    new = factorize(model, plan.plan, stats)
    assert count_params(new) == plan.params_after == plan.params_before - plan.removed
    ev = Evaluator(model, cal, Metric(tolerance=0.02))
    assert ev.measure(new).value == plan.metric  # the same number, not an estimate
    assert plan.removed_fraction == pytest.approx(plan.removed / count_params(model))
    assert 3 <= len(plan.frontier) <= 5
    removed = [p.removed for p in plan.frontier]
    assert removed == sorted(removed) and any(p.removed == plan.removed for p in plan.frontier)
    # a budget: the first plan removes at least that share; the chosen one is it, or a smaller one that holds
    b = plan_for_budget(model, layers, cal, curves, budget=0.5, tolerance=0.02, stats=stats)
    first = b.tries[0]
    assert first.removed >= 0.5 * b.params_before and b.ok
    assert b.plan == first.plan if first.ok else b.removed < first.removed
    # more than the layers can hold at once: backed off
    big = plan_for_budget(model, layers, cal, curves, budget=0.95, tolerance=0.02, stats=stats)
    assert not big.tries[0].ok and big.ok and big.removed < big.tries[0].removed
    assert count_params(factorize(model, b.plan, stats)) == b.params_after
    # tier-1 curves (no sweep) give a plan too, checked the same way
    t1 = plan_for_budget(model, layers, cal, curves_from_spectra(spectra, layers, 8), tolerance=0.02, stats=stats)
    assert t1.ok and t1.source == "tier1"


def test_default_metric_against_a_direct_computation(mlp_setup):
    from auditor.errors import AuditError

    model, cal, *_ = mlp_setup
    new = factorize(model, {"fc2": 4})
    ev = Evaluator(model, cal, Metric(tolerance=0.05))
    m = ev.measure(new)
    x = torch.cat([b.kwargs["x"] for b in cal.holdout])
    with torch.no_grad():
        y, y0 = new(x).double(), model(x).double()
    assert m.value == pytest.approx(float((y - y0).norm() / y0.norm()), rel=1e-9)
    assert m.top1 == float((y.argmax(1) == y0.argmax(1)).double().mean())
    assert m.ok == (m.value <= 0.05) and ev.cost(0.1) == pytest.approx(0.01)
    with pytest.raises(AuditError, match="returned nan"):
        Evaluator(model, cal, Metric(fn=lambda m, b: float("nan")))


def test_measured_curves_fill_unvisited_ranks_with_the_measured_gain(mlp_setup):
    """Between the ranks the guided search measured, an option costs (g(r) e(r))^2: the tier-1 layer-output error
    scaled by the measured/layer-output gain, log-linear in rank between measured ranks and flat beyond."""
    model, cal, layers, stats, spectra, _ = mlp_setup
    floors = measure_floors(model, layers, cal, 0.02, align=8, stats=stats, spectra=spectra)
    sparse = curves_from_floors(floors, layers)
    full = curves_from_floors(floors, layers, spectra)
    for name, f in floors.floors.items():
        layer = by_name(layers)[name]
        grid = list(range(8, lrmath.max_useful_rank(layer.m, layer.n) + 1, 8))
        opts = {o.rank: o for o in full.options.get(name, [])}
        measured = {r: v for r, v in f.points if lrmath.saves(layer.m, layer.n, r)}
        assert {o.rank: o.cost for o in sparse.options.get(name, [])} == {r: v * v for r, v in measured.items()}
        if not measured:
            continue
        assert sorted(opts) == grid  # every grid rank below break-even is an option
        spec = spectra[name]
        gains = sorted((r, v / spec.error_at(r)) for r, v in f.points)
        for r in grid:
            if r in measured:
                assert opts[r].cost == measured[r] ** 2
                continue
            below = [g for g in gains if g[0] < r]
            above = [g for g in gains if g[0] > r]
            if below and above:
                (r1, g1), (r2, g2) = below[-1], above[0]
                g = math.exp(math.log(g1) + (r - r1) / (r2 - r1) * (math.log(g2) - math.log(g1)))
            else:
                g = (above or below)[0 if above else -1][1]
            assert opts[r].cost == pytest.approx((g * spec.error_at(r)) ** 2, rel=1e-12)
            assert opts[r].saved == layer.params - layer.params_at(r)
