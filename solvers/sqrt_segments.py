"""Segment checkpointing: ``"sqrt"``, the strategy of ``torch.utils.checkpoint.checkpoint_sequential``.

Chen, Xu, Zhang and Guestrin, "Training Deep Nets with Sublinear Memory Cost" (2016): cut the
chain of n blocks into segments, run the forward without grad keeping only each segment's
input, then, segment by segment from the last, run the segment's forward again with autograd
and its backward. With about sqrt(n) segments the activation memory is O(sqrt(n)) blocks for
one extra forward. The budget-driven variant takes the fewest segments (the least
recomputation) whose plan fits the budget.

Each block runs its autograd option (no recomputation inside a block) and its no-grad forward:
the strategy is a :class:`solvers.rotor_dp.ChainAction` sequence that the chain planner
instantiates, so that the simulator validates it and the executor runs it exactly as any plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rkgb.cdgraph import ModelChain

from .registry import RotorSolver, _infeasible, _no_recompute_plan, _plan
from .rotor_dp import ChainAction, ChainCosts, strategy_peak, strategy_time
from .schedule import Plan

__all__ = ["SqrtSolver", "segment_actions", "segment_bounds"]


def segment_bounds(n_blocks: int, segments: int) -> list[int]:
    """The first block of each of ``segments`` segments of about equal length (as
    ``checkpoint_sequential`` cuts: ``n // segments`` blocks each, the last taking the rest)."""
    segments = max(1, min(segments, n_blocks))
    size = n_blocks // segments
    return [k * size for k in range(segments)]


def segment_actions(n_blocks: int, starts: list[int]) -> list[ChainAction]:
    """The chain strategy of segments beginning at ``starts`` (``starts[0] == 0``): the forward
    of every segment but the last without grad (keeping each segment's input), the last
    segment with autograd, the loss, then each earlier segment again with autograd and its
    backward."""
    bounds = list(starts) + [n_blocks]
    actions: list[ChainAction] = []

    def with_autograd(first: int, end: int, last: bool) -> list[ChainAction]:
        inner = [ChainAction("forward", k, 0) for k in range(first, end)]
        if last:
            inner.append(ChainAction("loss"))
        inner += [ChainAction("backward", k, 0) for k in reversed(range(first, end))]
        return inner

    # the forward: segments 0..S-2 without grad; each forgets its own inner inputs
    for index in range(len(starts) - 1):
        first, end = bounds[index], bounds[index + 1]
        for k in range(first, end):
            actions.append(ChainAction("no_grad", k, forget_input=k > first))
    tail: list[ChainAction] = with_autograd(bounds[-2], bounds[-1], last=True)
    # backward: from the last segment to the first, each recomputed from its kept input
    for index in reversed(range(len(starts) - 1)):
        first, end = bounds[index], bounds[index + 1]
        tail.append(ChainAction("forget_output", end - 1))
        tail += with_autograd(first, end, last=False)
    return actions + tail


@dataclass
class SqrtSolver(RotorSolver):
    """``checkpoint_sequential``'s segments, the fewest that fit the budget (``segments=None``)
    or a fixed count (``segments=k``; ``"sqrt"``: round(sqrt(n)))."""

    name: str = "sqrt"
    segments: int | str | None = None

    def _candidates(self, n_blocks: int) -> list[int]:
        if self.segments == "sqrt":
            return [max(1, round(math.sqrt(n_blocks)))]
        if isinstance(self.segments, int):
            return [self.segments]
        return list(range(1, n_blocks + 1))

    def _strategies(self, chain: ModelChain, costs: ChainCosts):
        n = len(chain.blocks)
        for count in self._candidates(n):
            actions = segment_actions(n, segment_bounds(n, count))
            yield count, actions, strategy_peak(costs, actions)

    def _describe(self, label, n_blocks: int) -> str:
        return f"{label} segment(s) of {n_blocks} blocks"

    def _solve(self, chain: ModelChain, budget: int) -> Plan:
        """The first of :meth:`_strategies` (the least recomputation first) whose plan the
        simulator puts within the budget."""
        costs, per_block = self.chain_costs(chain)
        fitting = [(count, actions) for count, actions, peak in self._strategies(chain, costs) if peak <= budget]
        for count, actions in fitting:  # the fewest segments first: the least recomputation
            plan = _plan(chain, budget, self.name, self.instantiate(chain, per_block, actions))
            if plan.predicted_peak <= budget:
                plan.notes.append(f"{self._describe(count, len(chain.blocks))}; "
                                  f"DP time model {strategy_time(costs, actions):.3g} s")
                return plan
        top = _no_recompute_plan(chain, budget, self.name)
        if top.predicted_peak <= budget:
            return top
        return _infeasible(chain, budget, self.name, self.min_budget(chain))

    def min_budget(self, chain: ModelChain) -> int:
        """The lowest simulated peak over the segment counts this solver tries."""
        costs, per_block = self.chain_costs(chain)
        best = None
        for _, actions, _ in self._strategies(chain, costs):
            peak = _plan(chain, 0, self.name, self.instantiate(chain, per_block, actions)).predicted_peak
            best = peak if best is None else min(best, peak)
        return best if best is not None else 0
