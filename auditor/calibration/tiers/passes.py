"""The calibration stage's passes. Each takes the pass context (the model, the session of inputs it measures with,
the progress), the results of the passes before it and its own option group, and returns a frozen result; none
changes the session or what an earlier pass made (tests/test_calibration_passes.py checks every one)::

    tier1        PassContext, align, keep                                 -> Tier1 (spectra, spans, the target, the
                                                                             kept decompositions)
    references   PassContext                                              -> References (the dense model measured:
                                                                             the search's measurer, the verifier)
    scope_of     [Layer], Tier1, Settings, ties                           -> Scope (swept, planned layers, ties)
    floors       PassContext, References, Tier1, Scope, TierOptions,
                 ClusterOptions                                           -> Floored | None (tier 2)
    sensitivity  PassContext, References, Tier1, Scope, Floored,
                 TierOptions                                              -> Sensitivity (one of sensitivity.py's;
                                                                             its ``loss_metric``: the gradient pass's)
    search       PassContext, References, Tier1, Scope, Sensitivity,
                 TierOptions, Settings                                    -> Searched (tier 3: plan, rounding floor;
                                                                             --tie: each group one option list)
    recovered    PassContext, References, Searched, Sensitivity,
                 RecoveryOptions                                          -> Recovered (--recover)
    verified     PassContext, References, BudgetResult, TruncatorStore,
                 LossMetric                                               -> Verified (the held-out verification; the
                                                                             chosen plan's number measured on the
                                                                             model factorize writes by default)
    baselined    PassContext, References, BudgetResult, Scope,
                 TruncatorStore                                           -> Baselined (uniform truncation beside)
    bits         PassContext, References, Scope, LossMetric,
                 TierOptions, BudgetResult                                -> Bits (rank or bits under a byte budget:
                                                                             --budget-bytes, --bits-per-weight)

What one pass learns and a later one needs travels in its result, by argument: the dense references
(:class:`~auditor.calibration.references.References`), tier 1's kept decompositions (``Tier1.kept``), tier 3's
store (``Searched.reuse``), the gradient pass's loss metric (``Sensitivity.loss_metric``).
:func:`auditor.calibration.stage.calibrate` composes them and builds the report's rows once from their results.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ..._env import trim_heap
from ...calresults import BitsReport, BudgetResult, FrontierPlan, RoundingFloor, Verification
from ...results import Layer, TieGroup
from ..references import References, references_of
from ..session import CalibrationSession
from ..statistics.stats import LayerInput
from ..statistics.whiten import TruncatorStore, WhitenedSpectrum
from .budget import Curves
from .pass_context import PassContext, Scope
from .sensitivity import Gradients, Measured, Sensitivity, Tier1Curves, gradients, probed
from .sweep import Floors

if TYPE_CHECKING:
    from torch import nn

    from ...config import Settings
    from ...options import ClusterOptions, RecoveryOptions, TierOptions
    from ...progress import Progress
    from ..measure.metric import Measurement
    from ..statistics.whiten import LossMetric


@dataclass(frozen=True)
class Span:
    """What the calibration reached of a layer's input: its rows and width, the rows (or ids) seen, whether they span
    the input."""

    rows: int
    width: int
    seen: int
    spans: bool


@dataclass(frozen=True)
class Tier1:
    """The input statistics' tier 1: every layer's whitened spectrum and span, keyed by ``Layer.name``."""

    spectra: dict[str, WhitenedSpectrum]
    spans: dict[str, Span]
    align: int  # ranks in multiples of this
    target: float  # the layer-output error tier 1 ranked for (the metric's)
    cached: bool  # the statistics came from the cache
    seconds: dict[str, float]
    kept: TruncatorStore | None = None  # the input-whitened truncators of the layers a plan may cut, made with the
    #                                     spectra (one decomposition each): tier 3's where no gradient pass made its
    #                                     own, the uniform baseline's where it did


def _span(inp: LayerInput) -> Span:
    """For an embedding the ids looked up at least once (a position table read only up to the calibration's sequence
    length, a vocabulary's unseen ids); for other layers the rows of X, which cannot span the input width when fewer.
    (A Gram of full row count but lower rank is left alone: a LayerNorm's output lies in a hyperplane for every
    input, held-out or not.)"""
    import numpy as np

    if inp.diagonal:
        seen = int(np.count_nonzero(inp.gram > 0))
        return Span(inp.rows, inp.width, seen, seen == inp.width)
    return Span(inp.rows, inp.width, int(inp.rows), inp.rows >= inp.width)


def tier1(ctx: PassContext, align: int, since: float | None = None, keep: frozenset[str] = frozenset()) -> Tier1:
    """The input statistics (block by block, tier 1 with them) and every layer's whitened spectrum; ``since``: when
    the stage's clock for tier 1 started (the session's opening counts); ``keep``: the layers whose decompositions
    are kept for the passes that cut factors (:func:`plannable`), in a store of their own on disk (``Tier1.kept``,
    nothing of it in memory between the passes; None without ``keep``, and on a Dask cluster, whose tier 1 keeps
    none: tier 3 asks the cluster)."""
    from ..statistics.whiten import Keep

    t = time.perf_counter() if since is None else since
    session, progress = ctx.session, ctx.progress
    target = session.metric.tier1_target
    kept = TruncatorStore(0) if keep and not session.decompositions.on_cluster else None  # a cluster keeps its own
    held = Keep(kept, keep) if kept is not None else None
    with progress.phase("statistics", total=len(session.calibration.fit), unit="batch"):  # tier 1 block by block
        stats = session.statistics(progress=progress, spectra=(align, target), keep=held)
        cached = session.cached
    with progress.phase("tier 1 spectra", total=sum(1 for l in session.layers if l in stats.layers)):
        spectra = session.spectra(align, target, progress=progress.update, keep=held)
    spans = {name: _span(stats.layers[name]) for name in spectra}
    return Tier1(spectra, spans, align, target, cached, {"tier1": time.perf_counter() - t}, kept)


def references(ctx: PassContext) -> References:
    """The dense model measured once on the held-out rows: the search's measurer, the verifier (split sessions) and
    the plain evaluator (:mod:`~auditor.calibration.references`)."""
    t = time.perf_counter()
    refs = references_of(ctx.session)
    return replace(refs, seconds={"references": time.perf_counter() - t})


def sweepable(layer: Layer, settings: "Settings") -> bool:
    """The layers the suggestions consider: not narrow (same gate as the weight-energy suggestion)."""
    from ... import lrmath

    return (layer.share >= settings.min_share and layer.break_even >= settings.min_break_even
            and lrmath.max_useful_rank(layer.m, layer.n) >= 1)


def plannable(layers: list[Layer], settings: "Settings") -> frozenset[str]:
    """The layers a plan may cut as far as their shapes and kinds say (:func:`scope_of`'s planned ones before tier 1
    knows their spans): those tier 1 keeps the decompositions of."""
    from ...kinds.registry import SUPPORTED

    return frozenset(l.name for l in layers if sweepable(l, settings) and not l.aliases and l.kind in SUPPORTED)


def scope_of(layers: list[Layer], tier1: Tier1, settings: "Settings", ties: tuple[TieGroup, ...] = ()) -> Scope:
    """The swept and planned layers. A layer calibration cannot rank (no statistics, or inputs it did not span: an
    embedding with ids the calibration never looks up, fewer rows than the input width; the condition of LR014) is
    in neither: no plan the search measures factorizes it, so the suggested plan keeps it dense rather than put it in
    at a data-free rank (a user's ``--plan`` may still name it, and LR014 says so)."""
    swept = [l for l in layers if l.name in tier1.spectra and sweepable(l, settings) and tier1.spans[l.name].spans]
    names = plannable(swept, settings)
    return Scope(swept, [l for l in swept if l.name in names], ties)


@dataclass(frozen=True)
class Floored:
    """Tier 2's measured floors, where they ran ("local", "dask tcp://HOST:PORT (N workers)") and its time."""

    floors: Floors
    where: str
    seconds: dict[str, float]


def floors(ctx: PassContext, refs: References, tier1: Tier1, scope: Scope, tiers: "TierOptions",
           cluster: "ClusterOptions", drawn: bool | str | None = None) -> Floored | None:
    """Tier 2 (``--measure-floor``): each swept layer's measured floor, here or on a Dask cluster (one task per
    layer, the workers' own sessions, its own progress bar as ``drawn`` asks: the audit's ``progress`` option);
    None without ``--measure-floor`` or a layer to sweep."""
    align, progress = tier1.align, ctx.progress
    if not tiers.measure_floor or not scope.swept:
        return None
    t = time.perf_counter()
    if cluster.scheduler is not None:  # one Dask task per layer (auditor/calibration/tiers/cluster.py)
        from .cluster import measure_floors_on_cluster

        found, where = measure_floors_on_cluster(ctx.model, scope.swept, ctx.session, align, tier1.spectra, cluster,
                                                 drawn)
    else:
        from .sweep import measure_floors

        def steps(done: int, total: int, evaluations: int) -> None:
            progress.update(done, total, note=f"{evaluations} evaluation{'s' if evaluations != 1 else ''}")

        with progress.phase("tier 2 floors", total=len(scope.swept)):
            found = measure_floors(ctx.model, scope.swept, ctx.session, align=align, spectra=tier1.spectra,
                                   steps=steps, evaluator=refs.evaluator)
        where = "local"
    return Floored(found, where, {"tier2": time.perf_counter() - t})


def sensitivity(ctx: PassContext, refs: References, tier1: Tier1, scope: Scope, floored: Floored | None,
                tiers: "TierOptions") -> Sensitivity:
    """The stage's sensitivity pass: tier 2's floors when measured; else, for the planned layers, the gradients (the
    default) or the probes (``--probe``); tier 1's curves for a user metric (no gradient, not zero on the dense
    model) or with ``--no-probe``."""
    if floored is not None:
        return Measured(floored.floors)
    spec = ctx.session.metric.spec
    if not tiers.probe_sensitivity or not scope.planned:
        return Tier1Curves()
    if tiers.probe:
        if not spec.zero_on_dense:
            return Tier1Curves()
        return probed(ctx, refs, scope.planned, tier1.spectra, (tier1.align, tier1.target))
    if not spec.gradient:
        return Tier1Curves()
    return gradients(ctx, refs, scope, tier1.spectra, (tier1.align, tier1.target))


VERIFY_TRIES = 6  # plans verified at most, from the largest that held on the search rows down
VERIFY_BACKSTOPS = 2  # plans the search measures a point, and two, below the one it found: the verification's fallbacks


@dataclass(frozen=True)
class Searched:
    """Tier 3: the plan search's result, the rounding floor (bf16 / fp16 weights), the decompositions kept for the
    verification and the plan check, the model-level evaluations and the time."""

    budget: BudgetResult
    rounding: RoundingFloor | None
    reuse: TruncatorStore
    evaluations: int
    seconds: dict[str, float]
    untied: Curves | None = None  # --tie: the curves before the ties, what the ties' cost is stated against
    ties: tuple[TieGroup, ...] = ()
    loss_aware: bool = False  # some of ``reuse`` are the gradient pass's loss-aware truncations, not SVD-LLM's
    whitened: TruncatorStore | None = None  # tier 1's input-whitened truncations (``Tier1.kept``)

    @property
    def baseline_reuse(self) -> TruncatorStore | None:
        """What the uniform baseline may cut from: ``reuse`` when it holds SVD-LLM's (input-whitened) truncations,
        else tier 1's (None where tier 1 kept none: the baseline decomposes its layers itself)."""
        return self.whitened if self.loss_aware else self.reuse

    def tie_costed(self, budget: BudgetResult) -> BudgetResult:
        """``budget`` with what the ties cost in removal at its plan's predicted cost (:func:`.tied.tie_cost`);
        as it is without ties."""
        if self.untied is None or not self.ties:
            return budget
        from .tied import tie_cost

        return replace(budget, ties=tie_cost(self.untied, self.ties, budget.predicted_cost, budget.params_before))


def curves_for(sensitivity: Sensitivity, tier1: Tier1, scope: Scope, settings: "Settings") -> Curves:
    """Tier 3's per-layer options from the sensitivity, every rank that compresses at least ``min_compression``."""
    curves = sensitivity.curves(scope.planned, tier1.spectra, settings.align)
    named = {l.name: l for l in scope.planned}
    least = settings.min_compression
    return Curves({k: [o for o in v if named[k].compression(o.rank) >= least]
                   for k, v in curves.options.items() if k in named}, curves.source, curves.linear)


def search(ctx: PassContext, refs: References, tier1: Tier1, scope: Scope, sensitivity: Sensitivity,
           tiers: "TierOptions", settings: "Settings") -> Searched:
    """The rounding floor (what every plannable layer at full rank measures: rounding alone), then the plan search
    over the sensitivity's curves, judged against the tolerance as given (the floor is part of every plan's cost)."""
    from ..statistics.whiten import part_bytes
    from .budget import plan_for_budget
    from .rounding import low_precision, rounding_floor

    model, session, progress = ctx.model, ctx.session, ctx.progress
    seconds: dict[str, float] = {}
    # each layer decomposed once for the rounding floor, the search and the verification's candidates; one part
    # of the model's decompositions in memory (a block's, or the largest outside layer's), the rest on disk; the
    # gradient pass's loss-aware truncations where it made them
    given = sensitivity.reuse if isinstance(sensitivity, Gradients) else None
    reuse = given if given is not None else tier1.kept if tier1.kept is not None else TruncatorStore(
        part_bytes(model, scope.sensitive))
    t = time.perf_counter()
    todo = [l for l in scope.sensitive if not reuse.holds(l.name)]
    if session.decompositions.on_cluster and todo:  # --scheduler: the decompositions made there, one task per distinct input
        with progress.phase("tier 3 decompositions", total=len(todo)):
            session.decompositions.truncators(todo, session.stats, reuse, progress.update)
        seconds["tier3 decompositions"] = time.perf_counter() - t
    t = time.perf_counter()
    if low_precision(model, scope.sensitive):
        with progress.phase("rounding floor"):
            rounding = rounding_floor(model, scope.sensitive, session, reuse, refs.evaluator)
        seconds["rounding"] = time.perf_counter() - t
    else:
        rounding = None
    t = time.perf_counter()
    untied = curves_for(sensitivity, tier1, scope, settings)
    curves = untied
    if scope.ties:  # each tie group one option list: the allocation never splits it
        from .tied import tie_curves

        curves = tie_curves(untied, scope.ties)[0]
    tier3 = time.perf_counter() - t
    t = time.perf_counter()
    with progress.phase("tier 3 plan search", unit="plan"):
        budget = plan_for_budget(model, list(session.layers.values()), session, curves, budget=tiers.budget,
                                 progress=progress.update, reuse=reuse, measurer=refs.search,
                                 backstops=VERIFY_BACKSTOPS if refs.verifier is not None else 0)
    seconds["tier3"] = tier3 + time.perf_counter() - t
    return Searched(budget, rounding, reuse, budget.evaluations + int(rounding is not None), seconds,
                    untied if scope.ties else None, scope.ties, loss_aware=given is not None and len(todo) < len(
                        scope.sensitive), whitened=tier1.kept)


@dataclass(frozen=True)
class Recovered:
    """Tier 3's result after ``--recover`` (every frontier plan measured again after the fine-tune), or as it was."""

    budget: BudgetResult
    seconds: dict[str, float] = field(default_factory=dict)


def recovered(ctx: PassContext, refs: References, searched: Searched, sensitivity: Sensitivity,
              recovery: "RecoveryOptions") -> Recovered:
    """``--recover``: every frontier plan measured again after the recovery fine-tune, each from the factors it was
    measured at (the gradient pass's loss-aware ones, where the search had them)."""
    if recovery.steps is None:
        return Recovered(searched.budget)
    from .budget import recover_frontier

    t = time.perf_counter()
    with ctx.progress.phase("tier 3 recovery", unit="plan"):
        out = recover_frontier(ctx.model, ctx.session, searched.budget, recovery,
                               progress=lambda done, total: ctx.progress.update(done, total),
                               reference=refs.evaluator, kept=sensitivity.loss_metric)
    return Recovered(out, {"recovery": time.perf_counter() - t})


@dataclass(frozen=True)
class Verified:
    """The plan chosen by its interval on the rows the search never read, the evaluations that took, and a warning
    when they are too few to resolve the tolerance."""

    budget: BudgetResult
    evaluations: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()


def verified(ctx: PassContext, refs: References, budget: BudgetResult, reuse: TruncatorStore,
             loss_metric: "LossMetric | None" = None) -> Verified:
    """The verification (split sessions only): the plan chosen by its interval on the verification rows (each
    candidate measured with the search's truncation), then the chosen plan measured again on the model
    ``factorize`` writes with default flags (:func:`fitted_measurement`; ``loss_metric``: the gradient pass's): the
    number the audit states for it, naming its fit."""
    ver = refs.verifier
    if ver is None:
        return Verified(budget)
    t = time.perf_counter()
    before = ver.evaluations
    with ctx.progress.phase("verification", unit="plan"):
        budget = verify(ctx.model, ctx.session, budget, refs, reuse)
        if budget.plan and budget.verification is not None:
            budget = _fitted(ctx, refs, budget, loss_metric)
    seconds = {"verification": time.perf_counter() - t}
    v = budget.verification or next((p.verification for p in sorted(budget.tries, key=lambda p: p.removed)
                                     if p.verification is not None), None)  # none held: the smallest verified
    warnings: tuple[str, ...] = ()
    if v is not None and v.rows_needed is not None:
        u = v.unseen
        what = (f"a {100 * v.confidence:g}% interval {u.low:.4g} to {u.high:.4g} for an unseen document ({u.label})"
                if u is not None else f"a {100 * v.confidence:g}% interval {v.low:.4g} to {v.high:.4g}"
                if v.low is not None else "no interval")
        warnings = (f"the {v.rows:,} verification rows (held out, never searched) give {what} against the "
                    f"tolerance {ctx.session.metric.tolerance:g}: too few to resolve it; about {v.rows_needed:,} "
                    f"verification rows (about {2 * v.rows_needed:,} held out) would",)
    return Verified(budget, ver.evaluations - before, seconds, warnings)


@dataclass(frozen=True)
class Baselined:
    """Tier 3's result with the uniform whitened truncation (SVD-LLM) measured beside the chosen plan and each
    frontier plan, the measurements that took and their time."""

    budget: BudgetResult
    evaluations: int = 0
    seconds: dict[str, float] = field(default_factory=dict)


def baselined(ctx: PassContext, refs: References, budget: BudgetResult, scope: Scope,
              reuse: TruncatorStore | None) -> Baselined:
    """The baseline in every report: uniform whitened truncation of the planned layers at each measured plan's share
    removed, all at once on its rows (:mod:`~auditor.calibration.tiers.uniform`). ``reuse``: SVD-LLM's
    input-whitened truncations where the search's are (None: a store of its own, the layers decomposed here)."""
    from ..statistics.whiten import part_bytes
    from .uniform import with_baselines

    if not any(p.plan for p in [*budget.frontier, *budget.tries]):
        return Baselined(budget)
    if reuse is None:
        reuse = TruncatorStore(part_bytes(ctx.model, scope.sensitive))
    t = time.perf_counter()
    with ctx.progress.phase("uniform baseline", unit="plan"):
        out, n = with_baselines(ctx, refs, budget, scope.sensitive, reuse)
    return Baselined(out, n, {"baseline": time.perf_counter() - t})


@dataclass(frozen=True)
class Bits:
    """Rank or bits under a byte budget (:mod:`.bits`): the three families' plans and the uniform baselines, each
    measured all at once; None where no byte plan was asked for or no layer can be rewritten."""

    report: "BitsReport | None" = None
    evaluations: int = 0
    seconds: dict[str, float] = field(default_factory=dict)


def bits(ctx: PassContext, refs: References, scope: Scope, loss_metric: "LossMetric | None",
         tiers: "TierOptions", budget: BudgetResult | None = None) -> Bits:
    """The byte plan where ``tiers`` asks for one (``budget_bytes`` or ``bits_per_weight``); ``budget``: the rank
    plan the audit chose, whose size is one of those measured."""
    from .bits import rank_or_bits

    if not tiers.bytes_planned:
        return Bits()
    t = time.perf_counter()
    out = rank_or_bits(ctx, refs, scope, loss_metric, tiers.budget_bytes, tiers.bits_per_weight,
                       str(tiers.write_bits) if tiers.write_bits is not None else None,
                       budget.plan if budget is not None else None)
    n = sum(p.reachable for p in [*out.plans, *out.baselines]) if out is not None else 0
    return Bits(out, n, {"rank or bits": time.perf_counter() - t})


def fitted_measurement(model: "nn.Module", session: CalibrationSession, refs: References, plan: dict[str, int],
                       loss_metric: "LossMetric | None") -> "tuple[Verification | Measurement, str, int]":
    """``plan`` factorized as ``factorize`` fits it with default flags (:func:`~auditor.calibration.apply.default_fit`:
    the sequential fit with block refinement, loss-aware with the gradient pass's moments where the metric has a
    gradient, as :func:`~.sensitivity.loss_metric_for` gives ``factorize`` the kept ``loss_metric``) and measured as
    the plan check measures: on the verification rows with the interval in a split session (a
    :class:`Verification`, whose ``fit`` names the fit), else on the held-out rows (a ``Measurement``); the fit's
    label (:attr:`~auditor.calibration.apply.Fit.label`); the parameters the plan removes."""
    from ..apply import default_fit, fitted_copy
    from ..data.inputs import eval_mode
    from ...surgery import checked_plan, count_params
    from .sensitivity import loss_metric_for

    fit = default_fit(session, loss_metric)
    with session.measuring():
        planned = [l for l, _ in checked_plan(model, plan).values()]
        moments = loss_metric_for(session, model, planned, fit, kept=loss_metric)
        new = fitted_copy(model, plan, session, fit, moments)  # one block's factors alive at once
        removed = count_params(model) - count_params(new)
        with eval_mode(new):
            got = written_measurement(refs, new, fit.label)
    del new
    trim_heap()
    return got, fit.label, removed


def written_measurement(refs: References, new: "nn.Module", fit: str) -> "Verification | Measurement":
    """``new`` (a written model, ``fit`` the label of its fit) measured as the plan check measures: on the
    verification rows with the interval in a split session (a :class:`Verification` naming the fit and the search
    rows), else on every search row (a ``Measurement``). The caller puts ``new`` in eval mode."""
    if refs.verifier is None:
        return refs.evaluator.measure(new)
    return replace(refs.verifier.measure(new), search_rows=refs.search_rows, fit=fit)


def _fitted(ctx: PassContext, refs: References, budget: BudgetResult,
            loss_metric: "LossMetric | None") -> BudgetResult:
    """The chosen plan measured as ``factorize`` writes it (:func:`fitted_measurement`): its number is the audit's.
    Where that model misses the tolerance although the search's truncation held, the next smaller plan that held on
    the search rows is fitted and measured (at most ``VERIFY_TRIES`` in all), and the first that holds is the
    suggestion; none holding, the empty plan: the plan suggested is never one whose written model fails."""
    if budget.chosen_after_recovery:  # the recovered plan: its own verification, fitted as factorize writes it
        fitted, _, _ = fitted_measurement(ctx.model, ctx.session, refs, budget.plan, loss_metric)
        return replace(budget, verification=fitted)
    failing: int | None = None
    for p in [p for p in _candidates(budget) if p.removed <= budget.removed][:VERIFY_TRIES]:
        fitted, _, _ = fitted_measurement(ctx.model, ctx.session, refs, p.plan, loss_metric)
        trim_heap()
        if fitted.ok:  # the plan's row in every table shows the number stated for it: the written model's
            tries, frontier = ([replace(q, verification=fitted) if q.plan == p.plan else q for q in plans]
                               for plans in (budget.tries, budget.frontier))
            return _chosen(budget, p, fitted, tries, frontier)
        failing = p.removed if failing is None else min(failing, p.removed)
    return _dense_plan(ctx.session, budget, budget.removed if failing is None else failing)


def _candidates(budget: BudgetResult) -> list[FrontierPlan]:
    """The plans that held on the search rows within the budget, largest first, each once, the chosen one among
    them."""
    limit = budget.budget * budget.params_before if budget.budget is not None else float("inf")
    seen: set[tuple[tuple[str, int], ...]] = set()
    held = []
    for p in sorted((p for p in budget.tries if p.ok and p.plan and p.removed <= limit),
                    key=lambda p: (-p.removed, p.predicted_cost)):
        key = tuple(sorted(p.plan.items()))
        if key not in seen:
            seen.add(key)
            held.append(p)
    if not held or budget.plan not in [p.plan for p in held]:
        held.insert(0, next((p for p in budget.tries if p.plan == budget.plan), None) or held[0])
    return held


def verify(model: "nn.Module", session: CalibrationSession, budget: BudgetResult, refs: References,
           reuse: TruncatorStore | None = None) -> BudgetResult:
    """Tier 3's plan verified on the held-out rows the search never read: the largest plan that held on the search
    rows whose verification interval ends within the tolerance (at most ``VERIFY_TRIES`` verified, largest first;
    the empty plan when none does: a plan that misses or straddles is never suggested). The dense model is never
    verified: it is the reference. ``budget`` is left as it was: the result is a new one, its tries with their
    verifications."""
    from ..apply import measured_copy

    ver = refs.verifier
    assert ver is not None
    stats = session.stats
    if budget.chosen_after_recovery or not budget.plan:
        if budget.plan:
            with session.measuring():
                v = ver.measure(measured_copy(model, budget.plan, stats, reuse))
            return replace(budget, verification=replace(v, search_rows=refs.search_rows))
        return budget
    chosen: FrontierPlan | None = None
    v: Verification | None = None
    done: dict[int, Verification] = {}  # id of a try -> its verification
    with session.measuring():
        for p in _candidates(budget)[:VERIFY_TRIES]:
            v = ver.measure(measured_copy(model, p.plan, stats, reuse))
            trim_heap()  # the plan's factors handed back before the next
            chosen = p
            done[id(p)] = v = replace(v, search_rows=refs.search_rows)  # every plan verified says so in the report
            if v.ok:
                break
    assert chosen is not None and v is not None
    # a try the frontier holds too (the same plan object) shows its verification there as well
    tries, frontier = ([replace(p, verification=done[id(p)]) if id(p) in done else p for p in plans]
                       for plans in (budget.tries, budget.frontier))
    if not v.ok:  # no plan verified holds: the suggestion is the dense model, never a plan that fails
        return _dense_plan(session, replace(budget, tries=tries, frontier=frontier), chosen.removed)
    return _chosen(budget, chosen, v, tries, frontier)


def _chosen(budget: BudgetResult, chosen: FrontierPlan, v: Verification, tries: list[FrontierPlan],
            frontier: list[FrontierPlan]) -> BudgetResult:
    """``budget`` with ``chosen`` as its plan and ``v`` its verification (the search's plan, when larger, the
    smallest failing)."""
    if chosen.plan == budget.plan:
        return replace(budget, tries=tries, frontier=frontier, verification=v)
    total = budget.params_before
    return replace(budget, tries=tries, frontier=frontier, plan=dict(chosen.plan), removed=chosen.removed,
                   removed_fraction=chosen.removed_fraction, metric=chosen.metric, ok=chosen.ok, top1=chosen.top1,
                   params_after=total - chosen.removed, predicted_cost=chosen.predicted_cost, verification=v,
                   smallest_failing=budget.removed if budget.smallest_failing is None
                   else min(budget.smallest_failing, budget.removed))


def _dense_plan(session: CalibrationSession, budget: BudgetResult, failing: int) -> BudgetResult:
    """``budget`` with the empty plan chosen (the dense model: its own value, nothing removed), ``failing`` the
    smallest plan verified that failed."""
    dense = 0.0 if session.metric.spec.zero_on_dense else budget.reference
    low = failing if budget.smallest_failing is None else min(budget.smallest_failing, failing)
    return replace(budget, plan={}, removed=0, removed_fraction=0.0, metric=dense, ok=True, top1=None,
                   params_after=budget.params_before, predicted_cost=0.0, verification=None, smallest_failing=low)


__all__ = ["Baselined", "Floored", "PassContext", "Recovered", "References", "Scope", "Searched", "Span", "Tier1", "VERIFY_BACKSTOPS",
           "VERIFY_TRIES", "Verified", "baselined", "curves_for", "fitted_measurement", "floors", "recovered", "scope_of", "search",
           "references", "sensitivity", "sweepable", "tier1", "verified", "verify", "written_measurement"]
