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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from torch import nn

from .. import lrmath
from ..calresults import BudgetResult, FrontierPlan
from ..factorize import SUPPORTED, count_params, factorize
from ..results import Layer
from .inputs import Calibration
from .metric import Evaluator, Metric
from .session import CalibrationSession
from .stats import InputStatistics, by_name
from .sweep import Floors
from .whiten import WhitenedSpectrum

if TYPE_CHECKING:
    from .fisher import GradientSensitivity
    from .staged import StagedEvaluator


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


def curves_from_floors(floors: Floors, layers: dict[str, Layer] | list[Layer],
                       spectra: dict[str, WhitenedSpectrum] | None = None, source: str = "measured") -> Curves:
    """Options from the tier-2 points: every measured rank below break-even, costed by its measured metric.

    With ``spectra`` (tier 1) and the default metric, the grid ranks the search did not visit are options too,
    costed by the layer's measured gain times its tier-1 layer-output error, (g(r) e(r))^2, where g is the ratio
    of measured to layer-output error at the measured ranks, interpolated (log-linear in rank) between them and held
    flat beyond. The guided search measures about 3 ranks per layer; without these the allocation could only pick
    among those (on the char transformer the budgeted plan removed 27% instead of 50% at the same tolerance).
    ``floors`` may also be sensitivity probes (:func:`~auditor.calibration.sweep.probe_sensitivity`, ``source``
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
        if spec is not None and floors.kind != "user" and _gains(f.points, spec):
            useful = lrmath.max_useful_rank(layer.m, layer.n)
            for r in range(floors.align, useful + 1, floors.align):
                if r not in costs:
                    costs[r] = single_layer_error(f.points, spec, r) ** 2
        opts = [Option(r, layer.params - layer.params_at(r), c) for r, c in sorted(costs.items())]
        if opts:
            out[name] = opts
    return Curves(out, source)


def metric_cost(kind: str, higher_is_better: bool, reference: float, value: float) -> float:
    """What a planner adds up for one measured value: the squared value of a built-in metric (relative errors,
    the perplexity increase and the KL combine roughly in quadrature), or how far a user metric moved the wrong way
    from the dense value, in its units."""
    if kind != "user":
        return value * value
    return max(0.0, reference - value) if higher_is_better else max(0.0, value - reference)


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
    """Options from the gradient-predicted costs (:func:`~auditor.calibration.fisher.gradient_sensitivity`): every
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


def _pick(options: dict[str, list[Option]], mu: float) -> tuple[dict[str, int], int, float]:
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
    the options can remove): (plan, saved, predicted cost)."""
    opts = curves.options
    if target_saved <= 0:
        return _pick(opts, 0.0)
    hi = 1e-12
    while _pick(opts, hi)[1] < target_saved and hi < 1e30:
        hi *= 10
    if hi >= 1e30:
        return _pick(opts, hi)
    lo = 0.0
    for _ in range(200):
        mid = (lo + hi) / 2 if lo == 0 else math.sqrt(lo * hi)
        if _pick(opts, mid)[1] >= target_saved:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-12 * hi:
            break
    return _pick(opts, hi)


REUSE_SHARE = 0.25  # of the memory available when tier 3 starts, for the decompositions kept across plans
REUSE_CAP = 8 * 2**30  # bytes, at most, by default
REUSE_FALLBACK = 2 * 2**30  # bytes by default where the available memory cannot be read


def default_reuse_bytes() -> int:
    """The default budget of :class:`Decompositions`: a quarter of the memory available now, at most 8 GiB; 2 GiB
    where it cannot be read."""
    from ..spectra.backend import available_memory

    avail = available_memory()
    return REUSE_FALLBACK if avail is None else max(0, min(int(avail * REUSE_SHARE), REUSE_CAP))


def _truncator_bytes(trunc: object) -> int:
    """The float64 arrays a :class:`~auditor.calibration.whiten.Truncator` holds: the weight F and each group's U."""
    f = getattr(trunc, "f", None)
    return int(getattr(f, "nbytes", 0)) + sum(int(u.nbytes) for u in getattr(trunc, "u", ()))


class Decompositions(dict):
    """The per-layer decompositions (``factorize``'s ``reuse``) kept across the plans tier 3 measures, at most
    ``budget`` bytes of them (None: :func:`default_reuse_bytes`): a float64 weight and its U per layer would be
    about twice the model's weights in float64 for every layer at once. A decomposition that does not fit is not
    kept, and is computed again for the next plan that needs it (the same factors: the same arrays in, the same
    LAPACK calls). ``bytes``: what is kept."""

    def __init__(self, budget: int | None = None) -> None:
        super().__init__()
        self.budget = default_reuse_bytes() if budget is None else int(budget)
        self.bytes = 0
        self.refused = 0

    def __setitem__(self, key: str, value: object) -> None:
        n = _truncator_bytes(value)
        old = _truncator_bytes(self[key]) if key in self else 0
        if self.bytes - old + n > self.budget:
            self.refused += 1
            return
        super().__setitem__(key, value)
        self.bytes += n - old


RESOLUTION = 0.005  # of the model's parameters: the search stops bisecting when its bracket's plans are this close
FrontierPoint = FrontierPlan  # one plan measured all at once: the report's type (auditor/calresults.py)
BudgetPlan = BudgetResult  # tier 3's result: the report's type, returned as it is


def plan_for_budget(model: nn.Module, layers: dict[str, Layer] | list[Layer],
                    calibration: Calibration | CalibrationSession, curves: Curves, budget: float | None = None, tolerance: float | None = None,
                    metric: Metric | Callable[..., float] | None = None, stats: InputStatistics | None = None,
                    frontier: int = 5, max_tries: int = 64, fixed: dict[str, int] | None = None,
                    progress: Callable[[int], None] | None = None, reuse_bytes: int | None = None,
                    reuse: "Decompositions | None" = None) -> BudgetResult:
    """Tier 3: the largest plan over ``curves`` that holds the tolerance all at once on the held-out batches.

    Each target (parameters to remove) gives one plan (:func:`allocate`); a plan is factorized and measured once
    (repeated plans cost nothing), in the audit's split sessions for a built-in metric in stages (:mod:`~auditor.calibration.staged`: a quarter
    of the search rows, and the rest only for a plan whose interval there straddles the tolerance). Without
    ``budget`` the search starts at the largest target whose predicted cost fits the tolerance (tolerance^2 for the relative output error, the tolerance itself for a user metric), doubles
    the target while the plan holds and halves it while it fails until the boundary is bracketed, then bisects until
    no new plan lies between the largest plan that held and the smallest that failed, or they remove within
    ``RESOLUTION`` of the model of each other. With ``budget`` (a fraction of
    the model's parameters to remove) the first plan removes at least that share and the search only shrinks from
    there. ``max_tries`` bounds the measurements (a safety net: the bracket closes long before it on every model
    tried; :attr:`BudgetPlan.exhausted` says when it did not). ``fixed`` layers (name -> rank) are part of every plan
    measured: layers whose rank comes from elsewhere (the data-free suggestion) but that the plan must hold with.
    Only layers ``factorize`` rewrites take part. The model is measured in eval mode; its mode is restored.
    ``progress(plans measured so far)`` is called after each plan is measured (how many there will be is not known).
    ``reuse_bytes``: the budget of the per-layer decompositions kept across plans (:class:`Decompositions`; None: its
    default; 0 decomposes every layer again for every plan), or ``reuse``: a :class:`Decompositions` of the caller's
    (the audit's, kept for the verification and the plan check). One plan's factorized copy is alive at a time."""
    t0 = time.perf_counter()
    named = by_name(layers)
    fixed = {k: int(r) for k, r in (fixed or {}).items()}
    unknown = [k for k in fixed if k not in named]
    if unknown:
        from ..errors import AuditError

        raise AuditError(f"fixed layer(s) {', '.join(unknown[:5])} are not among the layers given",
                         "Pass every layer of the plan in layers")
    options = {k: v for k, v in curves.options.items()
               if k in named and named[k].kind in SUPPORTED and k not in fixed}
    curves = Curves(options, curves.source, curves.linear)
    planned = {k: named[k] for k in [*options, *fixed] if k in named}
    session = CalibrationSession.of(calibration, model, metric=metric, tolerance=tolerance, layers=planned,
                                    stats=stats)  # a metric given keeps its kind (perplexity, kl, ...)
    with session.measuring():  # every module's own mode is restored afterwards
        stats = session.statistics(planned)
        return _search(model, session.search_evaluator, curves, named, stats, session.metric, budget, frontier,
                       max_tries, fixed, t0, progress, reuse_bytes, reuse)


def _search(model: nn.Module, ev: "Evaluator | StagedEvaluator", curves: Curves, named: dict[str, Layer],
            stats: InputStatistics, metric: Metric, budget: float | None, frontier: int, max_tries: int,
            fixed: dict[str, int], t0: float, progress: Callable[[int], None] | None = None,
            reuse_bytes: int | None = None, reuse: "Decompositions | None" = None) -> BudgetResult:
    total = count_params(model)
    options = curves.options
    max_saved = sum(max(o.saved for o in opts) for opts in options.values())
    fixed_saved = sum(named[k].params - named[k].params_at(r) for k, r in fixed.items())
    memo: dict[tuple[tuple[str, int], ...], FrontierPlan] = {}
    by_target: dict[float, FrontierPlan] = {}
    tries: list[FrontierPlan] = []
    if reuse is None:
        reuse = Decompositions(reuse_bytes)  # each layer decomposed once across the plans, within a byte budget

    def measure(target: float) -> FrontierPlan:
        if target in by_target:
            return by_target[target]
        plan, saved, cost = allocate(curves, target)
        plan = {**plan, **fixed}
        saved += fixed_saved
        key = tuple(sorted(plan.items()))
        if key not in memo:  # each distinct plan is factorized and measured once
            if len(tries) >= max_tries:  # the safety net: the last plan measured stands in
                return tries[-1]
            m = ev.measure(factorize(model, plan, stats, reuse=reuse)) if plan else ev.measure(model)
            rows = getattr(ev, "last_rows", None) or sum(b.rows for b in getattr(ev, "batches", ()))
            memo[key] = FrontierPlan(saved, saved / total if total else 0.0, m.value, m.ok, len(plan), m.top1, target=int(target),
                                     plan=plan, predicted_cost=cost, rows=rows)
            tries.append(memo[key])
            if progress is not None:
                progress(len(tries))
        by_target[target] = memo[key]
        return memo[key]

    if budget is not None:
        if not 0 < budget < 1:
            from ..errors import AuditError

            raise AuditError(f"budget {budget} is not a fraction in (0, 1)", "Give e.g. --budget 0.3")
        start = min(max(budget * total - fixed_saved, 0.0), float(max_saved))
    else:
        cap = metric.tolerance if metric.kind == "user" or curves.linear else metric.tolerance ** 2
        lo, hi = 0.0, float(max_saved)  # the largest target whose predicted cost fits the cap
        for _ in range(60):
            mid = (lo + hi) / 2
            if allocate(curves, mid)[2] <= cap:
                lo = mid
            else:
                hi = mid
        start = max(lo, 1.0) if max_saved else 0.0
    ok_at, fail_at = _bracket(measure, start, float(max_saved), grow=budget is None)
    _bisect(measure, ok_at, fail_at, RESOLUTION * total)
    limit = float("inf") if budget is None else start
    held = [p for p in tries if p.ok and p.target <= limit]
    best = max(held, key=lambda p: (p.removed, -p.predicted_cost)) if held else measure(0.0)
    points = {tuple(sorted(best.plan.items())): best}
    targets = [best.target * f for f in (0.5, 1.5, 2.0)] + [max_saved]
    if best.removed == 0:
        targets = [max_saved * f for f in (0.25, 0.5, 0.75, 1.0)]
    for t in targets:
        if len(points) >= frontier:
            break
        if 0 < t <= max_saved:
            p = measure(t)
            points.setdefault(tuple(sorted(p.plan.items())), p)
    for f in (0.25, 0.75, 0.1, 0.9):
        if len(points) >= 3 or not max_saved:
            break
        p = measure(max_saved * f)
        points.setdefault(tuple(sorted(p.plan.items())), p)
    held = [p for p in tries if p.ok and p.target <= limit]  # a frontier point may hold beyond the bracket
    if held:
        best = max(held, key=lambda p: (p.removed, -p.predicted_cost))
    smallest_fail = min((p.removed for p in tries if not p.ok and p.removed > best.removed), default=None)
    return BudgetResult(
        plan=dict(best.plan), source=curves.source, budget=budget, removed=best.removed,
        removed_fraction=best.removed_fraction, metric=best.metric, ok=best.ok, top1=best.top1,
        frontier=sorted(points.values(), key=lambda p: p.removed), evaluations=len(tries),
        exhausted=len(tries) >= max_tries, fixed=dict(fixed), smallest_failing=smallest_fail,
        params_before=total, params_after=total - best.removed, predicted_cost=best.predicted_cost,
        metric_label=metric.label, higher_is_better=metric.higher_is_better, reference=ev.reference,
        tolerance=metric.tolerance, tries=tries, seconds=time.perf_counter() - t0)


def _bracket(measure: Callable[[float], FrontierPlan], start: float, top: float,
             grow: bool) -> tuple[float, float | None]:
    """(a target whose plan holds, a larger one whose plan fails, or None when the largest plan holds): from
    ``start``, doubling while it holds (``grow``) and halving while it fails; 0 (the dense model) always holds."""
    if measure(start).ok:
        if not grow:
            return start, None
        ok_at = start
        while ok_at < top:
            nxt = min(top, max(2 * ok_at, 1.0))
            if not measure(nxt).ok:
                return ok_at, nxt
            ok_at = nxt
        return ok_at, None
    fail_at = start
    while fail_at >= 2:
        nxt = fail_at / 2
        if measure(nxt).ok:
            return nxt, fail_at
        fail_at = nxt
    return 0.0, fail_at


def _bisect(measure: Callable[[float], FrontierPlan], ok_at: float, fail_at: float | None,
            gap: float = 0.0) -> None:
    """Narrow [ok_at, fail_at] until no new plan lies between (targets one parameter apart at the latest), or the
    plans at its ends remove within ``gap`` parameters of each other."""
    if fail_at is None:
        return
    ok_key, fail_key = measure(ok_at).plan, measure(fail_at).plan
    while fail_at - ok_at > 1 and measure(fail_at).removed - measure(ok_at).removed > gap:
        mid = (ok_at + fail_at) / 2
        p = measure(mid)
        if p.plan == ok_key or (p.ok and p.plan != fail_key):
            ok_at, ok_key = mid, p.plan
        else:
            fail_at, fail_key = mid, p.plan


def recover_frontier(model: nn.Module, session: CalibrationSession, result: BudgetResult, *, steps: int,
                     lr: float = 1e-4, trainable: str = "factors", objective: str = "auto", seed: int = 0,
                     choose_after: bool = False,
                     progress: Callable[[int, int], None] | None = None) -> BudgetResult:
    """Every frontier plan of ``result`` measured again after the same recovery fine-tune
    (:func:`auditor.recover.recover`: distillation toward ``model`` on the session's fit batches, the held-out ones
    only measured, with the session's evaluator), each from the whitened factors it was measured at; the plan's
    ``recovered`` says what it measured and what it cost. With a budget, the plan at the budget and the smallest
    plan that failed below it join the frontier (the plans recovery can move across the tolerance).

    ``choose_after``: the suggestion becomes the largest plan (within the budget) whose recovered metric holds the
    tolerance, when it removes more than the plan chosen before recovery (which holds without a fine-tune);
    ``chosen_after_recovery`` then marks it, and ``metric``/``ok`` stay its measurement before the fine-tune.
    ``progress(plans recovered, plans)`` after each. The model is measured in eval mode; its mode is restored."""
    from dataclasses import replace

    from ..calresults import FrontierRecovery, RecoverySetup
    from ..recover import recover

    t0 = time.perf_counter()
    limit = result.budget * result.params_before if result.budget is not None else float("inf")
    points = {tuple(sorted(p.plan.items())): p for p in result.frontier}
    if result.budget is not None and result.tries:
        extra = [result.tries[0]]  # the search's first plan: the one at the budget
        extra += [p for p in result.tries if not p.ok and p.removed == result.smallest_failing]
        for p in extra:
            if p.plan and p.removed <= limit:
                points.setdefault(tuple(sorted(p.plan.items())), p)
    frontier = sorted(points.values(), key=lambda p: p.removed)
    todo = [p for p in frontier if p.plan]
    out: list[FrontierPlan] = []
    done = 0
    with session.measuring():
        for p in frontier:
            if not p.plan:  # the dense model: nothing to recover
                out.append(p)
                continue
            t = time.perf_counter()
            new = factorize(model, p.plan, session)  # the whitened factors the plan was measured at
            r = recover(new, model, session, steps=steps, lr=lr, trainable=trainable, objective=objective,
                        seed=seed, metric=session.metric)
            del new
            if r.stopped is not None and r.stopped.startswith("interrupted"):
                raise KeyboardInterrupt
            rec = FrontierRecovery(r.after.metric, r.after.ok, r.after.top1, r.done, r.rows_trained,
                                   r.tokens_trained, time.perf_counter() - t, r.kept_step, r.stopped)
            out.append(replace(p, recovered=rec))
            done += 1
            if progress is not None:
                progress(done, len(todo))
    setup = RecoverySetup(steps, float(lr), trainable, objective, seed, choose_after, time.perf_counter() - t0)
    new_result = replace(result, frontier=out, recovery=setup)
    if not choose_after:
        return new_result
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
