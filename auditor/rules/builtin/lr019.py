"""The calibration rule LR019: the suggested plan holds the tolerance only after a recovery fine-tune."""

from __future__ import annotations

from ...results import Severity
from ..context import Context
from ..registry import Emit, Scope, rule


@rule("LR019", "plan-needs-recovery", Severity.WARNING, scope=Scope.PLAN)
def lr019(ctx: Context, emit: Emit) -> None:
    """The suggested plan holds the tolerance only after the recovery fine-tune it was chosen with.

    ## What it flags
    An audit with `--budget F --recover STEPS --choose-after-recovery` whose suggested plan was chosen on the
    recovered curve: it removes more than the largest plan that holds before any fine-tune, and its held-out metric,
    measured all at once, holds the tolerance only after the STEPS-step recovery (distillation toward the dense model
    on the calibration's fit rows). LR015 (a plan that misses the tolerance) stays quiet for it; this says why.

    ## Why it is bad
    The plan is only as good as the fine-tune that follows it: written and shipped without that fine-tune it misses
    the tolerance. The recovery measured here is a short distillation on the calibration rows; the team's own
    fine-tune (data, steps, learning rate) is what the shipped model gets.

    ## Example
    ```
    lowrank-audit model.py:build --calibration c.safetensors --budget 0.7 --recover 200 --choose-after-recovery
    ```

    ## Do instead
    Budget that fine-tune (`lowrank-audit factorize --recover STEPS`, or your own training), and describe it in the
    plan's `finetune`; or use the plan that holds before it (the same audit without `--choose-after-recovery`).
    """
    cal = ctx.audit.calibration
    rv = ctx.audit.review
    note = cal.recovery_note() if cal is not None else ""
    if not note or rv is None or not rv.suggested or not rv.items:
        return
    b = cal.budget
    rec = b.recovered
    emit(f"the suggested plan ({b.removed:,} parameters removed) {note}", [],
         f"Budget a {b.recovery.steps}-step recovery fine-tune ({b.recovery.command()}), or drop "
         "--choose-after-recovery for the plan that holds without it",
         removed=b.removed, before=b.metric, after=rec.metric if rec is not None else None,
         tolerance=cal.tolerance, steps=b.recovery.steps)
