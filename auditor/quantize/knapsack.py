"""One option per layer, least total cost under a byte budget (the multiple-choice knapsack).

Each key (a layer) lists its ``Choice``s: a label, exact bytes and a cost (predicted error, additive across keys).
``choose`` picks one per key, summed bytes <= budget, summed cost as low as it can find:

1. Per key, dominated options are dropped (another has bytes <= and cost <=, strictly better in one; of exact
   ties the earlier listed is kept), and the lower convex hull of the rest in (bytes, cost) is taken.
2. Exact: when the Pareto set of (bytes, cost) over all keys stays within ``exact_limit`` states (always when the
   product of the non-dominated option counts is at most ``exact_limit``), a dynamic programme over those sets
   returns an optimal plan (the least bytes among equal costs).
3. Otherwise a heuristic: every key starts at its smallest option, then takes hull upgrades by the best cost
   decrease per byte while they fit (the convex-hull / Lagrangian greedy of Shoham & Gersho's bit allocation); a
   key whose next upgrade does not fit stops upgrading. Then, while some single swap of one key to any
   non-dominated option fits and lowers the cost, the best such swap is taken. Ties go to the earlier key, then
   the earlier option.

The greedy is exact at every budget its own upgrade path passes through (Everett's theorem: each point of the path
minimises cost + lambda*bytes). At other budgets it is within one upgrade's cost decrease of optimal, so within
the largest single-key cost gap: even two-option (always convex) keys make this a 0/1 knapsack, where a greedy can
miss the optimum; the one-swap pass recovers most of those cases, the exact pass the small ones.

>>> options = {"fc1": [Choice("int8", 800, 0.0), Choice("int4", 400, 1.0), Choice("int2", 200, 9.0)],
...            "fc2": [Choice("int8", 400, 0.0), Choice("int4", 200, 3.0), Choice("int2", 100, 4.0)]}
>>> plan = choose(options, 700)
>>> {key: c.label for key, c in plan.items()}, total_bytes(plan), total_cost(plan)
({'fc1': 'int4', 'fc2': 'int4'}, 600, 4.0)
>>> print(choose(options, 299))
None
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

EXACT_LIMIT = 100_000

Plan = dict[str, "Choice"]


@dataclass(frozen=True)
class Choice:
    """One option of a key: its ``label``, stored ``nbytes`` (exact) and ``cost`` (>= 0, additive)."""

    label: str
    nbytes: int
    cost: float

    def __post_init__(self) -> None:
        if isinstance(self.nbytes, bool) or not isinstance(self.nbytes, int) or self.nbytes < 0:
            raise ValueError(f"nbytes of {self.label!r} must be a non-negative integer, got {self.nbytes!r}.")
        if not (isinstance(self.cost, (int, float)) and math.isfinite(self.cost) and self.cost >= 0):
            raise ValueError(f"cost of {self.label!r} must be a finite number >= 0, got {self.cost!r}.")


def total_bytes(plan: Mapping[str, Choice]) -> int:
    return sum(c.nbytes for c in plan.values())


def total_cost(plan: Mapping[str, Choice]) -> float:
    """The summed cost, correctly rounded (``math.fsum``), so equal plans compare equal in any key order."""
    return math.fsum(c.cost for c in plan.values())


def pareto(choices: Sequence[Choice]) -> list[Choice]:
    """The non-dominated choices by increasing bytes (so strictly decreasing cost); of exact ties the first listed.

    >>> [c.label for c in pareto([Choice("a", 2, 1.0), Choice("b", 1, 1.0), Choice("c", 3, 0.5),
    ...                           Choice("d", 3, 0.5)])]
    ['b', 'c']
    """
    order = sorted(range(len(choices)), key=lambda i: (choices[i].nbytes, choices[i].cost, i))
    kept: list[Choice] = []
    for i in order:
        if not kept or choices[i].cost < kept[-1].cost:
            kept.append(choices[i])
    return kept


def hull(front: Sequence[Choice]) -> list[Choice]:
    """The lower convex hull of a Pareto front (by increasing bytes); points on a straight edge are kept.

    >>> [c.label for c in hull([Choice("a", 0, 10.0), Choice("b", 1, 9.0), Choice("c", 2, 0.0)])]
    ['a', 'c']
    """
    out: list[Choice] = []
    for p in front:
        while len(out) >= 2:
            a, b = out[-2], out[-1]
            cross = (b.nbytes - a.nbytes) * (p.cost - a.cost) - (b.cost - a.cost) * (p.nbytes - a.nbytes)
            if cross >= 0:
                break
            out.pop()
        out.append(p)
    return out


def choose(options: Mapping[str, Sequence[Choice]], budget: int,
           exact_limit: int = EXACT_LIMIT) -> dict[str, Choice] | None:
    """One choice per key with summed ``nbytes`` <= ``budget`` and the least summed cost found; ``None`` when even
    the smallest options do not fit. ``exact_limit`` caps the exact pass's states (0: the heuristic only)."""
    fronts = _fronts(options)
    if sum(f[0].nbytes for f in fronts.values()) > budget:
        return None
    plan = _exact(fronts, budget, exact_limit) if exact_limit > 0 else None
    if plan is None:
        plan = _one_swap(fronts, _greedy(fronts, budget), budget)
    return plan


def frontier(options: Mapping[str, Sequence[Choice]], budgets: Sequence[int],
             exact_limit: int = EXACT_LIMIT) -> list[dict[str, Choice] | None]:
    """``choose`` at each budget, in the order given."""
    return [choose(options, b, exact_limit) for b in budgets]


def _fronts(options: Mapping[str, Sequence[Choice]]) -> dict[str, list[Choice]]:
    for key, choices in options.items():
        if not choices:
            raise ValueError(f"{key!r} has no options; give every key at least one Choice.")
    return {key: pareto(choices) for key, choices in options.items()}


def _greedy(fronts: dict[str, list[Choice]], budget: int) -> dict[str, Choice]:
    """Hull upgrades by the best cost decrease per byte while they fit; a key whose next one does not fit stops."""
    hulls = {key: hull(front) for key, front in fronts.items()}
    at = dict.fromkeys(hulls, 0)
    left = budget - sum(h[0].nbytes for h in hulls.values())
    open_keys = [key for key in hulls if len(hulls[key]) > 1]
    while open_keys:
        best, best_rate = None, -1.0
        for key in open_keys:  # in key order: the first of equal rates wins
            cur, nxt = hulls[key][at[key]], hulls[key][at[key] + 1]
            rate = (cur.cost - nxt.cost) / (nxt.nbytes - cur.nbytes)
            if rate > best_rate:
                best, best_rate = key, rate
        assert best is not None
        cur, nxt = hulls[best][at[best]], hulls[best][at[best] + 1]
        if nxt.nbytes - cur.nbytes <= left:
            left -= nxt.nbytes - cur.nbytes
            at[best] += 1
            if at[best] == len(hulls[best]) - 1:
                open_keys.remove(best)
        else:
            open_keys.remove(best)
    return {key: hulls[key][at[key]] for key in hulls}


def _one_swap(fronts: dict[str, list[Choice]], plan: dict[str, Choice], budget: int) -> dict[str, Choice]:
    """While one key's move to another non-dominated option fits and lowers the cost, take the best such move."""
    plan = dict(plan)
    used = total_bytes(plan)
    while True:
        best: tuple[str, Choice] | None = None
        gain = 0.0
        for key, front in fronts.items():
            cur = plan[key]
            for c in front:
                if c.cost < cur.cost and used - cur.nbytes + c.nbytes <= budget and cur.cost - c.cost > gain:
                    best, gain = (key, c), cur.cost - c.cost
        if best is None:
            return plan
        key, c = best
        used += c.nbytes - plan[key].nbytes
        plan[key] = c


def _exact(fronts: dict[str, list[Choice]], budget: int, limit: int) -> dict[str, Choice] | None:
    """An optimal plan by merging Pareto sets of (bytes, cost) key by key; None when a set passes ``limit``."""
    sizes = np.zeros(1, dtype=np.int64)
    costs = np.zeros(1, dtype=np.float64)
    steps: list[tuple[np.ndarray, np.ndarray]] = []  # per key: (parent state, option index) of each state
    for front in fronts.values():
        nb = np.array([c.nbytes for c in front], dtype=np.int64)
        cs = np.array([c.cost for c in front], dtype=np.float64)
        s = (sizes[:, None] + nb[None, :]).reshape(-1)
        k = (costs[:, None] + cs[None, :]).reshape(-1)
        fits = np.flatnonzero(s <= budget)
        order = fits[np.lexsort((fits, k[fits], s[fits]))]  # by bytes, then cost, then (parent, option)
        best = np.minimum.accumulate(k[order])
        keep = order[np.concatenate(([True], k[order][1:] < best[:-1]))]
        if keep.size > limit:
            return None
        steps.append((keep // len(front), keep % len(front)))
        sizes, costs = s[keep], k[keep]
    state = int(np.argmin(costs))  # costs fall as bytes rise: the last state; argmin takes the first of ties
    picks: list[int] = []
    for parent, option in reversed(steps):
        picks.append(int(option[state]))
        state = int(parent[state])
    return {key: front[i] for (key, front), i in zip(fronts.items(), reversed(picks))}
