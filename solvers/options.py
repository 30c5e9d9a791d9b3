"""Block options: what a block keeps between its forward and its backward, and what it costs.

An option (Zhao et al., Rockmate, ICML 2023, section 4) is one schedule of a block's CD-graph,
split at the loss: ``forward_ops`` run when the chain's forward reaches the block, and
``backward_ops`` when the backward comes back to it. Its figures are measured by the simulator
on the class graph, counting only the block's own data (its input data belong to the block
before it):

- ``forward_peak_bytes``: peak during ``forward_ops``;
- ``saved_bytes``: alive after ``forward_ops`` (what the block keeps for its backward, its
  output data included);
- ``backward_peak_bytes``: peak during ``backward_ops``, which start with the saved data and
  the block's output grads alive;
- ``end_bytes``: alive after ``backward_ops`` (the input grads; plus the output data for the
  model's last block, whose outputs the user keeps).

Also here: the forward without grad that keeps only the output (Rotor's "keep nothing" case),
the autograd option (no recomputation, everything the backward reads is kept) and the renaming
of class operations to a block's real names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rkgb.cdgraph import CDGraph, ComputeKind, ModelChain, compute_name, renamed_data
from solvers.schedule import Compute, Forget, Operation, Schedule
from solvers.simulate import schedule_from_computes, simulate

__all__ = [
    "PhaseFigures",
    "BlockOption",
    "NoGradForward",
    "ClassOptions",
    "option_from_computes",
    "option_from_schedule",
    "autograd_option",
    "no_grad_forward",
    "with_outputs_kept",
    "rename_operation",
    "rename_operations",
]


class PhaseFigures:
    """An option's peak and time from its two phases' figures (``forward_peak_bytes``,
    ``backward_peak_bytes``, ``forward_time_s``, ``backward_time_s``): :class:`BlockOption`'s,
    and the repairs' figures of a sequence (:class:`solvers.stage_figures.SequenceFigures`)."""

    @property
    def peak_bytes(self) -> int:
        return max(self.forward_peak_bytes, self.backward_peak_bytes)

    @property
    def time_s(self) -> float:
        return self.forward_time_s + self.backward_time_s


@dataclass
class BlockOption(PhaseFigures):
    """One way to run a block: forward ops, backward ops (class-graph names) and their costs."""

    forward_ops: list[Operation]
    backward_ops: list[Operation]
    saved_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    forward_time_s: float
    backward_time_s: float
    end_bytes: int = 0
    source: str = ""
    time_limit_hit: bool = False

    def key(self) -> tuple:
        """Figures that decide the DP (two options with equal keys are interchangeable)."""
        return (
            self.forward_peak_bytes,
            self.backward_peak_bytes,
            self.saved_bytes,
            self.end_bytes,
            round(self.forward_time_s, 15),
            round(self.backward_time_s, 15),
        )

    def dominates(self, other: "BlockOption") -> bool:
        """No worse than ``other`` in every figure (time, peaks, saved)."""
        eps = 1e-12 * max(1.0, other.time_s)
        return (
            self.forward_peak_bytes <= other.forward_peak_bytes
            and self.backward_peak_bytes <= other.backward_peak_bytes
            and self.saved_bytes <= other.saved_bytes
            and self.end_bytes <= other.end_bytes
            and self.forward_time_s + self.backward_time_s <= other.forward_time_s + other.backward_time_s + eps
        )


@dataclass
class NoGradForward:
    """The block's forward without grad keeping only its output: Rotor's "keep nothing"."""

    ops: list[Operation]
    peak_bytes: int
    time_s: float
    output_bytes: int


@dataclass
class ClassOptions:
    """The options of one class, the variants for the model's last block and its no-grad forward."""

    graph: CDGraph
    options: list[BlockOption]
    no_grad: NoGradForward
    solve_time_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def option_from_schedule(
    graph: CDGraph, schedule: Schedule, *, keep_outputs: bool = False, source: str = ""
) -> BlockOption:
    """Measure ``schedule`` (a whole fwd + loss + bwd schedule of ``graph``) as an option."""
    result = simulate(graph, schedule, keep_outputs=keep_outputs)
    loss = schedule.loss_index
    return BlockOption(
        forward_ops=list(schedule.ops[:loss]),
        backward_ops=list(schedule.ops[loss + 1 :]),
        saved_bytes=result.saved_bytes,
        forward_peak_bytes=result.forward_peak_bytes,
        backward_peak_bytes=result.backward_peak_bytes,
        forward_time_s=result.forward_time_s,
        backward_time_s=result.backward_time_s,
        end_bytes=result.memory_at_end,
        source=source,
    )


def option_from_computes(
    graph: CDGraph, computes: list[str], *, keep_outputs: bool = False, source: str = ""
) -> BlockOption:
    """The option running ``computes`` (loss included) with the fewest bytes alive."""
    protected = set(graph.input_grads) | (set(graph.output_data) if keep_outputs else set())
    schedule = schedule_from_computes(graph, computes, protected=protected)
    return option_from_schedule(graph, schedule, keep_outputs=keep_outputs, source=source)


def autograd_option(graph: CDGraph, *, keep_outputs: bool = False) -> BlockOption:
    """No recomputation: every forward once with grad, then the loss, then every backward.

    What PyTorch's autograd does; the option Rotor calls "keep everything".
    """
    computes = [c.name for c in graph.compute_nodes]
    return option_from_computes(graph, computes, keep_outputs=keep_outputs, source="autograd")


def no_grad_forward(graph: CDGraph) -> NoGradForward:
    """Every forward without grad, each data forgotten after its last use but the outputs."""
    computes = [c.name for c in graph.forward_nodes()]
    protected = set(graph.output_data)
    schedule = schedule_from_computes(graph, computes, protected=protected, keep_at_end=protected)
    ops = [Compute(op.node, False) if isinstance(op, Compute) else op for op in schedule.ops]
    result = simulate(graph, ops, keep_outputs=False)
    return NoGradForward(
        ops=ops,
        peak_bytes=result.peak_bytes,
        time_s=result.time_s,
        output_bytes=sum(graph.size(d) for d in graph.output_data),
    )


def with_outputs_kept(graph: CDGraph, option: BlockOption, outputs: set[str] | None = None) -> BlockOption:
    """The variant of ``option`` for a block that makes model outputs: ``outputs`` (all of
    the graph's for the model's last block) are never forgotten (the user holds them)."""
    outputs = set(graph.output_data) if outputs is None else outputs
    forward = [op for op in option.forward_ops if not (isinstance(op, Forget) and op.node in outputs)]
    backward = [op for op in option.backward_ops if not (isinstance(op, Forget) and op.node in outputs)]
    schedule = Schedule(forward + [Compute("loss")] + backward)
    if outputs != set(graph.output_data):
        graph = dataclasses.replace(graph, output_data=[d for d in graph.output_data if d in outputs])
    kept = option_from_schedule(graph, schedule, keep_outputs=True, source=option.source)
    kept.time_limit_hit = option.time_limit_hit
    return kept


def rename_operation(graph: CDGraph, op: Operation, names: dict[str, str]) -> Operation:
    """``op`` of class graph ``graph`` with the simplified-node names of a block (``names``)."""
    if isinstance(op, Forget):
        return Forget(renamed_data(op.node, names))
    node = graph.compute(op.node)
    if node.kind is ComputeKind.LOSS:
        return op
    return Compute(compute_name(names.get(node.target, node.target), node.kind), op.with_grad)


def rename_operations(graph: CDGraph, ops: list[Operation], names: dict[str, str]) -> list[Operation]:
    return [rename_operation(graph, op, names) for op in ops]


def block_names(chain: ModelChain, index: int) -> dict[str, str]:
    return chain.blocks[index].names
