"""JSON: a versioned schema (docs/schema.json) with a meta block; deterministic for the same input."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..core import Audit

FORMAT_VERSION = 1


def to_dict(audit: "Audit", with_sigma: bool = False) -> dict[str, Any]:
    from dataclasses import asdict

    g = audit.graph
    return {
        "format_version": FORMAT_VERSION,
        "meta": {
            "tool": "lowrank-auditor",
            "version": audit.environment.get("lowrank-auditor"),
            "model": audit.model_name,
            "source": audit.source,
            "trace_method": audit.trace_method,
            "trace_failures": audit.trace_failures,
            "trace_summary": audit.trace_summary,
            "inputs": audit.inputs,
            "environment": audit.environment,
            "settings": asdict(audit.settings),
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
            "graph_nodes": g.number_of_nodes() if g is not None else None,
            "graph_edges": g.number_of_edges() if g is not None else None,
        },
        "verdict": audit.verdict_line,
        "layers": [
            {**l.to_dict(), "cumulative_share": c} for l, c in zip(audit.layers, audit.cumulative())
        ],
        "spectra": {k: v.to_dict(with_sigma=with_sigma) for k, v in audit.spectra.items()},
        "suggestions": {k: v.to_dict() for k, v in audit.suggestions.items()},
        "plan_review": audit.review.to_dict() if audit.review else None,
        "findings": [f.to_dict() for f in audit.findings],
        "unsupported_ops": audit.unsupported_ops,
        "spectra_stats": audit.spectra_stats,
    }
