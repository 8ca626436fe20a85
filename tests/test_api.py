"""The api layer: ``auditor.audit`` returns a front object over the plain result, and ``auditor.factorize`` is both
the module and the top-level function that takes a plan the way ``audit`` does."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import auditor
from auditor import api, pipeline, results
from auditor.errors import AuditError
from auditor.factorize import count_params
from auditor.render import report

OUTPUTS = ("to_dict", "to_json", "to_text", "to_markdown", "to_html", "to_pdf", "to_pandas", "_repr_html_", "groups",
           "emit_plan", "_render")


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16, bias=False), nn.ReLU(), nn.Linear(16, 8, bias=False))
    with torch.no_grad():
        m[0].weight.copy_(torch.eye(16))  # 16 equal singular values: E(r) = r / 16
    return m


def test_the_plain_result_knows_no_reader_and_the_front_object_has_every_output():
    assert [name for name in OUTPUTS if hasattr(results.AuditResult, name)] == []
    assert all(callable(getattr(api.Audit, name)) for name in OUTPUTS)
    assert auditor.Audit is api.Audit and issubclass(api.Audit, results.AuditResult)
    plain = pipeline.audit(nn.Linear(8, 4), spectra=False)
    assert type(plain) is results.AuditResult
    a = api.Audit.of(plain)
    assert type(a) is api.Audit and api.Audit.of(a) is a and a == api.Audit.of(plain) and type(a.plain()) is results.AuditResult
    assert a.to_json() == report.to_json(plain) and a.to_markdown() == report.to_markdown(plain)
    assert a.to_dict() == report.to_dict(plain) and a._repr_html_() == report.notebook_html(plain)
    assert a._render("md") == a.to_markdown() and a.groups()[0].size == 1 and "[ranks]" in a.emit_plan()
    moved = dataclasses.replace(a, notes=["a note"])
    assert type(moved) is api.Audit and moved.notes == ["a note"] and '"a note"' in moved.to_json()
    assert repr(a) == repr(plain) == "<Audit Linear: 36 params, 1 factorizable layers, 0 findings>"


def test_one_audit_name_the_old_plain_name_still_imports_with_a_warning():
    """``Audit`` names the front object only; the plain result is ``AuditResult`` in every module of auditor/, and
    ``results.Audit`` (its old name) still resolves, with a DeprecationWarning, for code written before."""
    import ast
    from pathlib import Path

    pkg = Path(auditor.__file__).parent
    old = [f"{p.relative_to(pkg)}:{node.lineno}" for p in sorted(pkg.rglob("*.py"))
           for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
           if (isinstance(node, ast.ImportFrom) and (node.module or "").endswith("results")
               and any(a.name == "Audit" for a in node.names))
           or (isinstance(node, ast.Attribute) and node.attr == "Audit" and isinstance(node.value, ast.Name)
               and node.value.id == "results")]
    assert old == []
    with pytest.warns(DeprecationWarning, match="AuditResult"):
        assert results.Audit is results.AuditResult
    assert api.Audit.__name__ == "Audit" and results.AuditResult.__name__ == "AuditResult"


def test_audit_and_audit_source_return_the_front_object():
    assert type(auditor.audit(nn.Linear(8, 4), spectra=False)) is api.Audit
    a = auditor.audit_source("sample_models/digits.py:mlp", options=auditor.AuditOptions(spectra=False))
    assert type(a) is api.Audit and a.model_name == "DigitsMLP"


def test_factorize_takes_a_plan_file_as_audit_does(tmp_path):
    model = _model()
    plan = tmp_path / "plan.toml"
    plan.write_text('[ranks]\n"0" = "energy:0.25"\n"2" = "0.5be"\n', encoding="utf-8")
    reviewed = {it.layer: it.rank for it in auditor.audit(model, plan=plan).review.items}
    assert reviewed == {"0": 4, "2": 2}  # E(4) = 0.25; break-even 16*8/24 = 5.33, half of it floored
    for given in (plan, str(plan), {"ranks": {"0": "energy:0.25", "2": "0.5be"}}, {"0": 4, "2": 2}):
        new = auditor.factorize(model, given)
        assert count_params(new) == 4 * (16 + 16) + 2 * (16 + 8) == 176
        assert [type(new[i]).__name__ for i in (0, 2)] == ["Sequential", "Sequential"]
    assert torch.equal(model[0].weight, torch.eye(16))  # the input untouched


def test_factorize_with_calibration_data_matches_the_statistics_route():
    from auditor.calibration import input_statistics, load_calibration
    from auditor.factorize import factorize, resolve_plan

    model = _model()
    data = {"input": torch.randn(64, 16, generator=torch.Generator().manual_seed(1))}
    cal = load_calibration(data, model)
    want = factorize(model, {"2": 3}, input_statistics(model, [resolve_plan(model, {"2": 3})["2"][0]], cal)).state_dict()
    for given in (data, cal):
        got = auditor.factorize(model, {"2": 3}, calibration=given, fit="independent").state_dict()
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    default = auditor.factorize(model, {"2": 3}, calibration=cal)  # the default fit: the command's, named
    assert default.lowrank_fit == "sequential" and not torch.equal(default.state_dict()["2.0.weight"], want["2.0.weight"])
    plain = auditor.factorize(model, {"2": 3}).state_dict()
    assert not torch.equal(plain["2.0.weight"], want["2.0.weight"])  # the whitened factors differ from the SVD's


def test_factorize_fit_sequential(tmp_path):
    """fit="sequential": the library's sequential truncators on the calibration's fit rows; statistics alone (no rows)
    and an unknown fit are one line each."""
    from auditor.calibration import input_statistics, load_calibration
    from auditor.calibration.apply import sequential
    from auditor.factorize import resolve_plan

    from auditor.calibration import CalibrationSession, Metric
    from auditor.calibration.tiers.sensitivity import loss_metric

    model = _model()
    data = {"input": torch.randn(64, 16, generator=torch.Generator().manual_seed(1))}
    cal = load_calibration(data, model)
    plan = {"0": 4, "2": 3}
    session = CalibrationSession.of(cal, model, metric=Metric())  # what the library picks for a model like this
    kept = loss_metric(session, model, [l for l, _ in resolve_plan(model, plan).values()])
    assert kept is not None  # returned, not written on the session: the caller passes it on
    seq = sequential(session, model, resolve_plan(model, plan), loss_metric=kept).truncators  # the pass's moments
    assert seq["2"].both  # a loss-aware truncation's factors (w or z beside its bases), pinned at the plan's rank
    got = auditor.factorize(model, plan, calibration=cal, fit="sequential")
    a, b = seq["2"].factors(3)
    assert torch.equal(got.state_dict()["2.1.weight"], torch.from_numpy(a[0]).float())
    ind = auditor.factorize(model, plan, calibration=cal, fit="loss-aware").state_dict()
    assert torch.equal(got.state_dict()["0.0.weight"], ind["0.0.weight"]) or \
        torch.allclose(got.state_dict()["0.0.weight"], ind["0.0.weight"], atol=1e-6)  # the first layer: same inputs
    assert not torch.allclose(got.state_dict()["2.0.weight"], ind["2.0.weight"], atol=1e-4)
    stats = input_statistics(model, [l for l, _ in resolve_plan(model, plan).values()], cal)
    with pytest.raises(AuditError, match="the sequential fit needs the calibration rows; InputStatistics holds none"):
        auditor.factorize(model, plan, calibration=stats, fit="sequential")
    with pytest.raises(AuditError, match="fit 'greedy' is not a way to fit the factors"):
        auditor.factorize(model, plan, calibration=cal, fit="greedy")
    for fit, calibration in (("independent", cal), ("loss-aware", cal), ("sequential", None)):
        with pytest.raises(AuditError, match=r"refit_dense=True refits the dense layers in the sequential fit, which "
                                             r"needs a calibration and fit='sequential' \(got "):
            auditor.factorize(model, plan, calibration=calibration, fit=fit, refit_dense=True)
    same = auditor.factorize(model, plan, calibration=cal, fit="sequential", refit_dense=True)  # no layer kept dense
    assert all(torch.equal(v, got.state_dict()[k]) for k, v in same.state_dict().items())
    only = auditor.factorize(model, {"0": 4}, calibration=cal, fit="sequential", refit_dense=True)
    assert not torch.equal(only.state_dict()["2.weight"], model.state_dict()["2.weight"])  # it reads moved inputs
    assert torch.equal(model.state_dict()["0.weight"], torch.eye(16))  # the model is never written
    spelled = auditor.factorize(model, {"0": 4}, calibration=cal, fit="sequential, refit dense")  # apply.Fit's value
    assert all(torch.equal(v, only.state_dict()[k]) for k, v in spelled.state_dict().items())  # loss-aware as well


def test_factorize_refuses_bad_input_with_one_line(tmp_path):
    model = _model()
    with pytest.raises(AuditError, match=r"plan file .*missing\.toml does not exist"):
        auditor.factorize(model, tmp_path / "missing.toml")
    with pytest.raises(AuditError, match="not a factorizable layer"):
        auditor.factorize(model, {"fc9": 2})
    with pytest.raises(AuditError, match="'ranks' is a list, not a table"):
        auditor.factorize(model, {"ranks": [2]})
    with pytest.raises(AuditError, match="a plan must be a path or a dict, got int"):
        auditor.factorize(model, 5)
    with pytest.raises(AuditError, match="needs the model as an nn.Module, got dict"):
        auditor.factorize({"0.weight": torch.eye(4)}, {"0": 2})
    empty = tmp_path / "empty.toml"
    empty.write_text('[ranks]\n"nothing.*" = 2\n', encoding="utf-8")
    with pytest.raises(AuditError, match=r"pattern 'nothing\.\*' matches no factorizable layer"):
        auditor.factorize(model, empty)
