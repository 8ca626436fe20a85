"""Tie groups in the plan search (``--tie``): a group's members choose one rank together, and what that costs.

:func:`tie_curves` turns each group (:class:`~auditor.results.TieGroup`: q/k/v of one attention, gate/up of one MLP)
into one option list of the search: at every rank that every member offers (each member's options are its ranks
below its own break-even, so the group's reach the narrowest member's, k/v under grouped-query attention), the
parameters removed are the members' sum and so is the predicted cost. The allocation (:func:`~.budget.allocate`)
then never splits a group: it picks the group's rank, or keeps the group dense. A group where a member offers no
rank at all (narrow, not planned, every rank at or above its break-even or below the compression floor) is kept
dense whole, and said.

:func:`tie_cost` states what the constraint costs: the most the curves remove at the chosen plan's predicted cost
(on the Lagrangian hull of the options, :func:`removal_within`) with the ties and without them, one tie
added at a time so that each tie's part is measured against the ties before it and the parts add up. It measures
nothing: the search already runs on these predicted costs, so it is one more allocation per tie.

>>> from auditor.results import TieGroup
>>> c = Curves({"q": [Option(8, 100, 1.0), Option(16, 50, 0.2)], "k": [Option(8, 40, 0.5)]}, "tier1")
>>> t, dense = tie_curves(c, [TieGroup("q/k", "b", ("q", "k"))])
>>> t.options, t.tied, dense
({'q\\x00k': [Option(rank=8, saved=140, cost=1.5)]}, {'q\\x00k': ('q', 'k')}, [])
>>> from auditor.calibration.tiers.budget import allocate
>>> allocate(t, 100)[0]
{'q': 8, 'k': 8}
"""

from __future__ import annotations

import math
from typing import Sequence

from ...calresults import TieCost
from ...results import TieGroup
from .budget import Curves, Option, pick_at

__all__ = ["removal_within", "tie_cost", "tie_curves"]


def tie_curves(curves: Curves, groups: Sequence[TieGroup]) -> tuple[Curves, list[TieGroup]]:
    """``curves`` with each group's members replaced by one option list (ranks every member offers, removal and cost
    summed), and the groups kept dense whole (a member without options, or no rank common to all)."""
    options = dict(curves.options)
    tied = dict(curves.tied)
    dense: list[TieGroup] = []
    for g in groups:
        found = [options.pop(m, None) for m in g.members]
        by_rank = [{o.rank: o for o in opts} for opts in found if opts]
        common = sorted(set.intersection(*(set(b) for b in by_rank))) if len(by_rank) == len(found) else []
        if not common:
            dense.append(g)
            continue
        key = "\x00".join(g.members)
        options[key] = [Option(r, sum(b[r].saved for b in by_rank), sum(b[r].cost for b in by_rank)) for r in common]
        tied[key] = g.members
    return Curves(options, curves.source, curves.linear, tied), dense


def removal_within(curves: Curves, cap: float) -> float:
    """The most parameters the options remove at a summed predicted cost of ``cap``, on the Lagrangian hull: the
    allocation's price per parameter bisected to the point where its cost passes ``cap``, and the removal read off
    the hull segment there (linear between the allocations just below and just above: the continuous relaxation).
    That relaxation never removes more under a constraint: a tie's options are a subset of its members' (one rank
    for all), so its hull lies within theirs, and a tie's cost is never negative, as a comparison of two integer
    allocations at their own discrete steps could be."""
    opts = curves.options
    if not opts or cap < 0:
        return 0.0
    lo, hi = 0.0, 1e-12
    while pick_at(opts, hi)[2] <= cap and hi < 1e30:
        lo, hi = hi, hi * 10
    if hi >= 1e30:
        return float(pick_at(opts, lo)[1])
    for _ in range(200):
        mid = math.sqrt(lo * hi) if lo > 0 else hi / 2
        if pick_at(opts, mid)[2] <= cap:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    _, saved_lo, cost_lo = pick_at(opts, lo)
    _, saved_hi, cost_hi = pick_at(opts, hi)
    if cost_hi <= cost_lo:
        return float(saved_lo)
    return saved_lo + (saved_hi - saved_lo) * (cap - cost_lo) / (cost_hi - cost_lo)


def tie_cost(untied: Curves, groups: Sequence[TieGroup], cap: float, params: int) -> TieCost:
    """What the ties cost at a predicted cost of ``cap`` (the chosen plan's): the removal without ties, then with each
    tie added in turn (its groups, in their order), each tie's part the removal it takes from the ones before."""
    labels = list(dict.fromkeys(g.label for g in groups))
    before = removal_within(untied, cap)
    first = before
    each: dict[str, float] = {}
    dense: list[TieGroup] = []
    for i in range(len(labels)):
        tied, dense = tie_curves(untied, [g for g in groups if g.label in labels[:i + 1]])
        now = removal_within(tied, cap)
        # never negative on the relaxation (the module's docstring); a float's last bits can say -1e-17
        each[labels[i]] = max(before - now, 0.0) / params if params else 0.0
        before = now
    return TieCost(round(before), round(first), params, len(groups), each, [f"{g.label} in {g.block}" for g in dense])
