"""A plan applied with factors from the data: :mod:`auditor.surgery` replaces the layers, this module says where
their factors come from. Without calibration each layer's factors are its plain truncated SVD; with calibration (a
session, a ``Calibration`` or ``InputStatistics``) the whitened truncation, which keeps the layer's outputs on the
calibration data as close as any rank-r map can (:class:`auditor.calibration.statistics.whiten.Truncator`). With
``fit="sequential"`` each layer's factors are fitted on the inputs the factorized layers before it produce, anchored
to the dense outputs (:mod:`auditor.calibration.statistics.sequential`)."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, MutableMapping

import torch
from torch import nn

from ..errors import AuditError
from ..results import Layer
from ..surgery import Factors, Truncation, apply_plan, checked_plan, replace_layers
from .data.inputs import Calibration
from .session import CalibrationSession
from .statistics.stats import InputStatistics
from .statistics.whiten import Truncator

if TYPE_CHECKING:
    from .statistics.whiten import Truncator


class Fit(str, Enum):
    """How the factors are fitted with calibration: each layer alone on the dense model's inputs, or in call order on
    the inputs the factorized layers before it produce (the sequential, output-anchored fit)."""

    INDEPENDENT = "independent"
    SEQUENTIAL = "sequential"


def fit_of(fit: "Fit | str") -> Fit:
    """``fit`` as a :class:`Fit`, or one line naming the choices."""
    try:
        return Fit(fit)
    except ValueError:
        raise AuditError(f"fit {fit!r} is not a way to fit the factors",
                         f"Give one of {', '.join(f.value for f in Fit)}") from None


def truncation(stats: InputStatistics | None = None, reuse: "MutableMapping[str, Truncator] | None" = None) -> Truncation:
    """The factors of a layer at a rank: whitened under the layer's statistics in ``stats``, the plain SVD where
    there are none. ``reuse``: a dict the caller keeps across plans of one model and calibration, so each layer is
    decomposed once."""

    def factors(name: str, layer: Layer, weight: torch.Tensor, rank: int) -> Factors:
        trunc = reuse.get(name) if reuse is not None else None
        if trunc is None:
            trunc = Truncator(layer, weight, stats.layers.get(name) if stats is not None else None)
            if reuse is not None:
                reuse[name] = trunc
        return trunc.factors(rank)

    return factors


def statistics(calibration: object, model: nn.Module, planned: list[Layer]) -> InputStatistics | None:
    """The input statistics of the planned layers: ``InputStatistics`` as given, a session's (read once, when they
    cover the plan), or gathered on ``model`` (in eval mode) from a ``Calibration``; None without calibration."""
    if calibration is None or isinstance(calibration, InputStatistics):
        return calibration
    if isinstance(calibration, (Calibration, CalibrationSession)):
        return CalibrationSession.of(calibration, model, layers=planned).statistics(planned)
    raise AuditError(f"calibration is a {type(calibration).__name__}",
                     "Pass a CalibrationSession, a Calibration (load_calibration) or InputStatistics")


def factorize(model: nn.Module, plan: dict[str, int], calibration: object = None, *, init: bool = True,
              layers: dict[str, Layer] | None = None, reuse: "MutableMapping[str, Truncator] | None" = None,
              share: bool = False, fit: "Fit | str" = Fit.INDEPENDENT) -> nn.Module:
    """A deep copy of ``model`` with each planned layer (``{layer name: rank}``) replaced by two; ``model`` is left
    untouched. ``calibration``: None (plain SVD), a ``CalibrationSession`` (its statistics, read once), a
    ``Calibration`` (input statistics are gathered on ``model``, in eval mode), or ``InputStatistics``.
    ``init=False`` builds the structure only (for ``load_factorized``). ``reuse``: see :func:`truncation`; without
    it, a session on a Dask cluster (``AuditOptions(scheduler=...)``) has the decompositions made there.
    ``share``: the copy holds ``model``'s own parameters and buffers (:func:`auditor.surgery.replace_layers`).
    ``fit``: ``"independent"`` (each layer whitened under the dense inputs) or ``"sequential"`` (each layer fitted on
    the inputs the factorized layers before it produce; needs a session or a ``Calibration``; ``reuse`` is not read:
    the factors hold for this plan only, and are fitted here)."""
    if not init:
        return apply_plan(model, plan, layers=layers, share=share)
    resolved = checked_plan(model, plan, layers)  # before any statistics are gathered: a complex layer would crash them
    if fit_of(fit) is Fit.SEQUENTIAL and calibration is not None:
        return replace_layers(model, resolved, truncation(None, sequential(calibration, model, resolved)), share=share)
    stats = statistics(calibration, model, [l for l, _ in resolved.values()])
    if reuse is None and isinstance(calibration, CalibrationSession) and calibration.on_cluster:
        reuse = _on_cluster(model, calibration, [l for l, _ in resolved.values()], stats)
    return replace_layers(model, resolved, truncation(stats, reuse), share=share)


def _on_cluster(model: nn.Module, session: CalibrationSession, planned: list[Layer],
                stats: InputStatistics | None) -> "MutableMapping[str, Truncator]":
    """The planned layers' decompositions made on the session's Dask cluster, one block at a time, into a
    :class:`~auditor.calibration.statistics.whiten.TruncatorStore` holding one part of the model in memory (the rest
    on disk until its layer is replaced)."""
    from .statistics.whiten import TruncatorStore, part_bytes

    store = TruncatorStore(part_bytes(model, planned))
    session.cluster_truncators(planned, store, stats=stats)
    return store


def sequential(calibration: object, model: nn.Module, resolved: dict[str, tuple[Layer, int]]) -> dict[str, Truncator]:
    """The sequential fit's truncators of a checked plan on the fit rows of ``calibration`` (a session or a
    ``Calibration``; input statistics alone hold no rows to fit on)."""
    from .statistics.sequential import sequential_truncators

    if isinstance(calibration, CalibrationSession):
        calibration = calibration.calibration
    if not isinstance(calibration, Calibration):
        raise AuditError(f"the sequential fit needs the calibration rows; {type(calibration).__name__} holds none",
                         "Pass a CalibrationSession or a Calibration (load_calibration), or fit='independent'")
    return sequential_truncators(model, resolved, calibration)
