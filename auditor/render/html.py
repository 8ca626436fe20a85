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

from ..policy import verdict_line
from . import calibration
from .base import RenderContext
from .view import finding_groups, human, layer_table, skipped_rows

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


def context(audit: "Audit", ctx: RenderContext = RenderContext()) -> dict[str, Any]:
    """The template's variables."""
    from .charts import energy_chart, share_chart

    counts = audit.counts
    table = layer_table(audit)
    settings = [(k, ", ".join(map(str, v)) if isinstance(v, tuple) else (str(v) if isinstance(v, Enum) else v))
                for k, v in asdict(audit.settings).items()]
    return {
        "a": audit,
        "verdict": verdict_line(audit),
        "rank_columns": table.columns,
        "rows": table.rows,
        "counts": counts,
        "status": "fail" if counts.error else ("review" if counts.warning else "pass"),
        "findings": audit.findings,
        "finding_groups": finding_groups(audit, _why),
        "skipped": skipped_rows(audit),
        "settings": settings,
        "holding80": audit.layers_holding(0.8),
        "plan_suggested": audit.review is None or audit.review.suggested,
        "baseline": ctx.baseline,
        "share_chart": share_chart(audit) if ctx.charts else "",
        "energy_chart": energy_chart(audit) if ctx.charts else None,
        "created": _dt.date.today().isoformat(),
        "css": (template_dir() / "report.css").read_text(encoding="utf-8"),
        "human": human,
        "pct": _pct,
        **calibration.html_context(audit, ctx.charts),
    }


def render(audit: "Audit", ctx: RenderContext = RenderContext()) -> str:
    return _env().get_template("report.html").render(**context(audit, ctx))


def render_compact(audit: "Audit", top: int = 10) -> str:
    """The notebook view (``Audit._repr_html_``): summary, the top layers and the findings, no charts."""
    return _env().get_template("compact.html").render(**context(audit, RenderContext(charts=False)), top=top)


class HtmlReporter:
    name = "html"
    suffix = ".html"
    binary = False

    def render(self, audit: "Audit", context: RenderContext) -> str:
        return render(audit, context)
