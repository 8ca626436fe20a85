"""The calibration rule LR018: a bfloat16 / float16 model whose rounding alone uses the whole tolerance."""

from __future__ import annotations

import math

from ...results import Severity
from ..context import Context
from ..registry import Emit, rule


@rule("LR018", "rounding-floor-over-tolerance", Severity.ERROR)
def lr018(ctx: Context, emit: Emit) -> None:
    """A low-precision model whose rounding alone uses the whole tolerance: no plan can be judged.

    ## What it flags
    A bfloat16 / float16 model whose metric, with every plannable layer factorized at full rank (nothing dropped,
    the factors rounded to the model's dtype as `factorize` writes them), is at or beyond the tolerance, or not a
    number.

    ## Why it is bad
    No plan can hold a tolerance that rounding alone already misses: every plan measured fails, or holds only
    where its truncation happens to cancel rounding noise. The suggestion then keeps every layer dense, and a
    reviewed plan's measurement says nothing about its ranks.

    ## Example
    ```
    lowrank-audit model.py:build_fp16 --calibration data.pt --tolerance 0.001
    ```

    ## Do instead
    Factorize a float32 copy (or keep the factors in float32) and cast after recovery, or give a tolerance above
    the rounding floor the report names.
    """
    cal = ctx.audit.calibration
    f = cal.rounding_floor if cal is not None else None
    if f is None or (math.isfinite(f.share) and f.share < 1.0):
        return
    emit(f"{f.dtype} rounding alone (every one of {f.layers} layers factorized at full rank) measures "
         f"{cal.metric} {f.metric:.4g}, at or above the tolerance {f.tolerance:g}: no plan can be judged", [],
         "Factorize a float32 copy (or keep the factors in float32), or give a tolerance above the floor",
         dtype=f.dtype, floor=f.metric, used=f.used, tolerance=f.tolerance, factorized=f.layers)
