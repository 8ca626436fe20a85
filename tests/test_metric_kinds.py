"""Metrics the way layer kinds are: a metric registered by one module gets tier-1 targets, floors, the plan search,
the plan check and the reports. The worked example (docs/design.md, "Adding a metric") is top-1 agreement with the
dense model, a higher-is-better built-in in its own units: everything the audit does with it comes from this one
``MetricKind`` subclass."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import auditor
from auditor.calibration import load_calibration, metrics, tier1
from auditor.calibration.measure.metric import Evaluator, Metric
from auditor.calibration.metrics import Measurement, MetricKind, Scorer, main_output
from auditor.structure.layers import ParamTable, collect_layers

# ---- the whole metric: one module's worth -------------------------------------------------------------------------


class _Top1(Scorer):
    """The dense model's arg-max class of every held-out row, kept; a model's share of rows that agree with it."""

    def __init__(self, ev, dense: nn.Module) -> None:
        super().__init__(ev)
        with torch.no_grad():
            self.classes = [main_output(ev.forward(dense, b, i)).argmax(-1) for i, b in enumerate(ev.batches)]
        self.reference = 1.0  # the dense model agrees with itself

    def measure(self, model: nn.Module) -> Measurement:
        agree = rows = 0
        with torch.no_grad():
            for i, (b, dense) in enumerate(zip(self.ev.batches, self.classes)):
                agree += int((main_output(self.ev.forward(model, b, i)).argmax(-1) == dense).sum())
                rows += dense.numel()
        return self.judged(agree / rows)


class Top1Agreement(MetricKind):
    """Top-1 agreement with the dense model: higher is better, 1 on the dense model, holds when it is at least
    1 - tolerance; the plan search adds up each layer's drop."""

    kind = "top1"
    names = ("top1", "top1-agreement")
    label = "top-1 agreement"
    units = "a share of the held-out rows"
    higher_is_better = True
    zero_on_dense = False  # in its own units, against the dense model's value (1)

    def scorer(self, ev, dense: nn.Module) -> Scorer:
        return _Top1(ev, dense)


# ---- the test -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def top1():
    from digits import mlp
    from sklearn.datasets import load_digits

    kind = metrics.register(Top1Agreement())
    try:
        x = torch.tensor(load_digits().data[:400], dtype=torch.float32) / 16.0
        yield mlp()[0], x
    finally:
        metrics.unregister(kind)


def _agreement(model: nn.Module, dense: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(-1) == dense(x).argmax(-1)).double().mean())


def test_a_metric_registered_by_one_module_is_named_directed_and_judged(top1):
    assert metrics.for_name(" Top1-Agreement ") == "top1" and "top1" in metrics.kinds()
    m = Metric(kind="top1", tolerance=0.02)
    assert (m.higher_is_better, m.label, m.tier1_target, m.output_error) == (True, "top-1 agreement", 0.01, False)
    assert m.holds(0.98, 1.0) and not m.holds(0.97, 1.0)
    assert (m.cost(0.97, 1.0), m.cost(1.0, 1.0), m.tolerance_cost) == (pytest.approx(0.03), 0.0, 0.02)
    with pytest.raises(ValueError, match="higher-is-better; it cannot be declared otherwise"):
        Metric(kind="top1", higher_is_better=False)
    with pytest.raises(ValueError, match="takes no function"):
        Metric(lambda model, batches: 1.0, kind="top1")
    assert Metric(tolerance=0.02).tier1_target == 0.02  # the output error is tier 1's own units
    model, x = top1
    cal = load_calibration({"x": x}, model, holdout=0.25)
    ev = Evaluator(model, cal, m)
    half = copy.deepcopy(model)
    with torch.no_grad():  # a head with noise: some rows change class
        half.head.weight.add_(0.1 * torch.randn(half.head.weight.shape, generator=torch.Generator().manual_seed(0)))
    held = x[300:]
    assert ev.reference == 1.0 and ev.warnings == []
    got = ev.measure(half)
    assert 0.5 < got.value < 0.98 and not got.ok
    assert got.value == pytest.approx(_agreement(half, model, held), abs=1e-12)


def test_the_registered_metric_gets_tier1_targets_floors_the_plan_search_the_plan_check_and_reports(top1):
    model, x = top1
    plan = {"fc2": 16, "fc3": 16}
    a = auditor.audit(model, x[:4], plan={"ranks": plan}, calibration={"x": x}, metric="top1-agreement",
                      tolerance=0.02, measure_floor=True, cache=False, progress=False)
    cal = a.calibration
    assert (cal.metric, cal.higher_is_better, cal.reference, cal.tolerance) == ("top-1 agreement", True, 1.0, 0.02)
    # tier 1 ranked for 1% layer-output error (the metric is not in those units), not for its 0.02 tolerance
    layers = collect_layers(model, ParamTable.of(model))
    calib = load_calibration({"x": x}, model, holdout=0.25)
    _, at1 = tier1(model, layers, calib, align=8, target=0.01)
    _, at2 = tier1(model, layers, calib, align=8, target=0.02)
    assert cal.tier1_target == 0.01
    assert {k: lc.suggested for k, lc in cal.layers.items()} == {k: s.suggested for k, s in at1.items()}
    assert {k: s.suggested for k, s in at1.items()} != {k: s.suggested for k, s in at2.items()}
    # tier 2: each floor holds (at least 1 - 0.02 agreement) and the rank below it does not; its points measure
    # the layer truncated alone
    held = x[300:]
    floors = {k: lc.floor for k, lc in cal.layers.items() if lc.floor is not None and lc.floor.floor is not None}
    assert floors
    for name, f in floors.items():
        assert f.metric_at_floor >= 0.98 and all(v >= 0.98 for r, v in f.points if r >= f.floor)
        if f.cliff_rank is not None:
            assert f.cliff_metric < 0.98
    name, f = next(iter(floors.items()))
    alone = auditor.factorize(model, {name: f.floor}, calib, fit="independent")  # what tiers 2 and 3 measure
    assert f.metric_at_floor == pytest.approx(_agreement(alone, model, held), abs=1.5 / len(held))
    # tier 3: the plan searched holds, measured all at once on the held-out rows
    b = cal.budget
    assert b is not None and b.plan and b.ok and b.metric >= 0.98 and b.removed > 0
    searched = auditor.factorize(model, b.plan, calib, fit="independent")
    assert b.metric == pytest.approx(_agreement(searched, model, held), abs=1.5 / len(held))
    # the plan check: the reviewed plan at once, judged against the dense value
    pc = cal.plan_check
    reviewed = auditor.factorize(model, plan, calib)
    assert pc is not None and pc.layers == 2 and pc.ok == (pc.measured >= 0.98)
    assert pc.measured == pytest.approx(_agreement(reviewed, model, held), abs=1.5 / len(held))
    # the reports say it in the metric's own units
    words = f"held-out top-1 agreement 1 -> {pc.measured:.4g} (tolerance -0.02)"
    assert words in a.to_text() and words in a.to_markdown()
    assert '"metric": "top-1 agreement"' in a.to_json() and "top-1 agreement" in a.to_html()


def test_the_registry_refuses_a_metric_it_could_not_judge():
    class RowsAgainstDense(Top1Agreement):
        kind = "rows_against_dense"
        verified_by_rows = True  # an interval's upper end judged against the tolerance: only zero-on-dense metrics

    with pytest.raises(ValueError, match="verified row by row, so it must be zero on the dense model"):
        metrics.register(RowsAgainstDense())
    with pytest.raises(TypeError, match="register needs a MetricKind"):
        metrics.register(object())  # type: ignore[arg-type]
    assert "rows_against_dense" not in metrics.kinds() and metrics.for_name("rows_against_dense") is None
    with pytest.raises(ValueError, match="metric kind must be one of output, perplexity, kl, masked, pooled, user"):
        Metric(kind="rows_against_dense")


def test_each_metric_says_its_limit_and_display_form_and_a_hand_made_report_follows_the_built_in_rule():
    """The renderers read ``CalibrationReport.limit`` / ``display`` (written from the kind), never the direction."""
    from auditor.calibration import metrics as registry
    from auditor.calresults import CalibrationReport

    out = {k: (registry.for_kind(k).limit(2.0, 0.5, False), registry.for_kind(k).display(False))
           for k in ("output", "perplexity", "kl", "masked")}
    assert out == {"output": (0.5, "percent"), "perplexity": (0.5, "percent"), "kl": (0.5, "number"),
                   "masked": (0.5, "percent")}  # zero on the dense model: the tolerance itself; KL in nats
    user = registry.for_kind("user")
    assert (user.limit(2.0, 0.5, True), user.display(True)) == (1.5, "number")
    assert (user.limit(2.0, 0.5, False), user.display(False)) == (2.5, "number")  # the dense value moved the wrong way
    made = CalibrationReport("c", "0.25", "", 1, 1, "accuracy", True, 0.05, 0.9)
    assert (made.limit, made.display, made.facts.shortfall(0.8), made.facts.shortfall(0.9)) == (
        pytest.approx(0.85), "number", pytest.approx(0.05), pytest.approx(-0.05))


# ---- the metric's facts: what the reports ask of a value, in one place --------------------------------------------


def _facts(kind: str, label: str, higher: bool, tolerance: float, reference: float):
    """The facts a report carries for a metric of ``kind``, from what the kind says of itself (as the stage does)."""
    from auditor.calresults import MetricFacts

    k = metrics.for_kind(kind)
    return MetricFacts(label, higher, tolerance, reference, k.limit(reference, tolerance, higher), k.display(higher),
                       k.increase_of)


def test_a_lower_is_better_metric_holds_at_most_its_tolerance_and_reads_in_percent():
    out = _facts("output", "relative output error", False, 0.01, 0.0)
    assert (out.limit, out.display, out.fails_above, out.from_dense) == (0.01, "percent", True, False)
    assert [out.holds(x) for x in (0.0099, 0.01, 0.0101, float("nan"))] == [True, True, False, False]
    assert [out.words(x) for x in (0.009936, 0.0106, 0.4229, 0.0, None, float("inf"))] == [
        "0.994%", "1.06%", "42.3%", "0%", "\u2013", "\u2013"]
    assert out.tolerance_words() == "1%"
    assert out.change(0.009937) == "relative output error 0.994% (tolerance 1%)"
    assert out.change(float("inf")) == "relative output error infinite (tolerance 1%)"
    assert out.change(None) == "relative output error: not measured"
    assert (out.judged(0.0058, True), out.judged(0.0201, False)) == ("0.580% \u2264 1%", "2.01% > 1%")
    assert out.judged(0.0058, True, tolerance=False) == "0.580% \u2264 1%"  # a limit's tolerance is always said
    half = _facts("output", "relative output error", False, 0.25, 0.0)
    assert (half.shortfall(0.5), half.shortfall(0.125)) == (0.25, -0.125)  # positive: misses by that much


def test_a_relative_increase_reads_signed_beside_the_dense_value():
    ppl = _facts("perplexity", "perplexity increase", False, 0.01, 153.77)
    assert (ppl.limit, ppl.display, ppl.fails_above, ppl.from_dense) == (0.01, "percent", True, True)
    assert [ppl.holds(x) for x in (-0.002, 0.009112, 0.0125)] == [True, True, False]
    assert [ppl.words(x) for x in (0.009112, -0.002, 0.0)] == ["+0.911%", "-0.200%", "0%"]
    assert ppl.tolerance_words() == "+1%"
    assert ppl.change(0.009112) == "held-out perplexity 153.77 -> 155.17 (+0.911%, tolerance +1%)"
    assert ppl.change(float("inf")) == "held-out perplexity 153.77 -> infinite (perplexity infinite, tolerance +1%)"
    assert ppl.judged(0.0125, False) == "+1.25% > +1%"


def test_a_higher_is_better_metric_holds_down_to_the_dense_value_less_the_tolerance():
    acc = _facts("user", "accuracy", True, 0.125, 0.875)
    assert (acc.limit, acc.display, acc.fails_above, acc.from_dense) == (0.75, "number", False, True)
    assert [acc.holds(x) for x in (0.9, 0.75, 0.7, float("nan"))] == [True, True, False, False]
    assert [acc.words(x) for x in (0.8765432, 0.75, None)] == ["0.8765", "0.75", "\u2013"]
    assert acc.tolerance_words() == "0.125"
    assert acc.change(0.8) == "held-out accuracy 0.875 -> 0.8 (tolerance -0.125)"
    assert acc.judged(0.8, True) == "0.8 (dense 0.875, tolerance 0.125)"
    assert acc.judged(0.8, True, tolerance=False) == "0.8 (dense 0.875)"
    assert (acc.shortfall(0.5), acc.shortfall(1.0)) == (0.25, -0.25)


def test_a_percentage_is_never_higher_is_better_and_the_report_carries_its_facts_into_the_json():
    from auditor.calresults import CalibrationReport, MetricFacts

    with pytest.raises(ValueError, match="written as a percentage .* is lower-is-better"):
        MetricFacts("accuracy", True, 0.01, 0.9, 0.89, "percent")
    made = CalibrationReport("c", "0.25", "", 1, 1, "accuracy", True, 0.125, 0.875)
    assert made.facts == MetricFacts("accuracy", True, 0.125, 0.875, 0.75, "number")
    d = made.to_dict()
    assert (d["limit"], d["display"]) == (0.75, "number")
    assert list(d).index("limit") > list(d).index("reference")  # written after the fields it is built from
