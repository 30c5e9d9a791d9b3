"""Checkmate's approximation: ``"checkmate-lp"``, LP relaxation and two-phase rounding.

Jain, Jain, Nrusimha, Gholami, Abbeel, Keutzer, Stoica and Gonzalez, "Checkmate: Breaking the
Memory Wall with Optimal Tensor Rematerialization" (MLSys 2020), section 5: for graphs too
large for the exact ILP, solve its linear relaxation, round the liveness variables ``S``
(deterministically at 1/2, then randomized: each ``S`` is 1 with its fractional value), and
solve the recomputations ``R`` given the rounded ``S`` (a much easier integer program), keeping
the fastest rounding whose plan fits. The paper reports plans within 6% (geometric mean) of
the ILP's optimum. Here on the whole model's rk-Checkmate CD-graph (:mod:`solvers.checkmate_ilp`,
the model of ``solver="checkmate"``); the simulator validates every plan.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from rkgb.cdgraph import ModelChain

from .registry import CheckmateSolver, _infeasible, _no_recompute_plan, _plan
from .schedule import Plan

__all__ = ["CheckmateLPSolver", "roundings"]


def roundings(relaxed: dict[str, float], count: int, seed: int = 0) -> list[dict[str, float]]:
    """The deterministic rounding of the liveness values (1 from 1/2 up), then ``count``
    randomized ones (1 with probability the value), without repeats."""
    rng = random.Random(seed)
    out = [{name: 1.0 if value >= 0.5 else 0.0 for name, value in relaxed.items()}]
    for _ in range(count):
        candidate = {name: 1.0 if rng.random() < value else 0.0 for name, value in relaxed.items()}
        if candidate not in out:
            out.append(candidate)
    return out


@dataclass
class CheckmateLPSolver(CheckmateSolver):
    """LP relaxation of the whole-graph rk-Checkmate model, rounded in two phases."""

    name: str = "checkmate-lp"
    random_roundings: int = 4
    round_only_saved: bool = False
    seed: int = 0
    time_limit_s: float = 30.0

    def _rounded(self, chain: ModelChain, budget: float | None, objective: str) -> Plan | None:
        """The best plan (fastest, or lowest for ``objective="peak"``) over the roundings that
        fit ``budget`` (None: any), or None."""
        graph, ilp = self._ilp(chain)
        relaxed = ilp.relaxed_liveness(budget, objective=objective, time_limit_s=self.time_limit_s,
                                       solver=self.ilp_solver)
        if relaxed is None:
            return None
        if self.round_only_saved:  # the checkpoint decision: what is alive at the loss
            saved = {v.name for v in ilp.saved_vars.values()}
            relaxed = {name: value for name, value in relaxed.items() if name in saved}
        best = None
        for fixed in roundings(relaxed, self.random_roundings, self.seed):
            ilp.fix_liveness(fixed)
            try:
                solution = ilp.solve(budget, objective=objective, time_limit_s=self.time_limit_s,
                                     solver=self.ilp_solver)
            finally:
                ilp.fix_liveness(None)
            if not solution.feasible:
                continue
            plan = _plan(chain, budget or 0, self.name, self._schedule(graph, solution.computes),
                         time_limit_hit=solution.time_limit_hit)
            if budget is not None and plan.predicted_peak > budget:
                continue
            key = plan.predicted_time if objective == "time" else plan.predicted_peak
            if best is None or key < (best.predicted_time if objective == "time" else best.predicted_peak):
                best = plan
        return best

    def solve(self, chain: ModelChain, budget: int, *, start_schedule=None) -> Plan:
        start = time.perf_counter()
        plan = self._rounded(chain, float(budget), "time")
        if plan is None:
            lowest = self._lowest(chain)
            if lowest.predicted_peak > budget:
                return _infeasible(chain, budget, self.name, lowest.predicted_peak,
                                   solve_time_s=time.perf_counter() - start)
            plan = lowest
            plan.notes.append("no rounding of the relaxation at this budget fits; the lowest-peak plan does")
        plan.budget = budget
        plan.solve_time_s = time.perf_counter() - start
        return plan

    def _lowest(self, chain: ModelChain) -> Plan:
        plan = self._rounded(chain, None, "peak")
        if plan is None:
            plan = _no_recompute_plan(chain, 0, self.name)
        plan.budget = plan.predicted_peak
        return plan
