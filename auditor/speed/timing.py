"""Timing one call: warm-up, then blocks of calls until enough time or runs are gathered; the median and the
interquartile range of the per-call times of the blocks. The clock is a parameter (``time.perf_counter`` by default),
so the mechanics are tested with a fake clock, never a wall time. On a CUDA device each block is timed with CUDA
events after a synchronize (the launch queue would otherwise be timed, not the work).

This is what ``torch.utils.benchmark.Timer.blocked_autorange`` does (blocks sized so that one block takes a few
milliseconds, so the timer's own overhead is negligible), written out so that the clock can be replaced; the
benchmark (benchmarks/latency.py) checks it against ``torch.utils.benchmark`` itself.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

Clock = Callable[[], float]

# a block lasts at least this long: the clock's overhead (~100 ns) is below 0.1%, and the block short enough that
# most blocks fit between two preemptions on a busy machine
MIN_BLOCK_S = 0.0005
MIN_TIME_S = 0.2  # blocks are added until they total this much
MIN_BLOCKS = 5  # and at least this many blocks (a median and quartiles need a few)
MAX_BLOCKS = 200
WARMUP_CALLS = 2
AGREE = 1.25  # two timings of one call agree when the larger is at most 25% above the smaller
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


def agree(a: float, b: float) -> bool:
    """Whether two times of one call agree within :data:`AGREE` (both sane)."""
    return sane(a) and sane(b) and max(a, b) <= AGREE * min(a, b)


def halves(per_call: list[float]) -> tuple[float, float] | None:
    """The medians of the first and the second half of the blocks (in timing order, the first block left out
    where more than two): two repeats of one measurement, one after the other, so that a load that comes or goes
    in between shows (None under two blocks)."""
    xs = per_call[1:] if len(per_call) > 2 else per_call  # the first block sized the rest (and ran cold)
    if len(xs) < 2:
        return None
    k = len(xs) // 2
    return statistics.median(xs[:k]), statistics.median(xs[k:])


def refusal(what: str, per_call: list[float], one_thread: float | None = None) -> str | None:
    """Why the blocks ``per_call`` of ``what`` are no timing to report or keep, or None: a time that is not sane,
    two repeats (:func:`halves`) more than 25% apart, or (``one_thread``: the same call timed on one thread) threads
    that make the call more than 25% slower than one thread does (spin-waiting threads stalling each other)."""
    if not per_call or not all(sane(t) for t in per_call):
        return f"{what} gave no sane time"
    h = halves(per_call)
    if h is not None and not agree(*h):
        return f"{what} took {seconds(h[0])} and {seconds(h[1])} in two repeats (more than 25% apart)"
    med = statistics.median(per_call)
    if one_thread is not None and (not sane(one_thread) or med > AGREE * one_thread):
        return (f"{what} took {seconds(med)} with its threads against {seconds(one_thread)} on one thread (the "
                "threads stall each other)")
    return None


def same_verdict(dense: float, fact: float, dense1: float, fact1: float) -> bool:
    """Whether the factorized call is faster (or not) than the dense one alike with threads and on one thread; a
    near tie on one thread (within 25%) agrees with either verdict."""
    if agree(dense1, fact1):
        return True
    return (fact < dense) == (fact1 < dense1)


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


def _sync(device: str) -> Callable[[], None]:
    if device.startswith("cuda"):
        import torch

        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def block_timer(device: str = "cpu", clock: Clock | None = None) -> Callable[[Callable[[], Any], int], float]:
    """seconds for ``calls`` calls of ``fn``: CUDA events on a GPU (without a clock given), else ``clock`` (the wall
    clock by default), the device synchronized before it is read."""
    sync = _sync(device)
    events = device.startswith("cuda") and clock is None
    clock = clock or time.perf_counter

    def block(fn: Callable[[], Any], calls: int) -> float:
        if events:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize(device)
            return start.elapsed_time(end) / 1e3
        t0 = clock()
        for _ in range(calls):
            fn()
        sync()
        return clock() - t0
    return block


def measure(fn: Callable[[], Any], *, device: str = "cpu", clock: Clock | None = None,
            min_time: float = MIN_TIME_S, min_blocks: int = MIN_BLOCKS, max_blocks: int = MAX_BLOCKS,
            warmup: int = WARMUP_CALLS) -> Timing:
    """Time ``fn()``: ``warmup`` calls, then the block size (calls) doubled until a block lasts ``MIN_BLOCK_S``, then
    blocks until ``min_time`` seconds and ``min_blocks`` blocks (at most ``max_blocks``). ``clock`` returns seconds;
    on CUDA (without a clock given) CUDA events time each block.

    >>> class Fake:  # a fake clock: every call of work advances it by half a "second"
    ...     t = 0.0
    ...     def __call__(self): return self.t
    >>> clk = Fake()
    >>> def work(): clk.t += 0.5
    >>> t = measure(work, clock=clk, min_time=5, min_blocks=3)
    >>> t.median, t.calls
    (0.5, 1)
    """
    return measure_many([fn], device=device, clock=clock, min_time=min_time, min_blocks=min_blocks,
                        max_blocks=max_blocks, warmup=warmup)[0]


def measure_many(fns: list[Callable[[], Any]], *, device: str = "cpu", clock: Clock | None = None,
                 min_time: float = MIN_TIME_S, min_blocks: int = MIN_BLOCKS, max_blocks: int = MAX_BLOCKS,
                 warmup: int = WARMUP_CALLS) -> list[Timing]:
    """Time several calls side by side: their blocks interleaved (a, b, a, b, ...), so that a change of the
    machine's load (other processes, clock frequency) falls on all of them alike and their ratio stays fair. Each
    gets its own block size and at least ``min_time`` seconds of blocks."""
    per_call, sizes = measure_blocks(fns, device=device, clock=clock, min_time=min_time, min_blocks=min_blocks,
                                     max_blocks=max_blocks, warmup=warmup)
    return [Timing.of(xs, c) for xs, c in zip(per_call, sizes)]


def measure_blocks(fns: list[Callable[[], Any]], *, device: str = "cpu", clock: Clock | None = None,
                   min_time: float = MIN_TIME_S, min_blocks: int = MIN_BLOCKS, max_blocks: int = MAX_BLOCKS,
                   warmup: int = WARMUP_CALLS) -> tuple[list[list[float]], list[int]]:
    """:func:`measure_many`'s blocks: (each call's per-call times, one per block in timing order; its block
    size)."""
    sync = _sync(device)
    block = block_timer(device, clock)

    sizes: list[int] = []
    per_call: list[list[float]] = []
    totals: list[float] = []
    for fn in fns:
        for _ in range(warmup):
            fn()
        sync()
        calls = 1
        took = block(fn, calls)
        while took < MIN_BLOCK_S and calls < 1 << 20:
            calls *= 2 if took <= 0 else max(2, min(16, int(MIN_BLOCK_S / took) + 1))
            took = block(fn, calls)
        sizes.append(calls)
        per_call.append([took / calls])
        totals.append(took)
    while True:
        todo = [i for i in range(len(fns)) if len(per_call[i]) < max_blocks
                and (totals[i] < min_time or len(per_call[i]) < min_blocks)]
        if not todo:
            break
        for i in range(len(fns)):  # every call gets a block in each round: the interleaving stays even
            if len(per_call[i]) >= max_blocks:
                continue
            took = block(fns[i], sizes[i])
            per_call[i].append(took / sizes[i])
            totals[i] += took
    return per_call, sizes
