"""One simulator for every schedule: validity, peak memory and time on a CD-graph.

The simulator is the single source of truth of the solvers: every solver builds a schedule,
replays it here, and reports the peak and time measured here (as Checkmate does with its
``Scheduler``; Jain et al., "Checkmate: Breaking the Memory Wall with Optimal Tensor
Rematerialization", MLSys 2020). The memory model is the one of ``rkgb.cdgraph``:

- the memory is the sum of the sizes of the alive data nodes, except ``graph.input_data``
  (owned by whoever runs before: the user for a model, the previous block for a block);
- while a compute node runs, the memory also holds its ``overhead_bytes`` and every data node
  it produces, counted in full even when that node is already alive (a recomputation or a
  gradient accumulation holds the old and the new copy until the operation ends);
- ``Compute(fwd_x, with_grad=False)`` produces no phantoms;
- ``bwd_x`` needs, besides its ``needs``, ``x.grad`` and ``x.phantoms`` (when those nodes
  exist), and consumes the phantoms: they cannot serve another backward;
- a backward node and the loss run at most once (running a backward twice would accumulate
  its gradients twice).

This module also holds :func:`schedule_from_computes`, which turns a sequence of compute
nodes into a schedule with the fewest bytes alive at every step (forget right after the last
use, phantoms only when a backward will read them). Every solver builds its schedules with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rkgb.cdgraph import CDGraph, ComputeKind, ComputeNode, DataKind, data_name
from solvers.schedule import Compute, Forget, Operation, Schedule

__all__ = [
    "InvalidSchedule",
    "SimulationResult",
    "simulate",
    "effective_needs",
    "operation_outputs",
    "phantoms_of",
    "schedule_from_computes",
]


class InvalidSchedule(ValueError):
    """A schedule breaks the execution semantics; the message names the operation and the rule."""


@dataclass
class SimulationResult:
    """What a replay measures.

    ``memory_during[i]`` is the memory while operation ``i`` runs (for a ``Forget``, the memory
    after it). ``alive_after_forward`` is the set alive just before the loss (``None`` when
    the schedule has no loss) and ``saved_bytes`` its size.
    """

    peak_bytes: int
    time_s: float
    memory_during: list[int]
    alive_at_end: set[str]
    saved_bytes: int = 0
    alive_after_forward: set[str] | None = None
    forward_peak_bytes: int = 0
    backward_peak_bytes: int = 0
    forward_time_s: float = 0.0
    backward_time_s: float = 0.0
    peak_index: int = -1
    notes: list[str] = field(default_factory=list)


def phantoms_of(graph: CDGraph, node: ComputeNode) -> str | None:
    """Name of the phantoms data node of a forward or backward node, or None if it has none."""
    name = data_name(node.target, DataKind.PHANTOMS)
    return name if graph.has_data(name) else None


def effective_needs(graph: CDGraph, node: ComputeNode) -> list[str]:
    """The data nodes that must be alive while ``node`` runs (its ``needs``, plus a backward's
    own gradient and phantoms)."""
    needs = list(node.needs)
    if node.kind is ComputeKind.BACKWARD:
        for extra in (data_name(node.target, DataKind.GRAD), phantoms_of(graph, node)):
            if extra is not None and graph.has_data(extra) and extra not in needs:
                needs.append(extra)
    return needs


def operation_outputs(graph: CDGraph, node: ComputeNode, with_grad: bool = True) -> list[str]:
    """The data nodes that ``Compute(node, with_grad)`` makes alive."""
    outputs = [d for d in node.produces if graph.data(d).kind is not DataKind.PHANTOMS]
    if node.kind is ComputeKind.FORWARD and with_grad:
        phantoms = phantoms_of(graph, node)
        if phantoms is not None:
            outputs.append(phantoms)
    return outputs


def simulate(
    graph: CDGraph,
    schedule: Schedule | list[Operation],
    *,
    keep_outputs: bool = True,
    initially_alive: set[str] | None = None,
) -> SimulationResult:
    """Replay ``schedule`` on ``graph``; return its peak memory and time.

    Parameters
    ----------
    graph
        The CD-graph whose node names the schedule uses (a class graph or a whole model's).
    schedule
        The operations to replay.
    keep_outputs
        When True (a whole model), ``graph.output_data`` and ``graph.output_grads`` may never be
        forgotten: the user holds the model's outputs, and the autograd engine holds their
        gradients until the compiled module's backward returns. Block options are simulated with False.
    initially_alive
        Data nodes alive at the start besides ``graph.input_data`` (counted in the memory).

    Returns
    -------
    SimulationResult

    Raises
    ------
    InvalidSchedule
        naming the operation: an unknown node, a compute whose input is not alive (use after
        free), a forget of a dead node (double free), of an input, of a kept output, a backward
        or loss run twice, a backward reading consumed phantoms, a gradient accumulated into
        after it was forgotten.
    """
    ops = schedule.ops if isinstance(schedule, Schedule) else list(schedule)
    inputs = set(graph.input_data)
    # the user holds the outputs, and autograd holds their gradients until the backward ends
    protected = set(inputs) | (set(graph.output_data) | set(graph.output_grads) if keep_outputs else set())
    alive: set[str] = set(inputs) | set(initially_alive or ())
    consumed: set[str] = set()
    forgotten_grads: set[str] = set()
    ran_once: set[str] = set()
    memory = sum(graph.size(d) for d in alive if d not in inputs)
    peak = memory
    peak_index = -1
    time_s = 0.0
    memory_during: list[int] = []
    alive_after_forward: set[str] | None = None
    saved = 0
    forward_peak = memory
    backward_peak = 0
    forward_time = backward_time = 0.0
    after_loss = False

    def where(i: int, op: Operation) -> str:
        return f"operation {i} ({op})"

    for i, op in enumerate(ops):
        if isinstance(op, Forget):
            if not graph.has_data(op.node):
                raise InvalidSchedule(f"{where(i, op)}: unknown data node {op.node!r}")
            if op.node not in alive:
                raise InvalidSchedule(
                    f"{where(i, op)}: {op.node!r} is not alive (double free, or never computed)"
                )
            if op.node in protected:
                what = "an input of the graph" if op.node in inputs else "a model output, held by the user"
                raise InvalidSchedule(f"{where(i, op)}: {op.node!r} is {what} and cannot be forgotten")
            alive.discard(op.node)
            consumed.discard(op.node)
            if graph.data(op.node).kind is DataKind.GRAD:
                forgotten_grads.add(op.node)
            memory -= graph.size(op.node)
            memory_during.append(memory)
            continue
        if not isinstance(op, Compute):
            raise InvalidSchedule(f"{where(i, op)}: not a Compute or a Forget")
        if not graph.has_compute(op.node):
            raise InvalidSchedule(f"{where(i, op)}: unknown compute node {op.node!r}")
        node = graph.compute(op.node)
        if node.kind is not ComputeKind.FORWARD:
            if node.name in ran_once:
                raise InvalidSchedule(
                    f"{where(i, op)}: {node.name!r} already ran; a backward or the loss runs once"
                )
            ran_once.add(node.name)
        if node.kind is ComputeKind.LOSS:
            if after_loss:
                raise InvalidSchedule(f"{where(i, op)}: second loss")
            alive_after_forward = set(alive)
            saved = memory
            after_loss = True
        for d in effective_needs(graph, node):
            if d not in alive:
                raise InvalidSchedule(
                    f"{where(i, op)}: needs {d!r}, which is not alive (use after free, or "
                    "never computed); compute it earlier or forget it later"
                )
            if d in consumed:
                raise InvalidSchedule(
                    f"{where(i, op)}: phantoms {d!r} were consumed by an earlier backward; "
                    "recompute the forward with grad first"
                )
        outputs = operation_outputs(graph, node, op.with_grad)
        for d in outputs:
            if d in forgotten_grads:
                raise InvalidSchedule(
                    f"{where(i, op)}: accumulates into gradient {d!r}, which was forgotten "
                    "after an earlier contribution (that contribution would be lost)"
                )
        during = memory + node.overhead_bytes + sum(graph.size(d) for d in outputs)
        memory_during.append(during)
        if during > peak:
            peak, peak_index = during, i
        if node.kind is ComputeKind.FORWARD and not after_loss:
            forward_peak = max(forward_peak, during)
            forward_time += node.time_s
        elif node.kind is ComputeKind.BACKWARD:
            backward_peak = max(backward_peak, during)
            backward_time += node.time_s
        elif node.kind is ComputeKind.FORWARD:
            backward_peak = max(backward_peak, during)
            backward_time += node.time_s
        time_s += node.time_s
        for d in outputs:
            consumed.discard(d)
            if d not in alive:
                alive.add(d)
                memory += graph.size(d)
        if node.kind is ComputeKind.BACKWARD:
            phantoms = phantoms_of(graph, node)
            if phantoms is not None:
                consumed.add(phantoms)
    return SimulationResult(
        peak_bytes=peak,
        time_s=time_s,
        memory_during=memory_during,
        alive_at_end=alive,
        saved_bytes=saved,
        alive_after_forward=alive_after_forward,
        forward_peak_bytes=forward_peak,
        backward_peak_bytes=backward_peak,
        forward_time_s=forward_time,
        backward_time_s=backward_time,
        peak_index=peak_index,
    )


def schedule_from_computes(
    graph: CDGraph,
    computes: list[str],
    *,
    protected: set[str] | None = None,
    initially_alive: set[str] | None = None,
    keep_at_end: set[str] | None = None,
) -> Schedule:
    """The schedule running ``computes`` in order with the fewest bytes alive at every step.

    A data node is forgotten right after the operation where its next event is not a use (its
    last use, or its production when nothing reads it before it is produced again); a forward
    keeps its phantoms (``with_grad=True``) only when a backward reads them before the forward
    runs again. For a fixed sequence of computes this is pointwise minimal in memory, so the
    peak and the memory saved across the loss are both the smallest possible; the ILP searches
    sequences of computes only and relies on this.

    Parameters
    ----------
    protected
        Data nodes never forgotten (besides ``graph.input_data``).
    initially_alive
        Data nodes alive at the start besides the inputs.
    keep_at_end
        Data nodes that must stay alive after the last compute.
    """
    protected = set(graph.input_data) | set(protected or ())
    keep_at_end = set(keep_at_end or ())
    nodes = [graph.compute(name) for name in computes]
    # next event of each data node after position i: "use", "produce" or None
    events: dict[str, list[tuple[int, str]]] = {}
    for i, node in enumerate(nodes):
        for d in effective_needs(graph, node):
            events.setdefault(d, []).append((i, "use"))
        for d in operation_outputs(graph, node, True):
            events.setdefault(d, []).append((i, "produce"))

    def next_event(d: str, after: int) -> str | None:
        for position, kind in events.get(d, ()):
            if position > after:
                if kind == "produce" and graph.data(d).kind is DataKind.GRAD:
                    return "use"  # a gradient accumulates: it must stay alive until its last use
                return kind
        return "use" if d in keep_at_end else None

    ops: list[Operation] = []
    alive: set[str] = set(graph.input_data) | set(initially_alive or ())
    for d in sorted(alive - protected):
        if next_event(d, -1) != "use":
            ops.append(Forget(d))
            alive.discard(d)
    for i, node in enumerate(nodes):
        with_grad = True
        if node.kind is ComputeKind.FORWARD:
            phantoms = phantoms_of(graph, node)
            with_grad = phantoms is not None and next_event(phantoms, i) == "use"
        ops.append(Compute(node.name, with_grad))
        alive.update(operation_outputs(graph, node, with_grad))
        touched = effective_needs(graph, node) + operation_outputs(graph, node, with_grad)
        for d in touched:
            if d in alive and d not in protected and next_event(d, i) != "use":
                ops.append(Forget(d))
                alive.discard(d)
    return Schedule(ops)
