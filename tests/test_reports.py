"""Reports: HTML parsed back against the JSON, PDF text, escaping, atomic writes, the browser, notebook views."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

import auditor
from auditor.verdict.policy import verdict_head, verdict_line

bs4 = pytest.importorskip("bs4")


@pytest.fixture(scope="module")
def audit_cnn():
    from digits import cnn

    model, x = cnn()
    return auditor.audit(model, x, plan={"ranks": {"fc1": 24, "conv1": 4}},
                         options=auditor.AuditOptions(cache=False, progress=False))


def test_html_rows_match_json(audit_cnn, tmp_path):
    html = audit_cnn.to_html(tmp_path / "r.html")
    data = json.loads(audit_cnn.to_json())
    soup = bs4.BeautifulSoup(html, "html.parser")
    rows = soup.select("#layer-table tbody tr[data-layer]")
    assert [r["data-layer"] for r in rows] == [l["name"] for l in data["layers"]]
    for row, layer in zip(rows, data["layers"]):
        assert row.select_one("td.params").text == f"{layer['params']:,}"
        assert row.select_one("td.be").text == f"{layer['break_even']:.1f}"
        sugg = data["suggestions"][layer["name"]]["rank"]
        assert row.select_one("td.rank").text == (str(sugg) if sugg is not None else "–")
    assert f"{data['totals']['params']:,}" in soup.select_one("#summary").text
    # the plan review table lists each planned layer, and every finding is shown with its code
    assert [td.text for td in soup.select("#plan-table tbody td.name")] == ["fc1", "conv1"]
    for f in data["findings"]:
        assert f["code"] in soup.select_one("#findings").text
    # self-contained: no external URL anywhere
    assert not re.search(r'(src|href)="(?!data:|#)', html)  # data URIs and in-page anchors only
    assert (tmp_path / "r.html").read_text(encoding="utf-8") == html


def test_pdf_text_has_totals_and_top_layers(audit_cnn, tmp_path):
    pypdf = pytest.importorskip("pypdf")
    pytest.importorskip("weasyprint")
    path = audit_cnn.to_pdf(tmp_path / "r.pdf")
    reader = pypdf.PdfReader(str(path))
    text = "\n".join(p.extract_text() for p in reader.pages)
    assert f"{audit_cnn.total_params:,}" in text
    for layer in audit_cnn.layers[:3]:
        assert layer.name in text
    assert "Page 1 of" in text and "Low-rank audit: DigitsCNN" in text
    assert len(reader.pages) >= 2


def test_pdf_fetcher_refuses_files_and_remote_urls():
    wp = pytest.importorskip("weasyprint")
    from auditor.render.pdf import url_fetcher

    fetch = url_fetcher(wp)
    for url in ("file:///etc/passwd", "http://example.com/x.png", "https://example.com/a.css"):
        with pytest.raises(ValueError, match="refuses"):
            (fetch.fetch if hasattr(fetch, "fetch") else fetch)(url)
    tiny = "data:image/svg+xml;base64,PHN2ZyB4bWxucz0iaHR0cDovL3d3dy53My5vcmcvMjAwMC9zdmciLz4="
    assert (fetch.fetch if hasattr(fetch, "fetch") else fetch)(tiny) is not None


def test_missing_weasyprint_says_what_to_install(monkeypatch, audit_cnn, tmp_path):
    import builtins

    real = builtins.__import__

    def fake(name, *a, **k):
        if name == "weasyprint":
            raise OSError("cannot load library 'libpango-1.0-0'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(auditor.AuditError, match="Pango") as exc:
        audit_cnn.to_pdf(tmp_path / "x.pdf")
    assert "pip install weasyprint" in exc.value.line()
    assert not (tmp_path / "x.pdf").exists()
    assert "<html" in audit_cnn.to_html()  # HTML keeps working


class Evil(nn.Module):
    def __init__(self):
        super().__init__()
        self.add_module("<script>alert(1)</script>", nn.Linear(8, 8))

    def forward(self, x):
        return getattr(self, "<script>alert(1)</script>")(x)


def test_module_names_are_escaped():
    a = auditor.audit(Evil(), torch.zeros(1, 8), options=auditor.AuditOptions(cache=False, name="<b>model</b>"))
    html = a.to_html()
    assert "<script>alert(1)</script>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<b>model</b>" not in html
    assert "<script>alert" not in a._repr_html_()
    md = a.to_markdown()
    assert "`<script>alert(1)</script>`" in md  # literal inside a code span, which Markdown never parses
    assert "<script>" not in re.sub(r"`[^`]*`", "", md)


def test_reports_are_written_atomically(monkeypatch, audit_cnn, tmp_path):
    from auditor.render import atomic_write

    target = tmp_path / "report.html"
    target.write_text("old complete report")
    with pytest.raises(RuntimeError):
        with atomic_write(target) as fh:
            fh.write("half")
            raise RuntimeError("interrupted")
    assert target.read_text() == "old complete report"
    assert list(tmp_path.iterdir()) == [target]  # no temporary file left behind


def test_repr_html_and_markdown(audit_cnn):
    compact = audit_cnn._repr_html_()
    assert "DigitsCNN" in compact and "fc1" in compact and "LR0" in compact
    md = audit_cnn.to_markdown()
    assert md.startswith("## Low-rank audit: DigitsCNN")
    # the verdict's head in bold, the saving once, in the plan card under it
    assert "| `fc1` |" in md and md.splitlines()[2] == f"**{verdict_head(audit_cnn)}**"
    assert md.count(f"{audit_cnn.review.params_saved:,}") == 1
    assert f"**{audit_cnn.review.params_saved:,} parameters saved**" in md.splitlines()[4]
    assert "### Findings" in md


def test_to_pandas(audit_cnn):
    pytest.importorskip("pandas")
    df = audit_cnn.to_pandas()
    assert list(df["name"]) == [l.name for l in audit_cnn.layers]
    assert int(df["params"].sum()) == audit_cnn.factorizable_params


def test_baseline_diff(cli, tmp_path):
    base = tmp_path / "base.json"
    res = cli("sample_models/digits.py:mlp", "--format", "json", "-q", "-o", tmp_path / "b")
    assert res.returncode == 0
    shutil.copy(tmp_path / "b" / "lowrank-audit.json", base)
    plan = tmp_path / "plan.toml"
    plan.write_text('finetune = "1 epoch"\n[ranks]\n"fc2" = 300\n')
    res = cli("sample_models/digits.py:mlp", "--plan", plan, "--baseline", base, "--format", "md", "-q")
    assert res.returncode == 1
    assert "### Since the baseline" in res.stdout and "new **LR001**" in res.stdout
    bad = cli("sample_models/digits.py:mlp", "--baseline", tmp_path / "nope.json")
    assert bad.returncode == 2 and "baseline" in bad.stderr


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def _browse(html_path: Path, tmp_path: Path) -> tuple[str, str]:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
             "--virtual-time-budget=2000", "--dump-dom"]
    res = subprocess.run([_chromium(), *flags, html_path.as_uri()], capture_output=True, text=True, timeout=120)
    return res.stdout, res.stderr


@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed (make test installs it)")
def test_html_in_headless_chromium_has_no_console_errors_and_sorts(audit_cnn, tmp_path):
    def console_errors(log: str) -> list[str]:
        return [l for l in log.splitlines() if "CONSOLE" in l and ("Uncaught" in l or "Error" in l)]

    # the detector works: a page with a script error is caught
    broken = tmp_path / "broken.html"
    broken.write_text("<html><body><script>undefinedFunction();</script></body></html>")
    assert console_errors(_browse(broken, tmp_path)[1])

    html = audit_cnn.to_html()
    # click the "params" header twice (ascending, then descending) and record the first row
    probe = ("<script>window.addEventListener('load', function () {"
             "var th = document.querySelectorAll('#layer-table th')[4]; th.click();"
             "document.title = 'first:' + document.querySelector('#layer-table tbody tr').getAttribute('data-layer');"
             "});</script></body>")
    page = tmp_path / "report.html"
    page.write_text(html.replace("</body>", probe), encoding="utf-8")
    dom, log = _browse(page, tmp_path)
    assert console_errors(log) == []
    smallest = min(audit_cnn.layers, key=lambda l: l.params).name
    assert f"<title>first:{smallest}</title>" in dom


def test_json_validates_against_the_documented_schema(audit_cnn):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((Path(__file__).resolve().parents[1] / "docs" / "schema.json").read_text())
    jsonschema.validate(json.loads(audit_cnn.to_json(with_sigma=True)), schema)
    base = json.loads(audit_cnn.to_json())
    base["findings"].append({"code": "LR999", "message": "gone since", "layers": []})
    with_baseline = json.loads(audit_cnn.to_json(baseline=base))
    jsonschema.validate(with_baseline, schema)
    with_baseline["baseline"]["saved_delta"] = "a lot"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(with_baseline, schema)
    broken = json.loads(audit_cnn.to_json())
    broken["layers"][0]["kind"] = "banana"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


# ---- reporters: registry, rank columns from the energy targets, width, the baseline in every format -------------
def test_registry_holds_every_format_as_a_reporter():
    from auditor.render import REPORTERS, Reporter, register

    assert list(REPORTERS) == ["text", "json", "md", "html", "pdf", "sarif", "github"]
    assert all(isinstance(r, Reporter) and r.name == k for k, r in REPORTERS.items())
    assert [r.suffix for r in REPORTERS.values()] == [".txt", ".json", ".md", ".html", ".pdf", ".sarif", ".github.txt"]
    assert [str(r.stdout.value) for r in REPORTERS.values()] == ["table", "document", "document", "never", "never",
                                                                   "document", "log"]
    with pytest.raises(TypeError, match="lacks"):
        register(object())  # type: ignore[arg-type]


class _Csv:
    """A format from outside the package: one table of formats means the command line knows it from this alone."""

    name, suffix, binary = "csv", ".csv", False

    def __init__(self, stdout):
        self.stdout = stdout

    def render(self, audit, context):
        return "layer,params\n" + "".join(f"{l.name},{l.params}\n" for l in audit.layers)


@pytest.mark.parametrize("kind", ["document", "never"])
def test_a_registered_format_goes_where_its_table_entry_says(cli_inproc, monkeypatch, tmp_path, kind):
    from auditor.render import REPORTERS, Stdout, register

    monkeypatch.setattr("auditor.render.REPORTERS", dict(REPORTERS))  # a copy: the real table stays as it was
    register(_Csv(Stdout(kind)))
    model = str(Path(__file__).resolve().parents[1] / "sample_models" / "digits.py") + ":mlp"
    csv = "layer,params\nfc2,262144\nfc3,131072\nfc1,32768\nhead,2560\n"  # weights m*n, largest first
    r = cli_inproc(model, "--no-spectra", "--format", "csv", "-q", cwd=tmp_path)
    assert r.returncode == 0
    verdict = "UNMEASURED: no errors or warnings; the ranks are energy-based estimates (measure with --calibration)\n"
    assert r.stdout == (csv if kind == "document" else verdict)  # -q keeps the verdict where no document goes
    assert (tmp_path / "lowrank-audit.csv").exists() == (kind == "never")
    both = cli_inproc(model, "--no-spectra", "--format", "csv,json", "-q", cwd=tmp_path)
    assert both.returncode == (2 if kind == "document" else 0)  # two documents cannot share stdout
    out = tmp_path / "out"
    r = cli_inproc(model, "--no-spectra", "--format", "csv", "-q", "-o", out, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout == verdict and (out / "lowrank-audit.csv").read_text() == csv


def test_rank_columns_follow_the_energy_targets(digits_mlp, tmp_path):
    pytest.importorskip("pandas")
    model, x = digits_mlp
    a = auditor.audit(model, x, options=auditor.AuditOptions(cache=False, progress=False,
                                                             overrides={"energy_targets": [0.8, 0.9]}))
    r80 = {l.name: a.spectra[l.name].rank_for(0.8) for l in a.layers}
    r90 = {l.name: a.spectra[l.name].rank_for(0.9) for l in a.layers}
    assert r80 != r90  # the two columns differ, so a swapped column would be caught
    df = a.to_pandas()
    assert list(df["r80"]) == [r80[l.name] for l in a.layers] and list(df["r90"]) == [r90[l.name] for l in a.layers]
    assert "r95" not in df.columns and "r99" not in df.columns
    header = next(line for line in a.to_text(width=200).splitlines() if line.lstrip().startswith("#  layer"))
    assert header.split()[-5:] == ["r80", "r90", "rank", "x", "verdict"]
    fc1 = next(line for line in a.to_text(width=200).splitlines() if " fc1 " in line)
    assert fc1.split()[-5:-3] == [str(r80["fc1"]), str(r90["fc1"])] and fc1.endswith("factorize")
    md = a.to_markdown()
    assert "| break-even | r80 / r90 | rank | x | verdict |" in md
    assert f"| {r80['fc1']} / {r90['fc1']} |" in md.split("`fc1`")[-1].splitlines()[0]
    soup = bs4.BeautifulSoup(a.to_html(), "html.parser")
    heads = [th.text for th in soup.select("#layer-table th")]
    assert "r80" in heads and "r90" in heads and "r95" not in heads
    row = soup.select_one('#layer-table tr[data-layer="fc1"]')
    assert [td.text for td in row.select("td.r")] == [str(r80["fc1"]), str(r90["fc1"])]


@pytest.mark.parametrize("width", [60, 80, 120, 200])
def test_to_text_fits_the_width(audit_cnn, width):
    text = audit_cnn.to_text(width=width)
    lines = text.splitlines()
    assert max(map(len, lines)) <= width
    header = next(line for line in lines if line.lstrip().startswith("#  layer")).split()
    assert {"layer", "params", "share", "planned", "verdict"} <= set(header)  # the essential columns always stay
    assert ("kind" in header) is (width >= 120)  # kind is shortened first, and dropped after cum and MACs
    assert ("cum" in header) is (width >= 120)  # the least useful column goes first (the whole table fits 120)
    assert all(l.name in text for l in audit_cnn.layers)  # short layer names are never cut


def test_baseline_diff_reaches_every_format(audit_cnn, tmp_path):
    from dataclasses import replace

    from auditor.render import REPORTERS, RenderContext
    from auditor.verdict.baseline import compare

    base = json.loads(audit_cnn.to_json())
    base["findings"] = base["findings"][1:] + [{"code": "LR999", "message": "gone since", "layers": []}]
    base["plan_review"]["params_saved"] = 1000
    new = audit_cnn.findings[0]
    diff = compare(audit_cnn, base)
    assert [f["code"] for f in diff.new_findings] == [new.code] and diff.fixed_findings[0]["code"] == "LR999"
    assert diff.saved_delta == audit_cnn.review.params_saved - 1000
    ctx = RenderContext(baseline=diff)
    data = json.loads(REPORTERS["json"].render(audit_cnn, ctx))
    assert data["baseline"] == diff.to_dict()
    assert json.loads(audit_cnn.to_json(baseline=base))["baseline"] == {**diff.to_dict(), "rank_changes": []}
    md = audit_cnn.to_markdown(baseline=base)
    assert "### Since the baseline" in md and f"new **{new.code}**" in md and "fixed **LR999**: gone since" in md
    text = REPORTERS["text"].render(audit_cnn, replace(ctx, width=200))
    assert "since the baseline: 1 new finding(s), 1 fixed" in text and "fixed LR999 gone since" in text
    soup = bs4.BeautifulSoup(audit_cnn.to_html(baseline=base), "html.parser")
    section = soup.select_one("#baseline")
    assert "fixed LR999: gone since" in section.text and f"new {new.code}" in section.text
    assert f"{diff.saved_delta:+,}" in section.text
    for fmt in ("json", "md", "text", "html"):  # without a baseline, no baseline section
        out = REPORTERS[fmt].render(audit_cnn, RenderContext())
        assert "LR999" not in out and "baseline" not in out.lower().replace("baseline_", "")


def test_pdf_shows_the_baseline(audit_cnn, tmp_path):
    pypdf = pytest.importorskip("pypdf")
    pytest.importorskip("weasyprint")
    base = json.loads(audit_cnn.to_json())
    base["findings"].append({"code": "LR999", "message": "gone since", "layers": []})
    path = audit_cnn.to_pdf(tmp_path / "b.pdf", baseline=base)
    text = "\n".join(p.extract_text() for p in pypdf.PdfReader(str(path)).pages)
    assert "Since the baseline" in text and "fixed LR999: gone since" in text
