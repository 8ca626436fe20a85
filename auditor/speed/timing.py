"""Timing one call: warm-up, then blocks of calls until enough time or runs are gathered; the median and the
interquartile range of the per-call times of the blocks. The clock is a parameter (``time.perf_counter`` by default),
so the mechanics are tested with a fake clock, never a wall time. On a CUDA device each block is timed with CUDA
events after a synchronize (the launch queue would otherwise be timed, not the work).

This is what ``torch.utils.benchmark.Timer.blocked_autorange`` does (blocks sized so that one block takes a few
milliseconds, so the timer's own overhead is negligible), written out so that the clock can be replaced; the
benchmark (benchmarks/latency.py) checks it against ``torch.utils.benchmark`` itself.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from ..speedresults import SANE_S, Timing, sane, seconds  # noqa: F401 - re-exported: the plain data lives there

Clock = Callable[[], float]

# a block lasts at least this long: the clock's overhead (~100 ns) is below 0.1%, and the block short enough that
# most blocks fit between two preemptions on a busy machine
MIN_BLOCK_S = 0.0005
MIN_TIME_S = 0.2  # blocks are added until they total this much
MIN_BLOCKS = 5  # and at least this many blocks (a median and quartiles need a few)
MAX_BLOCKS = 200
WARMUP_CALLS = 2
AGREE = 1.25  # two timings of one call agree when the larger is at most 25% above the smaller


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
