"""The PDF stays bounded for huge models: long names are cut in the middle, the appendix is capped, and the PDF
says what it left out and where the rest is (the HTML keeps every name whole)."""

import io

import pytest
import torch
from torch import nn

import auditor
from auditor.render.html import PDF_APPENDIX_CAP, PDF_NAME_MAX, cut_middle, cut_runs

pypdf = pytest.importorskip("pypdf")
pytest.importorskip("weasyprint")


def _pdf_text(audit) -> str:
    from auditor.render.pdf import render_pdf

    reader = pypdf.PdfReader(io.BytesIO(render_pdf(audit)))
    return " ".join(" ".join(p.extract_text() for p in reader.pages).split())  # lines joined, spaces collapsed


def test_cut_middle_keeps_head_and_tail():
    name = "h" * 50 + "m" * 9_900 + "t" * 50
    cut = cut_middle(name)
    assert len(cut) == PDF_NAME_MAX
    assert cut == "h" * 47 + "…" + "t" * 48
    assert cut_middle("short.name") == "short.name"
    assert cut_runs(f"layer {name} is tied") == f"layer {cut} is tied"


def test_pdf_of_a_10000_character_name_shows_it_cut_and_says_so():
    torch.manual_seed(0)
    long = "L" * 40 + "x" * 9_920 + "END" + "R" * 37
    assert len(long) == 10_000
    model = nn.Sequential()
    model.add_module(long, nn.Linear(16, 24))
    model.add_module("short", nn.Linear(24, 8))
    a = auditor.audit(model, torch.randn(2, 16), cache=False, progress=False)
    assert long in [l.name for l in a.layers]
    assert long in a.to_html()  # the HTML keeps it whole
    text = _pdf_text(a)
    packed = text.replace(" ", "")  # a cut name may still wrap across lines in its table cell
    assert cut_middle(long) in packed  # 47 head characters, "…", 48 tail characters
    assert "x" * 100 not in packed
    assert (f"1 name longer than {PDF_NAME_MAX} characters is shortened in the middle (…) in this PDF; the HTML and "
            "JSON reports give every name in full.") in text


class Many(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({f"l{i}": nn.Linear(4, 4 + i % 5) for i in range(n)})

    def forward(self, x):
        return x


def test_pdf_past_the_appendix_cap_states_it(monkeypatch):
    """The cap at work, lowered from 2,000 to 20 rows so that 30 layers pass it (a PDF of 3,000 layers took 31 s of
    the suite; benchmarks/render.py times the PDF of 1,000 and 10,000 layers)."""
    import auditor.render.html as html_mod

    assert PDF_APPENDIX_CAP == 2_000
    monkeypatch.setattr(html_mod, "PDF_APPENDIX_CAP", 20)
    torch.manual_seed(0)
    a = auditor.audit(Many(30), cache=False, progress=False)
    assert len(a.layers) == 30
    text = _pdf_text(a)
    assert "The 20 largest of the 30 layers, one per row." in text
    assert "10 more layers (the smallest) are left out of this PDF; the HTML and JSON reports list all 30." in text


def test_appendix_lines_align_and_long_names_take_a_line_of_their_own():
    from auditor.render.parts.pages import appendix_text
    from auditor.render.parts.view import LayerRow

    def row(i, name, planned=None):
        return LayerRow(rank_order=i, name=name, kind="linear", module_type="Linear", m=24, n=16, groups=1,
                        shape="24x16", params=384, share=0.6316, cumulative=0.6316, macs=None, calls=1, tied=False,
                        break_even=9.6, ranks=(10, 12, None), suggested=None, compression=None, energy_at_rank=None,
                        verdict="skip narrow", reason="", stable_rank=None, effective_rank=None, planned=planned)

    text = appendix_text([row(1, "fc1"), row(2, "n" * 50)], ["r90", "r95", "r99"], planned=True)
    lines = text.split("\n")
    w = 44  # the name column: the longest name, at most 44 characters
    assert lines[0] == f"{'#':>5} {'layer':<{w}}       m × n      params   share  b-even    r90    r95    r99   plan   sugg verdict"
    assert lines[1] == "─" * len(lines[0])
    figures = "      24x16         384  63.16%     9.6     10     12      –  dense      – skip narrow"
    assert lines[2] == f"    1 {'fc1':<{w}} {figures}"
    assert lines[3] == "    2 " + "n" * 50
    assert lines[4] == f"{'':>5} {'':<{w}} {figures}"
    assert len(lines) == 5


def test_report_css_parses_whole_and_keeps_table_rows_on_one_page():
    """Every top-level rule of report.css parses (a stray ``}`` once turned the next rule's selector into garbage,
    so WeasyPrint dropped ``tr { break-inside: avoid }`` and the Llama PDF split a row across pages), and the rule
    that keeps a table row on one page is among them."""
    tinycss2 = pytest.importorskip("tinycss2")
    from auditor.render.html import template_dir

    rules = tinycss2.parse_stylesheet((template_dir() / "report.css").read_text(encoding="utf-8"),
                                      skip_comments=True, skip_whitespace=True)
    assert [r for r in rules if r.type == "error"] == []
    selectors = {tinycss2.serialize(r.prelude).strip(): tinycss2.serialize(r.content) for r in rules
                 if r.type == "qualified-rule"}
    assert not [s for s in selectors if s.startswith("}")]
    row_rule = selectors.get("tr, td, th", "")
    assert "break-inside: avoid" in row_rule and "page-break-inside: avoid" in row_rule
