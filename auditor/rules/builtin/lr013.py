"""The calibration rule LR013: a plan reviewed without calibration data, so its rank floors are guesses."""

from __future__ import annotations

from ...results import Severity
from ..context import Context
from ..registry import Emit, Need, Scope, rule


@rule("LR013", "plan-without-calibration", Severity.INFO, scope=Scope.PLAN, needs={Need.PLAN})
def lr013(ctx: Context, emit: Emit) -> None:
    """A plan reviewed without calibration data: its rank floors are guesses.

    ## What it flags
    A plan file reviewed without `--calibration`.

    ## Why it is bad
    Without the model's own inputs the review can only compare ranks with weight energy, and weight energy does not
    predict where a layer's floor sits: on a trained BERT-style model its rank correlation with the measured floor
    was 0.82 at best, with errors up to 3.5x, and it removed 1.5% of the parameters where measured floors removed
    21.9% at the same accuracy.

    ## Example
    ```
    lowrank-audit model.py:build --plan plan.toml
    ```

    ## Do instead
    Pass `--calibration inputs.safetensors` (a few hundred real examples) and `--measure-floor`; the report then
    shows each layer's measured floor and the plan measured all at once.
    """
    if ctx.plan is not None and ctx.items and ctx.audit.calibration is None:
        emit(f"plan {ctx.plan.source} is reviewed without calibration data: its rank floors are guesses from "
             "weight energy", [], "Pass --calibration FILE (and --measure-floor) to measure them",
             plan=ctx.plan.source)
