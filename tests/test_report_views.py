"""Reports at transformer size: block groups, a page per layer, the plan where people look, the baseline's rank
changes, Markdown under the PR-comment cap, and hostile names in every format."""

from __future__ import annotations

import base64
import json
import re

import pytest
import torch
from torch import nn

import auditor
from auditor.render import RenderContext
from auditor.render.parts.md_fit import GITHUB_COMMENT_LIMIT, measure
from auditor.render.parts.safe import md_code, md_text, middle, term

bs4 = pytest.importorskip("bs4")


def chart_ids(node, unique: bool = True):
    """The ids (matplotlib gids) inside the one chart <img> under ``node``: a set, or every id in order."""
    import xml.etree.ElementTree as ET

    imgs = [i for i in node.select("img") if i["src"].startswith("data:image/svg+xml;base64,")]
    assert len(imgs) == 1
    root = ET.fromstring(base64.b64decode(imgs[0]["src"].split(",", 1)[1]))
    ids = [el.get("id") for el in root.iter() if el.get("id")]
    return set(ids) if unique else ids


class Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    """Four blocks (up 32->96, down 96->32) and a head 32->10: groups layers.*.up and layers.*.down."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block(32, 96) for _ in range(4))
        self.head = nn.Linear(32, 10, bias=False)

    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return self.head(x)


@pytest.fixture(scope="module")
def stack_audit():
    return auditor.audit(Stack(), torch.randn(2, 32), cache=False, progress=False)


@pytest.fixture(scope="module")
def planned_audit():
    # layers.*.up at rank 8 (saves), layers.0.down at 30 (above break-even 24: no saving)
    ranks = {**{f"layers.{i}.up": 8 for i in range(4)}, "layers.0.down": 30}
    return auditor.audit(Stack(), torch.randn(2, 32), plan={"ranks": ranks}, cache=False, progress=False)


def test_groups_in_html_table_markdown_and_terminal(stack_audit):
    a = stack_audit
    soup = bs4.BeautifulSoup(a.to_html(), "html.parser")
    groups = soup.select("#layer-table tr.group")
    assert [g["data-group"] for g in groups] == ["layers.*.down", "layers.*.up"]  # equal sizes: name order
    up = groups[1]
    assert up.select_one(":scope > td.params").text == f"{4 * 32 * 96:,}"  # 12,288
    # the members are sibling rows of the group's row, in its own tbody (not a table nested in the name cell)
    body = up.find_parent("tbody")
    members = [tr["data-layer"] for tr in body.select(":scope > tr.member")]
    assert members == [f"layers.{i}.up" for i in range(4)]
    assert not soup.select("#layer-table td table") and not soup.select("#layer-table td details")
    first = body.select_one(":scope > tr.member")
    assert len(first.select(":scope > td")) == len(up.select(":scope > td"))  # every column, as a layer's row
    assert first.select_one("td.params").text == f"{32 * 96:,}" and first.select_one("a")["href"] == "#layer-layers.0.up"
    # the head stays a plain row, after the two groups
    assert [b.select_one("tr")["data-layer" if i == 2 else "data-group"]
            for i, b in enumerate(soup.select("#layer-table > tbody"))] == ["layers.*.down", "layers.*.up", "head"]
    md = a.to_markdown()
    assert "| 2 | `layers.*.up` ×4 | 96x32 | 12,288 |" in md
    text = a.to_text(width=120)
    assert re.search(r"^\s*2\s+layers\.\*\.up ×4\s+(?:linear\s+)?96x32\s+12,288", text, re.M)
    assert "groups of repeated blocks" in text
    assert [g.label for g in a.groups()] == ["layers.*.down", "layers.*.up", "head"]


def test_every_layer_and_group_has_its_own_page(stack_audit):
    a = stack_audit
    soup = bs4.BeautifulSoup(a.to_html(), "html.parser")
    links = {x["href"][1:] for x in soup.select("#layer-table a[href^='#']")}
    pages = {p["id"]: p for p in soup.select("#pages article.page")}
    assert links <= set(pages)
    assert {"group-layers._.up", "layer-layers.0.up", "layer-head"} <= set(pages)
    page = pages["layer-layers.0.up"]
    sp = a.spectra["layers.0.up"]
    facts = {d.select_one("dt").text: d.select_one("dd").text for d in page.select("dl.facts > div")}
    assert facts["stable rank"] == f"{sp.stable_rank:.1f}" and facts["effective rank"] == f"{sp.effective_rank:.1f}"
    assert facts["break-even"] == "24.0"
    ids = chart_ids(page)  # one matplotlib SVG: a spectrum and an energy panel, break-even marked
    assert {"panel-spectrum", "panel-energy", "curve-0", "mark-break-even", "mark-target"} <= ids
    assert "panel-measured" not in ids
    # a group of 4 overlays its 4 members' curves (up to 6 are drawn as they are), in each panel
    group = chart_ids(pages["group-layers._.up"], unique=False)
    assert sorted(i for i in group if i.startswith("curve-")) == [f"curve-{i}" for i in range(4) for _ in range(2)]
    assert "no calibration data" in page.text
    # no hand-drawn inline SVG is left: every chart is an <img> of a matplotlib SVG
    assert not soup.select("svg") and not soup.select("polyline")


def test_measured_curve_hook(stack_audit):
    from auditor.render.html import render

    pts = [(4, 0.5), (8, 0.7), (16, 0.9)]
    html = render(stack_audit, RenderContext(measured={"layers.0.up": pts}))
    page = bs4.BeautifulSoup(html, "html.parser").select_one("#layer-layers\\.0\\.up")
    ids = chart_ids(page)
    assert {"panel-measured", "measured-0"} <= ids  # a third panel: the metric has its own axis, not the energy's
    assert "no calibration data" not in page.text


def test_plan_shown_where_people_look(planned_audit):
    a = planned_audit
    soup = bs4.BeautifulSoup(a.to_html(), "html.parser")
    head = [th.text for th in soup.select("#layer-table > thead th")]
    assert "planned" in head and "suggested" in head
    up = soup.select_one('#layer-table tr[data-group="layers.*.up"]')
    assert up.select_one("td.planned").text == "8"
    # the item above break-even: its real after-count (30 * (96 + 32) = 3,840 > 3,072) and a flag, in every format
    row = next(tr for tr in soup.select("#plan-table tbody tr") if tr.select_one("td.name").text == "layers.0.down")
    assert row.select_one("td.after").text.startswith("3,840") and "flagged" in row["class"]
    assert "above break-even 24.0" in row.text
    text = a.to_text(width=160)
    assert "! layers.0.down r=30: 3,072 -> 3,840 (x 0.80); above break-even 24.0" in text
    assert re.search(r"layers\.\*\.up ×4 .*\s8\s+\S+\s+3\.00\s", text)  # 96*32 / (8 * 128)
    assert re.search(r"layers\.\*\.down ×4 .*\s30 \(1/4\)\s", text)  # the plan names one member
    md = a.to_markdown()
    assert "| `layers.0.down` | 30 |" in md and "3,072 → 3,840 ⚠️ no saving: kept dense" in md
    assert "| `layers.*.up` ×4 | 8 |" in md  # the group's members agree: one row
    df = a.to_pandas()
    assert str(df["planned"].dtype) == "Int64" and int(df.set_index("name").loc["layers.1.up", "planned"]) == 8
    assert df.set_index("name")["planned"].isna()["head"]


def test_baseline_rank_changes_in_every_format(stack_audit, planned_audit):
    base = stack_audit.to_dict()  # the suggested plan
    a = planned_audit
    before = {it.layer: it.rank for it in stack_audit.review.items}
    data = json.loads(a.to_json(baseline=base))["baseline"]
    changes = {c["layer"]: (c["before"], c["after"]) for c in data["rank_changes"]}
    assert changes["layers.0.up"] == (before.get("layers.0.up"), 8)
    assert changes["layers.0.down"] == (before.get("layers.0.down"), 30)
    expected_down = f"{before['layers.0.down']:,}" if "layers.0.down" in before else "dense"
    assert f"rank  layers.0.down: {expected_down} -> 30" in a.to_text(width=160, baseline=base)
    assert f"- rank `layers.0.down`: {expected_down} → 30" in a.to_markdown(baseline=base)
    soup = bs4.BeautifulSoup(a.to_html(baseline=base), "html.parser")
    rows = {tr.select_one("td.name").text: [td.text for td in tr.select("td")[1:]]
            for tr in soup.select("#rank-changes tbody tr")}
    assert rows["layers.0.down"] == [expected_down, "30"]


def test_markdown_of_a_70b_config_fits_a_pr_comment():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                   num_attention_heads=64, num_key_value_heads=8, vocab_size=32000, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    a = auditor.audit(model, progress=False)  # meta device: structure only, nothing allocated
    assert a.total_params == 68_976_648_192
    md = a.to_markdown()
    assert measure(md) < GITHUB_COMMENT_LIMIT
    assert "| 1 | `model.layers.*.mlp.down_proj` ×80 | 8192x28672 | 18,790,481,920 |" in md
    assert "Spectra were not computed" in md


def test_markdown_cut_says_how_many_more():
    names = [f"blk_{i}_{'x' * 60}" for i in range(1500)]  # 1,500 distinct names: no grouping helps
    m = nn.Sequential()
    for n in names:
        m.add_module(n, nn.Linear(4, 4, bias=False))
    a = auditor.audit(m, spectra=False, progress=False)
    md = a.to_markdown()
    assert measure(md) <= 60_000
    shown = len(re.findall(r"^\| \d+ \| `blk_", md, re.M))
    assert 0 < shown < 1500
    assert f"_… {1500 - shown:,} more layer groups in the attached report._" in md
    assert md.index("## Low-rank audit") == 0 and md.rstrip().endswith("</sub>")


HOSTILE = ["evil`](http://x.example)", "![img](http://x.example/a.png)", "# heading", "<img src=x onerror=alert(1)>",
           "\x1b[31mred\x1b[0m", "a\nb", "\u202eexe.txt", "ctl\x9b1m", "[link](javascript:alert(1))"]


def test_safe_escapes_hostile_names():
    for name in HOSTILE:
        t = term(name)
        assert not re.search(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]", t), t
        code = md_code(name)
        fence = re.match(r"`+", code).group(0)
        inner = code[len(fence):-len(fence)]
        assert "`" * len(fence) not in inner and "\n" not in inner
        txt = md_text(name)
        assert "<" not in txt and "](" not in txt.replace("\\](", "") and "\n" not in txt
    assert term("\x1b[31m") == "\\x1b[31m" and term("\u202e") == "\\u202e"


class Hostile(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for i, n in enumerate(["evil`](javascript:alert(1))", "x\x1b[2Jy", "\u202egnp-exe", "$\\undefinedcmd{x}$"]):
            self.add_module(n, nn.Linear(8 + i, 8, bias=False))

    def forward(self, x):
        return x


def test_hostile_names_in_markdown_terminal_and_charts():
    a = auditor.audit(Hostile(), cache=False, progress=False)
    text = a.to_text()
    assert "\x1b" not in text and "\u202e" not in text
    assert "x\\x1b[2Jy" in text and "\\u202egnp-exe" in text
    md = a.to_markdown()
    assert "\x1b" not in md and "\u202e" not in md
    assert "`` evil`](javascript:alert(1)) ``" in md  # one backtick inside: a two-backtick fence holds it
    assert "](javascript" not in re.sub(r"(`+) .*? \1|`[^`]*`", "", md)
    html = a.to_html()  # the share chart draws $\undefinedcmd{x}$ as text (mathtext off)
    from auditor.render.html import context

    ctx = context(a)
    share = ctx["share_chart"]
    assert ctx["energy_chart"].startswith("data:image/svg+xml;base64,")  # the overview's energy curves
    assert share.startswith("data:image/svg+xml;base64,") and f'src="{share}"' in html
    assert "$\\undefinedcmd{x}$" in base64.b64decode(share.split(",", 1)[1]).decode("utf-8")


def test_long_names_are_cut_in_the_middle():
    enc = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias"
    dec = "decoder.block.0.layer.0.SelfAttention.relative_attention_bias"
    assert middle(enc, 30) != middle(dec, 30)
    assert middle(enc, 40) == "encoder.block.0….relative_attention_bias"
    m = nn.Module()
    for n in ("encoder_block_0_layer_0_SelfAttention_relative_attention_bias_x",
              "decoder_block_0_layer_0_SelfAttention_relative_attention_bias_x"):
        m.add_module(n, nn.Embedding(32, 8))
    a = auditor.audit(m, spectra=False, progress=False)
    rows = [l for l in a.to_text(width=70).splitlines() if "relative" in l or "…" in l]
    names = [r.split()[1] for r in rows if r.strip()[:1].isdigit()]
    assert len(names) == 2 and {n[:7] for n in names} == {"encoder", "decoder"} and all("…" in n for n in names)


def test_compression_header_is_explained(stack_audit):
    soup = bs4.BeautifulSoup(stack_audit.to_html(), "html.parser")
    x = next(th for th in soup.select("#layer-table > thead th") if th.text == "×")
    assert "m·n / (r·(m+n))" in x["title"]
    assert "x = compression m*n / (r*(m+n))" in stack_audit.to_text(width=120)
    assert "x = compression m·n / (r·(m+n))" in stack_audit.to_markdown()


def test_no_spectra_says_so_in_every_format():
    a = auditor.audit(Stack(), torch.randn(2, 32), spectra=False, progress=False)
    assert "spectra were not computed" in a.to_text() and "worth factorizing" not in a.to_text()
    assert "Spectra were not computed" in a.to_markdown() and "worth factorizing" not in a.to_markdown()
    html = a.to_html()
    assert "Spectra were not computed" in html and "none reaches the target energy" not in html


def test_repr_html_styles_itself(stack_audit):
    soup = bs4.BeautifulSoup(stack_audit._repr_html_(), "html.parser")
    div = soup.select_one("div.lowrank-audit")
    assert "padding" in div["style"]
    cells = soup.select("tbody td")
    numeric = [td for td in cells if re.fullmatch(r"[\d,.%]+", td.text)]
    assert numeric and all("text-align:right" in td["style"] for td in numeric)
    assert soup.select("tbody tr")[0].select_one("td").text == "layers.*.down ×4"


def test_emit_plan_and_spectrum_values(stack_audit, tmp_path):
    text = stack_audit.emit_plan(tmp_path / "plan.toml")
    assert (tmp_path / "plan.toml").read_text() == text and "[ranks]" in text
    sp = stack_audit.spectra["head"]
    assert sp.values == sp.sigma[0] and len(sp.values) == 10
    assert stack_audit.stable_ranks["head"] == sp.stable_rank


# ---- HTML/PDF layout: order of the sections, grouped skipped layers, wording and rounding (issue 21) -------------
def _section_ids(html: str) -> list[str]:
    return [s["id"] for s in bs4.BeautifulSoup(html, "html.parser").select("main > section")]


@pytest.fixture(scope="module")
def meta_stack_audit():
    with torch.device("meta"):
        model = Stack()
    return auditor.audit(model, cache=False, progress=False)


def test_findings_come_first_in_the_html_and_in_the_pdf(planned_audit, stack_audit):
    from auditor.render.html import render

    assert planned_audit.findings  # layers.0.down is planned above its break-even
    ids = _section_ids(render(planned_audit))
    assert ids[:3] == ["summary", "findings", "plan"]
    assert ids.index("findings") < ids.index("shares") < ids.index("energy")  # before any chart
    pdf = _section_ids(render(planned_audit, pdf=True))
    assert pdf[:3] == ["summary", "findings", "plan"]  # the HTML's order: verdict, findings, plan
    # the drill-down after them, the per-layer pages last (only the appendix and reference material follow)
    assert pdf.index("findings") < pdf.index("layers") < pdf.index("pages") < pdf.index("appendix")
    assert pdf[pdf.index("pages"):] == ["pages", "appendix", "method", "environment"]
    # no findings: the HTML says so further down instead of first
    ids = _section_ids(render(stack_audit))
    assert not stack_audit.findings and ids.index("findings") > ids.index("layers")


def test_skipped_layers_are_grouped_like_layers(meta_stack_audit):
    from auditor.render.html import render

    a = meta_stack_audit
    soup = bs4.BeautifulSoup(render(a), "html.parser")
    table = soup.select_one("#skipped table")
    groups = table.select("tr.group")
    assert [g["data-group"] for g in groups] == ["layers.*.down", "layers.*.up"]
    assert [td.text for td in groups[0].select("td")][1:3] == ["×4", "skipped"]
    assert "on the meta device" in groups[0].select("td")[3].text
    # members are sibling rows of their group; the head is one plain row: 3 rows with a badge, not 9
    body = groups[1].find_parent("tbody")
    assert [tr["data-layer"] for tr in body.select("tr.member")] == [f"layers.{i}.up" for i in range(4)]
    assert len(table.select("span.pill")) == 3
    assert table.select("tbody > tr:not(.member)")[-1]["data-layer"] == "head"
    assert "9 weights in 3 groups" in soup.select_one("#skipped p.note").text
    # the PDF lists the groups only
    pdf = bs4.BeautifulSoup(render(a, pdf=True), "html.parser").select_one("#skipped table")
    assert len(pdf.select("tr.group")) == 2 and not pdf.select("tr.member") and not pdf.select("button")


def test_pdf_has_no_interactive_wording(planned_audit):
    from auditor.render.html import render

    html = render(planned_audit)
    assert "Click a column to sort" in html and "button" in html  # the HTML's table sorts and opens groups
    printed = render(planned_audit, pdf=True)
    soup = bs4.BeautifulSoup(printed, "html.parser")
    assert not soup.select("script, button, details, .noprint")
    words = soup.get_text(" ")
    for w in ("Click", "click", "▸", "button", "opens"):
        assert w not in words, w


def test_pdf_text_is_in_reading_order_without_click(planned_audit):
    pypdf = pytest.importorskip("pypdf")
    pytest.importorskip("weasyprint")
    import io

    from auditor.render.pdf import render_pdf

    reader = pypdf.PdfReader(io.BytesIO(render_pdf(planned_audit)))
    text = " ".join(" ".join(p.extract_text() for p in reader.pages).split())
    assert "lick" not in text  # "Click ..." / "click ..."
    at = [text.index(h) for h in ("Findings", "Plan review", "Where the parameters are", "Layers", "Top layers",
                                  "Appendix: every layer")]
    assert at == sorted(at)
    assert "planned ranks save" in reader.pages[0].extract_text().replace("\n", " ")  # the verdict on page 1


def test_shares_round_alike_in_the_table_the_pages_and_the_card(planned_audit):
    from auditor.render.html import render
    from auditor.render.parts.view import share_pct

    a = planned_audit
    soup = bs4.BeautifulSoup(render(a), "html.parser")
    head = soup.select_one("#layer-table tr[data-layer='head']")
    share = a.layer("head").share
    assert head.select("td")[4].text == share_pct(share) == f"{100 * share:.1f}%"
    page = soup.select_one("#layer-head")
    facts = {d.select_one("dt").text: d.select_one("dd").text for d in page.select("dl.facts > div")}
    assert facts["params"] == f"{a.layer('head').params:,} ({share_pct(share)})"
    assert share_pct(a.review.share_saved) in soup.select_one("#summary .cards").text
    assert share_pct(0.6099) == share_pct(0.61) == "61.0%" and share_pct(0.00049) == "0.049%"


def test_a_trace_failure_reads_as_a_sentence(stack_audit):
    import dataclasses

    from auditor.render.html import render
    from auditor.render.parts.view import trace_sentence

    raw = "torch.fx.symbolic_trace failed: ValueError: code: co_varnames is too small"
    a = dataclasses.replace(stack_audit, trace_method=auditor.results.TraceMethod.EXPORT, trace_failures=[raw])
    s = trace_sentence(a)
    assert s == ("Traced with torch.export, because torch.fx.symbolic_trace could not trace the model's forward code "
                 "(the JSON report's trace_failures gives the error).")
    html = render(a)
    assert s in bs4.BeautifulSoup(html, "html.parser").select_one("#summary").text
    assert "co_varnames" not in html and "ValueError" not in html
    b = dataclasses.replace(stack_audit, trace_method=auditor.results.TraceMethod.WALK,
                            trace_failures=["torch.fx.symbolic_trace not tried: --tracer walk",
                                            "torch.export not tried: no example inputs"])
    assert trace_sentence(b) == ("Traced with module walk: no data-flow graph, edges follow module call order, because "
                                 "torch.fx.symbolic_trace was not tried (--tracer walk) and torch.export was not tried "
                                 "(no example inputs).")


def test_chart_legends_draw_each_line_as_the_chart_does(planned_audit):
    from auditor.render.html import render
    from auditor.render.parts.layer_charts import _energy_label

    soup = bs4.BeautifulSoup(render(planned_audit), "html.parser")
    root = chart_svg(soup.select_one("#energy"))
    curves = {el.get("id"): style_of(el) for el in root.iter() if (el.get("id") or "").startswith("curve-")}
    assert list(curves) == ["curve-0", "curve-1", "curve-2"]
    legend = next(el for el in root.iter() if el.get("id") == "legend_1")  # drawn by matplotlib, from the lines
    swatches = [style_of(el) for el in legend.iter() if (el.get("id") or "").startswith("line2d_")]
    assert swatches[:3] == list(curves.values())  # each swatch has its line's colour, width and dashes
    assert len({c["stroke"] for c in curves.values()}) == 3  # three colours
    assert len({c.get("stroke-dasharray", "none") for c in curves.values()}) == 3  # and three dash patterns
    from auditor.render.parts import layer_charts as lc
    import numpy as np

    es = [np.asarray(planned_audit.spectra[n].energy) for n in ("layers.0.down", "layers.0.up", "head")]
    ax = build(lc._overview_fig, es, ["a", "b", "c"], 0.95).axes[0]
    # the band from E = 0.9 to 1 takes most of the height: the axis is 1 - E on a log scale, labelled with E
    assert ax.get_yscale() == "log" and ax.yaxis_inverted()
    lo, hi = sorted(ax.get_ylim())
    import math

    assert math.log(0.1 / lo) / math.log(hi / lo) > 0.6  # a tenth of it on a linear axis
    assert [_energy_label(v) for v in (1, 0.1, 0.01, 0.001, 0.3)] == ["0", "0.9", "0.99", "0.999", ""]


def chart_svg(node):
    import xml.etree.ElementTree as ET

    imgs = [i for i in node.select("img") if i["src"].startswith("data:image/svg+xml;base64,")]
    assert len(imgs) == 1
    return ET.fromstring(base64.b64decode(imgs[0]["src"].split(",", 1)[1]))


def style_of(group) -> dict:
    """The stroke of the first path inside an SVG group, as a dict of its style properties."""
    path = next(el for el in group.iter() if el.tag.endswith("}path") and "stroke" in (el.get("style") or ""))
    props = dict(kv.split(":", 1) for kv in path.get("style").replace(" ", "").split(";") if ":" in kv)
    return {k: v for k, v in props.items() if k in ("stroke", "stroke-width", "stroke-dasharray")}


def build(fn, *args):
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from auditor.render.parts import layer_charts as lc

    with matplotlib.rc_context(lc._RC):
        fig = fn(*args)
        FigureCanvasAgg(fig).draw()  # tests only: to read the legend as drawn
    return fig


def test_measured_floor_charts_for_every_measured_layer(stack_audit):
    from types import SimpleNamespace

    from auditor.render.parts import calibration
    from auditor.render.parts.layer_charts import floor_chart

    a = stack_audit
    names = [l.name for l in a.layers]
    assert len(names) == 9  # more than the 8 charts there used to be at most
    lcs = {n: SimpleNamespace(curve=[(r, 0.5 / r) for r in (1, 2, 4, 8, 16, 24)],
                              floor=SimpleNamespace(floor=16, points=[(8, 0.02), (16, 0.008), (24, 0.004)]))
           for n in names}
    from auditor.calresults import CalibrationReport

    cal = CalibrationReport("c", "0.25", "", 1, 1, "relative output error", False, 0.01, 0.0, layers=lcs)
    charts = calibration.floor_data(SimpleNamespace(calibration=cal, layers=a.layers, layer=a.layer))
    assert [c.name for c in charts] == names  # every layer with points, largest first
    assert all(floor_chart(c).startswith("<?xml") for c in charts)  # each one drawn
    layer = a.layer("layers.0.up")
    from auditor.render.parts.layer_charts import FloorChart, _floor_fig

    fig = _floor_fig(FloorChart("layers.0.up", lcs["layers.0.up"].floor.points, lcs["layers.0.up"].curve, 0.01,
                                "relative output error", True, layer.break_even, 16, (layer.m, layer.n)))
    ax, ax2 = fig.axes  # the tier-1 layer-output error on its own (right-hand) axis
    assert ax.get_ylabel() == "relative output error" and ax2.get_ylabel() == "layer-output error"
    assert [l.get_label() for l in ax2.get_lines()] == ["layer-output error (tier 1, right axis)"]
    assert ax.get_legend() is None and ax2.get_legend() is None  # one legend for all charts, in the report
    assert 8 / 1.5 < ax.get_xlim()[0] < 8  # the axis starts just below the first measured rank, not at 1
    assert ax.get_title(loc="left") == "layers.0.up (96 x 32): break-even 24.0, measured floor 16"


def test_frontier_log_ticks_are_plain_numbers():
    import re as _re

    from auditor.render.parts.layer_charts import FrontierChart, _frontier_fig, _svg

    pts = [(0.856, 0.0052, True), (0.867, 0.0089, True), (0.889, 0.0209, False), (0.899, 0.0642, False)]
    svg = _svg(_frontier_fig(FrontierChart(pts, 0.01, "relative output error", chosen=0.867)))
    assert "mathdefault" not in svg and "times10" not in svg  # TeX source showed up in the browsers' SVG
    labels = [t for t in _re.findall(r"<!-- ([^>]*) -->", svg) if t[:1].isdigit() and "." in t]
    assert labels == ["0.01", "0.005", "0.02", "0.05"]  # 1, 2 and 5 of each decade, no crowded minor labels


def test_pdf_has_no_interactive_wording(planned_audit):
    from auditor.render.html import render

    soup = bs4.BeautifulSoup(render(planned_audit, pdf=True), "html.parser")
    text = soup.get_text(" ")
    for word in ("Click", "click", "button", "opens", "open the group"):
        assert word not in text, word
    assert not soup.select("script") and not soup.select("button")
    assert "Click a column to sort" in bs4.BeautifulSoup(render(planned_audit), "html.parser").get_text(" ")


def test_plan_tables_show_the_measured_error_of_calibrated_layers(planned_audit):
    import dataclasses

    from auditor.calresults import CalibrationReport, LayerCalibration, LayerFloor
    from auditor.render.parts.calibration import measured_error, rows
    from auditor.render.html import render

    lcs = {"layers.0.up": LayerCalibration("layers.0.up", 64, 32, {}, 8, "factorize", "", [(4, 0.09), (6, 0.04)],
                                           floor=LayerFloor(8, 0.004, 4, 0.03, 3.0, False, [(4, 0.03), (8, 0.0041)])),
           "layers.1.up": LayerCalibration("layers.1.up", 64, 32, {}, 8, "factorize", "", [(4, 0.09), (6, 0.05)])}
    cal = CalibrationReport("calib.safetensors", "0.25", "", 64, 16, "relative output error", False, 0.01, 0.0,
                            layers=lcs)
    assert measured_error(cal, "layers.0.up", 8).text(cal) == "0.41% (tier 2, layer alone)"
    assert measured_error(cal, "layers.1.up", 8).text(cal) == "\u2264 5.0% (tier 1, layer output)"  # rank 6 below
    assert measured_error(cal, "layers.1.up", 6).text(cal) == "5.0% (tier 1, layer output)"
    assert measured_error(cal, "layers.1.up", 2) is None and measured_error(cal, "head", 8) is None
    # one row builder, each format its own formatter
    assert rows(cal)[0].cliff == "4: 0.03" and rows(cal, lambda v: f"{100 * v:.1f}%", "")[0].cliff == "4: 3.0%"
    assert rows(cal)[0].compression == "3.00x" and rows(cal, times="")[0].compression == "3.00"
    a = dataclasses.replace(planned_audit, calibration=cal)
    soup = bs4.BeautifulSoup(render(a, RenderContext(charts=False)), "html.parser")
    head = [th.text for th in soup.select("#plan-table thead th")]
    assert head.index("measured error") < head.index("energy kept (data-free)")
    cells = {tr.select_one("td.name").text: tr.select_one("td.measured").text for tr in soup.select("#plan-table tbody tr")}
    assert cells["layers.0.up"] == "0.41% (tier 2, layer alone)" and cells["layers.0.down"] == "not measured"
    md = a.to_markdown()
    assert "| measured error, else energy kept (data-free) |" in md
    assert "| `layers.0.up` | 8 | – | 24.0 | 3,072 → 1,024 | 0.41% (tier 2, layer alone) |" in md


def test_each_format_draws_the_calibration_from_one_view(planned_audit, monkeypatch):
    import dataclasses

    from auditor.calresults import CalibrationReport, LayerCalibration, LayerFloor
    from auditor.render import REPORTERS
    from auditor.render.parts import calibration

    lcs = {"layers.0.up": LayerCalibration("layers.0.up", 64, 32, {"0.01": 12}, 8, "factorize", "",
                                           [(4, 0.09), (6, 0.04)],
                                           floor=LayerFloor(8, 0.004, 4, 0.03, 3.0, False, [(4, 0.03), (8, 0.0041)]))}
    cal = CalibrationReport("calib.safetensors", "0.25", "", 64, 16, "relative output error", False, 0.01, 0.0,
                            layers=lcs, warnings=["a warning the view carries"])
    a = dataclasses.replace(planned_audit, calibration=cal)
    built = []
    real = calibration.view
    monkeypatch.setattr(calibration, "view", lambda audit: built.append(audit) or real(audit))
    cv = real(a)
    assert [(r.layer, r.r1, r.suggested, r.floor, r.cliff) for r in cv.rows] == [("layers.0.up", 12, "8", "8", "4: 0.03")]
    assert cv.md_rows[0].cliff == "4: 3.00%" and cv.md_rows[0].compression == "3.00"  # the Markdown's units
    for fmt in ("text", "md", "html"):
        built.clear()
        out = REPORTERS[fmt].render(a, RenderContext(charts=False, width=0))
        assert len(built) == 1, fmt  # built once per report, every section drawn from it
        assert cv.summary.split(":")[0] in out.replace("\n", " ") or fmt == "md", fmt
        assert "a warning the view carries" in out, fmt
