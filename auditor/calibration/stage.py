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
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

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
    from ..results import AuditResult, Spectrum

SYNTHETIC_MARK = "looks like token ids drawn uniformly at random"


@dataclass(frozen=True)
class Calibrated:
    """The report, the session the plan check (and the CLI's factorize) measure with, and the tier-1 spectra."""

    report: CalibrationReport
    session: CalibrationSession
    spectra: dict[str, WhitenedSpectrum]
    sweep: str = ""  # where tier 2 ran: "local", "dask tcp://HOST:PORT (N workers)"; empty without tier 2
    gradients: Any = None  # the gradient sensitivity (auditor/calibration/fisher.py) tier 3 searched over, if any
    reuse: Any = None  # tier 3's decompositions (whiten.TruncatorStore), reused by the plan check

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
    from ..kinds.registry import SUPPORTED

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


@dataclass
class _Run:
    """What the steps of :func:`calibrate` share: its arguments, the session and what each step measured."""

    model: nn.Module
    layers: list[Layer]
    settings: "Settings"
    options: "AuditOptions"
    suggestions: dict[str, Suggestion]
    progress: "Progress"
    session: CalibrationSession = None  # type: ignore[assignment]
    spectra: dict[str, WhitenedSpectrum] = field(default_factory=dict)
    per: dict[str, LayerCalibration] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    evaluations: int = 0
    cached: bool = False
    floors: Any = None  # tier 2's Floors
    sweep: str = ""
    probes: Any = None
    gradients: Any = None
    fallback: Any = None  # SensitivityFallback: the planned layers the output gradients did not reach
    rounding: Any = None
    reference: float = 0.0
    planned: list[Layer] = field(default_factory=list)
    fixed: dict[str, int] = field(default_factory=dict)
    reuse: Any = None  # tier 3's decompositions (whiten.TruncatorStore), kept for the verification and plan check

    @property
    def metric(self) -> Metric:
        return self.session.metric

    @property
    def target(self) -> float:
        """Tier 1's layer-output error target (the metric's: the tolerance in layer-error units, else 0.01)."""
        return self.metric.tier1_target

    @property
    def sensitive(self) -> list[Layer]:
        """The layers a sensitivity is measured for: the planned ones and the fixed ones."""
        return [*self.planned, *(l for l in self.layers if l.name in self.fixed)]


@contextmanager
def _timed(seconds: dict[str, float], key: str) -> Iterator[None]:
    """Adds the block's wall time to ``seconds[key]``."""
    t = time.perf_counter()
    try:
        yield
    finally:
        seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t


@one_blas_thread
def calibrate(model: nn.Module, layers: list[Layer], settings: "Settings", options: "AuditOptions",
              suggestions: dict[str, Suggestion] | None = None, progress: "Progress | None" = None) -> Calibrated:
    """Tier 1 on every layer; tier 2 (``options.measure_floor``) on the layers that are not narrow and whose inputs
    the calibration spans; tier 3 always: the largest plan over the measured (or tier-1) curves that holds the
    tolerance all at once (``options.budget``: at most that share removed). ``suggestions`` (the data-free ones) give
    the ranks of the layers calibration cannot rank, which every plan measured then includes. Bad calibration data
    raises :class:`AuditError` with one line. ``progress`` (default: none drawn) gets one phase per step: calibration
    data, statistics (per batch), tier 1 (per layer), tier 2 (per layer, evaluations so far; a cluster sweep draws its
    own), the sensitivity, tier 3 (plans measured so far), the verification."""
    from ..progress import Progress

    if any(p.device.type == "meta" for p in model.parameters()):
        raise AuditError("calibration needs real weights; this model's weights are on the meta device",
                         "Audit a model with weights (not --structure-only) to use --calibration")
    run = _Run(model, layers, settings, options, suggestions or {}, progress or Progress(enabled=False))
    was_training = model.training
    model.eval()
    try:
        with _timed(run.seconds, "tier1"):
            _open_session(run)
            _tier1(run)
        _tier2(run)
        _plannable(run)
        _sensitivity(run)
        budget = _tier3(run)
        budget = _recovery(run, budget)
        budget = _verification(run, budget)
        return Calibrated(_report(run, budget), run.session, run.spectra, run.sweep, run.gradients, run.reuse)
    finally:
        model.train(was_training)


def _open_session(run: _Run) -> None:
    """The calibration data and the session that measures with it (a user metric must be higher-is-better)."""
    with run.progress.phase("calibration data"):
        run.session = CalibrationSession.from_options(run.model, run.layers, run.options)
        run.session.metric.check_reportable()


def _tier1(run: _Run) -> None:
    """The input statistics (block by block, tier 1 with them) and every layer's whitened spectrum."""
    session, progress, align = run.session, run.progress, run.settings.align
    cal = session.calibration
    with progress.phase("statistics", total=len(cal.fit), unit="batch"):  # and tier 1, block by block
        stats = session.statistics(progress=progress, spectra=(align, run.target))
        run.cached = session.cached
    with progress.phase("tier 1 spectra", total=sum(1 for l in run.layers if l.name in stats.layers)):
        run.spectra = session.spectra(align, run.target, progress=progress.update)
    for name, spec in run.spectra.items():
        inp = stats.layers[name]
        lc = LayerCalibration(name, inp.rows, inp.width, dict(spec.ranks_for), spec.suggested, spec.verdict,
                              spec.reason, subsample(spec.error), spec.damping, spec.approximate)
        lc.seen, lc.spans = _span(inp)
        run.per[name] = lc


def _swept(run: _Run) -> list[Layer]:
    """The layers tiers 2 and 3 consider: with a spectrum, not narrow, inputs spanned."""
    return [l for l in run.layers
            if l.name in run.spectra and _sweepable(l, run.settings) and run.per[l.name].spans]


def _tier2(run: _Run) -> None:
    """Tier 2 (``--measure-floor``): each swept layer's measured floor, here or on a Dask cluster."""
    swept = _swept(run)
    if not run.options.measure_floor or not swept:
        return
    from .sweep import measure_floors

    session, progress = run.session, run.progress
    with _timed(run.seconds, "tier2"):
        if run.options.scheduler is not None:  # one Dask task per layer (auditor/calibration/cluster.py)
            from .cluster import measure_floors_on_cluster

            floors, run.sweep = measure_floors_on_cluster(run.model, swept, session.calibration, session.metric,
                                                          run.settings.align, session.stats, run.spectra,
                                                          run.options)  # the workers' own sessions
        else:
            def steps(done: int, total: int, evaluations: int) -> None:
                progress.update(done, total, note=f"{evaluations} evaluation{'s' if evaluations != 1 else ''}")

            with progress.phase("tier 2 floors", total=len(swept)):
                floors = measure_floors(run.model, swept, session, align=run.settings.align, spectra=run.spectra,
                                        steps=steps)
            run.sweep = "local"
    for name, f in floors.floors.items():
        run.per[name].floor = f
    run.floors, run.evaluations, run.reference = floors, run.evaluations + floors.evaluations, floors.reference


def _plannable(run: _Run) -> None:
    """The layers tier 3 plans (swept, untied, rewritable by factorize) and those every plan fixes at their data-free
    rank."""
    from ..kinds.registry import SUPPORTED

    run.planned = [l for l in _swept(run) if not l.aliases and l.kind in SUPPORTED]
    run.fixed = _fixed_ranks(run.layers, run.suggestions, {l.name for l in run.planned}, run.per, run.settings)


def _sensitivity(run: _Run) -> None:
    """Without tier 2: each planned layer's model-level sensitivity, from output gradients (the default) or from
    truncation probes (``--probe``); none for a user metric or with ``--no-probe``."""
    opts = run.options
    if run.floors is not None or not opts.probe_sensitivity or not run.planned:
        return
    if opts.probe:
        if run.metric.spec.zero_on_dense:
            _probes(run)
    elif run.metric.spec.gradient:
        _gradients(run)


GRADIENT_POSITIONS = 4096  # scored positions (rows times positions per row) the gradient pass reads at most


def _positions(b: Any) -> int:
    ts = b.tensors()
    return int(ts[0][1].numel()) if ts else b.rows


def gradient_rows(cal: Calibration, positions: int = GRADIENT_POSITIONS) -> tuple[Calibration, float]:
    """(the fit rows the gradient pass reads, their share of the fit rows): every fit batch's first rows, the same
    share of each (spread over the calibration, not its start), enough for ``positions`` positions; every row when
    the fit rows hold no more. Output-gradient second moments are means over positions: 4k positions (8k
    position-samples with the pass's two samples) estimate a width-192 one; the statistics keep every row."""
    from .verify import _slice

    total = sum(_positions(b) for b in cal.fit)
    if total <= positions:
        return cal, 1.0
    share = positions / total
    fit = []
    for b in cal.fit:
        ts = b.tensors()
        keep = max(1, math.ceil(share * b.rows))
        fit.append(b if keep >= b.rows or not ts or ts[0][1].dim() < 2 else _slice(b, 0, keep))
    rows = sum(b.rows for b in fit)
    joined = _joined(fit, max(b.rows for b in cal.fit))
    return replace(cal, fit=joined, warnings=cal.warnings), rows / max(cal.fit_rows, 1)


def _joined(parts: list[Any], size: int) -> list[Any]:
    """``parts`` concatenated along their rows into batches of at most ``size`` rows, when every part holds the same
    inputs batched alike (same names, every tensor rows first with the same other dimensions); else as they are. A
    forward and backward pass costs about as much for 4 rows as for 32 here (the per-batch work dominates)."""
    import torch

    from .inputs import Batch

    def sig(b: Any) -> Any:
        ts = b.tensors()
        return [(k, tuple(t.shape[1:]), t.dtype) for k, t in ts] if all(t.dim() >= 2 for _, t in ts) else None

    first = sig(parts[0]) if parts else None
    same = first is not None and all(not p.args and sig(p) == first and len(p.tensors()) == len(p.kwargs)
                                     for p in parts)
    if not same:
        return parts
    out, group, n = [], [], 0
    for p in parts:
        if group and n + p.rows > size:
            out.append(group)
            group, n = [], 0
        group.append(p)
        n += p.rows
    out.append(group)
    return [Batch((), {k: torch.cat([g.kwargs[k] for g in grp]) for k in grp[0].kwargs}) for grp in out]


def _gradients(run: _Run) -> None:
    """The output-gradient sensitivity (one backward pass per sample over the gradient rows, :func:`gradient_rows`),
    its costs scaled to the statistics' rows, and each layer's predicted cost alone beside its tier-1 curve."""
    from .fisher import gradient_sensitivity, predicted_value

    session = run.session
    cal, share = gradient_rows(session.calibration)
    with _timed(run.seconds, "gradients"):
        with run.progress.phase("sensitivity gradients", total=len(cal.fit), unit="batch"):
            with session.measuring():
                g = gradient_sensitivity(run.model, run.sensitive, cal, run.metric, session.stats, run.spectra,
                                         progress=run.progress.update)
    if share < 1.0:  # the pass's scale is over its own rows; the statistics sum every fit row
        g = replace(g, costs={k: [share * c for c in v] for k, v in g.costs.items()},
                    scaled={k: share * r for k, r in g.scaled.items()})
    run.gradients = g
    if _gradient_fallback(run, g):
        return
    g = run.gradients
    lost = set(run.fallback.layers) if run.fallback is not None else set()  # probed: no gradient prediction
    for name, c in g.costs.items():
        if name in run.per and name not in lost:
            run.per[name].predicted = [(r, predicted_value(c[r], g.linear)) for r, _ in run.per[name].curve
                                       if r < len(c)]


def _gradient_fallback(run: _Run, g: Any) -> bool:
    """The planned layers no output gradient reached (a forward that detaches, runs under ``torch.no_grad()``, goes
    through numpy or returns integers): costed by truncation probes (:func:`_probes`, on those layers only) where the
    metric allows them, else by tier-1 costs (scaled by the reached layers' median ratio, where some were reached).
    Recorded in ``run.fallback`` for the report. True when no planned layer was reached: the whole sensitivity is
    the fallback's (``run.gradients`` None)."""
    from ..calresults import SensitivityFallback

    lost = [l for l in run.planned if l.name in g.unreachable]
    if not lost:
        return False
    reasons = list(dict.fromkeys(g.unreachable[l.name] for l in lost))
    reached = [l for l in run.planned if l.name in g.costs and l.name not in g.scaled and l.name not in g.unreachable]
    probes = run.metric.spec.zero_on_dense
    method = ("truncation probes (each layer truncated alone and measured, as --probe)" if probes
              else "tier-1 costs scaled by the median gradient ratio of the layers reached" if reached
              else "tier-1 costs")
    run.fallback = SensitivityFallback(method, [l.name for l in lost], "; ".join(reasons), not reached,
                                       len(run.planned))
    if not reached:
        run.gradients = None
        if probes:
            _probes(run)
        return True
    if probes:
        _probes(run, lost)
        run.gradients = _probed_costs(run, g, lost)
    return False


def _probed_costs(run: _Run, g: Any, lost: list[Layer]) -> Any:
    """``g`` with each of ``lost``'s costs at every rank from its probes (measured where probed, else its tier-1
    error times the measured gain), in the gradients' units: the value for a likelihood metric, squared otherwise."""
    from .budget import single_layer_error

    costs, scaled = dict(g.costs), dict(g.scaled)
    for layer in lost:
        f, spec = run.probes.floors.get(layer.name), run.spectra.get(layer.name)
        scaled.pop(layer.name, None)
        if f is None or spec is None:  # nothing to probe (no grid rank below break-even): no option either
            costs.pop(layer.name, None)
            continue
        values = [single_layer_error(f.points, spec, r) for r in range(len(spec.error))]
        costs[layer.name] = [v if g.linear else v * v for v in values]
    return replace(g, costs=costs, scaled=scaled)


def _probes(run: _Run, layers: list[Layer] | None = None) -> None:
    """``--probe``: each planned layer (or each of ``layers``) truncated alone at two ranks and measured (two
    evaluations a layer)."""
    from .sweep import probe_sensitivity

    progress = run.progress

    def probed(done: int, total: int, n: int) -> None:
        progress.update(done, total, note=f"{n} evaluation{'s' if n != 1 else ''}")

    layers = run.planned if layers is None else layers
    with _timed(run.seconds, "probes"), progress.phase("sensitivity probes", total=len(layers)):
        run.probes = probe_sensitivity(run.model, layers, run.session, run.spectra, run.settings.align,
                                       run.target, steps=probed)
    run.evaluations += run.probes.evaluations
    for name, f in run.probes.floors.items():
        run.per[name].probes = list(f.points)


def _curves(run: _Run) -> Any:
    """Tier 3's per-layer options: from the measured floors, the gradients (with any layers they did not reach costed
    by probes, :func:`_gradient_fallback`), the probes or tier 1 (in that order of preference), every rank that
    compresses at least ``min_compression``."""
    from .budget import curves_from_floors, curves_from_gradients, curves_from_spectra

    planned, spectra, align = run.planned, run.spectra, run.settings.align
    curves = (curves_from_floors(run.floors, planned, spectra) if run.floors is not None
              else curves_from_gradients(run.gradients, planned, align) if run.gradients is not None
              else curves_from_floors(run.probes, planned, spectra, source="probed") if run.probes is not None
              else curves_from_spectra({l.name: spectra[l.name] for l in planned}, planned, align))
    named = {l.name: l for l in planned}
    least = run.settings.min_compression
    return type(curves)({k: [o for o in v if named[k].compression(o.rank) >= least]
                         for k, v in curves.options.items() if k in named}, curves.source, curves.linear)


def _tier3(run: _Run) -> Any:
    """The rounding floor (bf16 / fp16 weights), then the plan search over the curves."""
    from .budget import plan_for_budget
    from .whiten import TruncatorStore, part_bytes
    from .rounding import rounding_floor

    # bf16 / fp16 weights: what every plannable layer at full rank (nothing dropped) measures: rounding alone
    with _timed(run.seconds, "rounding"):
        run.rounding = rounding_floor(run.model, run.sensitive, run.session)
    if run.rounding is None:
        del run.seconds["rounding"]
    else:
        run.evaluations += 1
    with _timed(run.seconds, "tier3"):
        curves = _curves(run)
    # each layer decomposed once for the search, the verification and the plan check; one part of the model's
    # decompositions in memory (a block's, or the largest outside layer's), the rest on disk
    run.reuse = TruncatorStore(part_bytes(run.model, run.sensitive))
    # judged against the tolerance as given: the floor is part of every plan's cost
    with _timed(run.seconds, "tier3"), run.progress.phase("tier 3 plan search", unit="plan"):
        budget = plan_for_budget(run.model, run.layers, run.session, curves, budget=run.options.budget,
                                 fixed=run.fixed, progress=run.progress.update, reuse=run.reuse,
                                 backstops=VERIFY_BACKSTOPS if run.session.verifier is not None else 0)
    run.reference = budget.reference
    run.evaluations += budget.evaluations
    return budget


def _recovery(run: _Run, budget: Any) -> Any:
    """``--recover``: every frontier plan measured again after the recovery fine-tune."""
    opts = run.options
    if opts.recover_steps is None:
        return budget
    from .budget import RecoverySettings, recover_frontier

    settings = RecoverySettings(steps=opts.recover_steps, lr=opts.recover_lr, trainable=opts.recover_trainable,
                                objective=opts.recover_objective, seed=opts.recover_seed,
                                choose_after=opts.choose_after_recovery)
    with _timed(run.seconds, "recovery"), run.progress.phase("tier 3 recovery", unit="plan"):
        return recover_frontier(run.model, run.session, budget, settings,
                                progress=lambda done, total: run.progress.update(done, total))


def _verification(run: _Run, budget: Any) -> Any:
    """The plan chosen by its interval on the rows the search never read; a warning when they are too few."""
    session = run.session
    if session.verifier is None:
        return budget
    with _timed(run.seconds, "verification"), run.progress.phase("verification", unit="plan"):
        budget = _verify(run.model, session, budget, session.stats, run.reuse)
    run.evaluations += session.verifier.evaluations
    v = budget.verification
    if v is not None and v.rows_needed is not None:
        what = (f"a {100 * v.confidence:g}% interval {v.low:.4g} to {v.high:.4g}" if v.low is not None
                else "no interval")
        session.calibration.warnings.append(
            f"the {v.rows:,} verification rows (held out, never searched) give {what} against the "
            f"tolerance {run.metric.tolerance:g}: too few to resolve it; about {v.rows_needed:,} verification "
            f"rows (about {2 * v.rows_needed:,} held out) would")
    return budget


def _report(run: _Run, budget: Any) -> CalibrationReport:
    session, options, metric = run.session, run.options, run.metric
    cal, stats = session.calibration, session.stats
    measured = run.floors is not None
    source = (str(options.calibration) if isinstance(options.calibration, (str, Path)) else cal.source)
    return CalibrationReport(
        source=source + (f" ({cal.tokenized})" if cal.tokenized else ""),
        holdout=str(options.holdout), digest=cal.digest, fit_rows=cal.fit_rows, holdout_rows=cal.holdout_rows,
        metric=metric.label, higher_is_better=metric.higher_is_better, tolerance=metric.tolerance,
        reference=run.reference, layers=run.per, missing=dict(stats.missing),
        warnings=list(dict.fromkeys([*cal.warnings, *stats.warnings])),
        synthetic=any(SYNTHETIC_MARK in w for w in cal.warnings), measured_floors=measured,
        budget=budget.settled() if budget is not None else None, suggestions_from="measured floors" if measured else "calibration",
        statistics_cached=run.cached, seconds=run.seconds, evaluations=run.evaluations,
        rounding_floor=run.rounding, compute_dtype=options.compute_dtype,
        tier1_target=run.target, increase_of=metric.spec.increase_of, sensitivity_fallback=run.fallback,
        limit=metric.spec.limit(run.reference, metric.tolerance, metric.higher_is_better),
        display=metric.spec.display(metric.higher_is_better))


VERIFY_TRIES = 6  # plans verified at most, from the largest that held on the search rows down
VERIFY_BACKSTOPS = 2  # plans the search measures a point, and two, below the one it found: the verification's fallbacks


def _verify(model: nn.Module, session: CalibrationSession, budget: Any, stats: InputStatistics,
            reuse: Any = None) -> Any:
    """Tier 3's plan verified on the held-out rows the search never read: the largest plan that held on the search
    rows whose verification interval ends within the tolerance (at most ``VERIFY_TRIES`` verified, largest first;
    the smallest verified stands, said to miss or straddle, when none does). The dense model is never verified: it
    is the reference."""
    from .apply import factorize

    ver = session.verifier
    search_rows = sum(b.rows for b in session.search_calibration.holdout)
    if budget.chosen_after_recovery or not budget.plan:
        if budget.plan:
            with session.measuring():
                v = ver.measure(factorize(model, budget.plan, stats, reuse=reuse, share=True))
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
            v = ver.measure(factorize(model, p.plan, stats, reuse=reuse, share=True))
            chosen = p
            p.verification = v = replace(v, search_rows=search_rows)  # every plan verified says so in the report
            if v.ok:
                break
    assert chosen is not None and v is not None
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
    from ..kinds.registry import SUPPORTED

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
def check_plan(cal: Calibrated, model: nn.Module, audit: "AuditResult") -> CalibrationReport:
    """The reviewed plan (or the suggested ranks) factorized all at once with whitened initialisation and measured on
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
    m, removed, verification = _measured_plan(cal, model, plan)
    predicted, basis = _predicted(cal, plan)
    check = PlanCheck(len(plan), left, predicted, m.value, m.ok, m.top1, removed, basis, verification)
    b = report.budget
    reference = (b.reference if cal.session.verifier is not None and b is not None  # the search rows' reference,
                 else cal.session.evaluator.reference)  # measured once by tier 3
    return replace(report, plan_check=check, reference=reference)


def _reviewed_plan(audit: "Audit") -> tuple[dict[str, int], list[str]]:
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


def _measured_plan(cal: Calibrated, model: nn.Module, plan: dict[str, int]) -> tuple[Any, int, Any]:
    """(the plan's measurement, parameters removed, its verification or None): on the verification rows with the
    interval in a split session (the suggested plan's verification and removal reused: neither factorized nor
    measured again), else on the held-out rows."""
    from ..surgery import count_params
    from .apply import factorize
    from .metric import Measurement

    session, b = cal.session, cal.report.budget
    suggested = b is not None and b.plan == plan
    if suggested and session.verifier is not None and b.verification is not None:  # measured: nothing to factorize
        verification, removed = b.verification, b.removed
    else:
        with session.measuring():
            new = factorize(model, plan, session, reuse=cal.reuse, share=True)
            removed = count_params(model) - count_params(new)
            if session.verifier is None:
                return session.evaluator.measure(new), removed, None
            verification = replace(session.verifier.measure(new),
                                   search_rows=sum(x.rows for x in session.search_calibration.holdout))
    m = Measurement(verification.value, verification.ok)
    if suggested:
        m.top1 = b.top1
    return m, removed, verification


def _predicted(cal: Calibrated, plan: dict[str, int]) -> tuple[float | None, str]:
    """(the plan's predicted metric, what it is predicted from): the gradient-predicted costs where every layer has
    them, else for the output error the single-layer errors in quadrature; (None, "") otherwise."""
    grads, report = cal.gradients, cal.report
    if grads is not None and all(k in grads.costs for k in plan):
        from .fisher import predicted_value

        fb = report.sensitivity_fallback
        probed = (" and truncation probes where no gradient reached" if fb is not None and set(fb.layers) & set(plan)
                  else "")
        return predicted_value(grads.predicted(plan), grads.linear), (
            f"gradient-predicted single-layer cross-entropy increases (output-gradient second moments{probed}), "
            "which add up" if grads.linear else
            f"gradient-predicted single-layer model errors (output-gradient second moments{probed})")
    if not (cal.metric.output_error and all(k in cal.spectra for k in plan)):
        return None, ""
    from .budget import single_layer_error

    def points(k: str) -> list[tuple[int, float]]:
        lc = report.layers.get(k)
        if lc is None:
            return []
        return list(lc.floor.points) if lc.floor is not None else list(lc.probes)

    predicted = math.sqrt(sum(single_layer_error(points(k), cal.spectra[k], r) ** 2 for k, r in plan.items()))
    return predicted, ("single-layer model errors (measured, or tier-1 errors scaled by the measured gain)"
                       if any(points(k) for k in plan) else "tier-1 layer-output errors")
