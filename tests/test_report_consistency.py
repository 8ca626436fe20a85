"""Every format tells one story (issue 29): a data-free audit, a plan review and two calibrated audits (the char
transformer and the sample Llama) rendered in every format, and checked for what a reader must never see: PASS where
nothing was measured, a layer whose plan rank and table verdict disagree, a language model's perplexity without its
dense baseline, a column dropped from the .txt report. Then the HTML in headless Chromium: nothing wider than a 400 px
phone screen, no table cell taller than three lines at 1400 px.

The calibrated audits are kept cheap: the char transformer's calibration file with a quarter held out, the Llama on
the first few kilobytes of its texts in 64-token windows, no sensitivity probes; each is audited once per module."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import auditor
from auditor.render import REPORTERS, RenderContext
from auditor.render.parts.calibration import plan_ranks

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "sample_models" / "llama"
FORMATS = ("text", "json", "md", "html", "pdf")
PHONE = ("llama", "review-bad")  # the audits whose HTML, charts and all, headless Chromium measures


def _opts(**kw) -> auditor.AuditOptions:
    return auditor.AuditOptions(cache=False, progress=False, **kw)


@pytest.fixture(scope="module")
def audits(tmp_path_factory) -> dict[str, auditor.Audit]:
    tmp = tmp_path_factory.mktemp("consistency")
    bad = tmp / "bad-plan.toml"  # fc1 above break-even (kept dense), head narrow: FAIL
    bad.write_text('finetune = "1 epoch"\n[ranks]\n"fc1" = 60\n"fc2" = 14\n"fc3" = 24\n"head" = 8\n', encoding="utf-8")
    clean = tmp / "clean-plan.toml"  # nothing wrong with it, but nothing measured it: UNMEASURED
    clean.write_text('finetune = "1 epoch, lr 1e-4"\n[ranks]\n"fc2" = 16\n"fc3" = 24\n', encoding="utf-8")
    for name in ("calib.txt", "holdout.txt"):  # the first few kilobytes of each text, cut at a line end
        text = (LLAMA / name).read_text(encoding="utf-8")[:4000]
        (tmp / name).write_text(text[:text.rfind("\n") + 1], encoding="utf-8")
    mlp = "sample_models/digits.py:mlp"
    return {
        "free": auditor.audit_source(mlp, options=_opts()),
        "review-bad": auditor.audit_source(mlp, plan=str(bad), options=_opts()),
        "review-clean": auditor.audit_source(mlp, plan=str(clean), options=_opts()),
        "chargpt": auditor.audit_source("sample_models/chargpt.py:chargpt", options=_opts(
            calibration="sample_models/chargpt_calib.safetensors", holdout=0.25, probe_sensitivity=False)),
        "llama": auditor.audit_source(str(LLAMA), options=_opts(
            calibration=str(tmp / "calib.txt"), holdout=str(tmp / "holdout.txt"), calibration_length=64,
            probe_sensitivity=False)),
    }


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def rendered(audits) -> dict[str, dict[str, str]]:
    """Each audit in each format, as text: the .txt report (wide), the JSON, the Markdown, the HTML's text, the PDF's
    extracted text."""
    pypdf = pytest.importorskip("pypdf")
    bs4 = pytest.importorskip("bs4")
    out: dict[str, dict[str, str]] = {}
    for key, a in audits.items():
        # the charts (SVG images: no text these checks read) only where the browser test measures the page with them
        ctx = RenderContext(width=0, charts=key in PHONE)
        html = REPORTERS["html"].render(a, ctx)
        pdf = REPORTERS["pdf"].render(a, ctx)
        out[key] = {
            "text": REPORTERS["text"].render(a, ctx), "json": REPORTERS["json"].render(a, ctx),
            "md": REPORTERS["md"].render(a, ctx), "html": html,
            "html_text": bs4.BeautifulSoup(html, "html.parser").get_text(" "),
            "pdf_text": " ".join(p.extract_text() for p in pypdf.PdfReader(io.BytesIO(pdf)).pages),
        }
    return out


def _verdicts(r: dict[str, str]) -> dict[str, str]:
    import bs4

    md_head = next(l for l in r["md"].splitlines() if l.startswith("**"))
    return {"text": r["text"].rstrip().split("\n\n")[-1], "json": json.loads(r["json"])["verdict"], "md": md_head,
            "html": bs4.BeautifulSoup(r["html"], "html.parser").select_one(".verdict").get_text(" "),
            "pdf": r["pdf_text"]}


@pytest.mark.parametrize("key, status, measured", [("free", "unmeasured", False), ("review-clean", "unmeasured", False),
                                                   ("review-bad", "fail", False), ("chargpt", "pass", True),
                                                   ("llama", "pass", True)])
def test_status_says_what_was_measured_in_every_format(audits, rendered, key, status, measured):
    a, r = audits[key], rendered[key]
    d = json.loads(r["json"])
    assert (d["status"], d["measured"]) == (status, measured) and (a.status, a.measured) == (status, measured)
    assert a.exit_code == (1 if status == "fail" else 0)  # UNMEASURED exits 0 at the default --fail-on error
    word = status.upper()
    for fmt, line in _verdicts(r).items():
        assert word in line, (fmt, line)
        if not measured:
            assert "PASS" not in line, (fmt, line)
    if status == "unmeasured":
        assert "measure with --calibration" in d["verdict"]
        from auditor.verdict.policy import exit_code

        assert int(exit_code(a, "unmeasured")) == 1 and int(exit_code(a, "never")) == 0
    assert isinstance(a.findings, list) and str(a).startswith("lowrank-audit: ")  # str(a) is the table
    assert repr(a).count("\n") == 0


def _plan(a: auditor.Audit) -> dict[str, int]:
    """The plan's rank per layer it factorizes, straight from the plan review (the source of truth)."""
    from auditor.results import PlanVerdict

    return {it.layer: it.rank for it in a.review.items if it.verdict in (PlanVerdict.FACTORIZE, PlanVerdict.NARROW)}


@pytest.mark.parametrize("key", ["free", "review-bad", "review-clean", "chargpt", "llama"])
def test_no_layer_table_contradicts_the_plan(audits, rendered, key):
    pd = pytest.importorskip("pandas")
    a, r = audits[key], rendered[key]
    plan = _plan(a)
    assert plan and plan_ranks(a) == plan
    df = a.to_pandas()
    assert df.index.name == "layer" and list(df.index) == [l.name for l in a.layers]
    rank_col = "planned" if not a.review.suggested else "suggested"
    for name, row in df.iterrows():
        factorized = row["verdict"].startswith("factorize")
        assert factorized == (name in plan), (name, row["verdict"], plan.get(name))
        if factorized:
            assert int(row[rank_col]) == plan[name]
        elif rank_col == "suggested":
            assert row[rank_col] is pd.NA or row["verdict"] in ("skip narrow", "skipped"), (name, row[rank_col])
    if key == "review-bad":  # planned above break-even: the plan keeps it dense, and the table says so
        assert df.loc["fc1", "verdict"] == "kept dense" and df.loc["head", "verdict"] == "factorize"  # narrow: LR003
        assert "3 of 4 planned layers factorized" in _flat(r["text"])
        assert "3 layers factorized (1 planned at a rank that saves nothing, kept dense)" in r["md"]
        lr001 = next(f for f in a.findings if f.code == "LR001")
        assert f"e.g. {a.suggestions['fc1'].rank}, the suggested rank" in lr001.fix  # the number the table shows
        assert re.search(r"\n\s+at \S*bad-plan\.toml:3\n", r["text"])  # where: the plan's fc1 line
    cal = a.calibration
    if cal is None:
        return
    # the calibration tables: plan rank first; the evidence never says "keep dense" for a factorized layer
    lines = r["text"].splitlines()
    head = next(i for i, l in enumerate(lines) if l.startswith("layer ") and " plan " in l)
    assert lines[head].split()[:2] == ["layer", "plan"]
    seen = 0
    end = lines[head].index(" plan ") + len(" plan")
    groups = {f"{g.label} \u00d7{g.size}": list(g.members) for g in a.groups() if g.is_group}

    def expected(label: str) -> str:  # a group of repeated blocks is one row: its members' ranks, dense counted
        members = groups.get(label, [label])
        ranks = sorted(plan[m] for m in members if m in plan)
        dense = len(members) - len(ranks)
        span = "" if not ranks else f"{ranks[0]:,}" if ranks[0] == ranks[-1] else f"{ranks[0]:,}\u2013{ranks[-1]:,}"
        return "dense" if not ranks else span if not dense else f"{dense} dense, {span}"

    for line in lines[head + 1:]:
        if not line.strip():
            break
        label = next((g for g in groups if line.startswith(g + " ")), line.split()[0])
        assert line[len(label):end].strip() == expected(label), line
        assert "keep dense" not in line
        seen += len(groups.get(label, [label]))
    assert seen == len(cal.layers)
    md_rows = [l for l in r["md"].splitlines() if l.startswith("| `") and "**" in l]
    shown = 0
    for row in md_rows:
        label = row.split(" | ")[0].removeprefix("| `").removesuffix("`").replace("\\*", "*")
        if label not in groups and label not in cal.layers:
            continue  # another table's row
        assert row.split(" | ")[1] == f"**{expected(label)}**", row
        assert "keep dense" not in row
        shown += len(groups.get(label, [label]))
    assert shown == len(cal.layers)
    import bs4

    soup = bs4.BeautifulSoup(r["html"], "html.parser")
    table = next(t for t in soup.select("table") if t.select_one("th") and "plan rank" in t.get_text())
    for tr in table.select("tbody tr"):
        cells = [td.get_text("", strip=True) for td in tr.select("td")]
        label = next((g for g in groups if g.replace(" ", "") == cells[0].replace(" ", "")), cells[0])
        assert cells[1] == expected(label), cells
        assert not any("keep dense" in c for c in cells)


@pytest.mark.parametrize("key", ["llama"])
def test_perplexity_with_its_dense_baseline_in_every_format(audits, rendered, key):
    a, r = audits[key], rendered[key]
    cal = a.calibration
    pc = cal.plan_check
    assert cal.metric == "perplexity increase" and 1 < cal.reference < 2048 and pc.layers > 0
    ref = pc.verification.reference if pc.verification is not None else cal.reference  # the rows it was measured on
    assert ref is not None and 1 < ref < 2048
    want = (f"held-out perplexity {ref:.2f} -> {ref * (1 + pc.measured):.2f} "
            f"({100 * pc.measured:+.3g}%, tolerance +1%)")  # one unit: a percentage, three significant digits
    for fmt in ("text", "json", "md", "html_text", "pdf_text"):
        assert want in _flat(r[fmt]), fmt


@pytest.mark.parametrize("key", ["free", "review-bad", "chargpt", "llama"])
def test_the_txt_report_keeps_every_column(audits, rendered, key):
    a, text = audits[key], rendered[key]["text"]
    labels = [f"r{round(100 * t, 6):g}" for t in a.settings.energy_targets]
    head = next(l for l in text.splitlines() if l.startswith("#  layer"))
    rank = ["planned", "sugg."] if not a.review.suggested else ["rank"]
    assert head.split() == ["#", "layer", "kind", "m", "x", "n", "params", "share", "cum", "MACs", "break-even",
                            *labels, *rank, "x", "verdict"]
    assert "left out to fit" not in text and "…" not in text  # no column dropped, no name cut
    for l in a.layers:  # every layer (or its group) by its whole name
        assert l.name in text or any(g.label in text for g in a.groups() if l.name in g.members)
    if a.calibration is not None:
        cal_head = next(l for l in text.splitlines() if l.startswith("layer ") and " plan " in l)
        # no tier 2 here: the floor and cliff columns, a dash in every row, are left out
        assert cal_head.split() == ["layer", "plan", "rows", "r@1%", "r@5%", "tier-1"]


# ---- the HTML in headless Chromium -------------------------------------------------------------------------------
def _chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


MEASURE = """<script>window.addEventListener('load', function () {
  var W = window.innerWidth, wide = [], tall = [];
  function clipped(el) {  /* inside a box that scrolls or clips sideways */
    for (var p = el.parentElement; p && p !== document.body; p = p.parentElement) {
      var o = getComputedStyle(p).overflowX; if (o === 'auto' || o === 'scroll' || o === 'hidden') return true; }
    return false; }
  document.querySelectorAll('body *').forEach(function (el) {
    var r = el.getBoundingClientRect();
    if (r.width > 0 && r.right > W + 1 && !clipped(el)) wide.push(el.tagName + '.' + el.className + ' ' + Math.round(r.right));
  });
  document.querySelectorAll('td').forEach(function (td) {
    if (td.offsetParent === null || td.querySelector('table, img, svg, details, .flagtext')) return;
    var s = getComputedStyle(td), lh = parseFloat(s.lineHeight) || 1.45 * parseFloat(s.fontSize);
    var h = td.clientHeight - parseFloat(s.paddingTop) - parseFloat(s.paddingBottom);
    if (h > 3 * lh + 1) tall.push(td.textContent.trim().slice(0, 60) + ' ' + Math.round(h / lh) + ' lines');
  });
  window.parent.document.title = JSON.stringify({W: W, page: document.documentElement.scrollWidth,
                                                 wide: wide.slice(0, 10), tall: tall.slice(0, 10)});
});</script></body>"""


def _measure(html: str, width: int, tmp_path: Path) -> dict:
    """The page at ``width`` CSS pixels: in an iframe of that width (headless Chromium's window is at least 500 px
    wide; the iframe is the viewport its media queries and measurements see), the result in the outer title."""
    import html as html_mod

    page = tmp_path / f"page-{width}.html"
    inner = html.replace("</body>", MEASURE)
    page.write_text(f'<!doctype html><html><head><title>-</title><style>body{{margin:0}}</style></head><body>'
                    f'<iframe style="width:{width}px;height:1000px;border:0" srcdoc="{html_mod.escape(inner, quote=True)}">'
                    '</iframe></body></html>', encoding="utf-8")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={width + 100},1100",
             "--virtual-time-budget=5000", "--dump-dom"]
    res = subprocess.run([_chromium(), *flags, page.as_uri()], capture_output=True, text=True, timeout=180)
    m = re.search(r"<title>(\{.*?\})</title>", res.stdout, re.S)
    assert m, res.stderr[-2000:]
    return json.loads(html_mod.unescape(m.group(1)))


@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed (make system-deps installs it)")
@pytest.mark.parametrize("key", PHONE)
def test_html_fits_a_phone_and_cells_stay_short(rendered, key, tmp_path):
    html = rendered[key]["html"]
    phone = _measure(html, 400, tmp_path)
    assert phone["W"] == 400 and phone["page"] <= phone["W"], phone  # the page never scrolls sideways
    assert phone["wide"] == [], phone
    desk = _measure(html, 1400, tmp_path)
    assert desk["W"] == 1400 and desk["tall"] == [], desk


def test_notebook_view_inherits_the_theme(audits):
    html = audits["free"]._repr_html_()
    assert "color:inherit" in html and not re.search(r"(?<![-\w])color:#", html)  # no fixed text colour
    assert 'data-status="unmeasured"' in html and "UNMEASURED" in html


@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed (make system-deps installs it)")
def test_layout_probe_catches_a_wide_element_and_a_tall_cell(tmp_path):
    """The control: the probe above sees a block wider than the phone and a cell of many lines."""
    page = ('<html><body style="margin:0"><div style="width:900px">wide</div><div style="overflow-x:auto"><div style="width:900px">'
            'scrolls in its box</div></div><table><tr><td style="width:30px">one two three four five six</td></tr>'
            '</table></body></html>')
    phone = _measure(page, 400, tmp_path)
    assert phone["page"] > 400 and phone["wide"] == ["DIV. 900"], phone  # the scrolling box's child is not counted
    assert phone["tall"] and phone["tall"][0].startswith("one two three four five six")


def test_colour_only_on_a_terminal_without_no_colour(monkeypatch):
    import torch

    from auditor.render.terminal import colour, use_colour

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    assert use_colour(Tty()) and not use_colour(io.StringIO())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_colour(Tty())
    a = auditor.audit(torch.nn.Linear(64, 64), plan={"finetune": "x", "ranks": {"Linear": 40}}, cache=False,
                      progress=False)  # 40 is above the break-even rank 32: LR001, FAIL
    text = colour(a.to_text(width=0))
    assert "\x1b[1;31mFAIL\x1b[0m: 1 error(s)" in text and "\x1b[31merror\x1b[0m   LR001" in text
    assert "\x1b" not in a.to_text(width=0)  # the .txt report and a pipe: plain
