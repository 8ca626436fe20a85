"""What a speed measurement found, as plain data (no torch): per planned layer the dense and factorized times, the
time break-even rank per shape, the whole model dense vs factorized (and its exported programs), and the plan chosen
by ``--budget-latency``. Every time carries its spread (:class:`Timing`), and the report its device, dtype and
thread count. Below :mod:`auditor.results`, which carries a :class:`SpeedReport`; :mod:`auditor.speed` measures."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

SANE_S = (1e-9, 3600.0)  # a time per call outside this (or NaN, infinite) is no measurement


def seconds(s: float) -> str:
    """A time per call, readable: ``38.7 µs``, ``2.74 ms``, ``1.20 s``.

    >>> seconds(3.87e-5), seconds(2.74e-3), seconds(1.2)
    ('38.7 µs', '2.74 ms', '1.2 s')
    """
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= scale:
            v = s / scale
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{s * 1e9:.0f} ns"


def sane(t: Any) -> bool:
    """A number that can be a time per call: finite, within :data:`SANE_S` (a float, not a bool)."""
    return type(t) in (int, float) and math.isfinite(t) and SANE_S[0] <= t <= SANE_S[1]


@dataclass(frozen=True)
class Timing:
    """Seconds per call: the median of the blocks' per-call times and their quartiles (the spread is q3 - q1)."""

    median: float
    q1: float
    q3: float
    blocks: int  # blocks timed
    calls: int  # calls per block

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    def to_dict(self) -> dict[str, Any]:
        return {"median_s": self.median, "q1_s": self.q1, "q3_s": self.q3, "iqr_s": self.iqr,
                "blocks": self.blocks, "calls_per_block": self.calls}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Timing":
        """A timing read back (from the cache): a ValueError unless its numbers are sane and ordered (q1 <= median
        <= q3, at least one block of at least one call)."""
        if not isinstance(d, dict):
            raise ValueError("a timing is a JSON object")
        xs = [d.get("median_s"), d.get("q1_s"), d.get("q3_s")]
        blocks, calls = d.get("blocks"), d.get("calls_per_block")
        if not all(sane(x) for x in xs) or not xs[1] <= xs[0] <= xs[2]:
            raise ValueError(f"not a sane time per call: {xs!r:.80}")
        if type(blocks) is not int or type(calls) is not int or not (1 <= blocks <= 1 << 20 and 1 <= calls <= 1 << 30):
            raise ValueError("not a count of blocks and calls")
        return cls(float(xs[0]), float(xs[1]), float(xs[2]), blocks, calls)

    @classmethod
    def of(cls, per_call: list[float], calls: int) -> "Timing":
        """The median and quartiles of per-call times (one per block)."""
        xs = sorted(per_call)
        if len(xs) == 1:
            return cls(xs[0], xs[0], xs[0], 1, calls)
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
        return cls(statistics.median(xs), q1, q3, len(xs), calls)


def ratio(dense: Timing, factorized: Timing) -> float:
    """Dense time over factorized time: above 1 the factorized form is faster."""
    return dense.median / factorized.median if factorized.median > 0 else float("inf")


@dataclass(frozen=True)
class LayerSpeed:
    """One planned layer at one input shape: the dense module and the module ``factorize`` writes at ``rank``."""

    layer: str
    kind: str
    m: int
    n: int
    rank: int
    input_shape: tuple[int, ...]
    at: str  # "traced" (the input the trace saw) or "latency-shape" (--latency-shape)
    dense: Timing
    factorized: Timing
    cached: bool = False

    @property
    def ratio(self) -> float:
        return ratio(self.dense, self.factorized)

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "kind": self.kind, "m": self.m, "n": self.n, "rank": self.rank,
                "input_shape": list(self.input_shape), "at": self.at, "dense": self.dense.to_dict(),
                "factorized": self.factorized.to_dict(), "speedup": self.ratio, "cached": self.cached}


@dataclass(frozen=True)
class TimeBreakEven:
    """The largest rank on a grid (multiples of ``step``, up to the parameter break-even) whose factorized layer is
    faster than the dense one at this input shape; None when even the smallest is slower."""

    kind: str
    m: int
    n: int
    input_shape: tuple[int, ...]
    at: str
    rank: int | None
    step: int  # the grid's resolution: the true crossover lies within one step above ``rank``
    param_break_even: float
    capped: bool  # the largest rank tried (at the parameter break-even) was still faster
    dense: Timing
    probes: tuple[tuple[int, Timing], ...]  # (rank, factorized time) of each rank measured, in measuring order
    layers: tuple[str, ...] = ()
    paired: tuple[Timing, ...] = ()  # the dense time measured side by side with each probe (what it was judged by)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "m": self.m, "n": self.n, "input_shape": list(self.input_shape), "at": self.at,
                "rank": self.rank, "step": self.step, "param_break_even": round(self.param_break_even, 4),
                "capped": self.capped, "dense": self.dense.to_dict(), "layers": list(self.layers),
                "probes": [{"rank": r, **t.to_dict(), **({"dense_median_s": d.median} if d is not None else {})}
                           for (r, t), d in zip(self.probes, [*self.paired, *[None] * len(self.probes)])]}

    def label(self) -> str:
        if self.rank is None:
            return f"none (rank {min((r for r, _ in self.probes), default=1)} is already slower)"
        return f"{'>=' if self.capped else ''}{self.rank}"


@dataclass(frozen=True)
class ModelRun:
    """One end-to-end run: time per forward and peak memory (CPU: peak RSS while the forwards ran, in a fresh
    process; CUDA: max allocated)."""

    timing: Timing
    peak_bytes: int | None
    memory: str  # "rss" | "cuda-max-allocated" | ""
    params: int

    def to_dict(self) -> dict[str, Any]:
        return {**self.timing.to_dict(), "peak_bytes": self.peak_bytes, "memory": self.memory, "params": self.params}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelRun":
        return cls(Timing.from_dict(d), d.get("peak_bytes"), str(d.get("memory", "")), int(d.get("params", 0)))


@dataclass(frozen=True)
class ModelSpeed:
    dense: ModelRun
    factorized: ModelRun
    inputs: str  # the input shapes the forwards ran at
    where: str  # "subprocess" (a fresh process each) or "in-process"

    @property
    def ratio(self) -> float:
        return ratio(self.dense.timing, self.factorized.timing)

    @property
    def latency_change(self) -> float:
        """Relative change of the latency: -0.31 is 31% faster."""
        return self.factorized.timing.median / self.dense.timing.median - 1

    def to_dict(self) -> dict[str, Any]:
        return {"dense": self.dense.to_dict(), "factorized": self.factorized.to_dict(), "speedup": self.ratio,
                "latency_change": self.latency_change, "inputs": self.inputs, "where": self.where}


@dataclass(frozen=True)
class LatencyPlan:
    """``--budget-latency F``: the plan saving the most parameters whose whole-model latency, measured, removes at
    least ``target`` of the dense model's latency: every planned layer, then (while the target is missed) the layers
    that cost time left dense, the worst first; ``ranks`` empty when none of those tried does. ``predicted_change``
    is what the layer times alone predict for it (dense model time minus each layer's saving times its calls)."""

    target: float
    ranks: dict[str, int]
    params_removed: int
    predicted_change: float  # relative latency change the layer times predict (-0.2: 20% faster)
    dropped: tuple[str, ...]  # planned layers left dense to meet the target
    measured: ModelRun | None = None  # the chosen plan, end to end
    dense: ModelRun | None = None  # the dense model, timed side by side with it

    @property
    def met(self) -> bool:
        return bool(self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "met": self.met, "ranks": self.ranks, "params_removed": self.params_removed,
                "predicted_change": self.predicted_change, "dropped": list(self.dropped),
                "measured": self.measured.to_dict() if self.measured is not None else None,
                "dense": self.dense.to_dict() if self.dense is not None else None}


@dataclass(frozen=True)
class FrontierSpeed:
    """One plan of the calibration's frontier (``--budget``), timed end to end beside the dense model."""

    removed: int
    removed_fraction: float
    layers: int
    run: ModelRun

    def to_dict(self) -> dict[str, Any]:
        return {"removed": self.removed, "removed_fraction": self.removed_fraction, "layers": self.layers,
                **self.run.to_dict()}


@dataclass(frozen=True)
class SpeedReport:
    device: str
    dtype: str
    threads: int
    versions: dict[str, str]
    layers: list[LayerSpeed] = field(default_factory=list)
    break_even: list[TimeBreakEven] = field(default_factory=list)
    model: ModelSpeed | None = None
    latency_plan: LatencyPlan | None = None
    notes: list[str] = field(default_factory=list)
    frontier: list[FrontierSpeed] = field(default_factory=list)  # with --budget: the frontier's plans, timed
    frontier_dense: ModelRun | None = None  # the dense model timed beside them

    def traced(self) -> dict[str, LayerSpeed]:
        """Layer name -> its timing at the traced input shape."""
        return {s.layer: s for s in self.layers if s.at == "traced"}

    def break_even_for(self, layer: str, at: str = "traced") -> TimeBreakEven | None:
        for b in self.break_even:
            if layer in b.layers and b.at == at:
                return b
        return None

    def where(self) -> str:
        """``cpu (2 threads)`` or ``cuda:0``."""
        return f"{self.device} ({self.threads} thread{'s' if self.threads != 1 else ''})" \
            if self.device == "cpu" else self.device

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "dtype": self.dtype, "threads": self.threads, "versions": self.versions,
                "layers": [s.to_dict() for s in self.layers],
                "break_even": [b.to_dict() for b in self.break_even],
                "model": self.model.to_dict() if self.model is not None else None,
                "latency_plan": self.latency_plan.to_dict() if self.latency_plan is not None else None,
                "notes": self.notes, "frontier": [f.to_dict() for f in self.frontier],
                "frontier_dense": self.frontier_dense.to_dict() if self.frontier_dense is not None else None}
