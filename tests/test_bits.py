"""Rank or bits (calibration/tiers/bits.py): every option's predicted cost is the quadratic form of the weight it
builds, its bytes are counted to the byte, and the byte plans stay within their sizes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from auditor.calibration.statistics.stats import LayerInput
from auditor.calibration.tiers import bits
from auditor.quantize.codes import QuantSpec
from auditor.results import Kind, Layer


def _layer(m: int, n: int, kind: Kind = Kind.LINEAR) -> Layer:
    shape = (m, n) if kind == Kind.LINEAR else (n, m)
    return Layer("fc", "fc.weight", kind, "Linear", shape, m, n)


def _case(m: int = 40, n: int = 150, seed: int = 0, carried: bool | None = False, kind: Kind = Kind.LINEAR):
    """A Linear with a trained-looking spectrum, a correlated input Gram and an output-gradient moment."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(m, 8, generator=g) @ torch.randn(8, n, generator=g) + 0.1 * torch.randn(m, n, generator=g))
    x = torch.randn(600, n, generator=g) @ torch.diag(torch.linspace(0.2, 3.0, n))
    gram = (x.T @ x).double().numpy()[None]
    moment = None
    if carried is not None:
        o = torch.randn(300, m, generator=g).double().numpy()
        f = w.double().numpy()
        moment = ((f.T @ (o.T @ o) @ f), True, 300) if carried else ((o.T @ o), False, 300)
    weight = w if kind == Kind.LINEAR else w.T.contiguous()
    inp = LayerInput("fc", "linear", gram, 600, n)
    return bits.LayerBits(_layer(m, n, kind), weight, inp, moment), w.double().numpy(), gram[0]


def _direct(lb: bits.LayerBits, f: np.ndarray, recipe: bits.Recipe) -> float:
    """The cost recomputed from the built weight: trace(G D S D^T) in the layer's metric."""
    metric = bits.output_metric(f, lb.inp.gram[0], lb.moment)
    metric = metric.isotropic() if bits.ISOTROPIC_COSTS else metric  # what the options are judged in
    built = lb.weight(recipe).double()
    fb = built.numpy() if lb.layer.kind == Kind.LINEAR else built.T.numpy()
    return metric.cost(f - fb)


@pytest.mark.parametrize("carried, kind, isotropic", [
    (False, Kind.LINEAR, False), (True, Kind.LINEAR, False), (None, Kind.LINEAR, False),
    (False, Kind.CONV1D_HF, False), (False, Kind.LINEAR, True), (True, Kind.CONV1D_HF, True)])
def test_each_options_cost_is_the_quadratic_form_of_the_weight_it_builds(carried, kind, isotropic, monkeypatch):
    """The knapsack's costs are what the built weights measure in the metric they are judged in (G, or its mean
    diagonal): the truncation's and the correction's tails equal the direct form, the quantized ones are it."""
    monkeypatch.setattr(bits, "ISOTROPIC_COSTS", isotropic)
    lb, f, _ = _case(carried=carried, kind=kind)
    options = lb.choices()
    assert options[0].label == "keep" and options[0].cost == 0.0
    for c in options[1:]:
        got = _direct(lb, f, lb.recipes[c.label])
        assert got == pytest.approx(c.cost, rel=1e-6, abs=1e-9 * max(c.cost, 1.0)), c.label


def test_bytes_are_counted_to_the_byte():
    lb, f, _ = _case(m=40, n=150)
    by = {c.label: c.nbytes for c in lb.choices()}
    assert by["keep"] == 40 * 150 * 4
    assert by["int4 g128 sym"] == QuantSpec(4).nbytes(40, 150) == math.ceil(40 * 150 * 4 / 8) + 40 * 2 * 2
    assert by["int3 g128 asym"] == math.ceil(40 * 150 * 3 / 8) + 40 * 2 * 2 + math.ceil(40 * 2 * 3 / 8)
    ranks = sorted(int(k.split()[1]) for k in by if k.startswith("rank "))
    assert ranks[0] == max(1, math.floor(lb.layer.break_even / 20)) and all(by[f"rank {r}"] == r * 190 * 4
                                                                          for r in ranks)
    assert all(v < by["keep"] for k, v in by.items() if k != "keep")  # no option stores more than the layer
    assert by["int4 g128 sym + rank 8"] == by["int4 g128 sym"] + 8 * 190 * 4
    # int8 factors: codes of A (40 x r, one group per row) and B (r x 150, two groups per row), float16 scales
    assert all(by[f"rank {r} int8"] == 40 * r + 40 * 2 + r * 150 + r * 2 * 2 for r in ranks)


def test_a_correction_lowers_the_cost_with_its_rank_and_the_metric_shapes_it():
    lb, f, _ = _case(m=96, n=160)
    cost = {c.label: c.cost for c in lb.choices()}
    chain = [cost["int3 g128 sym"]] + [cost[f"int3 g128 sym + rank {k}"] for k in (8, 16, 32)]
    assert all(a > b for a, b in zip(chain, chain[1:])), chain
    assert cost["int8 g128 sym"] < cost["int4 g128 sym"] < cost["int3 g128 sym"]
    # fitted in the metric the output gradient puts on the layer, the correction beats the input-whitened one there;
    # judged with G's mean diagonal (the options' costs), the input-whitened one is the better: each is the optimum
    # of its own metric
    g = bits.output_metric(f, lb.inp.gram[0], lb.moment)
    built = {w: lb.weight(bits.Recipe("int3 g128 sym", 16, whitened=w)).double().numpy() for w in (False, True)}
    assert g.cost(f - built[False]) < g.cost(f - built[True])
    assert g.isotropic().cost(f - built[True]) < g.isotropic().cost(f - built[False])


def test_swapped_restores_the_weights_even_when_the_forward_raises():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    before = model[0].weight.detach().clone()
    layer = Layer("0", "0.weight", Kind.LINEAR, "Linear", (3, 4), 3, 4)
    with pytest.raises(RuntimeError, match="boom"):
        with bits.swapped(model, {"0": torch.zeros(3, 4)}, {"0": layer}):
            assert torch.equal(model[0].weight, torch.zeros(3, 4))
            raise RuntimeError("boom")
    assert torch.equal(model[0].weight, before)


def test_families_keep_their_options():
    c = bits.Costed({}, {"a": [bits.Choice("keep", 10, 0.0), bits.Choice("rank 2", 4, 1.0),
                               bits.Choice("int4 g128 sym", 3, 2.0), bits.Choice("int4 g128 sym + rank 8", 5, 0.5)]},
                    0, "input statistics")
    labels = {fam: [ch.label for ch in c.family(fam)["a"]] for fam in ("bits", "rank", "joint")}
    assert labels == {"bits": ["keep", "int4 g128 sym"], "rank": ["keep", "rank 2"],
                      "joint": ["keep", "rank 2", "int4 g128 sym", "int4 g128 sym + rank 8"]}


def _tiny_llama():
    """A random-init 2-layer Llama (hidden 48, 15 rewritable Linears with the head) and 64 rows of 16 random ids."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return (transformers.LlamaForCausalLM(cfg).eval(),
            torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(1)))


@pytest.fixture(scope="module")
def tiny_lm_bits(tmp_path_factory):
    """A tiny Llama audited with a byte budget, its best measured plan written (--write-bits)."""
    from auditor import AuditOptions, pipeline
    from auditor.calibration.stage import through_sensitivity
    from auditor.calibration.tiers import passes

    model, ids = _tiny_llama()
    model.register_buffer("kept_buffer", torch.arange(100.0))  # a persistent buffer: saved, counted, loaded
    out = tmp_path_factory.mktemp("bits") / "plan"
    options = AuditOptions(calibration={"input_ids": ids}, cache=False, progress=False, bits_per_weight=5.0,
                           write_bits=str(out))
    plain = pipeline.audit(model, options=AuditOptions(progress=False, cache=False))
    ctx, refs, scope, sens = through_sensitivity(model, plain.layers, plain.settings, options)
    report = passes.bits(ctx, refs, scope, sens.loss_metric, options.tiers).report
    return model, ctx, scope, sens, report, out, ids


def test_byte_plans_fit_their_sizes_and_the_joint_plan_predicts_no_worse(tiny_lm_bits):
    model, ctx, scope, sens, report, out, ids = tiny_lm_bits
    assert report is not None and report.layers == 15 and report.weighted == "output gradients"
    int4 = next(p for p in report.baselines if p.family == "uniform int4")
    assert report.sizes == [report.budget, int4.size, next(p for p in report.baselines if p.family == "uniform int8").size]
    assert report.budget == report.rest_bytes + math.floor(5.0 * report.weights / 8)
    for size in report.sizes:
        fam = {p.family: p for p in report.at(size)}
        assert set(fam) == {"joint", "bits", "rank"}
        assert all(p.nbytes <= size for p in fam.values() if p.reachable)
        j = fam["joint"]  # chosen on the costs recalibrated by the two single-family plans' measurements
        assert j.rho >= 1.0 and j.predicted <= min(fam["bits"].predicted, j.rho * fam["rank"].predicted) + 1e-12
    assert int4.nbytes == report.rest_bytes + sum(QuantSpec(4).nbytes(*_out_in(model, k)) for k in int4.choices)


def _out_in(model, name):
    w = model.get_submodule(name).weight
    return tuple(w.shape)


def test_the_written_plan_loads_as_the_model_the_audit_measured(tiny_lm_bits):
    from safetensors import safe_open

    from auditor.quantize.written import load_byte_plan

    model, ctx, scope, sens, report, out, ids = tiny_lm_bits
    here = [p for p in report.at(report.budget) if p.reachable]
    joint = min(here, key=lambda p: p.value)  # the plan that measured least harm is the one written
    assert report.written == str(out) and (out / "plan.json").is_file() and report.written_family == joint.family
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        payload = sum(fh.get_tensor(k).numel() * fh.get_tensor(k).element_size() for k in fh.keys())
    assert payload == joint.nbytes  # every byte the plan predicted, and no other
    assert report.file_bytes == payload + report.header_bytes == (out / "model.safetensors").stat().st_size
    loaded = load_byte_plan(model, out)
    from auditor.calibration.tiers.bits import costed

    c = costed(ctx, scope.planned, sens.loss_metric)
    for name, label in joint.choices.items():
        got = loaded.get_submodule(name).weight
        assert torch.equal(got, c.layers[name].weight(c.layers[name].recipes[label])), name
    from auditor.factorize import load_factorized

    again = load_factorized(model, out)  # the documented loader knows a byte plan's folder
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), loaded.state_dict().values()))
    kept = [n for n, lab in joint.choices.items() if lab == "keep"]
    assert all(torch.equal(loaded.get_submodule(n).weight, model.get_submodule(n).weight) for n in kept)
    assert any(lab != "keep" for lab in joint.choices.values())


def test_a_byte_plan_refuses_a_folder_that_holds_something(tmp_path):
    from auditor import AuditError, AuditOptions

    (tmp_path / "x").write_text("keep me")
    with pytest.raises(AuditError, match="exists and is not an empty folder"):
        AuditOptions(calibration="c.txt", budget_bytes=1000, write_bits=str(tmp_path))
    with pytest.raises(AuditError, match="none was asked for"):
        AuditOptions(calibration="c.txt", write_bits=str(tmp_path / "new"))
    with pytest.raises(AuditError, match="both set the byte budget"):
        AuditOptions(calibration="c.txt", budget_bytes=1000, bits_per_weight=4.0)


def test_the_report_json_holds_the_byte_plans_and_validates(tiny_lm_bits):
    import json
    from pathlib import Path

    from auditor.calresults import CalibrationReport, report_dict

    jsonschema = pytest.importorskip("jsonschema")
    report = tiny_lm_bits[4]
    schema = json.loads((Path(__file__).resolve().parents[1] / "docs" / "schema.json").read_text())
    bits_schema = schema["properties"]["calibration"]["properties"]["bits"]
    d = json.loads(json.dumps(report_dict(report)))
    jsonschema.validate(d, bits_schema)
    assert [p["family"] for p in d["baselines"]] == ["uniform int8", "uniform int4", "uniform truncation"]
    bare = CalibrationReport("s", "0.25", "d", 1, 1, "perplexity", False, 0.01, 1.0)
    assert "bits" not in bare.to_dict()  # no byte plan asked for: the report as it was


def _tampered(src, dst, edit_plan=None, edit_tensors=None):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    plan = json.loads((dst / "plan.json").read_text())
    tensors = load_file(str(dst / "model.safetensors"))
    if edit_plan:
        edit_plan(plan)
    if edit_tensors:
        edit_tensors(tensors)
    (dst / "plan.json").write_text(json.dumps(plan))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _first(plan, want):
    return next(k for k, m in plan["layers"].items() if want(m))


@pytest.mark.parametrize("case, match", [
    ("drop factor", "needs"), ("spec emptied", "neither quantized nor factorized"), ("factor dtype", "factors|scales"),
    ("factor added", "needs"),
    ("layers a list", "not objects"), ("aliases a list", "not objects"), ("entry a string", "not an object"),
    ("shape short", "shape"), ("codes cut", "packed bytes"), ("extra tensor", "does not use"),
    ("version", "format version"), ("garbage file", "no readable byte plan")])
def test_a_tampered_byte_plan_is_refused_in_one_line(tiny_lm_bits, tmp_path, case, match):
    from auditor import AuditError
    from auditor.quantize.written import load_byte_plan

    model, out = tiny_lm_bits[0], tiny_lm_bits[5]
    import json
    plan = json.loads((out / "plan.json").read_text())
    ranked = next((k for k, m in plan["layers"].items() if m["rank"]), None)
    quant = next((k for k, m in plan["layers"].items() if m["spec"] and not m["rank"]), None)
    assert ranked is not None and quant is not None, plan["layers"]
    fkey = f"{ranked}.a" if not plan["layers"][ranked]["factors"] else f"{ranked}.a.scales"  # float or int8 factors
    edits = {
        "drop factor": (None, lambda t: t.pop(fkey)),
        "spec emptied": (lambda p: p["layers"][quant].update(spec=""), None),
        "factor dtype": (None, lambda t: t.update({fkey: t[fkey].double()})),
        "factor added": (None, lambda t: t.update({f"{quant}.a": torch.zeros(2, 2)})),
        "layers a list": (lambda p: p.update(layers=[]), None),
        "aliases a list": (lambda p: p.update(aliases=[]), None),
        "entry a string": (lambda p: p["layers"].update({quant: "int4"}), None),
        "shape short": (lambda p: p["layers"][quant].update(shape=[48]), None),
        "codes cut": (None, lambda t: t.update({f"{quant}.codes": t[f"{quant}.codes"][:-1].clone()})),
        "extra tensor": (None, lambda t: t.update({"stray": torch.zeros(3)})),
        "version": (lambda p: p.update(format_version=99), None),
    }
    if case == "garbage file":
        import shutil
        dst = tmp_path / "t"
        shutil.copytree(out, dst)
        (dst / "model.safetensors").write_bytes(b"\x00" * 40)
    else:
        dst = _tampered(out, tmp_path / "t", *edits[case])
    with pytest.raises(AuditError, match=match):
        load_byte_plan(model, dst)


def _plan(family, value, choices, size=100, reachable=True):
    from auditor.calresults import BitsPlan

    return BitsPlan(family, size, size, reachable, value, True, 0.0, None, choices)


@pytest.mark.parametrize("plans, words", [
    ((("joint", 0.01, {"a": "keep"}), ("bits", 0.01, {"a": "keep"}), ("rank", 0.01, {"a": "keep"})),
     "nothing needs rewriting"),
    ((("joint", 0.02, {"a": "rank 4"}), ("bits", 0.05, {"a": "int4 g128 sym"}), ("rank", 0.02, {"a": "rank 4"})),
     "At 100 bytes low rank alone does least harm: perplexity +2.00% (rank and bits together chose the same plan); "
     "quantization alone +5.00%."),
    ((("joint", 0.01, {"a": "int4 g128 sym + rank 8"}), ("bits", 0.05, {"a": "int4 g128 sym"}),
      ("rank", 0.5, {"a": "rank 4"})), "rank and bits together does least harm"),
])
def test_the_verdict_names_the_family_of_the_plan_that_won(plans, words):
    from auditor.calresults import BitsReport, MetricFacts

    report = BitsReport(100, 200, 10, 1, 50, "output gradients", [100], [_plan(*p) for p in plans], smallest=20)
    facts = MetricFacts("perplexity", False, 0.01, 10.0, 0.01, "percent", "perplexity")
    assert words in report.sentence(facts)
    empty = BitsReport(15, 200, 10, 1, 50, "output gradients", [15], [_plan("joint", None, {}, 15, False)],
                       smallest=20)
    assert empty.sentence(facts) == ("Nothing fits 15 bytes: the smallest plan takes 20 (the tensors no byte plan "
                                     "rewrites take 10).")


def test_writing_a_plan_no_budget_can_reach_is_refused(tiny_lm_bits, tmp_path):
    from auditor import AuditError
    from auditor.calibration.tiers.passes import bits as bits_pass
    from auditor.options import TierOptions

    model, ctx, scope, sens, report = tiny_lm_bits[:5]
    refs = bits_pass.__globals__["references"](ctx)
    tiers = TierOptions(budget_bytes=report.smallest - 1, write_bits=str(tmp_path / "never"))
    with pytest.raises(AuditError, match=f"the smallest takes {report.smallest:,}"):
        bits_pass(ctx, refs, scope, sens.loss_metric, tiers)
    assert not (tmp_path / "never").exists()
    with pytest.raises(AuditError, match=f"--budget-bytes: no byte plan fits {report.smallest - 1:,} bytes"):
        bits_pass(ctx, refs, scope, sens.loss_metric, TierOptions(budget_bytes=report.smallest - 1))
    assert report.rest_bytes < report.smallest < report.budget


def test_an_audit_with_a_byte_budget_reports_the_three_families_in_every_format(tmp_path):
    """The library path end to end: auditor.audit with bits_per_weight, the section in text, Markdown and HTML,
    the rows grouped by size with the baselines last, and the JSON's verdict the text's."""
    import auditor

    model, ids = _tiny_llama()
    a = auditor.audit(model, {"input_ids": ids[:2]}, options=auditor.AuditOptions(
        calibration={"input_ids": ids}, cache=False, progress=False, bits_per_weight=4.5))
    b = a.calibration.bits
    assert b is not None and b.verdict.startswith(f"At {b.budget:,} bytes ")
    text, md, html = a.to_text(width=120), a.to_markdown(), a.to_html()
    assert "Rank or bits at" in text and b.verdict in text.replace("\n  ", " ")
    assert text.index("at ") < text.index("  baselines:") and "uniform truncation" in text
    assert "#### Rank or bits" in md and "| planned for | plan | bytes |" in md
    assert 'id="bits-table"' in html and "uniform int4" in html
    assert json_bits(a)["verdict"] == b.verdict


def json_bits(a):
    import json

    return json.loads(a.to_json())["calibration"]["bits"]


def test_the_rank_plans_size_is_one_of_the_sizes_measured(tiny_lm_bits):
    from auditor.calibration.tiers import passes
    from auditor.calresults import BudgetResult

    model, ctx, scope, sens, report = tiny_lm_bits[:5]
    c = bits.costed(ctx, scope.planned, sens.loss_metric)
    plan = {"model.layers.0.mlp.up_proj": 8, "model.embed_tokens": 4}  # 96x48 and the 64x48 table, float32
    want = c.dense_bytes - 4 * ((96 * 48 - 8 * 144) + (64 * 48 - 4 * 112))
    assert bits.rank_plan_bytes(ctx, c, plan) == want and bits.rank_plan_bytes(ctx, c, {}) is None
    refs = passes.references(ctx)
    budget = BudgetResult(plan, "gradient", 0.2, 1, 0.1, 0.0, True, [])
    from auditor.options import TierOptions

    out = passes.bits(ctx, refs, scope, sens.loss_metric, TierOptions(budget_bytes=report.budget), budget).report
    assert out.sizes[:2] == [report.budget, want] and len(out.plans) == 3 * len(out.sizes)


@pytest.mark.parametrize("recipe", [bits.Recipe(rank=6, int8_factors=True), bits.Recipe("int3 g128 sym", 8),
                                    bits.Recipe(rank=6), bits.Recipe("int4 g128 asym")])
def test_each_kind_of_choice_writes_and_loads_as_it_measured(tmp_path, recipe):
    from auditor.quantize.written import load_byte_plan, write_byte_plan

    lb, f, _ = _case(m=40, n=150, carried=None)
    model = torch.nn.Sequential(torch.nn.Linear(150, 40))
    with torch.no_grad():
        model[0].weight.copy_(lb.weight_ref)
    lb.layer = Layer("0", "0.weight", Kind.LINEAR, "Linear", (40, 150), 40, 150)
    lb.choices()
    parts = lb.parts(recipe)
    size = write_byte_plan(tmp_path / "p", {"0.bias": model[0].bias}, {"0": parts}, {})
    loaded = load_byte_plan(model, tmp_path / "p")
    assert torch.equal(loaded[0].weight, lb.weight(recipe)) and torch.equal(loaded[0].bias, model[0].bias)
    nbytes = {c.label: c.nbytes for c in lb.choices()}[recipe.label]
    assert parts.nbytes == nbytes and size > nbytes + 40 * 4


def test_the_joint_plans_costs_are_recalibrated_by_what_the_single_family_plans_measured():
    from auditor.calresults import BitsPlan

    rank, quant = BitsPlan("rank", 10, 10, True, 0.06, True, 2.0), BitsPlan("bits", 10, 10, True, 0.01, True, 1.0)
    assert bits.ratio(rank, quant) == pytest.approx(3.0)  # 0.03 per unit of cost against 0.01
    assert bits.ratio(quant, rank) == 1.0  # never a discount
    assert bits.ratio(BitsPlan("rank", 10, 10, True, -0.001, True, 2.0), quant) == 1.0  # noise below zero
    noise = BitsPlan("rank", 10, 10, True, 3e-7, True, 4e-13)  # an exact low-rank plan: float32 rounding measured
    assert bits.ratio(noise, quant, floor=1e-4) == 1.0 and bits.ratio(noise, quant) > 1e6
    c = bits.Costed({}, {"a": [bits.Choice("keep", 10, 0.0), bits.Choice("rank 2", 4, 1.0),
                               bits.Choice("int4 g128 sym", 3, 2.0), bits.Choice("int4 g128 sym + rank 8", 5, 0.5)]},
                    0, "input statistics")
    got = {ch.label: ch.cost for ch in c.recalibrated(3.0)["a"]}
    assert got == {"keep": 0.0, "rank 2": 3.0, "int4 g128 sym": 2.0, "int4 g128 sym + rank 8": 2.0 - 1.5 / 3.0}
