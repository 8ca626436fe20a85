"""Tier 1 for a whole model: input statistics in one pass, then the whitened spectrum of every layer that has them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...structure.layers import ParamTable
from ...results import Layer
from ..data.inputs import Calibration
from ..session import CalibrationSession
from ..statistics.stats import InputStatistics, by_name
from ..statistics.whiten import WhitenedSpectrum, whitened_spectra


def tier1(model: nn.Module, layers: dict[str, Layer] | list[Layer], calibration: Calibration | CalibrationSession,
          align: int = 8, target: float = 0.01, stats: InputStatistics | None = None,
          scheduler: Any = None) -> tuple[InputStatistics, dict[str, WhitenedSpectrum]]:
    """Input statistics (the session's, or ``stats`` when given, e.g. from a cache) and the whitened spectrum of
    every layer that has them, keyed by ``Layer.name``. Layers without statistics are in ``stats.missing``: they keep
    the weight-energy rank. ``scheduler`` (a Dask scheduler address or a ``distributed.Client``): the
    decompositions run there, one task per distinct layer input
    (:class:`~auditor.calibration.statistics.remote.ClusterDecompositions`), the same spectra bit for bit."""
    if stats is None:
        stats = CalibrationSession.of(calibration, model, layers=layers).statistics(layers)
    table = ParamTable.of(model)
    weights = {layer.param: table.tensor(layer.param) for layer in by_name(layers).values()}
    if scheduler is None:
        return stats, whitened_spectra(layers, weights, stats, align, target)
    from ..statistics.remote import ClusterDecompositions

    with ClusterDecompositions(scheduler, model=model) as cluster:  # one block (or outside layer) at a time
        return stats, cluster.spectra(list(by_name(layers).values()), weights, stats, align, target)
