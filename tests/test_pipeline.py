"""The pipeline's shape: the entry points' signatures, stages that return new values, the plain-data layer graph,
O(1) layer lookup and the exit-code policy (the import layering is tests/test_layering.py)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from torch import nn

import auditor
from auditor import AuditOptions, FailOn
from auditor.errors import ExitCode
from auditor.verdict.policy import exit_code, verdict_line
from auditor.results import Finding, LayerGraph, Severity, TraceMethod


def test_entry_points_take_few_parameters():
    params = inspect.signature(auditor.audit).parameters
    assert list(params) == ["model", "inputs", "plan", "options", "shortcuts"]
    assert params["plan"].kind is inspect.Parameter.KEYWORD_ONLY
    assert list(inspect.signature(auditor.audit_source).parameters) == ["spec", "plan", "options", "load"]


def test_option_shortcuts_are_checked_and_replace_fields():
    m = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(TypeError, match="unknown audit option.*spectrum"):
        auditor.audit(m, spectrum=False)
    a = auditor.audit(m, options=AuditOptions(name="base", spectra=False), name="renamed")
    assert a.model_name == "renamed" and a.spectra == {}
    with pytest.raises(auditor.AuditError, match="jobs=0"):
        AuditOptions(jobs=0)


def test_settings_precedence_options_then_plan_then_overrides():
    m = nn.Sequential(nn.Linear(64, 64))
    opts = AuditOptions(settings=auditor.Settings(energy_floor=0.5, align=4), overrides={"align": 2}, spectra=False)
    a = auditor.audit(m, plan={"ranks": {"0": 8}, "thresholds": {"energy_floor": 0.7, "align": 16}}, options=opts)
    assert (a.settings.energy_floor, a.settings.align) == (0.7, 2)
    with pytest.raises(auditor.AuditError, match="unknown setting 'alignn' in the command line"):
        auditor.audit(m, options=AuditOptions(overrides={"alignn": 2}))
    with pytest.raises(auditor.AuditError, match="bad value 'sometimes'.*error, warning, unmeasured, never"):
        auditor.audit(m, options=AuditOptions(overrides={"fail_on": "sometimes"}))


def test_stages_return_new_values():
    from auditor import pipeline

    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    measured = pipeline.measure(model)
    before = {k: dataclasses.replace(v) for k, v in measured.layers.items()}
    traced = pipeline.trace_model(model, torch.zeros(2, 16), auditor.Tracer.AUTO)
    graphed = pipeline.build_graph(traced, model, measured)
    assert measured.layers == before  # the graph stage filled in copies
    assert all(l.uses == [] and l.macs is None for l in measured.layers.values())
    assert [l.macs for l in graphed.layers.values()] == [2 * 16 * 32, 2 * 32 * 4]
    ranked = pipeline.rank_layers(graphed.layers, measured.table.total)
    assert [l.share for l in graphed.layers.values()] == [0.0, 0.0]
    assert [l.name for l in ranked] == ["0", "1"] and ranked[0].share == 512 / (16 * 32 + 32 + 32 * 4 + 4)


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.down, self.up, self.out = nn.Linear(64, 8), nn.Linear(8, 64), nn.Linear(64, 64)

    def forward(self, x):
        return self.out(torch.relu(self.up(self.down(x))))


@pytest.mark.parametrize("tracer, data_flow", [("symbolic", True), ("export", True), ("walk", False)])
def test_layer_graph_is_plain_data_with_chains_only_for_data_flow(tracer, data_flow):
    a = auditor.audit(Chain(), torch.zeros(2, 64), options=AuditOptions(spectra=False, tracer=tracer))
    g = a.graph
    assert isinstance(g, LayerGraph) and g.data_flow is data_flow
    assert a.trace_method is {"symbolic": TraceMethod.SYMBOLIC, "export": TraceMethod.EXPORT,
                              "walk": TraceMethod.WALK}[tracer]
    assert {"down", "up", "out"} <= {n.name for n in g.nodes}
    assert g.node("down").role == "weight" and g.node("up").calls == 1
    assert ("down", "up") in g.edges
    assert g.chains == ([("down", "up")] if data_flow else [])
    assert [f.layers for f in a.findings if f.code == "LR007"] == ([["down", "up"]] if data_flow else [])
    d = a.to_dict()
    assert (d["totals"]["graph_nodes"], d["totals"]["graph_edges"]) == (len(g.nodes), len(g.edges))


def test_weights_only_audit_has_no_graph(tmp_path):
    from safetensors.torch import save_file

    from auditor.sources import load_source

    save_file({"a.weight": torch.randn(32, 16), "b.weight": torch.randn(4, 32)}, str(tmp_path / "m.safetensors"))
    a = auditor.audit(load_source(str(tmp_path / "m.safetensors")).model, options=AuditOptions(cache=False))
    assert a.graph is None and a.trace_method is TraceMethod.WEIGHTS and a.total_macs is None
    assert a.layer("a").param == "a.weight" and a.layer("b.weight").name == "b"


def test_audit_is_frozen_and_looks_layers_up_by_name_or_tensor():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 16)
            self.head = nn.Linear(16, 50, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(self.emb(ids))

    a = auditor.audit(Tied(), torch.zeros(1, 4, dtype=torch.long), spectra=False)
    assert a.layer("emb") is a.layers[0] and a.layer("emb.weight") is a.layers[0]
    assert a.layers[0].aliases == ["head.weight"]
    with pytest.raises(KeyError):
        a.layer("head.bias")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.findings = []  # type: ignore[misc]


def test_exit_code_policy():
    a = auditor.audit(nn.Sequential(nn.Linear(8, 8)), spectra=False)
    warn = dataclasses.replace(a, findings=[Finding("LR003", "narrow", Severity.WARNING, "m")])
    err = dataclasses.replace(a, findings=[Finding("LR001", "x", Severity.ERROR, "m")])
    info = dataclasses.replace(a, findings=[Finding("LR007", "x", Severity.INFO, "m")])
    assert [exit_code(x) for x in (info, warn, err)] == [ExitCode.OK, ExitCode.OK, ExitCode.FINDINGS]
    assert [exit_code(x, FailOn.WARNING) for x in (info, warn, err)] == [ExitCode.OK, ExitCode.FINDINGS,
                                                                           ExitCode.FINDINGS]
    assert exit_code(err, FailOn.NEVER) is ExitCode.OK
    strict = dataclasses.replace(warn, settings=dataclasses.replace(warn.settings, fail_on=FailOn.WARNING))
    assert exit_code(strict) is ExitCode.FINDINGS
    assert verdict_line(err).startswith("FAIL: 1 error(s), 0 warning(s)")
