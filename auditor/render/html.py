"""HTML from the jinja2 templates in ``templates/`` (shipped in the wheel as ``auditor.templates``).

One self-contained file: styles and charts inlined, nothing fetched. Autoescape is on for every template.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import atomic_write
from .view import human, layer_rows

if TYPE_CHECKING:
    from ..core import Audit


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


def context(audit: "Audit", charts: bool = True) -> dict[str, Any]:
    from ..rules import RULES
    from .charts import energy_chart, share_chart

    counts = audit.counts_by_severity()
    status = "fail" if counts["error"] else ("review" if counts["warning"] else "pass")
    findings = [{"severity": str(f.severity), "code": f.code, "slug": f.slug, "message": f.message,
                 "fix": f.fix, "layers": f.layers} for f in audit.findings]
    groups: dict[str, dict[str, Any]] = {}
    for f in findings:  # one box per rule: its explanation once, then each finding
        if f["code"] not in groups:
            r = RULES.get(f["code"])
            why = r.sections.get("Why it is bad", "").replace("\n", " ") if r else ""
            groups[f["code"]] = {"code": f["code"], "slug": f["slug"], "severity": f["severity"], "why": why,
                                 "entries": []}
        groups[f["code"]]["entries"].append(f)
    skipped = [(l.name, str(s.verdict), s.reason) for l in audit.layers
               if (s := audit.suggestions.get(l.name)) is not None and str(s.verdict) in ("skipped", "skip narrow")]
    settings = [(k, ", ".join(map(str, v)) if isinstance(v, tuple) else v) for k, v in asdict(audit.settings).items()]
    return {
        "a": audit,
        "rows": layer_rows(audit),
        "counts": counts,
        "status": status,
        "findings": findings,
        "finding_groups": list(groups.values()),
        "skipped": skipped,
        "settings": settings,
        "holding80": audit.layers_holding(0.8),
        "plan_suggested": audit.review is None or audit.review.source == "suggested",
        "share_chart": share_chart(audit) if charts else "",
        "energy_chart": energy_chart(audit) if charts else None,
        "created": _dt.date.today().isoformat(),
        "css": (template_dir() / "report.css").read_text(encoding="utf-8"),
        "human": human,
        "pct": _pct,
    }


def render(audit: "Audit") -> str:
    return _env().get_template("report.html").render(**context(audit))


def render_compact(audit: "Audit", top: int = 10) -> str:
    ctx = context(audit, charts=False)
    return _env().get_template("compact.html").render(**ctx, top=top)


def write(audit: "Audit", path: str | Path) -> str:
    text = render(audit)
    with atomic_write(path) as fh:
        fh.write(text)
    return text
