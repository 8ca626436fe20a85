"""The plan rule LR006: a tied or shared weight targeted (its error is felt at every use)."""

from __future__ import annotations

from ...results import Severity
from ..context import Context
from ..registry import Emit, Scope, rule


@rule("LR006", "tied-weight-targeted", Severity.WARNING, scope=Scope.PLAN)
def lr006(ctx: Context, emit: Emit) -> None:
    """A tied or shared weight targeted.

    ## What it flags
    A planned weight that has more than one name (GPT-2's lm_head is transformer.wte) or is used at more than one
    place or more than once per forward (ALBERT's shared layers).

    ## Why it is bad
    Factorizing it changes every use at once: the embedding and the output head, or all twelve applications of a
    shared layer. The saving counts once, while the error is felt at every use.

    ## Example
    ```toml
    [ranks]
    "transformer.wte" = 128   # also the lm_head
    ```

    ## Do instead
    Check the error at every use, or untie the weight first and decide per use; count the saving once.
    """
    for it, layer in ctx.plan_items():
        sites = sorted({u.site for u in layer.uses})
        if layer.aliases or len(sites) > 1 or layer.calls > 1:
            emit(f"{it.layer} is tied or shared: names {', '.join([layer.param, *layer.aliases])}; "
                 f"{layer.calls} use(s) per forward at {', '.join(sites) or layer.name}",
                 [it.layer], "Check the error at every use, or untie the weight before factorizing",
                 aliases=layer.aliases, uses=[u.site for u in layer.uses], calls=layer.calls)
