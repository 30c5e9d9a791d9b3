"""The knapsack solvers of PyTorch's activation-memory budget: ``"knapsack-dp"``,
``"knapsack-greedy"``, ``"knapsack-ilp"`` and ``"knapsack-hirschberg"``.

PyTorch's ``torch._functorch.config.activation_memory_budget`` (the min-cut partitioner's
``activation_memory_budget_solver``) chooses which activations to save for the backward as a
0/1 knapsack: each saveable tensor is an item whose weight is its memory and whose value is the
runtime that saving it avoids recomputing; what is not saved is recomputed in the backward.
Its solvers are a dynamic program over quantized memory, a greedy by value per byte, an ILP,
and the dynamic program with Hirschberg's divide and conquer (Hirschberg 1975: the same
optimum in O(capacity) memory instead of O(items x capacity)).

Here an item is a forward node of the whole model's CD-graph: saving it keeps its result and
what its backward reads (its phantoms); its value is its forward time. The backward recomputes
an unsaved node (with autograd, its unsaved inputs first) where a backward first needs it,
once; :func:`solvers.simulate.schedule_from_computes` places the frees. The capacity (bytes of
saved activations) is the largest, among evenly spaced ones, whose plan the simulator puts
within the budget; the executor runs the plan exactly as any other. The knapsack bounds what
is kept between the forward and the backward, not the step's peak: the recomputed tensors of
a backward stay until their last use, so that saving nothing recomputes the whole forward at
once; its plans reach budgets well above Rockmate's minimum (README, figures).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from rkgb.cdgraph import CDGraph, ComputeKind, ModelChain

from .registry import _infeasible, _no_recompute_plan, _plan
from .schedule import Plan, Schedule
from .simulate import effective_needs, operation_outputs, phantoms_of, schedule_from_computes

__all__ = ["KnapsackSolver", "knapsack_dp", "knapsack_greedy", "knapsack_hirschberg", "knapsack_ilp",
           "schedule_of_saved"]


# -- the four knapsack solvers: (values, integer weights, capacity) -> chosen item indices ----
def knapsack_dp(values: list[float], weights: list[int], capacity: int) -> list[int]:
    """Exact 0/1 knapsack by dynamic programming over capacities (O(n x capacity) memory for
    the choices). Ties: an item is left out unless taking it is strictly better."""
    n = len(values)
    best = np.zeros(capacity + 1)
    took = np.zeros((n, capacity + 1), dtype=bool)
    for i in range(n):
        w, v = weights[i], values[i]
        if w > capacity:
            continue
        candidate = best[: capacity + 1 - w] + v
        better = candidate > best[w:]
        took[i, w:] = better
        best[w:] = np.where(better, candidate, best[w:])
    chosen, c = [], capacity
    for i in reversed(range(n)):
        if took[i, c]:
            chosen.append(i)
            c -= weights[i]
    return sorted(chosen)


def _last_row(values, weights, capacity: int) -> np.ndarray:
    """The dynamic program's last row: the best value of the items within each capacity."""
    best = np.zeros(capacity + 1)
    for v, w in zip(values, weights):
        if w <= capacity:
            best[w:] = np.maximum(best[w:], best[: capacity + 1 - w] + v)
    return best


def knapsack_hirschberg(values: list[float], weights: list[int], capacity: int) -> list[int]:
    """Exact 0/1 knapsack in O(capacity) memory: Hirschberg's divide and conquer on the dynamic
    program (split the items in two halves, find by two last rows how the optimum shares the
    capacity between them, recurse)."""
    chosen: list[int] = []

    def solve(items: list[int], cap: int) -> None:
        if not items or cap <= 0:
            return
        if len(items) == 1:
            i = items[0]
            if weights[i] <= cap and values[i] > 0:
                chosen.append(i)
            return
        half = len(items) // 2
        left, right = items[:half], items[half:]
        f = _last_row([values[i] for i in left], [weights[i] for i in left], cap)
        g = _last_row([values[i] for i in right], [weights[i] for i in right], cap)
        totals = f + g[::-1]
        split = int(np.argmax(totals))  # the first (smallest left capacity) of the best
        solve(left, split)
        solve(right, cap - split)

    solve(list(range(len(values))), capacity)
    return sorted(chosen)


def knapsack_greedy(values: list[float], weights: list[int], capacity: int) -> list[int]:
    """By value per byte, the densest first, each that still fits (at most the optimum)."""
    order = sorted(range(len(values)), key=lambda i: (-(values[i] / weights[i]) if weights[i] else -np.inf, i))
    chosen, used = [], 0
    for i in order:
        if used + weights[i] <= capacity:
            chosen.append(i)
            used += weights[i]
    return sorted(chosen)


def knapsack_ilp(values: list[float], weights: list[int], capacity: int) -> list[int]:
    """Exact 0/1 knapsack as an integer program (pulp, CBC)."""
    import pulp

    prob = pulp.LpProblem("knapsack", pulp.LpMaximize)
    x = [pulp.LpVariable(f"x{i}", cat=pulp.LpBinary) for i in range(len(values))]
    prob += pulp.lpSum(v * xi for v, xi in zip(values, x))
    prob += pulp.lpSum(w * xi for w, xi in zip(weights, x)) <= capacity
    prob.solve(pulp.PULP_CBC_CMD(msg=False))
    return [i for i, xi in enumerate(x) if (xi.varValue or 0) > 0.5]


METHODS = {"dp": knapsack_dp, "greedy": knapsack_greedy, "ilp": knapsack_ilp, "hirschberg": knapsack_hirschberg}


# -- from a saved set to a schedule --------------------------------------------------------
def _items(graph: CDGraph) -> tuple[list[str], list[int], list[float], dict[str, str]]:
    """The saveable forward nodes (not those of the model's outputs, which are kept), their
    bytes (result and phantoms), their forward time, and each data node's producer."""
    producer: dict[str, str] = {}
    for node in graph.compute_nodes:
        if node.kind is ComputeKind.FORWARD:
            for d in operation_outputs(graph, node, True):
                producer[d] = node.name
    kept = {producer[d] for d in graph.output_data if d in producer}
    names, weights, values = [], [], []
    for node in graph.compute_nodes:
        if node.kind is ComputeKind.FORWARD and node.name not in kept:
            names.append(node.name)
            weights.append(sum(graph.size(d) for d in operation_outputs(graph, node, True)))
            values.append(node.time_s)
    return names, weights, values, producer


def schedule_of_saved(graph: CDGraph, saved: set[str], producer: dict[str, str] | None = None) -> Schedule:
    """The schedule that runs the forward, keeps the ``saved`` forward nodes' results (and those
    of the model's outputs), and recomputes every other one once, where a backward first needs
    it (its unsaved inputs first). ``producer``: :func:`_items`'s, where known."""
    if producer is None:
        producer = _items(graph)[3]
    computes = [node.name for node in graph.compute_nodes if node.kind is ComputeKind.FORWARD]
    kept = {producer[d] for d in graph.output_data if d in producer}
    available = {d for d, p in producer.items() if p in saved or p in kept} | set(graph.input_data)

    def ensure(d: str) -> None:
        if d in available or d not in producer:
            return
        node = graph.compute(producer[d])
        for need in effective_needs(graph, node):
            ensure(need)
        computes.append(node.name)
        available.update(operation_outputs(graph, node, True))

    for node in graph.compute_nodes:
        if node.kind is ComputeKind.FORWARD:
            continue
        if node.kind is ComputeKind.BACKWARD:
            for d in effective_needs(graph, node):
                ensure(d)
            phantoms = phantoms_of(graph, node)
            if phantoms is not None:
                ensure(phantoms)
        computes.append(node.name)
    return schedule_from_computes(graph, computes, protected=set(graph.input_grads) | set(graph.held_outputs),
                                  keep_at_end=set(graph.held_outputs))


@dataclass
class KnapsackSolver:
    """One of PyTorch's activation-memory-budget knapsacks (``method``: ``"dp"``, ``"greedy"``,
    ``"ilp"``, ``"hirschberg"``) on the whole graph, at the largest capacity that fits."""

    method: str = "dp"
    resolution: int = 2000  # memory quantized to 1/resolution of the saveable total (as PyTorch's dp)
    steps: int = 40  # capacities tried, evenly spaced

    @property
    def name(self) -> str:
        return f"knapsack-{self.method}"

    def _sweep(self, chain: ModelChain) -> list[Plan]:
        """The plans at ``steps + 1`` capacities from nothing saved to everything, the largest
        first (the peak is not monotone in the capacity: a scan, not a bisection)."""
        graph = chain.whole_graph()
        names, weights, values, producer = _items(graph)
        total = sum(weights)
        unit = max(1, -(-total // self.resolution))
        quantized = [-(-w // unit) for w in weights]  # rounded up: the bytes are never under-counted
        plans = []
        for k in reversed(range(self.steps + 1)):
            chosen = METHODS[self.method](values, quantized, total * k // self.steps // unit)
            schedule = schedule_of_saved(graph, {names[i] for i in chosen}, producer)
            plans.append(_plan(chain, 0, self.name, schedule))
        return plans

    def solve(self, chain: ModelChain, budget: int) -> Plan:
        start = time.perf_counter()
        for plan in self._sweep(chain):  # the largest capacity that fits: the least recomputation
            if plan.predicted_peak <= budget:
                plan.budget = budget
                plan.solve_time_s = time.perf_counter() - start
                return plan
        top = _no_recompute_plan(chain, budget, self.name)
        if top.predicted_peak <= budget:
            return top
        return _infeasible(chain, budget, self.name, self.min_budget(chain), solve_time_s=time.perf_counter() - start)

    def min_budget(self, chain: ModelChain) -> int:
        """The lowest peak over the capacities :meth:`solve` tries."""
        return min([plan.predicted_peak for plan in self._sweep(chain)]
                   + [_no_recompute_plan(chain, 0, self.name).predicted_peak])
