"""The model rule LR010: non-finite or all-zero weights. Non-finite ones are bad input on the command line (exit 2);
a dead (all-zero) layer is a finding."""

from __future__ import annotations

from ...results import Finding, Severity
from ..context import Context
from ..registry import Emit, Need, Scope, rule

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
