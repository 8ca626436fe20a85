"""One calibration session per audit: the statistics read once, one evaluator (the dense reference measured once),
the tiers returning the report's own types, metrics declaring their direction, and ``lowrank-audit factorize``
reusing the audit's statistics instead of reading them again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import auditor
import auditor.calibration.measure.metric as metric_mod
import auditor.calibration.session as session_mod
import auditor.calibration.statistics.stream as stream_mod
from auditor.calibration import (
    CalibrationSession, Evaluator, Metric, curves_from_spectra, load_calibration, measure_floors, plan_for_budget,
    tier1,
)
from auditor.calibration.measure.verify import Verifier
from auditor.calresults import BudgetResult, FrontierPlan, LayerFloor
from auditor.factorize import factorize, load_factorized
from auditor.structure.layers import ParamTable, collect_layers

ROWS = 400
MODEL = "sample_models/digits.py:mlp"


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> Path:
    from safetensors.torch import save_file
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().data[:ROWS], dtype=torch.float32) / 16.0
    path = tmp_path_factory.mktemp("calib") / "digits_calib.safetensors"
    save_file({"x": x.contiguous()}, str(path))
    return path


def _layers(model: torch.nn.Module) -> dict:
    return collect_layers(model, ParamTable.of(model))


def _count(monkeypatch, module, name: str) -> list[int]:
    """Count the calls of ``module.name`` (still calling it)."""
    calls = [0]
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _count_evaluators(monkeypatch, cls: type = Evaluator) -> list[int]:
    calls = [0]
    real = cls.__init__

    def init(self, *args, **kwargs):
        calls[0] += 1
        real(self, *args, **kwargs)

    monkeypatch.setattr(cls, "__init__", init)
    return calls


def _plan(tmp_path: Path, ranks: dict[str, int]) -> Path:
    p = tmp_path / "plan.toml"
    p.write_text("[ranks]\n" + "".join(f'{k} = {v}\n' for k, v in ranks.items()))
    return p


def test_an_audit_reads_statistics_once_and_builds_one_evaluator(monkeypatch, calib, digits_mlp):
    model = digits_mlp[0]
    stats_calls = _count(monkeypatch, stream_mod, "stream_statistics")
    evaluators = _count_evaluators(monkeypatch)
    a = auditor.audit(model, torch.zeros(1, 64), plan={"ranks": {"fc1": 24, "fc2": 16}}, calibration=calib,
                      measure_floor=True, cache=False, progress=False)
    cal = a.calibration
    assert cal.measured_floors and cal.budget is not None and cal.plan_check is not None
    assert cal.evaluations > 0 and cal.plan_check.layers == 2
    assert stats_calls[0] == 1  # tier 1, 2, 3 and the plan check share the statistics
    assert evaluators[0] == 1  # and one dense reference


def test_cli_factorize_reuses_the_audits_statistics_and_records_the_exported_models_number(
        cli_inproc, monkeypatch, calib, tmp_path, digits_mlp):
    model = digits_mlp[0]
    monkeypatch.setenv("LOWRANK_AUDITOR_CACHE", str(tmp_path / "cache"))
    plan = _plan(tmp_path, {"fc1": 24, "fc2": 16})
    r = cli_inproc(MODEL, "--calibration", calib, "--plan", plan, "--format", "json")
    assert r.returncode in (0, 1), r.stderr
    audited = json.loads(r.stdout)["calibration"]["plan_check"]["measured"]
    assert list((tmp_path / "cache" / "calibration").glob("*/meta.json"))  # the audit wrote its statistics
    stats_calls = _count(monkeypatch, stream_mod, "stream_statistics")
    evaluators = _count_evaluators(monkeypatch)
    verifiers = _count_evaluators(monkeypatch, Verifier)
    out = tmp_path / "fact"
    r = cli_inproc("factorize", MODEL, "--plan", plan, "--calibration", calib, "-o", out)  # the default fit: the
    assert r.returncode == 0, r.stderr  # one the audit's plan check measured
    assert stats_calls[0] == 0  # read from the cache the audit wrote, once, and used for the factors too
    # the dense reference of each held-out row once: tier 3's search rows (their head, and their tail for the
    # plans near the tolerance: auditor/calibration/measure/staged.py) and the verification rows the plan check reads
    assert evaluators[0] == 0 and verifiers[0] == 3
    meta = json.loads((out / "plan.json").read_text())
    assert meta["init"] == "whitened" and meta["fit"] == "sequential" == meta["measured"]["fit"]
    back = load_factorized(model, out)
    cal = load_calibration(calib, model, 0.25)
    from auditor.calibration.measure.verify import split_rows, with_holdout

    verify = with_holdout(cal, split_rows(cal.holdout)[1])  # the plan is checked on the verification rows
    measured = Evaluator(model, verify).measure(back).value
    assert meta["measured"]["value"] == pytest.approx(measured, rel=1e-12)
    assert meta["measured"]["value"] == pytest.approx(audited, rel=1e-12)


def test_cli_factorize_without_cache_reads_statistics_once(cli_inproc, monkeypatch, calib, tmp_path):
    stats_calls = _count(monkeypatch, stream_mod, "stream_statistics")
    loads = _count(monkeypatch, session_mod, "load_calibration")
    r = cli_inproc("factorize", MODEL, "--plan", _plan(tmp_path, {"fc1": 24}), "--calibration", calib,
                   "-o", tmp_path / "f", "--no-cache")
    assert r.returncode == 0, r.stderr
    assert stats_calls[0] == 1 and loads[0] == 1


@pytest.mark.parametrize("argv, says", [
    (["factorize", MODEL, "-o", "x"], "the following arguments are required: --plan"),
    (["factorize", MODEL, "--plan", "p.toml", "-o", "x", "--tolerance", "abc"], "--tolerance: invalid float"),
    (["factorize", MODEL, "--plan", "p.toml", "-o", "x", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_cli_factorize_usage_errors_are_one_line_and_exit_2(cli_inproc, argv, says):
    r = cli_inproc(*argv)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and says in r.stderr, r.stderr
    assert r.stderr.rstrip().endswith("See lowrank-audit factorize --help.")


def test_the_cli_factorize_entry_alone_exits_2(capsys):
    from auditor.cli.factorize_command import main

    assert main(["--plan"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")


def test_tiers_return_the_report_types_and_share_one_session(monkeypatch, calib, digits_mlp):
    from auditor.calibration.references import references_of

    model = digits_mlp[0]
    layers = _layers(model)
    cal = load_calibration(calib, model, 0.25)
    session = CalibrationSession(model, cal, Metric(tolerance=0.02), layers=layers)
    stats_calls = _count(monkeypatch, session_mod, "input_statistics")
    evaluators = _count_evaluators(monkeypatch)
    stats, spectra = tier1(model, layers, session)
    assert stats is session.stats
    refs = references_of(session)  # the dense model measured once, for every tier (the session holds inputs only)
    floors = measure_floors(model, layers, session, align=8, spectra=spectra, evaluator=refs.evaluator)
    bp = plan_for_budget(model, layers, session, curves_from_spectra(spectra, layers, 8), measurer=refs.search)
    new = factorize(model, bp.plan, session)
    assert stats_calls[0] == 1 and evaluators[0] == 1
    f = floors.floors["fc1"]
    assert type(f) is LayerFloor and f.layer == "fc1" and f.init == "whitened" and f.points
    assert type(bp) is BudgetResult and all(type(p) is FrontierPlan for p in [*bp.tries, *bp.frontier])
    assert bp.evaluations == len(bp.tries) and bp.tolerance == 0.02 and bp.reference == 0.0
    assert sum(p.numel() for p in new.parameters()) == bp.params_after
    # the same numbers as the calls given raw data (each building its own session)
    alone = plan_for_budget(model, layers, cal, curves_from_spectra(spectra, layers, 8), tolerance=0.02)
    assert (alone.plan, alone.metric, alone.removed) == (bp.plan, bp.metric, bp.removed)
    # the working fields stay out of the report's dictionary
    from auditor.calresults import CalibrationReport, LayerCalibration, report_dict

    rep = CalibrationReport("s", "0.25", "d", 1, 1, "m", False, 0.02, 0.0, budget=bp,
                            layers={"fc1": LayerCalibration("fc1", 1, 64, {}, None, "keep dense", "", [], floor=f)})
    d = rep.to_dict()
    assert "tries" not in d["budget"] and "plan" not in d["budget"]["frontier"][0]
    assert "start_rank" not in d["layers"]["fc1"]["floor"] and "layer" not in d["layers"]["fc1"]["floor"]
    assert list(d["budget"]["frontier"][0]) == ["removed", "removed_fraction", "metric", "ok", "layers", "top1",
                                                "status", "verification", "uniform"]
    assert report_dict(f)["points"] == f.points


def test_a_session_belongs_to_its_model(calib, digits_mlp):
    model = digits_mlp[0]
    session = CalibrationSession(model, load_calibration(calib, model, 0.25))
    with pytest.raises(auditor.errors.AuditError, match="another model"):
        factorize(torch.nn.Sequential(torch.nn.Linear(64, 8)), {"0": 2}, session)
    assert CalibrationSession.of(session, model) is session
    other = CalibrationSession.of(session, model, tolerance=0.5)
    assert other is not session and other.metric.tolerance == 0.5 and other.calibration is session.calibration


def test_metrics_declare_their_direction():
    assert Metric().higher_is_better is False
    assert Metric(kind="perplexity").higher_is_better is False and Metric(kind="kl").higher_is_better is False
    assert Metric(fn=lambda m, b: 1.0).higher_is_better is True
    assert Metric(fn=lambda m, b: 1.0, higher_is_better=False).higher_is_better is False
    with pytest.raises(ValueError, match="lower-is-better"):
        Metric(kind="output", higher_is_better=True)
    with pytest.raises(ValueError, match="True or False"):
        Metric(fn=lambda m, b: 1.0, higher_is_better="no")


def _loss_against(dense):
    """A loss, lower is better: the mean squared distance of the logits from a frozen copy of the dense model's."""
    import copy

    frozen = copy.deepcopy(dense).eval()

    def loss(model, batches) -> float:
        total = 0.0
        for x in batches:
            x = x["x"] if isinstance(x, dict) else x
            total += float((model(x) - frozen(x)).pow(2).mean())
        return total / len(batches)

    return loss


def test_a_lower_is_better_user_metric_holds_and_costs_in_its_direction(calib, digits_mlp):
    model = digits_mlp[0]
    cal = load_calibration(calib, model, 0.25)
    loss = _loss_against(model)
    ev = Evaluator(model, cal, Metric(loss, tolerance=0.1, higher_is_better=False))
    ref = ev.reference
    assert ref == 0.0
    assert ev.holds(ref + 0.1) and not ev.holds(ref + 0.11) and ev.holds(ref - 5)
    assert ev.cost(ref + 0.25) == pytest.approx(0.25) and ev.cost(ref - 1) == 0.0
    hib = Evaluator(model, cal, Metric(lambda m, b: -loss(m, b), tolerance=0.1))
    assert hib.holds(hib.reference - 0.1) and not hib.holds(hib.reference - 0.11)


def test_a_declared_direction_that_the_metric_contradicts_is_refused(calib, digits_mlp):
    model = digits_mlp[0]
    cal = load_calibration(calib, model, 0.25)
    with pytest.raises(auditor.errors.AuditError, match="falls when the model is cut down"):
        loss = _loss_against(model)
        Evaluator(model, cal, Metric(lambda m, b: -loss(m, b), tolerance=1e-6, higher_is_better=False))


def test_the_audit_refuses_a_lower_is_better_user_metric(calib, digits_mlp):
    model = digits_mlp[0]
    with pytest.raises(auditor.errors.AuditError, match="declared lower-is-better"):
        auditor.audit(model, torch.zeros(1, 64), calibration=calib, cache=False, progress=False,
                      metric=Metric(_loss_against(model), higher_is_better=False))


def test_a_user_metric_refuses_the_loss_aware_fit_and_fits_sequentially_without_a_gradient(calib, digits_mlp):
    """factorize's loss-aware fit reads the metric's gradient moments: a user metric has none, so that fit is refused
    in one line (the library's spelling), while the sequential fit truncates W* whitened and still writes a model."""
    from auditor.calibration.session import CalibrationSession

    model = digits_mlp[0]
    cal = load_calibration(calib, model, 0.25)
    session = CalibrationSession.of(cal, model, metric=Metric(_loss_against(model), tolerance=0.1,
                                                              higher_is_better=False))
    plan = {"fc1": 16}
    with pytest.raises(auditor.errors.AuditError) as err:
        auditor.factorize(model, plan, calibration=session, fit="loss-aware")
    assert err.value.what == (f"fit='loss-aware' needs a metric with a gradient; the metric "
                              f"{session.metric.label!r} has none")
    assert err.value.fix == "Use fit='sequential' or fit='independent' with a user metric"
    seq = auditor.factorize(model, plan, calibration=session, fit="sequential")
    from auditor.calibration.tiers.sensitivity import loss_metric
    from auditor.surgery import checked_plan

    assert loss_metric(session, model, [l for l, _ in checked_plan(model, plan).values()]) is None  # no gradient
    dense = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in seq.parameters()) == dense - 512 * 64 + 16 * (512 + 64)
