"""The rule machinery: the decorator and its bound emit, O(1) layer lookup, needs (LR007 only on a data-flow graph),
selection by code, prefix or slug, find_rule, and rules added by other packages through entry points (a real
distribution on sys.path, found by importlib.metadata)."""

from __future__ import annotations

import itertools
import re
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import auditor
from auditor.errors import AuditError
from auditor.results import Severity
from auditor.rules import (
    BUILTIN, RULES, Need, RuleDefinitionError, Scope, evaluate, find_rule, rule, rules_markdown, run_rules, selected,
)
from auditor.rules.docs import PLUGIN_EXAMPLE
from auditor.structure.trace import Method

DOC = """{summary}

    ## What it flags
    Layers.

    ## Why it is bad
    Because.

    ## Example
    Any model.

    ## Do instead
    Something else.
    """


def wide() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 64), nn.ReLU(), nn.Linear(64, 64))


def _audit(model=None, inputs=None, plan=None, select=("LR00",), **kw):
    return auditor.audit(model if model is not None else wide(), inputs, plan=plan,
                         settings=auditor.Settings(select=select), spectra=False, cache=False, **kw)


# ---- the decorator ------------------------------------------------------------------------------------------------

def test_emit_writes_code_slug_and_severity_once():
    def check(ctx, emit):
        for it, layer in ctx.plan_items():
            emit(f"{it.layer} planned", [it.layer], "leave it", m=layer.m)

    check.__doc__ = DOC.format(summary="Flags every planned layer.")
    r = rule("XY900", "every-planned-layer", "warning", scope="plan")(check)
    assert (r.severity, r.scope, r.summary) == (Severity.WARNING, Scope.PLAN, "Flags every planned layer.")
    run = evaluate(_audit(plan={"ranks": {"0": 8, "4": 8}, "finetune": "x"}), rules=[r])
    assert [(f.code, f.slug, f.severity, f.layers, f.evidence, f.fix) for f in run.findings] == [
        ("XY900", "every-planned-layer", Severity.WARNING, ["0"], {"m": 4096}, "leave it"),
        ("XY900", "every-planned-layer", Severity.WARNING, ["4"], {"m": 64}, "leave it"),
    ]


@pytest.mark.parametrize("args, doc, what", [
    (("XY1", "ok-slug", "info"), DOC.format(summary="s"), "capital letters then 3+ digits"),
    (("XY901", "Not_A_Slug", "info"), DOC.format(summary="s"), "lowercase words"),
    (("XY902", "ok-slug", "fatal"), DOC.format(summary="s"), "'fatal' is not a valid Severity"),
    (("XY903", "ok-slug", "info"), "Summary only.\n\n## What it flags\nx\n", "missing: Why it is bad, Example"),
])
def test_a_badly_declared_rule_says_what_is_wrong(args, doc, what):
    def check(ctx, emit):
        pass

    check.__doc__ = doc
    with pytest.raises(RuleDefinitionError, match=re.escape(what)):
        rule(*args)(check)


def test_plan_rules_look_layers_up_once_not_by_scanning_the_audit():
    plan = {"ranks": {"0": 820, "2": 65, "4": 8}}
    a = _audit(plan=plan, select=("LR",))
    expected = [(f.code, f.layers) for f in a.findings]
    assert {"LR001", "LR002", "LR003", "LR005", "LR008"} <= {c for c, _ in expected}

    def linear_scan(name):
        raise AssertionError(f"Audit.layer({name!r}) called: a linear scan per plan item")

    object.__setattr__(a, "layer", linear_scan)  # Audit is frozen; replace the lookup on this instance only
    assert [(f.code, f.layers) for f in run_rules(a, None)] == [e for e in expected if e[0] not in ("LR005", "LR013")]


# ---- needs ----------------------------------------------------------------------------------------------------------

class Attention(nn.Module):
    """q_proj, k_proj and v_proj read the same input; a module walk links them in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if float(x.abs().sum()) > 0:  # data-dependent: symbolic_trace and torch.export both refuse it
            q = q * 2
        return self.o_proj(torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v)


WALK_NOTE = ("Not run without a data-flow graph (the module walk links layers in call order; weights-only audits "
             "have no graph): LR007 chained-linear-maps.")


def test_lr007_does_not_run_on_a_module_walk_of_sibling_projections():
    a = _audit(Attention(), torch.ones(1, 4, 64), select=("LR007",))
    assert a.trace_method == Method.WALK and len(a.trace_failures) == 2
    assert a.findings == []
    run = evaluate(a)
    assert [s.rule.code for s in run.skipped] == ["LR007"] and run.notes == [WALK_NOTE]


@pytest.mark.parametrize("tracer, method, found", [
    ("auto", Method.SYMBOLIC, [(["0", "1"], {"inner_rank": 64})]),
    ("export", Method.EXPORT, [(["0", "1"], {"inner_rank": 64})]),
    ("walk", Method.WALK, []),
])
def test_lr007_finds_a_real_chain_only_with_data_flow(tracer, method, found):
    chain = nn.Sequential(nn.Linear(512, 64), nn.Linear(64, 512))
    a = _audit(chain, torch.zeros(1, 512), select=("LR007",), tracer=tracer)
    assert a.trace_method == method
    assert [(f.layers, f.evidence) for f in a.findings] == found
    assert evaluate(a).notes == ([] if found else [WALK_NOTE])


def test_skipped_rules_are_noted_per_missing_need_but_a_missing_plan_file_is_not():
    run = evaluate(_audit(select=("LR",), tracer="walk"))
    assert {s.rule.code: s.missing for s in run.skipped} == {
        "LR004": (Need.SPECTRA,), "LR005": (Need.PLAN,), "LR009": (Need.SPECTRA,), "LR010": (Need.SPECTRA,),
        "LR011": (Need.SPECTRA,), "LR007": (Need.DATA_FLOW,), "LR013": (Need.PLAN,)}
    assert run.notes == [
        "Not run without a data-flow graph (the module walk links layers in call order; weights-only audits have "
        "no graph): LR007 chained-linear-maps.",
        "Not run without spectra: LR004 energy-below-floor, LR009 small-before-wide, LR010 non-finite-or-zero-weight, "
        "LR011 tall-thin-left-alone.",
    ]


# ---- selection and lookup -----------------------------------------------------------------------------------------

def test_select_by_code_prefix_or_slug_and_ignore():
    codes = lambda rules: [r.code for r in rules]  # noqa: E731
    assert codes(selected(("LR00",), ("LR005", "chained-linear-maps"))) == [
        "LR001", "LR002", "LR003", "LR004", "LR006", "LR008", "LR009"]
    assert codes(selected(("energy-below-floor", "lr011"))) == ["LR004", "LR011"]
    assert codes(selected()) == list(RULES)


@pytest.mark.parametrize("select, ignore, bad", [(("LR0O4",), (), "select 'LR0O4'"),
                                                 ((), ("energy-below-flor",), "ignore 'energy-below-flor'")])
def test_a_selection_that_matches_no_rule_is_an_error(select, ignore, bad):
    with pytest.raises(AuditError, match=f"rule {bad} matches no rule"):
        selected(select, ignore)


def test_cli_select_typo_exits_2(cli_inproc):
    res = cli_inproc("sample_models/digits.py:mlp", "--no-spectra", "-q", "--select", "LR0O4")
    assert res.returncode == 2 and res.stderr.startswith("error: rule select 'LR0O4' matches no rule")
    assert res.stderr.count("\n") == 1


def test_find_rule_by_code_or_slug():
    assert find_rule("LR004") is find_rule("lr004") is find_rule("energy-below-floor") is RULES["LR004"]
    with pytest.raises(AuditError, match="no rule 'energy-floor'.*Did you mean energy-below-floor"):
        find_rule("energy-floor")


# ---- plugins: rules from other packages --------------------------------------------------------------------------

_names = itertools.count()


@pytest.fixture
def install(tmp_path, monkeypatch):
    """Install a fake distribution (a *.dist-info with entry_points.txt, plus its module) on sys.path; RULES is
    reloaded before and after, so each test sees exactly its plugins."""
    import importlib
    import sys

    made: list[str] = []

    def _install(source: str, value: str = "{module}", name: str = "extra") -> str:
        n = next(_names)
        module, dist = f"lrplug_rules_{n}", f"lrplug{n}"
        root = tmp_path / f"site{n}"
        (root / f"{dist}-1.0.dist-info").mkdir(parents=True)
        (root / f"{dist}-1.0.dist-info" / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (root / f"{dist}-1.0.dist-info" / "entry_points.txt").write_text(
            f"[lowrank_auditor.rules]\n{name} = {value.format(module=module)}\n")
        (root / f"{module}.py").write_text(textwrap.dedent(source))
        monkeypatch.syspath_prepend(str(root))
        importlib.invalidate_caches()
        made.append(module)
        RULES.reload()
        return dist

    RULES.reload()
    yield _install
    for m in made:
        sys.modules.pop(m, None)
    monkeypatch.undo()
    RULES.reload()


BIG_LAYER = PLUGIN_EXAMPLE  # the example docs/rules.md shows


def big_low_rank() -> nn.Sequential:
    """0: 4096 x 1024 of rank 8 (4,194,304 weights, suggested rank 8); 2: 64 x 4096."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 64))
    with torch.no_grad():
        m[0].weight.copy_(torch.randn(4096, 8) @ torch.randn(8, 1024))
    return m


def test_a_plugin_rule_is_registered_listed_and_run(install, cli_inproc):
    dist = install(BIG_LAYER)
    assert list(RULES) == [*(r.code for r in BUILTIN), "XY001"]
    r = find_rule("big-layer")
    assert (r.code, r.origin, r.severity) == ("XY001", dist, Severity.WARNING)
    a = auditor.audit(big_low_rank(), None, plan={"ranks": {"2": 4}, "finetune": "x"},
                      settings=auditor.Settings(select=("big-layer",)), cache=False)
    assert [(f.code, f.layers, f.evidence) for f in a.findings] == [("XY001", ["0"], {"params": 4096 * 1024,
                                                                                      "rank": 8})]
    planned = auditor.audit(big_low_rank(), None, plan={"ranks": {"0": 8}, "finetune": "x"},
                            settings=auditor.Settings(select=("XY001",)), cache=False)
    assert planned.findings == []
    listing = cli_inproc("rules")
    assert listing.returncode == 0 and f"(from {dist})" in listing.stdout.splitlines()[-1] \
        and "XY001  big-layer" in listing.stdout
    assert "## XY001 big-layer" in rules_markdown() and "## XY001" not in rules_markdown(BUILTIN)


def test_a_plugin_can_name_a_rule_object(install):
    install(BIG_LAYER, value="{module}:big_layer")
    assert RULES["XY001"].slug == "big-layer"


@pytest.mark.parametrize("source, value, says", [
    ("raise RuntimeError('boom at import')\n", "{module}", "RuntimeError: boom at import"),
    ("", "{module}_missing", "ModuleNotFoundError: No module named"),
    ("X = 3\n", "{module}:X", "TypeError: expected a Rule, a list of Rules or a module declaring rules, got int"),
    ("", "{module}", "TypeError: it declares no rules"),
    ("import sys\nsys.exit(0)\n", "{module}", "SystemExit: 0"),
    (BIG_LAYER.replace("## Example", "## Examples"), "{module}", "missing: Example"),
])
def test_a_broken_plugin_is_one_clear_line(install, cli_inproc, source, value, says):
    dist = install(source, value=value, name="broken")
    with pytest.raises(AuditError) as e:
        list(RULES)
    line = e.value.line()
    assert line.startswith("rule plugin 'broken' (") and f"from {dist}) cannot be loaded: " in line and says in line
    assert f"Fix or uninstall {dist}" in line and "\n" not in line
    res = cli_inproc("rules")
    assert res.returncode == 2 and res.stderr == f"error: {line}\n" and res.stdout == ""


def test_a_plugin_may_not_reuse_a_code_or_slug(install):
    dist = install(BIG_LAYER.replace("XY001", "LR001"))
    with pytest.raises(AuditError, match=f"declares LR001 big-layer, which lowrank-auditor already declares as "
                                         f"LR001 rank-at-or-above-break-even.*uninstall {dist}"):
        RULES["LR001"]


def test_a_plugin_rule_that_crashes_while_running_is_one_clear_line(install):
    dist = install(BIG_LAYER.replace('emit(f"{layer.name} ({layer.params:,} weights) is left dense"', 'emit(1 / 0'))
    assert "1 / 0" in BIG_LAYER.replace('emit(f"{layer.name} ({layer.params:,} weights) is left dense"', 'emit(1 / 0')
    with pytest.raises(AuditError, match=f"rule XY001 big-layer from {dist} failed: ZeroDivisionError"):
        auditor.audit(big_low_rank(), None, plan={"ranks": {"2": 4}}, settings=auditor.Settings(select=("XY001",)),
                      cache=False)


def test_docs_name_the_package_the_rules_live_in():
    assert "`auditor/rules/`" in Path(__file__).resolve().parents[1].joinpath("docs", "rules.md").read_text()


def test_the_rules_import_no_torch_or_networkx():
    import subprocess
    import sys

    code = ("import sys, auditor.rules as r; list(r.RULES); "
            "print(sorted(m for m in ('torch', 'networkx', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]", out.stderr
