"""The plan rule LR001: a planned rank at or above the break-even rank m*n/(m+n) saves nothing."""

from __future__ import annotations

import math

from ... import lrmath
from ...results import Severity
from ..context import Context
from ..registry import Emit, Scope, rule


@rule("LR001", "rank-at-or-above-break-even", Severity.ERROR, scope=Scope.PLAN)
def lr001(ctx: Context, emit: Emit) -> None:
    """Planned rank at or above the break-even rank m*n/(m+n).

    ## What it flags
    A planned rank r with r*(m+n) >= m*n for an m x n weight: the factors A (m x r) and B (r x n) store at least as
    many numbers as W itself.

    ## Why it is bad
    Nothing is saved, neither parameters nor multiply-accumulates, and A B is still limited to rank r: the layer
    loses expressivity for no gain. For a 4096 x 4096 layer the break-even rank is 2048; rank 3000 stores
    24,576,000 numbers instead of 16,777,216.

    ## Example
    ```toml
    [ranks]
    "decoder.layers.*.mlp.up_proj" = 3000   # 4096 x 4096: break-even 2048
    ```

    ## Do instead
    Choose a rank well below break-even (a quarter of it gives 4x fewer weights on a square layer), read the energy
    kept at that rank from the report, or keep the layer dense.
    """
    for it, layer in ctx.plan_items():
        if it.rank <= layer.max_rank and not lrmath.saves(layer.m, layer.n, it.rank):
            sg = ctx.audit.suggestions.get(it.layer)
            # the report's own suggestion when it saves (the number the layer table shows), else a quarter of break-even
            example = (f"e.g. {sg.rank}, the suggested rank" if sg is not None and sg.rank
                       and lrmath.saves(layer.m, layer.n, sg.rank)
                       else f"e.g. {max(1, math.floor(layer.break_even / 4))}")
            emit(f"rank {it.rank} for {it.layer} ({layer.m}x{layer.n}) is at or above the break-even rank "
                 f"{layer.break_even:.1f}: {layer.params_at(it.rank):,} weights instead of {layer.params:,}",
                 [it.layer],
                 f"Use a rank below {layer.break_even:.1f} ({example}) or keep it dense",
                 rank=it.rank, break_even=round(layer.break_even, 1), m=layer.m, n=layer.n,
                 params_dense=layer.params, params_factored=layer.params_at(it.rank))
