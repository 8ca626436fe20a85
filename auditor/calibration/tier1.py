"""Tier 1 for a whole model: input statistics in one pass, then the whitened spectrum of every layer that has them."""

from __future__ import annotations

from torch import nn

from ..layers import ParamTable
from ..results import Layer
from .inputs import Calibration
from .stats import InputStatistics, input_statistics
from .whiten import WhitenedSpectrum, whitened_spectrum


def tier1(model: nn.Module, layers: dict[str, Layer], calibration: Calibration, align: int = 8,
          target: float = 0.01, stats: InputStatistics | None = None) -> tuple[InputStatistics, dict[str, WhitenedSpectrum]]:
    """Input statistics (unless given, e.g. from a cache) and the whitened spectrum of every layer that has them,
    keyed by ``Layer.name``. Layers without statistics are in ``stats.missing``: they keep the weight-energy rank."""
    if stats is None:
        stats = input_statistics(model, layers, calibration)
    table = ParamTable.of(model)
    spectra: dict[str, WhitenedSpectrum] = {}
    for layer in layers.values():
        inp = stats.layers.get(layer.name)
        if inp is None:
            continue
        spectra[layer.name] = whitened_spectrum(layer, table.tensor(layer.param), inp, align, target)
    return stats, spectra
