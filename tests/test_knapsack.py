"""PyTorch's activation-memory-budget knapsacks (``solver="knapsack-*"``): the four pick the same
value where they are exact, greedy at most that, Hirschberg's in O(capacity) memory; the plans
run exactly."""

from __future__ import annotations

import itertools
import random
import tracemalloc

import pytest

from exactness import check_training
from solvers.knapsack import knapsack_dp, knapsack_greedy, knapsack_hirschberg, knapsack_ilp
from zoo import ZOO


def _instance(seed: int, n: int, capacity: int):
    rng = random.Random(seed)
    values = [round(rng.uniform(0.1, 10.0), 3) for _ in range(n)]
    weights = [rng.randint(1, capacity // 2) for _ in range(n)]
    return values, weights


def _value(values, chosen):
    return sum(values[i] for i in chosen)


@pytest.mark.parametrize("seed", range(6))
def test_exact_knapsacks_agree_with_brute_force_and_greedy_is_below(seed):
    values, weights = _instance(seed, 12, 60)
    best = max(_value(values, subset) for r in range(13) for subset in itertools.combinations(range(12), r)
               if sum(weights[i] for i in subset) <= 60)
    for solve in (knapsack_dp, knapsack_hirschberg, knapsack_ilp):
        chosen = solve(values, weights, 60)
        assert sum(weights[i] for i in chosen) <= 60
        assert _value(values, chosen) == pytest.approx(best)
    # the divide and conquer finds the dp's own selection (the optimum is unique here)
    assert sorted(knapsack_hirschberg(values, weights, 60)) == sorted(knapsack_dp(values, weights, 60))
    greedy = knapsack_greedy(values, weights, 60)
    assert sum(weights[i] for i in greedy) <= 60 and _value(values, greedy) <= best + 1e-9


def test_hirschberg_needs_far_less_memory_than_the_dp():
    """2000 items, capacity 2000: the same optimum; the dp's table of choices is items x
    capacity, Hirschberg's rows are capacity-sized (tracemalloc peaks)."""
    values, weights = _instance(7, 2000, 2000)
    peaks, results = {}, {}
    for solve in (knapsack_dp, knapsack_hirschberg):
        tracemalloc.start()
        results[solve] = sorted(solve(values, weights, 2000))
        peaks[solve] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert results[knapsack_dp] == results[knapsack_hirschberg]  # the same selection
    assert peaks[knapsack_hirschberg] * 10 < peaks[knapsack_dp], peaks  # measured: 233 KB against 4.05 MB


@pytest.mark.parametrize("solver", ["knapsack-dp", "knapsack-greedy"])
def test_knapsack_plans_are_exact_and_under_budget(solver):
    model, sample = ZOO["gpt"].build()
    report = check_training(model, sample, 0.8, solver, steps=2, at_minimum=True)
    assert report.compiled.plan.solver == solver
