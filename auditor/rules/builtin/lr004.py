"""The plan rule LR004: a planned rank keeping less spectral energy than ``energy_floor``."""

from __future__ import annotations

from ...config import Setting
from ...results import Severity
from ..context import Context
from ..registry import Emit, Need, Scope, rule

ENERGY_FLOOR = Setting("energy_floor", 0.90, "a planned rank keeping less spectral energy than this is flagged",
                       low=0.0, high=1.0, low_inclusive=False, stricter="higher")


@rule("LR004", "energy-below-floor", Severity.WARNING, scope=Scope.PLAN, needs={Need.SPECTRA},
      settings=[ENERGY_FLOOR])
def lr004(ctx: Context, emit: Emit) -> None:
    """Planned rank keeps less spectral energy than the floor.

    ## What it flags
    A planned rank r whose energy E(r) = sum(sigma_i^2, i <= r) / ||W||_F^2 is below `energy_floor` (default 0.90).

    ## Why it is bad
    The best rank-r approximation has relative error sqrt(1 - E(r)): at 80% energy that is 45% of the weight's
    norm, gone before fine-tuning starts. "Any rank is fine if we fine-tune" is not a plan: recovery is slower and
    less complete the more is cut, and the floor differs per layer.

    ## Example
    ```toml
    [ranks]
    "encoder.layer.*.intermediate.dense" = 16   # keeps 41% of the energy
    ```

    ## Do instead
    Use `"energy:0.95"` or the rank the report lists for 90/95/99% energy, and measure the accuracy after the
    recovery fine-tune. With `--calibration` the suggested ranks come from the layer-output error on the model's own
    inputs, and this rule leaves them alone (it still checks a plan you give).
    """
    floor = ctx.setting(ENERGY_FLOOR)
    cal = ctx.audit.calibration
    for it in ctx.items:
        if cal is not None and ctx.audit.review is not None and ctx.audit.review.suggested and it.layer in cal.layers:
            continue  # a data-aware suggestion: its layer-output error was measured, energy is the weaker guess
        if it.energy_kept is not None and it.energy_kept < floor:
            emit(f"rank {it.rank} for {it.layer} keeps {100 * it.energy_kept:.1f}% of the spectral energy, below the "
                 f"floor of {100 * floor:g}% (best relative error {it.error_bound:.3f})",
                 [it.layer], _raise_hint(ctx, it.layer, floor),
                 rank=it.rank, energy_kept=round(it.energy_kept, 6), floor=floor,
                 error_bound=round(it.error_bound or 0.0, 6))


def _raise_hint(ctx: Context, layer: str, floor: float) -> str:
    """The fix, naming the rank itself (the layer table may have dropped the energy columns to fit)."""
    sp = ctx.audit.spectra.get(layer)
    if sp is not None and sp.energy:
        return f"Raise the rank to at least {sp.rank_for(floor)}, the rank keeping {100 * floor:g}% of the energy"
    return f"Raise the rank (see the ranks for {100 * floor:g}% in the layer table)"
