"""The plan rule LR003: a narrow layer targeted. It reads the global settings ``min_share`` and
``min_break_even``, which the suggested ranks use too (a layer the suggestion skips as narrow is one LR003 flags)."""

from __future__ import annotations

from ...results import Severity
from ..context import Context
from ..registry import Emit, Scope, rule


@rule("LR003", "narrow-layer-targeted", Severity.WARNING, scope=Scope.PLAN)
def lr003(ctx: Context, emit: Emit) -> None:
    """A narrow layer targeted: a tiny share of the parameters, or a break-even rank that leaves no room.

    ## What it flags
    A planned layer that holds less than `min_share` of the model's parameters (default 0.25%), or whose
    break-even rank is below `min_break_even` (default 16).

    ## Why it is bad
    Almost none of the parameters live there, so the saving is negligible, while every factorized layer adds a
    rank floor to measure, an extra kernel launch and accuracy risk. Narrow layers often also carry information
    bottlenecks (heads, projections to few channels) that do not tolerate truncation.

    ## Example
    ```toml
    [ranks]
    "head" = 8   # 64 x 64 in a 10M-parameter model: 0.04% of the weights
    ```

    ## Do instead
    Target the widest layers first: the layer table is sorted by parameter share and says how many layers hold 80%.
    """
    s = ctx.settings
    for it, layer in ctx.plan_items():
        if layer.share < s.min_share or layer.break_even < s.min_break_even:
            why = (f"holds {100 * layer.share:.3f}% of the parameters (threshold {100 * s.min_share:g}%)"
                   if layer.share < s.min_share else
                   f"its break-even rank {layer.break_even:.1f} is below {s.min_break_even:g}")
            emit(f"{it.layer} ({layer.m}x{layer.n}) is narrow: {why}", [it.layer],
                 "Drop it from the plan and target the widest layers first",
                 share=layer.share, break_even=round(layer.break_even, 1), params=layer.params)
