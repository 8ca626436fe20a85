"""The speed rule LR020: a planned layer whose factorized form is slower than its dense form where it was timed."""

from __future__ import annotations

from ...results import Severity
from ..context import Context
from ..registry import Emit, Scope, rule
from ...speedresults import seconds

SPEED_TOLERANCE = 0.05  # slower than dense by more than this share of the dense time: flagged (a constant, not a
# setting: a setting would enter every report's settings block, and audits without speed must read as before)


@rule("LR020", "factorized-slower", Severity.WARNING, scope=Scope.PLAN)
def lr020(ctx: Context, emit: Emit) -> None:
    """A planned layer is slower factorized than dense, measured.

    ## What it flags
    With `--measure-speed`: a planned layer whose factorized form (the two modules `factorize` writes, timed on the
    audit's device at the input the trace saw, or at `--latency-shape`) takes longer per call than its dense form,
    by more than 5% of the dense time. The finding gives both times and the time break-even rank: the largest rank
    measured to be faster than dense at that shape, if any.

    ## Why it is bad
    Fewer parameters and MACs do not make a layer faster. At batch 1 a layer is memory-bound and a factorized one is
    two small matmuls and a launch more; near the parameter break-even m*n/(m+n) it reads almost as many weights
    and does two passes. A plan sold as a speed-up can make the model slower where it runs.

    ## Example
    ```
    lowrank-audit model.py:build --plan plan.toml --measure-speed --latency-shape 1,128
    ```
    with a rank near break-even on a 4096x4096 projection at batch 1 on a CPU.

    ## Do instead
    Lower the rank to the time break-even rank the report gives (or below), keep the layer dense if it is there for
    speed, or plan for the shape the model serves at (`--latency-shape`): a larger batch moves the crossover up.
    """
    sp = ctx.audit.speed
    if sp is None:
        return
    tol = SPEED_TOLERANCE
    planned = ctx.planned
    for s in sp.layers:
        if s.layer not in planned or s.factorized.median <= s.dense.median * (1 + tol):
            continue
        be = sp.break_even_for(s.layer, s.at)
        shape = "x".join(map(str, s.input_shape))
        faster = (f"rank {be.rank} or below is faster there" if be is not None and be.rank is not None
                  else "no rank measured was faster there")
        fix = (f"Plan rank {be.rank} or below for this layer, or keep it dense" if be is not None and be.rank
               else "Keep the layer dense where speed matters, or plan for a larger batch (--latency-shape)")
        emit(f"{s.layer} at rank {s.rank} is slower factorized: {seconds(s.factorized.median)} against "
             f"{seconds(s.dense.median)} dense per call on {sp.where()}, input {shape}; {faster}",
             [s.layer], fix, rank=s.rank, factorized_s=s.factorized.median, dense_s=s.dense.median,
             device=sp.device, threads=sp.threads, input_shape=list(s.input_shape), at=s.at,
             time_break_even=be.rank if be is not None else None)
