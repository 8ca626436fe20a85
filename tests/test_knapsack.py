"""The multiple-choice knapsack against brute-force enumeration on seeded random instances (integer bytes and
integer-valued costs, so every sum is exact and costs compare with ``==``)."""

from __future__ import annotations

import itertools
import random

import pytest

from auditor.quantize.knapsack import Choice, choose, frontier, hull, pareto, total_bytes, total_cost

Options = dict[str, list[Choice]]


def brute_force(options: Options, budget: int) -> float | None:
    """The least total cost of any plan within the budget, by enumerating every combination."""
    best = None
    for combo in itertools.product(*options.values()):
        if sum(c.nbytes for c in combo) <= budget:
            cost = total_cost(dict(zip(options, combo)))
            best = cost if best is None or cost < best else best
    return best


def bounds(options: Options) -> tuple[int, int]:
    return (sum(min(c.nbytes for c in v) for v in options.values()),
            sum(max(c.nbytes for c in v) for v in options.values()))


def general(rng: random.Random) -> tuple[Options, int]:
    options = {f"k{i}": [Choice(f"o{j}", rng.randint(1, 40), float(rng.randint(0, 50)))
                         for j in range(rng.randint(2, 5))] for i in range(rng.randint(3, 5))}
    return options, rng.randint(*bounds(options))


def convex(rng: random.Random) -> Options:
    """Per key, points on a convex decreasing curve: bytes rise, cost decreases by shrinking steps."""
    options = {}
    for i in range(rng.randint(3, 5)):
        n = rng.randint(2, 5)
        drops = sorted(rng.sample(range(1, 30), n - 1), reverse=True)  # steps per byte, strictly falling
        nbytes, cost, row = rng.randint(1, 10), float(sum(d * 4 for d in drops) + rng.randint(0, 5)), []
        for j in range(n):
            row.append(Choice(f"o{j}", nbytes, cost))
            if j < n - 1:
                nbytes, cost = nbytes + 4, cost - drops[j] * 4
        rng.shuffle(row)
        options[f"k{i}"] = row
    return options


def gap(options: Options) -> float:
    """The largest single-key cost gap among non-dominated options."""
    return max(f[0].cost - f[-1].cost for f in map(pareto, options.values()))


def greedy_path(options: Options) -> list[int]:
    """The bytes of every state the hull greedy passes through with no budget limit."""
    hulls = [hull(pareto(v)) for v in options.values()]
    steps = sorted(((a.cost - b.cost) / (b.nbytes - a.nbytes), b.nbytes - a.nbytes)
                   for h in hulls for a, b in zip(h, h[1:]))
    used, path = sum(h[0].nbytes for h in hulls), []
    path.append(used)
    for _, extra in sorted(steps, key=lambda s: -s[0]):
        used += extra
        path.append(used)
    return path


@pytest.mark.parametrize("exact_limit", [0, 100_000])
def test_general_instances_within_one_gap_and_feasible(exact_limit: int) -> None:
    rng = random.Random(0)
    for _ in range(300):
        options, budget = general(rng)
        plan = choose(options, budget, exact_limit=exact_limit)
        assert plan is not None and set(plan) == set(options) and total_bytes(plan) <= budget
        assert all(plan[k] in v for k, v in options.items())
        assert total_cost(plan) <= brute_force(options, budget) + gap(options)


def test_exact_pass_is_optimal_on_every_instance() -> None:
    rng = random.Random(1)
    for _ in range(300):
        options, budget = general(rng)
        assert total_cost(choose(options, budget)) == brute_force(options, budget)


def test_heuristic_alone_is_optimal_on_at_least_90_percent() -> None:
    rng = random.Random(0)
    hits = 0
    for _ in range(300):
        options, budget = general(rng)
        hits += total_cost(choose(options, budget, exact_limit=0)) == brute_force(options, budget)
    assert hits == 288  # measured: 96%; the one-swap pass is what lifts it there


def test_heuristic_is_exact_on_convex_instances_at_its_path_budgets() -> None:
    rng = random.Random(2)
    checked = 0
    for _ in range(100):
        options = convex(rng)
        assert all(len(hull(pareto(v))) == len(v) for v in options.values())  # built convex
        for budget in greedy_path(options):
            assert total_cost(choose(options, budget, exact_limit=0)) == brute_force(options, budget)
            checked += 1
    assert checked > 500


def test_convex_instances_at_every_budget() -> None:
    rng = random.Random(3)
    for _ in range(50):
        options = convex(rng)
        lo, hi = bounds(options)
        for budget in range(lo, hi + 1, 3):
            best = brute_force(options, budget)
            assert total_cost(choose(options, budget)) == best
            assert total_cost(choose(options, budget, exact_limit=0)) <= best + gap(options)


def test_greedy_alone_misses_a_knapsack_optimum_that_the_exact_pass_finds() -> None:
    # two-option keys are always convex, yet this is a 0/1 knapsack: the best rate (k0) blocks the best fill
    options = {"k0": [Choice("skip", 0, 10.0), Choice("take", 6, 0.0)],
               "k1": [Choice("skip", 0, 8.0), Choice("take", 5, 0.0)],
               "k2": [Choice("skip", 0, 8.0), Choice("take", 5, 0.0)]}
    assert total_cost(choose(options, 10, exact_limit=0)) == 16.0
    assert total_cost(choose(options, 10)) == 10.0 == brute_force(options, 10)


def test_budget_exactly_at_a_sum_is_feasible_and_one_below_is_not() -> None:
    options = {"a": [Choice("x", 10, 5.0), Choice("y", 20, 1.0)], "b": [Choice("x", 7, 3.0), Choice("y", 9, 0.0)]}
    assert {k: c.label for k, c in choose(options, 29).items()} == {"a": "y", "b": "y"}
    assert {k: c.label for k, c in choose(options, 17).items()} == {"a": "x", "b": "x"}
    assert choose(options, 16) is None
    assert choose(options, 16, exact_limit=0) is None


def test_a_budget_above_everything_picks_each_least_cost_option() -> None:
    rng = random.Random(4)
    for _ in range(50):
        options, _ = general(rng)
        for limit in (0, 100_000):
            plan = choose(options, bounds(options)[1] + 1, exact_limit=limit)
            assert total_cost(plan) == sum(min(c.cost for c in v) for v in options.values())


def test_dominated_options_are_never_chosen() -> None:
    rng = random.Random(5)
    for _ in range(200):
        options, budget = general(rng)
        for limit in (0, 100_000):
            plan = choose(options, budget, exact_limit=limit)
            assert all(plan[k] in pareto(v) for k, v in options.items())


def test_pareto_keeps_the_first_of_exact_ties_and_hull_drops_points_above() -> None:
    row = [Choice("a", 4, 2.0), Choice("b", 4, 2.0), Choice("c", 4, 3.0), Choice("d", 2, 5.0), Choice("e", 9, 2.0)]
    assert [c.label for c in pareto(row)] == ["d", "a"]
    front = [Choice("p", 0, 12.0), Choice("q", 1, 6.0), Choice("r", 2, 5.0), Choice("s", 3, 0.0)]
    assert [c.label for c in hull(front)] == ["p", "q", "s"]
    straight = [Choice("p", 0, 3.0), Choice("q", 1, 2.0), Choice("r", 2, 1.0)]
    assert hull(straight) == straight


def test_frontier_costs_fall_as_budgets_rise() -> None:
    options, _ = general(random.Random(6))
    lo, hi = bounds(options)
    plans = frontier(options, [lo - 1, lo, (lo + hi) // 2, hi])
    assert plans[0] is None
    costs = [total_cost(p) for p in plans[1:]]
    assert costs == sorted(costs, reverse=True)
    assert [total_cost(p) for p in plans[1:]] == [brute_force(options, b) for b in (lo, (lo + hi) // 2, hi)]


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="non-negative integer"):
        Choice("x", -1, 0.0)
    with pytest.raises(ValueError, match="finite number >= 0"):
        Choice("x", 1, float("nan"))
    with pytest.raises(ValueError, match="has no options"):
        choose({"a": []}, 10)
    assert choose({}, 0) == {}
