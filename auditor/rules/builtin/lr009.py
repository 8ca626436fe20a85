"""The plan rule LR009: small layers targeted while layers ``wider_factor`` times larger that factorize stay dense."""

from __future__ import annotations

from ...config import Setting
from ...results import Severity, Verdict
from ..context import Context
from ..registry import Emit, Need, Scope, rule

WIDER_FACTOR = Setting("wider_factor", 4.0, "a dense layer that factorizes and is at least this many times larger "
                       "than the smallest planned one is flagged", low=0.0, low_inclusive=False, example=4,
                       stricter="lower")


@rule("LR009", "small-before-wide", Severity.INFO, scope=Scope.PLAN, needs={Need.SPECTRA},
      settings=[WIDER_FACTOR])
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
    factor = ctx.setting(WIDER_FACTOR)
    smallest = min(planned, key=lambda l: l.params)  # ties: the first in plan order
    wider = [info.layer for info in ctx.each_layer()
             if not info.planned and info.layer.params >= factor * smallest.params
             and info.suggestion is not None and info.suggestion.verdict == Verdict.FACTORIZE]
    if wider:
        names = [l.name for l in wider[:5]]
        emit(f"{smallest.name} ({smallest.params:,} params) is planned while {len(wider)} layer(s) at least "
             f"{factor:g}x larger that factorize well stay dense: {', '.join(names)}",
             [smallest.name, *names], "Factorize the wider layers first",
             smallest=smallest.name, wider=names)
