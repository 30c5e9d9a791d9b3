"""Optimal checkpointing of a chain of identical steps: ``"bptt"`` (Griewank's revolve).

Memory-efficient backpropagation through time (Gruslys, Munos, Danihelka, Lanctot and Graves,
NeurIPS 2016) and, before it, Griewank's binomial checkpointing ("Achieving logarithmic growth
of temporal and spatial complexity in reverse automatic differentiation", 1992; ``revolve``,
Griewank and Walther 2000): to reverse ``l`` identical steps holding at most ``s`` step inputs at
once (the chain's input among them), the fewest forward steps run again is

    t(l, s) = r * l - beta(s + 1, r - 1),  beta(s, r) = C(s + r, s),

with ``r`` the least integer such that ``beta(s, r) >= l``; it satisfies the recurrence
``t(l, s) = min_m [m + t(l - m, s - 1) + t(m, s)]`` (advance ``m`` steps without autograd to a
new checkpoint, reverse the rest with one slot less, then the first ``m`` steps), whose
minimizing ``m`` is found here by bisection on the recurrence's convex cost (each ``t`` in
O(r)). The schedule is a :class:`solvers.rotor_dp.ChainAction` sequence (each block's autograd
option and its no-grad forward), so that the simulator validates it and the executor runs it
exactly; the solver takes the most slots whose plan fits the budget (the least recomputation).
On a chain of identical blocks (an unrolled RNN) it is optimal among the strategies that keep
whole block inputs; on other chains it is valid but blind to their differences.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from functools import lru_cache

from rkgb.cdgraph import ModelChain

from .registry import RotorSolver, _infeasible, _no_recompute_plan, _plan
from .rotor_dp import ChainAction, strategy_peak, strategy_time
from .schedule import Plan

__all__ = ["BPTTSolver", "revolve_actions", "revolve_cost"]


def _beta(s: int, r: int) -> int:
    return math.comb(s + r, s) if r >= 0 and s >= 0 else 0


@lru_cache(maxsize=None)
def _repetitions(l: int, s: int) -> int:
    r = 0
    while _beta(s, r) < l:
        r += 1
    return r


def revolve_cost(l: int, s: int) -> int:
    """The fewest forward steps run again to reverse ``l`` steps with ``s`` checkpoints (the
    input's included); ``s >= 1``."""
    if l <= 1:
        return 0
    if s == 1:
        return l * (l - 1) // 2
    r = _repetitions(l, s)
    return r * l - _beta(s + 1, r - 1)


def _split(l: int, s: int) -> int:
    """A minimizing ``m`` of ``m + t(l - m, s - 1) + t(m, s)`` over 1..l-1 (convex in m: the
    first m whose next difference is not negative)."""
    def cost(m: int) -> int:
        return m + revolve_cost(l - m, s - 1) + revolve_cost(m, s)

    low, high = 1, l - 1
    while low < high:
        middle = (low + high) // 2
        if cost(middle + 1) - cost(middle) >= 0:
            high = middle
        else:
            low = middle + 1
    return low


def revolve_actions(n_blocks: int, slots: int) -> list[ChainAction]:
    """The chain strategy reversing ``n_blocks`` with at most ``slots`` block inputs kept at once
    (the chain's input included): ``revolve_cost(n_blocks, slots)`` no-grad forwards, each
    block's forward with autograd once, the loss after the last block's."""
    slots = max(1, slots)
    actions: list[ChainAction] = []
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 4 * n_blocks + 100))

    def advance(first: int, end: int) -> None:
        """No-grad forwards of blocks first..end-1 from the kept input of ``first``: keeps the
        output of end-1 (a new checkpoint) and none between."""
        for k in range(first, end):
            actions.append(ChainAction("no_grad", k, forget_input=k > first))

    def reverse(first: int, end: int, s: int) -> None:
        """Backward of blocks first..end-1, the input of ``first`` kept, ``s`` slots."""
        length = end - first
        if length == 1:
            actions.append(ChainAction("forward", first, 0))
            if end == n_blocks:
                actions.append(ChainAction("loss"))
            actions.append(ChainAction("backward", first, 0))
            return
        if s == 1:  # only the input kept: run forward from it to each block in turn
            for j in reversed(range(first, end)):
                if j > first:
                    advance(first, j)
                reverse(j, j + 1, 2)
                if j > first:
                    actions.append(ChainAction("forget_output", j - 1))
            return
        m = _split(length, s)
        advance(first, first + m)
        reverse(first + m, end, s - 1)
        actions.append(ChainAction("forget_output", first + m - 1))
        reverse(first, first + m, s)

    try:
        reverse(0, n_blocks, slots)
    finally:
        sys.setrecursionlimit(limit)
    return actions


@dataclass
class BPTTSolver(RotorSolver):
    """Revolve's binomial checkpoints: the most slots (fewest recomputations) that fit."""

    name: str = "bptt"

    def _solve(self, chain: ModelChain, budget: int) -> Plan:
        # revolve runs every block's taped forward in the reversal, after a sweep without
        # autograd: even with a slot per block it runs n - 1 forwards again; where keeping
        # everything fits, that (autograd's plan) is the fastest
        top = _no_recompute_plan(chain, budget, self.name)
        if top.predicted_peak <= budget:
            return top
        costs, per_block = self.chain_costs(chain)
        n = len(chain.blocks)
        # the DP model's peak grows with the slots: the most that fit, by bisection
        low, high = 1, max(1, n)
        if strategy_peak(costs, revolve_actions(n, low)) > budget:
            high = 0
        while low < high:
            middle = (low + high + 1) // 2
            if strategy_peak(costs, revolve_actions(n, middle)) <= budget:
                low = middle
            else:
                high = middle - 1
        for slots in range(high, 0, -1):  # the simulator judges (a few fewer slots if it must)
            actions = revolve_actions(n, slots)
            plan = _plan(chain, budget, self.name, self.instantiate(chain, per_block, actions))
            if plan.predicted_peak <= budget:
                plan.notes.append(f"{slots} checkpoint slot(s) for {n} blocks: {revolve_cost(n, slots)} "
                                  f"forwards again; DP time model {strategy_time(costs, actions):.3g} s")
                return plan
            if high - slots >= 3:
                break
        return _infeasible(chain, budget, self.name, self.min_budget(chain))

    def min_budget(self, chain: ModelChain) -> int:
        """The simulated peak of one slot (the chain's input alone), or of the no-recomputation
        plan where lower."""
        costs, per_block = self.chain_costs(chain)
        n = len(chain.blocks)
        one = _plan(chain, 0, self.name, self.instantiate(chain, per_block, revolve_actions(n, 1))).predicted_peak
        return min(one, _no_recompute_plan(chain, 0, self.name).predicted_peak)
