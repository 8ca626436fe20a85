"""The calibration rule LR016: calibration data was given, but the plan could not be measured all at once."""

from __future__ import annotations

import math

from ...results import Severity
from ..context import Context
from ..registry import Emit, Scope, rule


@rule("LR016", "plan-not-measured", Severity.WARNING, scope=Scope.PLAN)
def lr016(ctx: Context, emit: Emit) -> None:
    """Calibration data was given, but the plan could not be measured all at once.

    ## What it flags
    An audit with `--calibration` whose reviewed plan has planned layers, none of which the all-at-once check could
    factorize (tied weights, recurrent gates, attention in-projections), or whose measurement is not a number.

    ## Why it is bad
    Without the all-at-once measurement nothing says whether the plan holds the tolerance: a report that said
    PASS would be a guess presented as a measurement.

    ## Example
    ```toml
    [ranks]
    "lstm.weight_ih_l0" = 64   # factorize() cannot rewrite LSTM gates: the plan is not measured
    ```

    ## Do instead
    Plan layers that `factorize` rewrites (Linear, Conv1D, convolutions, embeddings), or measure the plan with your
    own pipeline before adopting it.
    """
    cal = ctx.audit.calibration
    rv = ctx.audit.review
    if cal is None or rv is None or not rv.items:
        return
    pc = cal.plan_check
    if pc is None:
        emit("the plan was not measured all at once", [], "Report this: the plan check did not run")
    elif pc.layers == 0:
        emit("the plan was not measured all at once: factorize() cannot rewrite any of its layers ("
             + ", ".join(pc.left_out[:5]) + (f" and {len(pc.left_out) - 5} more" if len(pc.left_out) > 5 else "")
             + ")", list(pc.left_out), "Plan layers that factorize rewrites, or measure the plan yourself",
             left_out=list(pc.left_out))
    elif math.isnan(pc.measured):  # an infinite one is a measurement: LR015 says the plan misses by it
        emit(f"the plan's all-at-once measurement is not a number ({pc.measured})", [],
             "Check the metric and the held-out data", measured=pc.measured)
