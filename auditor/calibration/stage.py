"""The pipeline's calibration stage: the three tiers run on an audit's layers, turned into plain data
(:class:`auditor.calresults.CalibrationReport`), data-aware suggestions, and the reviewed plan measured all at once.

    calibrate          nn.Module, [Layer], Settings, AuditOptions  -> Calibrated (report + what later steps reuse)
    suggest_with       [Layer], {layer: Suggestion}, report, Settings -> {layer: Suggestion} (data-aware ranks)
    check_plan         Calibrated, nn.Module, Audit               -> CalibrationReport with .plan_check

Everything is measured through one :class:`~auditor.calibration.session.CalibrationSession` (the batches, the input
statistics, cached on disk under ``<cache dir>/calibration/<key>/`` and keyed by everything that determines them,
:func:`~auditor.calibration.session.statistics_key`, the metric and one evaluator); ``Calibrated`` keeps it
for the plan check and for ``lowrank-audit factorize``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from .. import kinds, lrmath
from ..calresults import (
    CalibrationReport, LayerCalibration, PlanCheck, subsample,
)
from ..errors import AuditError
from ..results import Layer, Suggestion, Verdict
from .inputs import Calibration
from .metric import Metric
from .session import STATS_KINDS, CalibrationSession, _statistics, cache_path, metric_of, statistics_memory
from .stats import InputStatistics
from .whiten import WhitenedSpectrum

__all__ = ["Calibrated", "STATS_KINDS", "_statistics", "cache_path", "calibrate", "check_plan", "metric_of",
           "statistics_memory", "suggest_with"]

if TYPE_CHECKING:
    from ..config import Settings
    from ..options import AuditOptions
    from ..progress import Progress
    from ..results import Audit, Spectrum

SYNTHETIC_MARK = "looks like token ids drawn uniformly at random"


@dataclass(frozen=True)
class Calibrated:
    """The report, the session the plan check (and the CLI's factorize) measure with, and the tier-1 spectra."""

    report: CalibrationReport
    session: CalibrationSession
    spectra: dict[str, WhitenedSpectrum]
    sweep: str = ""  # where tier 2 ran: "local", "dask tcp://HOST:PORT (N workers)"; empty without tier 2
    gradients: Any = None  # the gradient sensitivity (auditor/calibration/fisher.py) tier 3 searched over, if any
    reuse: Any = None  # tier 3's decompositions (budget.Decompositions), reused by the plan check

    @property
    def calibration(self) -> Calibration:
        return self.session.calibration

    @property
    def stats(self) -> InputStatistics:
        return self.session.stats

    @property
    def metric(self) -> Metric:
        return self.session.metric


def _sweepable(layer: Layer, settings: "Settings") -> bool:
    """The layers the suggestions consider: not narrow (same gate as the weight-energy suggestion)."""
    return (layer.share >= settings.min_share and layer.break_even >= settings.min_break_even
            and lrmath.max_useful_rank(layer.m, layer.n) >= 1)


def _span(inp: Any) -> tuple[int, bool]:
    """(input rows the calibration reached, whether that is all of them): for an embedding the ids looked up at
    least once (a position table read only up to the calibration's sequence length, a vocabulary's unseen ids);
    for other layers the rows of X, which cannot span the input width when fewer. (A Gram of full row count but lower
    rank is left alone: a LayerNorm's output lies in a hyperplane for every input, held-out or not.)"""
    import numpy as np

    if inp.diagonal:
        seen = int(np.count_nonzero(inp.gram > 0))
        return seen, seen == inp.width
    return int(inp.rows), inp.rows >= inp.width


def _fixed_ranks(layers: list[Layer], suggestions: dict[str, Suggestion], planned: set[str],
                 per: dict[str, LayerCalibration], settings: "Settings") -> dict[str, int]:
    """The layers every measured plan includes at their data-free rank: factorized by the weight-energy suggestion,
    rewritable by ``factorize``, but not ranked by calibration (no statistics, or inputs it did not span)."""
    from ..factorize import SUPPORTED

    out: dict[str, int] = {}
    for layer in layers:
        sg = suggestions.get(layer.name)
        if (layer.name in planned or sg is None or sg.verdict is not Verdict.FACTORIZE or sg.rank is None
                or layer.aliases or layer.kind not in SUPPORTED):
            continue
        lc = per.get(layer.name)
        if lc is None or not lc.spans:
            out[layer.name] = sg.rank
    return out


def one_blas_thread(fn: Any) -> Any:
    """Run ``fn`` with NumPy's BLAS on one thread: the decompositions here are many small eigh calls, and
    OpenBLAS threads spinning against torch's (or another process's) took a 512 x 512 eigh from 0.17 s to 2.8 s
    on the 2-core machine under load."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from threadpoolctl import threadpool_limits

        with threadpool_limits(limits=1, user_api="blas"):
            return fn(*args, **kwargs)

    return wrapper


@one_blas_thread
def calibrate(model: nn.Module, layers: list[Layer], settings: "Settings", options: "AuditOptions",
              suggestions: dict[str, Suggestion] | None = None, progress: "Progress | None" = None) -> Calibrated:
    """Tier 1 on every layer; tier 2 (``options.measure_floor``) on the layers that are not narrow and whose inputs
    the calibration spans; tier 3 always: the largest plan over the measured (or tier-1) curves that holds the
    tolerance all at once (``options.budget``: at most that share removed). ``suggestions`` (the data-free ones) give
    the ranks of the layers calibration cannot rank, which every plan measured then includes. Bad calibration data
    raises :class:`AuditError` with one line. ``progress`` (default: none drawn) gets one phase per step: calibration
    data, statistics (per batch), tier 1 (per layer), tier 2 (per layer, evaluations so far; a cluster sweep draws its
    own), tier 3 (plans measured so far)."""
    from ..progress import Progress
    from .budget import curves_from_floors, curves_from_gradients, curves_from_spectra, plan_for_budget
    from .fisher import predicted_value
    from .sweep import measure_floors
    if any(p.device.type == "meta" for p in model.parameters()):
        raise AuditError("calibration needs real weights; this model's weights are on the meta device",
                         "Audit a model with weights (not --structure-only) to use --calibration")
    progress = progress or Progress(enabled=False)
    was_training = model.training
    model.eval()
    try:
        t0 = time.perf_counter()
        with progress.phase("calibration data"):
            session = CalibrationSession.from_options(model, layers, options)
            cal, metric = session.calibration, session.metric
            if metric.kind == "user" and not metric.higher_is_better:  # the report reads a user metric so
                raise AuditError(f"metric {metric.label} is declared lower-is-better; the audit's reports read a "
                                 "user metric as higher-is-better", "Return the negative (e.g. -loss) from the "
                                 "metric, or measure with the library calls (measure_floors, plan_for_budget)")
        target = metric.tolerance if metric.output_error else 0.01
        with progress.phase("statistics", total=len(cal.fit), unit="batch"):  # and tier 1, block by block
            stats = session.statistics(progress=progress, spectra=(settings.align, target))
            cached = session.cached
        with progress.phase("tier 1 spectra", total=sum(1 for l in layers if l.name in stats.layers)):
            spectra = session.spectra(settings.align, target, progress=progress.update)
        per: dict[str, LayerCalibration] = {}
        for name, spec in spectra.items():
            inp = stats.layers[name]
            per[name] = LayerCalibration(
                name, inp.rows, inp.width, dict(spec.ranks_for), spec.suggested, spec.verdict, spec.reason,
                subsample(spec.error), spec.damping, spec.approximate)
        seconds = {"tier1": time.perf_counter() - t0}
        for name, lc in per.items():
            lc.seen, lc.spans = _span(stats.layers[name])
        swept = [l for l in layers if l.name in spectra and _sweepable(l, settings) and per[l.name].spans]
        evaluations = 0
        floors = None
        reference = 0.0
        sweep_where = ""
        if options.measure_floor and swept:
            t = time.perf_counter()
            if options.scheduler is not None:  # one Dask task per layer (auditor/calibration/cluster.py)
                from .cluster import measure_floors_on_cluster

                floors, sweep_where = measure_floors_on_cluster(model, swept, cal, metric, settings.align, stats,
                                                                spectra, options)  # the workers' own sessions
            else:
                def steps(done: int, total: int, evaluations: int) -> None:
                    progress.update(done, total, note=f"{evaluations} evaluation{'s' if evaluations != 1 else ''}")

                with progress.phase("tier 2 floors", total=len(swept)):
                    floors, sweep_where = measure_floors(model, swept, session, align=settings.align,
                                                         spectra=spectra, steps=steps), "local"
            for name, f in floors.floors.items():
                per[name].floor = f
            evaluations += floors.evaluations
            reference = floors.reference
            seconds["tier2"] = time.perf_counter() - t
        t = time.perf_counter()
        from ..factorize import SUPPORTED

        planned = [l for l in swept if not l.aliases and l.kind in SUPPORTED]
        fixed = _fixed_ranks(layers, suggestions or {}, {l.name for l in planned}, per, settings)
        probes = None
        gradients = None
        if floors is None and options.probe_sensitivity and not options.probe and metric.kind != "user" and planned:
            from .fisher import gradient_sensitivity

            t_grad = time.perf_counter()
            with progress.phase("sensitivity gradients", total=len(cal.fit), unit="batch"):
                with session.measuring():
                    gradients = gradient_sensitivity(model, [*planned, *(l for l in layers if l.name in fixed)],
                                                     cal, metric, stats, spectra,
                                                     progress=progress.update)
            seconds["gradients"] = time.perf_counter() - t_grad
            t += seconds["gradients"]
            for name, c in gradients.costs.items():
                if name in per:
                    per[name].predicted = [(r, predicted_value(c[r], gradients.linear)) for r, _ in per[name].curve
                                           if r < len(c)]
        if floors is None and options.probe_sensitivity and options.probe and metric.kind != "user" and planned:
            from .sweep import probe_sensitivity

            t_probe = time.perf_counter()

            def probed(done: int, total: int, n: int) -> None:
                progress.update(done, total, note=f"{n} evaluation{'s' if n != 1 else ''}")

            with progress.phase("sensitivity probes", total=len(planned)):
                probes = probe_sensitivity(model, planned, session, spectra, settings.align, target, steps=probed)
            evaluations += probes.evaluations
            seconds["probes"] = time.perf_counter() - t_probe
            t += seconds["probes"]
            for name, f in probes.floors.items():
                per[name].probes = list(f.points)
        curves = (curves_from_floors(floors, planned, spectra) if floors is not None
                  else curves_from_floors(probes, planned, spectra, source="probed") if probes is not None
                  else curves_from_gradients(gradients, planned, settings.align) if gradients is not None
                  else curves_from_spectra({l.name: spectra[l.name] for l in planned}, planned, settings.align))
        named = {l.name: l for l in planned}
        curves = type(curves)({k: [o for o in v if named[k].compression(o.rank) >= settings.min_compression]
                               for k, v in curves.options.items() if k in named}, curves.source, curves.linear)
        from .rounding import rounding_floor

        # bf16 / fp16 weights: what every plannable layer at full rank (nothing dropped) measures: rounding alone
        t_round = time.perf_counter()
        rounding = rounding_floor(model, [*planned, *(l for l in layers if l.name in fixed)], session)
        if rounding is not None:
            evaluations += 1
            seconds["rounding"] = time.perf_counter() - t_round
            t += seconds["rounding"]
        from .budget import Decompositions

        reuse = Decompositions()  # each layer decomposed once for the search, the verification and the plan check
        with progress.phase("tier 3 plan search", unit="plan"):  # judged against the tolerance as given: the floor is part of every plan's cost
            budget = plan_for_budget(model, layers, session, curves, budget=options.budget, fixed=fixed,
                                     progress=progress.update, reuse=reuse)
        reference = budget.reference
        evaluations += budget.evaluations
        seconds["tier3"] = time.perf_counter() - t
        if options.recover_steps is not None:  # every frontier plan again after the recovery fine-tune
            from .budget import recover_frontier

            t = time.perf_counter()
            with progress.phase("tier 3 recovery", unit="plan"):
                budget = recover_frontier(
                    model, session, budget, steps=options.recover_steps, lr=options.recover_lr,
                    trainable=options.recover_trainable, objective=options.recover_objective,
                    seed=options.recover_seed, choose_after=options.choose_after_recovery,
                    progress=lambda done, total: progress.update(done, total))
            seconds["recovery"] = time.perf_counter() - t
        if session.verifier is not None:  # the plan chosen by its interval on rows the search never read
            t = time.perf_counter()
            with progress.phase("verification", unit="plan"):
                budget = _verify(model, session, budget, stats, reuse)
            seconds["verification"] = time.perf_counter() - t
            evaluations += session.verifier.evaluations
            v = budget.verification
            if v is not None and v.rows_needed is not None:
                what = (f"a {100 * v.confidence:g}% interval {v.low:.4g} to {v.high:.4g}" if v.low is not None
                        else "no interval")
                cal.warnings.append(
                    f"the {v.rows:,} verification rows (held out, never searched) give {what} against the "
                    f"tolerance {metric.tolerance:g}: too few to resolve it; about {v.rows_needed:,} verification "
                    f"rows (about {2 * v.rows_needed:,} held out) would")
        warnings = list(dict.fromkeys([*cal.warnings, *stats.warnings]))
        holdout = options.holdout
        report = CalibrationReport(
            source=(str(options.calibration) if isinstance(options.calibration, (str, Path)) else cal.source)
            + (f" ({cal.tokenized})" if cal.tokenized else ""),
            holdout=str(holdout), digest=cal.digest, fit_rows=cal.fit_rows, holdout_rows=cal.holdout_rows,
            metric=metric.label, higher_is_better=metric.higher_is_better, tolerance=metric.tolerance,
            reference=reference, layers=per, missing=dict(stats.missing), warnings=warnings,
            synthetic=any(SYNTHETIC_MARK in w for w in cal.warnings), measured_floors=floors is not None,
            budget=budget, suggestions_from="measured floors" if floors is not None else "calibration",
            statistics_cached=cached, seconds=seconds, evaluations=evaluations, rounding_floor=rounding,
            compute_dtype=options.compute_dtype)
        return Calibrated(report, session, spectra, sweep_where, gradients, reuse)
    finally:
        model.train(was_training)


VERIFY_TRIES = 6  # plans verified at most, from the largest that held on the search rows down


def _verify(model: nn.Module, session: CalibrationSession, budget: Any, stats: InputStatistics,
            reuse: Any = None) -> Any:
    """Tier 3's plan verified on the held-out rows the search never read: the largest plan that held on the search
    rows whose verification interval ends within the tolerance (at most ``VERIFY_TRIES`` verified, largest first;
    the smallest verified stands, said to miss or straddle, when none does). The dense model is never verified: it
    is the reference."""
    from ..factorize import factorize

    ver = session.verifier
    search_rows = sum(b.rows for b in session.search_calibration.holdout)
    if budget.chosen_after_recovery or not budget.plan:
        if budget.plan:
            with session.measuring():
                v = ver.measure(factorize(model, budget.plan, stats, reuse=reuse))
            return replace(budget, verification=replace(v, search_rows=search_rows))
        return budget
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
    chosen = v = None
    with session.measuring():
        for p in held[:VERIFY_TRIES]:
            v = ver.measure(factorize(model, p.plan, stats, reuse=reuse))
            chosen = p
            if v.ok:
                break
    assert chosen is not None and v is not None
    v = replace(v, search_rows=search_rows)
    if chosen.plan == budget.plan:
        return replace(budget, verification=v)
    total = budget.params_before
    return replace(budget, plan=dict(chosen.plan), removed=chosen.removed, removed_fraction=chosen.removed_fraction,
                   metric=chosen.metric, ok=chosen.ok, top1=chosen.top1, params_after=total - chosen.removed,
                   predicted_cost=chosen.predicted_cost, verification=v,
                   smallest_failing=budget.removed if budget.smallest_failing is None
                   else min(budget.smallest_failing, budget.removed))


def suggest_with(layers: list[Layer], spectra: dict[str, "Spectrum"], suggestions: dict[str, Suggestion],
                 report: CalibrationReport, settings: "Settings") -> dict[str, Suggestion]:
    """The suggestions as the plan that holds the tolerance all at once (tier 3, ``report.budget``): its layers at
    its ranks, every other calibrated layer dense. Per-layer floors and tier-1 ranks are evidence in the reasons,
    never the plan. Where calibration did not rank a layer (no statistics, inputs it did not span) the data-free
    suggestion stays; the plan was measured with it. Layers ``factorize`` cannot rewrite are kept dense."""
    from ..factorize import SUPPORTED

    out = dict(suggestions)
    b = report.budget
    plan = b.plan if b is not None else {}
    for layer in layers:
        lc = report.layers.get(layer.name)
        old = suggestions.get(layer.name)
        if lc is None or old is None or old.verdict in (Verdict.SKIP_NARROW, Verdict.SKIPPED) \
                or not _sweepable(layer, settings):
            continue
        if not lc.spans:
            what = "rows looked up" if layer.kind == "embedding" else "calibration rows for its input width"
            note = (f"calibration did not span its inputs ({lc.seen:,} of {lc.width:,} {what}): the data-free "
                    "suggestion stands")
            out[layer.name] = replace(old, reason=f"{note}; {old.reason}")
            continue
        evidence = _evidence(lc, report)
        if layer.kind not in SUPPORTED or layer.aliases:
            refusal = "" if layer.aliases else kinds.for_kind(layer.kind).cannot_factorize
            why = ("tied or shared weight: factorizing one use changes every use" if layer.aliases
                   else f"{layer.kind} cannot be factorized: {refusal}" if refusal  # and was not swept
                   else f"factorize cannot rewrite a {layer.kind} layer, so no plan measured it")
            out[layer.name] = _dense(old, f"keep dense: {why}" + (f" ({evidence})" if evidence and not refusal else ""))
            continue
        r = plan.get(layer.name)
        if r is None:
            held = (f"left dense by the largest plan that holds all at once ({report.metric} {b.metric:.4g} "
                    f"<= {report.tolerance:g})" if b is not None and b.ok and b.plan
                    else "no plan factorizing it held the tolerance all at once")
            out[layer.name] = _dense(old, held + (f"; alone: {evidence}" if evidence else ""))
            continue
        note = report.recovery_note()
        why = ((f"rank {r} in the largest plan that {note} ({len(plan)} layers)" if note else
                f"rank {r} in the plan that holds all at once ({len(plan)} layers, {report.metric} {b.metric:.4g} "
                f"<= {report.tolerance:g})") + (f"; alone: {evidence}" if evidence else ""))
        spec = spectra.get(layer.name)
        kept = spec.energy_at(r) if spec is not None and spec.computed else None
        out[layer.name] = replace(old, verdict=Verdict.FACTORIZE, rank=r, reason=why, energy_at_rank=kept,
                                  error_bound=lrmath.relative_error(kept) if kept is not None else None,
                                  params_after=layer.params_at(r), macs_after=layer.macs_at(r),
                                  compression=layer.compression(r))
    return out


def _dense(old: Suggestion, why: str) -> Suggestion:
    return replace(old, verdict=Verdict.KEEP_DENSE, rank=None, reason=why, energy_at_rank=None, error_bound=None,
                   params_after=None, macs_after=None, compression=None)


def _evidence(lc: LayerCalibration, report: CalibrationReport) -> str:
    """What calibration measured of the layer alone: its measured floor, or its tier-1 rank."""
    f = lc.floor
    if f is not None and f.floor is not None and not f.keep_dense:
        return (f"measured floor {f.floor} ({report.metric} {f.metric_at_floor:.4g})"
                + (f", rank {f.cliff_rank} does not hold" if f.cliff_rank is not None else ""))
    if f is not None:
        return "no rank below break-even holds (measured)"
    if lc.suggested is not None:
        return f"tier-1 rank {lc.suggested} ({lc.reason})"
    return f"tier 1: {lc.reason}" if lc.reason else ""


@one_blas_thread
def check_plan(cal: Calibrated, model: nn.Module, audit: "Audit") -> CalibrationReport:
    """The reviewed plan (or the suggested ranks) factorized all at once with whitened initialisation and measured on
    the held-out part: the model-level metric beside the tier-1 prediction sqrt(sum e_l^2)."""
    from ..factorize import SUPPORTED, count_params, factorize
    from .metric import Measurement

    rv = audit.review
    report = cal.report
    if rv is None or not rv.items:
        return report
    plan: dict[str, int] = {}
    left: list[str] = []
    for it in rv.items:
        layer = audit.layer(it.layer)
        if it.rank > layer.max_rank or layer.kind not in SUPPORTED or layer.aliases:
            left.append(it.layer)
        else:
            plan[it.layer] = it.rank
    if not plan:
        return replace(report, plan_check=PlanCheck(0, left, None, float("nan"), False))
    session = cal.session
    if session.model is not model:
        raise AuditError("the plan check was given another model than the one calibrated",
                         "Check the plan on the audited model")
    verification = None
    with session.measuring():
        new = factorize(model, plan, session, reuse=cal.reuse)
        removed = count_params(model) - count_params(new)
        b = report.budget
        if session.verifier is not None:  # the verification rows, with the interval: memoized for the suggested plan
            verification = (b.verification if b is not None and b.verification is not None and b.plan == plan
                            else replace(session.verifier.measure(new),
                                         search_rows=sum(x.rows for x in session.search_calibration.holdout)))
            m = Measurement(verification.value, verification.ok)
            if b is not None and b.plan == plan:
                m.top1 = b.top1
        else:
            m = session.evaluator.measure(new)
    predicted = None
    basis = ""
    grads = cal.gradients
    if grads is not None and all(k in grads.costs for k in plan):
        from .fisher import predicted_value

        predicted = predicted_value(grads.predicted(plan), grads.linear)
        basis = ("gradient-predicted single-layer cross-entropy increases (output-gradient second moments), which "
                 "add up" if grads.linear else
                 "gradient-predicted single-layer model errors (output-gradient second moments)")
    elif cal.metric.output_error and all(k in cal.spectra for k in plan):
        from .budget import single_layer_error

        def points(k: str) -> list[tuple[int, float]]:
            lc = report.layers.get(k)
            if lc is None:
                return []
            return list(lc.floor.points) if lc.floor is not None else list(lc.probes)

        predicted = math.sqrt(sum(single_layer_error(points(k), cal.spectra[k], r) ** 2 for k, r in plan.items()))
        basis = ("single-layer model errors (measured, or tier-1 errors scaled by the measured gain)"
                 if any(points(k) for k in plan) else "tier-1 layer-output errors")
    check = PlanCheck(len(plan), left, predicted, m.value, m.ok, m.top1, removed, basis, verification)
    reference = (b.reference if session.verifier is not None and b is not None  # the search rows' reference,
                 else session.evaluator.reference)  # measured once by tier 3
    return replace(report, plan_check=check, reference=reference)
