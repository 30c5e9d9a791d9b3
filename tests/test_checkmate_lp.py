"""``solver="checkmate-lp"``: Checkmate's LP relaxation and two-phase rounding (Jain et al. 2020)."""

from __future__ import annotations

import pytest

from solvers.checkmate_ilp import RkCheckmateILP
from solvers.checkmate_lp import roundings
from solvers.toy_graphs import diamond_graph, residual_graph, split_graph


def test_roundings_start_with_the_threshold_one_and_never_repeat():
    relaxed = {"S_1_0": 0.5, "S_2_0": 0.2, "S_2_1": 1.0, "S_3_1": 0.0}
    out = roundings(relaxed, 20, seed=1)
    assert out[0] == {"S_1_0": 1.0, "S_2_0": 0.0, "S_2_1": 1.0, "S_3_1": 0.0}
    assert all(r["S_2_1"] == 1.0 and r["S_3_1"] == 0.0 for r in out)  # integral values stay
    assert len({tuple(sorted(r.items())) for r in out}) == len(out) <= 4


@pytest.mark.parametrize("make", [diamond_graph, residual_graph, split_graph])
def test_relaxation_bounds_the_optimum_and_its_rounding_is_feasible(make):
    """The LP's optimum is at most the ILP's; with the liveness fixed to the threshold
    rounding of the LP's, the second phase's plan costs at least the ILP's optimum."""
    graph = make()
    ilp = RkCheckmateILP(graph, lazy_recompute=True)
    low = ilp.solve(None, objective="peak", time_limit_s=20).objective
    budget = low * 1.1
    exact = ilp.solve(budget, time_limit_s=20)
    assert exact.feasible
    relaxed = ilp.relaxed_liveness(budget, time_limit_s=20)
    assert relaxed is not None and all(0.0 <= v <= 1.0 for v in relaxed.values())
    lp_value = sum(v.varValue * c for v, c in ilp.time_objective.items()) + ilp.time_objective.constant
    assert lp_value <= exact.objective + 1e-6
    ilp.fix_liveness(roundings(relaxed, 0)[0])
    rounded = ilp.solve(budget, time_limit_s=20)
    ilp.fix_liveness(None)
    if rounded.feasible:
        assert rounded.objective >= exact.objective - 1e-6
    assert ilp.solve(budget, time_limit_s=20).objective == pytest.approx(exact.objective)  # freed again
