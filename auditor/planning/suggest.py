"""A suggested rank and verdict per layer, from its spectrum and the settings."""

from __future__ import annotations

import math

from .. import lrmath
from ..config import Settings
from ..results import Layer, Spectrum, Suggestion, Verdict


def target_key(t: float) -> str:
    """The key of an energy target in ``Suggestion.ranks_for``: ``0.9`` -> ``"0.9"``."""
    return f"{t:g}"


def suggest(layer: Layer, spec: Spectrum | None, settings: Settings) -> Suggestion:
    be = layer.break_even
    useful = lrmath.max_useful_rank(layer.m, layer.n)
    if spec is None or spec.sigma is None:
        reason = spec.skipped if spec is not None else "no spectrum computed"
        return Suggestion(layer.name, Verdict.SKIPPED, None, reason)
    ranks = {target_key(t): spec.rank_for(t) for t in settings.energy_targets}
    e_be = spec.energy_at(math.floor(be)) if useful > 0 else None
    base = dict(ranks_for=ranks, energy_at_break_even=e_be)
    if layer.share < settings.min_share:
        return Suggestion(layer.name, Verdict.SKIP_NARROW, None,
                          f"holds {100 * layer.share:.2f}% of the parameters "
                          f"(below {100 * settings.min_share:.2f}%): little to gain", **base)
    if be < settings.min_break_even or useful < 1:
        return Suggestion(layer.name, Verdict.SKIP_NARROW, None,
                          f"break-even rank {be:.1f} leaves no room (below {settings.min_break_even:g})", **base)
    from .. import kinds  # here, not at the top: the report renderers import this module, --help must not load torch

    refusal = kinds.for_kind(layer.kind).cannot_factorize
    if refusal:  # an explicit "no replacement" (LSTM gates, MultiheadAttention's in_proj): never suggested
        return Suggestion(layer.name, Verdict.KEEP_DENSE, None, f"{layer.kind} cannot be factorized: {refusal}",
                          **base)
    if layer.tied or layer.calls > 1:  # LR006's test (plan.shared): one factorization would change every use
        names = ", ".join([layer.param, *layer.aliases])
        return Suggestion(layer.name, Verdict.KEEP_DENSE, None,
                          f"tied or shared ({names}; {layer.calls} use(s) per forward): factorizing it changes every "
                          "use at once; untie it, or plan it by hand and check the error at every use", **base)
    need = spec.rank_for(settings.target_energy)
    if need > useful:
        return Suggestion(layer.name, Verdict.KEEP_DENSE, None,
                          f"{100 * settings.target_energy:g}% energy needs rank {need}, "
                          f"{need / be:.2f}x the break-even {be:.1f}: factorizing would not save anything", **base)
    aligned = int(math.ceil(need / settings.align) * settings.align)
    r = aligned if aligned <= useful else need
    if layer.compression(r) < settings.min_compression:
        return Suggestion(layer.name, Verdict.KEEP_DENSE, None,
                          f"{100 * settings.target_energy:g}% energy needs rank {need}, which compresses only "
                          f"{layer.compression(r):.2f}x (below {settings.min_compression:g}x): not worth a factorization",
                          **base)
    kept = spec.energy_at(r)
    return Suggestion(
        layer.name,
        Verdict.FACTORIZE,
        r,
        f"rank {r} keeps {100 * kept:.2f}% of the energy at {layer.compression(r):.2f}x compression",
        energy_at_rank=kept,
        error_bound=lrmath.relative_error(kept),
        params_after=layer.params_at(r),
        macs_after=layer.macs_at(r),
        compression=layer.compression(r),
        **base,
    )
