"""Tier 1 for a whole model: input statistics in one pass, then the whitened spectrum of every layer that has them."""

from __future__ import annotations

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
          jobs: int | None = None) -> tuple[InputStatistics, dict[str, WhitenedSpectrum]]:
    """Input statistics (the session's, or ``stats`` when given, e.g. from a cache) and the whitened spectrum of
    every layer that has them, keyed by ``Layer.name``. Layers without statistics are in ``stats.missing``: they keep
    the weight-energy rank."""
    if stats is None:
        stats = CalibrationSession.of(calibration, model, layers=layers).statistics(layers)
    table = ParamTable.of(model)
    weights = {layer.param: table.tensor(layer.param) for layer in by_name(layers).values()}
    return stats, whitened_spectra(layers, weights, stats, align, target, jobs)
