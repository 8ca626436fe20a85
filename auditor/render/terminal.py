"""The terminal table: ranked layers, totals, the plan's savings and the findings."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .view import fmt_num, human, layer_rows

if TYPE_CHECKING:
    from ..core import Audit


def render(audit: "Audit", width: int = 120, top: int = 40) -> str:  # noqa: ARG001 - width kept for API
    out: list[str] = []
    out.append(f"lowrank-audit: {audit.model_name}  ({audit.source})")
    out.append(audit.trace_summary)
    macs = audit.total_macs
    out.append(f"parameters {audit.total_params:,} unique; factorizable {audit.factorizable_params:,} "
               f"in {len(audit.layers)} layers; rest {audit.rest_params:,} ({100 * audit.rest_share:.1f}%)"
               + (f"; MACs {macs:,} per forward on {audit.inputs}" if macs is not None else "; MACs: no inputs"))
    k = audit.layers_holding(0.8)
    if k:
        out.append(f"{k} of {len(audit.layers)} layers hold 80% of the parameters")
    for note in audit.notes:
        out.append(f"note: {note}")
    out.append("")
    cols = [("#", 3, ">"), ("layer", 0, "<"), ("kind", 12, "<"), ("m x n", 13, ">"), ("params", 12, ">"),
            ("share", 6, ">"), ("cum", 6, ">"), ("MACs", 9, ">"), ("break-even", 10, ">"), ("r90", 5, ">"),
            ("r95", 5, ">"), ("r99", 5, ">"), ("rank", 5, ">"), ("x", 6, ">"), ("verdict", 11, "<")]
    rows = layer_rows(audit)
    namew = max([16] + [len(r["name"]) + 2 for r in rows[:top]])
    namew = min(namew, 56)

    def line(vals: list[str]) -> str:
        parts = []
        for (_, w, al), v in zip(cols, vals):
            w = w or namew
            v = v if len(v) <= w else "…" + v[-(w - 1):]
            parts.append(f"{v:{al}{w}}")
        return "  ".join(parts).rstrip()

    out.append(line([c for c, _, _ in cols]))
    for r in rows[:top]:
        out.append(line([
            str(r["rank_order"]), r["name"] + (" *" if r["tied"] else ""), r["kind"], r["shape"], f"{r['params']:,}",
            f"{100 * r['share']:.1f}%", f"{100 * r['cumulative']:.0f}%", human(r["macs"]), fmt_num(r["break_even"]),
            fmt_num(r["r90"]), fmt_num(r["r95"]), fmt_num(r["r99"]), fmt_num(r["suggested"]),
            fmt_num(r["compression"], 2), r["verdict"],
        ]))
    if len(rows) > top:
        out.append(f"... {len(rows) - top} more layers (see --format json/html)")
    if any(r["tied"] for r in rows):
        out.append("* tied or shared weight: counted once; every use listed in the JSON and HTML reports")
    rv = audit.review
    out.append("")
    if rv is not None and rv.items:
        what = "suggested plan" if rv.source == "suggested" else f"plan {rv.source}"
        out.append(f"{what}: {len(rv.items)} layers, {rv.params_before:,} -> {rv.params_after:,} params; model "
                   f"{audit.total_params:,} -> {rv.model_params_after:,} ({100 * rv.share_saved:.1f}% saved)"
                   + (f"; MACs {rv.macs_before:,} -> {rv.macs_after:,}" if rv.macs_before is not None else ""))
    elif rv is not None:
        out.append("no layer is worth factorizing at the target energy" if rv.source == "suggested"
                   else "the plan factorizes nothing")
    if audit.findings:
        out.append("")
        for f in audit.findings:
            out.append(f"{f.severity.value:<7} {f.code} {f.message}")
    out.append("")
    out.append(audit.verdict_line)
    return "\n".join(out) + "\n"
