"""The Markdown as GitHub shows it, parsed by a CommonMark/GFM renderer (markdown-it-py): verdict, plan card and
findings first; every table a table; long or wide tables folded in <details>; at most 7 columns and under 10 KB
open; one unit convention; "->" as written; the saving said once."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn

import auditor
import auditor.planning.groups
from auditor.render.parts.md_fit import DEFAULT_CAP, OPEN_LIMIT, measure, open_part

markdown_it = pytest.importorskip("markdown_it")

MLP = "sample_models/digits.py:mlp"


def gfm(text: str) -> list:
    """Block tokens as GitHub's renderer sees them (GFM tables and strike-through; no autolinks needed here)."""
    return markdown_it.MarkdownIt("gfm-like", {"linkify": False}).parse(text)


def tables(text: str) -> list[tuple[int, int]]:
    """(columns, body rows) of every table the renderer finds."""
    out, cols, rows, state = [], 0, 0, ""
    for t in gfm(text):
        if t.type == "table_open":
            cols = rows = 0
        elif t.type == "thead_open":
            state = "head"
        elif t.type == "tbody_open":
            state = "body"
        elif t.type == "th_open" and state == "head":
            cols += 1
        elif t.type == "tr_open" and state == "body":
            rows += 1
        elif t.type == "table_close":
            out.append((cols, rows))
    return out


def check(md: str) -> dict:
    """What holds for every Markdown report; returns facts for the case's own assertions."""
    assert measure(md) <= DEFAULT_CAP
    # every table in the source is parsed as one (a missing blank line before or after would make it a paragraph)
    seps = [l for l in md.splitlines() if re.fullmatch(r"\|(?:-+:?\|)+", l)]
    found = tables(md)
    assert len(found) == len(seps)
    # folds: <details> opens an HTML block, a blank line ends it, so the table inside is Markdown; every fold closed
    html = [t.content for t in gfm(md) if t.type == "html_block"]
    opens = [h for h in html if h.startswith("<details><summary>")]
    assert len(opens) == md.count("<details>") == md.count("</details>") == sum(h.strip() == "</details>" for h in html)
    assert all(re.fullmatch(r"<details><summary>[^<>&]+</summary>\n", h) for h in opens)
    # "->" is written as is: no "&gt;" in the source, so none that a reader sees ("&amp;gt;" once rendered)
    assert "&gt;" not in md and "&amp;gt;" not in markdown_it.MarkdownIt("gfm-like", {"linkify": False}).render(md)
    shown = open_part(md)
    assert len(shown.encode("utf-8")) < OPEN_LIMIT
    for cols, rows in tables(shown):  # what shows unexpanded: short, narrow tables only
        assert cols <= 7 and rows <= 8, (cols, rows)
    for cols, rows in found:
        if rows > 8:
            assert (cols, rows) not in tables(shown)
    lines = md.splitlines()
    assert lines[0].startswith("## Low-rank audit: ") and lines[1] == "" and re.fullmatch(r"\*\*(PASS|REVIEW|FAIL|UNMEASURED)\b.*\*\*", lines[2])
    assert lines[4].startswith("- **Plan**")
    # one unit convention: shares and errors are percentages (finding messages are the rules' own words); a
    # percentage may carry three significant digits (0.968%: 1.02% must not read as the tolerance's 1.0%)
    prose = "\n".join(l for l in lines if not l.startswith("- 🛑") and not l.startswith("- ⚠️ **")
                      and not l.startswith("- ℹ️"))
    assert not re.search(r"(?<![\d.,])0\.\d{3,}(?![\d%])", prose), \
        re.findall(r".{30}(?<![\d.,])0\.\d{3,}(?![\d%]).{10}", prose)
    return {"shown": shown, "tables": found, "lines": lines}


@pytest.fixture(scope="module")
def mlp_md():
    return auditor.audit_source(MLP, options=auditor.AuditOptions(cache=False, progress=False)).to_markdown()


def test_digits_mlp(mlp_md):
    md = mlp_md
    facts = check(md)
    assert md.count("372,736") == 1  # the saving, said once: in the plan card
    assert "- **Plan** (suggested): 3 layers factorized, **372,736 parameters saved** (86.7% of 429,834)" in md
    # the plan (3 rows, 6 columns) is open; the layer table (10 columns) is folded
    assert (6, 3) in tables(facts["shown"]) and (10, 4) in facts["tables"] and (10, 4) not in tables(facts["shown"])
    assert "<details><summary>4 layer groups of 4 layers, 10 columns</summary>\n\nLayers whose names" in md
    assert "| 1 | `fc2` | 512x512 | 262,144 | 61.0% | 256.0 | 7 / 12 / 143 | 16 | 16.00 | factorize |" in md
    assert "| `fc2` | 16 | 256.0 | 262,144 → 16,384 | 96.0% | 16.00 |" in md


def test_a_plan_with_mistakes(tmp_path):
    plan = tmp_path / "plan.toml"
    plan.write_text('finetune = "1 epoch"\n[ranks]\n"fc2" = 300\n"fc1" = 60\n"fc3" = 4\n"head" = 8\n')
    a = auditor.audit_source(MLP, plan=plan, options=auditor.AuditOptions(cache=False, progress=False))
    md = a.to_markdown()
    facts = check(md)
    lines = facts["lines"]
    assert lines[2] == "**FAIL: 2 error(s), 2 warning(s)**"
    order = [md.index(s) for s in ("**FAIL", "- **Plan**", "### Findings", "### Plan ", "### Layers")]
    assert order == sorted(order)
    assert md.count("128,432") == 1 and "**128,432 parameters saved** (29.9% of 429,834)" in md
    assert md.count("- 🛑 **LR001**") == 2 and "- ⚠️ **LR004**" in md
    # the plan table is open at 7 columns: planned and suggested side by side
    assert "| layer | planned | suggested | break-even | params before → after | energy kept | x |" in facts["shown"]
    assert "| `fc2` | 300 | 16 | 256.0 | 262,144 → 307,200 ⚠️ no saving: kept dense | 99.8% | 0.85 |" in md
    assert "| `head` | 8 | – | 9.6 | 2,560 → 2,128 | 95.7% | 1.20 |" in md


def test_llama_7b_structure_only_shows_break_even(tmp_path, cli_inproc):
    pytest.importorskip("transformers")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
           "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096}
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    r = cli_inproc(tmp_path / "m", "--structure-only", "--format", "md", "-q", "--no-cache")
    assert r.returncode == 0, r.stderr
    md = r.stdout
    facts = check(md)
    assert "- **Plan**: none. Spectra were not computed, so no rank is suggested" in md
    # 9 groups: folded; the one number known on meta, break-even, is there; no column of dashes
    assert "<details><summary>9 layer groups of 226 layers, 7 columns</summary>" in md
    assert "| # | layer | m x n | params | share | break-even | verdict |" in md
    assert "| 1 | `model.layers.*.mlp.down_proj` ×32 | 4096x11008 | 1,442,840,576 | 21.4% | 2,985.2 | skipped |" in md
    assert "| 8 | `lm_head` | 32000x4096 | 131,072,000 | 1.9% | 3,631.2 | skipped |" in md
    assert (7, 9) in facts["tables"] and not tables(facts["shown"])


def test_char_transformer_with_calibration(cli_inproc, tmp_path):
    """Tier 1 with a held-out file: the measurement in the card, the frontier open, 20 plan rows and 27 calibrated
    layers folded, errors as percentages everywhere (this run takes a minute or more)."""
    r = cli_inproc("sample_models/chargpt.py:chargpt", "--calibration", "sample_models/chargpt_calib.safetensors",
                   "--holdout", "sample_models/chargpt_holdout.safetensors", "--format", "md,json", "-q",
                   "--no-cache", "-o", tmp_path)
    assert r.returncode in (0, 1), r.stderr
    md = (tmp_path / "lowrank-audit.md").read_text(encoding="utf-8")
    d = json.loads((tmp_path / "lowrank-audit.json").read_text())
    facts = check(md)
    cal, pc = d["calibration"], d["calibration"]["plan_check"]
    saved = d["plan_review"]["params_saved"]
    assert md.count(f"{saved:,}") == 2  # the card, and the frontier row of the suggested plan
    sign = "≤" if pc["ok"] else ">"
    value = f"{100 * pc['measured']:#.3g}%"  # one unit: a percentage, three significant digits
    v = pc["verification"]
    assert f"- **Measured all at once**: {'✅' if pc['ok'] else '🛑'} **{value} {sign} 1%**: relative output error " \
           f"on {v['rows']:,} verification rows (of {cal['holdout_rows']:,} held out, never read by the search), " \
           f"{pc['layers']} layers at once" in md
    n_plan, n_cal = len(d["plan_review"]["items"]), len(cal["layers"])
    assert n_plan > 8 and f"<details><summary>{n_plan} plan rows, 6 columns</summary>" in md
    # repeated blocks one row each; without tier 2 the floor, cliff and compression columns are left out
    n_rows = len(auditor.planning.groups.group_layers([auditor.planning.groups.LayerShape(n, 1, 1) for n in cal["layers"]]))
    assert n_rows < n_cal and f"<details><summary>{n_rows:,} calibrated layer rows, 6 columns</summary>" in md
    assert (6, n_rows) in facts["tables"] and (6, n_plan) in facts["tables"]
    plans = cal["budget"]["plans"]  # every plan the search measured is a row, what happened to it said
    assert len(plans) == cal["budget"]["evaluations"] and f"Every plan the search measured ({len(plans)})" in md
    assert (8, len(plans)) in tables(md) and "| **SUGGESTED** |" in md  # 8 columns: uniform truncation beside
    u = cal["budget"]["uniform"]
    assert f"{100 * u['metric']:#.3g}% at {100 * u['removed_fraction']:.1f}% | **SUGGESTED** |" in md
    assert "tolerance 1%" in md and "0.01" not in md.replace("0.01%", "")


class Wide(nn.Module):
    """1,200 layers with long distinct names, each planned above break-even: 1,200 errors."""

    def __init__(self, n: int = 1200) -> None:
        super().__init__()
        for i in range(n):
            self.add_module(f"blk_{i}_{'x' * 60}->y<z>&", nn.Linear(4, 4, bias=False))


def test_open_part_stays_small_for_any_model():
    m = Wide()
    plan = {"ranks": {n: 3 for n, _ in m.named_children()}}  # break-even is 2: every item an error
    a = auditor.audit(m, spectra=False, plan=plan, progress=False, cache=False, name="N" * 5000)
    md = a.to_markdown()
    facts = check(md)
    assert md.count("- 🛑 **LR001**") > 8 and facts["shown"].count("- 🛑 **LR001**") <= 8
    assert re.search(r"<details><summary>[\d,]+ more findings</summary>", md)
    assert "->y&lt;z>&amp;" in md  # names as data: "->" kept, "<" and "&" escaped and "<z>" not in re.sub(r"(`+).*?\1", "", md)
    assert md.rstrip().endswith("</sub>") and re.search(r"^_… [\d,]+ more .* in the attached report\._$", md, re.M)
