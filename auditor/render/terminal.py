"""The terminal table: block groups largest first, totals, the plan's savings, the findings and the baseline diff.

Every line fits ``context.width``: prose is wrapped, and each table column is as wide as its widest cell, so no number,
range (``64–126``) or verdict (``keep dense 1 · factorize 3``) is ever cut. When the line is too short the columns give
way in a fixed order (:func:`layer_steps`: shortened, then dropped, least useful first), and a legend line says what
was shortened or left out; the layer name column then takes the room that is left (long names are cut in the
middle, so T5's ``encoder...relative_attention_bias`` and ``decoder...relative_attention_bias`` stay distinct).
Names pass through :func:`auditor.render.parts.safe.term`: no escape sequence, control character or direction override
reaches the terminal.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..verdict.policy import empty_plan_words, verdict_line
from .parts import calibration, speed
from .base import RenderContext, Stdout
from .parts.pages import GroupRow, group_rows, plan_rows, rank_changes
from .parts.safe import middle, term
from .parts.view import factorized_count, fmt_num, human, layer_table, spectra_computed, trace_sentence

if TYPE_CHECKING:
    from ..results import AuditResult
    from .parts.calibration import CalibrationView

MIN_WIDTH = 60
NAME_MIN = 10
GAP = 2

# Short kind words, for the first step of fitting a narrow table.
KIND_SHORT = {"linear": "lin", "embedding": "emb", "hf_conv1d": "conv1d", "conv_transpose": "convT",
              "mha_in_proj": "mha", "matmul": "mm", "tensor": "tens"}


@dataclass(frozen=True)
class Column:
    """A table column. ``key`` names it in the fitting steps; ``short`` is its abbreviated form (a shorter title
    and/or shorter cells that keep every number whole: 589,824 -> 589.82K)."""

    key: str
    title: str
    align: str
    cell: Callable[[int, Any], str]
    short: "tuple[str, Callable[[int, Any], str]] | None" = None
    name: bool = False  # the flexible column: cut in the middle when room is short
    min_width: int = 0


@dataclass(frozen=True)
class Fitted:
    """A table fitted to a width: its columns (abbreviated where ``short`` is set), their widths, and which
    columns were dropped or abbreviated (in the order the steps ran)."""

    columns: list[tuple[Column, bool]]  # (column, abbreviated)
    widths: list[int]
    dropped: list[str]
    abbreviated: list[str]

    def lines(self, rows: list[Any]) -> list[str]:
        def line(vals: list[str]) -> str:
            parts = []
            for (c, _), w, v in zip(self.columns, self.widths, vals):
                if c.name:
                    v = _cut_name(v, w)
                parts.append(f"{v:{c.align}{w}}")
            return (" " * GAP).join(parts).rstrip()

        head = [(c.short[0] if short and c.short else c.title) for c, short in self.columns]
        return [line(head)] + [line([_cell(c, short, i, r) for c, short in self.columns])
                               for i, r in enumerate(rows, 1)]

    def has(self, key: str) -> bool:
        return any(c.key == key for c, _ in self.columns)


def _cell(c: Column, short: bool, i: int, row: Any) -> str:
    return (c.short[1] if short and c.short else c.cell)(i, row)


def fit(cols: list[Column], rows: list[Any], width: int, steps: list[tuple[str, str]],
        name_floor: int = NAME_MIN) -> Fitted:
    """The columns that fit ``width``: each column as wide as its widest cell or title (nothing is ever cut but the
    name column), then ``steps`` applied in their fixed order, ``("short", key)`` abbreviating a column and
    ``("drop", key)`` removing it, until the line fits with the name column at its floor (a quarter of the line,
    at least ``name_floor``, or the longest name when that is shorter). The name column then takes the room left."""
    state: dict[str, bool] = {c.key: False for c in cols}  # key -> abbreviated
    kept = [c.key for c in cols]
    by_key = {c.key: c for c in cols}
    dropped: list[str] = []
    abbreviated: list[str] = []

    def natural(c: Column, short: bool) -> int:
        title = c.short[0] if short and c.short else c.title
        return max([c.min_width, len(title)] + [len(_cell(c, short, i, r)) for i, r in enumerate(rows, 1)])

    name_want = max([natural(c, False) for c in cols if c.name] or [0])
    floor = min(name_want, max(name_floor, width // 4))

    def fixed() -> int:
        return sum(natural(by_key[k], state[k]) for k in kept if not by_key[k].name) + GAP * (len(kept) - 1)

    for action, key in steps:
        if fixed() + floor <= width:
            break
        if key not in kept:
            continue
        if action == "drop":
            kept.remove(key)
            dropped.append(key)
        elif by_key[key].short is not None and not state[key]:
            state[key] = True
            abbreviated.append(key)
    room = width - fixed()
    widths = [max(4, min(name_want, room)) if by_key[k].name else natural(by_key[k], state[k]) for k in kept]
    return Fitted([(by_key[k], state[k]) for k in kept], widths, dropped, abbreviated)


def _name(g: GroupRow) -> str:
    tied = any(r.tied for r in g.members)
    return term(g.label) + (f" ×{g.size}" if g.is_group else "") + (" *" if tied else "")


def _dash(text: str) -> str:
    return "-" if text == "–" else text


def _columns(labels: list[str], planned: bool) -> list[Column]:
    cols = [
        Column("#", "#", ">", lambda i, g: str(i)),
        Column("layer", "layer", "<", lambda i, g: _name(g), name=True),
        Column("kind", "kind", "<", lambda i, g: g.members[0].kind,
               short=("kind", lambda i, g: KIND_SHORT.get(g.members[0].kind, g.members[0].kind))),
        Column("shape", "m x n", ">", lambda i, g: g.shape),
        Column("params", "params", ">", lambda i, g: f"{g.params:,}", short=("params", lambda i, g: human(g.params))),
        Column("share", "share", ">", lambda i, g: f"{100 * g.share:.1f}%"),
        Column("cum", "cum", ">", lambda i, g: f"{100 * g.cumulative:.0f}%"),
        Column("macs", "MACs", ">", lambda i, g: human(g.macs)),
        Column("break-even", "break-even", ">", lambda i, g: fmt_num(g.break_even),
               short=("b-e", lambda i, g: fmt_num(g.break_even))),
    ]
    for k, label in enumerate(labels):
        cols.append(Column(label, label, ">", lambda i, g, k=k: _dash(g.ranks[k])))
    if planned:
        cols += [Column("planned", "planned", ">", lambda i, g: g.planned if g.planned != "–" else "dense"),
                 Column("sugg.", "sugg.", ">", lambda i, g: _dash(g.suggested))]
    else:
        cols.append(Column("rank", "rank", ">", lambda i, g: _dash(g.suggested)))
    cols += [
        Column("x", "x", ">", lambda i, g: fmt_num(g.compression, 2)),
        Column("verdict", "verdict", "<", lambda i, g: g.verdict, short=("verdict", lambda i, g: short_verdict(g.verdict))),
    ]
    return cols


def short_verdict(verdict: str) -> str:
    """A group's mixed verdict in fewer columns, every count kept: "keep dense 1 · factorize 3" -> "dense 1·fact 3".

    >>> short_verdict("keep dense 1 · factorize 3"), short_verdict("factorize")
    ('dense 1·fact 3', 'factorize')
    """
    if "\u00b7" not in verdict:
        return verdict
    words = {"keep dense": "dense", "factorize": "fact", "skip narrow": "narrow", "skipped": "skip"}
    parts = [p.strip() for p in verdict.split("\u00b7")]
    out = []
    for p in parts:
        for long, short in words.items():
            if p.startswith(long):
                p = short + p[len(long):]
                break
        out.append(p)
    return "\u00b7".join(out)


def layer_steps(labels: list[str], target: str) -> list[tuple[str, str]]:
    """The fixed order in which the layer table gives way to a narrow line: kind words shortened, the cumulative
    share dropped, parameter counts in K/M, MACs, kind, the rank columns other than the target energy's (highest
    target first), break-even's title, the compression, the shape, break-even, the target's rank column, the
    suggested rank beside a planned one, the share, the parameters. The row number, the name, the rank shown and
    the verdict always stay."""
    others = [lab for lab in reversed(labels) if lab != target]
    return ([("short", "kind"), ("drop", "cum"), ("short", "params"), ("drop", "macs"), ("drop", "kind")]
            + [("drop", lab) for lab in others]
            + [("short", "break-even"), ("drop", "x"), ("drop", "shape"), ("short", "verdict"),
               ("drop", "break-even")]
            + [("drop", lab) for lab in labels if lab == target]
            + [("drop", "sugg."), ("drop", "share"), ("drop", "params")])


def dotted(name: str, width: int) -> str:
    """``name`` in ``width`` characters, whole path components dropped from the middle, never a word cut: the first
    component and the last ones kept where they fit (``encoder.….relative_attention_bias``), else the last ones
    (``….0.mlp.down_proj``); only a last component longer than the width is cut (in its middle).

    >>> dotted("model.layers.0.mlp.down_proj", 20), dotted("encoder.block.0.layer.0.SelfAttention.relative_attention_bias", 40)
    ('….0.mlp.down_proj', 'encoder.….relative_attention_bias')
    """
    if len(name) <= width:
        return name
    parts = name.split(".")

    def most(head: str) -> tuple[int, str]:  # the most tail components that fit after head
        for k in range(len(parts) - 1 - bool(head), 0, -1):
            cand = f"{head}….{'.'.join(parts[-k:])}"
            if len(cand) <= width:
                return k, cand
        return 0, ""

    k_first, with_first = most(parts[0] + ".")
    k_tail, tail_only = most("")
    if k_first and k_first >= k_tail - 1:  # the first component (encoder, decoder) at the cost of one more
        return with_first
    return tail_only or middle(name, width)


def _cut_name(text: str, width: int) -> str:
    """A name shortened at its dots (:func:`dotted`), its " ×N" and " *" marks kept whole."""
    m = re.match(r"(.*?)((?: ×\d+)?(?: \*)?)$", text, re.S)
    label, marks = (m.group(1), m.group(2)) if m else (text, "")
    return dotted(label, max(4, width - len(marks))) + marks


def _cal_columns() -> list[Column]:
    return [
        Column("layer", "layer", "<", lambda i, r: term(r.layer), name=True),
        Column("plan", "plan", ">", lambda i, r: r.plan),
        Column("rows", "rows", ">", lambda i, r: _opt(r.rows),
               short=("rows", lambda i, r: human(r.rows) if isinstance(r.rows, int) else r.rows)),
        Column("r1", "r@1%", ">", lambda i, r: _opt(r.r1)),
        Column("r5", "r@5%", ">", lambda i, r: _opt(r.r5)),
        Column("data", "tier-1", ">", lambda i, r: r.suggested),
        Column("floor", "floor", ">", lambda i, r: r.floor),
        Column("cliff", "cliff", ">", lambda i, r: r.cliff),
    ]


CAL_STEPS = [("short", "rows"), ("drop", "cliff"), ("drop", "r1"), ("drop", "rows"), ("drop", "r5")]


def _plan_columns(cal: Any) -> list[Column]:
    """The frontier table: every plan the search measured, with what happened to it."""
    return [
        Column("removed", "removed", ">", lambda i, r: r.removed),
        Column("share", "share", ">", lambda i, r: r.share),
        Column("layers", "layers", ">", lambda i, r: str(r.layers)),
        Column("metric", "on search rows", ">", lambda i, r: r.metric),
        Column("verified", calibration.verified_head(cal), "<", lambda i, r: r.verified,
               short=("verified", lambda i, r: r.verified)),
        Column("uniform", calibration.UNIFORM_HEAD, ">", lambda i, r: r.uniform,
               short=("uniform", lambda i, r: r.uniform_value)),
        Column("status", "what happened", "<", lambda i, r: r.status, name=True),
    ]


PLAN_STEPS = [("drop", "layers"), ("drop", "share"), ("short", "uniform"), ("short", "verified")]


def _opt(v: Any) -> str:
    return "-" if v is None else f"{v:,}" if isinstance(v, int) else str(v)


def _legend(fitted: Fitted, rows: list[Any], width: int) -> list[str]:
    """What an abbreviated or dropped column means, in one line (nothing when the table is whole)."""
    parts = []
    if "kind" in fitted.abbreviated and fitted.has("kind"):
        used = dict.fromkeys(g.members[0].kind for g in rows)
        parts.append("kind: " + ", ".join(f"{KIND_SHORT[k]} = {k}" for k in used if k in KIND_SHORT))
    if "break-even" in fitted.abbreviated and fitted.has("break-even"):
        parts.append("b-e = break-even rank m*n/(m+n)")
    if "verdict" in fitted.abbreviated and any("\u00b7" in g.verdict for g in rows):
        parts.append("dense N·fact M = N members kept dense, M factorized")
    if fitted.dropped:
        titles = {c.key: c.title for c in _columns([], False)} | {"sugg.": "sugg."}
        parts.append(f"left out to fit {width} columns: "
                     f"{', '.join(titles.get(k, k) for k in fitted.dropped)} (widen the terminal, or see "
                     "--format json/html)")
    return ["; ".join(p for p in parts if p)] if any(parts) else []


def _index_key(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def plan_rank_lines(audit: "AuditResult", groups: list[GroupRow]) -> list[str]:
    """The plan's rank of every layer, one line per block group, members in index order: "ranks:
    layers.*.fc ×4: 40, 72, 88, 104", "head: 48"; a group of one rank "layers.*.up ×4: 8"; "dense" where the plan
    leaves a member dense. Groups the plan does not touch are left out."""
    from .parts.calibration import plan_ranks

    ranks = plan_ranks(audit)
    parts = []
    for g in groups:
        names = sorted((r.name for r in g.members), key=_index_key)
        if not any(n in ranks for n in names):
            continue
        vals = [f"{ranks[n]:,}" if n in ranks else "dense" for n in names]
        shown = vals[0] if len(set(vals)) == 1 else ", ".join(vals)
        parts.append(f"{term(g.label)}{f' ×{g.size}' if g.is_group else ''}: {shown}")
    return ["ranks: " + "; ".join(parts)] if parts else []


WIDE_PROSE = 100  # a wide table's (width 0) prose still wraps here


@dataclass
class _Lines:
    """The table's lines as they are written: prose wrapped at ``width``, tables fitted to ``table_width``."""

    width: int
    table_width: int
    out: list[str] = field(default_factory=list)

    def say(self, text: str, indent: str = "") -> None:
        self.out.extend(textwrap.wrap(text, self.width, subsequent_indent=indent, break_on_hyphens=False) or [""])


def _head(audit: "AuditResult", w: _Lines) -> None:
    """The model, how it was traced, its parameters and MACs, the notes."""
    w.say(f"lowrank-audit: {term(audit.model_name)}  ({term(audit.source)})")
    w.say(term(trace_sentence(audit)))
    macs = audit.total_macs
    w.say(f"parameters {audit.total_params:,} unique; factorizable {audit.factorizable_params:,} "
          f"in {len(audit.layers)} layers; rest {audit.rest_params:,} ({100 * audit.rest_share:.1f}%)"
          + (f"; MACs {macs:,} per forward on {audit.inputs}" if macs is not None else "; MACs: no inputs"))
    k = audit.layers_holding(0.8)
    if k:
        w.say(f"{k} of {len(audit.layers)} layers hold 80% of the parameters")
    for note in audit.notes:
        w.say(f"note: {term(note)}", "      ")


def _layers(audit: "AuditResult", w: _Lines, top: int) -> list[GroupRow]:
    """The layer table (block groups, the first ``top``) and its legend lines; returns every group."""
    table = layer_table(audit)
    groups = group_rows(audit, table)
    rows = groups[:top]
    labels = [c.label for c in table.columns]
    target = next((c.label for c in table.columns if abs(c.target - audit.settings.target_energy) < 1e-12), "")
    fitted = fit(_columns(labels, table.planned), rows, w.table_width, layer_steps(labels, target))
    w.out += fitted.lines(rows)
    if len(groups) > top:
        w.say(f"... {len(groups) - top} more groups (see --format json/html)")
    grouped = sum(g.is_group for g in groups)
    if grouped:
        w.say(f"{grouped} groups of repeated blocks: * stands for the index, ×N for the members (each member is "
              "listed in the JSON and HTML reports)", "  ")
    if any(r.tied for r in table.rows):
        w.say("* tied or shared weight: counted once; every use listed in the JSON and HTML reports", "  ")
    for line in _legend(fitted, rows, w.width):
        w.say(line, "  ")
    if fitted.has("x"):
        w.say("x = compression m*n / (r*(m+n)) at the " + ("planned" if table.planned else "suggested")
              + " rank; above 1 saves parameters", "  ")
    return groups


def _plan(audit: "AuditResult", w: _Lines, groups: list[GroupRow]) -> None:
    """The plan's savings, its ranks per group, the items that save nothing."""
    rv = audit.review
    if not spectra_computed(audit):
        w.say("spectra were not computed: no rank is suggested (drop --no-spectra, or load real weights)")
    elif rv is not None and rv.items:
        what = "suggested plan" if rv.suggested else f"plan {term(rv.source)}"
        n = factorized_count(audit)
        count = f"{n} layers" if n == len(rv.items) else f"{n} of {len(rv.items)} planned layers factorized"
        w.say(f"{what}: {count}, {rv.params_before:,} -> {rv.params_after:,} params; model "
              f"{audit.total_params:,} -> {rv.model_params_after:,} ({100 * rv.share_saved:.1f}% saved)"
              + (f"; MACs {rv.macs_before:,} -> {rv.macs_after:,}" if rv.macs_before is not None else ""), "  ")
        for line in plan_rank_lines(audit, groups):
            w.say(line, "      ")
        for p in plan_rows(audit):
            if p.flag:
                w.say(f"  ! {term(p.layer)} r={p.rank:,}: {p.params_before:,} -> {p.params_after:,} "
                      f"(x {p.compression:.2f}); {p.flag}", "      ")
        if rv.suggested and audit.calibration is None:  # a calibrated audit says it in its own section
            w.say(calibration.suggested_plan_note(audit), "  ")
    elif rv is not None:
        w.say(empty_plan_words(audit) if rv.suggested else "the plan factorizes nothing")


def calibration_lines(cv: "CalibrationView") -> list[str]:
    """The calibration's prose (unwrapped): the search, the plan measured all at once, rounding, the data and the
    basis, warnings, the fine-tune note."""
    out = list(cv.budget)
    if cv.plan:
        out.append(cv.plan)
    if cv.rounding:
        out.append(cv.rounding)
    out += [cv.summary, cv.basis]
    if cv.fallback:
        out.append(f"sensitivity fallback: {cv.fallback}")
    out += [f"warning: {w}" for w in cv.cal.warnings]
    out.append(calibration.FINETUNE)
    return [term(x) for x in out]  # messages may quote layer names


def _calibration(audit: "AuditResult", w: _Lines) -> None:
    """The calibration's prose, then its per-layer table (the plan's rank first, then the evidence)."""
    cv = calibration.view(audit)
    if cv is None:
        return
    w.out.append("")
    for line in calibration_lines(cv):
        w.say(line, "  ")
    if cv.frontier:
        w.say(calibration.frontier_title(cv.cal) + ":", "  ")
        w.out += fit(_plan_columns(cv.cal), cv.frontier, w.table_width, PLAN_STEPS, name_floor=9).lines(cv.frontier)
    _bits(cv, w)
    if cv.rows:
        w.say("Per layer: plan = the plan's rank (measured all at once, \"dense\": the plan keeps the layer); "
              "evidence, not the plan: r@1%, r@5%, tier-1 = the tier-1 ranks for 1%, 5% and the tolerance, floor = "
              "the measured floor (tier 2); > b-e: only a rank past break-even meets it alone", "  ")
        empty = calibration.empty_columns(cv.rows)
        cols = [c for c in _cal_columns() if c.key not in empty]
        steps = [st for st in CAL_STEPS if st[1] not in empty]
        w.out += fit(cols, cv.rows, w.table_width, steps, name_floor=12).lines(cv.rows)


def _bits(cv: "CalibrationView", w: _Lines) -> None:
    """Rank or bits (--budget-bytes): the prose, then the plans measured at each size and the baselines, in
    aligned columns, each plan's choices below it."""
    from .parts import rank_or_bits as bits

    intro = bits.intro(cv.cal)
    if intro is None:
        return
    w.out.append("")
    w.say(term(intro), "  ")
    rows = bits.rows(cv.cal)
    table = [bits.HEADERS[1:-1]] + [(r.plan, r.nbytes, r.bits, r.value, r.interval, r.holds) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    line = lambda row: "  ".join(c.ljust(wd) for c, wd in zip(row, widths)).rstrip()  # noqa: E731
    w.say("    " + term(line(table[0])), "    ")
    size = None
    for r, row in zip(rows, table[1:]):
        if r.size != size:
            w.say("  " + r.size + ":", "    ")
            size = r.size
        w.say("    " + term(line(row)), "      ")
        if r.choices:
            w.say("      " + term(r.choices), "      ")


def _findings(audit: "AuditResult", w: _Lines) -> None:
    """Each finding with its fix and where it is (path:line, the form editors and terminals open)."""
    if not audit.findings:
        return
    from .sarif import Locator, _relative_path

    w.out.append("")
    locate = Locator(audit)
    for f in audit.findings:
        w.say(f"{f.severity.value:<7} {f.code} {term(f.message)}", " " * 14)
        if f.fix:
            w.say(f"{'':14}fix: {term(f.fix)}", " " * 19)
        where = locate.where(f)
        if where is not None:
            w.say(f"{'':14}at {term(_relative_path(where.path))}:{max(1, where.line)}", " " * 17)


def _baseline(audit: "AuditResult", context: RenderContext, w: _Lines, top: int) -> None:
    """What changed since the baseline: findings, layers, planned ranks (the first ``top``)."""
    d = context.baseline
    if d is None:
        return
    w.out.append("")
    w.say(f"since the baseline: {len(d.new_findings)} new finding(s), {len(d.fixed_findings)} fixed; parameters "
          f"saved {d.saved_before:,} -> {d.saved_after:,} ({d.saved_delta:+,})")
    for f in d.new_findings:
        w.say(f"  new   {f['code']} {term(f['message'])}", " " * 14)
    for f in d.fixed_findings:
        w.say(f"  fixed {f['code']} {term(f['message'])}", " " * 14)
    if d.layers_added or d.layers_removed:
        w.say(f"  layers added: {', '.join(map(term, d.layers_added)) or 'none'}; removed: "
              f"{', '.join(map(term, d.layers_removed)) or 'none'}", "    ")
    changes = rank_changes(audit, context.baseline_report)
    for c in changes[:top]:
        w.say(f"  rank  {term(c.layer)}: {c.text().replace('→', '->')}", "        ")
    if len(changes) > top:
        w.say(f"  ... {len(changes) - top} more rank changes")


def render(audit: "AuditResult", context: RenderContext = RenderContext(), top: int = 40) -> str:
    """The table at ``context.width`` columns; width 0 is wide (the .txt report, a CI log, a pipe): every column
    kept and every name whole, whatever the line's length, the prose wrapped at :data:`WIDE_PROSE`."""
    wide = context.width <= 0
    width = WIDE_PROSE if wide else max(MIN_WIDTH, context.width)
    w = _Lines(width, 1 << 20 if wide else width)
    _head(audit, w)
    w.out.append("")
    groups = _layers(audit, w, top)
    w.out.append("")
    _plan(audit, w, groups)
    _calibration(audit, w)
    if audit.speed is not None:  # only when the speed was measured (--measure-speed)
        w.out.append("")
        w.out += speed.terminal(audit)
    _findings(audit, w)
    _baseline(audit, context, w, top)
    w.out.append("")
    w.say(term(verdict_line(audit)))
    return "\n".join(map(term, w.out)) + "\n"  # the choke point: whatever a section forgot, one line stays one


ANSI = {"PASS": "32", "UNMEASURED": "35", "REVIEW": "33", "FAIL": "31", "error": "31", "warning": "33", "info": "36"}


def colour(text: str) -> str:
    r"""The table with ANSI colour for a terminal: the verdict's word (PASS green, UNMEASURED magenta, REVIEW yellow,
    FAIL red) and each finding's severity. The caller decides (a terminal, and ``NO_COLOR`` unset).

    >>> colour("error   LR001 x\nFAIL: 1 error(s)\n")
    '\x1b[31merror\x1b[0m   LR001 x\n\x1b[1;31mFAIL\x1b[0m: 1 error(s)\n'
    """
    text = re.sub(r"(?m)^(error|warning|info)(?= +LR)", lambda m: f"\x1b[{ANSI[m.group(1)]}m{m.group(1)}\x1b[0m", text)
    return re.sub(r"(?m)^(PASS|UNMEASURED|REVIEW|FAIL)(?=:)", lambda m: f"\x1b[1;{ANSI[m.group(1)]}m{m.group(1)}\x1b[0m",
                  text)


def use_colour(stream: Any) -> bool:
    """Colour only on a terminal, and never with ``NO_COLOR`` set (https://no-color.org)."""
    import os

    try:
        return bool(stream.isatty()) and not os.environ.get("NO_COLOR")
    except (AttributeError, ValueError):
        return False


class TextReporter:
    name = "text"
    suffix = ".txt"
    binary = False
    stdout = Stdout.TABLE

    def render(self, audit: "AuditResult", context: RenderContext) -> str:
        return render(audit, context)
