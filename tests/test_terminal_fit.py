"""The terminal table at 80, 100 and 120 columns: no line longer than the width, no verdict, number or rank range
cut, columns given up in the fixed order, each finding with its fix, and ``--format text -o DIR`` as a file."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import auditor
from auditor.render.parts.pages import group_rows
from auditor.render.terminal import layer_steps, short_verdict
from auditor.render.parts.view import layer_table

WIDTHS = (80, 100, 120)


@pytest.fixture(scope="module")
def mlp_audit(digits_mlp):
    model, x = digits_mlp
    return auditor.audit(model, x, cache=False, progress=False)


@pytest.fixture(scope="module")
def chargpt_audit():
    from chargpt import chargpt

    model, ids = chargpt()
    return auditor.audit(model, ids, cache=False, progress=False, name="CharGPT")


class Mixed(nn.Module):
    """A group whose members disagree: three blocks of rank 4 (factorize), one of full rank (keep dense), under long
    names; a narrow head (skip narrow)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.encoder = nn.ModuleList()
        for i in range(4):
            blk = nn.Module()
            blk.attention_output_projection = nn.Linear(96, 96, bias=False)
            w = torch.randn(96, 96, generator=g) if i == 3 else \
                torch.randn(96, 4, generator=g) @ torch.randn(4, 96, generator=g)
            blk.attention_output_projection.weight.data.copy_(w)
            self.encoder.append(blk)
        self.head = nn.Linear(96, 3, bias=False)

    def forward(self, x):
        for b in self.encoder:
            x = b.attention_output_projection(x)
        return self.head(x)


@pytest.fixture(scope="module")
def mixed_audit():
    plan = {"ranks": {"encoder.0.attention_output_projection": 8, "encoder.1.attention_output_projection": 16}}
    return auditor.audit(Mixed(), torch.randn(2, 96), plan=plan, cache=False, progress=False)


def _rows(audit: auditor.Audit, text: str) -> tuple[list[str], dict[int, str]]:
    lines = text.splitlines()
    header = next(l for l in lines if re.match(r"\s*#  layer", l))
    start = lines.index(header)
    rows = {}
    for line in lines[start + 1:]:
        m = re.match(r"\s*(\d+)  ", line)
        if not m:
            break
        rows[int(m.group(1))] = line
    return header.split(), rows


def _check(audit: auditor.Audit, width: int) -> list[str]:
    """Every line fits; each group row ends with its whole verdict and shows every kept rank cell whole."""
    text = audit.to_text(width=width)
    assert max(map(len, text.splitlines())) <= width
    header, rows = _rows(audit, text)
    table = layer_table(audit)
    groups = group_rows(audit, table)
    assert len(rows) == len(groups)
    labels = [c.label for c in table.columns]
    for i, g in enumerate(groups, 1):
        line = rows[i]
        # a mixed verdict may shorten, every count kept, so that break-even stays (dense 1·fact 3)
        assert line.endswith("  " + g.verdict) or line.endswith("  " + short_verdict(g.verdict)), (line, g.verdict)
        cells = line.split()
        for k, label in enumerate(labels):
            if label in header and g.ranks[k] != "–":
                assert g.ranks[k] in cells, (label, g.ranks[k], line)
        shown = g.planned if table.planned else g.suggested
        if shown != "–":
            assert shown.split(" ")[0] in cells
    return header


@pytest.mark.parametrize("width", WIDTHS)
def test_digits_mlp_fits(mlp_audit, width):
    header = _check(mlp_audit, width)
    want = {80: ["#", "layer", "m", "x", "n", "params", "share", "break-even", "r95", "rank", "x", "verdict"],
            100: ["#", "layer", "kind", "m", "x", "n", "params", "share", "break-even", "r90", "r95", "r99", "rank",
                  "x", "verdict"],
            120: ["#", "layer", "kind", "m", "x", "n", "params", "share", "cum", "MACs", "break-even", "r90", "r95",
                  "r99", "rank", "x", "verdict"]}
    assert header == want[width]


@pytest.mark.parametrize("width", WIDTHS)
def test_char_transformer_fits(chargpt_audit, width):
    header = _check(chargpt_audit, width)
    want = {80: ["#", "layer", "params", "share", "b-e", "r95", "rank", "verdict"],  # break-even kept at 80
            100: ["#", "layer", "m", "x", "n", "params", "share", "b-e", "r95", "rank", "verdict"],
            120: ["#", "layer", "m", "x", "n", "params", "share", "break-even", "r90", "r95", "rank", "x", "verdict"]}
    assert header == want[width]
    text = chargpt_audit.to_text(width=width)
    proj = next(l for l in text.splitlines() if "blocks.*.proj ×4" in l)
    # the "…actorize 3": never cut; at 80 columns shortened with its counts, break-even kept beside it
    assert proj.endswith("dense 1·fact 3" if width == 80 else "keep dense 1 · factorize 3")
    assert "70–92" in proj.split() and "72–80" in proj.split()  # ranges whole, never "…–92"
    assert "…" not in "".join(_rows(chargpt_audit, text)[1].values())  # short names: nothing cut at all


@pytest.mark.parametrize("width", WIDTHS)
def test_group_rows_with_mixed_verdicts_and_a_plan_fit(mixed_audit, width):
    header = _check(mixed_audit, width)
    # the group's compression is shown now (4.00, not "-"), and the mixed verdict shortens before break-even goes
    want = {80: ["#", "layer", "params", "share", "planned", "sugg.", "verdict"],
            100: ["#", "layer", "params", "share", "b-e", "r95", "planned", "sugg.", "verdict"],
            120: ["#", "layer", "m", "x", "n", "params", "share", "b-e", "r95", "planned", "sugg.", "verdict"]}
    assert header == want[width]
    text = mixed_audit.to_text(width=width)
    row = next(l for l in text.splitlines() if "×4" in l)
    assert row.endswith("factorize 2 · not planned 2") or row.endswith("fact 2·not planned 2")  # the plan's outcome, not the audit's own suggestion
    assert "8–16 (2/4)" in row  # the plan names two of the four members: the range and the count whole


def test_columns_give_way_in_the_fixed_order(chargpt_audit):
    labels = ["r90", "r95", "r99"]
    steps = layer_steps(labels, "r95")
    assert steps[:5] == [("short", "kind"), ("drop", "cum"), ("short", "params"), ("drop", "macs"), ("drop", "kind")]
    assert [k for a, k in steps if a == "drop" and k.startswith("r")] == ["r99", "r90", "r95"]
    wide = chargpt_audit.to_text(width=120)
    narrow = chargpt_audit.to_text(width=80)
    left = {w: re.search(r"left out to fit \d+ columns: ([^(]+) \(", re.sub(r"\s+", " ", t)).group(1).split(", ")
            for w, t in ((120, wide), (80, narrow))}
    assert left[120] == ["cum", "MACs", "kind", "r99"]
    assert left[80] == ["cum", "MACs", "kind", "r99", "r90", "x", "m x n"]  # break-even kept: the verdict shortens
    assert "left out" not in chargpt_audit.to_text(width=200)  # wide enough: the whole table, no legend


def test_each_finding_prints_its_fix(digits_mlp):
    model, x = digits_mlp
    a = auditor.audit(model, x, plan={"ranks": {"fc2": 300}}, cache=False, progress=False)
    lr001 = next(f for f in a.findings if f.code == "LR001")
    for width in WIDTHS:
        text = a.to_text(width=width)
        assert max(map(len, text.splitlines())) <= width
        flat = re.sub(r"\s+", " ", text)
        for f in a.findings:
            assert f.fix and f"fix: {' '.join(f.fix.split())}" in flat
    assert lr001.fix  # the rule gives one


def test_text_with_output_dir_writes_a_file(cli_inproc, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    out = tmp_path / "out"
    r = cli_inproc("sample_models/digits.py:mlp", "--no-cache", "--format", "text,json", "-o", out)
    assert r.returncode == 0, r.stderr
    txt = (out / "lowrank-audit.txt").read_text(encoding="utf-8")
    assert max(map(len, r.stdout.splitlines())) <= 80  # on screen at $COLUMNS
    assert txt != r.stdout and "fc2" in txt  # the file is wide: every column kept
    assert "left out to fit" not in txt and "m x n" in txt.split("#  layer")[1].splitlines()[0]
    assert f"wrote {out / 'lowrank-audit.txt'}" in r.stderr.splitlines()
    q = cli_inproc("sample_models/digits.py:mlp", "--no-cache", "--format", "text", "-o", out, "-q")
    assert q.returncode == 0 and q.stdout.startswith("UNMEASURED: ") and len(q.stdout.splitlines()) == 1  # the verdict
    assert (out / "lowrank-audit.txt").read_text(encoding="utf-8") == txt


def test_width_is_flag_or_columns_or_wide(cli_inproc, monkeypatch):
    """--width, else $COLUMNS, else (stdout not a terminal: a pipe, a CI log) wide: every column and name whole."""
    import os

    def no_terminal(*a):
        raise OSError("not a terminal")

    monkeypatch.setattr(os, "get_terminal_size", no_terminal)  # as in a pipe or a CI log, even under a terminal
    for env, flag, width in (("72", None, 72), (None, "90", 90), ("72", "0", None), (None, None, None)):
        if env is None:
            monkeypatch.delenv("COLUMNS", raising=False)
        else:
            monkeypatch.setenv("COLUMNS", env)
        r = cli_inproc("sample_models/chargpt.py:chargpt", "--no-cache", *(["--width", flag] if flag else []))
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        if width is not None:
            assert max(map(len, lines)) <= width
            assert max(map(len, lines)) >= width - 8  # the prose is wrapped at that width, not at a narrower one
        else:
            head = next(l for l in lines if l.startswith("#  layer")).split()
            assert head == ["#", "layer", "kind", "m", "x", "n", "params", "share", "cum", "MACs", "break-even",
                            "r90", "r95", "r99", "rank", "x", "verdict"]
            assert "left out to fit" not in r.stdout and "…" not in r.stdout  # nothing dropped, no name cut
    bad = cli_inproc("sample_models/chargpt.py:chargpt", "--no-cache", "--width", "-1")
    assert bad.returncode == 2 and "--width -1 is negative" in bad.stderr


def test_calibration_table_gives_way_without_cutting_numbers():
    from auditor.render.parts.calibration import CalRow
    from auditor.render.terminal import CAL_STEPS, _cal_columns, _cell, fit

    rows = [CalRow("model.layers.0.mlp.down_proj", 1_234_567, 11008, 1312, 1400, 904, 512, "928", "1,024",
                   "896: 0.01234", "3.01x", "1,024"),
            CalRow("lm_head", 8, 4096, None, None, None, None, "> b-e", "> b-e", "–", "–", "dense")]
    seen = {}
    for width in (60, 80, 100, 120):
        fitted = fit(_cal_columns(), rows, width, CAL_STEPS, name_floor=12)
        lines = fitted.lines(rows)
        assert max(map(len, lines)) <= width
        for line, row in zip(lines[1:], rows):
            for c, short in fitted.columns[1:]:
                assert _cell(c, short, 1, row) in line  # every kept number whole
        seen[width] = [(c.key, short) for c, short in fitted.columns]
    whole = [("layer", False), ("plan", False), ("rows", False), ("r1", False), ("r5", False), ("data", False), ("floor", False),
             ("cliff", False)]
    assert seen[120] == seen[100] == seen[80] == whole
    assert seen[60] == [("layer", False), ("plan", False), ("rows", True), ("r1", False), ("r5", False), ("data", False),
                        ("floor", False)]  # 1,234,567 -> 1.23M first, then the cliff
    assert "1.23M" in fit(_cal_columns(), rows, 60, CAL_STEPS, name_floor=12).lines(rows)[1]
