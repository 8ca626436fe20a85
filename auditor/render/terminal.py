"""The terminal table: ranked layers, totals, the plan's savings, the findings and the baseline diff.

Every line fits ``context.width``: prose is wrapped, and table columns are dropped, least useful first, until the
table fits; the layer name column then takes the room that is left (long names keep their tail).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..policy import verdict_line
from . import calibration
from .base import RenderContext
from .view import LayerRow, fmt_num, human, layer_table

if TYPE_CHECKING:
    from ..results import Audit

MIN_WIDTH = 60
NAME_MIN = 12
GAP = 2


@dataclass(frozen=True)
class Column:
    title: str
    width: int  # 0: the name column, sized to fit
    align: str
    cell: Callable[[LayerRow], str]
    keep: int  # higher is kept longer when the width is short


def _columns(labels: list[str]) -> list[Column]:
    cols = [
        Column("#", 3, ">", lambda r: str(r.rank_order), 100),
        Column("layer", 0, "<", lambda r: r.name + (" *" if r.tied else ""), 100),
        Column("kind", 12, "<", lambda r: r.kind, 10),
        Column("m x n", 13, ">", lambda r: r.shape, 60),
        Column("params", 12, ">", lambda r: f"{r.params:,}", 95),
        Column("share", 6, ">", lambda r: f"{100 * r.share:.1f}%", 90),
        Column("cum", 6, ">", lambda r: f"{100 * r.cumulative:.0f}%", 20),
        Column("MACs", 9, ">", lambda r: human(r.macs), 30),
        Column("break-even", 10, ">", lambda r: fmt_num(r.break_even), 70),
    ]
    for i, label in enumerate(labels):
        cols.append(Column(label, max(5, len(label)), ">", lambda r, i=i: fmt_num(r.ranks[i]), 40 + i))
    cols += [
        Column("rank", 5, ">", lambda r: fmt_num(r.suggested), 85),
        Column("x", 6, ">", lambda r: fmt_num(r.compression, 2), 50),
        Column("verdict", 11, "<", lambda r: r.verdict, 80),
    ]
    return cols


def _fit(cols: list[Column], width: int, name_want: int) -> tuple[list[Column], int]:
    """The columns that fit in ``width`` (dropping the least useful first) and the name column's width."""
    kept = list(cols)

    def fixed() -> int:
        return sum(c.width for c in kept if c.width) + GAP * (len(kept) - 1)

    while fixed() + NAME_MIN > width:
        droppable = [c for c in kept if c.keep < 100]
        if not droppable:
            break
        kept.remove(min(droppable, key=lambda c: c.keep))
    return kept, max(NAME_MIN, min(name_want, width - fixed()))


def _table(rows: list[LayerRow], cols: list[Column], namew: int) -> list[str]:
    def line(vals: list[str]) -> str:
        parts = []
        for c, v in zip(cols, vals):
            w = c.width or namew
            v = v if len(v) <= w else "…" + v[-(w - 1):]
            parts.append(f"{v:{c.align}{w}}")
        return (" " * GAP).join(parts).rstrip()

    return [line([c.title for c in cols])] + [line([c.cell(r) for c in cols]) for r in rows]


def render(audit: "Audit", context: RenderContext = RenderContext(), top: int = 40) -> str:
    width = max(MIN_WIDTH, context.width)
    out: list[str] = []

    def say(text: str, indent: str = "") -> None:
        out.extend(textwrap.wrap(text, width, subsequent_indent=indent, break_on_hyphens=False) or [""])

    say(f"lowrank-audit: {audit.model_name}  ({audit.source})")
    say(audit.trace_summary)
    macs = audit.total_macs
    say(f"parameters {audit.total_params:,} unique; factorizable {audit.factorizable_params:,} "
        f"in {len(audit.layers)} layers; rest {audit.rest_params:,} ({100 * audit.rest_share:.1f}%)"
        + (f"; MACs {macs:,} per forward on {audit.inputs}" if macs is not None else "; MACs: no inputs"))
    k = audit.layers_holding(0.8)
    if k:
        say(f"{k} of {len(audit.layers)} layers hold 80% of the parameters")
    for note in audit.notes:
        say(f"note: {note}", "      ")
    out.append("")
    table = layer_table(audit)
    rows = table.rows[:top]
    cols, namew = _fit(_columns([c.label for c in table.columns]), width,
                       min(56, max([16] + [len(r.name) + 2 for r in rows])))
    out += _table(rows, cols, namew)
    if len(table.rows) > top:
        say(f"... {len(table.rows) - top} more layers (see --format json/html)")
    if any(r.tied for r in table.rows):
        say("* tied or shared weight: counted once; every use listed in the JSON and HTML reports", "  ")
    rv = audit.review
    out.append("")
    if rv is not None and rv.items:
        what = "suggested plan" if rv.suggested else f"plan {rv.source}"
        say(f"{what}: {len(rv.items)} layers, {rv.params_before:,} -> {rv.params_after:,} params; model "
            f"{audit.total_params:,} -> {rv.model_params_after:,} ({100 * rv.share_saved:.1f}% saved)"
            + (f"; MACs {rv.macs_before:,} -> {rv.macs_after:,}" if rv.macs_before is not None else ""), "  ")
    elif rv is not None:
        say("no layer is worth factorizing at the target energy" if rv.suggested else "the plan factorizes nothing")
    if audit.calibration is not None:
        out.append("")
        for line in calibration.terminal(audit):
            say(line, "  ")
        out += [line[:width] for line in calibration.terminal_table(audit, min(40, max(12, width - 62)))]
    if audit.findings:
        out.append("")
        for f in audit.findings:
            say(f"{f.severity.value:<7} {f.code} {f.message}", " " * 14)
    if context.baseline is not None:
        d = context.baseline
        out.append("")
        say(f"since the baseline: {len(d.new_findings)} new finding(s), {len(d.fixed_findings)} fixed; parameters "
            f"saved {d.saved_before:,} -> {d.saved_after:,} ({d.saved_delta:+,})")
        for f in d.new_findings:
            say(f"  new   {f['code']} {f['message']}", " " * 14)
        for f in d.fixed_findings:
            say(f"  fixed {f['code']} {f['message']}", " " * 14)
        if d.layers_added or d.layers_removed:
            say(f"  layers added: {', '.join(d.layers_added) or 'none'}; removed: "
                f"{', '.join(d.layers_removed) or 'none'}", "    ")
    out.append("")
    say(verdict_line(audit))
    return "\n".join(out) + "\n"


class TextReporter:
    name = "text"
    suffix = ".txt"
    binary = False

    def render(self, audit: "Audit", context: RenderContext) -> str:
        return render(audit, context)
