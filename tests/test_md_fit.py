"""Markdown under a hard cap: summary first, rows while they fit, an exact "N more" line, never over the cap."""

from __future__ import annotations

import re

import pytest

from auditor.render.parts.md_fit import DEFAULT_CAP, GITHUB_COMMENT_LIMIT, Section, fit_markdown, measure

SUMMARY = "## Low-rank audit: llama-70b\n\n**FAIL: 3 errors**\n\n- Parameters: **68,976,648,192** unique"
TAIL = "<sub>lowrank-auditor 0.1.0 · torch 2.13.0</sub>"


def layer_rows(n: int) -> list[str]:
    return [f"| {i + 1} | `model.layers.{i // 7}.mlp.down_proj_{i % 7}` | linear | 8192x28672 | 234,881,024 | "
            f"0.3% | {min(100, i // 100)}% | 4,096 | factorize |" for i in range(n)]


def sections(n_layers: int = 10_000) -> list[Section]:
    return [
        Section("### Findings", [], [f"- ⚠️ **LR004** `energy-below-floor`: layer {i} keeps 80.0% energy." for i in
                                     range(40)], noun="findings"),
        Section("### Top layers by parameter share",
                ["| # | layer | kind | m x n | params | share | cum. | r95 | verdict |",
                 "|---:|---|---|---:|---:|---:|---:|---:|---|"], layer_rows(n_layers), noun="layers"),
        Section("### Rank changes since the baseline", ["| layer | before | after |", "|---|---:|---:|"],
                [f"| `l{i}` | 64 | 128 |" for i in range(500)], noun="rank changes", title="Rank changes"),
    ]


def test_ten_thousand_rows_fit_under_the_cap():
    md = fit_markdown(SUMMARY, sections(), tail=TAIL)
    text = md.text
    assert len(text) <= measure(text) <= DEFAULT_CAP < GITHUB_COMMENT_LIMIT
    assert text.startswith(SUMMARY + "\n\n") and text.rstrip("\n").endswith(TAIL)
    assert text.count("**LR004**") == 40  # the first section whole
    shown = len(re.findall(r"^\| \d+ \| `model\.layers", text, re.M))
    assert shown == md.shown_rows - 40 and shown > 100
    last = re.findall(r"^_… ([\d,]+) more layers and 1 more section \(Rank changes\) in the attached report\._$",
                      text, re.M)
    assert last == [f"{10_000 - shown:,}"] and md.omitted_rows == 10_000 - shown
    assert md.omitted_sections == ["Rank changes"] and md.omitted_section_rows == 500 and not md.complete
    # the table is closed by a blank line before the note, and its rows are the first ones, in order
    lines = text.splitlines()
    note = next(i for i, l in enumerate(lines) if l.startswith("_… "))
    assert lines[note - 1] == "" and lines[note - 2] == layer_rows(shown)[-1]
    assert lines[note + 1] == "" and lines[note + 2] == TAIL and "\n\n\n" not in text
    # one more row would not have fit: the cut is as late as the cap allows
    assert DEFAULT_CAP - measure(text) < measure(layer_rows(shown + 1)[-1]) + 1


def test_everything_fits_no_note():
    md = fit_markdown(SUMMARY, sections(20), tail=TAIL)
    assert md.complete and md.omitted_sections == []
    assert md.shown_rows == 40 + 20 + 500 and "_… " not in md.text
    assert "\n\n\n" not in md.text


@pytest.mark.parametrize("cap", [1_000, 3_000, 9_999, 60_000])
def test_cap_always_holds_and_counts_add_up(cap):
    secs = sections(2_000)
    md = fit_markdown(SUMMARY, secs, cap=cap, tail=TAIL)
    assert measure(md.text) <= cap
    total = sum(len(s.rows) for s in secs)
    assert md.shown_rows + md.omitted_rows + md.omitted_section_rows == total
    body_rows = sum(md.text.count(r + "\n") for s in secs for r in s.rows)
    assert body_rows == md.shown_rows


def test_section_that_cannot_start_is_left_out_whole():
    big = Section("### Layers", ["| a |", "|---|"], ["| " + "x" * 500 + " |"], noun="layers")
    md = fit_markdown("## S", [big], cap=300)
    assert "### Layers" not in md.text and md.text == "## S\n\n_… 1 more section (Layers) in the attached report._\n"
    assert md.omitted_sections == ["Layers"] and md.omitted_section_rows == 1


def test_utf16_measure_and_bad_input():
    assert measure("🛑") == 2 and measure("⚠️") == 2 and measure("abc") == 3
    emoji_rows = Section("### E", [], ["- 🛑 x"] * 1000, noun="errors")
    md = fit_markdown("## S", [emoji_rows], cap=500)
    assert measure(md.text) <= 500 < len(md.text) * 2
    with pytest.raises(ValueError, match="65,536"):
        fit_markdown("## S", [], cap=70_000)
    with pytest.raises(ValueError, match="line break"):
        fit_markdown("## S", [Section("### X", [], ["a\nb"])])
    with pytest.raises(ValueError, match="cannot hold"):
        fit_markdown("## " + "s" * 600, [Section("### X", [], ["a"])], cap=500)
