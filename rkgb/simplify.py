"""Simplify the captured graph to one node per allocating operation.

Each operation of the functional ATen graph is classified from its schema's alias annotations
(not from lists of names):

- *view*: a return aliases an argument without writing it (``view``, ``transpose``, ``split``),
  by its schema, or by the traced values when the schema does not say so (``_unsafe_view``,
  which ``matmul``'s decomposition uses on its own temporaries, returns a view that autograd
  does not track as one: the traced result shares its argument's storage);
- *in-place*: an argument is written (``add_``); the functionalized graph rarely has them;
- *getitem*: picks one result of a multi-output operation;
- *shape*: returns no tensor (``sym_size``, arithmetic on sizes);
- *allocating*: everything else. Each allocating operation becomes a :class:`SimplifiedNode`,
  and the views, in-place updates and getitems of its result go into its ``body``.

Operations that read no activation (only parameters, buffers, constants; a causal mask built
from a buffer, ``arange``) are *static*: they are inlined into the ``prelude`` of every node
that uses them, so that they are recomputed where needed and no edge jumps across the chain.
Static operations whose result updates a buffer (``num_batches_tracked + 1``) are kept apart in
``SimplifiedGraph.buffer_updates_prologue`` and run once per training step. Where nothing but that
update reads the buffer (a counter: ``self.count += 1`` then ``x * self.count``), the update is
made first, in place as eager makes it, and the nodes read the buffer for its new value
(``SimplifiedGraph.updated_first``): no copy of the new value lives through the forward.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from .capture import FUNCTIONAL_BATCH_NORM, CapturedGraph, storage_identity
from .errors import UnsupportedOperation, describe_fx_node
from .memory import storage_bytes

__all__ = ["OpKind", "classify", "SimplifiedNode", "SimplifiedGraph", "simplify", "GradientNeeds", "gradient_needs", "NO_GRADIENT"]


class OpKind(enum.Enum):
    VIEW = "view"
    INPLACE = "inplace"
    GETITEM = "getitem"
    SHAPE = "shape"
    ALLOCATING = "allocating"


def _returns_tensor(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(isinstance(v, torch.Tensor) for v in value)
    return False


def classify(node: torch.fx.Node) -> OpKind:
    """The kind of a ``call_function`` node, read from its op schema's alias annotations."""
    if node.target is operator.getitem:
        return OpKind.GETITEM
    if not _returns_tensor(node):
        return OpKind.SHAPE
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        raise UnsupportedOperation(
            f"cannot classify {describe_fx_node(node)}: it is not an ATen operator"
        )
    if any(arg.alias_info is not None and arg.alias_info.is_write for arg in schema.arguments):
        return OpKind.INPLACE
    if any(ret.alias_info is not None for ret in schema.returns):
        return OpKind.VIEW
    if _traced_alias(node) is not None:
        return OpKind.VIEW
    return OpKind.ALLOCATING


def _is_data_dependent(node: torch.fx.Node) -> bool:
    """Whether a non-tensor result depends on tensor data (an unbacked symbol: ``.item()``)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    value = node.meta.get("val")
    try:
        return bool(free_unbacked_symbols(value))
    except (TypeError, AttributeError):  # a value that holds no symbols
        return False


def _traced_alias(node: torch.fx.Node) -> torch.fx.Node | None:
    """The argument whose storage the traced (fake) result shares, if any."""
    result = storage_identity(node.meta.get("val"))
    if result is None:
        return None
    for argument in _input_nodes(node):
        if storage_identity(argument.meta.get("val")) == result:
            return argument
    return None


def _aliased_argument(node: torch.fx.Node) -> torch.fx.Node:
    """The argument a view or in-place op aliases (the one sharing its alias set)."""
    schema = node.target._schema
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    # an in-place op aliases the argument it writes; a view aliases its annotated argument
    candidates = written or [a for a in schema.arguments if a.alias_info is not None]
    if not candidates:
        traced = _traced_alias(node)
        if traced is not None:
            return traced
    for position, argument in enumerate(schema.arguments):
        if argument is not candidates[0] if candidates else True:
            continue
        value = node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
        if isinstance(value, (list, tuple)):
            value = value[0]
        if isinstance(value, torch.fx.Node):
            return value
    raise UnsupportedOperation(f"cannot find the tensor that {describe_fx_node(node)} aliases")


def _input_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), lambda n: found.append(n) or n)
    return found


@dataclass
class TensorOutput:
    """One tensor that a simplified node allocates: the fx node naming it and its metadata."""

    fx_name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    size_bytes: int
    requires_grad: bool


@dataclass
class SimplifiedNode:
    """One allocating operation with its body; the unit of recomputation.

    ``prelude``: static operations recomputed before ``main``. ``body``: views, getitems and
    in-place updates of the result, in graph order. ``data_deps``: simplified nodes whose data
    (or a view of it) the node reads. ``shape_deps``: nodes of which only a shape is read (an
    ordering constraint, not a data edge). ``outputs``: the tensors it allocates that are used.
    ``buffer_updates``: fx names of results that are new values of buffers (path).
    """

    name: str
    main: torch.fx.Node
    prelude: list[torch.fx.Node] = field(default_factory=list)
    body: list[torch.fx.Node] = field(default_factory=list)
    data_deps: list[str] = field(default_factory=list)
    shape_deps: list[str] = field(default_factory=list)
    globals_read: list[str] = field(default_factory=list)
    outputs: list[TensorOutput] = field(default_factory=list)
    buffer_updates: dict[str, str] = field(default_factory=dict)
    is_random: bool = False

    @property
    def size_bytes(self) -> int:
        return sum(o.size_bytes for o in self.outputs)

    @property
    def lines(self) -> list[torch.fx.Node]:
        """Every fx node the node executes, in order: prelude, main, body."""
        return self.prelude + [self.main] + self.body


@dataclass
class SimplifiedGraph:
    """The model as a list of simplified nodes in a topological order.

    ``globals`` are placeholders that are always available and never counted: parameters,
    buffers, constants and the model's inputs (and the views of these, kept in
    ``global_views``). ``owner`` maps every fx node name that holds a tensor to the simplified
    node owning its memory (or to itself for a global).
    """

    captured: CapturedGraph
    nodes: list[SimplifiedNode]
    global_views: list[torch.fx.Node]
    buffer_updates_prologue: list[torch.fx.Node]
    owner: dict[str, str]
    outputs: list[str]  # fx names of the user outputs, in order
    # exported tensors that a backward from the outputs reaches (rkgb.inspect.gradient_flow);
    # None: not known, every tensor computed from one that requires grad is taken to be reached
    gradient_receivers: set[str] | None = None
    # views of a node's result made in each of their readers' preludes, whose gradients the
    # executor sums apart (view groups): view fx name -> the fx name of the result it views
    # (see _group_views_of_results)
    grouped_views: dict[str, str] = field(default_factory=dict)
    # buffer updates made before the forward (see _updates_made_first): the new value's fx name
    # -> the buffer's placeholder, which the nodes read for it; and the lines that compute them
    updated_first: dict[str, str] = field(default_factory=dict)
    buffer_updates_first: list[torch.fx.Node] = field(default_factory=list)
    # outputs that the user's loss gives no gradient: where the model returns its own loss, the
    # others (``rockmate.BuildOptions.output_gradients``); their gradients come from the nodes
    # that read them, if any
    outputs_without_gradient: frozenset[str] = frozenset()
    # outputs that the model's loss does not reach: the plan gives them a gradient (their
    # backward runs if the user gives one) and holds for a step that gives none too (the
    # inspection measures the blocks both ways, rkgb.inspect.inspect_chain)
    outputs_with_optional_gradient: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self._by_name = {node.name: node for node in self.nodes}

    @property
    def gradient_outputs(self) -> list[str]:
        """The outputs that the user's loss gives a gradient (with their repeats, in order)."""
        return [name for name in self.outputs if name not in self.outputs_without_gradient]

    def updates_written_at_once(self, node: SimplifiedNode) -> set[str]:
        """The lines of ``node`` whose values are new values of buffers that the step writes as
        soon as the node's first run makes them (the others wait for the forward's end).

        Eager writes a BatchNorm's running statistics in place while it runs; the functional
        graph returns new values instead. A new value that no line reads again, of a buffer that
        no node reads but to update statistics (``snapshot_buffers``: a recomputation reads the
        buffer as the step found it), is written at once: holding it to the forward's end kept
        two small tensors per batch norm that eager does not have."""
        if not node.buffer_updates:
            return set()
        kept = set(self.snapshot_buffers())
        placeholders = {path: name for name, path in self.captured.buffers.items()}
        outputs = {out.fx_name for out in node.outputs}
        return {line for line, path in node.buffer_updates.items()
                if line not in outputs and placeholders.get(path) not in kept}

    def snapshot_buffers(self) -> list[str]:
        """Placeholders of the buffers that the step updates and that a node reads.

        The step writes a buffer's new value once, at the end of the forward; a node
        recomputed after that (in the backward) must read the value its first computation read.
        The executor reads such buffers from a copy made when the step starts. BatchNorm in
        training mode reads its running statistics only to compute their update, which is
        written once, at the first computation: its reads need no copy.
        """
        captured = self.captured
        updated = set(captured.buffer_mutations.values())
        mutated = {name for name, path in captured.buffers.items() if path in updated}
        if not mutated:
            return []
        base = {view.name: view for view in self.global_views}

        def root(fx_node: torch.fx.Node) -> str:
            while fx_node.name in base:
                fx_node = base[fx_node.name].args[0]
            return fx_node.name

        read: set[str] = set()
        for node in self.nodes:
            for line in node.lines:
                if _reads_only_statistics_of(line):
                    continue
                read |= {root(arg) for arg in line.all_input_nodes} & mutated
        return sorted(read)

    def node(self, name: str) -> SimplifiedNode:
        return self._by_name[name]

    @property
    def output_owners(self) -> list[str]:
        """Simplified nodes owning the user outputs (globals are not listed)."""
        owners = []
        for name in self.outputs:
            owner = self.owner.get(name)
            if owner in self._by_name and owner not in owners:
                owners.append(owner)
        return owners

    def global_names(self) -> set[str]:
        """fx names of the globals: parameters, buffers, constants, inputs and their views."""
        captured = self.captured
        names = set(captured.parameters) | set(captured.buffers) | set(captured.constants)
        names |= {name for name in captured.inputs if name is not None}
        return names | {view.name for view in self.global_views} | set(self.updated_first)

    def exported(self, node: SimplifiedNode) -> list[str]:
        """fx names of the tensors of ``node`` that other nodes or the user read: its result or
        views of it (a buffer's new value only where the forward reads it again). The executor keeps these as the node's data
        (one leaf each) and backpropagates from them; the inspection does the same."""
        own = {line.name for line in node.lines}
        outputs = set(self.outputs)
        exported = []
        for line in [node.main] + node.body:
            users = [user for user in line.users if user.op != "output"]
            if line.name in node.buffer_updates and not users:
                continue  # a buffer's new value that nothing else reads
            if line.name in outputs or any(user.name not in own for user in users):
                if isinstance(line.meta.get("val"), torch.Tensor):
                    exported.append(line.name)
        return exported

    def input_view_readers(self, name: str) -> dict[str, list[str]]:
        """The views of model input ``name`` made in nodes' preludes (each reading island makes
        its own, where eager makes one): view fx name -> its reading nodes, in order. The
        executor sums each view's gradient apart (``exec.codegen``, view groups) and the plan
        counts that sum (``rkgb.build.first_run_bytes``)."""
        readers: dict[str, list[str]] = {}
        for node in self.nodes:
            for line in node.prelude:
                if isinstance(line.meta.get("val"), (torch.Tensor, list, tuple)) and \
                        any(arg.name == name for arg in _input_nodes(line)):
                    names = readers.setdefault(line.name, [])
                    if node.name not in names:
                        names.append(node.name)
        return readers

    def last_node_before(self, line: str, has_backward) -> "SimplifiedNode | None":
        """The node made last before fx line ``line`` among those for which ``has_backward``
        (node name -> bool) holds, or None: where eager's backward passes the place of ``line``
        (the engine runs the node made last first), the executor delivers what belongs there
        (a view group's sum, a shared parameter's sum of contributions) before that node's
        backward, and the plan counts it until then (``rkgb.build.first_run_bytes``)."""
        position = {fx.name: i for i, fx in enumerate(self.captured.graph.nodes)}
        before = [node for node in self.nodes if position[node.main.name] < position[line] and has_backward(node.name)]
        return max(before, key=lambda node: position[node.main.name]) if before else None

    def reads(self, node: SimplifiedNode) -> set[str]:
        """Owners (nodes, or globals: parameters, buffers, inputs) of the tensors ``node``'s
        lines read, ``node`` itself excluded."""
        return {self.owner.get(arg.name, arg.name) for line in node.lines for arg in line.all_input_nodes} - {node.name}

    def readers(self) -> dict[str, set[str]]:
        """Owner (node or global) -> the nodes whose lines read one of its tensors."""
        readers: dict[str, set[str]] = {}
        for node in self.nodes:
            for holder in self.reads(node):
                readers.setdefault(holder, set()).add(node.name)
        return readers

    def results_read_by_one_node(self) -> dict[str, str]:
        """fx name of each node result that one node alone reads and the user does not get ->
        that node. All the contributions to such a result's gradient come from its reader's
        island, whose one engine call sums them in eager's order (one buffer, as eager's): a
        reader that reads it more than once needs no alias per read (``exec.codegen``
        ``split_reads``, ``rkgb.inspect.run_island_lines``), and holds one sum, not one
        gradient per read, as eager does (``nn.MultiheadAttention``'s three ``select``s of its
        packed projection)."""
        readers = self.readers()
        nodes = {node.name for node in self.nodes}
        # (a view of a result that the user gets passes its gradient on to the result)
        returned = {self.owner.get(name, name) for name in self.outputs}
        one: dict[str, str] = {}
        for fx_name, owner in self.owner.items():
            if owner in nodes and owner not in returned and len(readers.get(owner, ())) == 1:
                one[fx_name] = next(iter(readers[owner]))
        return one

    def users(self) -> dict[str, list[str]]:
        users: dict[str, list[str]] = {node.name: [] for node in self.nodes}
        for node in self.nodes:
            for dep in node.data_deps:
                users[dep].append(node.name)
        return users


_RANDOM_TAG = torch.Tag.nondeterministic_seeded


_aten = torch.ops.aten
# allocations shaped like their argument, whose results never require grad
NO_GRADIENT = {
    _aten.empty_like.default, _aten.zeros_like.default, _aten.ones_like.default,
    _aten.full_like.default, _aten.rand_like.default, _aten.randn_like.default,
}


@dataclass(frozen=True)
class GradientNeeds:
    """Whether a node runs as an autograd island (``requires_grad``: its backward has work),
    and which of its exported tensors get a gradient (``exported``: fx name -> flag)."""

    requires_grad: bool
    exported: dict[str, bool]


def gradient_needs(graph: SimplifiedGraph, global_requires_grad: dict[str, bool]) -> dict[str, GradientNeeds]:
    """Which nodes need a backward, given which globals (placeholder names, views of globals
    included) require grad.

    An exported tensor gets a gradient when its node reads a tensor that requires grad (a global
    or another node's exported tensor that gets one) through a line that is not an allocation like
    ``empty_like`` (the noise of a dropout on CPU), which autograd never differentiates (a
    ``zeros_like`` that later lines write values requiring grad into does get one), it is
    floating point, and a backward from the model's outputs reaches it
    (``graph.gradient_receivers``: not an unused result, not only read by non-differentiable
    operations such as comparisons). A node needs a backward when one of its exported tensors
    gets a gradient; the others run without grad.
    """
    receivers = graph.gradient_receivers
    needs: dict[str, GradientNeeds] = {}
    for node in graph.nodes:
        reads_grad = False
        for line in node.lines:
            if line.target in NO_GRADIENT:
                # (its result never requires grad: only what other lines read counts, as the
                # values an RWKV writes in place, step by step, into a zeros_like of its key)
                continue
            for arg in line.all_input_nodes:
                holder = graph.owner.get(arg.name)
                if holder in needs:
                    reads_grad |= needs[holder].exported.get(arg.name, needs[holder].requires_grad)
                elif holder is not None and holder != node.name:
                    reads_grad |= global_requires_grad.get(arg.name, global_requires_grad.get(holder, False))
        differentiable = reads_grad
        exported = {}
        names = set(graph.exported(node))
        for line in [node.main] + node.body:
            if line.name in names:
                value = line.meta["val"]
                floating = value.dtype.is_floating_point or value.dtype.is_complex
                exported[line.name] = differentiable and floating and (receivers is None or line.name in receivers)
        needs[node.name] = GradientNeeds(any(exported.values()), exported)
    return needs


def _reads_only_statistics_of(line: torch.fx.Node) -> bool:
    """A training-mode BatchNorm: its outputs do not depend on the running statistics it reads."""
    return line.target is FUNCTIONAL_BATCH_NORM and line.args[5] is True


def _updates_made_first(captured: CapturedGraph) -> dict[str, str]:
    """The buffer updates that can be made before the forward, in place: new value's fx name ->
    the buffer's placeholder.

    Eager increments a counter in place (``self.count += 1``) and reads the buffer for its new
    value; the functional graph computes ``add = count + 1`` and reads ``add``, so a plan held
    ``add`` (and, recomputing it in each reader, its temporaries) beside the activations, where
    eager holds nothing (fuzzing: the plan's peak 16 bytes above eager's on a counter model).
    An update qualifies when it is computed from that buffer, unmutated buffers and constants
    alone, without random draws, when nothing but its own lines reads the buffer or its
    intermediate values (the buffer's old value is then never needed again, even by a
    recomputation), and when its new value has the buffer's shape, dtype and strides (the
    buffer, written with it, reads the same)."""
    by_name = {node.name: node for node in captured.graph.nodes}
    by_path = {path: name for name, path in captured.buffers.items()}
    mutated = {by_path.get(path) for path in captured.buffer_mutations.values()}
    found: dict[str, str] = {}
    for name, path in captured.buffer_mutations.items():
        buffer, value = by_name.get(by_path.get(path, "")), by_name.get(name)
        if buffer is None or value is None or value.op != "call_function" or name in captured.user_outputs:
            continue
        lines: set[torch.fx.Node] = set()
        pending, sources_ok = [value], True
        while pending and sources_ok:
            node = pending.pop()
            if node in lines or node is buffer:
                continue
            if node.op == "placeholder":
                sources_ok = node.name in captured.constants or (node.name in captured.buffers and node.name not in mutated)
                continue
            if node.op != "call_function" or _is_random(node):
                sources_ok = False
                continue
            lines.add(node)
            pending.extend(node.all_input_nodes)
        if not sources_ok or not all(user in lines for user in buffer.users):
            continue
        if not all(user in lines for line in lines if line is not value for user in line.users):
            continue
        old, new = buffer.meta.get("val"), value.meta.get("val")
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and old.shape == new.shape \
                and old.dtype == new.dtype and old.stride() == new.stride() and old.device == new.device:
            found[name] = buffer.name
    return found


def _written_by_random_ops(graph: torch.fx.Graph) -> set[str]:
    """fx names of the tensors that a random in-place op fills (``empty_like(x).bernoulli_(p)``,
    dropout's mask), and the views down to them. Such a tensor is never static (recomputed in
    each reader's prelude): a dropout of a value computed from constants alone (XLNet's
    positional encoding, read by every layer) drew a new mask in each layer, where eager draws
    one, and every later draw came from another generator state (silently other masks)."""
    found: set[str] = set()
    for fx_node in graph.nodes:
        if fx_node.op != "call_function" or classify(fx_node) is not OpKind.INPLACE or not _is_random(fx_node):
            continue
        base = _aliased_argument(fx_node)
        while isinstance(base, torch.fx.Node) and base.name not in found:
            found.add(base.name)
            if base.op != "call_function" or classify(base) not in (OpKind.VIEW, OpKind.INPLACE):
                break
            base = _aliased_argument(base)
    return found


def _is_random(node: torch.fx.Node) -> bool:
    """Whether ``node`` may draw random numbers: its op's tag says so (a custom autograd.Function's
    operator too, rkgb.functions: its forward may), or it is a custom operator of another library
    (torch.library: its kernel may draw without a tag saying so), whose recomputation then
    replays the generator's state."""
    if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace not in _TORCH_NAMESPACES:
        return True
    return _RANDOM_TAG in getattr(node.target, "tags", ()) and not _attention_without_dropout(node)


_TORCH_NAMESPACES = frozenset({"aten", "prims", "rockmate", "profiler"})


def _attention_without_dropout(node: torch.fx.Node) -> bool:
    """An attention operator (``scaled_dot_product_attention`` and its kernels) whose
    ``dropout_p`` is 0: tagged random for its dropout, it draws nothing then (its kernels touch
    the generator only when dropping). Kept random, each such node held a copy of the generator
    state to replay it (5 KB on CPU each: a tiny Llama's minimum budget 18% above its plans)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    for index, argument in enumerate(schema.arguments):
        if argument.name == "dropout_p":
            if index < len(node.args):
                value = node.args[index]
            else:
                value = node.kwargs.get("dropout_p", argument.default_value)
            return isinstance(value, (int, float)) and value == 0
    return False


def _tensor_output(fx_node: torch.fx.Node, value: torch.Tensor) -> TensorOutput:
    size = storage_bytes(value) if value.numel() else 0
    return TensorOutput(
        fx_name=fx_node.name,
        shape=tuple(int(s) for s in value.shape),
        dtype=value.dtype,
        size_bytes=int(size),
        requires_grad=bool(value.requires_grad) or value.dtype.is_floating_point,
    )


class _WrittenFromActivations(Exception):
    """A static value is written in place with values that carry gradients (``buf[:, 0] =
    h[:, 0]`` into a ``zeros``): it is not static (``name``, its root), the simplification runs
    again with it as a node."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def simplify(captured: CapturedGraph) -> SimplifiedGraph:
    """Group the captured graph's operations into simplified nodes.

    Raises:
        UnsupportedOperation: an operation returns something Rockmate cannot track (a value
            computed from tensor data, such as ``.item()``); the message names the op and the
            module path.
    """
    not_static: set[str] = set()
    while True:
        try:
            return _simplify(captured, frozenset(not_static))
        except _WrittenFromActivations as written:
            if written.name in not_static:  # (a value that stays static: a model input's view)
                raise UnsupportedOperation(
                    f"{written.name!r} is written in place with values computed from the inputs, and "
                    "Rockmate cannot make it a node of its own; write into a clone instead") from None
            not_static.add(written.name)


def _simplify(captured: CapturedGraph, not_static: frozenset[str]) -> SimplifiedGraph:
    """:func:`simplify`, with the values of ``not_static`` made nodes even where they read no
    activation."""
    graph = captured.graph
    global_names = set(captured.parameters) | set(captured.buffers) | set(captured.constants)
    global_names |= {name for name in captured.inputs if name is not None}
    buffer_mutation_outputs = set(captured.buffer_mutations)

    owner: dict[str, str] = {}  # fx name -> simplified node name (or the global's own name)
    static: dict[str, list[torch.fx.Node]] = {}  # static fx name -> its static lines, in order
    static_root: dict[str, str] = {}  # a static view -> the static value whose storage it views
    static_views: dict[str, list[str]] = {}  # a static value -> its static views
    nodes: dict[str, SimplifiedNode] = {}
    order: list[str] = []
    global_views: list[torch.fx.Node] = []
    prologue: list[torch.fx.Node] = []
    outputs: list[str] = []
    model_inputs = {name for name in captured.inputs if name is not None}
    input_views: set[str] = set()  # static lines that are views of model inputs
    # static values computed from integer or boolean model inputs (an attention mask built from
    # ``attention_mask``, position ids), and from parameters: one value may not be both
    input_derived: set[str] = set()
    parameter_derived: set[str] = set()
    parameters = set(captured.parameters)
    trained = {node.name for node in graph.nodes if node.op == "placeholder" and node.name in parameters
               and getattr(node.meta.get("val"), "requires_grad", False)}
    trained_views: set[str] = set()  # static views of trained parameters
    never_static = _written_by_random_ops(graph) | not_static
    updated_first = _updates_made_first(captured)
    first_lines: list[torch.fx.Node] = []
    made_first: dict[str, str] = {}  # (the updates of updated_first that are static here)

    for fx_node in graph.nodes:
        if fx_node.op == "placeholder":
            if fx_node.name in global_names or not fx_node.users:
                owner[fx_node.name] = fx_node.name
            continue
        if fx_node.op == "output":
            results = fx_node.args[0]
            outputs = [r.name for r in results if isinstance(r, torch.fx.Node) and r.name in captured.user_outputs]
            continue
        if fx_node.op != "call_function":
            raise UnsupportedOperation(f"unexpected fx operation {fx_node.op} in {describe_fx_node(fx_node)}")

        inputs = _input_nodes(fx_node)
        kind = classify(fx_node)
        activation_inputs = [n for n in inputs if owner.get(n.name) in nodes]
        static_inputs = [n for n in inputs if n.name in static]
        reads_model_input = any((owner.get(n.name) in model_inputs or n.name in input_views) and _may_require_grad(n)
                                for n in inputs)
        reads_integer_input = any(n.name in input_derived or (
            (owner.get(n.name) in model_inputs or n.name in input_views) and not _may_require_grad(n)) for n in inputs)
        reads_parameter = any(n.name in parameters or n.name in parameter_derived for n in inputs)
        # a trained parameter, or a static view of one (``weight.t()``)
        reads_trained = any(n.name in trained or n.name in trained_views for n in inputs)

        if kind is OpKind.SHAPE:
            if _is_data_dependent(fx_node) and (activation_inputs or reads_model_input):
                raise UnsupportedOperation(
                    f"{describe_fx_node(fx_node)} reads a value out of a tensor computed from the inputs "
                    "(.item(), .tolist(), a Python number or bool of a tensor): Rockmate plans a graph "
                    "of tensor operations and cannot replay such a value when it recomputes; keep the "
                    "value as a tensor (e.g. `x * s` instead of `x * s.item()`)"
                )
            if not activation_inputs:
                static[fx_node.name] = _static_lines(static_inputs, static) + [fx_node]
            else:
                # a size read from an activation: consumers depend on its shape only
                owner[fx_node.name] = owner[activation_inputs[0].name]
                nodes[owner[fx_node.name]].body.append(fx_node)
            continue

        if kind in (OpKind.VIEW, OpKind.INPLACE, OpKind.GETITEM):
            base = fx_node.args[0] if kind is OpKind.GETITEM else _aliased_argument(fx_node)
            if base.name in static:
                if kind is OpKind.INPLACE and (activation_inputs or reads_model_input or reads_trained):
                    # (written with values that carry gradients: a node, recomputed as one)
                    raise _WrittenFromActivations(static_root.get(base.name, base.name))
                static[fx_node.name] = _static_lines(static_inputs, static) + [fx_node]
                root = static_root.get(base.name, base.name)
                if kind is OpKind.INPLACE:
                    # a write into a static value (``shifted[:, 0] = start`` into a new_zeros): its
                    # later readers, and those of its views, recompute it written
                    for name in [root] + static_views.get(root, []):
                        static[name] = _merge_static_lines(list(static[name]), [fx_node], static)
                else:
                    static_root[fx_node.name] = root
                    static_views.setdefault(root, []).append(fx_node.name)
                if base.name in input_views:
                    input_views.add(fx_node.name)
                if reads_integer_input:
                    input_derived.add(fx_node.name)
                if reads_parameter:
                    parameter_derived.add(fx_node.name)
                if reads_trained and kind is not OpKind.INPLACE:
                    trained_views.add(fx_node.name)
                continue
            base_owner = owner.get(base.name)
            if base_owner is None:
                raise UnsupportedOperation(f"cannot place {describe_fx_node(fx_node)}: unknown base")
            if base_owner not in nodes:
                if kind is OpKind.INPLACE:
                    raise UnsupportedOperation(
                        f"{describe_fx_node(fx_node)} writes in place into an input or a parameter; "
                        "Rockmate needs a model that does not mutate its inputs or parameters"
                    )
                if base_owner in model_inputs and kind is OpKind.VIEW:
                    # a view of an input is made where it is read, as eager makes it: its
                    # backward's place among the others sets the order of the input's gradient
                    # sum; one that is an output is also made once, as a global, for the user
                    static[fx_node.name] = [fx_node]
                    input_views.add(fx_node.name)
                    if fx_node.name not in captured.user_outputs:
                        continue
                owner[fx_node.name] = base_owner  # a view of a global is a global
                global_views.append(fx_node)
                continue
            holder = nodes[base_owner]
            holder.body.append(fx_node)
            holder.is_random |= _is_random(fx_node)  # dropout's noise: empty_like, bernoulli_
            owner[fx_node.name] = base_owner
            if kind is OpKind.INPLACE:
                _add_deps(holder, fx_node, inputs, owner, nodes, static)
                here = order.index(holder.name)
                late = [d for d in holder.data_deps if order.index(d) > here]
                if late:
                    # written with values computed after it: the node moves after them, which
                    # is eager's order of its last line, unless a node in between reads it
                    between = [n for n in order[here + 1:] if holder.name in nodes[n].data_deps]
                    if between:
                        raise UnsupportedOperation(
                            f"{describe_fx_node(fx_node)} updates {holder.name!r} in place with values "
                            f"computed after it ({late}), while {between} read it in between: a node is "
                            "one value for Rockmate; write into a clone instead"
                        )
                    order.remove(holder.name)
                    order.append(holder.name)
            elif kind is OpKind.GETITEM:
                value = fx_node.meta.get("val")
                if fx_node.name in buffer_mutation_outputs:
                    holder.buffer_updates[fx_node.name] = captured.buffer_mutations[fx_node.name]
                elif isinstance(value, torch.Tensor) and fx_node.users and base is holder.main:
                    holder.outputs.append(_tensor_output(fx_node, value))
            continue

        # static: reads no activation and nothing that can carry a gradient from the inputs;
        # values computed from integer inputs (read by every layer, e.g. an attention mask) are
        # recomputed where read instead of joining the layers into one block, unless they mix
        # with parameters (an embedding is a node) or are returned. An operation on a trained
        # parameter is a node (T5's position bias, an embedding of constant buckets that every
        # layer reads): recomputed in each reader, its backward would run once per reader, where
        # eager sums the readers' gradients first (not bitwise: a scatter-add of each, summed)
        if not activation_inputs and not reads_model_input and not _is_random(fx_node) and not reads_trained \
                and fx_node.name not in never_static \
                and not (reads_integer_input and (reads_parameter or fx_node.name in captured.user_outputs)):
            static[fx_node.name] = _static_lines(static_inputs, static) + [fx_node]
            if fx_node.name in updated_first:
                # made once, before the forward; its readers read the buffer (a global)
                first_lines += static.pop(fx_node.name)
                owner[fx_node.name] = fx_node.name
                made_first[fx_node.name] = updated_first[fx_node.name]
                continue
            if reads_integer_input:
                input_derived.add(fx_node.name)
            if reads_parameter:
                parameter_derived.add(fx_node.name)
            continue

        # an allocating op reading at least one activation or model input
        value = fx_node.meta.get("val")
        node = SimplifiedNode(name=fx_node.name, main=fx_node, is_random=_is_random(fx_node))
        _add_deps(node, fx_node, inputs, owner, nodes, static)
        if isinstance(value, torch.Tensor):
            if fx_node.name in buffer_mutation_outputs:
                node.buffer_updates[fx_node.name] = captured.buffer_mutations[fx_node.name]
            if fx_node.name not in buffer_mutation_outputs or any(user.op != "output" for user in fx_node.users):
                # (a buffer's new value that the forward reads again is also the node's output)
                node.outputs.append(_tensor_output(fx_node, value))
        nodes[node.name] = node
        order.append(node.name)
        owner[fx_node.name] = node.name

    # static ops whose result is a buffer's new value run once per step
    for name in captured.buffer_mutations:
        if name in static:
            for line in static[name]:
                if line not in prologue:
                    prologue.append(line)
    for name in outputs:
        if name in input_views and name not in owner:
            chain = " -> ".join(line.name for line in static[name])
            raise UnsupportedOperation(
                f"output {name!r} is a view of a view of a model input ({chain}); Rockmate returns an "
                "input itself or one view of it: return the input's view in one op (e.g. one "
                "`reshape`), or a copy of it (`.clone()`)"
            )
        if name in static and name not in owner:  # (an input's view is static and a global)
            raise UnsupportedOperation(
                f"output {name!r} does not depend on the model's inputs; Rockmate needs outputs "
                "computed from the inputs"
            )
    simplified = SimplifiedGraph(
        captured=captured,
        nodes=[nodes[name] for name in order],
        global_views=global_views,
        buffer_updates_prologue=prologue,
        owner=owner,
        outputs=outputs,
        updated_first=made_first,
        buffer_updates_first=first_lines,
    )
    _move_views_to_their_reader(simplified)
    _group_views_of_results(simplified)
    return _sink_free_nodes(simplified)


def _move_views_to_their_reader(graph: SimplifiedGraph) -> None:
    """Make a view of a node's result that one other node alone reads in that node, as eager
    makes it where the model's code does.

    Eager adds the gradient contributions of a tensor in the order its engine runs their
    backward nodes (the latest created first); a view's backward is one of them, placed by
    where the view was made. Made in its reader's island, the view's contribution reaches the
    node's gradient among the others in that order (the reader's reads are split, see
    :class:`rkgb.gradsink.GradientQueue`), and with its layout: a transposed gradient added
    first makes the sum transposed, and a bias's gradient, a reduction over it, rounds as in
    eager. A view that the node itself, the user or two nodes read stays in the node's body
    (one leaf whose contributions the view's own backward sums first, as eager's does), and
    so does one made before an in-place write of the node's result.
    """
    outputs = set(graph.outputs) | set(graph.captured.user_outputs)
    line_holder = {line.name: node.name for node in graph.nodes for line in node.lines}
    position = _fx_positions(graph)
    for node in graph.nodes:
        for line in reversed(list(node.body)):
            # (a piece of a split is a view too: the pieces go first, then the split they read)
            piece = classify(line) is OpKind.GETITEM and isinstance(line.args[0], torch.fx.Node) \
                and line.args[0].op == "call_function" and classify(line.args[0]) is OpKind.VIEW
            if (classify(line) is not OpKind.VIEW and not piece) or line.name in outputs or not line.users:
                continue
            later = node.body[node.body.index(line) + 1:]
            if any(classify(other) is OpKind.INPLACE for other in later):
                continue
            if _piece(line) is not None and line.args[0] in node.lines and _disjoint_pieces(line.args[0], graph) \
                    and _views_alone_reach(line.args[0], node):
                # disjoint parts of the result (nn.MultiheadAttention's q, k and v): kept as its
                # views, their gradients part-sized until the node's backward runs the parts'
                # backward, as eager's do (made in their readers, each reader's gradient was the
                # result's size, the whole projection's where one SDPA reads the three)
                continue
            readers = {line_holder.get(user.name) for user in line.users}
            if piece:  # the split moves with its pieces: all of them read by that one node
                readers |= {line_holder.get(user.name) for sibling in line.args[0].users for user in sibling.users}
            if len(readers) != 1 or None in readers or node.name in readers:
                continue
            reader = graph.node(readers.pop())
            node.body.remove(line)
            if position[line.name] > position[reader.main.name]:
                # made after the reader's own operation (a slice of a tensor that the reader
                # writes into its clone): there, as eager makes it, its backward node is
                # created after the reader's (the engine runs it first)
                at = next((i for i, other in enumerate(reader.body) if position[other.name] > position[line.name]),
                          len(reader.body))
                reader.body.insert(at, line)
            else:
                # before the first line that reads it or that is a view of the same tensor made
                # after it: views of one result read together (LongT5's three slices of its
                # padded keys, read by one `cat`) are made in eager's order, their backward nodes
                # created in it, and the engine runs them (and sums their contributions) in
                # eager's order, the latest made first (made in the reverse order, its sums
                # rounded otherwise). Other lines (static ones) keep their place: the blocks of
                # one class keep one order
                reader.prelude.insert(min(_first_reading(reader.prelude, line),
                                          _first_sibling_made_after(reader.prelude, line, position)), line)
            line_holder[line.name] = reader.name


def _group_views_of_results(graph: SimplifiedGraph) -> None:
    """Make a view of a node's result that several other nodes read in each of them, where
    eager's order of the result's gradient contributions needs it.

    Eager sums a view's contributions in the view's own buffer and adds the sum into the
    result's gradient when the view's backward runs, which is where the view was made in the
    engine's order (the latest made first): after the nodes made after the view, before those
    made before it. A view kept in the node's body runs its backward with the node's, after
    every reader of the result: where a node made before the view also reads the result (or a
    view of it), the sums differ in their last bits. Made in each reader (the same line in
    every prelude), its contributions form a group that the executor sums apart and adds into
    the result's gradient at the view's place (``exec.codegen``, view groups); the plan counts
    the group's sum (``rkgb.build.first_run_bytes``). Views that the user gets, that the node
    itself reads, or made before an in-place write of the result stay in the body.
    """
    outputs = set(graph.outputs) | set(graph.captured.user_outputs)
    position = _fx_positions(graph)
    holder = {line.name: node.name for node in graph.nodes for line in node.lines}
    for node in graph.nodes:
        own = {other.name for other in node.lines}
        for line in list(node.body):
            if classify(line) is not OpKind.VIEW or not line.args or not isinstance(line.args[0], torch.fx.Node) \
                    or line.args[0].name not in own:
                continue
            main = line.args[0]  # the node's result, or a view of it that the node exports
            later = node.body[node.body.index(line) + 1:]
            if any(classify(other) is OpKind.INPLACE for other in later):
                continue
            family = [line] + [user for user in line.users if user.target is operator.getitem
                               and holder.get(user.name) == node.name]
            names = {member.name for member in family}
            if names & outputs:
                continue
            readers: list[str] = []
            nested = False
            for member in family:
                for user in member.users:
                    if user.name in names:
                        continue
                    owner = holder.get(user.name)
                    if owner is None or owner == node.name:
                        nested = True
                    elif owner not in readers:
                        readers.append(owner)
            if nested or len(readers) < 2:
                continue
            # a node made before the view that reads the result itself
            early = any(holder.get(user.name) not in (None, node.name) and user.name not in names
                        and position[graph.node(holder[user.name]).main.name] < position[line.name]
                        for user in main.users)
            if not early or (main is not node.main and main.name not in graph.exported(node)):
                continue
            if main is node.main and _split_summed_exactly(line, family[1:], main, outputs):
                continue
            for member in family:
                node.body.remove(member)
            for name in readers:
                reader = graph.node(name)
                for member in family:
                    if any(user.name in {l.name for l in reader.lines} for user in member.users) or member is line:
                        reader.prelude.insert(_first_reading(reader.prelude, member), member)
            graph.grouped_views[line.name] = main.name
    # a view moved to its one reader (_move_views_to_their_reader) whose contribution would
    # reach the result's gradient before those of nodes made between the view and its reader
    # (a view of a node's result: not of a static value that preludes recompute, an attention
    # mask built with ``ones``, which gets no gradient)
    made = {line.name: node.name for node in graph.nodes for line in [node.main] + node.body}
    for reader in graph.nodes:
        for line in reader.prelude:
            if classify(line) is not OpKind.VIEW or line.name in graph.grouped_views or not line.args \
                    or not isinstance(line.args[0], torch.fx.Node) or line.args[0].name not in made:
                continue
            base = line.args[0]
            owner = graph.node(made[base.name])
            if owner is reader:
                continue
            between = any(holder.get(user.name) not in (None, owner.name, reader.name)
                          and position[line.name] < position[graph.node(holder[user.name]).main.name]
                          < position[reader.main.name]
                          for user in base.users)
            if between and not _disjoint_pieces(base, graph):
                graph.grouped_views[line.name] = base.name


def _split_summed_exactly(split: torch.fx.Node, pieces: list[torch.fx.Node], result: torch.fx.Node,
                          outputs: set[str]) -> bool:
    """Whether a split of a node's ``result`` can stay in the node's body (its ``pieces``
    exported), its readers' gradients piece-sized, the split's backward run once by the node's,
    as eager's split node does, where a group made in each reader would make a result-sized
    gradient per reader (``chunk`` read by two nodes: one more result-sized tensor than eager).

    The gradients' sums are then made in another order than eager's (the node's backward runs
    the split's after the backward of nodes made before the split), so only where every sum has
    at most two terms, which add up the same in either order: each piece read at most twice, and
    the result read once at most beside the split (the user's gradient counted)."""
    def reads(value: torch.fx.Node, users) -> int:  # (``a * a`` reads ``a`` twice: two terms)
        return sum(arg is value for user in users for arg in _input_nodes(user))

    if split.target not in SPLIT_TARGETS or not pieces or any(reads(piece, piece.users) > 2 for piece in pieces):
        return False
    return reads(result, [user for user in result.users if user is not split]) + (result.name in outputs) <= 1


def _piece(line: torch.fx.Node) -> tuple[int, int, int] | None:
    """``(dim, start, stop)`` of the part of its input that ``line`` views where it is a
    ``select`` or a ``slice`` with step 1 (dimension and bounds normalized), else None."""
    base = line.args[0].meta.get("val") if line.args and isinstance(line.args[0], torch.fx.Node) else None
    if not isinstance(base, torch.Tensor) or base.dim() == 0:
        return None
    if line.target is torch.ops.aten.select.int:
        dim = line.args[1] % base.dim()
        index = line.args[2] % base.shape[dim]
        return dim, index, index + 1
    if line.target is torch.ops.aten.slice.Tensor:
        args = list(line.args) + [None] * (5 - len(line.args))
        dim = (args[1] if args[1] is not None else 0) % base.dim()
        size = base.shape[dim]
        start, stop, step = args[2] if args[2] is not None else 0, args[3] if args[3] is not None else size, args[4] or 1
        if step != 1:
            return None
        start, stop = (start + size if start < 0 else start), (stop + size if stop < 0 else stop)
        return dim, max(0, min(start, size)), max(0, min(stop, size))
    return None


def _disjoint_pieces(base: torch.fx.Node, graph: SimplifiedGraph) -> bool:
    """Whether every read of node result ``base`` is a ``select`` or ``slice`` of it, along one
    dimension, each of another part (``nn.MultiheadAttention``'s q, k and v of its packed
    projection), each read by one node (the user may get ``base`` too).

    Each part's gradient then reaches ``base``'s as a tensor of zeros but in its part: at each
    element at most two terms of the sum are not zeros (one part's, and the user's where
    ``base`` is returned), so that the sum is exact in any order (adding a zero to a number is
    exact, two numbers add the same either way, and zeros add up to a negative zero in any order
    only where all are): no part needs a view group to keep eager's order, and ``base``'s
    gradient is one buffer, as eager's, not one per group."""
    pieces = []
    for user in base.users:
        if user.op == "output":  # the user's gradient: dense, but one term beside one part's
            continue
        piece = _piece(user)
        if piece is None or len({holder for holder in _readers_of(user, graph)}) > 1:
            return False
        pieces.append(piece)
    if len({dim for dim, _, _ in pieces}) != 1:
        return False
    spans = sorted((start, stop) for _, start, stop in pieces)
    return all(stop <= next_start for (_, stop), (next_start, _) in zip(spans, spans[1:]))


def _views_alone_reach(base: torch.fx.Node, node: SimplifiedNode) -> bool:
    """Whether ``base`` is ``node``'s result or a chain of views of it that nothing else reads
    (but the user): the gradient of the result then gets nothing from the node's other readers
    before base's does, so that base's parts kept in the node change no order of the sums (a part
    of a view of a result that other nodes read too, kept there, added its gradient after theirs
    where eager adds it among them: fuzz seed 113)."""
    line = base
    while line is not node.main:
        parent = line.args[0] if line.args and isinstance(line.args[0], torch.fx.Node) else None
        if parent is None or parent not in node.lines or classify(line) is not OpKind.VIEW:
            return False
        if any(user is not line and user.op != "output" for user in parent.users):
            return False
        line = parent
    return True


def _readers_of(line: torch.fx.Node, graph: SimplifiedGraph) -> set[str]:
    """The nodes with a line that reads ``line``."""
    return {node.name for node in graph.nodes for other in node.lines if line in other.all_input_nodes}


def _fx_positions(graph: SimplifiedGraph) -> dict[str, int]:
    """The place of every fx node in the captured graph (eager's order of creation)."""
    return {line.name: i for i, line in enumerate(graph.captured.graph.nodes)}


def _first_sibling_made_after(lines: list[torch.fx.Node], line: torch.fx.Node, position: dict[str, int]) -> int:
    """The index of the first of ``lines`` that reads the tensor ``line`` reads first (a view
    of the same tensor) and that the captured graph makes after ``line``, else their count."""
    if not line.args:
        return len(lines)
    base = line.args[0]
    return next((index for index, other in enumerate(lines)
                 if other.args and other.args[0] is base and position[other.name] > position[line.name]),
                len(lines))


def _first_reading(lines: list[torch.fx.Node], line: torch.fx.Node) -> int:
    """Where ``line`` goes in ``lines``: before the first line that reads it, else last."""
    for index, other in enumerate(lines):
        if line in other.all_input_nodes:
            return index
    return len(lines)


def _merge_static_lines(lines: list[torch.fx.Node], static_inputs, static) -> list[torch.fx.Node]:
    """Append to ``lines`` the static lines of ``static_inputs`` it lacks, in order."""
    for n in static_inputs:
        for line in static[n.name]:
            if line not in lines:
                lines.append(line)
    return lines


def _may_require_grad(fx_node: torch.fx.Node) -> bool:
    """Whether the value of ``fx_node`` can require grad (a floating or complex tensor)."""
    value = fx_node.meta.get("val")
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def _static_lines(static_inputs, static) -> list[torch.fx.Node]:
    return _merge_static_lines([], static_inputs, static)


def _add_deps(node, fx_node, inputs, owner, nodes, static) -> None:
    for n in inputs:
        if n.name in static:
            _merge_static_lines(node.prelude, [n], static)
            continue
        holder = owner.get(n.name)
        if holder is None:
            raise UnsupportedOperation(f"cannot place {describe_fx_node(fx_node)}: input {n.name!r} unknown")
        if holder in nodes:
            if holder != node.name and holder not in node.data_deps:
                node.data_deps.append(holder)
        elif holder not in node.globals_read:
            node.globals_read.append(holder)


def _sink_free_nodes(graph: SimplifiedGraph) -> SimplifiedGraph:
    """Move each deterministic node that reads no other node right before its first user.

    Such nodes (an RNN's input projection at step t) read only globals; placing them late
    keeps edges from jumping over the chain's separators. Random nodes keep their place so
    that they draw random numbers in the same order as eager PyTorch. A node does not move
    past one that reads a parameter or an input it reads too: the backwards run in the reverse
    order of the nodes, and eager adds the gradient contributions of a tensor in the reverse
    order of their creation (the sums round differently in another order).
    """
    users = graph.users()
    constants = set(graph.captured.buffers) | set(graph.captured.constants)
    reads = {node.name: graph.reads(node) - constants for node in graph.nodes}
    order = [node.name for node in graph.nodes]
    free = [n.name for n in graph.nodes if not n.data_deps and not n.is_random and users[n.name]]
    for name in free:
        start = order.index(name)
        order.remove(name)
        target = min(order.index(u) for u in users[name])
        for position in range(start, target):
            if reads[order[position]] & reads[name]:
                target = position
                break
        order.insert(target, name)
    graph.nodes = [graph.node(name) for name in order]
    graph.__post_init__()
    return graph


SPLIT_TARGETS = (torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default)


def split_of_view(view: torch.fx.Node, lines) -> torch.fx.Node | None:
    """The one split through which ``lines`` (an island) read ``view``, a view of its input's
    shape that is not itself a split (``x.view(x.shape).chunk(2)``), or None: such reads are
    summed piece by piece before they join the view's group (``exec.codegen._group_argument``,
    counted by ``rkgb.build.first_run_bytes``)."""
    users = [line for line in lines if view in line.all_input_nodes]
    base = view.args[0].meta.get("val") if view.args and isinstance(view.args[0], torch.fx.Node) else None
    value = view.meta.get("val")
    if view.target in SPLIT_TARGETS or len(users) != 1 or users[0].target not in SPLIT_TARGETS \
            or not isinstance(base, torch.Tensor) or not isinstance(value, torch.Tensor) \
            or tuple(base.shape) != tuple(value.shape):
        return None
    return users[0]


# views whose backward sums the gradient (an ``expand``'s sums over the expanded dimensions, an
# ``unfold``'s over overlapping windows): the sum of two readers' gradients taken through such a
# backward apart rounds otherwise than eager's one backward of their sum
SUMMING_VIEW_TARGETS = (torch.ops.aten.expand.default, torch.ops.aten.unfold.default)


def _views_from(root: torch.fx.Node) -> list[torch.fx.Node]:
    """``root`` and the views after it, each the one user of the one before."""
    chain = [root]
    while True:
        users = list(chain[-1].users)
        if len(users) != 1 or users[0].op != "call_function" or classify(users[0]) is not OpKind.VIEW \
                or len(users[0].all_input_nodes) != 1:
            break
        chain.append(users[0])
    return chain


def summing_view_chain(root: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The views from ``root`` (a view of one tensor) on, each the one user of the one before,
    up to the last whose backward sums (:data:`SUMMING_VIEW_TARGETS`): ``x[None].expand(4, -1,
    -1)`` from the ``unsqueeze``. None where no view of that chain sums.

    A gradient group of ``root`` (view groups, ``exec.codegen``) sums its readers' gradients
    after each reader's island has run the whole chain's backward: exact for views that only
    re-view or place the gradient, not for those that sum. The group of such a chain sums at the
    size of its last view, and runs the chain's backward once on the sum
    (:meth:`rkgb.gradsink.GradientQueue.alias`'s ``through``), as eager does; the plan counts
    that sum at the view's size (``rkgb.build.first_run_bytes``)."""
    chain = _views_from(root)
    summing = [i for i, line in enumerate(chain) if line.target in SUMMING_VIEW_TARGETS]
    return chain[: summing[-1] + 1] if summing else None


def input_view_chain(root: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The chain of views from ``root`` (a view of a model input made in each reader's prelude)
    whose gradients the executor sums at the size of its last view: a summing chain
    (:func:`summing_view_chain`), or else the whole chain of views from ``root`` (each the one
    user of the one before) where its last view has fewer elements than the input (a slice, a
    ``select``: its backward places the gradient into zeros of the input's size). None otherwise.

    Eager's buffer of such a view holds the view's gradient, and its backward makes the
    input-sized tensor once, when it runs. Each reading island running the chain's backward
    apart would make one input-sized tensor per read, all held until the view's place in the
    backward (``cat([x[:, :4], x[:, 4:]])`` held two: 1.2x eager's peak, fuzz seed 135)."""
    summing = summing_view_chain(root)
    if summing is not None:
        return summing
    chain = _views_from(root)
    base = root.all_input_nodes[0].meta.get("val") if len(root.all_input_nodes) == 1 else None
    last = chain[-1].meta.get("val")
    if not isinstance(base, torch.Tensor) or not isinstance(last, torch.Tensor) or last.numel() >= base.numel():
        return None
    return chain


def summed_parameter_views(graph: "SimplifiedGraph", trained: set[str] | frozenset[str]) -> dict[str, list[torch.fx.Node]]:
    """Views of a trained parameter made once (``graph.global_views``) whose backward sums, that
    several nodes read: the view's fx name -> the chain of views from the parameter to it
    (:func:`summing_view_chain`). Each reader's island would run the view's backward on its own
    gradient (Perceiver's ``latents.expand(batch, ...)``, read by a layer norm and a residual),
    where eager sums first; the executor sums these views' gradients as a group."""
    readers: dict[str, set[str]] = {}
    for node in graph.nodes:
        for line in node.lines:
            for arg in line.all_input_nodes:
                readers.setdefault(arg.name, set()).add(node.name)
    globals_ = {line.name for line in graph.global_views}
    result: dict[str, list[torch.fx.Node]] = {}
    for line in graph.global_views:
        args = line.all_input_nodes
        if len(args) != 1 or args[0].name not in trained or line.name in graph.outputs:
            continue
        chain = summing_view_chain(line)
        if chain is None or any(view.name not in globals_ for view in chain):
            continue
        end = chain[-1]
        if len(readers.get(end.name, ())) > 1 and end.name not in graph.outputs:
            result[end.name] = chain
    return result


def summed_input_views(graph: "SimplifiedGraph", requiring_grad: set[str] | frozenset[str]
                       ) -> dict[str, tuple[str, list[torch.fx.Node]]]:
    """The view groups of model inputs that require grad (views made in their readers'
    preludes, ``SimplifiedGraph.input_view_readers``) whose chain of views sums in its backward
    or makes a smaller tensor (:func:`input_view_chain`), made whole in every reader's prelude and
    not read through a split (and, for a smaller one, made before one of its readers: made after
    them all, its backward runs first, and each read's contribution joins the input's gradient
    at once, ``rkgb.build.first_run_bytes``): the chain's last view -> (the input, the chain).
    The executor sums their gradients at the view's size (``exec.codegen``); the inspection
    reads that view as a leaf of its own."""
    result: dict[str, tuple[str, list[torch.fx.Node]]] = {}
    preludes = [(node, {line.name for line in node.prelude}) for node in graph.nodes]
    position = {line.name: i for i, line in enumerate(graph.captured.graph.nodes)}
    for name in requiring_grad:
        for root in graph.input_view_readers(name):
            line = next(line for node in graph.nodes for line in node.prelude if line.name == root)
            if line.target in SPLIT_TARGETS:
                result.update(_summed_pieces(graph, name, line, preludes, position))
                continue
            chain = input_view_chain(line)
            if chain is None or not isinstance(chain[-1].meta.get("val"), torch.Tensor) \
                    or any(view.name in graph.outputs for view in chain):
                continue
            readers = [(node, names) for node, names in preludes if root in names]
            if summing_view_chain(line) is None and all(position[root] > position[node.main.name]
                                                        for node, _ in readers):
                continue  # made after its readers: its place in the backward is before theirs
            if all(all(view.name in names for view in chain) and split_of_view(line, node.lines) is None
                   for node, names in readers):
                result[chain[-1].name] = (name, chain)
    return result


def _summed_pieces(graph: "SimplifiedGraph", name: str, split: torch.fx.Node, preludes: list, position: dict
                   ) -> dict[str, tuple[str, list[torch.fx.Node]]]:
    """:func:`summed_input_views` for a split of input ``name`` (``x.chunk(2)``) made in its
    readers' preludes, each of which reads it through pieces (``getitem`` lines) made in its
    prelude alone: each piece read -> (the input, [the split, the piece]), none where a piece is
    returned or the split is made after all its readers. Eager's split node sums each piece's
    gradients in a slot of the piece's size, and its backward makes one input-sized tensor, the
    pieces no reader read as zeros; the executor sums the pieces as groups of their own and runs
    the split's backward once on them all (``rkgb.gradsink.GradientQueue.deliver``), where each
    reading island would make an input-sized tensor of its own."""
    readers = [(node, names) for node, names in preludes if split.name in names]
    pieces: dict[str, torch.fx.Node] = {}
    for node, names in readers:
        users = [line for line in node.lines if split in line.all_input_nodes]
        if any(line.target is not operator.getitem or line.name not in names for line in users):
            return {}
        pieces.update((line.name, line) for line in users)
    if not pieces or any(piece in graph.outputs for piece in pieces) or split.name in graph.outputs \
            or all(position[split.name] > position[node.main.name] for node, _ in readers):
        return {}
    return {piece: (name, [split, line]) for piece, line in pieces.items()}


def parameter_gradient_sources(graph: "SimplifiedGraph", name: str, summed: dict[str, list[torch.fx.Node]]
                               ) -> tuple[set[str], int]:
    """Where the gradient of parameter ``name`` comes from: the nodes that read it (or a view of
    it) other than through the views of ``summed`` (:func:`summed_parameter_views`), and how many
    of those views it has (each gives it one contribution, when its group is delivered). A
    parameter with one source in all needs no sum of its contributions apart
    (``exec.runtime._stash_grad``): eager's ``AccumulateGrad`` adds that one into ``.grad``."""
    views = [view for view, chain in summed.items() if chain[0].all_input_nodes[0].name == name]
    through = {line.name for view in views for line in summed[view]}
    direct = {node.name for node in graph.nodes for line in node.lines for arg in line.all_input_nodes
              if arg.name not in through and graph.owner.get(arg.name, arg.name) == name}
    return direct, len(views)
