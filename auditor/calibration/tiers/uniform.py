"""The baseline beside every plan: SVD-LLM's uniform whitened truncation at the same share removed.

Every planned layer keeps one share ``kept`` of its break-even rank m*n/(m+n): rank round(kept * m*n/(m+n)), at
least 1, and a layer whose rank would save nothing (r (m+n) >= m n) stays dense. The parameters removed fall as
``kept`` rises, in steps (integer ranks); :func:`uniform_plan` finds the step whose removal is closest to the plan's
(bisection on ``kept`` to the step's edge; a tie goes to the smaller removal). The layers every plan fixes at their
data-free rank (``fixed``) keep that rank here too, so the two differ only in how the planned layers share the cut.

:func:`measure_uniform` factorizes that plan with the whitened truncation of the same input statistics (the
search's cached truncators: one decomposition per layer, reused) and measures it all at once on the plan's rows with
the plan's metric: the search rows the plan read (the staged evaluator's first ``rows``), and the verification rows
with their interval where the plan was verified. One extra all-at-once measurement per plan (two for the verified
one), nothing decomposed again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

from ... import lrmath
from ..._env import trim_heap
from ...calresults import BudgetResult, FrontierPlan, UniformBaseline
from ...results import Layer

if TYPE_CHECKING:
    from torch import nn

    from ..references import References
    from ..statistics.whiten import TruncatorStore
    from .pass_context import PassContext

STEPS = 64  # bisection steps on the kept share: the bracket closes to below a float's resolution near 1


def ranks_at(layers: list[Layer], kept: float) -> dict[str, int]:
    """Every layer's rank at ``kept`` of its break-even rank (round half up, at least 1); a layer whose rank would
    save nothing is left out (dense).

    >>> from auditor.results import Kind, Layer
    >>> def lin(name, m, n): return Layer(name, name + ".weight", Kind.LINEAR, "Linear", (m, n), m, n)
    >>> a, b = lin("a", 100, 100), lin("b", 30, 10)  # break-even 50 and 7.5; at 0.99, a's rank 50 saves nothing
    >>> ranks_at([a, b], 0.5), ranks_at([a, b], 0.99)
    ({'a': 25, 'b': 4}, {'b': 7})
    """
    out: dict[str, int] = {}
    for layer in layers:
        r = max(1, math.floor(kept * layer.break_even + 0.5))
        if lrmath.saves(layer.m, layer.n, r):
            out[layer.name] = r
    return out


def removed_by(layers: list[Layer], ranks: dict[str, int]) -> int:
    """Parameters ``ranks`` remove from ``layers`` (exact integers)."""
    named = {l.name: l for l in layers}
    return sum(named[k].params - named[k].params_at(r) for k, r in ranks.items())


@dataclass(frozen=True)
class UniformPlan:
    """One kept share for every planned layer: the ranks, the share and the parameters removed (the planned
    layers' alone; the fixed layers' come on top)."""

    ranks: dict[str, int]
    kept: float
    removed: int


def uniform_plan(layers: list[Layer], target: int) -> UniformPlan:
    """The uniform plan over ``layers`` whose removal is closest to ``target`` parameters (integer ranks allow no
    closer; of two as close, the one removing fewer). The removal never rises with ``kept``.

    >>> from auditor.results import Kind, Layer
    >>> def lin(name, m, n): return Layer(name, name + ".weight", Kind.LINEAR, "Linear", (m, n), m, n)
    >>> p = uniform_plan([lin("a", 100, 100), lin("b", 30, 10)], 5000)
    >>> p.ranks, p.removed  # a at 25 and b at 4 would remove 5,140: 140 past the target, 4,940 is 60 short
    ({'a': 26, 'b': 4}, 4940)
    """
    def at(kept: float) -> UniformPlan:
        ranks = ranks_at(layers, kept)
        return UniformPlan(ranks, kept, removed_by(layers, ranks))

    lo, hi = at(0.0), at(1.0)  # the most and the least it can remove
    if target >= lo.removed:
        return lo
    if target <= hi.removed:
        return hi
    for _ in range(STEPS):  # lo removes at least the target, hi less
        mid = at((lo.kept + hi.kept) / 2)
        if mid.removed >= target:
            lo = mid
        else:
            hi = mid
    return lo if lo.removed - target < target - hi.removed else hi


def planned_layers(layers: list[Layer], fixed: dict[str, int], plans: Sequence[dict[str, int]] = ()) -> list[Layer]:
    """The layers the uniform truncation cuts: the planned ones of the kinds ``plans`` factorize (the chosen plan's:
    the Linears of a transformer whose plan cuts only Linears, not its embeddings, SVD-LLM's set), not those every
    plan fixes; every planned one when no plan factorizes anything."""
    named = {l.name: l for l in layers}
    kinds = {named[k].kind for p in plans for k in p if k in named and k not in fixed}
    return [l for l in layers if l.name not in fixed and (not kinds or l.kind in kinds)]


def measure_uniform(ctx: "PassContext", refs: "References", layers: list[Layer], p: FrontierPlan,
                    budget: BudgetResult, reuse: "TruncatorStore | None", verify: bool = False) -> UniformBaseline:
    """Uniform whitened truncation of :func:`planned_layers` removing as close to ``p.removed`` as integer ranks
    allow (``budget.fixed`` layers at their ranks, as in ``p``), measured all at once on ``p``'s search rows, and
    with ``verify`` on the verification rows too. The model is measured in eval mode (the caller's
    ``session.measuring()``), against the references' search measurer and verifier."""
    from ..apply import measured_copy
    from ..measure.staged import StagedEvaluator

    fixed, total = budget.fixed, budget.params_before
    named = {l.name: l for l in layers}
    fixed_saved = removed_by([named[k] for k in fixed if k in named], {k: r for k, r in fixed.items() if k in named})
    cut = planned_layers(layers, fixed, [budget.plan] if budget.plan else [q.plan for q in budget.frontier])
    u = uniform_plan(cut, p.removed - fixed_saved)
    ranks = {**u.ranks, **fixed}
    removed = u.removed + fixed_saved
    new = measured_copy(ctx.model, ranks, ctx.session.stats, reuse)
    ev = refs.search
    m = ev.measure_rows(new, p.rows) if isinstance(ev, StagedEvaluator) and p.rows else ev.measure(new)
    rows = ev.rows_read if isinstance(ev, StagedEvaluator) else 0
    v = None
    if verify and refs.verifier is not None:
        v = replace(refs.verifier.measure(new), search_rows=refs.search_rows)
    return UniformBaseline(u.kept, len(ranks), removed, removed / total if total else 0.0, m.value, m.ok, rows, v,
                           ranks=ranks)


def with_baselines(ctx: "PassContext", refs: "References", budget: BudgetResult, layers: list[Layer],
                   reuse: "TruncatorStore | None") -> tuple[BudgetResult, int]:
    """``budget`` with the uniform baseline beside each frontier plan that removes something and beside the chosen
    plan (on its verification rows too, where it was verified); and the measurements that took."""
    done: dict[tuple[tuple[str, int], ...], UniformBaseline] = {}
    count = 0
    chosen = tuple(sorted(budget.plan.items()))
    with ctx.session.measuring():
        for p in [*budget.frontier, *(q for q in budget.tries if q.plan == budget.plan)]:
            key = tuple(sorted(p.plan.items()))
            if not p.plan or key in done:
                continue
            verify = key == chosen and budget.verification is not None
            done[key] = measure_uniform(ctx, refs, layers, p, budget, reuse, verify)
            trim_heap()  # the plan's factors handed back before the next
            count += 1 + int(done[key].verification is not None)
    frontier = [replace(p, uniform=done.get(tuple(sorted(p.plan.items())))) for p in budget.frontier]
    tries = [replace(p, uniform=done.get(tuple(sorted(p.plan.items())))) for p in budget.tries]
    return replace(budget, frontier=frontier, tries=tries, uniform=done.get(chosen)), count


__all__ = ["UniformPlan", "measure_uniform", "planned_layers", "ranks_at", "removed_by", "uniform_plan",
           "with_baselines"]
