"""The plan rule LR005: a plan file that budgets no recovery fine-tune."""

from __future__ import annotations

from ...results import Severity
from ..context import Context
from ..registry import Emit, Need, Scope, rule


@rule("LR005", "no-finetune-budget", Severity.WARNING, scope=Scope.PLAN, needs={Need.PLAN})
def lr005(ctx: Context, emit: Emit) -> None:
    """The plan budgets no recovery fine-tune.

    ## What it flags
    A plan file without a non-empty `finetune` entry.

    ## Why it is bad
    Truncating a trained weight always moves the model; even at 99% energy the errors of many layers compound.
    A recovery fine-tune is part of every low-rank compression that keeps its accuracy, and it costs compute and
    data that must be planned.

    ## Example
    ```toml
    [ranks]
    "*.mlp.*" = "energy:0.95"
    # no finetune = "..."
    ```

    ## Do instead
    Add `finetune = "1 epoch on the training set, lr 1e-4"` (or whatever you have budgeted) to the plan.
    """
    if ctx.plan is not None and ctx.items and not ctx.plan.has_finetune:
        emit(f"plan {ctx.plan.source} budgets no recovery fine-tune", [],
             'Add finetune = "..." describing the recovery fine-tune', finetune=ctx.plan.finetune)
