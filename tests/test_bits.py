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
    built = lb.weight(recipe).double()
    fb = built.numpy() if lb.layer.kind == Kind.LINEAR else built.T.numpy()
    return metric.cost(f - fb)


@pytest.mark.parametrize("carried", [False, True, None])
@pytest.mark.parametrize("kind", [Kind.LINEAR, Kind.CONV1D_HF])
def test_each_options_cost_is_the_quadratic_form_of_the_weight_it_builds(carried, kind):
    """The knapsack's costs are what the built weights measure in the same metric: the truncation's and the
    correction's tails equal the direct form (the fit is the optimum in that metric), the quantized ones are it."""
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


def test_a_correction_lowers_the_cost_with_its_rank_and_the_metric_shapes_it():
    lb, f, _ = _case(m=96, n=160)
    cost = {c.label: c.cost for c in lb.choices()}
    chain = [cost["int3 g128 sym"]] + [cost[f"int3 g128 sym + rank {k}"] for k in (8, 16, 32)]
    assert all(a > b for a, b in zip(chain, chain[1:])), chain
    assert cost["int8 g128 sym"] < cost["int4 g128 sym"] < cost["int3 g128 sym"]
    # in the metric the output gradient puts on the layer, the loss-aware correction beats the input-whitened one
    loss_aware = _direct(lb, f, bits.Recipe("int3 g128 sym", 16))
    whitened = _direct(lb, f, bits.Recipe("int3 g128 sym", 16, whitened=True))
    assert loss_aware < whitened


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


@pytest.fixture(scope="module")
def tiny_lm_bits(tmp_path_factory):
    """A tiny Llama audited with a byte budget, its joint plan written (--write-bits)."""
    transformers = pytest.importorskip("transformers")
    from auditor import AuditOptions, pipeline
    from auditor.calibration.stage import _open_session
    from auditor.calibration.tiers import passes
    from auditor.progress import Progress

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(1))
    out = tmp_path_factory.mktemp("bits") / "plan"
    options = AuditOptions(calibration={"input_ids": ids}, cache=False, progress=False, bits_per_weight=5.0,
                           write_bits=str(out))
    plain = pipeline.audit(model, options=AuditOptions(progress=False, cache=False))
    progress = Progress(enabled=False)
    ctx = passes.PassContext(model, _open_session(model, plain.layers, options, progress), progress)
    t1 = passes.tier1(ctx, plain.settings.align)
    refs = passes.references(ctx)
    scope = passes.scope_of(plain.layers, t1, plain.settings)
    sens = passes.sensitivity(ctx, refs, t1, scope, None, options.tiers)
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
        assert fam["joint"].predicted <= min(fam["bits"].predicted, fam["rank"].predicted) + 1e-12
    assert int4.nbytes == report.rest_bytes + sum(QuantSpec(4).nbytes(*_out_in(model, k)) for k in int4.choices)


def _out_in(model, name):
    w = model.get_submodule(name).weight
    return tuple(w.shape)


def test_the_written_plan_loads_as_the_model_the_audit_measured(tiny_lm_bits):
    from safetensors import safe_open

    from auditor.quantize.written import load_byte_plan

    model, ctx, scope, sens, report, out, ids = tiny_lm_bits
    joint = next(p for p in report.at(report.budget) if p.family == "joint")
    assert report.written == str(out) and (out / "plan.json").is_file()
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
