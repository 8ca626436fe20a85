"""View models for block groups, the plan as shown per layer, the baseline's rank changes, and the per-layer pages.

* :func:`group_rows`: the layer table grouped by block (``model.layers.*.mlp.down_proj`` x 32), each group with
  its member rows (:mod:`auditor.groups` decides the grouping).
* :func:`plan_rows`: each plan item with the parameter count it would really have after factorizing (an item
  above break-even shows its larger after-count and a flag, never ``before -> before`` next to ``x 0.85``).
* :func:`rank_changes`: per-layer rank changes against an earlier JSON report.
* :func:`layer_pages`: one page per group and per layer: singular values (log-log), energy against a log rank axis,
  break-even, suggested and planned rank, and ``measured`` (rank, metric) points once calibration provides them.
  Its charts are :class:`SvgChart` coordinates that the template draws as inline SVG, in the HTML and the PDF
  alike: a page for each of 1,000 layers costs milliseconds this way (matplotlib takes about half a second per
  chart).

Nothing here imports torch.
"""

from __future__ import annotations

import math
from functools import lru_cache
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..groups import Members, group_layers
from .view import LayerRow, LayerTable, anchors

if TYPE_CHECKING:
    from ..results import Audit

__all__ = ["GroupRow", "LayerPage", "PlanRow", "RankChange", "SvgChart", "group_rows", "layer_pages", "plan_rows",
           "rank_changes", "summary_of"]


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


def _verdicts(rows: Sequence[LayerRow]) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.verdict or "–"] = counts.get(r.verdict or "–", 0) + 1
    if len(counts) == 1:
        return next(iter(counts))
    return " · ".join(f"{v} {c}" for v, c in counts.items())


def _planned(rows: Sequence[LayerRow]) -> str:
    """The planned ranks of a group's members: "8", "16–32", or "30 (1/4)" when the plan names only some."""
    k = sum(r.planned is not None for r in rows)
    text = summary_of([r.planned for r in rows])
    return text if k in (0, len(rows)) else f"{text} ({k}/{len(rows)})"


def group_rows(audit: "Audit", table: LayerTable) -> list[GroupRow]:
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
        comp = first.m * first.n / (shown * (first.m + first.n)) if same and shown else None
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


def plan_rows(audit: "Audit") -> list[PlanRow]:
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
        out.append(PlanRow(it.layer, ids.get(it.layer, ""), it.rank, sg.rank if sg else None, it.break_even,
                           it.params_before, after, saves, flag, it.compression, it.energy_kept, it.error_bound,
                           it.macs_after, str(it.verdict)))
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


def rank_changes(audit: "Audit", base: dict[str, Any] | None) -> list[RankChange]:
    """Each layer whose reviewed-plan rank changed since ``base`` (a JSON report, as :func:`auditor.baseline.load`
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


# ---- charts as coordinates ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Line:
    points: str  # "x,y x,y ..." in the chart's pixel space
    cls: str
    label: str = ""


@dataclass(frozen=True)
class Mark:
    pos: float  # pixel x (vertical marks) or y (horizontal marks)
    cls: str
    label: str


@dataclass(frozen=True)
class Dot:
    x: float
    y: float
    cls: str
    label: str


@dataclass(frozen=True)
class SvgChart:
    """A small chart as coordinates for the template's inline SVG (``templates/chart.html``)."""

    title: str
    x_label: str
    y_label: str
    width: int
    height: int
    left: int
    top: int
    right: int  # x of the plot box's right edge
    bottom: int  # y of its bottom edge
    xticks: list[tuple[float, str]]
    yticks: list[tuple[float, str]]
    lines: list[Line]
    band: str = ""  # polygon points of a min-max band
    vmarks: list[Mark] = field(default_factory=list)
    hmarks: list[Mark] = field(default_factory=list)
    dots: list[Dot] = field(default_factory=list)


W, H, L, T, R, B = 420, 230, 52, 14, 410, 190
SPLIT_SHARE = 0.55  # of an energy chart's height, for E between the split (0.9, or a lower target) and 1
POINTS = 64  # points per curve, spread evenly on the log rank axis


@lru_cache(maxsize=256)
def _ranks(k: int) -> np.ndarray:
    return np.unique(np.round(np.logspace(0, math.log10(max(k, 1)), POINTS)).astype(int))


def _log_ticks(lo: float, hi: float) -> list[float]:
    """Decade ticks between 10**lo and 10**hi (with 2 and 5 when the span is under two decades)."""
    out = []
    for e in range(math.floor(lo), math.ceil(hi) + 1):
        for m in ((1, 2, 5) if hi - lo < 2 else (1,)):
            v = m * 10.0 ** e
            if lo - 1e-9 <= math.log10(v) <= hi + 1e-9:
                out.append(v)
    return out


def _fmt_tick(v: float) -> str:
    if v >= 1:
        return f"{int(round(v)):,}"
    e = int(round(math.log10(v)))
    return f"1e{e}" if abs(v - 10.0 ** e) < 1e-12 * 10.0 ** e else f"{v:g}"


class _Axes:
    def __init__(self, k: int, marks: Sequence[float | None], y_lo: float, y_hi: float, y_log: bool,
                 right: int = R, split: float | None = None) -> None:
        self.x_hi = math.log10(max([k, *(m for m in marks if m)]) * 1.15)
        self.right = right
        self.y_lo, self.y_hi, self.y_log = y_lo, y_hi, y_log
        self.split = split  # a linear axis whose top (split..y_hi) takes the upper SPLIT_SHARE of the height

    def x(self, r: float) -> float:
        return round(L + (self.right - L) * math.log10(max(r, 1)) / self.x_hi, 1) if self.x_hi > 0 else float(L)

    def y(self, v: float) -> float:
        t = (math.log10(v) if self.y_log else v)
        t = min(max(t, self.y_lo), self.y_hi)
        s = self.split
        if s is not None and self.y_lo < s < self.y_hi:  # two linear pieces meeting at the split
            f = (t - self.y_lo) / (s - self.y_lo) * (1 - SPLIT_SHARE) if t <= s else \
                (1 - SPLIT_SHARE) + (t - s) / (self.y_hi - s) * SPLIT_SHARE
        else:
            f = (t - self.y_lo) / (self.y_hi - self.y_lo)
        return round(B - (B - T) * f, 1)

    def xticks(self) -> list[tuple[float, str]]:
        return [(self.x(v), _fmt_tick(v)) for v in _log_ticks(0, self.x_hi) if v >= 1]


def _poly(ax: _Axes, xs: np.ndarray, ys: np.ndarray) -> str:
    return " ".join(f"{ax.x(float(x))},{ax.y(float(y))}" for x, y in zip(xs, ys) if math.isfinite(y))


def _rank_marks(ax: _Axes, be: float | None, sug: int | None, plan: int | None) -> list[Mark]:
    out = []
    if be:
        out.append(Mark(ax.x(be), "be", f"break-even {be:,.1f}"))
    if sug:
        out.append(Mark(ax.x(sug), "sug", f"suggested r={sug:,}"))
    if plan:
        out.append(Mark(ax.x(plan), "plan", f"planned r={plan:,}"))
    return out


def _curves(series: list[np.ndarray]) -> tuple[list[np.ndarray], tuple[np.ndarray, np.ndarray] | None]:
    """Up to 6 curves as they are; more as their median with a min-max band."""
    if len(series) <= 6:
        return series, None
    k = max(len(s) for s in series)
    stack = np.vstack([np.pad(s, (0, k - len(s)), constant_values=np.nan) for s in series])
    return [np.nanmedian(stack, 0)], (np.nanmin(stack, 0), np.nanmax(stack, 0))


def _band(ax: _Axes, band: tuple[np.ndarray, np.ndarray] | None, positive: bool) -> str:
    """The min-max band as polygon points: the maxima left to right, then the minima back (``positive``: only
    values above 0, for a log axis); "" without a band."""
    if band is None:
        return ""
    lo, hi = band
    idx = _ranks(len(lo)) - 1
    up = [(float(x), float(y)) for x, y in zip(idx + 1, hi[idx]) if not positive or y > 0]
    dn = [(float(x), float(y)) for x, y in zip(idx + 1, lo[idx]) if not positive or y > 0]
    return " ".join(f"{ax.x(x)},{ax.y(y)}" for x, y in up + dn[::-1])


def spectrum_svg(sigmas: list[np.ndarray], title: str, be: float | None, sug: int | None,
                 plan: int | None) -> SvgChart | None:
    norm = [s / s[0] for s in sigmas if len(s) and s[0] > 0]
    if not norm:
        return None
    curves, band = _curves(norm)
    k = max(len(s) for s in norm)
    positive = [float(np.min(s[s > 0])) for s in norm if np.any(s > 0)]
    y_lo = max(math.floor(math.log10(min(positive))) if positive else -1, -16)
    y_lo = min(y_lo, -1)
    ax = _Axes(k, [be, sug, plan], y_lo, 0.0, True)
    lines = []
    for i, c in enumerate(curves):
        idx = _ranks(len(c)) - 1
        ys = np.where(c[idx] > 0, c[idx], np.nan)
        lines.append(Line(_poly(ax, idx + 1, ys), f"c{i % 6}", "median" if band else ""))
    band_pts = _band(ax, band, positive=True)
    yt = [(ax.y(10.0 ** e), _fmt_tick(10.0 ** e)) for e in range(int(y_lo), 1, max(1, (-int(y_lo)) // 5 or 1))]
    return SvgChart(title, "index i (log)", "σᵢ / σ₁ (log)", W, H, L, T, R, B, ax.xticks(), yt, lines, band_pts,
                    _rank_marks(ax, be, sug, plan))


def energy_svg(energies: list[np.ndarray], title: str, be: float | None, sug: int | None, plan: int | None,
               target: float | None, measured: Sequence[tuple[int, float]] | None,
               labels: Sequence[str] | None = None, wide: bool = False) -> SvgChart | None:
    """E(r) against a log rank axis; ``labels`` name the curves in the legend (the overview of the largest
    groups); ``wide``: twice the width."""
    es = [e for e in energies if len(e)]
    if not es:
        return None
    curves, band = _curves(es)
    right, width = (2 * W - 10, 2 * W) if wide else (R, W)
    k = max(len(e) for e in es)
    split = min(0.9, target) if target and target > 0.5 else 0.9
    ax = _Axes(k, [be, sug, plan, *(r for r, _ in measured or [])], 0.0, 1.0, False, right, split=split)
    lines = []
    for i, c in enumerate(curves):
        idx = _ranks(len(c)) - 1
        name = labels[i] if labels and i < len(labels) else ("median" if band else "")
        lines.append(Line(_poly(ax, idx + 1, c[idx]), f"c{i % 6}", name))
    band_pts = _band(ax, band, positive=False)
    if measured:
        pts = sorted((int(r), float(v)) for r, v in measured if r > 0 and math.isfinite(v))
        lines.append(Line(" ".join(f"{ax.x(r)},{ax.y(v)}" for r, v in pts), "measured", "measured"))
    first = curves[0]
    dots = []
    for r, cls, name in ((sug, "sug", "suggested"), (plan, "plan", "planned")):
        if r:
            v = float(first[min(r, len(first)) - 1])
            dots.append(Dot(ax.x(r), ax.y(v), cls, f"{name} r={r:,}: E={v:.3f}"))
    hm = [Mark(ax.y(target), "target", f"target {target:g}")] if target else []
    upper = [split, round((1 + split) / 2, 4), 1.0]
    yt = [(ax.y(v), f"{v:g}") for v in sorted({0.0, 0.5, *upper})]
    return SvgChart(title, "rank r (log)", f"E(r), {split:g}–1 enlarged", width, H, L, T, right, B, ax.xticks(), yt, lines, band_pts,
                    _rank_marks(ax, be, sug, plan), hm, dots)


# ---- layer pages ----------------------------------------------------------------------------------------------
@dataclass
class LayerPage:
    """One layer's (or one group's) own section of the HTML report.

    ``measured``: (rank, metric) points from calibration for this layer or group; None until a calibration stage
    fills it in (:func:`layer_pages` takes them as ``measured={name or group label: points}``).
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
    measured: list[tuple[int, float]] | None = None
    spectrum: SvgChart | None = None
    energy: SvgChart | None = None


def _sigma_rows(audit: "Audit", name: str) -> list[np.ndarray]:
    sp = audit.spectra.get(name)
    if sp is None or sp.sigma is None:
        return []
    return [np.asarray(g, dtype=np.float64) for g in sp.sigma]


def _energy(audit: "Audit", name: str) -> list[np.ndarray]:
    sp = audit.spectra.get(name)
    if sp is None or not sp.energy:
        return []
    return [np.asarray(sp.energy, dtype=np.float64)]


def _common(values: Sequence[Any]) -> Any:
    return values[0] if values and all(v == values[0] for v in values) else None


def layer_pages(audit: "Audit", table: LayerTable, groups: list[GroupRow], *, charts: bool = True,
                measured: dict[str, list[tuple[int, float]]] | None = None,
                only: set[str] | None = None) -> list[LayerPage]:
    """A page per group of two or more (first, largest first), then a page per layer (largest first);
    ``only``: just the pages with these anchors (the PDF's top groups), in group order."""
    measured = measured or {}
    target = audit.settings.target_energy
    pages: list[LayerPage] = []

    def page(anchor: str, title: str, rows: list[LayerRow], is_group: bool, key: str) -> LayerPage:
        names = [r.name for r in rows]
        be = _common([r.break_even for r in rows])
        sug = _common([r.suggested for r in rows])
        plan = _common([r.planned for r in rows])
        sr = [r.stable_rank for r in rows if r.stable_rank is not None]
        er = [r.effective_rank for r in rows if r.effective_rank is not None]
        ea = [r.energy_at_rank for r in rows if r.energy_at_rank is not None]
        meas = measured.get(key)
        p = LayerPage(anchor, title, is_group, names, _common([r.shape for r in rows]) or "mixed",
                      sum(r.params for r in rows), sum(r.share for r in rows), be, sug, plan, target,
                      _verdicts(rows), rows[0].reason if not is_group else "",
                      float(np.median(sr)) if sr else None, float(np.median(er)) if er else None,
                      float(np.median(ea)) if ea else None, meas)
        if charts:
            sig = [s for n in names for s in _sigma_rows(audit, n)]
            en = [e for n in names for e in _energy(audit, n)]
            p.spectrum = spectrum_svg(sig, title, be, sug, plan)
            p.energy = energy_svg(en, title, be, sug, plan, target, meas)
        return p

    if only is not None:
        return [page(g.anchor, g.label, g.members, g.is_group, g.label if g.is_group else g.members[0].name)
                for g in groups if g.anchor in only]
    for g in groups:
        if g.is_group:
            pages.append(page(g.anchor, g.label, g.members, True, g.label))
    for r in table.rows:
        pages.append(page(r.anchor, r.name, [r], False, r.name))
    return pages


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
