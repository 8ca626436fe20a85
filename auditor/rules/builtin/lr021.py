"""The plan rule LR021: a tie group (``--tie``, or the plan's ``ties``) whose members the plan gives different ranks."""

from __future__ import annotations

from ...planning.ties import broken_words, violations
from ...results import Severity
from ..context import Context
from ..registry import Emit, Scope, rule


@rule("LR021", "tie-broken", Severity.ERROR, scope=Scope.PLAN)
def lr021(ctx: Context, emit: Emit) -> None:
    """A tie group's members planned at different ranks.

    ## What it flags
    With `--tie` (or a plan whose `ties` list names groups): a block whose tied layers the plan does not give one
    rank: q_proj at 64 and k_proj at 32, or q_proj factorized while v_proj stays dense. Every broken group is one
    finding, naming each member's rank.

    ## Why it is bad
    A tie says a fused kernel runs the group as one product: q/k/v read one input, so their first factors stack
    into one [A_q; A_k; A_v] of one rank r, and gate/up the same. Members at different ranks cannot be stacked:
    the factorized model falls back to separate, slower products, or the kernel cannot load it at all.
    `lowrank-audit factorize` refuses such a plan (exit 2).

    ## Example
    ```toml
    ties = ["q_proj,k_proj,v_proj"]
    [ranks]
    "model.layers.0.self_attn.q_proj" = 64
    "model.layers.0.self_attn.k_proj" = 32
    "model.layers.0.self_attn.v_proj" = 32
    ```

    ## Do instead
    Give the group one rank (one the narrowest member still saves at: k and v are narrower than q under
    grouped-query attention), keep the whole group dense, or drop the tie if no fused kernel will run the model.
    """
    ties = ctx.audit.ties
    if not ties:
        return
    ranks = {it.layer: it.rank for it in ctx.items}
    for group, got in violations(ranks, ties):
        what, fix = broken_words([(group, got)])
        emit(f"the plan {what}", list(group.members), fix, tie=group.label, block=group.block, ranks=got)
