"""Tier 3: ranks for a whole model from per-layer curves, checked all at once.

Each layer offers options (a rank below break-even: parameters saved, a cost) from its measured tier-2 points or its
tier-1 error curve; keeping it dense costs nothing and saves nothing. The cost is what the layers add up to: the
squared relative output error (single-layer errors combine roughly in quadrature) or a user metric's drop below the
dense value. A Lagrangian relaxation picks, for a price mu per parameter, the option minimising cost - mu * saved in
every layer; bisection on mu meets a removal target. The plan is then factorized and measured as a whole, since the
sum of single-layer costs underestimates the combined error near the cliff, and the target is backed off (or grown)
until the model-level metric holds. A frontier of 3-5 targets, each measured all at once, shows where the cliff is.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, TypedDict

from torch import nn

from ... import lrmath
from ..._env import trim_heap
from ...calresults import BudgetResult, FrontierPlan
from ...kinds.registry import SUPPORTED
from ...surgery import count_params
from ..apply import factorize, measured_copy
from ...results import Layer
from .. import metrics
from ..data.inputs import Calibration
from ..measure.metric import Metric, PlanMeasurer
from ..references import search_measurer
from ..session import CalibrationSession
from ..statistics.stats import InputStatistics, by_name
from .sweep import Floors
from ..statistics.whiten import TruncatorStore, WhitenedSpectrum

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ...options import RecoveryOptions
    from ..measure.metric import Evaluator
    from ..statistics.whiten import LossMetric
    from .fisher import GradientSensitivity


@dataclass
class Option:
    rank: int
    saved: int  # parameters removed at this rank
    cost: float


@dataclass
class Curves:
    """Per-layer options keyed by ``Layer.name``; ``source`` is "measured" (tier 2) or "tier1"."""

    options: dict[str, list[Option]]
    source: str
    linear: bool = False  # costs in the metric's own units, adding up as they are (gradient curves of a likelihood
    #                       metric: nats of cross-entropy); else squared values that add up in quadrature
    tied: dict[str, tuple[str, ...]] = field(default_factory=dict)  # an option key standing for a tie group (--tie,
    #                       tiers/tied.py) -> its members, which every plan gives the key's one rank

    def members(self, key: str) -> tuple[str, ...]:
        """The layers an option key plans: the key itself, or a tie group's members."""
        return self.tied.get(key, (key,))


def curves_from_floors(floors: Floors, layers: dict[str, Layer] | list[Layer],
                       spectra: dict[str, WhitenedSpectrum] | None = None, source: str = "measured") -> Curves:
    """Options from the tier-2 points: every measured rank below break-even, costed by its measured metric.

    With ``spectra`` (tier 1) and the default metric, the grid ranks the search did not visit are options too,
    costed by the layer's measured gain times its tier-1 layer-output error, (g(r) e(r))^2, where g is the ratio
    of measured to layer-output error at the measured ranks, interpolated (log-linear in rank) between them and held
    flat beyond. The guided search measures about 3 ranks per layer; without these the allocation could only pick
    among those (on the char transformer the budgeted plan removed 27% instead of 50% at the same tolerance).
    ``floors`` may also be sensitivity probes (:func:`~auditor.calibration.tiers.sweep.probe_sensitivity`, ``source``
    "probed"): two measured ranks a layer, the same gains between them."""
    named = by_name(layers)
    out: dict[str, list[Option]] = {}
    for name, f in floors.floors.items():
        layer = named.get(name)
        if layer is None:  # measured but not planned (tied, or a kind factorize cannot rewrite)
            continue
        measured = {r: v for r, v in f.points if lrmath.saves(layer.m, layer.n, r)}
        costs = {r: metric_cost(floors.kind, floors.higher_is_better, floors.reference, v)
                 for r, v in measured.items()}
        spec = spectra.get(name) if spectra else None
        if spec is not None and metrics.for_kind(floors.kind).zero_on_dense and _gains(f.points, spec):
            useful = lrmath.max_useful_rank(layer.m, layer.n)
            for r in range(floors.align, useful + 1, floors.align):
                if r not in costs:
                    costs[r] = single_layer_error(f.points, spec, r) ** 2
        opts = [Option(r, layer.params - layer.params_at(r), c) for r, c in sorted(costs.items())]
        if opts:
            out[name] = opts
    return Curves(out, source)


def metric_cost(kind: str, higher_is_better: bool, reference: float, value: float) -> float:
    """What a planner adds up for one measured value: the metric kind's cost (:meth:`MetricKind.cost`: the squared
    value of a metric that is zero on the dense model, or how far it moved the wrong way from the dense value)."""
    return metrics.for_kind(kind).cost(value, reference, higher_is_better)


def _gains(points: list[tuple[int, float]], spec: WhitenedSpectrum) -> list[tuple[int, float]]:
    return sorted((r, v / spec.error_at(r)) for r, v in points if spec.error_at(r) > 0 and v > 0 and math.isfinite(v))


def single_layer_error(points: list[tuple[int, float]], spec: WhitenedSpectrum, r: int) -> float:
    """The model-level relative output error of this layer truncated alone at rank ``r``: measured when tier 2
    measured ``r`` (``points``: (rank, error)), else the tier-1 layer-output error scaled by the layer's measured gain
    (log-linear between measured ranks, flat beyond), else (nothing measured) the layer-output error itself."""
    for rank, v in points:
        if rank == r:
            return v
    gains = _gains(points, spec)
    return _gain_at(gains, r) * spec.error_at(r) if gains else spec.error_at(r)


def _gain_at(gains: list[tuple[int, float]], r: int) -> float:
    """The gain at rank ``r`` from (rank, gain) pairs sorted by rank: log-linear between, flat beyond."""
    if r <= gains[0][0]:
        return gains[0][1]
    if r >= gains[-1][0]:
        return gains[-1][1]
    for (r1, g1), (r2, g2) in zip(gains, gains[1:]):
        if r1 <= r <= r2:
            t = (r - r1) / (r2 - r1)
            return math.exp((1 - t) * math.log(g1) + t * math.log(g2))
    return gains[-1][1]


def curves_from_spectra(spectra: dict[str, WhitenedSpectrum], layers: dict[str, Layer] | list[Layer],
                        align: int = 8) -> Curves:
    """Options from the tier-1 curves: every multiple of ``align`` below break-even, costed by the squared
    layer-output error (a layer-level proxy; the all-at-once measurement corrects its scale)."""
    named = by_name(layers)
    out: dict[str, list[Option]] = {}
    for name, spec in spectra.items():
        layer = named[name]
        useful = lrmath.max_useful_rank(layer.m, layer.n)
        opts = [Option(r, layer.params - layer.params_at(r), spec.error_at(r) ** 2)
                for r in range(align, useful + 1, align)]
        if opts:
            out[name] = opts
    return Curves(out, "tier1")


def curves_from_gradients(sensitivity: "GradientSensitivity", layers: dict[str, Layer] | list[Layer],
                          align: int = 8) -> Curves:
    """Options from the gradient-predicted costs (:func:`~auditor.calibration.tiers.fisher.gradient_sensitivity`): every
    multiple of ``align`` below break-even, costed by the layer's predicted model-level cost at that rank (the
    squared relative output error, or for a likelihood metric the cross-entropy increase in nats: ``linear``)."""
    named = by_name(layers)
    out: dict[str, list[Option]] = {}
    for name, costs in sensitivity.costs.items():
        layer = named.get(name)
        if layer is None:
            continue
        useful = lrmath.max_useful_rank(layer.m, layer.n)
        opts = [Option(r, layer.params - layer.params_at(r), float(costs[min(r, len(costs) - 1)]))
                for r in range(align, useful + 1, align)]
        if opts:
            out[name] = opts
    return Curves(out, "gradient", sensitivity.linear)


def pick_at(options: dict[str, list[Option]], mu: float) -> tuple[dict[str, int], int, float]:
    """The plan at the multiplier ``mu``: for each layer the option of least ``cost - mu * saved`` below keeping it
    dense (0); (plan, parameters saved, summed cost). The budget search and the tied-group search bisect on ``mu``."""
    plan: dict[str, int] = {}
    saved = 0
    cost = 0.0
    for name, opts in options.items():
        best: Option | None = None
        best_val = 0.0  # keeping the layer dense
        for o in opts:
            val = o.cost - mu * o.saved
            if val < best_val or (val == best_val and best is not None and o.saved > best.saved) or (
                    val == best_val and best is None and o.saved > 0 and val <= 0 and o.cost == 0):
                best, best_val = o, val
        if best is not None:
            plan[name] = best.rank
            saved += best.saved
            cost += best.cost
    return plan, saved, cost


def allocate(curves: Curves, target_saved: float) -> tuple[dict[str, int], int, float]:
    """The Lagrangian plan removing at least ``target_saved`` parameters at the least summed cost (or the most that
    the options can remove): (plan, saved, predicted cost). A tie group's key stands for its members, each at the
    group's rank."""
    plan, saved, cost = _allocate(curves.options, target_saved)
    if curves.tied:
        plan = {m: r for k, r in plan.items() for m in curves.members(k)}
    return plan, saved, cost


def _allocate(opts: dict[str, list[Option]], target_saved: float) -> tuple[dict[str, int], int, float]:
    if target_saved <= 0:
        return pick_at(opts, 0.0)
    hi = 1e-12
    while pick_at(opts, hi)[1] < target_saved and hi < 1e30:
        hi *= 10
    if hi >= 1e30:
        return pick_at(opts, hi)
    lo = 0.0
    for _ in range(200):
        mid = (lo + hi) / 2 if lo == 0 else math.sqrt(lo * hi)
        if pick_at(opts, mid)[1] >= target_saved:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-12 * hi:
            break
    over = pick_at(opts, hi)
    filled = _fill(opts, pick_at(opts, lo), over[0], target_saved)
    return filled if filled is not None and filled[2] < over[2] else over


def _fill(opts: dict[str, list[Option]], under: tuple[dict[str, int], int, float], over: dict[str, int],
          target_saved: float) -> tuple[dict[str, int], int, float] | None:
    """The gap between two neighbouring Lagrangian plans closed: from ``under`` (removing less than the target), the
    layers the two plans differ in moved one at a time toward their ``over`` option (through the options between),
    the move that reaches the target at the least cost where one does, else the one of least cost per parameter.
    The relaxation only reaches the vertices of the hull, and one vertex to the next can be a cliff: on the digits
    MLP the plans jumped from 211k to 407k parameters removed, nothing between. None when no move is left."""
    plan, saved, cost = dict(under[0]), under[1], under[2]
    at = {name: next((o for o in opts[name] if o.rank == plan[name]), None) if name in plan else None
          for name in set(under[0]) | set(over)}
    changing = [n for n in at if under[0].get(n) != over.get(n)]
    while saved < target_saved:
        moves = []
        for name in changing:
            cur = at[name]
            s0, c0 = (cur.saved, cur.cost) if cur is not None else (0, 0.0)
            s1 = next((o.saved for o in opts[name] if o.rank == over[name]), s0) if name in over else 0
            moves += [(o.cost - c0, o.saved - s0, name, o) for o in opts[name] if s0 < o.saved <= s1]
        if not moves:
            return None
        reach = [m for m in moves if saved + m[1] >= target_saved]
        dc, ds, name, o = (min(reach, key=lambda m: (m[0], m[1])) if reach
                           else min(moves, key=lambda m: (m[0] / m[1], -m[1])))
        at[name], plan[name] = o, o.rank
        saved, cost = saved + ds, cost + dc
    return plan, saved, cost


RESOLUTION = 0.005  # of the model's parameters: the search stops narrowing when its bracket's plans are this close
FRONTIER = 5  # plans measured around the one found, itself included (_frontier; the uniform baseline beside each)
GUIDED_STEPS = 2  # bracketing steps aimed by the scaled prediction before falling back to doubling or halving
FrontierPoint = FrontierPlan  # one plan measured all at once: the report's type (auditor/calresults.py)
BudgetPlan = BudgetResult  # tier 3's result: the report's type, returned as it is


@dataclass(frozen=True)
class SearchSettings:
    """What tier 3's search is asked besides the model, its layers, the calibration and the curves: the keywords of
    :func:`plan_for_budget` (which documents each)."""

    budget: float | None = None  # a fraction of the model's parameters to remove; None: the largest plan that holds
    tolerance: float | None = None
    metric: Metric | Callable[..., float] | None = None
    stats: InputStatistics | None = None
    frontier: int = FRONTIER
    max_tries: int = 64
    fixed: dict[str, int] | None = None
    progress: Callable[[int], None] | None = None
    reuse_bytes: int | None = None
    reuse: TruncatorStore | None = None
    backstops: int = 0  # plans measured below the one found, a point of the model apart: fallbacks for a verification
    measurer: "PlanMeasurer | None" = None  # what measures each plan (the audit's references'); None: one here


class SearchFields(TypedDict, total=False):
    """The keywords of :func:`plan_for_budget`: :class:`SearchSettings`' fields, for type checkers."""

    budget: float | None
    tolerance: float | None
    metric: Metric | Callable[..., float] | None
    stats: InputStatistics | None
    frontier: int
    max_tries: int
    fixed: dict[str, int] | None
    progress: Callable[[int], None] | None
    reuse_bytes: int | None
    reuse: TruncatorStore | None
    backstops: int
    measurer: "PlanMeasurer | None"


def plan_for_budget(model: nn.Module, layers: dict[str, Layer] | list[Layer],
                    calibration: Calibration | CalibrationSession, curves: Curves,
                    **given: Unpack[SearchFields]) -> BudgetResult:
    """Tier 3: the largest plan over ``curves`` that holds the tolerance all at once on the held-out batches.

    Each target (parameters to remove) gives one plan (:func:`allocate`); a plan is factorized and measured once
    (repeated plans cost nothing), in the audit's split sessions for a built-in metric in stages
    (:mod:`~auditor.calibration.measure.staged`: 16 search rows, and more, doubling, only while the plan's interval straddles
    the tolerance). Without ``budget`` the search starts at the largest target whose predicted cost fits the
    tolerance (tolerance^2 for the relative output error, the tolerance itself for a user metric or a likelihood
    metric's linear costs). For a built-in metric the next target is the one the curves predict at the tolerance
    once scaled by what the last plan measured against its prediction (at most ``GUIDED_STEPS`` such steps), then
    the target doubles while the plan holds and halves while it fails until the boundary is bracketed; the bracket
    then narrows (at the point its ends' measured values interpolate to the tolerance, log-linear, kept inside the
    bracket; the midpoint for a user metric) until no new plan lies between the largest plan that held and the
    smallest that failed, or they remove within ``RESOLUTION`` of the model of each other. With ``budget`` (a
    fraction of the model's parameters to remove) the first plan removes at least that share and the search only
    shrinks from there. ``max_tries`` bounds the measurements (a safety net: the bracket closes long before it on
    every model tried; :attr:`BudgetPlan.exhausted` says when it did not). ``fixed`` layers (name -> rank) are part of
    every plan measured: layers whose rank comes from elsewhere (the data-free suggestion) but that the plan must hold
    with. Only layers ``factorize`` rewrites take part. The model is measured in eval mode; its mode is restored.
    ``progress(plans measured so far)`` is called after each plan is measured (how many there will be is not known).
    ``reuse_bytes``: the budget of the per-layer decompositions kept across plans (a
    :class:`~auditor.calibration.statistics.whiten.TruncatorStore` that keeps what fits and drops the rest; None: its
    default; 0 decomposes every layer again for every plan), or ``reuse``: a ``TruncatorStore`` of the caller's
    (the audit's, kept for the verification and the plan check). One plan's factorized copy is alive at a time.

    The settings come as keywords (:class:`SearchFields`, the fields of :class:`SearchSettings`)."""
    t0 = time.perf_counter()
    s = SearchSettings(**given)
    named = by_name(layers)
    fixed = _fixed_of(s.fixed, named)
    options = {k: v for k, v in curves.options.items()
               if all(m in named and named[m].kind in SUPPORTED and m not in fixed for m in curves.members(k))}
    curves = Curves(options, curves.source, curves.linear, {k: v for k, v in curves.tied.items() if k in options})
    planned = {m: named[m] for k in [*options, *fixed] for m in curves.members(k) if m in named}
    session = CalibrationSession.of(calibration, model, metric=s.metric, tolerance=s.tolerance, layers=planned,
                                    stats=s.stats)  # a metric given keeps its kind (perplexity, kl, ...)
    with session.measuring():  # every module's own mode is restored afterwards
        stats = session.statistics(planned)
        measurer = s.measurer if s.measurer is not None else search_measurer(session)
        return _search(model, curves, named, stats, session.metric, replace(s, fixed=fixed, measurer=measurer), t0)


def _fixed_of(fixed: dict[str, int] | None, named: dict[str, Layer]) -> dict[str, int]:
    out = {k: int(r) for k, r in (fixed or {}).items()}
    unknown = [k for k in out if k not in named]
    if unknown:
        from ...errors import AuditError

        raise AuditError(f"fixed layer(s) {', '.join(unknown[:5])} are not among the layers given",
                         "Pass every layer of the plan in layers")
    return out


def _key(plan: dict[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(plan.items()))


@dataclass
class _Plans:
    """The plans one tier-3 search measures: each distinct plan factorized and measured once (``tries``, in order),
    remembered by the target that asked for it; ``max_tries`` plans at most (then the last one stands in)."""

    model: nn.Module
    ev: PlanMeasurer
    curves: Curves
    stats: InputStatistics
    reuse: TruncatorStore  # each layer decomposed once across the plans, within a byte budget
    fixed: dict[str, int]  # in every plan
    fixed_saved: int  # what the fixed layers remove
    total: int  # the model's parameters
    max_tries: int
    progress: Callable[[int], None] | None = None
    memo: dict[tuple[tuple[str, int], ...], FrontierPlan] = field(default_factory=dict)
    by_target: dict[float, FrontierPlan] = field(default_factory=dict)
    tries: list[FrontierPlan] = field(default_factory=list)

    def measure(self, target: float) -> FrontierPlan:
        """The plan at ``target`` (parameters to remove), measured all at once the first time it comes up."""
        if target in self.by_target:
            return self.by_target[target]
        plan, saved, cost = allocate(self.curves, target)
        plan = {**plan, **self.fixed}
        key = _key(plan)
        if key not in self.memo:  # each distinct plan is factorized and measured once
            if len(self.tries) >= self.max_tries:  # the safety net: the last plan measured stands in
                return self.tries[-1]
            self.memo[key] = self._measured(plan, saved + self.fixed_saved, cost, target)
            self.tries.append(self.memo[key])
            if self.progress is not None:
                self.progress(len(self.tries))
        self.by_target[target] = self.memo[key]
        return self.memo[key]

    def _measured(self, plan: dict[str, int], saved: int, cost: float, target: float) -> FrontierPlan:
        ev = self.ev
        m = ev.measure(measured_copy(self.model, plan, self.stats, self.reuse)) if plan else ev.measure(self.model)
        trim_heap()  # the plan's factors and what building them freed, handed back before the next plan
        return FrontierPlan(saved, saved / self.total if self.total else 0.0, m.value, m.ok, len(plan), m.top1,
                            target=int(target), plan=plan, predicted_cost=cost, rows=ev.rows_read)

    def best(self, limit: float) -> FrontierPlan | None:
        """The largest plan that held among those aimed at ``limit`` or less."""
        held = [p for p in self.tries if p.ok and p.target <= limit]
        return max(held, key=lambda p: (p.removed, -p.predicted_cost)) if held else None


@dataclass(frozen=True)
class _Aim:
    """Where the curves put the targets: the first one, the one they predict at the tolerance once scaled by a
    measured plan, and the point inside a bracket its ends' measured values interpolate to."""

    curves: Curves
    metric: Metric
    budget: float | None
    total: int
    max_saved: int  # the most the curves can remove
    fixed_saved: int

    def within(self, cap: float) -> float:
        """The largest target whose plan's predicted cost fits ``cap``."""
        lo, hi = 0.0, float(self.max_saved)
        for _ in range(60):
            mid = (lo + hi) / 2
            if allocate(self.curves, mid)[2] <= cap:
                lo = mid
            else:
                hi = mid
        return lo

    def start(self) -> float:
        """The first target: the budget's share, or the largest whose predicted cost fits the tolerance."""
        budget = self.budget
        if budget is not None:
            if not 0 < budget < 1:
                from ...errors import AuditError

                raise AuditError(f"budget {budget} is not a fraction in (0, 1)", "Give e.g. --budget 0.3")
            return min(max(budget * self.total - self.fixed_saved, 0.0), float(self.max_saved))
        if not self.max_saved:
            return 0.0
        cap = self.metric.tolerance if self.curves.linear else self.metric.tolerance_cost
        return max(self.within(cap), 1.0)

    def guess(self, p: FrontierPlan) -> float | None:
        """The target the curves predict at the tolerance once their prediction is scaled by what ``p`` measured
        against what they predicted for it (None for a user metric, or nothing to scale by)."""
        linear = self.curves.linear
        pred = p.predicted_cost if linear else math.sqrt(max(p.predicted_cost, 0.0))
        if not self.metric.spec.zero_on_dense or not (pred > 0 and 0 < p.metric < math.inf):
            return None
        want = self.metric.tolerance * pred / p.metric
        return self.within(want if linear else want * want)

    def scaled(self, p: FrontierPlan, share: float) -> float | None:
        """The target the curves predict at ``share`` of what ``p`` measured, their prediction scaled as in
        :meth:`guess` (None where they cannot say)."""
        linear = self.curves.linear
        pred = p.predicted_cost if linear else math.sqrt(max(p.predicted_cost, 0.0))
        if not self.metric.spec.zero_on_dense or not (pred > 0 and 0 < p.metric < math.inf):
            return None
        want = share * pred
        return self.within(want if linear else want * want)

    def between(self, ok_at: float, ok_p: FrontierPlan, fail_at: float, fail_p: FrontierPlan, gap: float) -> float:
        """Where the bracket's ends' measured values interpolate to the tolerance (log-linear in the target), at
        least min(gap / 2, a quarter of the bracket) inside it; the midpoint for a user metric, or values that do not
        interpolate (the dense model's 0)."""
        width = fail_at - ok_at
        tol, a, b = self.metric.tolerance, ok_p.metric, fail_p.metric
        if not self.metric.spec.zero_on_dense or not (0 < a < tol < b < math.inf):
            return ok_at + width / 2
        x = ok_at + width * math.log(tol / a) / math.log(b / a)
        margin = min(gap / 2, width / 4)
        return min(max(x, ok_at + margin), fail_at - margin)


def _search(model: nn.Module, curves: Curves, named: dict[str, Layer], stats: InputStatistics, metric: Metric,
            s: SearchSettings, t0: float) -> BudgetResult:
    """One tier-3 search (``s.measurer`` measures each plan): the bracket found and narrowed, fallbacks below the
    plan found, the frontier around it."""
    ev = s.measurer
    assert ev is not None
    fixed = dict(s.fixed or {})
    fixed_saved = sum(named[k].params - named[k].params_at(r) for k, r in fixed.items())
    total = count_params(model)
    reuse = s.reuse if s.reuse is not None else TruncatorStore(s.reuse_bytes, spill=False)
    plans = _Plans(model, ev, curves, stats, reuse, fixed, fixed_saved, total, s.max_tries, s.progress)
    aim = _Aim(curves, metric, s.budget, total, sum(max(o.saved for o in opts) for opts in curves.options.values()),
               fixed_saved)
    start = aim.start()
    limit = float("inf") if s.budget is None else start
    ok_at, fail_at = _bracket(plans, aim, start, grow=s.budget is None)
    _narrow(plans, aim, ok_at, fail_at)
    best = plans.best(limit) or plans.measure(0.0)
    _backstop(plans, best, s.backstops, aim)
    points = _frontier(plans, aim.max_saved, best, s.frontier)
    best = plans.best(limit) or best  # a frontier point may hold beyond the bracket
    return _result(plans, aim, best, points, t0)


BACKSTOP_VALUE = 0.7  # the second and later backstops: plans aimed at this share of the last one's measured value


def _backstop(plans: _Plans, best: FrontierPlan, backstops: int, aim: "_Aim | None" = None) -> None:
    """``backstops`` plans below ``best``: what a verification that rejects ``best`` falls back to (the search's
    targets jump; a fallback half the model below would give away what the search found). The first about
    ``2 * RESOLUTION`` of the model smaller, unless a plan that held lies that close already; each later one aimed,
    through the curves scaled by what the last one measured, at ``BACKSTOP_VALUE`` of its measured value (a plan a
    point smaller can measure the same, and held-out rows often measure a plan a third worse than the search rows:
    on the digits MLP the next plan below a rejected one removed half as much at a thousandth of its error)."""
    step = 2 * RESOLUTION * plans.total
    at = best
    for k in range(backstops):
        target = at.target - step
        if k and aim is not None:
            want = aim.scaled(at, BACKSTOP_VALUE)
            if want is not None and 0 < want < target:
                target = want
        near = [p for p in plans.tries if p.ok and p.plan and target - step / 2 <= p.removed - plans.fixed_saved
                < at.removed - plans.fixed_saved]
        if target <= 0:
            return
        n = len(plans.tries)
        at = max(near, key=lambda p: p.removed) if near else plans.measure(target)
        at.backstop = at.backstop or len(plans.tries) > n  # measured here, as the fallback


def _bracket(plans: _Plans, aim: _Aim, start: float, grow: bool) -> tuple[float, float | None]:
    """(a target whose plan holds, a larger one whose plan fails, or None when the largest plan holds): from
    ``start``, aimed by :meth:`_Aim.guess` for ``GUIDED_STEPS`` steps (at least ``RESOLUTION`` of the model each),
    then doubling while it holds (``grow``) and halving while it fails; 0 (the dense model) always holds."""
    top, step = float(aim.max_saved), RESOLUTION * plans.total
    p = plans.measure(start)
    if p.ok and not grow:
        return start, None
    at = start
    for n in range(plans.max_tries + 1):
        g = aim.guess(p) if n < GUIDED_STEPS else None
        if p.ok:
            if at >= top:
                return at, None
            nxt = min(top, max(g, at + step)) if g is not None else min(top, max(2 * at, 1.0))
        else:
            if at < 2:
                return 0.0, at
            nxt = max(0.0, min(g, at - step)) if g is not None else at / 2
        q = plans.measure(nxt)
        if q.ok != p.ok:
            return (at, nxt) if p.ok else (nxt, at)
        at, p = nxt, q
    return (at, None) if p.ok else (0.0, at)  # the safety net: max_tries plans measured


def _narrow(plans: _Plans, aim: _Aim, ok_at: float, fail_at: float | None) -> None:
    """Narrow [ok_at, fail_at] until no new plan lies between (targets one parameter apart at the latest), or the
    plans at its ends remove within ``RESOLUTION`` of the model of each other: at :meth:`_Aim.between`, and at the
    midpoint after two steps in a row moved the same end (interpolation on a convex curve creeps from one side)."""
    if fail_at is None:
        return
    gap = RESOLUTION * plans.total
    ok_p, fail_p = plans.measure(ok_at), plans.measure(fail_at)
    moved: list[bool] = []  # which end each step moved (True: the end that holds)
    while fail_at - ok_at > 1 and fail_p.removed - ok_p.removed > gap:
        if moved[-2:] in ([True, True], [False, False]):  # interpolation stuck on one side: bisect once
            mid = ok_at + (fail_at - ok_at) / 2
            moved.clear()
        else:
            mid = aim.between(ok_at, ok_p, fail_at, fail_p, gap)
        p = plans.measure(mid)
        if p.plan == ok_p.plan or (p.ok and p.plan != fail_p.plan):
            ok_at, ok_p = mid, p
            moved.append(True)
        else:
            fail_at, fail_p = mid, p
            moved.append(False)


def _frontier(plans: _Plans, top: int, best: FrontierPlan, size: int,
              ) -> dict[tuple[tuple[str, int], ...], FrontierPlan]:
    """3-5 plans around ``best`` (half, 1.5x and twice its target, the largest plan, ``top``), each measured once."""
    points = {_key(best.plan): best}
    targets = [best.target * f for f in (0.5, 1.5, 2.0)] + [top]
    if best.removed == 0:
        targets = [top * f for f in (0.25, 0.5, 0.75, 1.0)]
    for t in targets:
        if len(points) >= size:
            break
        if 0 < t <= top:
            p = plans.measure(t)
            points.setdefault(_key(p.plan), p)
    for f in (0.25, 0.75, 0.1, 0.9):
        if len(points) >= 3 or not top:
            break
        p = plans.measure(top * f)
        points.setdefault(_key(p.plan), p)
    return points


def _result(plans: _Plans, aim: _Aim, best: FrontierPlan, points: dict[tuple[tuple[str, int], ...], FrontierPlan],
            t0: float) -> BudgetResult:
    tries, total, metric = plans.tries, plans.total, aim.metric
    smallest_fail = min((p.removed for p in tries if not p.ok and p.removed > best.removed), default=None)
    return BudgetResult(
        plan=dict(best.plan), source=aim.curves.source, budget=aim.budget, removed=best.removed,
        removed_fraction=best.removed_fraction, metric=best.metric, ok=best.ok, top1=best.top1,
        frontier=sorted(points.values(), key=lambda p: p.removed), evaluations=len(tries),
        exhausted=len(tries) >= plans.max_tries, fixed=dict(plans.fixed), smallest_failing=smallest_fail,
        params_before=total, params_after=total - best.removed, predicted_cost=best.predicted_cost,
        metric_label=metric.label, higher_is_better=metric.higher_is_better, reference=plans.ev.reference,
        tolerance=metric.tolerance, tries=tries, seconds=time.perf_counter() - t0)


def recover_frontier(model: nn.Module, session: CalibrationSession, result: BudgetResult,
                     recovery: "RecoveryOptions", progress: Callable[[int, int], None] | None = None, *,
                     reference: "Evaluator | None" = None, kept: "LossMetric | None" = None) -> BudgetResult:
    """Every frontier plan of ``result`` measured again after the same recovery fine-tune
    (:func:`auditor.calibration.recovery.recover`: distillation toward ``model`` on the session's fit batches, the held-out ones
    only measured, with the session's evaluator), each from the whitened factors it was measured at; the plan's
    ``recovered`` says what it measured and what it cost. With a budget, the plan at the budget and the smallest
    plan that failed below it join the frontier (the plans recovery can move across the tolerance).

    ``recovery`` (the audit's :class:`~auditor.options.RecoveryOptions`, ``steps`` given): with
    ``choose_after`` the suggestion becomes the largest plan (within the budget) whose recovered metric holds the
    tolerance, when it removes more than the plan chosen before recovery (which holds without a fine-tune);
    ``chosen_after_recovery`` then marks it, and ``metric``/``ok`` stay its measurement before the fine-tune.
    ``progress(plans recovered, plans)`` after each. The model is measured in eval mode; its mode is restored.
    ``reference``: the dense reference the recovered plans are measured against (the audit's references' evaluator;
    None: one here); ``kept``: the gradient pass's loss metric, whose loss-aware factors the plans were measured at
    (None: the whitened ones)."""
    from ...calresults import RecoverySetup
    from ..references import evaluator_of

    s = recovery
    t0 = time.perf_counter()
    frontier = _recovery_frontier(result)
    ev = reference if reference is not None else evaluator_of(session)
    out, used = _recover_each(model, (session, ev, kept), frontier, s, progress)
    setup = RecoverySetup(s.steps, float(s.lr), s.trainable, used, s.seed, s.choose_after,
                          time.perf_counter() - t0)
    new_result = replace(result, frontier=out, recovery=setup)
    return _chosen_after(new_result, result, out) if s.choose_after else new_result


def _limit(result: BudgetResult) -> float:
    """The most a plan may remove: the budget's share of the model, or no limit."""
    return result.budget * result.params_before if result.budget is not None else float("inf")


def _recovery_frontier(result: BudgetResult) -> list[FrontierPlan]:
    """The frontier, with a budget also the plan at the budget and the smallest plan that failed below it."""
    limit = _limit(result)
    points = {_key(p.plan): p for p in result.frontier}
    if result.budget is not None and result.tries:
        extra = [result.tries[0]]  # the search's first plan: the one at the budget
        extra += [p for p in result.tries if not p.ok and p.removed == result.smallest_failing]
        for p in extra:
            if p.plan and p.removed <= limit:
                points.setdefault(_key(p.plan), p)
    return sorted(points.values(), key=lambda p: p.removed)


def _recover_each(model: nn.Module, measured: "tuple[CalibrationSession, Evaluator, LossMetric | None]",
                  frontier: list[FrontierPlan], s: "RecoveryOptions", progress: Callable[[int, int], None] | None,
                  ) -> tuple[list[FrontierPlan], str]:
    """Each plan (the dense model aside) factorized, fine-tuned and measured again; and the objective the runs
    used ("auto" resolved to "kl" or "mse", so that the emitted command repeats that recovery, not another).
    ``measured``: the session, its dense reference and the loss metric the plans were measured at."""
    from ...calresults import FrontierRecovery
    from ..recovery import recover

    session, ev, kept = measured
    todo = [p for p in frontier if p.plan]
    out: list[FrontierPlan] = []
    done, used = 0, s.objective
    with session.measuring():
        for p in frontier:
            if not p.plan:  # the dense model: nothing to recover
                out.append(p)
                continue
            t = time.perf_counter()
            # the loss-aware factors the plan was measured at, where the search had them
            new = factorize(model, p.plan, session, reuse=kept.store if kept is not None else None)
            r = recover(new, model, session, steps=s.steps, lr=s.lr, trainable=s.trainable, objective=s.objective,
                        seed=s.seed, metric=session.metric, evaluator=ev)
            del new
            used = r.objective
            if r.stopped is not None and r.stopped.startswith("interrupted"):
                raise KeyboardInterrupt
            rec = FrontierRecovery(r.after.metric, r.after.ok, r.after.top1, r.done, r.rows_trained,
                                   r.tokens_trained, time.perf_counter() - t, r.kept_step, r.stopped)
            out.append(replace(p, recovered=rec))
            done += 1
            if progress is not None:
                progress(done, len(todo))
    return out, used


def _chosen_after(new_result: BudgetResult, result: BudgetResult, out: list[FrontierPlan]) -> BudgetResult:
    """``choose_after``: the largest plan within the budget whose recovered metric holds, when it removes more than
    the plan chosen before recovery."""
    limit = _limit(result)
    held = [p for p in out if p.recovered is not None and p.recovered.ok and p.removed <= limit]
    best = max(held, key=lambda p: (p.removed, -p.predicted_cost), default=None)
    if best is None or (result.ok and result.plan and best.removed <= result.removed):
        return new_result  # the plan that holds without a fine-tune is at least as large
    total = result.params_before
    later = [p.removed for p in out if p.recovered is not None and not p.recovered.ok and p.removed > best.removed]
    return replace(new_result, plan=dict(best.plan), removed=best.removed, removed_fraction=best.removed_fraction,
                   metric=best.metric, ok=best.ok, top1=best.top1, params_after=total - best.removed,
                   predicted_cost=best.predicted_cost, chosen_after_recovery=True,
                   smallest_failing=min(later, default=None))
