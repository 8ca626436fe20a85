"""The calibration rule LR012: a planned rank below the layer's measured rank floor (``--measure-floor``). It reads
``audit.calibration`` (:class:`auditor.calresults.CalibrationReport`)."""

from __future__ import annotations

from ...results import Severity
from ..context import Context
from ..registry import Emit, Scope, rule


@rule("LR012", "rank-below-measured-floor", Severity.ERROR, scope=Scope.PLAN)
def lr012(ctx: Context, emit: Emit) -> None:
    """Planned rank below the layer's measured rank floor.

    ## What it flags
    With `--measure-floor`, a planned rank below the smallest rank at which truncating that layer alone keeps the
    model-level metric within the tolerance on the held-out calibration data (or any planned rank for a layer whose
    floor reaches break-even: "keep dense (measured)").

    ## Why it is bad
    The floor was measured, not guessed: one grid step below it the model already leaves the tolerance with only
    this layer truncated, and every other planned layer adds its own error on top (errors combine roughly in
    quadrature). Cliffs are sharp: the sample digits MLP's fc2 alone keeps 69.0% accuracy at rank 4 and 96.5% at 5.

    ## Example
    ```toml
    [ranks]
    "fc1" = 16   # measured floor 24: rank 16 gives 1.8% output error against a 1% tolerance
    ```

    ## Do instead
    Raise the rank to the measured floor (the report's calibration section lists it per layer), or use
    `--budget` for a plan checked all at once.
    """
    cal = ctx.audit.calibration
    if cal is None or not cal.measured_floors:
        return
    for it, layer in ctx.plan_items():
        lc = cal.layers.get(layer.name)
        f = lc.floor if lc is not None else None
        if f is None or (f.floor is None and not f.keep_dense):
            continue
        if f.floor is None:
            emit(f"{it.layer} is planned at rank {it.rank}, but no rank below break-even kept {cal.metric} within "
                 f"{cal.tolerance:g} on the calibration data (keep dense, measured)", [it.layer],
                 "Leave the layer dense", rank=it.rank, floor=None, keep_dense=True)
        elif it.rank < f.floor:
            emit(f"rank {it.rank} for {it.layer} is below its measured floor {f.floor} ({cal.metric} "
                 f"{f.metric_at_floor:.4g} at the floor" + (f", {f.cliff_metric:.4g} at rank {f.cliff_rank}"
                                                            if f.cliff_rank is not None else "") + ")",
                 [it.layer], f"Use rank {f.floor} or more", rank=it.rank, floor=f.floor,
                 cliff_rank=f.cliff_rank)
