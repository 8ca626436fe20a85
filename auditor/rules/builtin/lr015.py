"""The calibration rule LR015: the reviewed plan, factorized all at once, misses the tolerance on the held-out rows."""

from __future__ import annotations

import math

from ...results import Severity
from ..context import Context
from ..registry import Emit, Scope, rule


@rule("LR015", "plan-misses-tolerance", Severity.ERROR, scope=Scope.PLAN)
def lr015(ctx: Context, emit: Emit) -> None:
    """The plan, factorized all at once, misses the tolerance on the held-out calibration data.

    ## What it flags
    With `--calibration`, the reviewed plan (yours, or the suggested ranks) is factorized all at once with whitened
    initialisation and measured on the held-out rows. This rule fires when that measurement misses the tolerance:
    the relative output error above it, or a user metric more than the tolerance below the dense model's value.

    ## Why it is bad
    Each layer's floor is measured with that layer alone truncated; the errors of the others add on top (roughly
    in quadrature, worse near the cliff). Per-layer floors that each hold at 1% gave 3.7% all at once on the sample
    char transformer, and on a trained BERT-style masked LM a plan of per-layer floors dropped held-out masked-token
    accuracy from 88.8% to 84.2%. Only the all-at-once number says whether the plan holds.

    ## Example
    ```toml
    [ranks]
    "blocks.*.mlp.fc1" = 24   # each at its measured floor; all at once: 0.037 against a 0.01 tolerance
    ```

    ## Do instead
    Use the plan the audit measured to hold (`--emit-plan` writes it; `--budget` caps its share), or raise the
    ranks of the layers with the largest single-layer errors and measure again.

    A suggested plan chosen with `--choose-after-recovery` (it holds after the `--recover` fine-tune, measured) is
    flagged by LR019 instead: the verdict, the plan header and every report say that it needs that fine-tune.
    """
    cal = ctx.audit.calibration
    pc = cal.plan_check if cal is not None else None
    rv = ctx.audit.review
    if pc is None or pc.layers == 0 or pc.ok or rv is None:
        return
    if rv.suggested and cal.recovery_note():  # --choose-after-recovery: it holds after that fine-tune (LR019)
        return
    what = "suggested plan" if rv.suggested else ("plan" if rv.source == "plan" else f"plan {rv.source}")
    b = cal.budget
    held = (f"; the largest plan that held removed {100 * b.removed_fraction:.1f}% of the parameters at "
            f"{b.metric:.4g}" if b is not None and b.ok and b.plan else "; no plan measured held it")
    v = pc.verification
    u = v.unseen if v is not None else None  # the interval the plan is judged on, where drawn
    unseen = f"; for an unseen document {u.low:.4g} to {u.high:.4g}, {u.label}" if u is not None else ""
    where = "on the held-out rows, missing" if v is None else (
        f"on the verification rows ({100 * v.confidence:g}% interval {v.low:.4g} to {v.high:.4g}{unseen}), "
        + ("straddling" if v.straddles else "missing") if v.low is not None and v.high is not None
        else "on the verification rows, missing")
    if math.isnan(pc.measured):  # measured on nothing: no number to miss the tolerance by
        emit(f"the {what} factorized all at once is unmeasured: its {cal.metric} on the held-out rows is not a "
             f"number, so whether it holds the tolerance {cal.tolerance:g} is unknown ({pc.layers} layers, "
             f"{pc.removed:,} parameters removed){held}", [], "Check the metric and the held-out data (rows the "
             "metric can score), then measure the plan again", measured=None, tolerance=cal.tolerance,
             planned_layers=pc.layers, removed=pc.removed)
        return
    number = f"{pc.measured:.4g}" if math.isfinite(pc.measured) else (
        f"infinite ({cal.increase_of or cal.metric} infinite)" if pc.measured > 0 else "-infinite")
    emit(f"the {what} factorized all at once measures {cal.metric} {number} {where} the tolerance "
         f"{cal.tolerance:g} ({pc.layers} layers, {pc.removed:,} parameters removed){held}",
         [], "Use the plan that holds (--emit-plan writes it), or raise the ranks of the layers with the largest "
         "single-layer errors", measured=pc.measured, tolerance=cal.tolerance, planned_layers=pc.layers,
         removed=pc.removed, held_removed=b.removed if b is not None and b.ok else None,
         held_metric=b.metric if b is not None and b.ok else None)
