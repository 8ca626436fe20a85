"""The sensitivity tier 3 plans over: what each planned layer costs the model at every rank. One protocol,
:class:`Sensitivity`, four ways to have it, in the stage's order of preference:

    Measured     tier 2's floors (``--measure-floor``): the points the floor search measured, gains between them
    Probed       ``--probe``: each layer truncated alone at two ranks and measured (two evaluations a layer)
    Gradients    the default: output-gradient second moments (:mod:`.fisher`), one backward pass per sample; the
                 planned layers no gradient reaches probed instead where the metric allows (``fallback``)
    Tier1Curves  none measured (a user metric, ``--no-probe``): tier 1's squared layer-output errors

Each gives tier 3 its :class:`~.budget.Curves` and the report's row its part (``probes``: the points measured alone;
``predicted``: the cost predicted alone at the curve's ranks). The stage's pass that picks one is
:func:`auditor.calibration.tiers.passes.sensitivity`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from ...calresults import SensitivityFallback
from ...errors import AuditError
from ...results import Layer
from ..apply import LIBRARY
from ..data.inputs import Batch, Calibration
from .budget import Curves, curves_from_floors, curves_from_gradients, curves_from_spectra
from .fisher import GradientSensitivity, gradient_sensitivity, predicted_value
from .sweep import Floors, probe_sensitivity

if TYPE_CHECKING:
    from torch import nn

    from ..apply import Fit, Spelling
    from ..references import References
    from ..session import CalibrationSession
    from .pass_context import PassContext, Scope
    from ..statistics.whiten import LossMetric, Truncator, TruncatorStore, WhitenedSpectrum


class Sensitivity(Protocol):
    """Each planned layer's model-level cost at every rank, as tier 3's curves and as the report's evidence."""

    evaluations: int  # model-level evaluations it took (the probes'; tier 2's count with its floors)
    seconds: dict[str, float]  # its phases' wall time ("gradients", "probes"), none when nothing was measured
    fallback: SensitivityFallback | None  # the planned layers the output gradients did not reach, and what costed them
    loss_metric: "LossMetric | None"  # the gradient pass's loss-aware truncations and moments, where it ran

    def curves(self, planned: list[Layer], spectra: "dict[str, WhitenedSpectrum]", align: int) -> Curves:
        """Tier 3's options for ``planned``, every rank a multiple of ``align`` (or a measured one)."""

    def probes(self, name: str) -> list[tuple[int, float]]:
        """(rank, metric) the layer measured alone, for the report's row; empty when none was measured alone."""

    def predicted(self, name: str, ranks: list[int]) -> list[tuple[int, float]]:
        """(rank, metric) predicted for the layer alone at ``ranks``; empty when nothing predicts it."""


@dataclass(frozen=True)
class Tier1Curves:
    """Tier 1's squared layer-output errors (a layer-level proxy; the all-at-once measurement corrects its scale)."""

    evaluations: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    fallback: SensitivityFallback | None = None  # the gradients reached no layer, and probes cannot be read
    loss_metric: "LossMetric | None" = None  # the gradient pass's, when it ran before a fallback

    def curves(self, planned: list[Layer], spectra: "dict[str, WhitenedSpectrum]", align: int) -> Curves:
        return curves_from_spectra({l.name: spectra[l.name] for l in planned}, planned, align)

    def probes(self, name: str) -> list[tuple[int, float]]:
        return []

    def predicted(self, name: str, ranks: list[int]) -> list[tuple[int, float]]:
        return []


@dataclass(frozen=True)
class Measured:
    """Tier 2's floors: every measured rank, and the grid ranks between costed by the measured gains."""

    floors: Floors
    evaluations: int = 0  # counted with the floors (the stage's Floored)
    seconds: dict[str, float] = field(default_factory=dict)
    fallback: SensitivityFallback | None = None
    loss_metric: "LossMetric | None" = None  # the gradient pass's, when it ran before a fallback

    def curves(self, planned: list[Layer], spectra: "dict[str, WhitenedSpectrum]", align: int) -> Curves:
        return curves_from_floors(self.floors, planned, spectra)

    def probes(self, name: str) -> list[tuple[int, float]]:
        return []

    def predicted(self, name: str, ranks: list[int]) -> list[tuple[int, float]]:
        return []


@dataclass(frozen=True)
class Probed:
    """``--probe``: two ranks a layer measured alone (:func:`~.sweep.probe_sensitivity`), gains between them."""

    floors: Floors
    evaluations: int
    seconds: dict[str, float]
    fallback: SensitivityFallback | None = None  # probed because the output gradients reached no planned layer
    loss_metric: "LossMetric | None" = None  # the gradient pass's, when it ran before a fallback

    def curves(self, planned: list[Layer], spectra: "dict[str, WhitenedSpectrum]", align: int) -> Curves:
        return curves_from_floors(self.floors, planned, spectra, source="probed")

    def probes(self, name: str) -> list[tuple[int, float]]:
        f = self.floors.floors.get(name)
        return list(f.points) if f is not None else []

    def predicted(self, name: str, ranks: list[int]) -> list[tuple[int, float]]:
        return []


@dataclass(frozen=True)
class Gradients:
    """The output-gradient sensitivity (:func:`~.fisher.gradient_sensitivity`), its costs scaled to the statistics'
    rows; the layers it did not reach (``fallback``) costed by their ``probed`` points where the metric allows, and
    predicted nothing alone."""

    gradients: GradientSensitivity
    seconds: dict[str, float]
    evaluations: int = 0  # the probes of the layers no gradient reached
    probed: Floors | None = None
    fallback: SensitivityFallback | None = None
    reuse: "TruncatorStore | None" = None  # the loss-aware truncations the costs are of (tier 3 cuts from them)
    loss_metric: "LossMetric | None" = None  # its loss-aware truncations and moments (factorize reads them)

    def curves(self, planned: list[Layer], spectra: "dict[str, WhitenedSpectrum]", align: int) -> Curves:
        return curves_from_gradients(self.gradients, planned, align)

    def probes(self, name: str) -> list[tuple[int, float]]:
        f = self.probed.floors.get(name) if self.probed is not None else None
        return list(f.points) if f is not None else []

    def predicted(self, name: str, ranks: list[int]) -> list[tuple[int, float]]:
        c = self.gradients.costs.get(name)
        if c is None or (self.fallback is not None and name in self.fallback.layers):  # probed: no prediction
            return []
        return [(r, predicted_value(c[r], self.gradients.linear)) for r in ranks if r < len(c)]


def probed(ctx: "PassContext", refs: "References", planned: list[Layer], spectra: "dict[str, WhitenedSpectrum]",
           aim: tuple[int, float]) -> Probed:
    """``--probe``: each planned layer truncated alone at two ranks (``aim``: tier 1's align and target) and
    measured against the references' evaluator (two evaluations a layer)."""
    progress = ctx.progress

    def steps(done: int, total: int, n: int) -> None:
        progress.update(done, total, note=f"{n} evaluation{'s' if n != 1 else ''}")

    t = time.perf_counter()
    with progress.phase("sensitivity probes", total=len(planned)):
        floors = probe_sensitivity(ctx.model, planned, ctx.session, spectra, aim, steps=steps,
                                   evaluator=refs.evaluator)
    return Probed(floors, floors.evaluations, {"probes": time.perf_counter() - t})


def gradients(ctx: "PassContext", refs: "References", scope: "Scope", spectra: "dict[str, WhitenedSpectrum]",
              aim: tuple[int, float]) -> Sensitivity:
    """The output-gradient sensitivity of the scope's sensitive layers (the planned and fixed ones: one backward
    pass per sample over the gradient rows, :func:`gradient_rows`), its costs scaled to the statistics' rows; the
    planned layers no gradient reached fall back (:func:`_fallback`). Its ``loss_metric``: the loss-aware
    truncations and moments factorize's loss-aware and sequential fits read."""
    from ..statistics.whiten import TruncatorStore, part_bytes

    model, session, progress = ctx.model, ctx.session, ctx.progress
    planned, layers = scope.planned, scope.sensitive
    cal, share = gradient_rows(session.calibration)
    # each reached layer's loss-aware truncation (one part of the model's in memory, the rest on disk): what its
    # costs are of, and what tier 3, the verification and the plan check cut factors from
    store = TruncatorStore(part_bytes(model, layers))
    t = time.perf_counter()
    with progress.phase("sensitivity gradients", total=len(cal.fit), unit="batch"):
        with session.measuring():
            g = gradient_sensitivity(model, layers, cal, session.metric, session.stats, spectra,
                                     progress=progress.update, store=store, bases=session.decompositions.weighted())
    seconds = {"gradients": time.perf_counter() - t}
    if share < 1.0:  # the pass's scale is over its own rows; the statistics sum every fit row
        g = replace(g, costs={k: [share * c for c in v] for k, v in g.costs.items()},
                    scaled={k: share * r for k, r in g.scaled.items()})
    kept = g.loss_metric(layers)  # factorize's loss-aware and sequential fits read them
    if not any(l.name in g.unreachable for l in planned):
        return Gradients(g, seconds, reuse=store, loss_metric=kept)
    out = _fallback(ctx, refs, g, seconds, planned, spectra, aim)
    return replace(out, reuse=store, loss_metric=kept) if isinstance(out, Gradients) else replace(
        out, loss_metric=kept)


def loss_metric(session: "CalibrationSession", model: nn.Module, planned: list[Layer],
                kept: "LossMetric | None" = None) -> "LossMetric | None":
    """The loss-aware truncations and output-gradient moments for ``planned`` (what ``factorize``'s loss-aware and
    sequential fits read): ``kept`` (the audit's gradient pass's, :attr:`auditor.calibration.stage.Calibrated.
    loss_metric`) where it covers them, else one gradient pass here over the session's gradient rows with its
    metric. None for a metric without a gradient (a user metric). The session is not written: the caller keeps what
    this returns."""
    if kept is not None and all(l.name in kept.layers for l in planned):
        return kept
    if not session.metric.spec.gradient:
        return None
    store: "dict[str, Truncator]" = {}
    with session.measuring():
        g = gradient_sensitivity(model, planned, gradient_rows(session.calibration)[0], session.metric,
                                 session.statistics(planned), {}, store=store, bases=session.decompositions.weighted())
    return g.loss_metric(planned)


def loss_metric_for(session: "CalibrationSession", model: nn.Module, planned: list[Layer], fit: "Fit",
                    spelled: "Spelling" = LIBRARY, kept: "LossMetric | None" = None) -> "LossMetric | None":
    """:func:`loss_metric` for a ``fit`` of ``factorize`` (the library's and the command's one check): the loss-aware
    and sequential fits read it; the loss-aware fit with a metric without a gradient is refused in one line
    (``spelled``: how the caller names the fit and its alternatives). None for the independent fit, or no
    gradient."""
    if fit.method == "independent":
        return None
    found = loss_metric(session, model, planned, kept)
    if found is None and fit.method == "loss-aware":
        named, others = spelled.gradient()
        raise AuditError(f"{named} needs a metric with a gradient; the metric {session.metric.label!r} has none",
                         f"Use {others} with a user metric")
    return found


def _fallback(ctx: "PassContext", refs: "References", g: GradientSensitivity, seconds: dict[str, float],
              planned: list[Layer], spectra: "dict[str, WhitenedSpectrum]", aim: tuple[int, float]) -> Sensitivity:
    """The planned layers no output gradient reached (``g.unreachable``: a forward that detaches, runs under
    ``torch.no_grad()``, goes through numpy or returns integers): costed by truncation probes (on those layers only)
    where the metric allows them, else by tier-1 costs (scaled by the reached layers' median ratio, where some were
    reached). When no planned layer was reached the whole sensitivity is the fallback's."""
    lost = [l for l in planned if l.name in g.unreachable]
    reasons = list(dict.fromkeys(g.unreachable[l.name] for l in lost))
    reached = [l for l in planned if l.name in g.costs and l.name not in g.scaled and l.name not in g.unreachable]
    can_probe = ctx.session.metric.spec.zero_on_dense
    method = ("truncation probes (each layer truncated alone and measured, as --probe)" if can_probe
              else "tier-1 costs scaled by the median gradient ratio of the layers reached" if reached
              else "tier-1 costs")
    fb = SensitivityFallback(method, [l.name for l in lost], "; ".join(reasons), not reached, len(planned))
    if not reached:
        if not can_probe:
            return Tier1Curves(seconds=seconds, fallback=fb)
        p = probed(ctx, refs, planned, spectra, aim)
        return replace(p, seconds={**seconds, **p.seconds}, fallback=fb)
    if not can_probe:
        return Gradients(g, seconds, fallback=fb)
    p = probed(ctx, refs, lost, spectra, aim)
    return Gradients(_probed_costs(g, p.floors, lost, spectra), {**seconds, **p.seconds}, p.evaluations, p.floors,
                     fb)


def _probed_costs(g: GradientSensitivity, probes: Floors, lost: list[Layer],
                  spectra: "dict[str, WhitenedSpectrum]") -> GradientSensitivity:
    """``g`` with each of ``lost``'s costs at every rank from its probes (measured where probed, else its tier-1
    error times the measured gain), in the gradients' units: the value for a likelihood metric, squared otherwise."""
    from .budget import single_layer_error

    costs, scaled = dict(g.costs), dict(g.scaled)
    for layer in lost:
        f, spec = probes.floors.get(layer.name), spectra.get(layer.name)
        scaled.pop(layer.name, None)
        if f is None or spec is None:  # nothing to probe (no grid rank below break-even): no option either
            costs.pop(layer.name, None)
            continue
        values = [single_layer_error(f.points, spec, r) for r in range(len(spec.error))]
        costs[layer.name] = [v if g.linear else v * v for v in values]
    return replace(g, costs=costs, scaled=scaled)


GRADIENT_POSITIONS = 4096  # scored positions (rows times positions per row) the gradient pass reads at most


def _positions(b: Batch) -> int:
    ts = b.tensors()
    return int(ts[0][1].numel()) if ts else b.rows


def gradient_rows(cal: Calibration, positions: int = GRADIENT_POSITIONS) -> tuple[Calibration, float]:
    """(the fit rows the gradient pass reads, their share of the fit rows): every fit batch's first rows, the same
    share of each (spread over the calibration, not its start), enough for ``positions`` positions; every row when
    the fit rows hold no more. Output-gradient second moments are means over positions: 4k positions (8k
    position-samples with the pass's two samples) estimate a width-192 one; the statistics keep every row."""
    from ..measure.verify import _slice

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


def _joined(parts: list[Batch], size: int) -> list[Batch]:
    """``parts`` concatenated along their rows into batches of at most ``size`` rows, when every part holds the same
    inputs batched alike (same names, every tensor rows first with the same other dimensions); else as they are. A
    forward and backward pass costs about as much for 4 rows as for 32 here (the per-batch work dominates)."""
    import torch

    def sig(b: Batch) -> list[tuple[str, tuple[int, ...], torch.dtype]] | None:
        ts = b.tensors()
        return [(k, tuple(t.shape[1:]), t.dtype) for k, t in ts] if all(t.dim() >= 2 for _, t in ts) else None

    first = sig(parts[0]) if parts else None
    same = first is not None and all(not p.args and sig(p) == first and len(p.tensors()) == len(p.kwargs)
                                     for p in parts)
    if not same:
        return parts
    out: list[list[Batch]] = []
    group: list[Batch] = []
    n = 0
    for p in parts:
        if group and n + p.rows > size:
            out.append(group)
            group, n = [], 0
        group.append(p)
        n += p.rows
    out.append(group)
    return [Batch((), {k: torch.cat([g.kwargs[k] for g in grp]) for k in grp[0].kwargs}) for grp in out]


__all__ = ["GRADIENT_POSITIONS", "Gradients", "Measured", "Probed", "Sensitivity", "Tier1Curves", "gradient_rows",
           "gradients", "probed"]
