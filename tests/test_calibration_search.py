"""Tier 3's search at the cost it needs (auditor/calibration/tiers/budget.py): the bracket aimed by the scaled prediction
ends where the plain doubling-and-bisecting search ends, with no more plans; the settings as one object or as
keywords; and the gradient pass's rows (auditor/calibration/stage.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from auditor.calibration import load_calibration, plan_for_budget, tier1
from auditor.calibration.tiers import budget as budget_mod
from auditor.calibration.tiers.budget import RESOLUTION, SearchFields, SearchSettings, curves_from_spectra
from auditor.calibration.data.inputs import Batch, Calibration
from auditor.calibration.tiers.sensitivity import gradient_rows
from auditor.calibration.statistics.stats import by_name
from auditor.structure.layers import ParamTable, collect_layers


@pytest.fixture(scope="module")
def mlp_setup():
    from digits import mlp
    from sklearn.datasets import load_digits

    model = mlp()[0]
    x = torch.tensor(load_digits().data[:600], dtype=torch.float32) / 16.0
    cal = load_calibration({"x": x}, model, holdout=0.5, batch_size=300)
    layers = by_name(collect_layers(model, ParamTable.of(model)))
    stats, spectra = tier1(model, layers, cal, align=8)
    return model, cal, layers, stats, curves_from_spectra(spectra, layers, 8)


def _plain(monkeypatch) -> None:
    """The search before: no guided steps, the bracket bisected at its midpoint."""
    monkeypatch.setattr(budget_mod, "GUIDED_STEPS", 0)
    monkeypatch.setattr(budget_mod._Aim, "between", lambda self, ok_at, ok_p, fail_at, fail_p, gap:
                        ok_at + (fail_at - ok_at) / 2)


@pytest.mark.parametrize("tol", [0.02, 0.05])
def test_the_guided_search_closes_the_bracket_with_no_more_plans_than_bisection(mlp_setup, monkeypatch, tol):
    model, cal, layers, stats, curves = mlp_setup
    guided = plan_for_budget(model, layers, cal, curves, tolerance=tol, stats=stats)
    with monkeypatch.context() as m:
        _plain(m)
        plain = plan_for_budget(model, layers, cal, curves, tolerance=tol, stats=stats)
    for b in (guided, plain):
        assert b.ok and b.metric <= tol and not b.exhausted
        above = [p.removed for p in b.tries if not p.ok and p.removed > b.removed]
        assert b.smallest_failing == min(above)  # the bracket closed: within the resolution, or nothing between
        closer = b.smallest_failing - b.removed <= RESOLUTION * b.params_before
        assert closer or not any(b.removed < p.removed < b.smallest_failing for p in b.tries)
    assert len(guided.tries) <= len(plain.tries)
    assert abs(guided.removed - plain.removed) <= RESOLUTION * guided.params_before


def test_the_settings_are_keywords_each_checked(mlp_setup):
    """One form: keywords (typed for type checkers by ``SearchFields``); a settings object or a misspelt keyword is
    refused."""
    model, cal, layers, stats, curves = mlp_setup
    b = plan_for_budget(model, layers, cal, curves, budget=0.3, tolerance=0.05, stats=stats)
    assert b.budget == 0.3 and b.tolerance == 0.05 and b.ok
    assert set(SearchFields.__annotations__) == {f.name for f in dataclasses.fields(SearchSettings)}
    with pytest.raises(TypeError):
        plan_for_budget(model, layers, cal, curves, SearchSettings(budget=0.3))  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        plan_for_budget(model, layers, cal, curves, tolerence=0.05)


def test_the_gradient_pass_reads_the_same_share_of_every_fit_batch():
    ids = torch.arange(100 * 64).reshape(100, 64) % 50
    fit = [Batch((), {"input_ids": ids[i:i + 25]}) for i in range(0, 100, 25)]
    cal = Calibration(fit, [], warnings=["kept"])
    sub, share = gradient_rows(cal, positions=1024)  # 16 of 100 rows: 4 from each batch of 25, joined in one batch
    assert [b.rows for b in sub.fit] == [16] and share == pytest.approx(0.16)
    assert torch.equal(sub.fit[0].kwargs["input_ids"], torch.cat([b.kwargs["input_ids"][:4] for b in fit]))
    big, _ = gradient_rows(cal, positions=4000)  # 64 of 100 rows, 16 from each batch: 25 rows a batch at most
    assert [b.rows for b in big.fit] == [16, 16, 16, 16]
    assert sub.warnings is cal.warnings and cal.fit == fit
    same, one = gradient_rows(cal, positions=100 * 64)
    assert same is cal and one == 1.0
