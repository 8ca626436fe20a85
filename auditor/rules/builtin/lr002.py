"""The plan rule LR002: a planned rank above min(m, n), the most an m x n matrix has (bad input on the command
line: exit 2)."""

from __future__ import annotations

from ...results import Severity
from ..context import Context
from ..registry import Emit, Scope, rule


@rule("LR002", "rank-above-matrix-rank", Severity.ERROR, scope=Scope.PLAN, input_error=lambda f: True)
def lr002(ctx: Context, emit: Emit) -> None:
    """Planned rank above min(m, n).

    ## What it flags
    A planned rank larger than the smaller side of the weight's matrix view.

    ## Why it is bad
    An m x n matrix has rank at most min(m, n); factors of a larger rank cannot represent anything more, and they
    are always above break-even. The plan is wrong, not just wasteful: usually a typo or a pattern that matched
    the wrong layer.

    ## Example
    ```toml
    [ranks]
    "classifier" = 64   # classifier is 10 x 256: rank at most 10
    ```

    ## Do instead
    Fix the rank or narrow the pattern so that it matches only the layers you meant.
    """
    for it, layer in ctx.plan_items():
        if it.rank > layer.max_rank:
            emit(f"rank {it.rank} for {it.layer} is above min(m, n) = {layer.max_rank} of its "
                 f"{layer.m}x{layer.n} matrix",
                 [it.layer], f"Use a rank below {layer.break_even:.1f}, or narrow the pattern {it.pattern!r}",
                 rank=it.rank, max_rank=layer.max_rank, m=layer.m, n=layer.n)
