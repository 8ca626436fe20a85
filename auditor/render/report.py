"""The report calls as functions of a plain :class:`auditor.results.AuditResult`: what ``a.to_json()``, ``a.to_html(path)``
and the other output methods of :class:`auditor.api.Audit` (the object :func:`auditor.audit` returns) call.

``baseline`` is an earlier JSON report (a path or the dict); every format then shows what changed since it.

>>> import auditor, torch
>>> a = auditor.audit(torch.nn.Linear(8, 4), spectra=False, name="tiny")
>>> to_markdown(a).splitlines()[0], to_dict(a)["totals"]["params"]
('## Low-rank audit: tiny', 36)
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import AuditError
from . import REPORTERS
from .base import RenderContext, atomic_write

if TYPE_CHECKING:
    import pandas

    from ..verdict.baseline import BaselineSource
    from ..results import AuditResult

__all__ = ["LAYER_ROW_FIELDS", "context", "notebook_html", "to_dict", "to_html", "to_json", "to_markdown",
           "to_pandas", "to_pdf", "to_text"]

LAYER_ROW_FIELDS = ("rank_order", "name", "kind", "module_type", "m", "n", "groups", "shape", "params", "share",
                    "cumulative", "macs", "calls", "tied", "break_even", "suggested", "compression",
                    "energy_at_rank", "verdict", "reason", "stable_rank", "effective_rank", "planned")


def context(audit: "AuditResult", baseline: "BaselineSource | None" = None) -> RenderContext:
    """The render context: empty, or the comparison with ``baseline`` (a path or an earlier report's dict)."""
    if baseline is None:
        return RenderContext()
    from ..verdict.baseline import compare, load

    base = baseline if isinstance(baseline, dict) else load(baseline)
    return RenderContext(baseline=compare(audit, base), baseline_report=base)


def render(audit: "AuditResult", fmt: str, baseline: "BaselineSource | None" = None) -> str | bytes:
    """One format of :data:`auditor.render.REPORTERS` (``"md"``, ``"html"``, ...), nothing written."""
    return REPORTERS[fmt].render(audit, context(audit, baseline))


def to_dict(audit: "AuditResult", with_sigma: bool = False) -> dict[str, Any]:
    """The JSON report as a dict (docs/schema.json); ``with_sigma`` adds every singular value."""
    from .jsonout import to_dict as as_dict

    return as_dict(audit, with_sigma=with_sigma)


def to_json(audit: "AuditResult", with_sigma: bool = False, indent: int | None = 2,
            baseline: "BaselineSource | None" = None) -> str:
    """The JSON report; ``baseline`` adds a ``baseline`` block."""
    from .jsonout import baseline_block

    data = to_dict(audit, with_sigma=with_sigma)
    ctx = context(audit, baseline)
    if ctx.baseline is not None:
        data["baseline"] = baseline_block(audit, ctx)
    from ..artifacts.outputs import strict_json

    return strict_json(data, indent=indent, sort_keys=False)


def to_markdown(audit: "AuditResult", baseline: "BaselineSource | None" = None) -> str:
    """Markdown for a pull-request comment or a CI summary; ``baseline`` adds "Since the baseline"."""
    return render(audit, "md", baseline)  # type: ignore[return-value]


def to_text(audit: "AuditResult", width: int = 120, baseline: "BaselineSource | None" = None) -> str:
    """The terminal table, no line longer than ``width`` (at least 60) characters; ``width=0``: every column kept
    (the .txt report's form)."""
    return REPORTERS["text"].render(audit, replace(context(audit, baseline), width=width))  # type: ignore[return-value]


def to_html(audit: "AuditResult", path: str | Path | None = None, baseline: "BaselineSource | None" = None) -> str:
    """One self-contained HTML page, written atomically to ``path`` when given; returns the HTML."""
    text = render(audit, "html", baseline)
    if path is not None:
        with atomic_write(path) as fh:
            fh.write(text)
    return text  # type: ignore[return-value]


def to_pdf(audit: "AuditResult", path: str | Path, baseline: "BaselineSource | None" = None) -> Path:
    """The HTML report printed to PDF with WeasyPrint, written atomically to ``path``; returns the path. Without
    WeasyPrint and Pango it raises :class:`AuditError` saying what to install, and writes nothing."""
    data = render(audit, "pdf", baseline)
    with atomic_write(path, binary=True) as fh:
        fh.write(data)
    return Path(path)


def to_pandas(audit: "AuditResult") -> "pandas.DataFrame":
    """One row per layer indexed by its name (the layer table's columns, rank columns named after the energy targets); the rank
    columns, ``suggested``, ``planned`` and ``macs`` are nullable integers (``Int64``)."""
    try:
        import pandas as pd
    except ImportError:
        raise AuditError("pandas is not installed", "pip install pandas") from None
    from .parts.view import layer_table

    table = layer_table(audit)
    labels = [c.label for c in table.columns]
    df = pd.DataFrame([row.record(labels) for row in table.rows], columns=[*LAYER_ROW_FIELDS, *labels])
    for col in [*labels, "suggested", "planned", "macs"]:
        df[col] = df[col].astype("Int64")
    df.index = pd.Index(df["name"], name="layer")  # df.loc["fc1"]; the name column stays
    return df


def notebook_html(audit: "AuditResult") -> str:
    """The notebook view: summary, the top layers and the findings, styled inline."""
    from .html import render_compact

    return render_compact(audit)
