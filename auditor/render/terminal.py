"""The terminal table: block groups largest first, totals, the plan's savings, the findings and the baseline diff.

Every line fits ``context.width``: prose is wrapped, and table columns are dropped, least useful first, until the
table fits; the layer name column then takes the room that is left (long names are cut in the middle, so T5's
``encoder...relative_attention_bias`` and ``decoder...relative_attention_bias`` stay distinct). Names pass through
:func:`auditor.render.safe.term`: no escape sequence, control character or direction override reaches the terminal.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..policy import verdict_line
from . import calibration
from .base import RenderContext
from .pages import GroupRow, group_rows, plan_rows, rank_changes
from .safe import middle, term
from .view import fmt_num, human, layer_table, spectra_computed

if TYPE_CHECKING:
    from ..results import Audit

MIN_WIDTH = 60
NAME_MIN = 10
GAP = 2


@dataclass(frozen=True)
class Column:
    title: str
    width: int  # 0: the name column, sized to fit
    align: str
    cell: Callable[[int, GroupRow], str]
    keep: int  # higher is kept longer when the width is short


def _name(g: GroupRow) -> str:
    tied = any(r.tied for r in g.members)
    return term(g.label) + (f" ×{g.size}" if g.is_group else "") + (" *" if tied else "")


def _columns(labels: list[str], planned: bool) -> list[Column]:
    cols = [
        Column("#", 3, ">", lambda i, g: str(i), 100),
        Column("layer", 0, "<", lambda i, g: _name(g), 100),
        Column("kind", 12, "<", lambda i, g: g.members[0].kind, 10),
        Column("m x n", 13, ">", lambda i, g: g.shape, 60),
        Column("params", 12, ">", lambda i, g: f"{g.params:,}", 95),
        Column("share", 6, ">", lambda i, g: f"{100 * g.share:.1f}%", 90),
        Column("cum", 5, ">", lambda i, g: f"{100 * g.cumulative:.0f}%", 20),
        Column("MACs", 9, ">", lambda i, g: human(g.macs), 30),
        Column("break-even", 10, ">", lambda i, g: fmt_num(g.break_even), 70),
    ]
    for k, label in enumerate(labels):
        cols.append(Column(label, max(5, len(label)), ">", lambda i, g, k=k: g.ranks[k] if g.ranks[k] != "–" else "-", 40 + k))
    if planned:
        cols += [Column("planned", 8, ">", lambda i, g: g.planned if g.planned != "–" else "dense", 88),
                 Column("sugg.", 8, ">", lambda i, g: g.suggested if g.suggested != "–" else "-", 75)]
    else:
        cols.append(Column("rank", 8, ">", lambda i, g: g.suggested if g.suggested != "–" else "-", 85))
    cols += [
        Column("x", 6, ">", lambda i, g: fmt_num(g.compression, 2), 50),
        Column("verdict", 11, "<", lambda i, g: g.verdict, 80),
    ]
    return cols


def _fit(cols: list[Column], width: int, name_want: int) -> tuple[list[Column], int]:
    """The columns that fit in ``width`` (dropping the least useful first) and the name column's width (at least
    a sixth of the line, so names stay readable before the less useful columns go)."""
    kept = list(cols)
    name_min = max(NAME_MIN, min(name_want, width // (4 if width >= 100 else 6)))

    def fixed() -> int:
        return sum(c.width for c in kept if c.width) + GAP * (len(kept) - 1)

    while fixed() + name_min > width:
        droppable = [c for c in kept if c.keep < 100]
        if not droppable:
            break
        kept.remove(min(droppable, key=lambda c: c.keep))
    return kept, max(name_min, min(name_want, width - fixed()))


def _cut_name(text: str, width: int) -> str:
    """A name cut in the middle, its " ×N" and " *" marks kept whole."""
    m = re.match(r"(.*?)((?: ×\d+)?(?: \*)?)$", text, re.S)
    label, marks = (m.group(1), m.group(2)) if m else (text, "")
    return middle(label, max(4, width - len(marks))) + marks


def _table(rows: list[GroupRow], cols: list[Column], namew: int) -> list[str]:
    def line(vals: list[str]) -> str:
        parts = []
        for c, v in zip(cols, vals):
            w = c.width or namew
            v = _cut_name(v, w) if c.width == 0 else (v if len(v) <= w else "…" + v[-(w - 1):])
            parts.append(f"{v:{c.align}{w}}")
        return (" " * GAP).join(parts).rstrip()

    return [line([c.title for c in cols])] + [line([c.cell(i, g) for c in cols]) for i, g in enumerate(rows, 1)]


def render(audit: "Audit", context: RenderContext = RenderContext(), top: int = 40) -> str:
    width = max(MIN_WIDTH, context.width)
    out: list[str] = []

    def say(text: str, indent: str = "") -> None:
        out.extend(textwrap.wrap(text, width, subsequent_indent=indent, break_on_hyphens=False) or [""])

    say(f"lowrank-audit: {term(audit.model_name)}  ({term(audit.source)})")
    say(term(audit.trace_summary))
    macs = audit.total_macs
    say(f"parameters {audit.total_params:,} unique; factorizable {audit.factorizable_params:,} "
        f"in {len(audit.layers)} layers; rest {audit.rest_params:,} ({100 * audit.rest_share:.1f}%)"
        + (f"; MACs {macs:,} per forward on {audit.inputs}" if macs is not None else "; MACs: no inputs"))
    k = audit.layers_holding(0.8)
    if k:
        say(f"{k} of {len(audit.layers)} layers hold 80% of the parameters")
    for note in audit.notes:
        say(f"note: {term(note)}", "      ")
    out.append("")
    table = layer_table(audit)
    groups = group_rows(audit, table)
    rows = groups[:top]
    cols, namew = _fit(_columns([c.label for c in table.columns], table.planned), width,
                       min(64, max([16] + [len(_name(g)) + 2 for g in rows])))
    out += _table(rows, cols, namew)
    if len(groups) > top:
        say(f"... {len(groups) - top} more groups (see --format json/html)")
    grouped = sum(g.is_group for g in groups)
    if grouped:
        say(f"{grouped} groups of repeated blocks: * stands for the index, ×N for the members (each member is "
            "listed in the JSON and HTML reports)", "  ")
    if any(r.tied for r in table.rows):
        say("* tied or shared weight: counted once; every use listed in the JSON and HTML reports", "  ")
    if any(c.title == "x" for c in cols):
        say("x = compression m*n / (r*(m+n)) at the " + ("planned" if table.planned else "suggested")
            + " rank; above 1 saves parameters", "  ")
    rv = audit.review
    out.append("")
    if not spectra_computed(audit):
        say("spectra were not computed: no rank is suggested (drop --no-spectra, or load real weights)")
    elif rv is not None and rv.items:
        what = "suggested plan" if rv.suggested else f"plan {term(rv.source)}"
        say(f"{what}: {len(rv.items)} layers, {rv.params_before:,} -> {rv.params_after:,} params; model "
            f"{audit.total_params:,} -> {rv.model_params_after:,} ({100 * rv.share_saved:.1f}% saved)"
            + (f"; MACs {rv.macs_before:,} -> {rv.macs_after:,}" if rv.macs_before is not None else ""), "  ")
        for p in plan_rows(audit):
            if p.flag:
                say(f"  ! {term(p.layer)} r={p.rank:,}: {p.params_before:,} -> {p.params_after:,} "
                    f"(x {p.compression:.2f}); {p.flag}", "      ")
        if rv.suggested and audit.calibration is None:  # a calibrated audit says it in its own section
            say(calibration.suggested_plan_note(audit), "  ")
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
            say(f"{f.severity.value:<7} {f.code} {term(f.message)}", " " * 14)
    if context.baseline is not None:
        d = context.baseline
        out.append("")
        say(f"since the baseline: {len(d.new_findings)} new finding(s), {len(d.fixed_findings)} fixed; parameters "
            f"saved {d.saved_before:,} -> {d.saved_after:,} ({d.saved_delta:+,})")
        for f in d.new_findings:
            say(f"  new   {f['code']} {term(f['message'])}", " " * 14)
        for f in d.fixed_findings:
            say(f"  fixed {f['code']} {term(f['message'])}", " " * 14)
        if d.layers_added or d.layers_removed:
            say(f"  layers added: {', '.join(map(term, d.layers_added)) or 'none'}; removed: "
                f"{', '.join(map(term, d.layers_removed)) or 'none'}", "    ")
        changes = rank_changes(audit, context.baseline_report)
        for c in changes[:top]:
            say(f"  rank  {term(c.layer)}: {c.text().replace('→', '->')}", "        ")
        if len(changes) > top:
            say(f"  ... {len(changes) - top} more rank changes")
    out.append("")
    say(term(verdict_line(audit)))
    return "\n".join(out) + "\n"


class TextReporter:
    name = "text"
    suffix = ".txt"
    binary = False

    def render(self, audit: "Audit", context: RenderContext) -> str:
        return render(audit, context)
