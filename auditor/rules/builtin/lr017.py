"""The calibration rule LR017: a bfloat16 / float16 model whose rounding alone uses much of the tolerance."""

from __future__ import annotations

from ...results import Severity
from ..context import Context
from ..registry import Emit, rule

HALF = 0.5  # a constant, not a setting: a new setting would change every report's settings table

@rule("LR017", "rounding-floor-high", Severity.WARNING)
def lr017(ctx: Context, emit: Emit) -> None:
    """A low-precision model whose rounding alone uses much of the tolerance.

    ## What it flags
    A bfloat16 / float16 model whose metric, with every plannable layer factorized at full rank (nothing dropped,
    the factors rounded to the model's dtype as `factorize` writes them), uses more than half the
    tolerance, but less than all of it (LR018 flags that).

    ## Why it is bad
    Every plan pays that rounding before it drops a single direction, so the ranks are chosen with what is left of
    the tolerance: in bfloat16, factorizing every MLP of a model at full rank measured 0.0070 of a 0.01 tolerance,
    leaving 0.003 for the truncation itself. The plan search still judges plans against the tolerance as given
    (the rounding is part of each plan's cost), so the plan is small, and the metric is mostly noise of the dtype.

    ## Example
    ```
    lowrank-audit model.py:build_bf16 --calibration data.pt --tolerance 0.01
    ```

    ## Do instead
    Factorize a float32 copy and cast after recovery, keep the factors in float32, or give a larger `--tolerance`.
    """
    cal = ctx.audit.calibration
    f = cal.rounding_floor if cal is not None else None
    if f is None or not HALF < f.share < 1.0:
        return
    emit(f"{f.dtype} rounding alone (every one of {f.layers} layers factorized at full rank) measures "
         f"{cal.metric} {f.metric:.4g}: {100 * f.share:.0f}% of the tolerance {f.tolerance:g}", [],
         "Factorize a float32 copy (or keep the factors in float32), or give a larger --tolerance",
         dtype=f.dtype, floor=f.metric, used=f.used, tolerance=f.tolerance, factorized=f.layers)
