"""Rules on the model's layers and weights, whatever the plan: broken or dead weights, big blocks left alone."""

from __future__ import annotations

from ..results import Finding, Severity, Verdict
from .context import Context
from .registry import Emit, Need, Scope, rule

# The spectral engine's reasons for skipping a layer (Spectrum.skipped) that this rule reports.
_NON_FINITE, _ALL_ZERO = "non-finite", "all-zero"


def _non_finite(f: Finding) -> bool:
    """A broken checkpoint is bad input (exit 2); a dead (all-zero) layer is a finding."""
    return str(f.evidence.get("reason", "")).startswith(_NON_FINITE)


@rule("LR010", "non-finite-or-zero-weight", Severity.ERROR, scope=Scope.MODEL, needs={Need.SPECTRA},
      input_error=_non_finite)
def lr010(ctx: Context, emit: Emit) -> None:
    """Non-finite or all-zero weights.

    ## What it flags
    A weight with NaN or Inf entries, or one that is exactly zero everywhere.

    ## Why it is bad
    A non-finite weight means the checkpoint is broken (a diverged run, a bad conversion); no spectrum exists and
    any compression decision is meaningless. An all-zero weight is dead: it has rank 0 and should be removed,
    not factorized (or it was never trained, and the audit is looking at the wrong checkpoint).

    ## Example
    A checkpoint saved after a loss spike, with `nan` in `encoder.layer.3.output.dense.weight`.

    ## Do instead
    Audit a healthy checkpoint; remove dead layers.
    """
    for info in ctx.each_layer():
        sp = info.spectrum
        if sp is not None and sp.skipped.startswith((_NON_FINITE, _ALL_ZERO)):
            emit(f"{info.layer.name} has {sp.skipped}", [info.layer.name],
                 "Audit a healthy checkpoint, or remove the dead layer", reason=sp.skipped)


@rule("LR011", "tall-thin-left-alone", Severity.INFO, scope=Scope.MODEL, needs={Need.SPECTRA})
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
    s = ctx.settings
    for layer, _, sg, planned in ctx.each_layer():
        ratio = max(layer.m, layer.n) / min(layer.m, layer.n)
        if (not planned and ratio >= s.tall_ratio and layer.share >= s.tall_min_share
                and sg is not None and sg.verdict == Verdict.FACTORIZE):
            emit(f"{layer.name} ({layer.m}x{layer.n}, {100 * layer.share:.1f}% of the parameters) is tall and thin "
                 f"and factorizes at rank {sg.rank} ({sg.compression:.1f}x), but the plan leaves it dense",
                 [layer.name], f"Consider factorizing it at rank {sg.rank}",
                 ratio=round(ratio, 2), share=layer.share, suggested_rank=sg.rank)
