"""HTML from the jinja2 templates in ``templates/`` (shipped in the wheel as ``auditor.templates``).

One self-contained file: styles and charts inlined, nothing fetched. Autoescape is on for every template, and the
templates receive data (view models and the Audit), never pre-built HTML.
"""

from __future__ import annotations

import datetime as _dt
import re
from enum import Enum
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..verdict.policy import empty_plan_words, status, verdict_line
from .parts import calibration, speed
from .base import RenderContext, Stdout
from .parts.layer_charts import short_label
from .parts.pages import appendix_text, group_rows, layer_pages, page_legend, plan_rows, rank_changes
from .parts.view import (finding_groups, human, layer_table, pct, share_pct, skipped_groups, skipped_rows, spectra_computed,
                   trace_sentence)

if TYPE_CHECKING:
    from ..results import AuditResult
    from .parts.view import LayerTable


def template_dir() -> Path:
    """The templates beside this source tree when it is a checkout (so a second checkout or worktree sharing one
    environment renders with its own templates), else the installed package's ``auditor.templates``."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "templates" / "report.html").is_file():
        return root / "templates"
    try:
        from importlib.resources import files

        p = Path(str(files("auditor.templates")))
        if (p / "report.html").is_file():
            return p
    except (ModuleNotFoundError, TypeError):  # pragma: no cover - not installed as a package
        pass
    return Path(__file__).resolve().parents[2] / "templates"


@lru_cache(maxsize=1)
def _env():  # type: ignore[no-untyped-def]
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        autoescape=True,  # every template, whatever its extension
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    return env


def _why(code: str) -> str:
    from ..rules import RULES

    r = RULES.get(code)
    return r.sections.get("Why it is bad", "").replace("\n", " ") if r else ""


PDF_PAGES = 8  # the largest groups (or single layers) whose page the PDF carries; an appendix lists every layer
PDF_NAME_MAX = 96  # longest name (or unbroken run of characters) the PDF lays out; longer ones are cut in the middle
PDF_TABLE_CAP = 200  # rows of the PDF's grouped layer table (its appendix lists the layers one per row)
PDF_APPENDIX_CAP = 2000  # rows of the PDF's appendix; the rest are counted, and listed in the HTML and JSON reports
PDF_LIST_CAP = 500  # rows of the PDF's findings, plan and skipped-layer lists


def cut_middle(s: str, limit: int = PDF_NAME_MAX) -> str:
    """``s`` at most ``limit`` characters: longer strings keep their head and tail around a "…" (so layout cost in the
    PDF cannot grow with a name's length)."""
    if len(s) <= limit:
        return s
    head = (limit - 1) // 2
    return s[:head] + "…" + s[len(s) - (limit - 1 - head):]


_LONG_RUN = re.compile(r"\S{%d,}" % (PDF_NAME_MAX + 1))


def cut_runs(s: str, limit: int = PDF_NAME_MAX) -> str:
    """``s`` with every unbroken run of more than ``limit`` non-space characters (a long name inside a message)
    cut in the middle."""
    return _LONG_RUN.sub(lambda m: cut_middle(m.group(0), limit), s) if len(s) > limit else s


def wrap_dots(s: Any, limit: int = PDF_NAME_MAX) -> Any:
    """A layer name for a table cell of the HTML: escaped, with a line-break opportunity (``<wbr>``) after each dot,
    so a long name wraps between its components, never inside one.

    >>> str(wrap_dots("model.layers.0.self_attn<x>"))
    'model.<wbr>layers.<wbr>0.<wbr>self_attn&lt;x&gt;'
    """
    from markupsafe import Markup, escape

    if not isinstance(s, str):
        return s
    return Markup("").join(Markup(f"{escape(p)}<wbr>") if p.endswith(".") else escape(p)
                           for p in re.split(r"(?<=[.])", s) if p)


def _same(s: Any, limit: int = PDF_NAME_MAX) -> Any:
    return s
OVERVIEW_CURVES = 6


def _share_chart(audit: "AuditResult", groups: list[Any]) -> str:
    from .parts.layer_charts import data_uri, group_share_chart

    svg = group_share_chart([g.label for g in groups], [g.params for g in groups], audit.total_params,
                            counts=[g.size for g in groups])
    return data_uri(svg) if svg else ""


def _overview_chart(audit: "AuditResult", groups: list[Any]) -> str:
    """Energy curves of the largest groups (a group's first member stands for it), as a ``data:`` URI ("" without)."""
    from .parts.layer_charts import data_uri, energy_overview_chart

    curves, labels = [], []
    for g in groups:
        sp = audit.spectra.get(g.members[0].name)
        if sp is not None and sp.energy:
            curves.append(np.asarray(sp.energy, dtype=np.float64))
            labels.append(short_label(g.label, 44) + (f" ×{g.size}" if g.is_group else ""))
        if len(curves) == OVERVIEW_CURVES:
            break
    target = audit.settings.target_energy if audit.calibration is None else None  # calibration chose the ranks
    svg = energy_overview_chart(curves, labels, target) if curves else None
    return data_uri(svg) if svg else ""


def _page_legend(pages: list[Any]) -> str:
    from .parts.layer_charts import data_uri, legend_chart

    svg = legend_chart(page_legend(pages))
    return data_uri(svg) if svg else ""


def _calibration(audit: "Audit", charts: bool) -> dict[str, Any]:
    """The template's ``calibration`` variable (``templates/_calibration.html``) from the calibration's view model,
    its charts drawn here: None without calibration."""
    from .parts import rank_or_bits as bits
    from .parts.layer_charts import data_uri, floor_chart, frontier_chart, legend_chart

    cv = calibration.view(audit)
    if cv is None:
        return {"calibration": None}
    cal = cv.cal
    front = frontier_chart(cv.frontier_chart) if charts and cv.frontier_chart is not None else None
    floors = [(c.name, data_uri(svg)) for c in cv.floor_charts for svg in [floor_chart(c)] if svg] if charts else []
    legend = legend_chart(calibration.floor_legend(cal.metric)) if floors else None
    return {"calibration": {
        "summary": cv.summary, "basis": cv.basis, "plan": cv.plan,
        "budget": cv.budget + [x for x in [cv.rounding, cv.fallback] if x],
        "warnings": cal.warnings, "missing": cal.missing, "rows": cv.rows,
        "empty": calibration.empty_columns(cv.rows),
        "finetune": calibration.FINETUNE if not cv.recovery_note else calibration.FINETUNE + " The suggested plan was "
                    "chosen after recovery: it " + cv.recovery_note + "; it needs that fine-tune.",
        "recovery": cv.recovery, "recovered_steps": cv.recovered_steps,
        "frontier": data_uri(front) if front else None, "frontier_rows": cv.frontier,
        "metric": cal.metric, "in_percent": calibration.in_percent(cal),
        "frontier_title": calibration.frontier_title(cal), "verified_head": calibration.verified_head(cal),
        "uniform_head": calibration.UNIFORM_HEAD, "uniform_words": cv.uniform, "ties_words": cv.ties,
        "layer_charts": floors, "floor_legend": data_uri(legend) if legend else "",
        "bits_intro": bits.intro(cal), "bits_rows": bits.rows(cal),
    }}


# The order of the report's sections, the same in both: the verdict (summary), the findings when there are any,
# the plan, calibration, then the drill-down; the PDF keeps the per-layer pages and the appendix last.
SECTIONS_HTML = ("summary", "findings", "plan", "calibration", "shares", "layers", "energy", "pages", "baseline",
                 "skipped", "method", "environment")
SECTIONS_PDF = ("summary", "findings", "plan", "calibration", "shares", "layers", "energy", "baseline", "skipped",
                "pages", "appendix", "method", "environment")


def sections(pdf: bool, findings: bool) -> list[str]:
    """The section ids in the order the report shows them; an HTML report without findings says so after the
    skipped layers instead of first."""
    if pdf:
        return list(SECTIONS_PDF)
    order = list(SECTIONS_HTML)
    if not findings:
        order.remove("findings")
        order.insert(order.index("skipped") + 1, "findings")
    return order


def _with_speed(order: list[str], audit: "AuditResult") -> list[str]:
    """The speed section after the calibration's, only when the speed was measured (other reports unchanged)."""
    if audit.speed is not None:
        order.insert(order.index("calibration") + 1, "speed")
    return order


def context(audit: "AuditResult", ctx: RenderContext = RenderContext(), pdf: bool = False) -> dict[str, Any]:
    """The template's variables. ``pdf``: the print variant (only the top groups' pages, an appendix table of every
    layer) instead of a page per group and per layer; both show the same matplotlib SVG charts."""
    counts = audit.counts
    table = layer_table(audit)
    groups = group_rows(audit, table)
    settings = [(k, ", ".join(map(str, v)) if isinstance(v, tuple) else (str(v) if isinstance(v, Enum) else v))
                for k, v in audit.settings.as_dict().items()]
    pages = layer_pages(audit, table, groups, charts=ctx.charts, measured=ctx.measured,
                        only={g.anchor for g in groups[:PDF_PAGES]} if pdf else None)
    plans = plan_rows(audit)
    skipped = skipped_rows(audit)
    sgroups = skipped_groups(audit, skipped)
    fgroups = finding_groups(audit, _why)
    cut = _pdf_cuts(table, groups, plans, skipped, fgroups, len(sgroups)) if pdf else {}
    return {
        "a": audit,
        "verdict": verdict_line(audit),
        "rank_columns": table.columns,
        "rows": table.rows,
        "groups": groups,
        "planned": table.planned,
        "pages": pages,
        "pdf": pdf,
        "plan_rows": plans[:PDF_LIST_CAP] if pdf else plans,
        "rank_changes": rank_changes(audit, ctx.baseline_report),
        "counts": counts,
        "status": str(status(audit)),
        "findings": audit.findings,
        "finding_groups": fgroups,
        "skipped": skipped,
        "skipped_groups": sgroups[:PDF_LIST_CAP] if pdf else sgroups,
        "sections": _with_speed(sections(pdf, bool(fgroups)), audit),
        "speed": speed.html_context(audit),
        "trace": trace_sentence(audit),
        "share": share_pct,
        "settings": settings,
        "holding80": audit.layers_holding(0.8),
        "plan_suggested": audit.review is None or audit.review.suggested,
        "plan_empty": empty_plan_words(audit),
        "check_card": calibration.check_card(audit),
        "plan_note": calibration.suggested_plan_note(audit),
        "spectra_computed": spectra_computed(audit),
        "baseline": ctx.baseline,
        "share_chart": _share_chart(audit, groups) if ctx.charts else "",
        "energy_chart": _overview_chart(audit, groups) if ctx.charts else "",
        "page_legend": _page_legend(pages) if ctx.charts else "",
        "created": _dt.date.today().isoformat(),
        "css": (template_dir() / "report.css").read_text(encoding="utf-8"),
        "human": human,
        "pct": pct,
        **_calibration(audit, ctx.charts),
        "pn": cut_middle if pdf else _same,  # a name as the PDF shows it (the HTML keeps it whole)
        "wn": cut_middle if pdf else wrap_dots,  # a name in a table cell: wraps at its dots in the HTML
        "pt": cut_runs if pdf else _same,  # a message as the PDF shows it
        "cut": cut,
        "count": lambda v: f"{v:,}" if isinstance(v, int) else v,  # a count, or a group's range as it is
    }


def _pdf_cuts(table: "LayerTable", groups: list[Any], plans: list[Any], skipped: list[Any], fgroups: list[Any],
              skipped_groups: int) -> dict[str, Any]:
    """What the PDF leaves out, so that it can say so: rows past each cap, and how many names it shortens."""
    rows, columns, planned = table.rows, table.columns, table.planned
    names = [r.name for r in rows] + [s.name for s in skipped]
    return {
        "table_rows": groups[:PDF_TABLE_CAP], "table_left": max(0, len(groups) - PDF_TABLE_CAP),
        "appendix_rows": rows[:PDF_APPENDIX_CAP], "appendix_left": max(0, len(rows) - PDF_APPENDIX_CAP),
        "appendix_text": appendix_text(rows[:PDF_APPENDIX_CAP], [c.label for c in columns], planned, cut_middle),
        "plan_left": max(0, len(plans) - PDF_LIST_CAP), "skipped_left": max(0, skipped_groups - PDF_LIST_CAP),
        "findings_left": sum(max(0, len(g.entries) - PDF_LIST_CAP) for g in fgroups),
        "long_names": len({n for n in names if len(n) > PDF_NAME_MAX}),
        "name_max": PDF_NAME_MAX, "list_cap": PDF_LIST_CAP,
    }


def render(audit: "AuditResult", ctx: RenderContext = RenderContext(), pdf: bool = False) -> str:
    return _env().get_template("report.html").render(**context(audit, ctx, pdf=pdf))


def render_compact(audit: "AuditResult", top: int = 10) -> str:
    """The notebook view (``Audit._repr_html_``): summary, the top layers and the findings, no charts."""
    return _env().get_template("compact.html").render(**context(audit, RenderContext(charts=False)), top=top)


class HtmlReporter:
    name = "html"
    suffix = ".html"
    binary = False
    stdout = Stdout.NEVER

    def render(self, audit: "AuditResult", context: RenderContext) -> str:
        return render(audit, context)
