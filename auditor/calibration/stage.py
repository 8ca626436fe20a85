"""The pipeline's calibration stage: the three tiers run on an audit's layers, turned into plain data
(:class:`auditor.calresults.CalibrationReport`), data-aware suggestions, and the reviewed plan measured all at once.

    calibrate          nn.Module, [Layer], Settings, AuditOptions  -> Calibrated (report + what later steps reuse)
                       (the passes of :mod:`~auditor.calibration.tiers.passes`, composed: tier1, scope_of, floors,
                       sensitivity, search, recovered, verified, baselined; each returns a frozen result)
    suggest_with       [Layer], {layer: Suggestion}, report, Settings -> {layer: Suggestion} (data-aware ranks)
    check_plan         Calibrated, nn.Module, Audit               -> CalibrationReport with .plan_check

Everything is measured through one :class:`~auditor.calibration.session.CalibrationSession` (the batches, the input
statistics, cached on disk under ``<cache dir>/calibration/<key>/`` and keyed by everything that determines them,
:func:`~auditor.calibration.session.statistics_key`, the metric and one evaluator); ``Calibrated`` keeps it
for the plan check and for ``lowrank-audit factorize``.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

from torch import nn

from .. import kinds, lrmath
from ..calresults import CalibrationReport, LayerCalibration, PlanCheck, Verification, looser_plans, subsample
from ..errors import AuditError
from ..results import Layer, Suggestion, TieGroup, Verdict
from .data.inputs import Calibration, eval_mode
from .data.precision import computing_in
from .statistics.stream import compute_dtype_for
from .measure.metric import Measurement, Metric
from .session import STATS_KINDS, CalibrationSession, _statistics, cache_path, metric_of, statistics_memory
from .statistics.stats import InputStatistics
from .statistics.whiten import LossMetric, WhitenedSpectrum
from .references import References
from .tiers import passes
from .tiers.fisher import GradientSensitivity
from .tiers.sensitivity import Gradients, Sensitivity

__all__ = ["Calibrated", "STATS_KINDS", "_statistics", "cache_path", "calibrate", "check_plan", "computing",
           "metric_of", "session_dtype", "statistics_memory", "suggest_with"]

if TYPE_CHECKING:
    from ..config import Settings
    from ..options import AuditOptions
    from ..progress import Progress
    from ..results import AuditResult, Spectrum

SYNTHETIC_MARK = "looks like token ids drawn uniformly at random"


@dataclass(frozen=True)
class Calibrated:
    """The report, the session the plan check (and the CLI's factorize) measure with, its references (the dense
    model measured), the tier-1 spectra, and what the passes learned that factorize and the plan check read."""

    report: CalibrationReport
    session: CalibrationSession
    references: References
    spectra: dict[str, WhitenedSpectrum]
    sweep: str = ""  # where tier 2 ran: "local", "dask tcp://HOST:PORT (N workers)"; empty without tier 2
    gradients: "GradientSensitivity | None" = None  # the gradient sensitivity tier 3 searched over, if any
    loss_metric: "LossMetric | None" = None  # the gradient pass's loss-aware truncations and moments (factorize)

    @property
    def calibration(self) -> Calibration:
        return self.session.calibration

    @property
    def stats(self) -> InputStatistics:
        return self.session.stats

    @property
    def metric(self) -> Metric:
        return self.session.metric


F = TypeVar("F", bound=Callable[..., object])


def one_blas_thread(fn: F) -> F:
    """Run ``fn`` with NumPy's BLAS on one thread: the decompositions here are many small eigh calls, and
    OpenBLAS threads spinning against torch's (or another process's) took a 512 x 512 eigh from 0.17 s to 2.8 s
    on the 2-core machine under load."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> object:
        from threadpoolctl import threadpool_limits

        with threadpool_limits(limits=1, user_api="blas"):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


@one_blas_thread
def calibrate(model: nn.Module, layers: list[Layer], settings: "Settings", options: "AuditOptions",
              progress: "Progress | None" = None) -> Calibrated:
    """Tier 1 on every layer; tier 2 (``options.tiers.measure_floor``) on the layers that are not narrow and whose
    inputs the calibration spans; tier 3 always: the largest plan over the measured (or tier-1) curves that holds the
    tolerance all at once (``options.tiers.budget``: at most that share removed). A layer calibration cannot rank
    (no statistics, inputs it did not span) is in no plan measured: the suggestions keep it dense. Bad
    calibration data raises :class:`AuditError` with one line. ``progress`` (default: none drawn) gets one phase per
    pass: calibration data, statistics (per batch), tier 1 (per layer), tier 2 (per layer, evaluations so far; a
    cluster sweep draws its own), the sensitivity, tier 3 (plans measured so far), the verification. The passes
    (:mod:`~auditor.calibration.tiers.passes`) each return a frozen result; the report's rows are built once from
    them."""
    from ..progress import Progress

    if any(p.device.type == "meta" for p in model.parameters()):
        raise AuditError("calibration needs real weights; this model's weights are on the meta device",
                         "Audit a model with weights (not --structure-only) to use --calibration")
    progress = progress or Progress(enabled=False)
    tiers = options.tiers
    was_training = model.training
    model.eval()
    try:
        with computing(model, options.statistics.compute_dtype):
            t = time.perf_counter()
            ctx = passes.PassContext(model, _open_session(model, layers, options, progress), progress)
            t1 = passes.tier1(ctx, settings.align, since=t, keep=passes.plannable(layers, settings))
            refs = passes.references(ctx)
            scope = passes.scope_of(layers, t1, settings, _ties(layers, options))
            floored = passes.floors(ctx, refs, t1, scope, tiers, options.cluster, options.progress)
            sens = passes.sensitivity(ctx, refs, t1, scope, floored, tiers)
            searched = passes.search(ctx, refs, t1, scope, sens, tiers, settings)
            recovered = passes.recovered(ctx, refs, searched, sens, options.recovery)
            verified = passes.verified(ctx, refs, recovered.budget, searched.reuse, sens.loss_metric)
            based = passes.baselined(ctx, refs, verified.budget, scope, searched.baseline_reuse)
            byte_plan = passes.bits(ctx, refs, scope, sens.loss_metric, tiers, based.budget)
            tiers_run = Tiers(t1, refs, floored, sens, searched, recovered, verified, based, byte_plan)
            return Calibrated(_report(ctx.session, options, tiers_run), ctx.session, refs, t1.spectra,
                              floored.where if floored is not None else "",
                              sens.gradients if isinstance(sens, Gradients) else None,
                              loss_metric=sens.loss_metric)
    finally:
        model.train(was_training)


def through_sensitivity(model: nn.Module, layers: list[Layer], settings: "Settings", options: "AuditOptions",
                        ) -> "tuple[passes.PassContext, References, passes.Scope, Sensitivity]":
    """The passes up to the sensitivity, run as :func:`calibrate` runs them (tier 1, the references, the scope, the
    gradient pass; no tier 2): what a pass after them (the byte plan) is run on by benchmarks and tests."""
    from ..progress import Progress

    progress = Progress(enabled=False)
    ctx = passes.PassContext(model, _open_session(model, layers, options, progress), progress)
    t1 = passes.tier1(ctx, settings.align)
    refs = passes.references(ctx)
    scope = passes.scope_of(layers, t1, settings, _ties(layers, options))
    return ctx, refs, scope, passes.sensitivity(ctx, refs, t1, scope, None, options.tiers)


def computing(model: nn.Module, compute_dtype: "str | None") -> "contextlib.AbstractContextManager[bool]":
    """Every forward the calibration runs in ``compute_dtype`` (``--compute-dtype float32``: a bf16/fp16 model's
    weights cast a module at a time while it runs, :func:`~auditor.calibration.data.precision.computing_in`)."""
    return computing_in(model, compute_dtype_for(compute_dtype))


def session_dtype(session: CalibrationSession) -> "str | None":
    """The compute dtype the session's audit measured in (None: the model's own)."""
    return session.options.statistics.compute_dtype if session.options is not None else None


def _ties(layers: list[Layer], options: "AuditOptions") -> tuple[TieGroup, ...]:
    """The tie groups of ``options.tiers.ties`` over the layers (the pipeline resolved them once already, so they
    resolve here without error)."""
    if not options.tiers.ties:
        return ()
    from ..planning.ties import resolve_ties

    return resolve_ties(layers, options.tiers.ties)


def _open_session(model: nn.Module, layers: list[Layer], options: "AuditOptions",
                  progress: "Progress") -> CalibrationSession:
    """The calibration data and the session that measures with it (a user metric must be higher-is-better)."""
    with progress.phase("calibration data"):
        session = CalibrationSession.from_options(model, layers, options)
        session.metric.check_reportable()
    return session


@dataclass(frozen=True)
class Tiers:
    """What the passes returned, in their order: what the report is built from."""

    tier1: passes.Tier1
    references: References
    floored: passes.Floored | None
    sensitivity: Sensitivity
    searched: passes.Searched
    recovered: passes.Recovered
    verified: passes.Verified
    baselined: passes.Baselined
    bits: passes.Bits = passes.Bits()

    @property
    def seconds(self) -> dict[str, float]:
        """Every pass's wall time, in their order."""
        out: dict[str, float] = {}
        for part in (self.tier1, self.references, self.floored, self.sensitivity, self.searched, self.recovered,
                     self.verified, self.baselined, self.bits):
            out.update(part.seconds if part is not None else {})
        return out

    @property
    def evaluations(self) -> int:
        """The model-level evaluations of tiers 2 and 3 (the floors, the probes, the rounding floor, the search, the
        verification, the uniform baseline)."""
        floors = self.floored.floors.evaluations if self.floored is not None else 0
        return (floors + self.sensitivity.evaluations + self.searched.evaluations + self.verified.evaluations
                + self.baselined.evaluations + self.bits.evaluations)


def _rows(tiers: Tiers) -> dict[str, LayerCalibration]:
    """The report's per-layer rows, each built once from tier 1, tier 2's floor and the sensitivity's evidence."""
    out: dict[str, LayerCalibration] = {}
    floors = tiers.floored.floors.floors if tiers.floored is not None else {}
    sens = tiers.sensitivity
    for name, spec in tiers.tier1.spectra.items():
        span = tiers.tier1.spans[name]
        curve = subsample(spec.error)
        out[name] = LayerCalibration(
            name, span.rows, span.width, dict(spec.ranks_for), spec.suggested, spec.verdict, spec.reason, curve,
            spec.damping, spec.approximate, floor=floors.get(name), seen=span.seen, spans=span.spans,
            probes=sens.probes(name), predicted=sens.predicted(name, [r for r, _ in curve]))
    return out


def _report(session: CalibrationSession, options: "AuditOptions", tiers: Tiers) -> CalibrationReport:
    metric, data = session.metric, options.calibration_data
    cal, stats = session.calibration, session.stats
    measured = tiers.floored is not None
    source = str(data.source) if isinstance(data.source, (str, Path)) else cal.source
    report = CalibrationReport(
        source=source + (f" ({cal.tokenized})" if cal.tokenized else ""),
        holdout=str(data.holdout), digest=cal.digest, fit_rows=cal.fit_rows, holdout_rows=cal.holdout_rows,
        metric=metric.label, higher_is_better=metric.higher_is_better, tolerance=metric.tolerance,
        reference=tiers.searched.budget.reference, layers=_rows(tiers), missing=dict(stats.missing),
        warnings=list(dict.fromkeys([*cal.warnings, *tiers.references.warnings, *tiers.verified.warnings,
                                     *stats.warnings])),
        synthetic=any(SYNTHETIC_MARK in w for w in cal.warnings), measured_floors=measured,
        budget=tiers.searched.tie_costed(tiers.baselined.budget).settled(),
        suggestions_from="measured floors" if measured else "calibration",
        statistics_cached=tiers.tier1.cached, seconds=tiers.seconds, evaluations=tiers.evaluations,
        rounding_floor=tiers.searched.rounding, compute_dtype=options.statistics.compute_dtype,
        tier1_target=tiers.tier1.target, increase_of=metric.spec.increase_of,
        sensitivity_fallback=tiers.sensitivity.fallback,
        limit=metric.spec.limit(tiers.searched.budget.reference, metric.tolerance, metric.higher_is_better),
        display=metric.spec.display(metric.higher_is_better))
    if tiers.bits.report is not None:  # its verdict in the metric's own words
        report = replace(report, bits=replace(tiers.bits.report, verdict=tiers.bits.report.sentence(report.facts)))
    b = report.budget
    if b is None or b.plan or b.nothing_to_plan:
        return report
    return replace(report, budget=replace(b, looser=looser_plans(b, report.facts)))  # what looser tolerances buy


def suggest_with(layers: list[Layer], spectra: dict[str, "Spectrum"], suggestions: dict[str, Suggestion],
                 report: CalibrationReport, settings: "Settings") -> dict[str, Suggestion]:
    """The suggestions as the plan that holds the tolerance all at once (tier 3, ``report.budget``): its layers at
    its ranks, every other calibrated layer dense. Per-layer floors and tier-1 ranks are evidence in the reasons,
    never the plan. Where calibration did not rank a layer (no statistics, inputs it did not span: an embedding with
    ids the calibration never looks up) it is kept dense: nothing in a calibrated plan is on a data-free guess. Layers
    ``factorize`` cannot rewrite are kept dense."""
    from ..kinds.registry import SUPPORTED

    out = dict(suggestions)
    b = report.budget
    plan = b.plan if b is not None else {}
    for layer in layers:
        lc = report.layers.get(layer.name)
        old = suggestions.get(layer.name)
        if old is None or old.verdict in (Verdict.SKIP_NARROW, Verdict.SKIPPED) \
                or not passes.sweepable(layer, settings):
            continue
        if lc is None:  # no statistics: no plan measured it, so it is not planned on a data-free guess
            if old.verdict is Verdict.FACTORIZE:
                why = report.missing.get(layer.name, "calibration read no statistics for it")
                out[layer.name] = _dense(old, f"keep dense: {why}, so no plan measured it")
            continue
        if not lc.spans:
            what = ("rows looked up" if kinds.for_kind(layer.kind).lookup_counts
                    else "calibration rows for its input width")
            out[layer.name] = _dense(old, f"calibration did not span its inputs ({lc.seen:,} of {lc.width:,} {what}): "
                                          "kept dense, as no plan measured it (a data-free rank would be a guess; "
                                          f"data-free: {old.reason})")
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
def check_plan(cal: Calibrated, model: nn.Module, audit: "AuditResult") -> CalibrationReport:
    """The reviewed plan (or the suggested ranks) factorized all at once as ``factorize`` writes it with default flags
    (:func:`~auditor.calibration.apply.default_fit`: the sequential fit; ``PlanCheck.fit`` names it) and measured on
    the held-out part: the model-level metric beside the tier-1 prediction sqrt(sum e_l^2)."""
    rv = audit.review
    report = cal.report
    if rv is None or not rv.items:
        return report
    plan, left = _reviewed_plan(audit)
    if not plan:
        return replace(report, plan_check=PlanCheck(0, left, None, float("nan"), False))
    if cal.session.model is not model:
        raise AuditError("the plan check was given another model than the one calibrated",
                         "Check the plan on the audited model")
    with computing(model, session_dtype(cal.session)):
        m, removed, verification, fit = _measured_plan(cal, model, plan)
    predicted, basis = _predicted(cal, plan)
    check = PlanCheck(len(plan), left, predicted, m.value, m.ok, m.top1, removed, basis, verification, fit)
    b = report.budget
    reference = (b.reference if cal.references.verifier is not None and b is not None  # the search rows' reference,
                 else cal.references.evaluator.reference)  # measured once by tier 3
    return replace(report, plan_check=check, reference=reference)


def _reviewed_plan(audit: "AuditResult") -> tuple[dict[str, int], list[str]]:
    """(the reviewed ranks factorize can apply, the reviewed layers it cannot: beyond full rank, a kind it does not
    rewrite, tied)."""
    from ..kinds.registry import SUPPORTED

    plan: dict[str, int] = {}
    left: list[str] = []
    for it in audit.review.items:  # type: ignore[union-attr]
        layer = audit.layer(it.layer)
        if it.rank > layer.max_rank or layer.kind not in SUPPORTED or layer.aliases:
            left.append(it.layer)
        else:
            plan[it.layer] = it.rank
    return plan, left


def _measured_plan(cal: Calibrated, model: nn.Module, plan: dict[str, int],
                   ) -> tuple[Measurement, int, Verification | None, str]:
    """(the plan's measurement, parameters removed, its verification or None, the fit measured): the plan fitted as
    ``factorize`` fits it by default (:func:`~.tiers.passes.fitted_measurement`), on the verification rows with the
    interval in a split session (the suggested plan's verification and removal reused: the verification pass
    measured it so already), else on the held-out rows."""
    refs, b = cal.references, cal.report.budget
    suggested = b is not None and b.plan == plan
    if suggested and refs.verifier is not None and b.verification is not None and b.verification.fit:
        verification, removed = b.verification, b.removed  # measured on the written fit: nothing to factorize
    else:
        got, fit, removed = passes.fitted_measurement(model, cal.session, refs, plan, cal.loss_metric)
        if refs.verifier is None:
            return got, removed, None, fit  # type: ignore[return-value]
        verification = got  # type: ignore[assignment]
    m = Measurement(verification.value, verification.ok)
    if suggested:
        m.top1 = b.top1
    return m, removed, verification, verification.fit


def check_factorized(report: CalibrationReport, cal: Calibrated, model: nn.Module,
                     new: nn.Module, fit: str = "") -> CalibrationReport:
    """The plan check again, on ``new``: the plan factorized otherwise than the check factorized it (``fit``, the
    label of ``new``'s fit: ``lowrank-audit factorize --fit`` other than the default), measured as the check measures
    (on the verification rows with the interval in a split session, else on the held-out rows), so the number
    written beside a model is that model's, naming its fit."""
    from ..surgery import count_params

    pc = report.plan_check
    if pc is None or pc.layers == 0:
        return report
    removed = count_params(model) - count_params(new)
    session, refs = cal.session, cal.references
    # eval_mode: a copy made outside measuring() has the model's own modes
    with session.measuring(), eval_mode(new), computing(model, session_dtype(session)):
        got = passes.written_measurement(refs, new, fit)
    if refs.verifier is None:
        check = replace(pc, measured=got.value, ok=got.ok, top1=got.top1, removed=removed, verification=None, fit=fit)
    else:
        check = replace(pc, measured=got.value, ok=got.ok, top1=None, removed=removed, verification=got, fit=fit)
    return replace(report, plan_check=check)


def _predicted(cal: Calibrated, plan: dict[str, int]) -> tuple[float | None, str]:
    """(the plan's predicted metric, what it is predicted from): the gradient-predicted costs where every layer has
    them, else for the output error the single-layer errors in quadrature; (None, "") otherwise."""
    grads, report = cal.gradients, cal.report
    if grads is not None and all(k in grads.costs for k in plan):
        from .tiers.fisher import predicted_value

        fb = report.sensitivity_fallback
        probed = (" and truncation probes where no gradient reached" if fb is not None and set(fb.layers) & set(plan)
                  else "")
        words = cal.metric.spec.predicted_words
        return predicted_value(grads.predicted(plan), grads.linear), (
            f"gradient-predicted single-layer {words} (output-gradient second moments{probed}), which add up"
            if grads.linear else f"gradient-predicted single-layer {words} (output-gradient second moments{probed})")
    if not (cal.metric.output_error and all(k in cal.spectra for k in plan)):
        return None, ""
    from .tiers.budget import single_layer_error

    def points(k: str) -> list[tuple[int, float]]:
        lc = report.layers.get(k)
        if lc is None:
            return []
        return list(lc.floor.points) if lc.floor is not None else list(lc.probes)

    predicted = math.sqrt(sum(single_layer_error(points(k), cal.spectra[k], r) ** 2 for k, r in plan.items()))
    return predicted, ("single-layer model errors (measured, or tier-1 errors scaled by the measured gain)"
                       if any(points(k) for k in plan) else "tier-1 layer-output errors")
