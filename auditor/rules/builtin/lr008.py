"""The plan rule LR008: the whole plan saves less than ``negligible_share`` of the model."""

from __future__ import annotations

from ...config import Setting
from ...results import Severity
from ..context import Context
from ..registry import Emit, Scope, rule

NEGLIGIBLE_SHARE = Setting("negligible_share", 0.01, "a plan saving less than this share of the model's unique "
                           "parameters is flagged", low=0.0, high=1.0, example=0.01,
                           stricter="higher")


@rule("LR008", "negligible-saving", Severity.WARNING, scope=Scope.PLAN, settings=[NEGLIGIBLE_SHARE])
def lr008(ctx: Context, emit: Emit) -> None:
    """The whole plan saves a negligible share of the model.

    ## What it flags
    A plan whose total parameter saving is below `negligible_share` (default 1%) of the model's unique parameters.

    ## Why it is bad
    Every factorized layer costs engineering, a fine-tune and accuracy risk. A plan that saves under 1% of the
    model pays those costs for nothing measurable.

    ## Example
    A plan that factorizes only one 64 x 64 layer of a 10M-parameter model saves 0.02%.

    ## Do instead
    Start from the suggested plan (`--emit-plan`), which targets the layers where the parameters are.
    """
    r = ctx.audit.review
    if r is None or not r.items:
        return
    share = ctx.setting(NEGLIGIBLE_SHARE)
    if r.share_saved < share:
        emit(f"the plan saves {r.params_saved:,} of {r.total_params:,} parameters ({100 * r.share_saved:.3f}%), "
             f"below {100 * share:g}%",
             [], "Target the widest layers (see --emit-plan)",
             params_saved=r.params_saved, share_saved=r.share_saved)
