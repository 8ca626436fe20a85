"""The calibration stage end to end on the digits MLP: the command line's numbers equal the library's (tier-1 ranks,
measured floors, the budget plan), the statistics cache, `lowrank-audit factorize` and its round trip, and bad
calibration data exiting 2 with one line and no report."""

from __future__ import annotations

import math

import json
from pathlib import Path

import pytest
import torch
from threadpoolctl import threadpool_limits

import auditor
from auditor.calibration import (
    curves_from_floors, curves_from_spectra, input_statistics, load_calibration, measure_floors, plan_for_budget, tier1,
)
from auditor.calibration.statistics.stats import by_name
from auditor.factorize import factorize, load_factorized, resolve_plan
from auditor.structure.layers import ParamTable, collect_layers

ROWS = 400  # 300 for statistics, 100 held out
MODEL = "sample_models/digits.py:mlp"


@pytest.fixture(autouse=True)
def _one_blas_thread():
    """The library's calls here run as the stage runs them (NumPy's BLAS on one thread): the same bits, and no
    thread pools spinning on a loaded machine."""
    with threadpool_limits(limits=1, user_api="blas"):
        yield


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> Path:
    from safetensors.torch import save_file
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().data[:ROWS], dtype=torch.float32) / 16.0
    path = tmp_path_factory.mktemp("calib") / "digits_calib.safetensors"
    save_file({"x": x.contiguous()}, str(path))
    return path


def _layers(model: torch.nn.Module) -> dict:
    return by_name(collect_layers(model, ParamTable.of(model)))


def _split(cal):
    """(the search part, the verification part) of the held-out rows, as the audit cuts them."""
    from auditor.calibration.measure.verify import split_rows, with_holdout

    search, verify = split_rows(cal.holdout)
    return with_holdout(cal, search), with_holdout(cal, verify)


def _split_session(model, cal, stats):
    """A session cut as the audit's is: tier 3 measures on the search rows in stages (staged.py), as the audit does."""
    from auditor.calibration.session import CalibrationSession

    return CalibrationSession(model, cal, stats=stats, split=True)


def _json(cli_inproc, out: Path, *args: str, code: int = 0, fmt: str = "json") -> dict:
    r = cli_inproc(MODEL, "--format", fmt, "-o", out, "-q", *args)
    assert r.returncode == code, r.stderr
    return json.loads((out / "lowrank-audit.json").read_text())


def test_tier1_ranks_and_suggestions_are_the_librarys(cli_inproc, calib, tmp_path, digits_mlp):
    model = digits_mlp[0]
    d = _json(cli_inproc, tmp_path, "--calibration", calib, "--cache-dir", tmp_path / "cache", "--no-probe",
              fmt="json,md")
    md = (tmp_path / "lowrank-audit.md").read_text()
    assert "### Calibration" in md and "recovery fine-tune follows" in md
    cal = load_calibration(calib, model, 0.25)
    stats, spectra = tier1(model, _layers(model), cal)
    got = d["calibration"]
    assert (got["fit_rows"], got["holdout_rows"], got["digest"]) == (300, 100, cal.digest)
    assert set(got["layers"]) == set(spectra) == {"fc1", "fc2", "fc3", "head"}
    for name, spec in spectra.items():
        lc = got["layers"][name]
        assert lc["ranks_for"] == spec.ranks_for and lc["suggested"] == spec.suggested, name
        assert lc["rows"] == 300 and lc["curve"][0] == [0, 1.0]
        assert lc["curve"] == [[r, spec.error_at(r)] for r, _ in lc["curve"]], name
    # the suggestions are the largest plan over the tier-1 curves that holds all at once (head, break-even 9.6,
    # is narrow): the library's tier 3 with the tolerance alone
    # fc2 and fc3 (512 wide) saw 300 rows: calibration does not span their inputs, so no plan measured puts them
    # in at the data-free (weight-energy) rank the audit without data gives them: they stay dense; fc1 (64 wide)
    # is ranked by the search
    free = auditor.audit(*digits_mlp, progress=False, cache=False).suggestions
    assert [free[k].verdict.value for k in ("fc2", "fc3")] == ["factorize", "factorize"]
    assert got["budget"]["fixed"] == {} and not got["layers"]["fc2"]["spans"] and got["layers"]["fc1"]["spans"]
    assert all(p["layers"] <= 1 for p in got["budget"]["plans"])  # fc1 at most: fc2 and fc3 are in no plan
    assert [d["suggestions"][k]["verdict"] for k in ("fc2", "fc3")] == ["keep dense", "keep dense"]
    swept = [_layers(model)["fc1"]]
    search, verify = _split(cal)  # the search reads the first 50 held-out rows, the verification the other 50
    bp = plan_for_budget(model, list(_layers(model).values()), search,
                         _curves(curves_from_spectra({"fc1": spectra["fc1"]}, swept), swept), stats=stats)
    assert bp.ok and not bp.exhausted and bp.plan and bp.removed > 0
    plan = {k: s["rank"] for k, s in d["suggestions"].items() if s["rank"] is not None}
    staged = plan_for_budget(model, list(_layers(model).values()), _split_session(model, cal, stats),
                             _curves(curves_from_spectra({"fc1": spectra["fc1"]}, swept), swept))
    assert plan == bp.plan == staged.plan == got["budget"]["plan"] and got["budget"]["evaluations"] == len(staged.tries)
    assert d["suggestions"]["head"]["verdict"] == "skip narrow"
    assert d["suggestions"]["fc1"]["reason"].startswith(f"rank {plan['fc1']} in the plan that holds all at once")
    assert d["suggestions"]["fc2"]["reason"].startswith("calibration did not span its inputs (300 of 512")
    # the boundary is bracketed: a measured plan removing more failed, unless the largest plan held
    assert bp.smallest_failing is not None and any(not t.ok and t.removed > bp.removed for t in bp.tries)
    assert not got["measured_floors"] and got["budget"]["budget"] is None and not got["statistics_cached"]
    assert got["budget"]["source"] == "tier1" and all(not lc["probes"] for lc in got["layers"].values())
    pc = got["plan_check"]  # the suggested plan, factorized all at once as auditor.factorize writes it by default
    ev = auditor.calibration.Evaluator(model, verify)  # and measured on the verification rows
    want = ev.measure(auditor.factorize(model, plan, calibration=cal))
    assert pc["fit"] == "sequential" and ev.measure(factorize(model, plan, stats)).value > want.value  # the search's
    assert pc["layers"] == len(plan) and pc["measured"] == pytest.approx(want.value, rel=1e-9)
    assert pc["ok"] is want.ok is True and pc["removed"] == sum(
        l.params - l.params_at(r) for l, r in resolve_plan(model, plan).values())
    # the audit's search measures a plan far from the tolerance on the first 16 of its 50 rows (staged.py)
    from auditor.calibration.measure.staged import _cut
    from auditor.calibration.measure.verify import with_holdout

    head = auditor.calibration.Evaluator(model, with_holdout(search, _cut(search.holdout, 16)[0]))
    on_head = head.measure(factorize(model, plan, stats)).value
    assert got["budget"]["metric"] == pytest.approx(on_head, rel=1e-9) or \
        got["budget"]["metric"] == pytest.approx(bp.metric, rel=1e-9)
    assert pc["measured"] <= got["tolerance"]
    v = pc["verification"]
    assert (v["rows"], v["search_rows"], v["confidence"]) == (50, 50, 0.9) and v == got["budget"]["verification"]
    assert v["low"] <= pc["measured"] <= v["high"] <= got["tolerance"] and v["ok"] and not v["straddles"]
    # fc2 and fc3 saw 300 rows for 512 inputs, but the plan keeps them dense: nothing truncated blind, no LR014
    assert d["verdict"].startswith("PASS: no errors or warnings; the suggested ranks save")
    pc3 = lambda x: f"{100 * x:.3g}%"  # one unit: a percentage, three significant digits
    u = v["unseen"]  # no documents named: blocks of rows, their length from the data
    assert (u["kind"], u["label"]) == ("blocks", f"block bootstrap, blocks of {u['block']} rows")
    assert u["low"] <= pc["measured"] <= u["high"] <= got["tolerance"]
    head, _, unseen = d["verdict"].partition("; for an unseen document ")
    assert head.endswith(f"measured all at once: relative output error {pc3(pc['measured'])} (90% interval "
                         f"{pc3(v['low'])} to {pc3(v['high'])} over 50 verification rows")
    low, high = unseen.split(f" ({u['label']})): within the tolerance 1%")[0].split(" to ")
    assert float(low.rstrip("%")) == pytest.approx(100 * u["low"], rel=5e-3)
    assert float(high.rstrip("%")) == pytest.approx(100 * u["high"], rel=5e-3)
    # without tier 2 the prediction sums the tier-1 layer-output errors in quadrature
    assert pc["basis"] == "tier-1 layer-output errors"
    assert pc["predicted"] == pytest.approx(math.sqrt(sum(spectra[k].error_at(r) ** 2 for k, r in plan.items())),
                                            rel=1e-9)
    # a second run reads the input statistics from the cache, with the same numbers
    again = _json(cli_inproc, tmp_path / "2", "--calibration", calib, "--cache-dir", tmp_path / "cache", "--no-probe")
    assert again["calibration"]["statistics_cached"]
    assert again["calibration"]["layers"] == got["layers"]


def test_probe_plan_scales_tier1_by_probed_sensitivity(cli_inproc, calib, tmp_path, digits_mlp):
    """Tier 3 with --probe (no --measure-floor): each planned layer truncated alone at its smallest grid rank and at
    its tier-1 rank, measured; the plan is the library's over the curves those gains scale, and holds all at once."""
    from auditor.calibration.tiers.sweep import probe_ranks, probe_sensitivity
    from auditor.calibration.statistics.whiten import Truncator

    model = digits_mlp[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    d = _json(cli_inproc, tmp_path, "--calibration", calib, "--no-cache", "--probe", fmt="json,md")
    cal = load_calibration(calib, model, 0.25)
    layers = _layers(model)
    stats, spectra = tier1(model, layers, cal)
    got = d["calibration"]
    search, verify = _split(cal)
    swept = [layers["fc1"]]  # the only layer calibration spans and is not narrow
    assert probe_ranks(layers["fc1"], spectra["fc1"], 8, 0.01) == [8, 48]  # 48: its rank for 1% output error
    assert [lc["probes"] != [] for lc in got["layers"].values()] == [k == "fc1" for k in got["layers"]]
    # each probe is the model with that layer alone at its whitened truncation, measured on the held-out rows
    ev = auditor.calibration.Evaluator(model, search)
    for r, value in got["layers"]["fc1"]["probes"]:
        import copy

        one = copy.deepcopy(model)
        with torch.no_grad():
            one.fc1.weight.copy_(Truncator(layers["fc1"], model.fc1.weight.detach(), stats.layers["fc1"]).weight(r))
        assert value == pytest.approx(ev.measure(one).value, rel=1e-9), r
    probes = probe_sensitivity(model, swept, search, spectra)
    assert [list(p) for p in probes.floors["fc1"].points] == got["layers"]["fc1"]["probes"]
    assert probes.evaluations == 2 and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    bp = plan_for_budget(model, list(layers.values()), search,
                         _curves(curves_from_floors(probes, swept, spectra, source="probed"), swept), stats=stats)
    b = got["budget"]
    assert b["source"] == "probed" and b["plan"] == bp.plan and b["removed"] == bp.removed and bp.ok
    staged = plan_for_budget(model, list(layers.values()), _split_session(model, cal, stats),
                             _curves(curves_from_floors(probes, swept, spectra, source="probed"), swept))
    assert got["evaluations"] >= 2 + len(staged.tries) and b["evaluations"] == len(staged.tries)
    pc = got["plan_check"]
    assert pc["ok"] and pc["basis"].startswith("single-layer model errors")
    md = (tmp_path / "lowrank-audit.md").read_text()
    assert "over the sensitivity-scaled tier-1 curves" in md


def test_floors_and_budget_are_the_librarys(cli_inproc, calib, tmp_path, digits_mlp):
    model = digits_mlp[0]
    d = _json(cli_inproc, tmp_path, "--calibration", calib, "--measure-floor", "--budget", "0.5", "--no-cache",
              "--plan", _plan(tmp_path, {"fc1": 8, "fc2": 16}), code=1)  # LR012 is an error
    cal = load_calibration(calib, model, 0.25)
    layers = _layers(model)
    stats, spectra = tier1(model, layers, cal)
    # head is narrow; fc2 and fc3 (300 rows for 512 inputs) are not spanned: only fc1 is swept
    swept = [layers["fc1"]]
    search, verify = _split(cal)  # tiers 2 and 3 read the search part of the held-out rows
    floors = measure_floors(model, swept, search, stats=stats, spectra=spectra)
    got = d["calibration"]["layers"]
    # with tier 2 the prediction sums single-layer model errors: fc1 at 8 and fc2 at 16, each measured or
    # gain-scaled from the tier-1 curve
    from auditor.calibration.tiers.budget import single_layer_error

    pc = d["calibration"]["plan_check"]
    assert pc["basis"].startswith("single-layer model errors")
    assert pc["predicted"] == pytest.approx(math.sqrt(sum(
        single_layer_error(floors.floors[k].points if k in floors.floors else [], spectra[k], r) ** 2
        for k, r in {"fc1": 8, "fc2": 16}.items())), rel=1e-9)
    for name, f in floors.floors.items():
        assert (got[name]["floor"]["floor"], got[name]["floor"]["cliff_rank"]) == (f.floor, f.cliff_rank), name
        assert got[name]["floor"]["points"] == [list(p) for p in f.points]
    assert got["head"]["floor"] is got["fc2"]["floor"] is got["fc3"]["floor"] is None
    assert got["fc1"]["floor"]["floor"] == 24
    assert d["calibration"]["budget"]["fixed"] == {}  # fc2 and fc3 are in no plan measured: dense, not guessed
    bp = plan_for_budget(model, list(layers.values()), search, _curves(curves_from_floors(floors, swept, spectra), swept),
                         budget=0.5, stats=stats)
    b = d["calibration"]["budget"]
    assert b["plan"] == bp.plan and b["removed"] == bp.removed and b["ok"] is bp.ok is True
    staged = plan_for_budget(model, list(layers.values()), _split_session(model, cal, stats),
                             _curves(curves_from_floors(floors, swept, spectra), swept), budget=0.5)
    assert 3 <= len(b["frontier"]) <= 5 and b["evaluations"] == len(staged.tries) and staged.plan == bp.plan
    # the suggestions are the budget plan that holds all at once, not the per-layer floors
    assert {k: s["rank"] for k, s in d["suggestions"].items() if s["rank"] is not None} == bp.plan
    # only fc1 (7.6% of the model) is planned: half the model is out of reach, and fc2, fc3 are not put in at a guess
    assert set(bp.plan) == {"fc1"} and b["removed_fraction"] < 0.5
    assert [p["removed"] for p in b["frontier"]] == [p.removed for p in staged.frontier]
    # fc1 planned at 8, below its measured floor 24: LR012, an error
    lr012 = [f for f in d["findings"] if f["code"] == "LR012"]
    assert [(f["layers"], f["evidence"]) for f in lr012] == [(["fc1"], {"rank": 8, "floor": 24, "cliff_rank": 16})]


def _curves(curves, layers):
    """The stage's filter: options compressing less than min_compression (1.1x) are not offered."""
    named = {l.name: l for l in layers}
    return type(curves)({k: [o for o in v if named[k].compression(o.rank) >= 1.1] for k, v in curves.options.items()},
                        curves.source, curves.linear)


def _plan(tmp_path: Path, ranks: dict[str, int]) -> Path:
    p = tmp_path / "plan.toml"
    p.write_text('finetune = "1 epoch"\n[ranks]\n' + "".join(f'{k} = {v}\n' for k, v in ranks.items()))
    return p


def test_factorize_writes_and_loads_back(cli_inproc, calib, tmp_path, digits_mlp):
    model = digits_mlp[0]
    plan = {"fc1": 24, "fc2": 16}
    out = tmp_path / "fact"
    r = cli_inproc("factorize", MODEL, "--plan", _plan(tmp_path, plan), "--calibration", calib, "-o", out,
                   "--no-cache", "--fit", "independent")  # the default, sequential: the next test
    assert r.returncode == 0, r.stderr
    assert "recovery fine-tune follows" in r.stderr and "measured" in r.stderr
    meta = json.loads((out / "plan.json").read_text())
    assert meta["plan"] == plan and meta["init"] == "whitened"
    assert meta["params"] == 429_834 - 512 * 64 + 24 * 576 - 512 * 512 + 16 * 1024
    back = load_factorized(model, out)
    cal = load_calibration(calib, model, 0.25)
    want = factorize(model, plan, input_statistics(model, _layers(model), cal))
    x = cal.fit[0].kwargs["x"]  # DigitsMLP.forward(x): the file's tensor is its keyword input
    with torch.no_grad():
        assert torch.equal(back(x), want(x))
    ev = auditor.calibration.Evaluator(model, _split(cal)[1])  # the verification rows
    assert meta["measured"]["value"] == pytest.approx(ev.measure(want).value, rel=1e-9)
    assert meta["measured"]["rows"] == 50 and meta["measured"]["confidence"] == 0.9
    low, high = meta["measured"]["interval"]
    assert low <= meta["measured"]["value"] <= high
    # a non-empty directory is refused without --force
    r = cli_inproc("factorize", MODEL, "--plan", tmp_path / "plan.toml", "-o", out)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "is not empty" in r.stderr
    r = cli_inproc("factorize", MODEL, "--plan", tmp_path / "plan.toml", "-o", out, "--force", "--no-cache")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "plan.json").read_text())["init"] == "svd"


def test_factorize_fit_sequential_and_independent(cli_inproc, calib, tmp_path, digits_mlp):
    """--fit: the written model is the library's fit of that name on the same fit rows, plan.json says which, and its
    "measured" is that model's (the plan check measured again on the verification rows when the fit is sequential)."""
    model = digits_mlp[0]
    plan = {"fc1": 24, "fc2": 16}
    cal = load_calibration(calib, model, 0.25)
    x = cal.fit[0].kwargs["x"]
    ev = auditor.calibration.Evaluator(model, _split(cal)[1])  # the verification rows
    values = {}
    for fit in ("sequential", "independent"):
        out = tmp_path / fit
        r = cli_inproc("factorize", MODEL, "--plan", _plan(tmp_path, plan), "--calibration", calib, "-o", out,
                       "--no-cache", "--fit", fit)
        assert r.returncode == 0, r.stderr
        assert f"whitened initialisation, {fit} fit" in r.stderr
        meta = json.loads((out / "plan.json").read_text())
        assert meta["fit"] == fit and meta["init"] == "whitened"
        want = auditor.factorize(model, plan, calibration=cal, fit=fit)  # sequential: loss-aware, as the CLI
        with torch.no_grad():
            assert torch.equal(load_factorized(model, out)(x), want(x))
        assert meta["measured"]["value"] == pytest.approx(ev.measure(want).value, rel=1e-9)
        values[fit] = meta["measured"]["value"]
    assert values["sequential"] != values["independent"]
    r = cli_inproc("factorize", MODEL, "--plan", tmp_path / "plan.toml", "-o", tmp_path / "none", "--fit",
                   "sequential")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--fit needs --calibration" in r.stderr
    assert not (tmp_path / "none").exists()


def test_factorize_refit_dense(cli_inproc, calib, tmp_path, digits_mlp):
    """--refit-dense: the layers the plan keeps dense refitted on the inputs the factorized layers give them (the library's
    refit_dense=True, output for output), plan.json names it, the factors and the parameter count are the plain
    sequential fit's; refused in one line without the sequential fit, nothing written."""
    model = digits_mlp[0]
    plan = {"fc1": 24, "fc2": 16}
    cal = load_calibration(calib, model, 0.25)
    x = cal.fit[0].kwargs["x"]
    out = tmp_path / "refit"
    r = cli_inproc("factorize", MODEL, "--plan", _plan(tmp_path, plan), "--calibration", calib, "-o", out,
                   "--no-cache", "--refit-dense")
    assert r.returncode == 0, r.stderr
    assert "whitened initialisation, sequential fit, 2 dense weights refitted\n" in r.stderr
    meta = json.loads((out / "plan.json").read_text())
    assert meta["fit"] == "sequential" and meta["refit_dense"] == ["fc3.weight", "head.weight"]
    from auditor.artifacts.export import _refit_line  # what an exported folder's README says of them

    assert _refit_line(meta).startswith("2 weight(s) the plan keeps dense were refitted") and _refit_line({}) == ""
    want = auditor.factorize(model, plan, calibration=cal, fit="sequential", refit_dense=True)
    plain = auditor.factorize(model, plan, calibration=cal, fit="sequential")
    with torch.no_grad():
        assert torch.equal(load_factorized(model, out)(x), want(x))
    assert want.fc3.weight.is_contiguous() and want.head.weight.is_contiguous()
    assert sum(p.numel() for p in want.parameters()) == sum(p.numel() for p in plain.parameters())
    assert torch.equal(want.fc2[0].weight, plain.fc2[0].weight) and torch.equal(want.fc3.bias, model.fc3.bias)
    assert not torch.equal(want.fc3.weight, model.fc3.weight) and torch.equal(plain.fc3.weight, model.fc3.weight)
    for extra, words in ((["--calibration", calib, "--fit", "independent"], "(got --fit independent)"),
                         ([], "(got no --calibration)")):
        r = cli_inproc("factorize", MODEL, "--plan", tmp_path / "plan.toml", "-o", tmp_path / "none", *extra,
                       "--refit-dense")
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and words in r.stderr, r.stderr
        assert not (tmp_path / "none").exists()


def test_factorize_no_refine(cli_inproc, calib, tmp_path, digits_mlp):
    """--no-refine: the sequential fit's closed form, the library's refine=False; plan.json says whether the block
    refinement was on (the digits MLP has no repeated blocks, so both models are the same, bit for bit); refused in
    one line without the sequential fit, nothing written."""
    model = digits_mlp[0]
    plan = {"fc1": 24, "fc2": 16}
    cal = load_calibration(calib, model, 0.25)
    x = cal.fit[0].kwargs["x"]
    made = {}
    for flag in ([], ["--no-refine"]):
        out = tmp_path / f"o{len(flag)}"
        r = cli_inproc("factorize", MODEL, "--plan", _plan(tmp_path, plan), "--calibration", calib, "-o", out,
                       "--no-cache", *flag)
        assert r.returncode == 0, r.stderr
        meta = json.loads((out / "plan.json").read_text())
        assert meta["fit"] == "sequential" and meta["block_refinement"] is not bool(flag)
        assert ("sequential fit (closed form: --no-refine)" in r.stderr) is bool(flag)
        from auditor.artifacts.export import _fit_words  # what an exported folder's README says of the fit

        assert _fit_words(meta) == (" (sequential fit, closed form)" if flag else " (sequential fit)")
        made[bool(flag)] = load_factorized(model, out)
    closed = auditor.factorize(model, plan, calibration=cal, fit="sequential", refine=False)
    with torch.no_grad():
        assert torch.equal(made[True](x), closed(x)) and torch.equal(made[False](x), closed(x))
    for extra, words in ((["--calibration", calib, "--fit", "loss-aware"], "(got --fit loss-aware)"),
                         ([], "(got no --calibration)")):
        r = cli_inproc("factorize", MODEL, "--plan", tmp_path / "plan.toml", "-o", tmp_path / "none", *extra,
                       "--no-refine")
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and words in r.stderr, r.stderr
        assert "--no-refine turns off the sequential fit's block refinement" in r.stderr
        assert not (tmp_path / "none").exists()


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("case", ["shape", "empty", "nan", "missing", "budget-without-data", "bad-budget"])
def test_bad_calibration_exits_2_with_one_line_and_no_report(cli_inproc, tmp_path, case):
    out = tmp_path / "out"
    args: list = []
    if case == "shape":
        args = ["--calibration", _write(tmp_path / "c.safetensors", {"x": torch.rand(40, 10)})]
        want = "do not fit DigitsMLP.forward"
    elif case == "empty":
        (tmp_path / "c.safetensors").write_bytes(b"")
        args, want = ["--calibration", tmp_path / "c.safetensors"], "is empty"
    elif case == "nan":
        x = torch.rand(40, 64)
        x[3, 5] = float("nan")
        args, want = ["--calibration", _write(tmp_path / "c.safetensors", {"x": x})], "NaN"
    elif case == "missing":
        args, want = ["--calibration", tmp_path / "nope.safetensors"], "does not exist"
    elif case == "budget-without-data":
        args, want = ["--budget", "0.3"], "need(s) calibration data"
    else:
        args = ["--calibration", _write(tmp_path / "c.safetensors", {"x": torch.rand(40, 64)}), "--budget", "1.5"]
        want = "not a fraction"
    r = cli_inproc(MODEL, "--format", "json,html", "-o", out, "--no-cache", *args)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and want in r.stderr, r.stderr
    assert not out.exists() or not any(out.iterdir())


def test_api_takes_the_same_calibration(digits_mlp):
    from sklearn.datasets import load_digits

    model, inputs = digits_mlp
    x = torch.tensor(load_digits().data[:200], dtype=torch.float32) / 16.0
    a = auditor.audit(model, inputs, options=auditor.AuditOptions(calibration={"x": x}, cache=False, progress=False,
                                                                 spectra=False))
    cal = load_calibration({"x": x}, model, 0.25)
    _, spectra = tier1(model, _layers(model), cal)
    assert {k: v.suggested for k, v in a.calibration.layers.items()} == {k: s.suggested for k, s in spectra.items()}
    assert a.calibration.fit_rows == 150 and "recovery fine-tune" in a.calibration.finetune_note
    with pytest.raises(auditor.AuditError, match="need calibration data"):
        auditor.AuditOptions(measure_floor=True)


def test_a_user_metric_in_its_own_units(cli_inproc, calib, tmp_path, digits_mlp):
    """--metric file.py:fn (accuracy on the held-out digits, higher is better) with --tolerance in its units."""
    from sklearn.datasets import load_digits

    metric = tmp_path / "metrics.py"
    metric.write_text(
        "import torch\nfrom sklearn.datasets import load_digits\n\n"
        f"LABELS = torch.tensor(load_digits().target[{ROWS * 3 // 4}:{ROWS}])\n\n"
        "def accuracy(model, batches):\n"
        "    pred = torch.cat([model(**b).argmax(-1) for b in batches])\n"
        "    return float((pred == LABELS).double().mean())\n")
    d = _json(cli_inproc, tmp_path, "--calibration", calib, "--metric", f"{metric}:accuracy", "--tolerance", "0.02",
              "--no-cache")
    c = d["calibration"]
    model = digits_mlp[0]
    x = torch.tensor(load_digits().data[ROWS * 3 // 4:ROWS], dtype=torch.float32) / 16.0
    y = torch.tensor(load_digits().target[ROWS * 3 // 4:ROWS])

    def acc(m: torch.nn.Module) -> float:
        with torch.no_grad():
            return float((m(x).argmax(-1) == y).double().mean())

    assert (c["metric"], c["higher_is_better"], c["tolerance"]) == ("accuracy", True, 0.02)
    assert c["reference"] == acc(model)
    assert (c["limit"], c["display"]) == (c["reference"] - 0.02, "number")  # the tolerance line, in its units
    plan = {k: s["rank"] for k, s in d["suggestions"].items() if s["rank"] is not None}
    cal = load_calibration(calib, model, 0.25)
    got = acc(factorize(model, plan, input_statistics(model, _layers(model), cal)))
    assert c["plan_check"]["measured"] == got and c["plan_check"]["ok"] == (got >= acc(model) - 0.02)
    assert c["plan_check"]["predicted"] is None  # no layer-level prediction in a user metric's units
