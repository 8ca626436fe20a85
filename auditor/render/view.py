"""View-model rows shared by the table renderers (terminal, Markdown, HTML, pandas)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..core import Audit


def layer_rows(audit: "Audit") -> list[dict[str, Any]]:
    rows = []
    cum = audit.cumulative()
    for i, layer in enumerate(audit.layers):
        sg = audit.suggestions.get(layer.name)
        sp = audit.spectra.get(layer.name)
        ranks = sg.ranks_for if sg else {}
        rows.append({
            "rank_order": i + 1,
            "name": layer.name,
            "kind": str(layer.kind),
            "module_type": layer.module_type,
            "m": layer.m,
            "n": layer.n,
            "groups": layer.groups,
            "shape": f"{layer.m}x{layer.n}" + (f" x{layer.groups}g" if layer.groups > 1 else ""),
            "params": layer.params,
            "share": layer.share,
            "cumulative": cum[i],
            "macs": layer.macs,
            "calls": layer.calls,
            "tied": layer.tied,
            "break_even": layer.break_even,
            "r90": ranks.get("0.9"),
            "r95": ranks.get("0.95"),
            "r99": ranks.get("0.99"),
            "ranks_for": ranks,
            "suggested": sg.rank if sg else None,
            "compression": sg.compression if sg else None,
            "energy_at_rank": sg.energy_at_rank if sg else None,
            "verdict": str(sg.verdict) if sg else "",
            "reason": sg.reason if sg else "",
            "stable_rank": sp.stable_rank if sp and sp.sigma is not None else None,
            "effective_rank": sp.effective_rank if sp and sp.sigma is not None else None,
        })
    return rows


def fmt_num(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:,.{digits}f}"


def human(x: int | None) -> str:
    if x is None:
        return "-"
    for div, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.2f}{unit}"
    return str(x)
