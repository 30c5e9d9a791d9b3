"""Classes whose CD-graphs differ only in their measured costs share one option grid.

A model's blocks fall into classes by their operations (:mod:`rkgb.blocks`), and each class gets
an option grid (:func:`solvers.block_options.solve_class_options`, seconds per attention class).
Two classes can still have the same CD-graph but for the costs their inspection measured: T5's
first self-attention block of the encoder and of the decoder compute their position biases with
other operations of the same shapes (bidirectional and causal buckets), so each is a class of its
own with the same compute and data nodes, sizes and gradient rules, a few temporary-memory figures
apart (419328 against 382464 bytes) and op times within the measures' noise.

Such twins share one grid: the lead (the first of them) is solved, and each of its options'
schedules is measured on the twin's own graph by the simulator (:func:`solvers.options.
option_from_schedule`), so every figure the DP and the budget check use is the twin's own, exact;
what may be lost is optimality, where the twin's own grid would have found other schedules. So
only classes whose costs are close are twins: their times alike under the criterion by which the
option cache reuses a class's options for a rebuild (:func:`solvers.option_cache.similar_times`;
the cache reuses the old figures too, a twin gets its own), their temporary memories within
:data:`MAX_OVERHEAD_DIFFERENCE` of the peak (a convolution of 3x3 kernels and one of 1x1 kernels
of the same shapes, half of a block's time, are no twins: that op's share 5x apart). Measured on
T5 (4 + 4 layers, d=64: five attention classes of 45-47 computes, two pairs of twins): see
:class:`solvers.registry.RockmateSolver`'s ``share_twin_grids``.
"""

from __future__ import annotations

import dataclasses

from rkgb.cdgraph import CDGraph, ComputeKind
from solvers.block_options import pareto_front
from solvers.option_cache import similar_times
from solvers.options import ClassOptions, autograd_option, no_grad_forward, option_from_schedule
from solvers.schedule import Compute, Schedule

__all__ = ["MAX_OVERHEAD_DIFFERENCE", "structure_key", "twin_leads", "options_of_twin"]

# the compute nodes' fields that are measured costs (the rest is the graph's structure)
COST_FIELDS = frozenset({"time_s", "overhead_bytes", "no_grad_overhead_bytes", "handoff_overhead_bytes"})
# twins' times are alike as the option cache's are (:func:`solvers.option_cache.similar_times`:
# each operation's share of the class's time within 4x, those under 5% aside), and their
# temporary memories by at most this fraction of the lead's peak without recomputation
# (:func:`overhead_distance`)
MAX_OVERHEAD_DIFFERENCE = 0.05


def structure_key(graph: CDGraph) -> tuple:
    """What the plans of ``graph`` depend on but its measured costs: its nodes (every field of the
    compute nodes but :data:`COST_FIELDS`, every field of the data nodes, sizes included), in
    their order, and its inputs and outputs."""
    def fields(node, skip=frozenset()) -> tuple:
        return tuple(repr(getattr(node, f.name)) for f in dataclasses.fields(node) if f.name not in skip)

    return (tuple(fields(c, COST_FIELDS) for c in graph.compute_nodes), tuple(fields(d) for d in graph.data_nodes),
            tuple(tuple(getattr(graph, name)) for name in ("input_data", "input_grads", "output_data", "output_grads",
                                                           "side_data", "dropped_outputs")))


def overhead_distance(lead: CDGraph, other: CDGraph) -> int:
    """The sum over the nodes of the largest difference of their temporary memories (a
    forward's with and without grad, a backward's with and without the hand-off), in bytes."""
    return sum(max(abs(a.overhead(w) - b.overhead(w)) for w in (True, False)) if a.kind is ComputeKind.FORWARD
               else max(abs(a.backward_overhead(h) - b.backward_overhead(h)) for h in (True, False))
               for a, b in zip(lead.compute_nodes, other.compute_nodes))


def _close(lead: CDGraph, other: CDGraph) -> bool:
    """Whether the costs of two graphs of one structure are close enough to share a grid."""
    times = [tuple(node.time_s for node in graph.compute_nodes) for graph in (lead, other)]
    return similar_times(*times) and \
        overhead_distance(lead, other) <= MAX_OVERHEAD_DIFFERENCE * autograd_option(lead).peak_bytes


def twin_leads(graphs: dict[int, CDGraph]) -> dict[int, int]:
    """Each class index of ``graphs`` mapped to the class whose grid it shares: itself, or the
    first class (by index) of the same structure (:func:`structure_key`) whose costs are close."""
    leads: dict[tuple, list[int]] = {}
    shared: dict[int, int] = {}
    for index in sorted(graphs):
        candidates = leads.setdefault(structure_key(graphs[index]), [])
        lead = next((c for c in candidates if _close(graphs[c], graphs[index])), None)
        if lead is None:
            candidates.append(index)
            lead = index
        shared[index] = lead
    return shared


def options_of_twin(lead: ClassOptions, lead_index: int, graph: CDGraph) -> ClassOptions:
    """The options of ``graph``: the schedules of its twin's options (``lead``, of class
    ``lead_index``), each measured on ``graph`` itself; the dominated ones dropped."""
    options = []
    for option in lead.options:
        schedule = Schedule(list(option.forward_ops) + [Compute("loss")] + list(option.backward_ops))
        measured = option_from_schedule(graph, schedule, source=option.source)
        measured.time_limit_hit = option.time_limit_hit
        options.append(measured)
    note = f"the grid of its twin class {lead_index} (the same CD-graph but measured costs), measured on its own"
    return ClassOptions(graph=graph, options=pareto_front(options), no_grad=no_grad_forward(graph), notes=[note])
