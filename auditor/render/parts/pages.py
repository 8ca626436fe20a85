"""View models for block groups, the plan as shown per layer, the baseline's rank changes, and the per-layer pages.

* :func:`group_rows`: the layer table grouped by block (``model.layers.*.mlp.down_proj`` x 32), each group with
  its member rows (:mod:`auditor.planning.groups` decides the grouping).
* :func:`plan_rows`: each plan item with the parameter count it would really have after factorizing (an item
  above break-even shows its larger after-count and a flag, never ``before -> before`` next to ``x 0.85``).
* :func:`rank_changes`: per-layer rank changes against an earlier JSON report.
* :func:`layer_pages`: one page per group and per layer: singular values (log-log), energy against a log rank axis,
  break-even, suggested and planned rank, and ``measured`` (rank, metric) points once calibration provides them.
  The charts are matplotlib SVG (:func:`auditor.render.parts.layer_charts.page_chart`), the same in the HTML and the PDF.
  matplotlib takes a good part of a second per chart, so only the pages of the table's rows (a group, or a layer in
  no group) get one, the :data:`CHART_PAGES` largest; a member's page points to its group's chart, which draws it.

Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ...planning.groups import Members, group_layers
from .layer_charts import MAX_CURVES
from .view import LayerRow, LayerTable, anchors, verdict_summary as _verdicts

if TYPE_CHECKING:
    from ...results import AuditResult

__all__ = ["GroupRow", "LayerPage", "PlanRow", "RankChange", "group_rows", "layer_pages", "plan_rows", "rank_changes",
           "summary_of"]

CHART_PAGES = 40  # pages with a chart: the largest groups and ungrouped layers (see the module's docstring)


def summary_of(values: Sequence[int | None]) -> str:
    """Members' ranks in one cell: the common value, or min–max, ``–`` when none has one.

    >>> summary_of([64, 64]), summary_of([32, None, 64]), summary_of([None])
    ('64', '32–64', '–')
    """
    vs = [v for v in values if v is not None]
    if not vs:
        return "–"
    lo, hi = min(vs), max(vs)
    return f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"


@dataclass(frozen=True)
class GroupRow(Members):
    """A block group in the layer table: one line for all members, the members themselves as detail."""

    label: str  # "model.layers.*.mlp.down_proj"
    pattern: str  # the plan glob
    anchor: str
    members: list[LayerRow]
    params: int
    share: float
    cumulative: float
    shape: str  # "4096x11008", or "mixed"
    break_even: float | None  # None when the members' shapes differ
    ranks: tuple[str, ...]  # per rank column, summarised over members
    suggested: str
    planned: str
    verdict: str  # "factorize", or "factorize 30 · keep dense 2"
    macs: int | None
    compression: float | None = None  # m·n / (r·(m+n)) at the shown rank, when every member has it

    @property
    def shown_rank(self) -> str:
        return self.planned if self.planned != "–" else self.suggested


def _planned(rows: Sequence[LayerRow]) -> str:
    """The planned ranks of a group's members: "8", "16–32", or "30 (1/4)" when the plan names only some."""
    k = sum(r.planned is not None for r in rows)
    text = summary_of([r.planned for r in rows])
    return text if k in (0, len(rows)) else f"{text} ({k}/{len(rows)})"


def group_rows(audit: "AuditResult", table: LayerTable) -> list[GroupRow]:
    """The table's rows grouped by block, largest group first."""
    by_name = {r.name: r for r in table.rows}
    groups = group_layers(audit.layers, audit.total_params)
    ids = anchors([g.label for g in groups], prefix="group-")
    out: list[GroupRow] = []
    acc = 0.0
    for g in groups:
        rows = [by_name[n] for n in g.members]
        acc += g.share
        first = rows[0]
        same = g.same_shape and len({(r.m, r.n, r.groups) for r in rows}) == 1
        macs = None if any(r.macs is None for r in rows) else sum(r.macs or 0 for r in rows)
        shown = _common([r.planned if table.planned else r.suggested for r in rows])
        comp = (first.m * first.n / (shown * (first.m + first.n)) if same and shown
                else _group_compression(rows, table.planned))
        out.append(GroupRow(
            label=g.label, pattern=g.pattern, anchor=ids[g.label] if g.is_group else first.anchor, members=rows,
            params=g.params, share=g.share, cumulative=acc, shape=first.shape if same else "mixed",
            break_even=first.break_even if same else None,
            ranks=tuple(summary_of([r.ranks[i] for r in rows]) for i in range(len(table.columns))),
            suggested=summary_of([r.suggested for r in rows]), planned=_planned(rows),
            verdict=_verdicts(rows), macs=macs, compression=comp,
        ))
    return out


# ---- the plan per layer ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanRow:
    """One plan item as the reports show it. ``params_after`` is what the factorized layer would hold
    (r·(m+n) per group) even where the plan keeps the layer dense for want of a saving; ``flag`` says why."""

    layer: str
    anchor: str
    rank: int
    suggested: int | None
    break_even: float
    params_before: int
    params_after: int
    saves: bool
    flag: str  # "" when the item saves parameters
    compression: float
    energy_kept: float | None
    error_bound: float | None
    macs_after: int | None
    verdict: str
    measured: str = ""  # the measured error at this rank where calibration reached the layer ("" where not)
    measured_error: Any = None  # that number (:class:`auditor.render.parts.calibration.MeasuredError`), or None


def plan_rows(audit: "AuditResult") -> list[PlanRow]:
    """The reviewed (or suggested) plan per item; ``measured`` where calibration measured the layer (its measured
    error comes before the data-free energy numbers in every report)."""
    from .calibration import measured_error

    rv = audit.review
    if rv is None:
        return []
    ids = anchors([l.name for l in audit.layers])
    out = []
    for it in rv.items:
        layer = audit.layer(it.layer)
        sg = audit.suggestions.get(it.layer)
        after = layer.params_at(it.rank)
        saves = after < layer.params and it.rank <= layer.max_rank
        if it.rank > layer.max_rank:
            flag = f"rank {it.rank:,} is above min(m, n) = {layer.max_rank:,}: kept dense"
        elif not saves:
            flag = f"above break-even {layer.break_even:,.1f}: A·B would hold {after - layer.params:+,} more; kept dense"
        else:
            flag = ""
        me = measured_error(audit.calibration, it.layer, it.rank)
        out.append(PlanRow(it.layer, ids.get(it.layer, ""), it.rank, sg.rank if sg else None, it.break_even,
                           it.params_before, after, saves, flag, it.compression, it.energy_kept, it.error_bound,
                           it.macs_after, str(it.verdict), me.text(audit.calibration) if me else "", me))
    return out


# ---- baseline: per-layer rank changes -------------------------------------------------------------------------
@dataclass(frozen=True)
class RankChange:
    """A layer whose planned rank differs from the baseline's (None: dense, or absent from that report)."""

    layer: str
    before: int | None
    after: int | None
    present_before: bool = True
    present_after: bool = True

    def text(self, dense: str = "dense") -> str:
        def word(r: int | None, present: bool) -> str:
            return "absent" if not present else (dense if r is None else f"{r:,}")

        return f"{word(self.before, self.present_before)} → {word(self.after, self.present_after)}"


def rank_changes(audit: "AuditResult", base: dict[str, Any] | None) -> list[RankChange]:
    """Each layer whose reviewed-plan rank changed since ``base`` (a JSON report, as :func:`auditor.verdict.baseline.load`
    reads it), in the current audit's layer order, then the layers only the baseline had."""
    if not base:
        return []
    items = ((base.get("plan_review") or {}).get("items")) or []
    before = {str(i["layer"]): int(i["rank"]) for i in items if "layer" in i and "rank" in i}
    names_before = {str(l["name"]) for l in base.get("layers", []) if "name" in l}
    after = {it.layer: it.rank for it in audit.review.items} if audit.review else {}
    names_now = [l.name for l in audit.layers]
    out = []
    for n in names_now:
        was, now = before.get(n), after.get(n)
        if n not in names_before:
            if now is not None:
                out.append(RankChange(n, None, now, present_before=False))
        elif was != now:
            out.append(RankChange(n, was, now))
    now_set = set(names_now)
    for n in sorted(names_before - now_set):
        if n in before:
            out.append(RankChange(n, before[n], None, present_after=False))
    return out


# ---- layer pages ----------------------------------------------------------------------------------------------
@dataclass
class LayerPage:
    """One layer's (or one group's) own section of the HTML report.

    ``measured``: (rank, metric) points from calibration, one series per layer (a group's: its members'); None
    without them. ``chart``: the page's chart as a ``data:`` URI, "" when the page has none; ``chart_at``: then the
    (anchor, title) of the group page whose chart draws this layer, if any.
    """

    anchor: str
    title: str
    is_group: bool
    members: list[str]
    shape: str
    params: int
    share: float
    break_even: float | None
    suggested: int | None
    planned: int | None
    target: float
    verdict: str
    reason: str
    stable_rank: float | None
    effective_rank: float | None
    energy_at_rank: float | None
    measured: list[list[tuple[int, float]]] | None = None
    chart: str = ""
    chart_at: tuple[str, str] | None = None


def _sigma_rows(audit: "AuditResult", name: str) -> list[np.ndarray]:
    sp = audit.spectra.get(name)
    if sp is None or sp.sigma is None:
        return []
    return [np.asarray(g, dtype=np.float64) for g in sp.sigma]


def _energy(audit: "AuditResult", name: str) -> list[np.ndarray]:
    sp = audit.spectra.get(name)
    if sp is None or not sp.energy:
        return []
    return [np.asarray(sp.energy, dtype=np.float64)]


def _group_compression(rows: Sequence[Any], planned: bool) -> float | None:
    """A group's compression where its members' ranks differ: the parameters of the members given a rank over
    what their factors hold, sum(m n) / sum(r (m + n)) (dense members left out); None when no member has a rank."""
    ranked = [(r, r.planned if planned else r.suggested) for r in rows]
    ranked = [(r, k) for r, k in ranked if k]
    if not ranked:
        return None
    return sum(r.m * r.n * r.groups for r, _ in ranked) / sum(k * (r.m + r.n) * r.groups for r, k in ranked)


def _common(values: Sequence[Any]) -> Any:
    return values[0] if values and all(v == values[0] for v in values) else None


def page_legend(pages: Sequence[LayerPage]) -> list[tuple[str, str]]:
    """The one legend of the pages' charts: (kind, label) for each kind of line some charted page draws."""
    charted = [p for p in pages if p.chart]
    if not charted:
        return []
    out = [("curve", "a layer (each member of a group)")]
    if any(p.is_group and len(p.members) > MAX_CURVES for p in charted):
        out += [("median", "median of the members"), ("band", "min–max of the members")]
    out += [("break-even", "break-even rank")]
    if any(p.suggested for p in charted):
        out.append(("suggested", "suggested rank"))
    if any(p.planned for p in charted):
        out.append(("planned", "planned rank"))
    if any(p.target for p in charted):
        out.append(("target", "target energy"))
    if any(p.measured for p in charted):
        out.append(("measured", "measured error, the layer alone truncated"))
        if all(p.target is None for p in charted):  # a calibrated audit's pages draw the tolerance instead
            out.append(("tolerance", "tolerance"))
    return out


@dataclass(frozen=True)
class _Measured:
    """What the pages' third panels share: (rank, metric) points per layer name (or group label), the metric's
    label, the tolerance they are judged against and the panel's title (None: the default)."""

    points: dict[str, list[tuple[int, float]]]
    metric: str
    tolerance: float | None
    title: str | None

    def series(self, key: str, names: list[str]) -> list[list[tuple[int, float]]]:
        """A page's series: the group's own points under ``key``, else each member's."""
        m = self.points
        return [m[key]] if m.get(key) else [m[n] for n in names if m.get(n)]

    def panel(self, series: list[list[tuple[int, float]]] | None) -> Any:
        from .layer_charts import MeasuredPanel

        if not series:
            return None
        return MeasuredPanel(series, self.metric, self.tolerance, self.title or MeasuredPanel.title)


def _measured_of(audit: "AuditResult", measured: dict[str, list[tuple[int, float]]] | None) -> _Measured:
    """The points the pages draw: ``measured`` when given, else the calibration's measured floors (tier 2: the
    model's metric, judged against the tolerance), else its tier-1 layer-output error curves."""
    from .calibration import measured_points

    cal = audit.calibration
    tolerance: float | None = None
    title: str | None = None
    if measured is None:
        measured = measured_points(audit) or {}
        if cal is not None and measured:  # tier 2: the model's metric, judged against the tolerance
            tolerance = cal.limit
        elif cal is not None:  # tier 1: the layer-output error curve the ranks were searched over
            measured = {k: [(r, e) for r, e in lc.curve] for k, lc in cal.layers.items() if lc.curve}
            tolerance = cal.tier1_target
            title = "layer-output error (tier 1), the layer alone"
    metric = ("layer-output error" if title else cal.metric) if cal is not None else "measured metric"
    return _Measured(measured, metric, tolerance, title)


def _page(anchor: str, title: str, rows: list[LayerRow], is_group: bool,
          series: list[list[tuple[int, float]]], target: float | None) -> LayerPage:
    """One page: the members' common shape and ranks, their summed parameters, median spectral statistics."""
    names = [r.name for r in rows]
    sr = [r.stable_rank for r in rows if r.stable_rank is not None]
    er = [r.effective_rank for r in rows if r.effective_rank is not None]
    ea = [r.energy_at_rank for r in rows if r.energy_at_rank is not None]
    return LayerPage(anchor, title, is_group, names, _common([r.shape for r in rows]) or "mixed",
                     sum(r.params for r in rows), sum(r.share for r in rows), _common([r.break_even for r in rows]),
                     _common([r.suggested for r in rows]), _common([r.planned for r in rows]), target,
                     _verdicts(rows), rows[0].reason if not is_group else "",
                     float(np.median(sr)) if sr else None, float(np.median(er)) if er else None,
                     float(np.median(ea)) if ea else None, series or None)


def _draw(audit: "AuditResult", p: LayerPage, measured: _Measured) -> None:
    """The page's chart (:func:`auditor.render.parts.layer_charts.page_chart`) as a ``data:`` URI."""
    from .layer_charts import Marks, data_uri, page_chart

    marks, panel = Marks(p.break_even, p.suggested, p.planned, p.target), measured.panel(p.measured)
    drawn = audit.__dict__.setdefault("_page_charts", {})  # the HTML's and the PDF's pages share their charts
    key = (tuple(p.members), repr(marks), repr(panel))
    if key not in drawn:
        sig = [s for n in p.members for s in _sigma_rows(audit, n)]
        en = [e for n in p.members for e in _energy(audit, n)]
        drawn[key] = page_chart(sig, en, marks, panel)
    p.chart = data_uri(drawn[key]) if drawn[key] else ""


def _chart_pages(audit: "AuditResult", groups: list[GroupRow], group_pages: list[LayerPage],
                 layer_pages_: list[LayerPage], measured: _Measured) -> None:
    """Charts for the table's rows first (each group, each layer in no group), largest first, then the groups'
    members while fewer than :data:`CHART_PAGES` pages have one; a member without one points to its group's."""
    by_anchor = {p.anchor: p for p in group_pages + layer_pages_}
    rows_first = [by_anchor[g.anchor] for g in groups]  # a group's page, or a layer in no group's
    shown = {id(p) for p in rows_first}
    members = [p for p in layer_pages_ if id(p) not in shown]
    for p in (rows_first + members)[:CHART_PAGES]:
        _draw(audit, p, measured)
    of_group = {m: (g.anchor, g.label) for g in groups if g.is_group for m in (r.name for r in g.members)}
    for p in layer_pages_:
        if not p.chart and p.title in of_group and by_anchor[of_group[p.title][0]].chart:
            p.chart_at = of_group[p.title]


def layer_pages(audit: "AuditResult", table: LayerTable, groups: list[GroupRow], *, charts: bool = True,
                measured: dict[str, list[tuple[int, float]]] | None = None,
                only: set[str] | None = None) -> list[LayerPage]:
    """A page per group of two or more (first, largest first), then a page per layer (largest first);
    ``only``: just the pages with these anchors (the PDF's top groups), in group order. ``measured``: (rank, metric)
    points per layer name (or group label); default: the calibration's measured floors.

    Charts (``charts``): the table's rows first (each group, each layer in no group), largest first, then the
    groups' members while fewer than :data:`CHART_PAGES` pages have one."""
    meas = _measured_of(audit, measured)
    target = audit.settings.target_energy if audit.calibration is None else None  # with calibration, energy chose no rank

    def page(anchor: str, title: str, rows: list[LayerRow], is_group: bool, key: str) -> LayerPage:
        return _page(anchor, title, rows, is_group, meas.series(key, [r.name for r in rows]), target)

    if only is not None:
        pages = [page(g.anchor, g.label, g.members, g.is_group, g.label if g.is_group else g.members[0].name)
                 for g in groups if g.anchor in only]
        for p in pages if charts else []:
            _draw(audit, p, meas)
        return pages
    group_pages = [page(g.anchor, g.label, g.members, True, g.label) for g in groups if g.is_group]
    layer_pages_ = [page(r.anchor, r.name, [r], False, r.name) for r in table.rows]
    if charts:
        _chart_pages(audit, groups, group_pages, layer_pages_, meas)
    return group_pages + layer_pages_


APPENDIX_NAME_WIDTH = 44  # the name column of the PDF's appendix; a longer name takes a line of its own


def appendix_text(rows: Sequence[LayerRow], labels: Sequence[str], planned: bool,
                  name: Any = lambda s: s) -> str:
    """The PDF's appendix as monospaced lines, one per layer (a header first): one text block lays out several
    times faster in WeasyPrint than a table of the same rows. ``name`` shortens a name for print; a name wider than
    the name column is printed on a line of its own, its figures on the next."""
    names = [name(r.name) for r in rows]
    w = max([5, *(min(len(n), APPENDIX_NAME_WIDTH) for n in names)])

    def dash(x: Any) -> str:
        return "–" if x is None else f"{x:,}" if isinstance(x, int) else str(x)

    head = (f"{'#':>5} {'layer':<{w}} {'m × n':>11} {'params':>11} {'share':>7} {'b-even':>7} "
            + " ".join(f"{c:>6}" for c in labels) + (f" {'plan':>6} {'sugg':>6}" if planned else f" {'rank':>6}") + " verdict")
    out = [head, "─" * len(head)]
    for r, n in zip(rows, names):
        figures = (f"{r.shape:>11} {r.params:>11,} {100 * r.share:6.2f}% {r.break_even:7.1f} "
                   + " ".join(f"{dash(x):>6}" for x in r.ranks)
                   + (f" {'dense' if r.planned is None else dash(r.planned):>6}" if planned else "")
                   + f" {dash(r.suggested):>6} {r.verdict}")
        if len(n) > w:
            out.append(f"{r.rank_order:>5} {n}")
            out.append(f"{'':>5} {'':<{w}} {figures}")
        else:
            out.append(f"{r.rank_order:>5} {n:<{w}} {figures}")
    return "\n".join(out)
