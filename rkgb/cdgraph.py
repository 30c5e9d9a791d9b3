"""CD-graphs: compute nodes and data nodes of one block, and the chain of blocks.

The CD-graph is Rockmate's view of a block (Zhao et al., "Rockmate: an Efficient, Fast,
Automatic and Generic Tool for Re-materialization in PyTorch", ICML 2023, section 3): for each
simplified node ``x`` there are two compute nodes (``fwd_x``, ``bwd_x``) and three data nodes
(``x.data``, ``x.grad``, ``x.phantoms``). A single ``loss`` compute node separates the forward
from the backward: it reads the block's outputs and produces their gradients (for a block
inside a chain it stands for "everything after this block").

This module imports no torch: the solvers are written and tested on these types alone.

Semantics that the solvers, the simulator and the executor share
------------------------------------------------------------------
- ``Compute(fwd_x, with_grad=True)`` makes ``x.data`` and ``x.phantoms`` alive;
  ``with_grad=False`` makes only ``x.data`` alive. If ``x.data`` was already alive, the
  recomputation allocates a fresh copy while it runs (it counts twice during the op) and the old
  one is dropped when it ends.
- ``Compute(bwd_x)`` needs ``x.grad``, ``x.phantoms`` (when its size is non-zero) and the
  data nodes in ``needs``; it makes alive (or accumulates into) the grads in ``produces``.
  The autograd graph of ``x`` is consumed: ``x.phantoms`` must be forgotten afterwards.
- ``Forget(d)`` frees data node ``d``.
- Every compute node needs, while it runs, ``overhead_bytes`` of temporary memory on top of
  what is alive and of what it produces.
- ``needs_shape`` are fake edges: the compute node only reads the shape of these data nodes,
  which therefore need not be alive.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

__all__ = [
    "DataKind",
    "ComputeKind",
    "DataNode",
    "ComputeNode",
    "CDGraph",
    "CDGraphError",
    "BlockInstance",
    "ModelChain",
    "data_name",
    "compute_name",
]


class CDGraphError(ValueError):
    """An invariant of a CD-graph is broken; the message names the node and the rule."""


class DataKind(enum.Enum):
    DATA = "data"
    GRAD = "grad"
    PHANTOMS = "phantoms"


class ComputeKind(enum.Enum):
    FORWARD = "fwd"
    BACKWARD = "bwd"
    LOSS = "loss"


LOSS_NAME = "loss"


def data_name(target: str, kind: DataKind) -> str:
    """Name of the data node of kind ``kind`` of simplified node ``target``: ``"x.data"``."""
    return f"{target}.{kind.value}"


def compute_name(target: str, kind: ComputeKind) -> str:
    """Name of the compute node of kind ``kind`` of simplified node ``target``: ``"fwd_x"``."""
    if kind is ComputeKind.LOSS:
        return LOSS_NAME
    return f"{kind.value}_{target}"


@dataclass
class DataNode:
    """A tensor (or a set of tensors, for phantoms) that is alive or not at each step."""

    name: str
    kind: DataKind
    target: str  # the simplified node it belongs to
    size_bytes: int


@dataclass
class ComputeNode:
    """An operation of the schedule: a forward, a backward or the loss."""

    name: str
    kind: ComputeKind
    target: str  # the simplified node it computes ("loss" for the loss)
    time_s: float
    overhead_bytes: int  # temporary memory while it runs, beyond what is alive and its outputs
    needs: list[str] = field(default_factory=list)  # real edges: data nodes that must be alive
    needs_shape: list[str] = field(default_factory=list)  # fake edges: only the shape is read
    produces: list[str] = field(default_factory=list)  # data nodes it makes alive
    is_random: bool = False


@dataclass
class CDGraph:
    """The CD-graph of one block (or of a whole model).

    ``compute_nodes`` are in a valid execution order: the forwards in topological order, then
    the loss, then the backwards in reverse topological order. ``input_data`` are alive at the
    start and owned by whoever comes before (the previous block): they are never freed here.
    ``input_grads`` are produced by this graph's backwards for the previous block. The loss
    needs ``output_data`` and produces ``output_grads``.
    """

    name: str
    compute_nodes: list[ComputeNode]
    data_nodes: list[DataNode]
    input_data: list[str] = field(default_factory=list)
    input_grads: list[str] = field(default_factory=list)
    output_data: list[str] = field(default_factory=list)
    output_grads: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._compute = {node.name: node for node in self.compute_nodes}
        self._data = {node.name: node for node in self.data_nodes}

    # -- lookups -------------------------------------------------------------------------
    def compute(self, name: str) -> ComputeNode:
        return self._compute[name]

    def data(self, name: str) -> DataNode:
        return self._data[name]

    def has_data(self, name: str) -> bool:
        return name in self._data

    def has_compute(self, name: str) -> bool:
        return name in self._compute

    @property
    def loss(self) -> ComputeNode:
        return self._compute[LOSS_NAME]

    def forward_nodes(self) -> list[ComputeNode]:
        return [c for c in self.compute_nodes if c.kind is ComputeKind.FORWARD]

    def backward_nodes(self) -> list[ComputeNode]:
        return [c for c in self.compute_nodes if c.kind is ComputeKind.BACKWARD]

    def producers(self, data: str) -> list[ComputeNode]:
        return [c for c in self.compute_nodes if data in c.produces]

    def users(self, data: str) -> list[ComputeNode]:
        return [c for c in self.compute_nodes if data in c.needs]

    def size(self, data: str) -> int:
        return self._data[data].size_bytes

    # -- transformations -----------------------------------------------------------------
    def renamed(self, targets: dict[str, str], name: str | None = None) -> "CDGraph":
        """A copy where each simplified node name ``t`` becomes ``targets[t]`` (others kept)."""

        def rename_data(d: str) -> str:
            target, _, kind = d.rpartition(".")
            return f"{targets.get(target, target)}.{kind}"

        def rename_compute(c: ComputeNode) -> ComputeNode:
            target = targets.get(c.target, c.target)
            return dataclasses.replace(
                c,
                name=compute_name(target, c.kind),
                target=target,
                needs=[rename_data(d) for d in c.needs],
                needs_shape=[rename_data(d) for d in c.needs_shape],
                produces=[rename_data(d) for d in c.produces],
            )

        return CDGraph(
            name=name or self.name,
            compute_nodes=[rename_compute(c) for c in self.compute_nodes],
            data_nodes=[
                dataclasses.replace(d, name=rename_data(d.name), target=targets.get(d.target, d.target))
                for d in self.data_nodes
            ],
            input_data=[rename_data(d) for d in self.input_data],
            input_grads=[rename_data(d) for d in self.input_grads],
            output_data=[rename_data(d) for d in self.output_data],
            output_grads=[rename_data(d) for d in self.output_grads],
        )

    # -- invariants ----------------------------------------------------------------------
    def validate(self) -> None:
        """Check the invariants; raise :class:`CDGraphError` naming the node and the rule."""
        names = [c.name for c in self.compute_nodes] + [d.name for d in self.data_nodes]
        seen: set[str] = set()
        for n in names:
            if n in seen:
                raise CDGraphError(f"{self.name}: node {n!r} appears twice; names must be unique")
            seen.add(n)
        losses = [c for c in self.compute_nodes if c.kind is ComputeKind.LOSS]
        if len(losses) != 1:
            raise CDGraphError(f"{self.name}: expected exactly one loss node, found {len(losses)}")
        for d in self.data_nodes:
            if d.size_bytes < 0:
                raise CDGraphError(f"{self.name}: data node {d.name!r} has a negative size")
            if d.name != data_name(d.target, d.kind):
                raise CDGraphError(
                    f"{self.name}: data node {d.name!r} should be named {data_name(d.target, d.kind)!r}"
                )
        for c in self.compute_nodes:
            if c.overhead_bytes < 0 or c.time_s < 0:
                raise CDGraphError(f"{self.name}: compute node {c.name!r} has a negative cost")
            for d in c.needs + c.needs_shape + c.produces:
                if d not in self._data:
                    raise CDGraphError(
                        f"{self.name}: compute node {c.name!r} refers to unknown data node {d!r}"
                    )
        for d in self.input_data + self.input_grads + self.output_data + self.output_grads:
            if d not in self._data:
                raise CDGraphError(f"{self.name}: interface data node {d!r} is not in the graph")
        for d in self.input_data:
            if self.producers(d):
                raise CDGraphError(f"{self.name}: input data {d!r} must not be produced inside the block")
        # a valid order: every real need is produced earlier (or is an input)
        alive_ever = set(self.input_data)
        loss_seen = False
        for c in self.compute_nodes:
            if c.kind is ComputeKind.LOSS:
                loss_seen = True
            elif c.kind is ComputeKind.FORWARD and loss_seen:
                raise CDGraphError(f"{self.name}: forward node {c.name!r} comes after the loss")
            elif c.kind is ComputeKind.BACKWARD and not loss_seen:
                raise CDGraphError(f"{self.name}: backward node {c.name!r} comes before the loss")
            for d in c.needs:
                if d not in alive_ever:
                    raise CDGraphError(
                        f"{self.name}: {c.name!r} needs {d!r}, which nothing before it produces; "
                        "the compute nodes must be listed in a valid execution order"
                    )
            alive_ever.update(c.produces)
        for d in self.input_grads:
            if not self.producers(d):
                raise CDGraphError(f"{self.name}: input grad {d!r} is produced by no backward node")


@dataclass
class BlockInstance:
    """One block of the chain: which class it belongs to and how its nodes are named.

    ``names`` maps the class's anonymized simplified-node names to this block's real names.
    """

    index: int
    class_index: int
    names: dict[str, str]


@dataclass
class ModelChain:
    """The chain of blocks of a model, with one CD-graph per class of identical blocks."""

    classes: list[CDGraph]
    blocks: list[BlockInstance]

    def block_graph(self, index: int) -> CDGraph:
        """The CD-graph of block ``index`` with its real node names."""
        block = self.blocks[index]
        return self.classes[block.class_index].renamed(block.names, name=f"block{index}")

    def whole_graph(self) -> CDGraph:
        """The CD-graph of the whole model: the blocks' graphs concatenated, one loss at the end.

        The loss of block ``i < last`` is dropped; block ``i``'s output data are block
        ``i+1``'s input data, and block ``i+1``'s backwards produce block ``i``'s output grads.
        """
        graphs = [self.block_graph(i) for i in range(len(self.blocks))]
        forwards: list[ComputeNode] = []
        backwards: list[ComputeNode] = []
        data: dict[str, DataNode] = {}
        for g in graphs:
            forwards += g.forward_nodes()
            backwards = g.backward_nodes() + backwards
            for d in g.data_nodes:
                data.setdefault(d.name, d)
        last = graphs[-1]
        return CDGraph(
            name="model",
            compute_nodes=forwards + [last.loss] + backwards,
            data_nodes=list(data.values()),
            input_data=list(graphs[0].input_data),
            input_grads=list(graphs[0].input_grads),
            output_data=list(last.output_data),
            output_grads=list(last.output_grads),
        )
