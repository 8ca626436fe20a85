"""The rounding floor of a low-precision model: what the metric measures with every plannable layer factorized at
full rank (nothing dropped), the factors rounded to the model's dtype as ``factorize`` writes them.

At full rank (r = min(m, n)) the whitened factors reproduce W exactly in float64; what is left is rounding A and B to
bfloat16 / float16 and running two matmuls in that precision where the dense model ran one. Every plan pays it, on
top of what its truncation costs, so it is a floor under every plan's metric: in bf16 it can use most of a 1%
tolerance before a single direction is dropped (issue 22 measured 0.0070 of 0.01 factorizing every MLP).

Measured once per audit, through the audit's one session and its evaluator, for models whose planned layers hold
bfloat16 or float16 weights, from the decompositions tier 3 then reuses (each layer decomposed once for both) and
with one block's factors in memory at a time (:func:`~auditor.calibration.apply.measured_copy`): at full rank the
factors outweigh the weights (2 m n against m n for a square layer), so a whole factorized copy would be the
largest thing the audit ever held; for float32 / float64 models it is not measured (their rounding is a million times
smaller) and the report is unchanged. The tier-3 search judges plans against the tolerance as given: the floor is
part of every plan's cost, not subtracted from it (LR017 / LR018 say when it takes too much of the tolerance).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...calresults import RoundingFloor
from ...results import Layer

if TYPE_CHECKING:
    from collections.abc import MutableMapping

    from torch import nn

    from ..measure.metric import Evaluator
    from ..session import CalibrationSession
    from ..statistics.whiten import Truncator

LOW_PRECISION = ("bfloat16", "float16")


def low_precision(model: "nn.Module", layers: list[Layer]) -> str:
    """The low-precision dtype ("bfloat16", "float16") of ``layers``' weights, the most common one when mixed; empty
    when none is (float32 / float64 weights)."""
    from collections import Counter

    params = dict(model.named_parameters(remove_duplicate=False))
    seen: Counter[str] = Counter()
    for l in layers:
        p = params.get(l.param)
        dtype = str(p.dtype).removeprefix("torch.") if p is not None else l.dtype
        if dtype in LOW_PRECISION:
            seen[dtype] += 1
    return seen.most_common(1)[0][0] if seen else ""


def rounding_floor(model: "nn.Module", layers: list[Layer], session: "CalibrationSession",
                   reuse: "MutableMapping[str, Truncator] | None" = None,
                   evaluator: "Evaluator | None" = None) -> RoundingFloor | None:
    """The metric with every one of ``layers`` factorized at full rank (whitened factors from the session's
    statistics, in the model's dtype), measured on the held-out rows by ``evaluator`` (the audit's references';
    None: one measured here); None when the layers hold no bfloat16 / float16 weights, or there are none.
    ``reuse``: the decompositions kept for tier 3 (each layer's made here once, and read there)."""
    from ..apply import measured_copy
    from ..references import evaluator_of

    dtype = low_precision(model, layers)
    if not dtype or not layers:
        return None
    plan = {l.name: l.max_rank for l in layers}
    with session.measuring():
        ev = evaluator if evaluator is not None else evaluator_of(session)
        m = ev.measure(measured_copy(model, plan, session.statistics(layers), reuse))
    metric = session.metric
    used = metric.used(m.value, ev.reference)
    return RoundingFloor(dtype=dtype, layers=len(plan), metric=m.value, used=used, tolerance=metric.tolerance,
                         top1=m.top1, ranks=plan)


__all__ = ["LOW_PRECISION", "low_precision", "rounding_floor"]
