"""Speed, not only size: measured latency and memory of a plan's factorized layers and model (``--measure-speed``),
the time break-even rank per shape, and a plan chosen by latency (``--budget-latency``). See docs/performance.md."""

from __future__ import annotations

from ..speedresults import LatencyPlan, LayerSpeed, ModelRun, ModelSpeed, SpeedReport, TimeBreakEven
from .timing import Timing, measure

__all__ = ["LatencyPlan", "LayerSpeed", "ModelRun", "ModelSpeed", "SpeedReport", "TimeBreakEven", "Timing", "measure"]
