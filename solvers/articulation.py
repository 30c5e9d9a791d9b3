"""Checkpoints at articulation points: ``"articulation"``, OpenAI's gradient checkpointing.

Bulatov and Salimans, "Fitting larger networks into memory" (2018; the
``openai/gradient-checkpointing`` package): the checkpoints are articulation points of the
forward graph, tensors whose removal disconnects it; the forward keeps only them, and the
backward recomputes everything between two checkpoints once, segment by segment. The package's
``memory`` mode takes about sqrt(n) of them, evenly spaced (the strategy of ``"sqrt"``); this
solver is its budget-driven form: the articulation points of our graphs are the boundaries of
the chain's blocks (the 1-separators that :mod:`rkgb.blocks` cuts at), and the checkpoints are
added greedily, each time the one whose segment lowers the peak most (the DP's block-level
memory model), until the plan fits the budget. Each block runs its autograd option and its
no-grad forward (:mod:`solvers.sqrt_segments`' segment strategy, with free segment starts):
the simulator validates the plan and the executor runs it exactly as any other.
"""

from __future__ import annotations

from dataclasses import dataclass

from rkgb.cdgraph import ModelChain

from .rotor_dp import ChainCosts, strategy_peak
from .sqrt_segments import SqrtSolver, segment_actions

__all__ = ["ArticulationSolver", "greedy_checkpoints"]


def greedy_checkpoints(costs: ChainCosts, n_blocks: int) -> list[tuple[list[int], int]]:
    """The greedy path: from one segment (no checkpoint: no recomputation), add at each step the
    block boundary whose checkpoint gives the lowest peak (ties: the earliest), until every
    boundary is one. Returns each step's segment starts and its peak (DP model), in order."""
    starts = [0]
    path = [(list(starts), strategy_peak(costs, segment_actions(n_blocks, starts)))]
    free = set(range(1, n_blocks))
    while free:
        best = None
        for k in sorted(free):
            candidate = sorted(starts + [k])
            peak = strategy_peak(costs, segment_actions(n_blocks, candidate))
            if best is None or peak < best[1]:
                best = (candidate, peak, k)
        starts = best[0]
        free.discard(best[2])
        path.append((list(starts), best[1]))
    return path


@dataclass
class ArticulationSolver(SqrtSolver):
    """Greedy checkpoints at the chain's articulation points (block boundaries), the fewest
    (along the greedy path) whose plan fits the budget; the minimum is the lowest simulated
    peak along that path (:class:`SqrtSolver`'s search over these strategies)."""

    name: str = "articulation"

    def _strategies(self, chain: ModelChain, costs: ChainCosts):
        n = len(chain.blocks)
        for starts, peak in greedy_checkpoints(costs, n):
            yield starts[1:], segment_actions(n, starts), peak

    def _describe(self, label, n_blocks: int) -> str:
        return f"checkpoints at blocks {label} of {n_blocks}"
