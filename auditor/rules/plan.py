"""Rules on the reviewed plan (a plan file, or the suggested ranks): ranks against break-even, matrix rank and
energy; what the plan targets and what it leaves out."""

from __future__ import annotations

import math

from .. import lrmath
from ..results import Severity, Verdict
from .context import Context
from .registry import Emit, Need, Scope, rule


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
            emit(f"rank {it.rank} for {it.layer} ({layer.m}x{layer.n}) is at or above the break-even rank "
                 f"{layer.break_even:.1f}: {layer.params_at(it.rank):,} weights instead of {layer.params:,}",
                 [it.layer],
                 f"Use a rank below {layer.break_even:.1f} (e.g. {max(1, math.floor(layer.break_even / 4))}) "
                 "or keep it dense",
                 rank=it.rank, break_even=round(layer.break_even, 1), m=layer.m, n=layer.n,
                 params_dense=layer.params, params_factored=layer.params_at(it.rank))


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


@rule("LR004", "energy-below-floor", Severity.WARNING, scope=Scope.PLAN, needs={Need.SPECTRA})
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
    floor = ctx.settings.energy_floor
    cal = ctx.audit.calibration
    for it in ctx.items:
        if cal is not None and ctx.audit.review is not None and ctx.audit.review.suggested and it.layer in cal.layers:
            continue  # a data-aware suggestion: its layer-output error was measured, energy is the weaker guess
        if it.energy_kept is not None and it.energy_kept < floor:
            emit(f"rank {it.rank} for {it.layer} keeps {100 * it.energy_kept:.1f}% of the spectral energy, below the "
                 f"floor of {100 * floor:g}% (best relative error {it.error_bound:.3f})",
                 [it.layer], f"Raise the rank (see the ranks for {100 * floor:g}% in the layer table)",
                 rank=it.rank, energy_kept=round(it.energy_kept, 6), floor=floor,
                 error_bound=round(it.error_bound or 0.0, 6))


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


@rule("LR008", "negligible-saving", Severity.WARNING, scope=Scope.PLAN)
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
    if r.share_saved < ctx.settings.negligible_share:
        emit(f"the plan saves {r.params_saved:,} of {r.total_params:,} parameters ({100 * r.share_saved:.3f}%), "
             f"below {100 * ctx.settings.negligible_share:g}%",
             [], "Target the widest layers (see --emit-plan)",
             params_saved=r.params_saved, share_saved=r.share_saved)


@rule("LR009", "small-before-wide", Severity.INFO, scope=Scope.PLAN, needs={Need.SPECTRA})
def lr009(ctx: Context, emit: Emit) -> None:
    """Small layers targeted while wider candidates stay dense.

    ## What it flags
    A planned layer while a layer at least `wider_factor` (default 4) times larger, which the spectral audit says
    can be factorized, is left out of the plan.

    ## Why it is bad
    The order of work is backwards: the large layer would save more parameters at the same engineering cost, and
    is usually the one with the most redundancy.

    ## Example
    A plan that factorizes `attn.q_proj` (768 x 768) but not `mlp.fc1` (3072 x 768) whose 95%-energy rank is far
    below break-even.

    ## Do instead
    Add the wider candidates first; the layer table is sorted by parameter share.
    """
    planned = [layer for _, layer in ctx.plan_items()]
    if not planned:
        return
    smallest = min(planned, key=lambda l: l.params)  # ties: the first in plan order
    wider = [info.layer for info in ctx.each_layer()
             if not info.planned and info.layer.params >= ctx.settings.wider_factor * smallest.params
             and info.suggestion is not None and info.suggestion.verdict == Verdict.FACTORIZE]
    if wider:
        names = [l.name for l in wider[:5]]
        emit(f"{smallest.name} ({smallest.params:,} params) is planned while {len(wider)} layer(s) at least "
             f"{ctx.settings.wider_factor:g}x larger that factorize well stay dense: {', '.join(names)}",
             [smallest.name, *names], "Factorize the wider layers first",
             smallest=smallest.name, wider=names)
