"""Measured rank floors from calibration data, in three tiers.

- Tier 1 (one forward pass): ``input_statistics`` accumulates X^T X per layer; ``whitened_spectrum`` gives the exact
  layer-output error at every rank and a data-aware suggested rank (``tier1`` does both for every layer).
- Tier 2: ``measure_floors`` (a ``Sweeper`` per layer) truncates each layer alone (whitened) and searches, guided by
  the tier-1 curve, for the smallest rank whose model-level metric holds, with the prefix of the layer's block
  replayed from a cache.
- Tier 3: ``plan_for_budget`` allocates ranks over the curves (Lagrangian), applies the whole plan at once with
  ``auditor.calibration.apply.factorize`` and backs off until the model-level metric holds; it also measures a frontier.

A ``CalibrationSession`` (``session.py``) owns what they all measure with: the model, the batches, the input
statistics (computed once), the metric and one ``Evaluator`` (the dense reference measured once); every tier, the plan
check and ``auditor.calibration.apply.factorize`` take one, or build one from the data they are given.

Inputs and results are plain dataclasses (tier 2 and 3 return the report's own types, ``auditor.calresults``); only
``Calibration`` (the input batches) and the session hold tensors.
"""

from __future__ import annotations

from .data.inputs import Batch, Calibration, load_calibration, token_statistics
from .measure.metric import Evaluator, Measurement, Metric, load_metric
from .statistics.stats import InputStatistics, LayerInput, by_name, input_statistics
from .session import CalibrationSession
from .statistics.whiten import Truncator, WhitenedSpectrum, truncated_factors, truncated_weight, whitened_spectrum
from .tiers.tier1 import tier1
from .statistics.whiten import whitened_spectra
from .tiers.sweep import Floor, Floors, Sweeper, measure_floors
from .data.text import is_text_file, text_inputs, tokenizer_home
from .tiers.budget import (
    BudgetPlan, Curves, FrontierPoint, Option, allocate, curves_from_floors, curves_from_spectra, plan_for_budget,
)

__all__ = [
    "Batch", "BudgetPlan", "Calibration", "CalibrationSession", "Curves", "Evaluator", "Floor", "Floors", "FrontierPoint",
    "InputStatistics", "LayerInput", "Measurement", "Metric", "Option", "Sweeper", "Truncator", "WhitenedSpectrum", "allocate",
    "by_name", "curves_from_floors", "curves_from_spectra", "input_statistics", "load_calibration", "load_metric",
    "measure_floors", "plan_for_budget", "tier1", "token_statistics", "truncated_factors", "truncated_weight",
    "whitened_spectra", "whitened_spectrum", "is_text_file", "text_inputs", "tokenizer_home",
]
