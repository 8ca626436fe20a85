"""Issue 51, parts 2 and 3: nothing in a calibrated plan rests on a data-free guess (a layer calibration cannot rank,
such as an embedding whose ids the calibration never looks up, stays dense; an embedding it covers is searched like
any layer), and the tool never suggests a failing plan (when no plan that factorizes a layer holds, the suggestion is
empty, the verdict says that nothing can be removed, and every format shows what the looser tolerances buy, read from
the plans measured)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

import auditor
from auditor.results import Verdict

MODEL = '''
import torch
from torch import nn


class Lookup(nn.Module):
    """A 1,024-id embedding of rank 4 (its data-free 95%-energy rank 8 saves 7.5x) before a two-layer MLP, and a
    rank-4 layer the forward never calls (no statistics)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(1024, 64)
        self.fc1 = nn.Linear(64, 256)
        self.fc2 = nn.Linear(256, 64)
        self.spare = nn.Linear(256, 256)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(1024, 4, generator=g) @ torch.randn(4, 64, generator=g) / 2)
            self.spare.weight.copy_(torch.randn(256, 4, generator=g) @ torch.randn(4, 256, generator=g))
            for fc in (self.fc1, self.fc2):
                fc.weight.copy_(torch.randn(fc.weight.shape, generator=g) / fc.in_features ** 0.5)
                fc.bias.zero_()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.emb(idx))))


def build() -> nn.Module:
    return Lookup().eval()
'''


@pytest.fixture(scope="module")
def lookup(tmp_path_factory) -> tuple[str, Path, Path]:
    """The model's source, a calibration that looks up 100 of its 1,024 ids, and one that looks up every id."""
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("lookup")
    (d / "lookup.py").write_text(MODEL)
    n = torch.arange(96 * 32)
    save_file({"idx": ((n * 7) % 100).reshape(96, 32).contiguous()}, str(d / "few.safetensors"))
    save_file({"idx": ((n * 7) % 1024).reshape(96, 32).contiguous()}, str(d / "all.safetensors"))
    return f"{d / 'lookup.py'}:build", d / "few.safetensors", d / "all.safetensors"


def _audit(spec: str, calibration: Path | None = None, plan: dict | None = None) -> auditor.Audit:
    options = auditor.AuditOptions(cache=False, progress=False,
                                   **({"calibration": str(calibration)} if calibration is not None else {}))
    return auditor.audit_source(spec, options=options, plan=plan)


def _measured_only(a: auditor.Audit) -> None:
    """Every layer the suggestion factorizes is in the plan the search measured, at its rank, and calibration spans
    its inputs; no plan measured holds a layer it did not rank."""
    b = a.calibration.budget
    planned = {k: s.rank for k, s in a.suggestions.items() if s.verdict is Verdict.FACTORIZE}
    assert planned == b.plan and b.fixed == {}
    assert all(a.calibration.layers[k].spans for p in b.plans for k in p.plan)


def test_an_embedding_the_calibration_does_not_cover_stays_dense(lookup):
    spec, few, _ = lookup
    free = _audit(spec)
    assert (free.suggestions["emb"].verdict, free.suggestions["emb"].rank) == (Verdict.FACTORIZE, 8)
    a = _audit(spec, few)
    lc = a.calibration.layers["emb"]
    assert (lc.seen, lc.width, lc.spans) == (100, 1024, False)
    s = a.suggestions["emb"]
    assert (s.verdict, s.rank) == (Verdict.KEEP_DENSE, None)
    assert s.reason.startswith("calibration did not span its inputs (100 of 1,024 rows looked up): kept dense")
    _measured_only(a)
    assert not any("emb" in p.plan for p in a.calibration.budget.plans)
    assert [f for f in a.findings if f.code == "LR014"] == []  # the plan keeps it dense: nothing truncated blind
    # a plan of the user's may still name it, and LR014 says the rank is blind to the 924 ids never looked up
    mine = _audit(spec, few, plan={"ranks": {"emb": 8}})
    lr014 = [f for f in mine.findings if f.code == "LR014"]
    assert [(f.layers, f.evidence["missing"]) for f in lr014] == [(["emb"], 924)]


def test_an_embedding_the_calibration_covers_is_searched_like_any_layer(lookup):
    spec, _, every = lookup
    a = _audit(spec, every)
    lc = a.calibration.layers["emb"]
    assert (lc.seen, lc.width, lc.spans) == (1024, 1024, True)
    _measured_only(a)
    assert a.calibration.budget.plan["emb"] == 8  # the search's rank, measured all at once with the others
    assert a.suggestions["emb"].reason.startswith("rank 8 in the plan that holds all at once")
    # a layer with no statistics is no data-free guess in the plan either
    free = _audit(spec).suggestions["spare"]
    assert (free.verdict, free.rank) == (Verdict.FACTORIZE, 8) and a.calibration.missing == {
        "spare": "never called on the calibration inputs"}
    s = a.suggestions["spare"]
    assert (s.verdict, s.reason) == (Verdict.KEEP_DENSE, "keep dense: never called on the calibration inputs, so no "
                                                         "plan measured it")


DIGITS = "sample_models/digits.py:mlp"


EMPTY = "nothing can be removed within the tolerance 0.0001%: no plan measured all at once holds it"
NOTHING = f"{EMPTY}, so the suggested plan is empty"  # the verdict's sentence


def test_when_no_plan_holds_the_suggestion_is_empty_and_the_looser_tolerances_are_shown(cli_inproc, digits_images,
                                                                                         tmp_path):
    pypdf = pytest.importorskip("pypdf")
    from bs4 import BeautifulSoup

    r = cli_inproc(DIGITS, "--calibration", digits_images, "--tolerance", "0.000001", "--no-cache", "--format",
                   "text,json,md,html,pdf", "-o", tmp_path, "--emit-plan", tmp_path / "plan.toml",
                   "--fail-on", "unmeasured")
    assert r.returncode == 0, r.stderr  # the tool's own (empty) suggestion is no failure, at the strictest --fail-on
    d = json.loads((tmp_path / "lowrank-audit.json").read_text())
    assert d["status"] == "pass" and d["verdict"] == f"PASS: no errors or warnings; {NOTHING}"
    b = d["calibration"]["budget"]
    assert b["plan"] == {} and b["removed"] == 0 and all(s["rank"] is None for s in d["suggestions"].values())
    assert not any(p["ok"] for p in b["plans"] if p["removed"])
    # what 2%, 5% and 10% buy: the largest plan measured whose value holds each (fc2 and fc3; then fc1 as well)
    got = [(x["tolerance"], x["removed"], x["layers"], x["verification"]) for x in b["looser"]]
    assert got == [(0.02, 311_296, 2, None), (0.05, 407_040, 3, None), (0.1, 407_040, 3, None)]
    assert [round(x["removed_fraction"], 12) for x in b["looser"]] == [round(311_296 / 429_834, 12),
                                                                      round(407_040 / 429_834, 12)] + \
        [round(407_040 / 429_834, 12)]
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((Path(__file__).resolve().parents[1] / "docs" / "schema.json").read_text())
    jsonschema.validate(d, schema)
    assert "looser" in schema["properties"]["calibration"]["properties"]["budget"]["properties"]
    byplan = {p["removed"]: p["metric"] for p in b["plans"]}
    assert [x["metric"] for x in b["looser"]] == [byplan[311_296], byplan[407_040], byplan[407_040]]
    assert 0.02 < byplan[407_040] <= 0.05  # so 2% buys the smaller plan only
    text = " ".join(r.stdout.split())
    md = (tmp_path / "lowrank-audit.md").read_text()
    html = " ".join(BeautifulSoup((tmp_path / "lowrank-audit.html").read_text(), "html.parser").get_text(
        " ", strip=True).split())
    pdf = " ".join(" ".join(p.extract_text() for p in pypdf.PdfReader(
        io.BytesIO((tmp_path / "lowrank-audit.pdf").read_bytes())).pages).split())
    looser = "within 2%, 72.4% of the parameters removed (311,296, 2 layers;"
    for fmt, body in (("text", text), ("md", md), ("html", html), ("pdf", pdf)):
        assert NOTHING in body, fmt
        assert looser in body and "within 5%, 94.7% of the parameters removed (407,040, 3 layers;" in body, fmt
    # the plan section says why it is empty (not "no layer is worth factorizing at the target energy")
    assert f"- **Plan**: none; {EMPTY}" in md and f"No layer is factorized: {EMPTY}." in html and \
        f"No layer is factorized: {EMPTY}." in pdf and EMPTY in text  # the terminal wraps at its width
    plan = (tmp_path / "plan.toml").read_text()
    assert "[ranks]\n\n" in plan and "Nothing can be removed within the tolerance 0.0001%" in plan
    assert "within 2% 72.4% removed" in plan


def test_when_no_plan_verified_holds_the_suggestion_is_the_empty_plan(monkeypatch):
    """Plans that held on the search rows but whose verification misses or straddles the tolerance are never
    suggested: the verification falls back to the empty plan, each plan it verified keeps its verification, and the
    smallest of them is the smallest that failed."""
    import contextlib
    from types import SimpleNamespace

    from auditor.calibration import apply
    from auditor.calibration.tiers import passes
    from auditor.calresults import BudgetResult, FrontierPlan, Verification

    monkeypatch.setattr(apply, "measured_copy", lambda model, plan, stats, reuse: plan)  # the plan is the "model"
    values = {8: 0.013, 16: 0.011}  # layer a's rank -> the verified value: 0.013 misses, 0.011 straddles 0.01

    class Verifier:
        evaluations = 0

        def measure(self, plan):
            v = values[plan["a"]]
            return Verification(v, v - 0.002, v + 0.002, 0.9, 100, False, v - 0.002 <= 0.01 < v + 0.002)

    refs = SimpleNamespace(verifier=Verifier(), search_rows=100)
    session = SimpleNamespace(stats=None, measuring=contextlib.nullcontext,
                              metric=SimpleNamespace(spec=SimpleNamespace(zero_on_dense=True)))
    tries = [FrontierPlan(600, 0.6, 0.009, True, 1, plan={"a": 8}, target=600),
             FrontierPlan(400, 0.4, 0.007, True, 1, plan={"a": 16}, target=400),
             FrontierPlan(800, 0.8, 0.02, False, 1, plan={"a": 4}, target=800)]
    budget = BudgetResult({"a": 8}, "gradient", None, 600, 0.6, 0.009, True, None, frontier=[tries[0]],
                          smallest_failing=800, params_before=1000, params_after=400, tolerance=0.01, tries=tries)
    out = passes.verify(None, session, budget, refs)
    assert (out.plan, out.removed, out.removed_fraction, out.metric, out.ok) == ({}, 0, 0.0, 0.0, True)
    assert (out.params_after, out.verification, out.smallest_failing) == (1000, None, 400)
    assert [p.verification.value if p.verification else None for p in out.tries] == [0.013, 0.011, None]
    assert budget.plan == {"a": 8} and budget.tries[0].verification is None  # the search's result as it was
    settled = out.settled()
    assert [p.status for p in settled.plans] == ["failed verification", "failed verification", "failed"]
    from auditor.render.parts.calibration import missed_words

    assert missed_words(settled) == ("every plan measured missed the tolerance (2 held on the search rows and failed "
                                     "verification)")


def test_looser_tolerances_read_the_measured_plans_in_the_metrics_own_units():
    """Each looser tolerance takes the largest measured plan (within the budget) whose value, and verified value
    where verified, holds it: a relative increase at the same shares, a higher-is-better metric below its dense
    value by the looser tolerance."""
    from auditor.calresults import BudgetResult, FrontierPlan, MetricFacts, Verification, looser_plans

    def plan(removed: int, value: float, verified: float | None = None) -> FrontierPlan:
        v = Verification(verified, verified - 0.001, verified + 0.001, 0.9, 80, False, False) if verified else None
        return FrontierPlan(removed, removed / 1000, value, False, 2, plan={"a": removed}, verification=v)

    tries = [plan(100, 0.015, 0.019), plan(200, 0.018, 0.021), plan(300, 0.04), plan(500, 0.2), plan(900, 0.01)]
    budget = BudgetResult({}, "gradient", 0.6, 0, 0.0, 0.0, True, None, params_before=1000, tries=tries)
    increase = MetricFacts("perplexity increase", False, 0.01, 40.0, 0.01, "percent", "perplexity")
    got = [(lp.tolerance, lp.removed, lp.metric, lp.verification.value if lp.verification else None)
           for lp in looser_plans(budget, increase)]
    # 2%: the 200 plan's verified value misses it (2.1%), so the 100 plan; 10%: not 500 (20%), not 900 (past 60%)
    assert got == [(0.02, 100, 0.015, 0.019), (0.05, 300, 0.04, None), (0.1, 300, 0.04, None)]
    # a tolerance of 5% leaves only 10% looser; an accuracy (higher is better, dense 0.9) reads the drop from it
    acc = MetricFacts("held-out accuracy", True, 0.05, 0.9, 0.85, "number")
    values = [plan(100, 0.86), plan(200, 0.84), plan(400, 0.79), plan(500, 0.81)]
    budget = BudgetResult({}, "gradient", None, 0, 0.0, 0.9, True, None, params_before=1000, tries=values)
    assert [(lp.tolerance, lp.removed, lp.metric) for lp in looser_plans(budget, acc)] == [(0.1, 500, 0.81)]
    assert acc.loosened(0.1).limit == pytest.approx(0.8) and increase.loosened(0.05).limit == pytest.approx(0.05)
    nothing = BudgetResult({}, "gradient", None, 0, 0.0, 0.0, True, None, params_before=1000, tries=[plan(10, 0.5)])
    assert [(lp.removed, lp.metric) for lp in looser_plans(nothing, increase)] == [(0, None)] * 3
