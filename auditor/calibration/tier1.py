"""Tier 1 for a whole model: input statistics in one pass, then the whitened spectrum of every layer that has them."""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
from torch import nn

from ..structure.layers import ParamTable
from ..results import Layer
from .inputs import Calibration
from .session import CalibrationSession
from .stats import InputStatistics, by_name
from .whiten import WhitenedSpectrum, whitened_spectrum


def whitened_spectra(layers: dict[str, Layer] | list[Layer], weights: dict[str, torch.Tensor],
                     stats: InputStatistics, align: int = 8, target: float = 0.01,
                     jobs: int | None = None,
                     progress: Callable[[int, int], None] | None = None) -> dict[str, WhitenedSpectrum]:
    """The whitened spectrum of every layer in ``layers`` that has input statistics, keyed by ``Layer.name`` in
    the layers' order. ``weights``: parameter name -> tensor. The decompositions are many small eigh calls, so
    they run on ``jobs`` threads (default: the CPU count), each with one BLAS thread: NumPy's LAPACK releases the
    GIL, and one thread per core beats OpenBLAS threads spinning against each other. ``progress(done, total)`` is
    called (on the calling thread) as each layer's spectrum comes back, in the layers' order."""
    from threadpoolctl import threadpool_limits

    todo = [(layer, stats.layers[layer.name]) for layer in by_name(layers).values() if layer.name in stats.layers]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo) or 1))
    def one(t: tuple[Layer, Any]) -> WhitenedSpectrum:
        return whitened_spectrum(t[0], weights[t[0].param], t[1], align, target)

    done: list[WhitenedSpectrum] = []
    with threadpool_limits(limits=1, user_api="blas"):
        with (ThreadPoolExecutor(jobs) if jobs > 1 else contextlib.nullcontext()) as pool:
            for spec in (pool.map(one, todo) if pool is not None else map(one, todo)):
                done.append(spec)
                if progress is not None:
                    progress(len(done), len(todo))
    return {spec.layer: spec for spec in done}


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
