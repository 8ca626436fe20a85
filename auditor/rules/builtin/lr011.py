"""The model rule LR011: a tall, thin matrix (embedding table, vocabulary head) that factorizes cheaply, left alone."""

from __future__ import annotations

from ...config import Setting
from ...results import Severity, Verdict
from ..context import Context
from ..registry import Emit, Need, Scope, rule

TALL_RATIO = Setting("tall_ratio", 8.0, "max(m, n) / min(m, n) at or above this is a tall, thin matrix", low=1.0,
                     example=8, stricter="lower")
TALL_MIN_SHARE = Setting("tall_min_share", 0.05, "a tall, thin matrix holding at least this share of the "
                         "parameters is flagged", low=0.0, high=1.0,
                         stricter="lower")


@rule("LR011", "tall-thin-left-alone", Severity.INFO, scope=Scope.MODEL, needs={Need.SPECTRA},
      settings=[TALL_RATIO, TALL_MIN_SHARE])
def lr011(ctx: Context, emit: Emit) -> None:
    """A tall, thin matrix (embedding table, vocabulary head) that factorizes cheaply, left alone.

    ## What it flags
    A weight with max(m, n) / min(m, n) >= `tall_ratio` (default 8) holding at least `tall_min_share` (default 5%)
    of the parameters, which the spectral audit can factorize below break-even, but which the plan leaves dense.

    ## Why it is bad
    Its break-even rank is close to its short side, so a moderate rank saves most of it: an embedding V x H
    becomes V x E plus E x H (50,000 x 768 at E = 128: 38.4M -> 6.5M weights). Leaving the biggest block alone
    caps what the plan can save. (Lookups stay cheap; the E x H projection adds E*H MACs per token.)

    ## Example
    A plan for a small language model that factorizes every attention projection but not the 30,000 x 768
    embedding that holds a quarter of the weights.

    ## Do instead
    Add the table with a factorized embedding (ALBERT-style E) at a rank from the report.
    """
    tall, share = ctx.setting(TALL_RATIO), ctx.setting(TALL_MIN_SHARE)
    for layer, _, sg, planned in ctx.each_layer():
        ratio = max(layer.m, layer.n) / min(layer.m, layer.n)
        if (not planned and ratio >= tall and layer.share >= share
                and sg is not None and sg.verdict == Verdict.FACTORIZE):
            emit(f"{layer.name} ({layer.m}x{layer.n}, {100 * layer.share:.1f}% of the parameters) is tall and thin "
                 f"and factorizes at rank {sg.rank} ({sg.compression:.1f}x), but the plan leaves it dense",
                 [layer.name], f"Consider factorizing it at rank {sg.rank}",
                 ratio=round(ratio, 2), share=layer.share, suggested_rank=sg.rank)
