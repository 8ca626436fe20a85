"""HTML from the jinja2 templates in ``templates/`` (shipped in the wheel as ``auditor.templates``).

One self-contained file: styles and charts inlined, nothing fetched. Autoescape is on for every template, and the
templates receive data (view models and the Audit), never pre-built HTML.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import asdict
from enum import Enum
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..policy import verdict_line
from . import calibration
from .base import RenderContext
from .layer_charts import short_label
from .pages import group_rows, layer_pages, plan_rows, rank_changes
from .view import finding_groups, human, layer_table, skipped_rows, spectra_computed

if TYPE_CHECKING:
    from ..results import Audit


def template_dir() -> Path:
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


def _pct(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{100 * x:.{digits}f}%"


def _why(code: str) -> str:
    from ..rules import RULES

    r = RULES.get(code)
    return r.sections.get("Why it is bad", "").replace("\n", " ") if r else ""


PDF_PAGES = 8  # the largest groups (or single layers) whose page the PDF carries; an appendix lists every layer
OVERVIEW_CURVES = 6


def _share_chart(audit: "Audit", groups: list[Any]) -> str:
    from .layer_charts import data_uri, group_share_chart

    svg = group_share_chart([g.label for g in groups], [g.params for g in groups], audit.total_params,
                            counts=[g.size for g in groups])
    return data_uri(svg) if svg else ""


def _overview_chart(audit: "Audit", groups: list[Any]) -> Any:
    """Energy curves of the largest groups (a group's first member stands for it), as inline SVG coordinates."""
    from .pages import energy_svg

    curves, labels = [], []
    for g in groups:
        sp = audit.spectra.get(g.members[0].name)
        if sp is not None and sp.energy:
            curves.append(np.asarray(sp.energy, dtype=np.float64))
            labels.append(short_label(g.label, 44) + (f" ×{g.size}" if g.is_group else ""))
        if len(curves) == OVERVIEW_CURVES:
            break
    if not curves:
        return None
    return energy_svg(curves, "largest groups", None, None, None, audit.settings.target_energy, None,
                      labels=labels, wide=True)


def context(audit: "Audit", ctx: RenderContext = RenderContext(), pdf: bool = False) -> dict[str, Any]:
    """The template's variables. ``pdf``: the print variant (the top pages with matplotlib charts, an appendix
    table of every layer) instead of a page per layer drawn as inline SVG."""
    counts = audit.counts
    table = layer_table(audit)
    groups = group_rows(audit, table)
    settings = [(k, ", ".join(map(str, v)) if isinstance(v, tuple) else (str(v) if isinstance(v, Enum) else v))
                for k, v in asdict(audit.settings).items()]
    pages = layer_pages(audit, table, groups, charts=ctx.charts, measured=ctx.measured,
                        only={g.anchor for g in groups[:PDF_PAGES]} if pdf else None)
    return {
        "a": audit,
        "verdict": verdict_line(audit),
        "rank_columns": table.columns,
        "rows": table.rows,
        "groups": groups,
        "planned": table.planned,
        "pages": pages,
        "pdf": pdf,
        "plan_rows": plan_rows(audit),
        "rank_changes": rank_changes(audit, ctx.baseline_report),
        "counts": counts,
        "status": "fail" if counts.error else ("review" if counts.warning else "pass"),
        "findings": audit.findings,
        "finding_groups": finding_groups(audit, _why),
        "skipped": skipped_rows(audit),
        "settings": settings,
        "holding80": audit.layers_holding(0.8),
        "plan_suggested": audit.review is None or audit.review.suggested,
        "spectra_computed": spectra_computed(audit),
        "baseline": ctx.baseline,
        "share_chart": _share_chart(audit, groups) if ctx.charts else "",
        "energy_chart": _overview_chart(audit, groups) if ctx.charts else None,
        "created": _dt.date.today().isoformat(),
        "css": (template_dir() / "report.css").read_text(encoding="utf-8"),
        "human": human,
        "pct": _pct,
        **calibration.html_context(audit, ctx.charts),
    }


def render(audit: "Audit", ctx: RenderContext = RenderContext(), pdf: bool = False) -> str:
    return _env().get_template("report.html").render(**context(audit, ctx, pdf=pdf))


def render_compact(audit: "Audit", top: int = 10) -> str:
    """The notebook view (``Audit._repr_html_``): summary, the top layers and the findings, no charts."""
    return _env().get_template("compact.html").render(**context(audit, RenderContext(charts=False)), top=top)


class HtmlReporter:
    name = "html"
    suffix = ".html"
    binary = False

    def render(self, audit: "Audit", context: RenderContext) -> str:
        return render(audit, context)
