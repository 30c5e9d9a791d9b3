"""``solver="bptt"``: Griewank's binomial checkpointing (revolve) on chains of identical blocks."""

from __future__ import annotations

import copy
from functools import lru_cache

import pytest

from exactness import check_training
from rockmate import Rockmate
from solvers.bptt import revolve_actions, revolve_cost
from zoo import ZOO


@lru_cache(maxsize=None)
def _dp(l: int, s: int) -> int:
    """The recurrence itself: advance m steps to a new checkpoint, reverse the rest with one slot
    less, then the first m."""
    if l <= 1:
        return 0
    if s == 1:
        return l * (l - 1) // 2
    return min(m + _dp(l - m, s - 1) + _dp(m, s) for m in range(1, l))


def test_closed_form_equals_the_recurrence():
    for l in range(1, 40):
        for s in range(1, 7):
            assert revolve_cost(l, s) == _dp(l, s), (l, s)


@pytest.mark.parametrize("n,s", [(1, 1), (5, 1), (7, 2), (20, 3), (33, 4), (64, 6), (10, 10)])
def test_actions_reverse_every_block_once_with_the_optimal_recomputation(n, s):
    actions = revolve_actions(n, s)
    assert [a.block for a in actions if a.kind == "backward"] == list(reversed(range(n)))
    assert sorted(a.block for a in actions if a.kind == "forward") == list(range(n))
    assert sum(a.kind == "no_grad" for a in actions) == revolve_cost(n, s)
    assert [a.kind for a in actions].count("loss") == 1
    # never more than s checkpoints (the chain's input is one) besides the state being advanced
    kept, most = {0}, 1
    for a in actions:
        if a.kind == "no_grad":
            kept.add(a.block + 1)
            if a.forget_input:
                kept.discard(a.block)
        elif a.kind == "forget_output":
            kept.discard(a.block + 1)
        most = max(most, len(kept - {n}))
    assert most <= s + 1


def test_bptt_is_exact_under_budget_and_no_faster_than_rotor():
    """On the unrolled RNN (identical blocks): bitwise over 3 steps within the budget, and its
    predicted time at least rk-Rotor's with one option per block at the same budget (the DP
    searches a superset of revolve's strategies)."""
    model, sample = ZOO["rnn"].build()
    report = check_training(model, sample, 0.85, "bptt", steps=3, at_minimum=True)
    plan = report.compiled.plan
    assert plan.solver == "bptt"
    rotor = Rockmate(copy.deepcopy(model), sample, report.budget, solver="rotor", cost_model="flops").plan
    assert plan.predicted_time >= rotor.predicted_time * (1 - 1e-9)
