"""SARIF 2.1.0 and GitHub annotations: valid against the SARIF schema (tests/schemas/sarif-2.1.0.json), each finding
with its rule (id, name, help, helpUri into docs/rules.md), level and a location: the plan file's line for plan
findings, the line that creates the layer for the others."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import auditor
from auditor.render.sarif import escape_data, escape_property, github_annotations, plan_lines, to_sarif

jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "tests" / "schemas" / "sarif-2.1.0.json").read_text(encoding="utf-8"))


def validate(log: dict) -> None:
    jsonschema.Draft4Validator(SCHEMA).validate(log)


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives headings: lower case, punctuation but - and _ dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", markdown, re.M)}


class Chain(nn.Module):
    """Two linear maps with nothing between them: LR007 on both, placed at the lines that create them."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 16, bias=False)
        self.second = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.second(self.first(x))


def _line_of(text: str) -> int:
    lines, start = inspect.getsourcelines(Chain)
    return start + next(i for i, l in enumerate(lines) if text in l)


@pytest.fixture(scope="module")
def planned(digits_mlp, tmp_path_factory):
    d = tmp_path_factory.mktemp("plan")
    plan = d / "plan.toml"
    plan.write_text('# a reviewed plan\nfinetune = ""\n\n[ranks]\n"fc2" = 300  # above break-even\n"fc1" = 4\n',
                    encoding="utf-8")
    model, x = digits_mlp
    return auditor.audit(model, x, plan=str(plan), cache=False, progress=False), d


def test_plan_findings_point_at_the_plan_lines(planned):
    a, d = planned
    log = to_sarif(a, root=d)
    validate(log)
    run = log["runs"][0]
    rules = run["tool"]["driver"]["rules"]
    got = {}
    for res in run["results"]:
        assert rules[res["ruleIndex"]]["id"] == res["ruleId"]
        loc = res["locations"][0]["physicalLocation"]
        assert loc["artifactLocation"] == {"uri": "plan.toml", "uriBaseId": "%SRCROOT%"}
        got[res["ruleId"]] = (res["level"], loc["region"]["startLine"])
    assert got == {"LR001": ("error", 5), "LR004": ("warning", 6), "LR005": ("warning", 2), "LR009": ("note", 6),
                   "LR013": ("note", 4)}
    lr001 = next(r for r in run["results"] if r["ruleId"] == "LR001")
    finding = next(f for f in a.findings if f.code == "LR001")
    assert lr001["message"]["text"] == f"{finding.message} Fix: {finding.fix}"
    assert run["originalUriBaseIds"]["%SRCROOT%"]["uri"] == d.resolve().as_uri() + "/"


def test_rules_carry_help_and_links_into_docs_rules_md(planned, monkeypatch):
    from auditor.rules import find_rule
    from auditor.rules.docs import rule_url

    a, d = planned
    # no published address is known (pyproject.toml has no [project.urls]): the rule's anchor in docs/rules.md,
    # and SARIF, whose helpUri must be an absolute URI, carries the help text without one
    monkeypatch.delenv("LOWRANK_AUDITOR_DOCS_URL", raising=False)
    assert rule_url(find_rule("LR001")) == "docs/rules.md#lr001-rank-at-or-above-break-even"
    log = to_sarif(a, root=d)
    validate(log)
    driver = log["runs"][0]["tool"]["driver"]
    assert "informationUri" not in driver and not [r for r in driver["rules"] if "helpUri" in r]
    assert all(r["help"]["markdown"].startswith(f"## {r['id']} ") for r in driver["rules"])
    # a published copy: every helpUri is that address with the rule's heading anchor
    monkeypatch.setenv("LOWRANK_AUDITOR_DOCS_URL", "https://docs.example.org/lowrank/docs/rules.md")
    log = to_sarif(a, root=d)
    validate(log)
    assert log["runs"][0]["tool"]["driver"]["informationUri"] == "https://docs.example.org/lowrank"
    rules = log["runs"][0]["tool"]["driver"]["rules"]
    anchors = github_anchors((ROOT / "docs" / "rules.md").read_text(encoding="utf-8"))
    assert [r["id"] for r in rules] == ["LR001", "LR004", "LR005", "LR009", "LR013"]
    for r in rules:
        url, anchor = r["helpUri"].split("#")
        assert url == "https://docs.example.org/lowrank/docs/rules.md" and anchor in anchors, anchor
        assert r["help"]["markdown"].startswith(f"## {r['id']} ") and "### Do instead" in r["help"]["markdown"]
        assert r["name"] and r["shortDescription"]["text"] and r["fullDescription"]["text"]
    lr001 = rules[0]
    assert lr001["name"] == "RankAtOrAboveBreakEven" and lr001["defaultConfiguration"] == {"level": "error"}
    assert lr001["helpUri"].endswith("#lr001-rank-at-or-above-break-even")


def test_layer_findings_point_at_the_code_that_creates_the_layer():
    a = auditor.audit(Chain(), torch.randn(2, 16), cache=False, progress=False)
    log = to_sarif(a, root=ROOT)
    validate(log)
    res = [r for r in log["runs"][0]["results"] if r["ruleId"] == "LR007"]
    assert len(res) == 1
    loc = res[0]["locations"][0]
    assert loc["physicalLocation"]["artifactLocation"] == {"uri": "tests/test_sarif.py", "uriBaseId": "%SRCROOT%"}
    assert loc["physicalLocation"]["region"]["startLine"] == _line_of("self.first = nn.Linear")
    assert [l["fullyQualifiedName"] for l in loc["logicalLocations"]] == ["first", "second"]
    assert res[0]["level"] == "note"


def test_sample_models_are_located_in_their_files(digits_mlp):
    a = auditor.audit_source("sample_models/chargpt.py:chargpt", options=auditor.AuditOptions(cache=False,
                                                                                              progress=False))
    sites = {l.name: l.defined_at for l in a.layers}
    text = (ROOT / "sample_models" / "chargpt.py").read_text(encoding="utf-8").splitlines()
    assert text[sites["blocks.2.proj"][1] - 1].strip().startswith("self.proj = ")  # in Block, not in torch
    assert text[sites["head"][1] - 1].strip().startswith("self.head = ")
    assert all(Path(f).name == "chargpt.py" for f, _ in sites.values())
    validate(to_sarif(a, root=ROOT))  # no findings: an empty, valid run
    assert to_sarif(a, root=ROOT)["runs"][0]["results"] == []


def test_the_schema_rejects_what_it_should(planned):
    a, d = planned
    log = to_sarif(a, root=d)
    bad = json.loads(json.dumps(log))
    bad["runs"][0]["results"][0]["level"] = "info"  # SARIF says "note"
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)
    bad = json.loads(json.dumps(log))
    del bad["runs"][0]["results"][0]["message"]
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)
    bad = json.loads(json.dumps(log))
    bad["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["region"]["startLine"] = 0
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


def test_plan_lines_read_quoted_keys_exactly(tmp_path):
    p = tmp_path / "p.toml"
    p.write_text('finetune = "x"  # [ranks]\n[thresholds]\nenergy_floor = 0.9\n\n[ranks]\n'
                 '"model.layers.*.mlp" = 8\n"a\\"b\\\\c[[]0]" = 4  # note\n\'lit.eral\' = "0.5be"\n', encoding="utf-8")
    assert plan_lines(p) == {"finetune": 1, "[ranks]": 5, "model.layers.*.mlp": 6, 'a"b\\c[[]0]': 7, "lit.eral": 8}
    j = tmp_path / "p.json"
    j.write_text('{\n  "finetune": "x",\n  "ranks": {\n    "fc1": 8,\n    "a\\"b": 4\n  }\n}\n', encoding="utf-8")
    assert plan_lines(j) == {"finetune": 2, "[ranks]": 3, "fc1": 4, 'a"b': 5}
    assert plan_lines(tmp_path / "missing.toml") == {}


def test_github_annotations(planned):
    a, d = planned
    text = github_annotations(a)
    lines = text.splitlines()
    assert len(lines) == len(a.findings) and all(l.startswith("::") for l in lines)
    lr004 = next(l for l in lines if "LR004" in l)
    assert re.match(r"^::warning file=[^,]+plan\.toml,line=6,title=LR004 energy-below-floor::rank 4 for fc1 keeps "
                    r"\d+\.\d%25 of the spectral energy", lr004)  # % escaped as %25
    assert lines[0].startswith("::error ") and any(l.startswith("::notice ") for l in lines)
    assert escape_data("a%b\r\nc") == "a%25b%0D%0Ac"
    assert escape_property("x,y:z\n%") == "x%2Cy%3Az%0A%25"


def test_github_annotations_of_hostile_names_stay_one_line(tmp_path):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    names = ["evil\n::error::forged", "pct%2C,comma:colon", "\x1b[2Jclear"]
    save_file({f"{n}.weight": torch.randn(32, 2, generator=g) @ torch.randn(2, 24, generator=g) for n in names},
              str(tmp_path / "w.safetensors"))
    plan = {"ranks": {n: 30 for n in names}, "finetune": "x"}  # rank 30 > break-even 13.7: LR001 for each
    a = auditor.audit_source(str(tmp_path / "w.safetensors"), plan=plan,
                             options=auditor.AuditOptions(cache=False, progress=False))
    text = github_annotations(a)
    assert text.count("\n") == len(a.findings) and "\x1b" not in text
    assert all(l.startswith(("::error ", "::warning ", "::notice ")) for l in text.splitlines())
    for line in text.splitlines():  # the command and its properties end at the first "::"; the rest is data
        assert re.match(r"^::(error|warning|notice) file=[^:,]+,line=1,title=[^:,]+::", line), line
    assert "evil\\n::error::forged" in text  # the newline shown, never a new line: the forged command stays data
    validate(to_sarif(a, root=tmp_path))


def test_cli_formats(cli_inproc, tmp_path):
    out = tmp_path / "out"
    r = cli_inproc("sample_models/digits.py:mlp", "--no-cache", "--format", "sarif,md,github", "-o", out, "-q")
    assert r.returncode == 0, r.stderr
    assert f"wrote {out / 'lowrank-audit.sarif'}" in r.stderr and not (out / "lowrank-audit.github.txt").exists()
    validate(json.loads((out / "lowrank-audit.sarif").read_text(encoding="utf-8")))
    assert r.stdout == ""  # no findings: no annotations
    both = cli_inproc("sample_models/digits.py:mlp", "--no-cache", "--format", "text,github")
    assert both.returncode == 0 and "fc2" in both.stdout  # log lines share stdout
    refused = cli_inproc("sample_models/digits.py:mlp", "--no-cache", "--format", "json,github")
    assert refused.returncode == 2 and "-o DIR" in refused.stderr
    alone = cli_inproc("sample_models/digits.py:mlp", "--no-cache", "--format", "sarif")
    assert alone.returncode == 0
    validate(json.loads(alone.stdout))
