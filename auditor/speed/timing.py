"""Timing one call: warm-up, then blocks of calls until enough time or runs are gathered; the median and the
interquartile range of the per-call times of the blocks. The clock is a parameter (``time.perf_counter`` by default),
so the mechanics are tested with a fake clock, never a wall time. On a CUDA device each block is timed with CUDA
events after a synchronize (the launch queue would otherwise be timed, not the work).

This is what ``torch.utils.benchmark.Timer.blocked_autorange`` does (blocks sized so that one block takes a few
milliseconds, so the timer's own overhead is negligible), written out so that the clock can be replaced; the
benchmark (benchmarks/latency.py) checks it against ``torch.utils.benchmark`` itself.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from ..speedresults import Timing

Clock = Callable[[], float]

# a block lasts at least this long: the clock's overhead (~100 ns) is below 0.1%, and the block short enough that
# most blocks fit between two preemptions on a busy machine
MIN_BLOCK_S = 0.0005
MIN_TIME_S = 0.2  # blocks are added until they total this much
MIN_BLOCKS = 5  # and at least this many blocks (a median and quartiles need a few)
MAX_BLOCKS = 200
WARMUP_CALLS = 2


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
    return [Timing.of(xs, c) for xs, c in zip(per_call, sizes)]
