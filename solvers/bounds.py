"""A lower bound on the peak memory of every schedule of a CD-graph: the operation floor.

Whatever a solver recomputes, every compute node of the graph runs at least once (the loss and
the backwards exactly once, in the graph's order, each forward at least once before the
backwards read it), and while one runs, the memory holds at least the data it reads, what it
produces and its temporary memory. A backward (or the loss) also runs with the gradients alive
at that point of the backward: they are made by backwards only, in a fixed order, and cannot
be recomputed, so their memory is the same in every schedule
(:func:`solvers.simulate.gradient_profile`). The largest of these over the graph is a floor
under the minimum budget of every solver that runs the graph's operations as they are (out of
place, as eager PyTorch does) with the backwards in eager's order: Rockmate, Rotor and
whole-graph Checkmate (Jain et al., MLSys 2020) alike. Comparing a solver's ``min_budget``
with the floor bounds how far it is from the best possible minimum; comparing the floor with
another solver's minimum bounds the best ratio any such plan can reach.

With ``keep_outputs`` (a whole model's graph), the model's outputs are alive from the loss on
(the user holds them), as :func:`solvers.simulate.simulate` has it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rkgb.cdgraph import CDGraph, ComputeKind
from solvers.schedule import Compute
from solvers.simulate import effective_needs, gradient_profile, operation_outputs, simulate

__all__ = ["OperationFloor", "operation_floor"]


@dataclass(frozen=True)
class OperationFloor:
    """The floor (bytes) and the compute node that sets it."""

    bytes: int
    node: str


def _alone(graph: CDGraph, name: str, alive: set[str], with_grad: bool) -> int:
    """Peak of ``Compute(name)`` run alone with ``alive`` (besides the graph's inputs) alive."""
    return simulate(graph, [Compute(name, with_grad=with_grad)], keep_outputs=False,
                    initially_alive=alive).peak_bytes


def operation_floor(graph: CDGraph, keep_outputs: bool = True) -> OperationFloor:
    """The largest memory one operation of ``graph`` needs in any schedule (a lower bound).

    A forward node counts its cheaper mode (with or without grad) with only its inputs alive.
    The loss and a backward node count the forward data they read, the gradients alive at
    their point of the backward and what they add, their temporary memory, and with
    ``keep_outputs`` the model's outputs.
    """
    nodes = graph.compute_nodes
    inputs = set(graph.input_data)
    held = set(graph.held_outputs) - inputs if keep_outputs else set()
    protected = set(graph.input_grads) | held
    grad_start, grad_added, _, grad_overhead = gradient_profile(graph, protected)
    made_by_forward = {d for c in nodes if c.kind is ComputeKind.FORWARD for d in operation_outputs(graph, c, True)}
    best = OperationFloor(0, "")
    for t, node in enumerate(nodes):
        if node.kind is ComputeKind.FORWARD:
            alive = set(effective_needs(graph, node)) - inputs
            need = min(_alone(graph, node.name, alive, with_grad) for with_grad in (False, True))
        else:
            forward_data = (set(effective_needs(graph, node)) & made_by_forward) | held
            need = (grad_start[t] + grad_added[t] + grad_overhead[t]
                    + sum(graph.size(d) for d in forward_data - inputs))
        if need > best.bytes:
            best = OperationFloor(need, node.name)
    return best
