"""The verdict follows the measurement: with calibration the suggested (and emitted) plan is the largest plan that
holds the tolerance all at once, `factorize` of the emitted plan measures within it on the held-out rows, a plan that
misses it is an error (LR015, exit 1) in every format, and calibration that does not reach a layer's inputs (short
windows and a position table) keeps that layer dense (no rank on a data-free guess)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

MODEL = "sample_models/digits.py:mlp"
FORMATS = ("text", "md", "json", "html", "pdf")


def _verdicts(out: Path, stdout: str) -> dict[str, str]:
    """The verdict line as each of the five formats prints it."""
    pypdf = pytest.importorskip("pypdf")
    from bs4 import BeautifulSoup

    html = BeautifulSoup((out / "lowrank-audit.html").read_text(), "html.parser")
    pdf = " ".join(p.extract_text() for p in pypdf.PdfReader(io.BytesIO((out / "lowrank-audit.pdf").read_bytes())).pages)
    md = (out / "lowrank-audit.md").read_text()
    return {
        "json": json.loads((out / "lowrank-audit.json").read_text())["verdict"],
        "text": " ".join(stdout.split()),  # the terminal wraps the line
        "md": "\n".join(md.split("\n\n")[1:3]),  # the verdict's head in bold, then the plan card
        "html": html.select_one(".verdict").get_text(" ", strip=True),
        "pdf": " ".join(pdf.split()),
    }


def _same_verdict(v: dict[str, str], ok: bool) -> None:
    """Every format says the JSON verdict; the Markdown splits it: the head in bold, then the saving and the
    all-at-once measurement in its plan card (as percentages, the Markdown's one unit convention)."""
    for fmt, line in v.items():
        if fmt != "md":
            assert " ".join(v["json"].split()) in line, (fmt, line)
    head, saving = v["json"].split("; ")[:2]
    n = saving.split(" save ")[1].split(" ")[0]
    md = v["md"].splitlines()
    assert md[0] == f"**{head}**" and f"**{n} parameters saved**" in md[1], v["md"]
    assert md[2].startswith(f"- **Measured all at once**: {'✅' if ok else '🛑'} **")
    assert ("holds" if ok else "misses the tolerance") in md[2]


@pytest.mark.parametrize("tier", ["tier1", "floors", "budget"])
def test_emitted_plan_holds_when_factorized(cli_inproc, digits_images, tmp_path, tier):
    extra = {"tier1": [], "floors": ["--measure-floor"], "budget": ["--measure-floor", "--budget", "0.5"]}[tier]
    out = tmp_path / "report"
    r = cli_inproc(MODEL, "--calibration", digits_images, *extra, "--no-cache", "--format", ",".join(FORMATS),
                   "-o", out, "--emit-plan", tmp_path / "plan.toml")
    assert r.returncode == 0, r.stderr
    d = json.loads((out / "lowrank-audit.json").read_text())
    cal = d["calibration"]
    b, pc = cal["budget"], cal["plan_check"]
    suggested = {k: s["rank"] for k, s in d["suggestions"].items() if s["verdict"] == "factorize"}
    assert suggested == b["plan"] and b["ok"] and pc["ok"] and pc["layers"] == len(suggested) > 0
    # the plan check is the suggested plan's verification (rows the search never read), not measured again
    assert pc["verification"] == b["verification"] and pc["measured"] == b["verification"]["value"]
    assert b["metric"] <= pc["verification"]["high"] <= cal["tolerance"] or b["metric"] <= cal["tolerance"]
    assert pc["verification"]["low"] <= pc["measured"] <= pc["verification"]["high"] <= cal["tolerance"]
    if tier == "budget":
        assert b["budget"] == 0.5 and b["removed_fraction"] >= 0.5
    assert not [f for f in d["findings"] if f["code"] in ("LR015", "LR016")]
    # the emitted plan is the plan that holds, and says how its ranks were chosen
    plan = (tmp_path / "plan.toml").read_text()
    assert "spectral energy" not in plan.splitlines()[1] and "all at once" in plan
    if tier == "budget":  # it removes at least the budget's share (50.x%): the budget is a target, not a cap
        assert "for a budget of 50% of the parameters removed" in plan and "at most" not in plan
    # the audit's number is the model factorize writes with default flags (the sequential fit), named
    assert pc["fit"] == pc["verification"]["fit"] == "sequential"
    f = cli_inproc("factorize", MODEL, "--plan", tmp_path / "plan.toml", "--calibration", digits_images,
                   "--no-cache", "-o", tmp_path / "fact")
    assert f.returncode == 0, f.stderr
    meta = json.loads((tmp_path / "fact" / "plan.json").read_text())
    assert meta["plan"] == suggested and meta["fit"] == "sequential" and "audit" not in meta["measured"]
    assert meta["measured"]["holds"] and meta["measured"]["value"] == pytest.approx(pc["measured"], rel=1e-9)
    assert meta["measured"]["fit"] == "sequential" and "does not apply" not in f.stderr
    if tier == "tier1":  # another fit: measured again on the written model, and the audit's number said not to apply
        g = cli_inproc("factorize", MODEL, "--plan", tmp_path / "plan.toml", "--calibration", digits_images,
                       "--no-cache", "-o", tmp_path / "other", "--fit", "independent")
        other = json.loads((tmp_path / "other" / "plan.json").read_text())["measured"]
        assert other["fit"] == "independent" and other["value"] != pc["measured"]
        assert other["audit"] == {"fit": "sequential", "value": pc["measured"], "applies": False,
                                  "note": f"the audit measured this plan fitted sequential ({pc['measured']:.4g}); "
                                          "that number does not apply to this model, fitted independent: measured "
                                          "again on it"}
        assert f"note: {other['audit']['note']}" in g.stderr
    # every format says the same verdict, and it names the all-at-once measurement
    v = _verdicts(out, r.stdout)
    assert v["json"].startswith("PASS") and "measured all at once" in v["json"]
    _same_verdict(v, ok=True)


def test_a_plan_that_misses_the_tolerance_is_an_error_in_every_format(cli_inproc, digits_images, tmp_path):
    p = tmp_path / "plan.toml"
    p.write_text('finetune = "1 epoch"\n[ranks]\nfc1 = 8\nfc2 = 8\nfc3 = 8\n')
    out = tmp_path / "report"
    r = cli_inproc(MODEL, "--calibration", digits_images, "--plan", p, "--no-cache", "--format", ",".join(FORMATS),
                   "-o", out)
    assert r.returncode == 1, r.stderr
    d = json.loads((out / "lowrank-audit.json").read_text())
    pc = d["calibration"]["plan_check"]
    assert not pc["ok"] and pc["measured"] > 0.01
    lr015 = [f for f in d["findings"] if f["code"] == "LR015"]
    assert len(lr015) == 1 and lr015[0]["severity"] == "error"
    ev = lr015[0]["evidence"]
    assert ev["measured"] == pc["measured"] and ev["tolerance"] == 0.01 and ev["planned_layers"] == 3
    b = d["calibration"]["budget"]
    assert ev["held_removed"] == b["removed"] and b["ok"]
    assert f"{pc['measured']:.4g}" in lr015[0]["message"] and "largest plan that held" in lr015[0]["message"]
    v = _verdicts(out, r.stdout)
    iv = pc["verification"]
    pct = lambda x: f"{100 * x:#.3g}%"  # the relative output error in its one unit, three significant digits kept
    assert v["json"].startswith("FAIL: 1 error(s)") and v["json"].endswith(
        f"relative output error {pct(pc['measured'])} ({100 * iv['confidence']:g}% interval {pct(iv['low'])} to "
        f"{pct(iv['high'])} over {iv['rows']} verification rows; for an unseen document {pct(iv['unseen']['low'])} "
        f"to {pct(iv['unseen']['high'])} ({iv['unseen']['label']})): misses the tolerance 1%")
    _same_verdict(v, ok=False)


def test_short_calibration_leaves_the_position_table_data_free(tmp_path):
    """16-character windows reach 16 of the char transformer's 128 positions: `pos` is kept dense (as the data-free
    suggestion keeps it) instead of a data-aware rank 16, and its reason says why."""
    import auditor
    from safetensors.torch import load_file, save_file

    root = Path(__file__).resolve().parents[1] / "sample_models"
    short = {}
    for part in ("calib", "holdout"):
        ids = load_file(str(root / f"chargpt_{part}.safetensors"))["idx"][:16]
        short[part] = tmp_path / f"{part}.safetensors"
        save_file({"idx": ids.reshape(-1, 16).contiguous()}, str(short[part]))
    free = auditor.audit_source("sample_models/chargpt.py:chargpt", options=auditor.AuditOptions(cache=False,
                                                                                               progress=False))
    a = auditor.audit_source("sample_models/chargpt.py:chargpt", options=auditor.AuditOptions(
        cache=False, progress=False, calibration=str(short["calib"]), holdout=str(short["holdout"])))
    lc = a.calibration.layers["pos"]
    assert (lc.seen, lc.width, lc.spans) == (16, 128, False)
    assert lc.suggested is not None  # tier 1 alone would have given it a data-aware rank
    assert a.suggestions["pos"].verdict == free.suggestions["pos"].verdict
    assert a.suggestions["pos"].rank == free.suggestions["pos"].rank
    assert a.suggestions["pos"].reason.startswith("calibration did not span its inputs (16 of 128 rows looked up)")
    assert "pos" not in a.calibration.budget.plan
    # the plan keeps pos dense, so nothing is truncated blind: LR014 stays quiet (the suggestion's reason says why)
    assert [f.layers for f in a.findings if f.code == "LR014" and "pos" in f.layers] == []
