"""The pipeline's calibration stage: the three tiers run on an audit's layers, turned into plain data
(:class:`auditor.calresults.CalibrationReport`), data-aware suggestions, and the reviewed plan measured all at once.

    calibrate          nn.Module, [Layer], Settings, AuditOptions  -> Calibrated (report + what later steps reuse)
    suggest_with       [Layer], {layer: Suggestion}, report, Settings -> {layer: Suggestion} (data-aware ranks)
    check_plan         Calibrated, nn.Module, Audit               -> CalibrationReport with .plan_check

Input statistics are cached on disk (``<cache dir>/calibration/<key>.npz``), keyed by a hash of every weight and
buffer of the model, the calibration's digest and the layer names.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from .. import lrmath
from ..calresults import (
    BudgetResult, CalibrationReport, FrontierPlan, LayerCalibration, LayerFloor, PlanCheck, subsample,
)
from ..errors import AuditError
from ..results import Kind, Layer, Suggestion, Verdict
from .hashing import weights_hash
from .inputs import Calibration, load_calibration
from .metric import Evaluator, Metric, load_metric
from .stats import InputStatistics
from .whiten import WhitenedSpectrum

if TYPE_CHECKING:
    from ..config import Settings
    from ..options import AuditOptions
    from ..progress import Progress
    from ..results import Audit, Spectrum

SYNTHETIC_MARK = "looks like token ids drawn uniformly at random"


@dataclass(frozen=True)
class Calibrated:
    """The report, and the objects the plan check reuses (the batches, statistics, tier-1 spectra, metric)."""

    report: CalibrationReport
    calibration: Calibration
    stats: InputStatistics
    spectra: dict[str, WhitenedSpectrum]
    metric: Metric
    sweep: str = ""  # where tier 2 ran: "local", "dask tcp://HOST:PORT (N workers)"; empty without tier 2


def cache_path(cache_dir: Path | None, model: nn.Module, calibration: Calibration, layers: list[Layer]) -> Path:
    from ..spectra import default_cache_dir

    key = hashlib.sha256("|".join([weights_hash(model), calibration.digest, *sorted(l.name for l in layers)])
                         .encode()).hexdigest()
    return (cache_dir or default_cache_dir()) / "calibration" / f"{key}.npz"


STATS_KINDS = (Kind.LINEAR, Kind.CONV1D_HF, Kind.CONV, Kind.EMBEDDING, Kind.RNN, Kind.MHA_IN_PROJ)  # what is read


def statistics_memory(layers: list[Layer]) -> tuple[int, str]:
    """Bytes the input statistics of ``layers`` take, and the largest one in words: a float64 Gram, groups x n x n,
    per layer (a vector of n lookup counts for an embedding), plus two more of the largest: one batch's Gram being
    added to the running sum, and the new sum."""
    sizes: list[tuple[int, str]] = []
    for l in layers:
        if l.kind not in STATS_KINDS:
            continue
        if l.kind == Kind.EMBEDDING:
            sizes.append((8 * l.m, f"layer {l.name} ({l.m:,} lookup counts)"))
        else:
            g = max(1, int(l.groups or 1))
            sizes.append((8 * g * l.n * l.n, f"layer {l.name} ({'%d x ' % g if g > 1 else ''}{l.n:,} x {l.n:,})"))
    if not sizes:
        return 0, ""
    big = max(sizes)
    return sum(b for b, _ in sizes) + 2 * big[0], big[1]


def _statistics(model: nn.Module, layers: list[Layer], cal: Calibration, options: "AuditOptions",
                progress: "Progress | None" = None) -> tuple[InputStatistics, bool]:
    """The input statistics of ``layers``: from the cache when an entry saved under this key is intact and fits
    the layers (checksum, shapes, finite, symmetric, PSD checks), else computed (and cached). Refused with one line,
    before any is allocated, when the float64 Grams need more memory than is available."""
    from ..spectra.backend import available_memory
    from .inputs import size_text
    from .stats import StatisticsMismatch, by_name, gram_problem

    need, largest = statistics_memory(layers)
    avail = available_memory()
    if avail is not None and need > avail:
        raise AuditError(f"calibration statistics need about {size_text(need)} of memory (a float64 Gram n x n per "
                         f"layer input; the largest: {largest}), and {size_text(avail)} is available",
                         "Run on a machine with more memory, or audit without --calibration (the weight spectra "
                         "need no input Grams)")
    path = cache_path(options.cache_dir, model, cal, layers) if options.cache else None
    named = by_name(layers)
    if path is not None and path.is_file():
        try:
            stats = InputStatistics.load(path, key=path.stem)
            for name, inp in stats.layers.items():
                layer = named.get(name)
                if layer is None or inp.width != (layer.m if inp.diagonal else layer.n) or gram_problem(inp):
                    raise StatisticsMismatch(f"{name} does not fit the layer")
            if stats.digest != cal.digest or set(stats.layers) | set(stats.missing) != set(named):
                raise StatisticsMismatch("another calibration or other layers")
            if progress is not None:
                progress.update(len(cal.fit), len(cal.fit), note="cached")
            return stats, True
        except Exception:  # noqa: BLE001 - a damaged, foreign or invalid entry is recomputed (and replaced)
            pass
    try:
        from .stream import stream_statistics  # block by block when the model has repeated blocks, else one pass

        stats = stream_statistics(model, layers, cal, device=options.device, offload=options.offload,
                                  progress=progress.update if progress is not None else None)
    except AuditError:
        raise
    except Exception as exc:  # noqa: BLE001 - a batch the forward refuses, said in one line
        from ..errors import first_line

        raise AuditError(f"the forward failed on the calibration batches while reading input statistics: "
                         f"{first_line(exc)}", "Give every batch the inputs and width the model takes") from None
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp")
            stats.save(tmp, key=path.stem)
            tmp.replace(path)
        except OSError:  # a read-only cache is not an error
            pass
    return stats, False


def metric_of(options: "AuditOptions", model: nn.Module | None = None, cal: Calibration | None = None) -> Metric:
    """The metric ``options.metric`` names: "perplexity", "kl", "output-error", ``file.py:fn`` / ``module:fn``, a
    function, or a ``Metric``; None follows the model: perplexity for a causal LM (:func:`is_causal_lm`, probed on the
    first held-out batch of ``cal``), the relative output error otherwise."""
    from .metric import NAMES, is_causal_lm

    fn = options.metric
    if isinstance(fn, Metric):
        m = fn
    elif fn is None:
        batch = cal.measure[0] if cal is not None and cal.measure else None
        causal = model is not None and is_causal_lm(model, batch)
        m = Metric(kind="perplexity" if causal else "output")
    elif isinstance(fn, str) and fn.strip().lower() in NAMES:
        m = Metric(kind=NAMES[fn.strip().lower()])
    elif isinstance(fn, str):
        m = Metric(fn=load_metric(fn), name=fn.rpartition(":")[2])
    else:
        m = Metric(fn=fn)
    return replace(m, tolerance=options.tolerance) if options.tolerance is not None else m


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


def _floor(f: Any) -> LayerFloor:
    return LayerFloor(f.floor, f.metric_at_floor, f.cliff_rank, f.cliff_metric, f.compression, f.keep_dense,
                      [(int(r), float(v)) for r, v in f.points], f.reason)


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
    from .budget import curves_from_floors, curves_from_spectra, plan_for_budget
    from .sweep import measure_floors
    from .tier1 import whitened_spectra

    if any(p.device.type == "meta" for p in model.parameters()):
        raise AuditError("calibration needs real weights; this model's weights are on the meta device",
                         "Audit a model with weights (not --structure-only) to use --calibration")
    progress = progress or Progress(enabled=False)
    was_training = model.training
    model.eval()
    try:
        t0 = time.perf_counter()
        with progress.phase("calibration data"):
            cal = load_calibration(options.calibration, model, options.holdout, tokenizer=options.tokenizer,
                                   length=options.calibration_length, max_rows=options.calibration_max_rows,
                                   max_bytes=options.calibration_max_bytes)
            metric = metric_of(options, model, cal)
        with progress.phase("statistics", total=len(cal.fit), unit="batch"):
            stats, cached = _statistics(model, layers, cal, options, progress)
        table = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
        target = metric.tolerance if metric.output_error else 0.01
        with progress.phase("tier 1 spectra", total=sum(1 for l in layers if l.name in stats.layers)):
            spectra = whitened_spectra(layers, table, stats, settings.align, target, progress=progress.update)
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
                                                                spectra, options)
            else:
                def steps(done: int, total: int, evaluations: int) -> None:
                    progress.update(done, total, note=f"{evaluations} evaluation{'s' if evaluations != 1 else ''}")

                with progress.phase("tier 2 floors", total=len(swept)):
                    floors, sweep_where = measure_floors(model, swept, cal, metric=metric, align=settings.align,
                                                         stats=stats, spectra=spectra, steps=steps), "local"
            for name, f in floors.floors.items():
                per[name].floor = _floor(f)
            evaluations += floors.evaluations
            reference = floors.reference
            seconds["tier2"] = time.perf_counter() - t
        t = time.perf_counter()
        from ..factorize import SUPPORTED

        planned = [l for l in swept if not l.aliases and l.kind in SUPPORTED]
        fixed = _fixed_ranks(layers, suggestions or {}, {l.name for l in planned}, per, settings)
        curves = (curves_from_floors(floors, planned, spectra) if floors is not None
                  else curves_from_spectra({l.name: spectra[l.name] for l in planned}, planned, settings.align))
        named = {l.name: l for l in planned}
        curves = type(curves)({k: [o for o in v if named[k].compression(o.rank) >= settings.min_compression]
                               for k, v in curves.options.items() if k in named}, curves.source)
        with progress.phase("tier 3 plan search", unit="plan"):
            bp = plan_for_budget(model, layers, cal, curves, budget=options.budget, metric=metric, stats=stats,
                                 fixed=fixed, progress=progress.update)
        reference = bp.reference
        evaluations += bp.evaluations
        budget = BudgetResult(dict(bp.plan), bp.source, bp.budget, bp.removed, bp.removed_fraction, bp.metric,
                              bp.ok, bp.top1, [FrontierPlan(p.removed, p.removed_fraction, p.metric, p.ok,
                                                            len(p.plan), p.top1) for p in bp.frontier],
                              evaluations=bp.evaluations, exhausted=bp.exhausted, fixed=dict(fixed),
                              smallest_failing=bp.smallest_failing)
        seconds["tier3"] = time.perf_counter() - t
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
            statistics_cached=cached, seconds=seconds, evaluations=evaluations)
        return Calibrated(report, cal, stats, spectra, metric, sweep_where)
    finally:
        model.train(was_training)


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
            why = ("tied or shared weight: factorizing one use changes every use" if layer.aliases
                   else f"factorize cannot rewrite a {layer.kind} layer, so no plan measured it")
            out[layer.name] = _dense(old, f"keep dense: {why}" + (f" ({evidence})" if evidence else ""))
            continue
        r = plan.get(layer.name)
        if r is None:
            held = (f"left dense by the largest plan that holds all at once ({report.metric} {b.metric:.4g} "
                    f"<= {report.tolerance:g})" if b is not None and b.ok and b.plan
                    else "no plan factorizing it held the tolerance all at once")
            out[layer.name] = _dense(old, held + (f"; alone: {evidence}" if evidence else ""))
            continue
        why = (f"rank {r} in the plan that holds all at once ({len(plan)} layers, {report.metric} {b.metric:.4g} "
               f"<= {report.tolerance:g})" + (f"; alone: {evidence}" if evidence else ""))
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
    was_training = model.training
    model.eval()
    try:
        ev = Evaluator(model, cal.calibration, cal.metric)
        new = factorize(model, plan, cal.stats)
        m = ev.measure(new)
        removed = count_params(model) - count_params(new)
    finally:
        model.train(was_training)
    predicted = None
    basis = ""
    if cal.metric.output_error and all(k in cal.spectra for k in plan):
        from .budget import single_layer_error

        def points(k: str) -> list[tuple[int, float]]:
            lc = report.layers.get(k)
            return list(lc.floor.points) if lc is not None and lc.floor is not None else []

        predicted = math.sqrt(sum(single_layer_error(points(k), cal.spectra[k], r) ** 2 for k, r in plan.items()))
        basis = ("single-layer model errors (measured, or tier-1 errors scaled by the measured gain)"
                 if any(points(k) for k in plan) else "tier-1 layer-output errors")
    check = PlanCheck(len(plan), left, predicted, m.value, m.ok, m.top1, removed, basis)
    return replace(report, plan_check=check, reference=ev.reference)
