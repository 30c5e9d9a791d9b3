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
- A gradient is one tensor per tensor of the node that other nodes read (its *parts*,
  ``DataNode.parts``: a ``split`` into q, k, v has three); a backward contributes to all the
  parts of each gradient it produces, or to those in ``contributes`` (once per contribution:
  a node that reads a tensor twice contributes to its gradient twice). Each part is
  accumulated as the executor does (as autograd's ``InputBuffer``): its first contribution is
  kept as it is; a later one waits until the next compute node starts (after the forgets that
  follow its backward), then is added in place into the part if nothing else holds the part's
  storage, into a new tensor (``old + grad``) otherwise (:mod:`solvers.simulate`).
- ``aliases[g][i] = j`` on ``bwd_x``: the contribution to part ``i`` of gradient ``g`` is part
  ``j`` of ``x.grad`` itself (``-1``: a new tensor). An ``add``'s backward passes its
  incoming gradient to both of its inputs, a ``clone``'s or a reshape's passes it (or a view of
  it) on. Both then share one storage, counted once while either holds it. Where a part gets
  contributions of both kinds (``h - h``: the first read's gradient is the incoming one, the
  second a new tensor), ``contribution_aliases[g]`` gives the ``j`` of each contribution, in
  the order of ``contributes[g]``.
- ``shared[g]`` on ``bwd_x``: parts of ``g`` whose first contribution shares its storage with
  another tensor that lives on (a view of a bigger result of the backward): as eager's buffer,
  the executor does not add the next contribution into it in place but makes a new sum.
- ``Forget(d)`` frees data node ``d`` (its storages, but those an alias still holds).
- Every compute node needs, while it runs, ``overhead_bytes`` of temporary memory on top of
  what is alive and of what it produces; a forward run without grad needs
  ``no_grad_overhead_bytes`` instead (when set): it does not keep its phantoms, but it may
  allocate them, or other temporaries, while it runs.
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
    "FirstRun",
    "input_grad_key",
    "input_views_key",
    "parameter_sum_key",
    "parameter_sums",
    "views_key_input",
    "BlockInstance",
    "ModelChain",
    "data_name",
    "compute_name",
    "renamed_data",
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


def renamed_data(name: str, targets: dict[str, str]) -> str:
    """Data node ``name`` (``"x.grad"``) with its simplified node renamed by ``targets`` (a
    block's names: a class graph's node in that block)."""
    target, _, kind = name.rpartition(".")
    return f"{targets.get(target, target)}.{kind}"


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
    parts: tuple[int, ...] = ()  # sizes of its tensors when it is several (a gradient)

    @property
    def part_sizes(self) -> tuple[int, ...]:
        """The sizes of its tensors: ``parts``, or one tensor of ``size_bytes``."""
        return self.parts or (self.size_bytes,)


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
    # gradient produced -> the parts of it this backward contributes to, each once per
    # contribution (a node reading a part twice contributes to it twice) (absent: all, once)
    contributes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # gradient produced -> for each of its parts, the part of the node's own gradient that its
    # first contribution is (-1: a new tensor)
    aliases: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # gradient produced -> the parts whose first contribution, if made here, shares its storage
    # with another tensor (a view of a bigger result): a later one joins as a new sum
    shared: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # gradient produced -> those of ``shared`` whose storage is freed with the gradient all the
    # same (a view of a result of its own size: a transpose's gradient): the engine frees it once
    # used (solvers.simulate's hand-off)
    owned: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # gradient produced -> for each of its parts, the group of this backward's new storages its
    # contribution is a view of (-1: none): the slices of one tensor made here (a `cat`'s
    # gradient) that several gradients' parts receive hold one storage between them
    together: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # (bytes, whole) of each of those storages; whole: the contributions are its one dense tensor
    # itself (an engine's sum passed to several), into which a later contribution is added in
    # place once nothing else holds it
    together_storages: tuple[tuple[int, bool], ...] = ()
    # where a part of a gradient gets contributions of both kinds from this backward (``h - h``:
    # the first read's gradient is the incoming one, the second a new tensor): per contribution,
    # in the order of ``contributes``, the part of the backward's own gradient it is (-1: a new
    # tensor); these gradients' entries of ``aliases`` then do not apply
    contribution_aliases: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # temporary memory of a forward run without grad (None: ``overhead_bytes``)
    no_grad_overhead_bytes: int | None = None
    # ``aliases`` of the block's input gradient that the block's own figures count as new
    # tensors (rkgb.build._drop_lasting_aliases) and the whole model's graph keeps, where that
    # gradient is an inner data node (ModelChain.whole_graph)
    boundary_aliases: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # a backward's temporary memory when the engine alone holds its incoming gradient (the
    # executor hands it over, rkgb.gradsink.handoff) and frees it once its first autograd node
    # has used it, as eager's engine does; may be negative (down to minus that gradient's
    # bytes). None: the same as ``overhead_bytes``. The simulator uses it where the gradient's
    # storage has no other holder (solvers.simulate)
    handoff_overhead_bytes: int | None = None
    # a backward that runs only where the step gives a gradient to an output that the model's
    # loss does not reach (``rkgb.simplify.SimplifiedGraph.outputs_with_optional_gradient``): a
    # sum it makes is taken to keep what the gradient was before it (shared, or not a dense
    # tensor of its own), as a step without it keeps that gradient (solvers.simulate)
    optional: bool = False

    def overhead(self, with_grad: bool = True) -> int:
        """Temporary memory while it runs (a forward's depends on ``with_grad``)."""
        if not with_grad and self.no_grad_overhead_bytes is not None:
            return self.no_grad_overhead_bytes
        return self.overhead_bytes

    def backward_overhead(self, handed_off: bool) -> int:
        """A backward's temporary memory: ``handoff_overhead_bytes`` where its incoming gradient
        is the engine's alone (``handed_off``), else ``overhead_bytes``."""
        if handed_off and self.handoff_overhead_bytes is not None:
            return self.handoff_overhead_bytes
        return self.overhead_bytes


@dataclass
class CDGraph:
    """The CD-graph of one block (or of a whole model).

    ``compute_nodes`` are in a valid execution order: the forwards in topological order, then
    the loss, then the backwards in reverse topological order. ``input_data`` are alive at the
    start and owned by whoever comes before (the previous block): they are never freed here.
    ``input_grads`` are produced by this graph's backwards for the previous block. The loss
    needs ``output_data`` and produces ``output_grads``. ``side_data``: the input data that are
    side inputs (tensors of earlier blocks besides the chain's input, ``rkgb.blocks``), which
    the chain keeps alive for later blocks too. ``dropped_outputs`` (a whole model's): those of
    ``output_data`` that the training step drops once the forward has returned them (it keeps
    the model's loss alone: ``ModelChain.dropped_outputs``), which the user does not hold to the
    step's end (:attr:`held_outputs` are the others).
    """

    name: str
    compute_nodes: list[ComputeNode]
    data_nodes: list[DataNode]
    input_data: list[str] = field(default_factory=list)
    input_grads: list[str] = field(default_factory=list)
    output_data: list[str] = field(default_factory=list)
    output_grads: list[str] = field(default_factory=list)
    side_data: list[str] = field(default_factory=list)
    dropped_outputs: list[str] = field(default_factory=list)

    @property
    def held_outputs(self) -> list[str]:
        """The outputs that the user holds to the end of the step (a whole model's graph: they
        are never forgotten)."""
        return [d for d in self.output_data if d not in self.dropped_outputs]

    @property
    def chain_input_data(self) -> list[str]:
        """The input data but the side inputs: what the previous block's output is."""
        return [d for d in self.input_data if d not in self.side_data]

    def __post_init__(self) -> None:
        self._compute = {node.name: node for node in self.compute_nodes}
        self._data = {node.name: node for node in self.data_nodes}

    def __getstate__(self) -> dict:
        # (the simulator's memo of needs and outputs, solvers.simulate._memoized, is keyed by
        # the nodes' identities: not worth keeping)
        return {key: value for key, value in self.__dict__.items() if key != "_structure_memo"}

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
            return renamed_data(d, targets)

        def rename_compute(c: ComputeNode) -> ComputeNode:
            target = targets.get(c.target, c.target)
            return dataclasses.replace(
                c,
                name=compute_name(target, c.kind),
                target=target,
                needs=[rename_data(d) for d in c.needs],
                needs_shape=[rename_data(d) for d in c.needs_shape],
                produces=[rename_data(d) for d in c.produces],
                contributes={rename_data(g): v for g, v in c.contributes.items()},
                aliases={rename_data(g): v for g, v in c.aliases.items()},
                contribution_aliases={rename_data(g): v for g, v in c.contribution_aliases.items()},
                shared={rename_data(g): v for g, v in c.shared.items()},
                owned={rename_data(g): v for g, v in c.owned.items()},
                together={rename_data(g): v for g, v in c.together.items()},
                boundary_aliases={rename_data(g): v for g, v in c.boundary_aliases.items()},
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
            side_data=[rename_data(d) for d in self.side_data],
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
            if d.parts and (sum(d.parts) != d.size_bytes or min(d.parts) < 0):
                raise CDGraphError(f"{self.name}: the parts of {d.name!r} do not add up to its size")
            if d.name != data_name(d.target, d.kind):
                raise CDGraphError(
                    f"{self.name}: data node {d.name!r} should be named {data_name(d.target, d.kind)!r}"
                )
        for c in self.compute_nodes:
            if c.overhead_bytes < 0 or c.time_s < 0 or (c.no_grad_overhead_bytes or 0) < 0:
                raise CDGraphError(f"{self.name}: compute node {c.name!r} has a negative cost")
            own = self._data.get(data_name(c.target, DataKind.GRAD))
            for table in (c.contributes, c.aliases, c.shared, c.together, c.contribution_aliases):
                for g in table:
                    if g not in c.produces or g not in self._data or self._data[g].kind is not DataKind.GRAD:
                        raise CDGraphError(
                            f"{self.name}: {c.name!r} declares parts of {g!r}, which is not a "
                            "gradient it produces"
                        )
            for g, indices in c.contributes.items():
                count = len(self._data[g].part_sizes)
                if not all(0 <= i < count for i in indices):
                    raise CDGraphError(
                        f"{self.name}: {c.name!r} contributes to parts {indices} of {g!r}, which has {count}"
                    )
            for g, sources in c.aliases.items():
                if (
                    c.kind is not ComputeKind.BACKWARD
                    or own is None
                    or len(sources) != len(self._data[g].part_sizes)
                    or not all(-1 <= j < len(own.part_sizes) for j in sources)
                ):
                    raise CDGraphError(
                        f"{self.name}: {c.name!r} declares the parts of {g!r} aliases of {sources}; "
                        "an alias is a part of the backward's own gradient, one entry per part"
                    )
            for g, sources in c.contribution_aliases.items():
                if (
                    c.kind is not ComputeKind.BACKWARD
                    or own is None
                    or g not in c.contributes
                    or len(sources) != len(c.contributes[g])
                    or not all(-1 <= j < len(own.part_sizes) for j in sources)
                ):
                    raise CDGraphError(
                        f"{self.name}: {c.name!r} declares the contributions to {g!r} aliases of {sources}; "
                        "one entry per contribution of `contributes`, each a part of the backward's own gradient"
                    )
            for d in c.needs + c.needs_shape + c.produces:
                if d not in self._data:
                    raise CDGraphError(
                        f"{self.name}: compute node {c.name!r} refers to unknown data node {d!r}"
                    )
        for d in self.input_data + self.input_grads + self.output_data + self.output_grads:
            if d not in self._data:
                raise CDGraphError(f"{self.name}: interface data node {d!r} is not in the graph")
        if not set(self.side_data) <= set(self.input_data):
            raise CDGraphError(f"{self.name}: side inputs {self.side_data} must be input data")
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
            producers = self.producers(d)
            if not producers:
                raise CDGraphError(f"{self.name}: input grad {d!r} is produced by no backward node")
            for i in range(len(self._data[d].part_sizes)):
                contributors = [c for c in producers if i in c.contributes.get(d, (i,))]
                if len(contributors) == 1 and contributors[0].aliases.get(d, (-1,) * (i + 1))[i] >= 0:
                    raise CDGraphError(
                        f"{self.name}: part {i} of input grad {d!r} is only an alias made by "
                        f"{contributors[0].name!r}: it would share a storage with the gradients of "
                        "later blocks, which chain figures cannot add up; count it as a new tensor"
                    )


def _larger(first: DataNode, second: DataNode) -> DataNode:
    """One data node of the whole graph from its two blocks' figures (a block's output, the
    next block's input): the larger of each. A gradient measured by the block that makes it
    may hold more than the tensor the next block reads (the real part of a complex FFT's
    gradient holds the whole complex storage: 6144 B for a 3072-B activation), which the
    block that reads it cannot know."""
    if first.kind is not DataKind.GRAD or first == second:
        return first
    parts = tuple(max(a, b) for a, b in zip(first.parts, second.parts)) if len(first.parts) == len(second.parts) \
        else first.parts
    return dataclasses.replace(first, size_bytes=max(first.size_bytes, second.size_bytes), parts=parts)


def _with_boundary_aliases(node: ComputeNode) -> ComputeNode:
    """``node`` with its ``boundary_aliases`` among its ``aliases``."""
    if not node.boundary_aliases:
        return node
    aliases = dict(node.aliases)
    for g, sources in node.boundary_aliases.items():
        old = aliases.get(g, (-1,) * len(sources))
        aliases[g] = tuple(j if j >= 0 else k for j, k in zip(sources, old))
    return dataclasses.replace(node, aliases=aliases, boundary_aliases={})


@dataclass(frozen=True)
class FirstRun:
    """Memory that a compute node allocates at its first run and the executor keeps to the end
    of the step (``ModelChain.first_run_bytes``), shared by the nodes with the same ``key``.
    ``only_if_rerun``: allocated only when the node runs again later (the generator state of
    a random node, saved to replay it). ``until_loss``: freed when the forward ends (the new
    values of buffers, written into them then). ``accumulates``: a gradient, which a later run
    contributes to as to the CD-graph's gradients (the contribution waits for the next compute
    node, then joins as a new tensor). ``in_overhead``: results of the node's own operation,
    which its measured temporary memory holds at its peak (not counted twice while it runs).
    ``until``: freed when the compute node of that name starts (a view group's sum, added
    into its base's gradient by then). None of these: a buffer that the later runs of the
    key's nodes add into in place (a shared parameter's sum of contributions). ``alias``: for
    a contribution to a model input's gradient, the part of the node's own incoming gradient
    that it is (an ``add``'s backward passes it on; no new memory), -1 for a new tensor.
    ``owned``: that contribution is a dense tensor over a storage of its own (not a slice of a
    bigger gradient, not an expanded one), which a later contribution is added into in place
    once nothing else holds it, as eager's buffer does; else the sum is a new tensor.
    ``together``: that contribution is (a view of) one of the node's new storages that its
    contributions to gradients' parts are views of too (:attr:`ComputeNode.together`; -1: none).
    ``after_flush``: that contribution is made later, when the compute node named by
    ``delivery`` starts (None: when the backward ends), the node's own contributions joined by
    then: the backward of a view group summed at the view's size, run on the group's sum where
    the group is delivered (``rkgb.build``), while the group's sum is still there; that sum (the
    keys ``releases``) is freed once it has joined. For the sum of a model input's view group
    (:func:`input_views_key`), ``delivery`` is where it joins the input's gradient (None: at
    the backward's end): added into it, or the gradient itself where there is none yet (a
    dense tensor of its own, which later contributions are added into in place, where
    ``owned``).
    """

    key: str
    bytes: int
    only_if_rerun: bool = False
    until_loss: bool = False
    accumulates: bool = False
    in_overhead: bool = False
    until: str | None = None
    alias: int = -1
    owned: bool = False
    together: int = -1
    after_flush: bool = False
    delivery: str | None = None
    releases: tuple[str, ...] = ()


# the keys of first-run gradients that other phases look up (rkgb.build makes them)
_GRAD, _VIEWS, _SUM = ".grad", ".grad.views", ".grad.sum"


def input_grad_key(name: str) -> str:
    """The key of the gradient of model input ``name``."""
    return name + _GRAD


def input_views_key(name: str, view: str | None = None) -> str:
    """The key of the sum of the gradients of views of input ``name`` that several readers
    (or the user) get, before it joins the input's gradient (``input_grad_key``): one buffer for
    the groups that are open one after the other, and one of its own for the group of ``view``
    where it is open together with another."""
    return name + _VIEWS if view is None else f"{name}{_VIEWS}@{view}"


def views_key_input(key: str) -> str | None:
    """The input whose views' sum ``key`` is (:func:`input_views_key`), or None."""
    if key.endswith(_VIEWS):
        return key[: -len(_VIEWS)]
    name, at, view = key.partition(_VIEWS + "@")
    return name if at and view else None


def parameter_sum_key(name: str) -> str:
    """The key of the sum of a shared parameter's contributions, built apart when its
    ``.grad`` holds values (gradient accumulation)."""
    return name + _SUM


def parameter_sums(first_run_bytes: dict[str, tuple[FirstRun, ...]] | None) -> dict[str, int]:
    """The shared parameters' sums among ``first_run_bytes`` (key -> bytes)."""
    return {entry.key: entry.bytes for entries in (first_run_bytes or {}).values() for entry in entries
            if entry.key.endswith(_SUM)}


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
    """The chain of blocks of a model, with one CD-graph per class of identical blocks.

    ``held_bytes``: memory the executor holds through the whole step besides the CD-graphs'
    data (copies of the buffers the step updates); every plan's peak includes it.
    ``first_run_bytes``: memory that compute nodes of the whole graph allocate at their first
    run and the executor keeps to the end of the step (:class:`FirstRun`, by compute node):
    ``{"fwd_x": (FirstRun("x.rng", bytes, only_if_rerun=True),)}`` for the generator state
    saved to replay a random node (on CPU; on CUDA states are host memory, outside the
    device's budget), ``{"bwd_y": (FirstRun("input.grad", bytes),)}`` for the gradient of a
    model input that ``y`` reads. A later run of a node with that key holds one more while it
    runs (a replay saves the outer state, an accumulation adds into a new tensor):
    :func:`solvers.simulate.simulate`.
    """

    classes: list[CDGraph]
    blocks: list[BlockInstance]
    held_bytes: int = 0
    first_run_bytes: dict[str, tuple[FirstRun, ...]] = field(default_factory=dict)
    # the model's outputs (data nodes, real names) that blocks before the last make: the user
    # holds them to the end of the step and the loss gives them gradients (rkgb.blocks)
    early_outputs: list[str] = field(default_factory=list)
    # their gradients -> the loss's contributions to their parts, where not one per part (an
    # output returned twice gets two gradients, which the executor adds)
    early_contributions: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # those of them that the loss gives no gradient (``rkgb.simplify.SimplifiedGraph.outputs_without_gradient``)
    early_without_gradient: list[str] = field(default_factory=list)
    # the last block's outputs (data nodes, real names) that the training step drops once the
    # forward has returned them, keeping the model's loss alone (``loss = model(**batch).loss``,
    # transformers' Trainer; ``rockmate.BuildOptions.held_outputs``): they may be forgotten
    # after the loss like any tensor
    dropped_outputs: list[str] = field(default_factory=list)
    # whole_graph's graph and what it was made from (the planner asks for it 5-6 times a build:
    # 76 ms each on a 24-layer Llama, 52 blocks)
    _whole: tuple[tuple, "CDGraph"] | None = field(default=None, init=False, repr=False, compare=False)

    def first_run_reserve(self) -> int:
        """An upper bound of the first-run memory alive at any time: every key's bytes, plus
        the most that one compute node adds for a key that is there already (a replay's outer
        state, or contributions waiting to join a gradient and the sum they make; nothing for a
        buffer added into in place, such as a shared parameter's sum)."""
        sizes = {entry.key: entry.bytes for entries in self.first_run_bytes.values() for entry in entries}
        # a key freed ``until`` a backward node (a view group's sum) lives only while the
        # backward goes from its first reader's block down to that node's block: keys whose
        # spans of blocks do not meet are never alive together (each block's backward runs
        # once, the last block's first), so the reserve counts the most that one block's span
        # holds (nn.MultiheadAttention's view groups: one layer's, not every layer's)
        within: dict[int, int] = {}
        for key, (low, high) in self._backward_spans().items():
            size = sizes.pop(key)
            for index in range(low, high + 1):
                within[index] = within.get(index, 0) + size
        extra = 0
        for entries in self.first_run_bytes.values():
            for entry in entries:
                count = sum(other.key == entry.key for other in entries)
                if entry.accumulates:
                    extra = max(extra, (count + 1) * entry.bytes)
                elif entry.only_if_rerun or entry.until_loss:
                    extra = max(extra, entry.bytes)
        return sum(sizes.values()) + max(within.values(), default=0) + extra

    def _backward_spans(self) -> dict[str, tuple[int, int]]:
        """Keys of ``first_run_bytes`` made by backward nodes and freed ``until`` one ->
        (the block of that node, the highest block of the nodes that make it)."""
        block_of: dict[str, int] = {}
        for index in range(len(self.blocks)):
            for compute in self.block_graph(index).compute_nodes:
                if compute.kind is ComputeKind.BACKWARD:
                    block_of[compute.name] = index
        spans: dict[str, tuple[int, int]] = {}
        refused: set[str] = set()
        for compute, entries in self.first_run_bytes.items():
            for entry in entries:
                if entry.until is None or compute not in block_of or entry.until not in block_of:
                    refused.add(entry.key)
                    continue
                low, high = spans.get(entry.key, (block_of[entry.until], block_of[compute]))
                spans[entry.key] = (min(low, block_of[entry.until]), max(high, block_of[compute]))
        return {key: span for key, span in spans.items() if key not in refused}

    def block_graph(self, index: int) -> CDGraph:
        """The CD-graph of block ``index`` with its real node names."""
        block = self.blocks[index]
        return self.classes[block.class_index].renamed(block.names, name=f"block{index}")

    def whole_graph(self) -> CDGraph:
        """The CD-graph of the whole model: the blocks' graphs concatenated, one loss at the end.

        The loss of block ``i < last`` is dropped; block ``i``'s output data are block
        ``i+1``'s input data, and block ``i+1``'s backwards produce block ``i``'s output grads.
        One graph per chain, made again where the chain's classes, blocks or early outputs were
        replaced (a graph read, not modified, by its callers).
        """
        made_from = (tuple(map(id, self.classes)), tuple((b.class_index, id(b.names)) for b in self.blocks),
                     tuple(self.early_outputs), tuple(self.early_contributions.items()),
                     tuple(self.early_without_gradient), tuple(self.dropped_outputs))
        if self._whole is None or self._whole[0] != made_from:
            self._whole = (made_from, self._whole_graph())
        return self._whole[1]

    def _whole_graph(self) -> CDGraph:
        """:meth:`whole_graph`, made."""
        graphs = [self.block_graph(i) for i in range(len(self.blocks))]
        if not graphs:  # a model without operations of its own (it returns views of its inputs)
            loss = ComputeNode(LOSS_NAME, ComputeKind.LOSS, LOSS_NAME, time_s=0.0, overhead_bytes=0)
            return CDGraph(name="model", compute_nodes=[loss], data_nodes=[])
        forwards: list[ComputeNode] = []
        backwards: list[ComputeNode] = []
        data: dict[str, DataNode] = {}
        for index, g in enumerate(graphs):
            forwards += g.forward_nodes()
            # a block's input gradient is an inner node of the whole graph but in the first
            # block: where the block's backward passes its own gradient on, they share a storage
            backwards = ([_with_boundary_aliases(c) for c in g.backward_nodes()] if index else g.backward_nodes()) \
                + backwards
            for d in g.data_nodes:
                data[d.name] = _larger(data[d.name], d) if d.name in data else d
        last = graphs[-1]
        output_data = list(self.early_outputs) + list(last.output_data)
        early_grads = [data_name(data[d].target, DataKind.GRAD) for d in self.early_outputs
                       if d not in self.early_without_gradient]
        output_grads = [g for g in early_grads if g in data] + list(last.output_grads)
        loss = dataclasses.replace(
            last.loss, needs=output_data, produces=output_grads,
            contributes={**last.loss.contributes, **{g: v for g, v in self.early_contributions.items()
                                                     if g in output_grads}},
            shared={**last.loss.shared, **{g: tuple(range(len(data[g].part_sizes))) for g in output_grads
                                           if g not in last.output_grads}},
            owned={**last.loss.owned, **{g: tuple(range(len(data[g].part_sizes))) for g in output_grads
                                         if g not in last.output_grads}})
        return CDGraph(
            name="model",
            compute_nodes=forwards + [loss] + backwards,
            data_nodes=list(data.values()),
            input_data=list(graphs[0].input_data),
            input_grads=list(graphs[0].input_grads),
            output_data=output_data,
            output_grads=output_grads,
            dropped_outputs=[d for d in self.dropped_outputs if d in last.output_data],
        )
