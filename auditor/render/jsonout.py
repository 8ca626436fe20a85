"""JSON: a versioned schema (docs/schema.json) with a meta block; deterministic for the same input."""

from __future__ import annotations

import json
from enum import Enum
from typing import TYPE_CHECKING, Any

from ..artifacts.outputs import strict_json
from ..verdict.policy import measured, status, verdict_line
from .base import RenderContext, Stdout

if TYPE_CHECKING:
    from ..results import AuditResult

FORMAT_VERSION = 1


def _settings(audit: "AuditResult") -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Enum) else v) for k, v in audit.settings.as_dict().items()}


def to_dict(audit: "AuditResult", with_sigma: bool = False) -> dict[str, Any]:
    g = audit.graph
    return {
        "format_version": FORMAT_VERSION,
        "meta": {
            "tool": "lowrank-auditor",
            "version": audit.environment.get("lowrank-auditor"),
            "model": audit.model_name,
            "source": audit.source,
            "trace_method": str(audit.trace_method),
            "trace_failures": audit.trace_failures,
            "trace_summary": audit.trace_summary,
            "inputs": audit.inputs,
            "environment": audit.environment,
            "settings": _settings(audit),
            "notes": audit.notes,
        },
        "totals": {
            "params": audit.total_params,
            "factorizable_params": audit.factorizable_params,
            "rest_params": audit.rest_params,
            "rest_share": audit.rest_share,
            "macs": audit.total_macs,
            "layers": len(audit.layers),
            "layers_holding_80pct": audit.layers_holding(0.8),
            "graph_nodes": len(g.nodes) if g is not None else None,
            "graph_edges": len(g.edges) if g is not None else None,
        },
        "verdict": verdict_line(audit),
        "status": str(status(audit)),
        "measured": measured(audit),
        "layers": [
            {**l.to_dict(), "cumulative_share": c} for l, c in zip(audit.layers, audit.cumulative())
        ],
        "spectra": {k: v.to_dict(with_sigma=with_sigma) for k, v in audit.spectra.items()},
        "suggestions": {k: v.to_dict() for k, v in audit.suggestions.items()},
        "plan_review": audit.review.to_dict() if audit.review else None,
        "findings": [f.to_dict() for f in audit.findings],
        "unsupported_ops": audit.unsupported_ops,
        "spectra_stats": audit.spectra_stats,
        # older reports are unchanged: the block only when the audit has calibration
        **({"calibration": audit.calibration.to_dict()} if audit.calibration is not None else {}),
        **({"speed": audit.speed.to_dict()} if audit.speed is not None else {}),  # only when measured
        **({"ties": [g.to_dict() for g in audit.ties]} if audit.ties else {}),  # only with --tie
    }


def baseline_block(audit: "AuditResult", context: RenderContext) -> dict[str, Any]:
    """The ``baseline`` block: the diff, plus ``rank_changes`` (layer, before, after; null = dense or absent)
    when the baseline report itself is at hand."""
    from .parts.pages import rank_changes

    assert context.baseline is not None
    d = context.baseline.to_dict()
    if context.baseline_report is not None:
        d["rank_changes"] = [{"layer": c.layer, "before": c.before, "after": c.after,
                              "present_before": c.present_before, "present_after": c.present_after}
                             for c in rank_changes(audit, context.baseline_report)]
    return d


class JsonReporter:
    name = "json"
    suffix = ".json"
    binary = False
    stdout = Stdout.DOCUMENT

    def render(self, audit: "AuditResult", context: RenderContext) -> str:
        data = to_dict(audit, with_sigma=context.with_sigma)
        if context.baseline is not None:
            data["baseline"] = baseline_block(audit, context)
        return strict_json(data, indent=2) + "\n"  # no Infinity/NaN: null, named under "non_finite"
