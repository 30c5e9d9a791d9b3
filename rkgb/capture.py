"""Capture a model with torch.export into a functional ATen graph.

The graph is torch.export's (non-strict) training graph, functionalized by
``run_decompositions({})``: buffer mutations become explicit outputs (BatchNorm's running
statistics), in-place operations become functional ones, and high-level operations
(linear, matmul, layer_norm, gelu, softmax, scaled_dot_product_attention, embedding,
convolution) stay undecomposed. A graph that writes no buffer nor input in place is lowered to
the same graph without that retrace (:mod:`rkgb.decompose`).

torch.export lowers ``dropout`` to ``native_dropout`` (a value and a bool mask). Eager PyTorch
runs ``native_dropout`` only on devices with a fused kernel (CUDA); on CPU it draws a float
noise (``empty_like``, ``bernoulli_``, ``div_``) and returns ``x * noise``, saving the noise.
:func:`restore_dropout` makes every device run exactly eager's kernels (the same random
numbers, the same saved tensors) wherever the mask is unused:

- on CUDA, ``aten.dropout``, which dispatches to the fused kernel as eager does;
- on CPU, eager's own decomposition, written as three nodes: a one-byte mask (random), the float
  noise made from it (without grad) and ``mul`` (see :func:`_cpu_dropout`). ``bernoulli_``
  costs about ten elementwise passes on CPU; with these nodes a plan can keep the noise,
  which the backward needs anyway, and recompute the output by one multiplication, or keep
  only the mask and rebuild the noise by one conversion, instead of drawing again.

A custom ``torch.autograd.Function`` that the forward applies to tensors requiring grad is
captured as one operation that applies the Function itself (:mod:`rkgb.functions`): export
keeps its forward and drops its backward.
"""

from __future__ import annotations

import contextlib
import io
import logging
import operator
import os
import sys
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import torch._inductor.config  # noqa: F401 - fallback_random, see capture()
import torch.fx._lazy_graph_module
import torch.nn.attention
from torch import nn
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.overrides import TorchFunctionMode
from torch.export.graph_signature import InputKind, OutputKind

from .decompose import decompose_functional_graph
from .errors import CaptureError, UnsupportedOperation, describe_fx_node
from .functions import CustomFunctions, FunctionCallError

__all__ = ["CapturedGraph", "capture", "as_input_tuple", "device_of", "restore_dropout"]


@dataclass
class CapturedGraph:
    """A functional ATen graph and how its placeholders and outputs map to the model.

    ``parameters`` and ``buffers`` map placeholder names to the model's attribute paths; a
    tied parameter (one tensor under two names) is one placeholder. ``inputs`` lists, for
    each positional argument of the model, the placeholder name of a tensor argument or
    ``None`` for a non-tensor argument (a constant baked into the graph).
    ``buffer_mutations`` maps output fx-node names to the buffer path they update.
    ``out_spec``: the pytree structure of the model's output (a tuple, a dict, a
    ``ModelOutput``...), whose leaves are ``user_outputs`` in order.
    """

    graph: torch.fx.Graph
    parameters: dict[str, str]
    buffers: dict[str, str]
    constants: dict[str, torch.Tensor]
    inputs: list[str | None]
    user_outputs: list[str]
    buffer_mutations: dict[str, str]
    output_is_tuple: bool
    out_spec: object = None
    # constant placeholders that are plain tensor attributes of the model -> their paths (not
    # a parameter nor a buffer: ``self.scale = torch.ones(d)``), which the user may replace
    constant_paths: dict[str, str] = field(default_factory=dict)
    # why the export's graph was lowered by ``run_decompositions`` (its whole retrace); None
    # where :mod:`rkgb.decompose` lowered it in place (a graph that writes no buffer in place)
    retraced: str | None = None

    def placeholder_values(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The current tensors behind the parameter, buffer and constant placeholders."""
        values: dict[str, torch.Tensor] = dict(self.constants)
        for name, path in self.parameters.items():
            values[name] = model.get_parameter(path)
        for name, path in self.buffers.items():
            values[name] = model.get_buffer(path)
        return values


def as_input_tuple(sample) -> tuple:
    """The sample as a tuple of positional arguments (a lone tensor becomes a 1-tuple)."""
    if isinstance(sample, tuple):
        return sample
    if isinstance(sample, list):
        return tuple(sample)
    return (sample,)


def restore_dropout(graph: torch.fx.Graph, device: torch.device, renamed: dict[str, str] | None = None) -> int:
    """Replace ``native_dropout(x, p, True)[0]`` by eager's dropout on ``device`` where the mask
    is unused (see the module docstring); returns how many were replaced. ``renamed`` receives
    the old name -> new name of each replaced value (the export's signature names outputs)."""
    native, getitem = torch.ops.aten.native_dropout.default, operator.getitem
    replaced = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not native:
            continue
        x, p, train = (list(node.args) + [None] * 3)[:3]
        users = list(node.users)
        if train is not True or not all(u.target is getitem and u.args[1] == 0 for u in users):
            continue
        value = node.meta["val"][0]
        with graph.inserting_before(node):
            if device.type == "cpu" and 0 < p < 1 and value.numel() > 0:
                # an unused dropout only draws its random numbers, as eager's does
                dropout = _cpu_dropout(graph, x, p, value, draw_only=not users)
            else:
                dropout = graph.call_function(torch.ops.aten.dropout.default, (x, p, True))
        dropout.meta = dict(node.meta)
        dropout.meta["val"] = value
        for user in users:
            if renamed is not None:
                renamed[user.name] = dropout.name
            user.replace_all_uses_with(dropout)
            graph.erase_node(user)
        graph.erase_node(node)
        replaced += 1
    if replaced:
        graph.lint()
    return replaced


def _scatter_views() -> dict:
    aten = torch.ops.aten
    return {
        aten.select_scatter.default: aten.select.int,
        aten.slice_scatter.default: aten.slice.Tensor,
        aten.diagonal_scatter.default: aten.diagonal.default,
        aten.as_strided_scatter.default: aten.as_strided.default,
    }


_VIEW_TARGETS = {
    torch.ops.aten.select.int, torch.ops.aten.slice.Tensor, torch.ops.aten.diagonal.default,
    torch.ops.aten.as_strided.default, torch.ops.aten.view.default, torch.ops.aten.transpose.int,
}


def _inplace_variant(target):
    """``aten.add_.Tensor`` for ``aten.add.Tensor`` (None when there is none)."""
    packet = getattr(torch.ops.aten, target._overloadpacket.__name__ + "_", None)
    return getattr(packet, target._overloadname, None) if packet is not None else None


def restore_inplace_writes(graph: torch.fx.Graph, renamed: dict[str, str] | None = None) -> int:
    """Write into views in place again, as eager does: ``x[:, 0] = y`` and ``x[:, 1:3] += z``.

    Functionalization turns an in-place write into a view of ``x`` into a functional op on the
    view (``copy``, ``add``, ``fill``) and a ``*_scatter`` of the result into a new ``x``. Their
    backward is not eager's: ``select_scatter``'s gives the gradient of ``x`` in the gradient's
    layout, where eager's ``CopySlices`` gives it in ``x``'s, and a reduction over it (a bias
    gradient) then rounds differently. Where ``x`` is read by nothing else (its old value is
    dead: a clone made to be written, the usual pattern), the scatter becomes the in-place op
    on the view again (``copy_``, ``add_``, ``fill_``), and its result is ``x``. Returns how many
    writes were restored; ``renamed`` receives the old name -> new name of each replaced value.
    """
    views = _scatter_views()
    rewritten: set[torch.fx.Node] = set()  # views and in-place writes made here
    restored = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in views:
            continue
        base, value, view_args = node.args[0], node.args[1], tuple(node.args[2:])
        if base.op != "call_function":
            continue  # an input or a parameter: written in place, it must stay functional
        view = value.args[0] if value.op == "call_function" and value.args else None
        in_place = None
        if (isinstance(view, torch.fx.Node) and view.op == "call_function" and view.target is views[node.target]
                and view.args[0] is base and tuple(view.args[1:]) == view_args and set(value.users) == {node}
                and set(view.users) == {value} and isinstance(value.target, torch._ops.OpOverload)):
            in_place = _inplace_variant(value.target)
        chain = {node, value} | ({view} if in_place is not None else set())
        others = set(base.users) - rewritten - chain
        # views of x read only by this write (its source: x[:, a] = x[:, b]) read x as it is now
        if any(other.target not in _VIEW_TARGETS or not set(other.users) <= chain for other in others):
            continue  # x's value before the write is read elsewhere
        with graph.inserting_before(node):
            if in_place is not None:
                write = graph.call_function(in_place, value.args, value.kwargs)
                write.meta = dict(value.meta)
                rewritten |= {view, write}
            else:
                view = graph.call_function(views[node.target], (base, *view_args))
                view.meta["val"] = _fake_call(views[node.target], (base, *view_args))
                write = graph.call_function(torch.ops.aten.copy_.default, (view, value))
                write.meta["val"] = view.meta["val"]
                rewritten |= {view, write}
        _replace_by_written(graph, node, base, renamed)
        if in_place is not None:
            graph.erase_node(value)
        restored += 1
    if restored:
        graph.lint()
    return restored


def user_inplace_ops(graph: torch.fx.Graph) -> dict[str, object]:
    """The in-place ops of the export's training graph (before functionalization) that write
    an intermediate result (``out.relu_()``, ``out += identity``): name -> target."""
    found = {}
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        schema = node.target._schema
        writes_self = bool(schema.arguments) and schema.arguments[0].alias_info is not None \
            and schema.arguments[0].alias_info.is_write
        if writes_self and node.args and isinstance(node.args[0], torch.fx.Node) and node.args[0].op == "call_function":
            found[node.name] = node.target
    return found


def _origins(node: torch.fx.Node) -> set[str]:
    """The names of the nodes of earlier graphs that ``node`` comes from (its ``from_node`` chain)."""
    names: set[str] = set()
    pending = list(node.meta.get("from_node") or ())
    while pending:
        source = pending.pop()
        names.add(getattr(source, "name", ""))
        pending.extend(getattr(source, "from_node", None) or ())
    return names


# in-place writes whose backward passes the incoming gradient on as it is (``out += identity``)
_PASS_THROUGH_WRITES = {torch.ops.aten.add_.Tensor, torch.ops.aten.sub_.Tensor}


def restore_inplace_ops(graph: torch.fx.Graph, inplace: dict[str, object], varying: set[str],
                        renamed: dict[str, str] | None = None, requiring: set[str] = frozenset(),
                        mutations: set[str] = frozenset()) -> int:
    """Run in place again the additions that the user's code runs in place on an intermediate
    result (``out += identity``; ``inplace`` from :func:`user_inplace_ops`), which
    functionalization made out of place: the functional op allocates a second activation where
    eager writes into the first (more memory and, on CPU, fresh pages to fault in).

    Restored where the op's input is an intermediate computed from an input or a parameter
    (``varying``: their placeholders; a step counter's ``count += 1`` stays functional), that
    nothing else reads and that shares its storage with no other value (not a view, not a
    split's piece), with the result's shape, dtype and layout: exactly eager's write. The write
    becomes a line of its input's node, whose island's engine call holds its incoming gradient
    to its end: only writes whose backward passes that gradient on (``add_``, ``sub_``) are
    restored, or any write where no autograd runs (nothing it reads is computed from the
    placeholders that require grad, ``requiring``), a user's output included but not a buffer's
    new value (``mutations``); an ``nn.ReLU(inplace=True)`` on values that require grad stays
    out of place (README, Known limits). Returns how many; ``renamed`` receives the old name ->
    new name of each (readers read the written tensor, as :func:`restore_inplace_writes` makes
    them)."""
    storages: dict[object, int] = {}
    for node in graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            key = storage_identity(value)
            if key is not None:
                storages[key] = storages.get(key, 0) + 1
    restored = 0
    writes: set[torch.fx.Node] = set()
    depends: set[torch.fx.Node] = set()  # nodes computed from an input or a parameter
    with_grad: set[torch.fx.Node] = set()  # nodes computed from a placeholder that requires grad
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name in varying) or any(a in depends for a in node.all_input_nodes):
            depends.add(node)
        if (node.op == "placeholder" and node.name in requiring) or any(a in with_grad for a in node.all_input_nodes):
            with_grad.add(node)
    for node in list(graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) or not node.args:
            continue
        in_place = _inplace_variant(node.target)
        if in_place is None or (in_place not in _PASS_THROUGH_WRITES and node in with_grad) \
                or not any(inplace.get(name) is in_place for name in _origins(node)):
            continue
        x = node.args[0]
        if any(user.op == "output" for user in node.users) and (node.name in mutations or node in with_grad):
            # a new buffer value (``mutations``: written where the graph says, exec.codegen), or
            # an output that requires grad
            continue
        # (x's earlier users may be writes restored here: out += identity, then out.relu_())
        if not isinstance(x, torch.fx.Node) or x.op != "call_function" or set(x.users) - writes != {node} \
                or x not in depends:
            continue
        before, after = x.meta.get("val"), node.meta.get("val")
        if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)) \
                or before.shape != after.shape or before.dtype != after.dtype or before.stride() != after.stride() \
                or storages.get(storage_identity(before), 0) != 1:
            continue
        with graph.inserting_before(node):
            write = graph.call_function(in_place, node.args, node.kwargs)
        write.meta = dict(node.meta)
        write.meta["val"] = before
        writes.add(write)
        _replace_by_written(graph, node, x, renamed)
        restored += 1
    if restored:
        graph.lint()
    return restored


def merge_regenerated_views(graph: torch.fx.Graph, targets: dict[str, object]) -> int:
    """Make one node of identical views that functionalization made again from a written base.

    After an in-place write (``out.mul_(x)``), functionalization replays the views of the
    written tensor for each of their readers: ``left, right = out.split(4, -1)`` becomes one
    ``split`` per piece. Eager has one split node, whose backward puts the pieces' gradients
    side by side; two splits give two contributions padded with zeros, whose sum turns a -0.0
    into +0.0. Views with the same target and arguments, none of whose origins (``targets``:
    the export's nodes before functionalization, name -> target) is a view of that target,
    become one. Returns how many were merged."""
    seen: dict[tuple, torch.fx.Node] = {}
    merged = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not _returns_alias(node.target):
            continue
        origins = _origins(node)
        if not origins or any(targets.get(name) is node.target for name in origins):
            continue  # the user's own view (or of unknown origin)
        key = (node.target, repr(node.args), repr(node.kwargs), tuple(sorted(origins)))
        first = seen.setdefault(key, node)
        if first is not node:
            node.replace_all_uses_with(first)
            graph.erase_node(node)
            merged += 1
    if merged:
        graph.lint()
    return merged


@dataclass(frozen=True)
class _TracedView:
    """A view op of the export's graph before functionalization: its target, the name of the
    tensor it views and its other arguments (printed)."""

    target: object
    base: str
    rest: str


@dataclass
class TracedProgram:
    """The export's graph before functionalization, as :func:`place_regenerated_views` needs
    it: each node's place (name -> index) and its view ops (name -> :class:`_TracedView`)."""

    places: dict[str, int]
    views: dict[str, _TracedView]
    # an op that writes its first argument in place -> the name of the tensor it writes
    writes: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, graph: torch.fx.Graph) -> "TracedProgram":
        places, views, writes = {}, {}, {}
        for place, node in enumerate(graph.nodes):
            places[node.name] = place
            if node.op == "call_function" and _returns_alias(node.target) and node.args \
                    and isinstance(node.args[0], torch.fx.Node):
                views[node.name] = _TracedView(node.target, node.args[0].name, repr(node.args[1:]))
            elif node.op == "call_function" and _writes_first_argument(node.target) and node.args \
                    and isinstance(node.args[0], torch.fx.Node):
                writes[node.name] = node.args[0].name
        return cls(places, views, writes)

    def written_bases(self, name: str) -> set[str]:
        """The tensors that the in-place op ``name`` writes: its first argument and, through
        the views it is made of, their bases (``copy_`` into a slice of ``out``: ``out``)."""
        found: set[str] = set()
        tensor = self.writes.get(name)
        while tensor is not None and tensor not in found:
            found.add(tensor)
            tensor = self.views[tensor].base if tensor in self.views else None
        return found


def place_regenerated_views(graph: torch.fx.Graph, traced: TracedProgram) -> int:
    """Move the views that functionalization made again at the end of the graph back to where
    the program made them.

    A returned view of a tensor the program writes in place (``out.mul_(y); v = out.view(s)``,
    with later readers of ``out``) is dropped by functionalization and made again from the
    written value just before the output, with no trace of its place (no ``from_node``, no stack
    trace). Its place matters: eager's engine adds the view's gradient into its base's after the
    gradients of the readers made after the view (:func:`exec.codegen._result_views_made_late`).
    Each such view is matched with the traced view of the same op and arguments on the same base
    (by the base's origins) that no functional node comes from, and moved before the first node
    that comes from a traced node made after it. Returns how many were moved (or merged,
    :func:`_merge_view_copies`)."""
    moved = _merge_view_copies(graph, traced)
    place_of: dict[str, int] = {}
    used: set[str] = set()
    for node in graph.nodes:
        origins = _origins(node)
        used |= origins
        places = [traced.places[name] for name in origins if name in traced.places]
        if places:
            place_of[node.name] = max(places)
    matched: dict[str, str] = {}  # a regenerated view -> the traced view it is made again from
    for node in list(graph.nodes):
        if node.op != "call_function" or node.meta.get("from_node") or node.meta.get("stack_trace") \
                or not _returns_alias(node.target) or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        base = node.args[0]
        base_names = _origins(base) | {matched.get(base.name, base.name)}
        candidates = [name for name, view in traced.views.items()
                      if name not in used and name not in matched.values() and view.target is node.target
                      and view.base in base_names and view.rest == repr(node.args[1:])]
        if not candidates:
            continue
        name = min(candidates, key=traced.places.__getitem__)
        matched[node.name] = name
        place = place_of[node.name] = traced.places[name]
        later = next((other for other in _nodes_before(base.next, node) if place_of.get(other.name, -1) > place), None)
        if later is not None:
            later.prepend(node)
            moved += 1
    if moved:
        graph.lint()
    return moved


def _merge_view_copies(graph: torch.fx.Graph, traced: TracedProgram) -> int:
    """Make one node of the views that functionalization made several times from one traced
    view (the same op and arguments on the same base): the program made one tensor, whose
    gradient gathers its readers' and the user's contributions before it reaches the base.
    Made apart, each copy's contributions reached the base on its own, in another order than
    eager's (fuzz seed 231: a slice-assigned result, a view of it and a convolution of the view,
    all returned). Only where the traced program has exactly one such view. Returns how many
    copies were replaced."""
    groups: dict[tuple, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and _returns_alias(node.target) and node.args \
                and isinstance(node.args[0], torch.fx.Node):
            key = (node.target, node.args[0], repr(node.args[1:]), repr(node.kwargs))
            groups.setdefault(key, []).append(node)
    replaced = 0
    for (target, base, rest, _), nodes in groups.items():
        if len(nodes) < 2:
            continue
        base_names = _origins(base) | {base.name}
        for origin in list(base_names):  # (the new value of a tensor written in place)
            base_names |= traced.written_bases(origin)
        traced_views = [name for name, view in traced.views.items()
                        if view.target is target and view.base in base_names and view.rest == rest]
        if len(traced_views) != 1:
            continue
        for copy in nodes[1:]:
            copy.replace_all_uses_with(nodes[0])
            graph.erase_node(copy)
            replaced += 1
    if replaced:
        graph.lint()
    return replaced


def _nodes_before(first: torch.fx.Node, end: torch.fx.Node):
    """The nodes from ``first`` up to ``end`` (excluded) in their graph, in order."""
    current = first
    while current is not end and current.op != "root":
        yield current
        current = current.next


def _writes_first_argument(target) -> bool:
    """Whether ``target`` is an ATen op that writes its first argument in place (``copy_``)."""
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.arguments:
        return False
    alias = target._schema.arguments[0].alias_info
    return alias is not None and alias.is_write


def _returns_alias(target) -> bool:
    """Whether ``target`` is an ATen op that returns a view of an argument it does not write."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    return any(ret.alias_info is not None for ret in schema.returns) \
        and not any(arg.alias_info is not None and arg.alias_info.is_write for arg in schema.arguments)


def storage_identity(value) -> object | None:
    """The identity of a (fake) tensor's storage, to tell aliases apart; None for a value that
    is not a tensor or has no storage."""
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return value.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):  # a tensor without storage
        return None


def _replace_by_written(graph: torch.fx.Graph, node: torch.fx.Node, written: torch.fx.Node,
                        renamed: dict[str, str] | None) -> None:
    """Erase ``node`` (a functional write's result): its readers read the tensor the restored
    in-place write writes into, and ``renamed`` follows (old name -> ``written``'s)."""
    node.replace_all_uses_with(written)
    if renamed is not None:
        for old, new in list(renamed.items()):
            if new == node.name:
                renamed[old] = written.name
        renamed[node.name] = written.name
    graph.erase_node(node)


def _fake_call(target, args, kwargs=None):
    """The fake value of ``target(*args, **kwargs)`` from the arguments' fake values."""
    args, kwargs = torch.fx.node.map_arg((tuple(args), dict(kwargs or {})), lambda n: n.meta["val"])
    fake = next(a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor))
    with fake.fake_mode:
        return target(*args, **kwargs)


def differentiable_copies(graph: torch.fx.Graph, renamed: dict[str, str] | None = None) -> int:
    """Replace the functional ``aten.copy(self, src)`` (what ``x.copy_(src)`` and ``x[i] = src``
    become once functionalized: ``src`` in ``self``'s shape and dtype), which autograd cannot
    differentiate, by the same values made differentiably: ``src`` expanded to ``self``'s shape
    and converted to its dtype (``_to_copy``), or cloned when nothing changes. ``self``'s values
    are overwritten: it gets no gradient, as in eager. Returns how many were replaced;
    ``renamed`` receives the old name -> new name of each (the export's signature names
    outputs)."""
    aten = torch.ops.aten
    replaced = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.copy.default:
            continue
        target, src = node.args[0], node.args[1]
        value, source = node.meta["val"], src.meta["val"]
        with graph.inserting_before(node):
            current = src
            if tuple(source.shape) != tuple(value.shape):
                current = graph.call_function(aten.expand.default, (current, list(value.shape)))
                with value.fake_mode:
                    current.meta["val"] = source.expand(value.shape)
            if source.dtype != value.dtype or source.device != value.device:
                copy = graph.call_function(aten._to_copy.default, (current,),
                                           {"dtype": value.dtype, "device": value.device})
            else:
                copy = graph.call_function(aten.clone.default, (current,))
        copy.meta = dict(node.meta)
        if renamed is not None:
            renamed[node.name] = copy.name
        node.replace_all_uses_with(copy)
        graph.erase_node(node)
        replaced += 1
    if replaced:
        graph.lint()
    return replaced


def _written_aliases(graph: torch.fx.Graph) -> set[str]:
    """The nodes that an in-place op of ``graph`` writes, with every node they are a view of or
    that is a view of them (``getitem`` of a split included)."""
    base: dict[str, str] = {}
    for node in graph.nodes:
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        if node.target is operator.getitem or _returns_alias(node.target):
            base[node.name] = node.args[0].name

    def root(name: str) -> str:
        while name in base:
            name = base[name]
        return name

    written_roots = set()
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for position, argument in enumerate(node.target._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
            for arg in (value if isinstance(value, (list, tuple)) else [value]):
                if isinstance(arg, torch.fx.Node):
                    written_roots.add(root(arg.name))
    return {node.name for node in graph.nodes if root(node.name) in written_roots}


def dropouts_of_nothing(graph: torch.fx.Graph) -> int:
    """Remove the copy that a dropout of probability 0 becomes (``aten.clone``, from
    ``F.dropout(x, 0.0, training=True)``: transformers' attention with ``attention_dropout=0``):
    its readers read its input, as eager's dropout returns its input itself. No copy (one
    tensor of the attention's size per layer that the plan would hold beside eager's), and no
    autograd node of its own, whose place in the backward would change the order in which the
    input's gradient adds its contributions (not bitwise). Not where an in-place op writes
    either of them (functionalization made them two tensors), nor for a model output.
    Returns how many."""
    written = None
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.clone.default or node.kwargs:
            continue
        if (node.meta.get("torch_fn") or ("", ""))[1] != "function.dropout":
            continue
        if any(user.op == "output" for user in node.users):
            continue
        if written is None:
            written = _written_aliases(graph)
        if node.name in written or node.args[0].name in written:
            continue
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)
        removed += 1
    if removed:
        graph.lint()
    return removed


def attention_in_kernel_layout(graph: torch.fx.Graph, device: torch.device) -> int:
    """Give each attention's output the layout its kernel gives it, and drop the copies that
    ``contiguous()`` made of it only because the traced layout was another.

    The graph keeps the composite ``scaled_dot_product_attention``, whose fake value has the
    math kernel's layout (contiguous in (batch, heads, sequence, features)); the fused kernels
    eager runs (CPU's flash attention, CUDA's) return (batch, sequence, heads, features) in
    memory, so that transformers' ``attn_output.transpose(1, 2).contiguous()`` copies nothing
    in eager where export recorded a ``clone``: one copy of the attention's output per layer,
    which the output projection saves (Llama's plan without recomputation 5% above eager's
    peak). The kernel's layout is read from one real call on the device (random values of the
    arguments' shapes, strides and dtypes, with grad, once per distinct call), the same choice
    of kernel as the plan's own call. An attention whose output is read otherwise than through
    views ending in such copies keeps its traced value (its readers' layouts would follow).
    Returns how many copies were dropped."""
    aten = torch.ops.aten
    layouts: dict[tuple, tuple[int, ...] | None] = {}
    dropped = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.scaled_dot_product_attention.default:
            continue
        fake = node.meta.get("val")
        if not isinstance(fake, torch.Tensor):
            continue
        copies = _views_to_contiguous_copies(node)
        if not copies:
            continue
        key = _attention_key(node)
        if key not in layouts:
            layouts[key] = _attention_kernel_stride(node, device)
        stride = layouts[key]
        if stride is None or tuple(stride) == tuple(fake.stride()):
            continue
        with fake.fake_mode:
            node.meta["val"] = torch.empty_strided(fake.shape, stride, dtype=fake.dtype, device=fake.device)
        _refresh_views(list(node.users))
        for copy in copies:
            source = copy.args[0]
            if not source.meta["val"].is_contiguous(memory_format=copy.kwargs["memory_format"]):
                continue
            readers = list(copy.users)
            copy.replace_all_uses_with(source)
            graph.erase_node(copy)
            dropped += 1
            _refresh_views(readers)
    if dropped:
        graph.lint()
    return dropped


def _views_to_contiguous_copies(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The ``contiguous()`` copies that ``node``'s output is read through (views, then the
    copy); none where a reader of it or of those views is neither."""
    views, copies, pending = [], [], list(node.users)
    while pending:
        user = pending.pop()
        if user in views or user in copies:
            continue
        if user.op == "call_function" and user.target is torch.ops.aten.clone.default \
                and str((user.meta.get("torch_fn") or ("", ""))[1]).endswith(".contiguous") \
                and user.kwargs.get("memory_format") in (torch.contiguous_format, torch.channels_last):
            copies.append(user)
        elif user.op == "call_function" and _returns_alias(user.target) and user.args and user.args[0] in (node, *views):
            views.append(user)
            pending.extend(user.users)
        else:
            return []
    return copies


def _attention_key(node: torch.fx.Node) -> tuple:
    """What the kernel's choice and layout depend on: the arguments' shapes, strides and dtypes,
    and the other arguments."""
    def part(value):
        if isinstance(value, torch.fx.Node):
            fake = value.meta.get("val")
            return (tuple(fake.shape), tuple(fake.stride()), fake.dtype) if isinstance(fake, torch.Tensor) else None
        return repr(value)
    return tuple(part(a) for a in node.args) + tuple((k, part(v)) for k, v in sorted(node.kwargs.items()))


def _attention_kernel_stride(node: torch.fx.Node, device: torch.device) -> tuple[int, ...] | None:
    """The stride of the attention's output as its kernel makes it on ``device``, from one call
    on random values (None where that call fails: the traced layout is kept)."""
    def real(value, grad: bool = False):
        if not isinstance(value, torch.fx.Node):
            return value
        fake = value.meta.get("val")
        if not isinstance(fake, torch.Tensor):
            return None
        tensor = torch.empty_strided(fake.shape, fake.stride(), dtype=fake.dtype, device=device)
        if fake.is_floating_point():
            tensor.normal_()
            return tensor.requires_grad_() if grad else tensor  # (query, key and value: trained)
        return tensor.zero_() if fake.dtype is not torch.bool else tensor.fill_(True)

    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.enable_grad():
            args = [real(a, i < 3) for i, a in enumerate(node.args)]
            kwargs = {k: real(v) for k, v in node.kwargs.items()}
            return tuple(torch.ops.aten.scaled_dot_product_attention.default(*args, **kwargs).stride())
    except Exception:  # noqa: BLE001 the traced layout is kept, as before
        return None


def _refresh_views(readers: list[torch.fx.Node]) -> None:
    """The fake values of ``readers`` (and of the views of them) from their arguments' again."""
    order = {n: i for i, n in enumerate(readers[0].graph.nodes)} if readers else {}
    pending = sorted(readers, key=order.get)
    seen = set()
    while pending:
        node = pending.pop(0)
        if node in seen or node.op != "call_function":
            continue
        seen.add(node)
        node.meta["val"] = _fake_call(node.target, node.args, node.kwargs)
        if _returns_alias(node.target):
            pending.extend(sorted(node.users, key=order.get))


def views_as_reshapes(graph: torch.fx.Graph) -> int:
    """Make each ``aten.view`` an ``aten.reshape``: the same view where the real layout allows
    it, a copy where it does not, as the user's ``reshape`` in eager. The export picks ``view``
    for a ``reshape`` when the traced layout allows one, and the traced layout can differ from
    the kernels' (a CPU batch norm of a transposed input returns a contiguous result, its meta
    function a transposed one): a ``view`` would then fail at run time. Returns how many."""
    replaced = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
            replaced += 1
    return replaced


def type_as_dtype(graph: torch.fx.Graph) -> int:
    """Make each ``aten.type_as(x, other)`` an ``aten.to.dtype(x, <other's dtype>)``, where both
    are on one device: the same result (``x`` itself for the same dtype, else a cast), without
    reading ``other``, whose value only lends its dtype. Read, it tied ``other`` to the reading
    node without being one of its inputs (Gemma 3's norms: ``output.type_as(x)``, a crash in the
    inspection where ``x`` was not computed). Returns how many."""
    replaced = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.type_as.default:
            value, other = (arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None for arg in node.args[:2])
            if isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor) and value.device == other.device:
                node.target = torch.ops.aten.to.dtype
                node.args = (node.args[0], other.dtype)
                replaced += 1
    return replaced


def _cpu_dropout(graph: torch.fx.Graph, x: torch.fx.Node, p: float, value, draw_only: bool = False) -> torch.fx.Node:
    """Eager's CPU dropout (ATen's ``_dropout_impl``: ``noise = empty_like(x)``,
    ``noise.bernoulli_(1 - p)``, ``noise.div_(1 - p)``, ``x * noise``), with the random draw
    made into a one-byte mask first: ``bernoulli_`` draws the same numbers whatever the
    tensor's dtype (tested), and ``mask.to(dtype)`` is exactly eager's 0/1 noise before
    ``div_``. The mask is ``uint8``, not ``bool``: its conversion to float is about eight
    times faster on CPU. It is what a plan keeps (a quarter of the float noise) to rebuild the
    noise without drawing again. Returns the product, or the drawn mask when ``draw_only``
    (a dropout whose result is unused: only its draw matters, for the later ones')."""
    aten = torch.ops.aten
    x_value = x.meta["val"]
    with value.fake_mode:
        mask_value = torch.empty_like(x_value, dtype=torch.uint8)
        noise_value = torch.empty_like(x_value)
    keep = 1 - p

    def line(target, args, name, meta, kwargs=None):
        node = graph.create_node("call_function", target, args, kwargs or {}, name=name)
        node.meta["val"] = meta
        return node

    mask = line(aten.empty_like.default, (x,), "dropout_mask", mask_value, {"dtype": torch.uint8})
    mask = line(aten.bernoulli_.float, (mask, keep), "dropout_mask_drawn", mask_value)
    if draw_only:
        return mask
    noise = line(aten._to_copy.default, (mask,), "dropout_noise", noise_value, {"dtype": x_value.dtype})
    noise = line(aten.div_.Scalar, (noise, keep), "dropout_noise_scaled", noise_value)
    return graph.create_node("call_function", aten.mul.Tensor, (x, noise), name="dropout")


def device_of(model: nn.Module, args: tuple) -> torch.device:
    """The device the model runs on (where inspection measures it and the plan executes): its
    first parameter's or buffer's, else its first tensor input's, else the CPU."""
    for value in [*model.parameters(), *model.buffers(), *args]:
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


# a comparison of a uniform draw in [0, 1) with a constant that it always (True) or never (False)
# satisfies: name -> test of the constant
_DECIDED = {
    "lt": lambda c: False if c <= 0 else True if c >= 1 else None,
    "le": lambda c: False if c < 0 else True if c >= 1 else None,
    "gt": lambda c: True if c < 0 else False if c >= 1 else None,
    "ge": lambda c: True if c <= 0 else False if c >= 1 else None,
}


class _ForwardWatch(TorchFunctionMode):
    """Sees every torch call of the forward while it is captured, for three things.

    LayerDrop: decides at capture the comparisons of a one-element ``torch.rand`` draw with a
    constant that settle them whatever the draw: transformers' LayerDrop (BART, mBART, Whisper,
    ...) runs ``if torch.rand([]) < self.layerdrop: skip the layer`` in training, a branch that
    export cannot take on a traced value, and that never skips with the default
    ``layerdrop=0.0``. The draw stays in the graph (unused, it still advances the generator, as in
    eager); a comparison that depends on the draw (``layerdrop`` in (0, 1)) still fails to capture.

    The user's line of a call where export meets a data-dependent value (``blamed``): torch
    blames the first frame outside torch, which is this mode's.

    Whether the forward packs sequences (``packed``: ``nn.utils.rnn.pack_padded_sequence``,
    whose layout follows the lengths' values), for the error's hint.

    Trained tensors that are not the model's parameters nor the sample's (``outside``; ``known``:
    their ids): export would lift them as constants, without gradients.
    """

    def __init__(self, known: set[int]) -> None:
        super().__init__()
        self.draws: dict[int, weakref.ref] = {}  # by id: a tensor's == would be traced
        self.undecided: list[str] = []  # the comparisons it could not decide (for the error)
        self.blamed: str | None = None
        self.packed = False  # the forward packed sequences (nn.utils.rnn.pack_padded_sequence)
        self.outside: dict[int, str] = {}  # by id: the first user line reading each
        self.known = known

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(value, torch.Tensor) and value.requires_grad and value.is_leaf \
                    and id(value) not in self.outside and id(value) not in self.known and not _is_fake(value):
                self.outside[id(value)] = f"{type(value).__name__} of shape {list(value.shape)} at {_user_line()}"
        name = getattr(func, "__name__", "").strip("_")
        self.packed |= name == "pack_padded_sequence"
        if name in _DECIDED and len(args) == 2 and isinstance(args[0], torch.Tensor) \
                and isinstance(args[1], (int, float)) and not isinstance(args[1], bool) \
                and self.draws.get(id(args[0]), lambda: None)() is args[0]:
            decided = _DECIDED[name](args[1])
            if decided is not None:
                return decided
            self.undecided.append(f"a random draw {name} {args[1]!r}")
        try:
            result = func(*args, **kwargs)
        except GuardOnDataDependentSymNode:
            # the latest: the capture's last attempt, along the compiler's paths, is the one reported
            self.blamed = _user_line()
            raise
        if func is torch.rand and isinstance(result, torch.Tensor) and result.numel() == 1:
            self.draws[id(result)] = weakref.ref(result)
        return result


def _error_chain(error: BaseException | None):
    """``error``, then each error it was raised from or while handling (once each)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        yield error
        seen.add(id(error))
        error = error.__cause__ or error.__context__


def _raised_by_data_dependence(error: BaseException) -> bool:
    """``error`` is export's data-dependent guard, or was raised while handling one."""
    return any(isinstance(cause, GuardOnDataDependentSymNode) for cause in _error_chain(error))


@contextlib.contextmanager
def _distribution_checks_off():
    """Capture with ``torch.distributions``' argument checks off by default (a VAE's
    ``Normal(mu, std).rsample()``): each check is ``if not constraint.check(value).all(): raise``,
    a branch on tensor values that export cannot follow, and it computes nothing the graph needs
    (the same values either way; the compiled module does not raise where eager would on a
    non-finite or negative scale). A distribution built with ``validate_args=True`` still
    checks, and fails to capture."""
    from torch.distributions import Distribution

    default = Distribution._validate_args
    Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        Distribution.set_default_validate_args(default)


@contextlib.contextmanager
def _host_random_draws(model: nn.Module):
    """Refuse a forward that draws from numpy's or Python's global generator while it is
    captured (transformers' SpecAugment masks in Wav2Vec2, HuBERT, Whisper: ``np.random`` in
    ``_compute_mask_indices``): the graph would hold the numbers drawn at capture, the same mask
    at every step, where eager draws new ones (a silently different training). The generators'
    states are restored either way: capturing leaves the user's streams where they were."""
    import random

    import numpy

    numpy_state, python_state = numpy.random.get_state(), random.getstate()
    try:
        yield
        drew = [name for name, same in (
            ("numpy.random", _same_numpy_state(numpy_state, numpy.random.get_state())),
            ("random", python_state == random.getstate())) if not same]
    finally:
        numpy.random.set_state(numpy_state)
        random.setstate(python_state)
    if drew:
        raise UnsupportedOperation(
            f"{_model_name(model)}'s forward draws random numbers from {' and '.join(drew)} (not torch's generator): "
            "the captured graph would hold the numbers drawn once, at capture, and reuse them at every step, where "
            "eager draws new ones. Draw them with torch (torch.rand, torch.randint: replayed exactly), or turn that "
            "randomness off (transformers' speech models: config.mask_time_prob = config.mask_feature_prob = 0)")


def _same_numpy_state(a, b) -> bool:
    import numpy

    return a[0] == b[0] and numpy.array_equal(a[1], b[1]) and tuple(a[2:]) == tuple(b[2:])


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)


def _user_line() -> str | None:
    """``File ..., line N, in f: code`` of the innermost frame outside torch and this library."""
    import linecache

    torch_directory = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_LIBRARY_DIRECTORIES + (torch_directory,)) and not path.startswith("<"):
            code = linecache.getline(path, frame.f_lineno).strip()
            return f"File {path}, line {frame.f_lineno}, in {frame.f_code.co_name}: {code}"
        frame = frame.f_back
    return None


@contextlib.contextmanager
def _eager_paths():
    """transformers' code takes other paths when it sees a compiler (``is_torchdynamo_compiling()``,
    true under export): T5 then leaves out the all-ones attention mask that eager adds, whose
    broadcast makes eager sum the layers' position-bias gradients at the batch's shape before
    reducing them (a different rounding). While Rockmate captures, transformers is told that
    nothing compiles, so that the graph is eager's."""
    patched = []
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("transformers"):
            continue
        for name, replacement in _NOT_TRACING.items():
            # the module's own attributes only: transformers' lazy modules import a submodule on
            # a missing attribute (5.x: an image processor importing torchvision)
            found = getattr(module, "__dict__", {}).get(name)
            if callable(found):
                patched.append((module, name, found))
                setattr(module, name, replacement)
    try:
        yield patched
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


def _not_compiling() -> bool:
    return False


def _not_tracing(tensor=None) -> bool:
    return False


# transformers' tests for a compiler: ``is_torchdynamo_compiling()``, and (5.x) ``is_tracing(tensor)``,
# also true for a fake tensor (every tensor under export)
_NOT_TRACING = {"is_torchdynamo_compiling": _not_compiling, "is_tracing": _not_tracing}


def _export_along_eager_paths(model: nn.Module, args: tuple, printed: io.StringIO):
    """``torch.export.export`` (non-strict) along eager's code paths (:func:`_eager_paths`).

    Where those branch on tensor values that export cannot follow, the branch is taken as eager
    takes it on the sample (export's real-tensor propagation, which leaves a runtime assertion of
    the branch in the graph) when the values depend on no input, parameter, buffer or constant
    of the model, only on the shapes (transformers 5's test for packed sequences, on position ids
    made by ``arange``: eager then attends with ``is_causal`` where the compiled path builds a
    mask, another kernel and other gradient bits): the same branch for every call of these
    shapes, and a plan is made per shape. Otherwise (transformers' check that an attention mask is
    all ones: BERT, BART, OPT...), along the paths that transformers takes under a compiler,
    which export was made for, right for any values.

    Returns the exported program and whether real values propagated through it (its fake values
    hold real tensors: :func:`_math_attention` while it is traced again)."""
    with _eager_paths() as patched:
        mark = printed.tell()
        try:
            return _export_quietly(model, args), False
        except GuardOnDataDependentSymNode as error:
            data_dependent = error
        printed.seek(mark)  # the forward runs again: print its output once
        printed.truncate()
        exported = _export_taking_shape_branches(model, args)
        if exported is not None:
            return exported, True
        printed.seek(mark)
        printed.truncate()
        if not patched:
            raise data_dependent
    return _export_quietly(model, args), False


def _export_taking_shape_branches(model: nn.Module, args: tuple):
    """The export with the branches on tensor values taken as eager takes them on the sample,
    where those values depend on the shapes alone (:func:`_export_along_eager_paths`), else None."""
    values = _ShapeDeterminedValues()
    decisions = _RealValueDecisions(values)
    try:
        with torch._functorch.config.patch(fake_tensor_propagate_real_tensors=True), decisions, \
                _math_attention(), values:
            exported = _export_quietly(model, args, shapes_logger=decisions.QUIETED)
    except Exception:  # noqa: BLE001 the branches taken on the sample failed too: the caller goes on as before
        return None
    if not decisions.made or decisions.undetermined:
        return None
    _drop_value_branches(exported.graph)
    return exported


def _math_attention():
    """Attention's math kernel while real values propagate through fake ones: the fused CUDA
    kernels' random-state outputs do not match their fake kernels' (torch 2.11, BART on an H200:
    ``MetadataMismatchError`` at ``output[2]``, in the export and again in ``run_decompositions``).
    The graph keeps the composite ``scaled_dot_product_attention`` either way: the kernel is
    chosen when the plan runs."""
    return torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH)


def _drop_real_values(graph: torch.fx.Graph) -> None:
    """Let go of the real tensors that real-value propagation left on the graph's fake values:
    they are the sample forward's every intermediate (eager's activations, on the user's device),
    which the compiled module would hold else."""
    for node in graph.nodes:
        for value in torch.utils._pytree.tree_leaves(node.meta.get("val")):
            if getattr(value, "real_tensor", None) is not None:
                value.real_tensor = None


class _ShapeDeterminedValues(TorchFunctionMode):
    """Which tensors of the forward hold values that the shapes alone determine, followed call by
    call while export traces it: those made by factories (``arange``, ``ones``...) and by
    operations reading only such tensors, or only their shapes (``ones_like``). Not: the inputs,
    parameters, buffers and constants (made before the forward), random draws, uninitialized
    memory, and a tensor whose storage was written in place from other values. ``symbols``: the
    values read out of such tensors (``item()``, ``tolist()``), export's unbacked symbols;
    ``reading``: for each read of a value in progress (``bool(t)``...), whether ``t`` is such a
    tensor. Conservative: a tensor made where this mode does not see it counts as undetermined.

    Independent of what export's graph keeps of a decision (torch 2.13 leaves a runtime assertion
    computed from the tensor, torch 2.11 none)."""

    def __init__(self) -> None:
        super().__init__()
        self._determined: dict[int, weakref.ref] = {}
        self._overwritten: set = set()  # storages written in place from undetermined values
        self.symbols: set = set()
        self.reading: list[bool] = []

    def determined(self, tensor: torch.Tensor) -> bool:
        ref = self._determined.get(id(tensor))
        return ref is not None and ref() is tensor and storage_identity(tensor) not in self._overwritten

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        read = torch.utils._pytree.tree_leaves((args[1:], kwargs) if name in _SHAPE_READERS else (args, kwargs))
        determined = not _draws_or_uninitialized(name) and \
            all(self.determined(value) for value in read if isinstance(value, torch.Tensor))
        if name in _VALUE_READS:
            self.reading.append(determined)
            try:
                result = func(*args, **kwargs)
            finally:
                self.reading.pop()
            if determined:
                for value in torch.utils._pytree.tree_leaves(result):
                    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                        self.symbols |= value.node.expr.free_symbols
            return result
        result = func(*args, **kwargs)
        written = kwargs.get("out", args[0] if args and _writes_in_place(name) else None)
        for value in torch.utils._pytree.tree_leaves((result, written)):
            if isinstance(value, torch.Tensor):
                if determined:
                    self._determined[id(value)] = weakref.ref(value)
                else:
                    self._determined.pop(id(value), None)
        if isinstance(written, torch.Tensor) and not determined:  # (its views made before too)
            self._overwritten.add(storage_identity(written))
        return result


# reading a tensor's value into Python (a decision on it follows)
_VALUE_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "is_nonzero"})
# reading only the first argument's shape, dtype and device
_SHAPE_READERS = frozenset({"new_ones", "new_zeros", "new_full", "ones_like", "zeros_like", "full_like"})
_DRAWS = frozenset({"bernoulli", "bernoulli_", "multinomial", "normal", "normal_", "uniform_", "exponential_",
                    "geometric_", "cauchy_", "log_normal_", "poisson", "binomial", "rrelu", "rrelu_",
                    "gumbel_softmax", "fractional_max_pool2d", "fractional_max_pool3d"})


def _draws_or_uninitialized(name: str) -> bool:
    """A function whose result is not a function of its arguments: a random draw or memory left
    uninitialized (by its Python name: the mode sees ``torch.rand``, ``Tensor.uniform_``...)."""
    return name.startswith("rand") or "dropout" in name or "empty" in name or name in _DRAWS


def _writes_in_place(name: str) -> bool:
    """``Tensor.add_``, ``__setitem__``, ``__iadd__``...: the first argument written."""
    return (name.endswith("_") and not name.startswith("__")) or name in _INPLACE_DUNDERS


_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__",
                              "__ilshift__", "__irshift__"})


class _UndeterminedDecision(Exception):
    """Raised (through export) by :class:`_RealValueDecisions` at the first decision on values
    that the shapes alone may not determine: :func:`_export_taking_shape_branches` gives up."""


class _RealValueDecisions(logging.Handler):
    """The decisions that export took on tensor values from the real values while the forward
    runs (its log of real-tensor propagation, kept from the user's stderr): ``made``, how many;
    ``undetermined``, those on values that the shapes alone may not determine (a decision is on
    such values when taken while a tensor that :class:`_ShapeDeterminedValues` follows is read,
    or on symbols read from such tensors)."""

    _LOGGER = "torch.fx.experimental.symbolic_shapes"
    QUIETED = "rkgb.capture.none"  # (:func:`_export_quietly` leaves the logger above to this handler)

    def __init__(self, values: _ShapeDeterminedValues) -> None:
        super().__init__(logging.WARNING)
        self.values = values
        self.made = 0
        self.undetermined: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if not (str(record.msg).startswith("propagate_real_tensors") and record.args):
            return
        self.made += 1
        symbols = set(getattr(record.args[0], "free_symbols", ()))
        reading = self.values.reading
        if not (reading and reading[-1]) and not (symbols and symbols <= self.values.symbols):
            self.undetermined.append(str(record.args[0]))
            # one such decision makes the attempt fail: stop the export here instead of
            # tracing the rest of the forward with real values (BART, T5: ~2 s a build)
            raise _UndeterminedDecision(self.undetermined[-1])

    def __enter__(self):
        logger = logging.getLogger(self._LOGGER)
        self._saved = logger.level, logger.propagate, logger.handlers
        logger.setLevel(logging.WARNING)
        logger.propagate, logger.handlers = False, [self]
        return self

    def __exit__(self, *exc) -> None:
        logger = logging.getLogger(self._LOGGER)
        level, logger.propagate, logger.handlers = self._saved
        logger.setLevel(level)  # (setLevel, not the attribute: it clears logging's cache of levels)


_ASSERT_SCALAR = torch.ops.aten._assert_scalar.default


def _ancestors(nodes: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """``nodes`` and every node they are computed from."""
    closure: dict[torch.fx.Node, None] = {}
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node not in closure:
            closure[node] = None
            stack.extend(node.all_input_nodes)
    return list(closure)


def _drop_value_branches(graph: torch.fx.Graph) -> None:
    """Erase the runtime assertions that export's real-tensor propagation leaves for the branches
    it took, and the nodes that only they read (the branches depend on the shapes alone and a
    plan is made per shape: they hold for every call it runs)."""
    closure = set(_ancestors([node for node in graph.nodes if node.target is _ASSERT_SCALAR]))
    for node in reversed([node for node in graph.nodes if node in closure]):
        if node.op != "placeholder" and not node.users:
            graph.erase_node(node)


def _export_quietly(model: nn.Module, args: tuple, shapes_logger: str = "torch.fx.experimental.symbolic_shapes"):
    """``torch.export.export`` (non-strict), whose stderr is held back where it fails on a
    data-dependent value: torch then prints a warning and the graph traced so far (tens of
    lines: about 90 on XLM-R's all-ones mask check), where the attempt is retried along other
    paths or the CaptureError that follows repeats torch's reason and the user's line.
    ``shapes_logger``: the logger quieted (another name: the caller keeps it)."""
    torch_said = io.StringIO()
    try:
        with _quiet_logger(shapes_logger), contextlib.redirect_stderr(torch_said):
            exported = torch.export.export(model, args, strict=False)
    except GuardOnDataDependentSymNode:
        raise
    except BaseException:
        sys.stderr.write(torch_said.getvalue())
        raise
    sys.stderr.write(torch_said.getvalue())
    return exported


class _TensorHooks:
    """Records the gradient hooks that the forward registers on tensors while Rockmate captures
    it (``h.register_hook(fn)``: a gradient scaled, clipped or logged on its way back): export
    keeps no trace of them, so the graph's gradients would skip them. :func:`capture` refuses
    such a model with the line that registers the hook."""

    def __init__(self) -> None:
        self.registered: list[str] = []

    def __enter__(self):
        self._original = torch.Tensor.register_hook
        original, registered = self._original, self.registered

        def register_hook(tensor, hook):
            caller = sys._getframe(1).f_code.co_filename
            # the user's call: not torch's own (export registers some), nor the same call again
            # through a torch-function mode's handler (ours, in this file)
            if f"{os.sep}torch{os.sep}" not in caller and os.path.dirname(caller) != os.path.dirname(__file__):
                where = f"{caller}:{sys._getframe(1).f_lineno}"
                if where not in registered:
                    registered.append(where)
            return original(tensor, hook)

        torch.Tensor.register_hook = register_hook
        return self

    def __exit__(self, *exc) -> None:
        torch.Tensor.register_hook = self._original


def _no_grad_regions(graph: torch.fx.Graph) -> set[str]:
    """The names of the export's (pre-dispatch) nodes that run a region of the forward without
    grad (``torch.no_grad()``, ``@torch.no_grad`` methods: a ``wrap_with_set_grad_enabled(False,
    ...)`` higher-order op), whose results eager computes without a graph."""
    names = set()
    for node in graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "wrap_with_set_grad_enabled" \
                and node.args and node.args[0] is False:
            names.add(node.name)
    return names


def detach_no_grad_results(graph: torch.fx.Graph, without_grad: set[str], output_specs=()) -> int:
    """Detach each result of a region that eager runs without grad where a node outside the
    region reads it.

    ``run_decompositions`` inlines the region (its nodes keep it in their ``from_node``) and
    loses its grad mode: the functional graph would differentiate through it (our gradient
    needs follow the graph's edges from the parameters). A spectral norm's
    power iteration (``torch.nn.utils.parametrizations.spectral_norm``, ``@torch.no_grad``)
    computes ``u`` and ``v`` from the weight: differentiated, they added terms to the weight's
    gradient (0.3% of it). A ``detach`` on each result read outside the region cuts them, as
    eager's grad mode does. Returns how many results were detached."""
    if not without_grad:
        return 0
    inside = {node.name for node in graph.nodes if _origins(node) & without_grad}
    detached = 0
    for node in list(graph.nodes):
        if node.name not in inside or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        # (the graph's output only where it returns the result to the user: a buffer's new value
        # needs no cut; ``output_specs`` name the node, renamed below)
        returned = [spec for spec in output_specs
                    if spec.kind is OutputKind.USER_OUTPUT and getattr(spec.arg, "name", None) == node.name]
        outside = [user for user in node.users if user.name not in inside and user.op != "output"]
        if not outside and not returned:
            continue
        with graph.inserting_after(node):
            detach = graph.call_function(torch.ops.aten.detach.default, (node,))
        detach.meta = {key: value for key, value in node.meta.items() if key != "from_node"}
        detach.meta["val"] = node.meta["val"].detach()
        for user in outside:
            user.replace_input_with(node, detach)
        if returned:
            output = next(user for user in node.users if user.op == "output")
            values = list(output.args[0])
            for i, spec in enumerate(output_specs):
                if spec in returned:
                    values[i] = detach
                    spec.arg.name = detach.name
            output.args = (tuple(values),)
        detached += 1
    if detached:
        graph.lint()
    return detached


def _refuse_sparse_gradients(graph: torch.fx.Graph) -> None:
    """Raise :class:`UnsupportedOperation` for an embedding whose weight requires grad and gets a
    sparse gradient (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``): its size
    depends on the indices' values, which no plan can know, and the executor's gradient sums are
    dense."""
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target._overloadpacket.__name__ not in ("embedding", "_embedding_bag", "embedding_bag"):
            continue
        schema = node.target._schema
        position = next(i for i, arg in enumerate(schema.arguments) if arg.name == "sparse")
        sparse = node.args[position] if len(node.args) > position else node.kwargs.get("sparse", False)
        weight = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if sparse is True and getattr(weight, "requires_grad", False):
            raise UnsupportedOperation(
                f"{describe_fx_node(node)} makes a sparse gradient (sparse=True): its size depends on the indices' "
                "values, which a plan cannot know; build the embedding with sparse=False")


def _refuse_value_dependent_shapes(graph: torch.fx.Graph) -> None:
    """Raise :class:`UnsupportedOperation` at the first operation whose result's shape depends
    on tensor values (export's unbacked sizes: ``torch.arange`` to a bound computed from a tensor,
    ``nonzero``, a boolean mask's selection): a plan is made for fixed sizes (it failed deep in
    the graph builder: "Could not extract specialized integer from data-dependent expression")."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in graph.nodes:
        value = node.meta.get("val")
        if node.op == "call_function" and isinstance(value, torch.Tensor) and free_unbacked_symbols(value):
            raise UnsupportedOperation(
                f"{describe_fx_node(node)} makes a tensor whose shape ({list(value.shape)}) depends on the values "
                "of tensors: Rockmate plans for fixed sizes; compute such sizes from Python numbers or from the "
                "inputs' shapes (not from tensors), or keep the full size and mask")


def _function_call_error(error: BaseException) -> FunctionCallError | None:
    """The :class:`rkgb.functions.FunctionCallError` that ``error`` is or was raised from."""
    return next((cause for cause in _error_chain(error) if isinstance(cause, FunctionCallError)), None)


@contextlib.contextmanager
def _quiet_logger(name: str):
    """Only errors from the logger ``name`` while the block runs."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _check_batch_norm_momentum(model: nn.Module) -> None:
    """Raise :class:`UnsupportedOperation` for a batch norm that averages its statistics
    cumulatively (``momentum=None``) while training: its factor ``1 / num_batches_tracked`` is a
    Python number read from a buffer at each call, which a captured graph cannot follow (export
    fails on it, deep inside torch)."""
    for path, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training and module.momentum is None \
                and module.track_running_stats:
            raise UnsupportedOperation(
                f"module {path or 'the model'!r} ({type(module).__name__}) has momentum=None (a cumulative "
                "average of the statistics): its factor 1 / num_batches_tracked is a Python number read from a "
                "buffer at each step, which a captured graph cannot follow. Give it a momentum (e.g. 0.1), or "
                "freeze it (eval(), or track_running_stats=False)")


# the attributes of an nn.Module that hold its hooks (none of which the compiled module calls)
MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def module_hooks(module: nn.Module, kind: str) -> list:
    """The hooks of ``kind`` (one of :data:`MODULE_HOOKS`) on ``module`` whose effect the captured
    graph would miss. Left out, transformers 5's: ``output_capturing_hook`` (installed at the
    first call of a model that records its layers' outputs, ``output_hidden_states=True``: it
    appends a layer's output to a list that the forward returns, an effect the export captures),
    and ``make_inputs_require_grads`` (registered on the input embeddings by
    ``gradient_checkpointing_enable()``: ``output.requires_grad_(True)``) where the module's
    parameters all require grad (its output requires grad already)."""
    hooks = getattr(module, kind, None) or {}
    if kind != "_forward_hooks" or not hooks:
        return list(hooks)
    trained = all(p.requires_grad for p in module.parameters(recurse=True))

    def captured(hook) -> bool:
        if not getattr(hook, "__module__", "").startswith("transformers"):
            return False
        name = getattr(hook, "__name__", "")
        return name == "output_capturing_hook" or (trained and name == "make_inputs_require_grads")

    return [key for key, hook in hooks.items() if not captured(hook)]


def _check_no_module_hooks(model: nn.Module) -> None:
    """Raise :class:`CaptureError` if a module has forward or backward hooks.

    The compiled module runs the captured graph, never the modules' ``forward`` methods: a hook
    would run once during capture, on fake tensors, and never while training.
    """
    from torch.nn.modules import module as nn_module

    for kind in MODULE_HOOKS:
        if getattr(nn_module, f"_global{kind}", None):
            raise CaptureError(
                f"global module {kind[1:].replace('_', ' ')} are registered (torch.nn.modules.module."
                f"register_module_{kind[1:-1]}): Rockmate runs the captured graph, not the modules' forward "
                "methods, so they would never be called while training; remove them before Rockmate(...)"
            )
    for path, module in model.named_modules():
        for kind in MODULE_HOOKS:
            if module_hooks(module, kind):
                where = f"module {path!r} ({type(module).__name__})" if path else f"the model ({type(module).__name__})"
                raise CaptureError(
                    f"{where} has {kind[1:].replace('_', ' ')}: Rockmate runs the captured graph, not the "
                    "modules' forward methods, so the hooks would run once during capture, on fake tensors, and "
                    "never while training. Remove them before Rockmate(...) (compute what they record inside "
                    "forward and return it; for weight normalization use "
                    "torch.nn.utils.parametrizations.weight_norm, which has no hooks)"
                )


def _instance_norm(input, weight, bias, running_mean, running_var, use_input_stats, momentum, eps, cudnn_enabled):
    """``aten.instance_norm`` as its C++ composite (ATen's Normalization.cpp) runs it: a batch
    norm over ``(1, batch * channels, ...)`` with the statistics repeated per sample, then the
    running statistics written back as the mean over the batch. Written out so that export
    functionalizes the write-back (see :func:`_hidden_mutations`); the same operations as
    eager's, so the same bits."""
    b, c = input.shape[0], input.shape[1]

    def repeated(tensor):
        return None if tensor is None else tensor.repeat(b)

    running_mean_, running_var_ = repeated(running_mean), repeated(running_var)
    out = torch.batch_norm(input.contiguous().view([1, b * c, *input.shape[2:]]), repeated(weight), repeated(bias),
                           running_mean_, running_var_, use_input_stats, momentum, eps, cudnn_enabled)
    if running_mean is not None:
        running_mean.copy_(running_mean_.view(b, c).mean(0))
    if running_var is not None:
        running_var.copy_(running_var_.view(b, c).mean(0))
    return out.view(input.shape)


def _hidden_mutations(graph: torch.fx.Graph) -> dict:
    """The decompositions for ``run_decompositions`` of the operations that write into their
    arguments without saying so in their schema, which export therefore keeps as they are:
    ``aten.instance_norm`` with running statistics (``InstanceNorm*d(track_running_stats=True)``)
    updates them in place inside its kernel, so the graph showed no buffer mutation, and each
    inspection run or recomputation of the node updated the user's statistics once more."""
    table = {}
    for node in graph.nodes:
        if node.target is torch.ops.aten.instance_norm.default and node.args[3] is not None:
            table[node.target] = _instance_norm
    return table


def _model_name(model: nn.Module) -> str:
    """The class name of the user's model (through an adapter that names it ``wrapped``)."""
    return type(getattr(model, "wrapped", model)).__name__


_LIBRARY_DIRECTORIES = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), package)
                             + os.sep for package in ("rkgb", "rockmate", "solvers", "exec"))


def _stacklevel_of_caller() -> int:
    """The ``stacklevel`` of a warning raised here that points at the first frame outside this
    library (the user's ``Rockmate(...)`` line)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRECTORIES):
        frame, level = frame.f_back, level + 1
    return level


# the training-mode batch norm of a functionalized graph (its results 3 and 4: the new running statistics)
FUNCTIONAL_BATCH_NORM = torch.ops.aten._native_batch_norm_legit_functional.default


def _chain_batch_norm_statistics(graph: torch.fx.Graph, buffers: dict[str, str],
                                 buffer_mutations: dict[str, str]) -> dict[str, str]:
    """Make every call of a BatchNorm called several times in one forward (a siamese encoder
    applied to two views, a teacher and a student sharing a layer) read and update its buffers,
    as eager's calls do; returns the buffer mutations, in the graph's order.

    Eager updates the running statistics in place at each call, and the next call reads what
    the one before wrote. The functional graph passes one call's new statistics to the next as
    values, which the executor's in-place batch norms (:func:`rkgb.interpret.batch_norm_updating`)
    did not write back: the buffers kept the first call's statistics (or none), and the second
    call's backward was taken to need the first call's results. Here each later call reads the
    buffer itself, and each call's new statistics are updates of that buffer, written at its
    first run, in the forward's order, so that the last call's is what the step leaves."""
    chained: dict[str, str] = {}
    for node in graph.nodes:
        if node.target is not FUNCTIONAL_BATCH_NORM or node.args[5] is not True:
            continue
        args = list(node.args)
        for position in (3, 4):  # running_mean, running_var: results 3 and 4 of the call before
            source = args[position]
            if not (isinstance(source, torch.fx.Node) and source.target is operator.getitem
                    and source.args[1] == position and len(source.users) == 1):
                continue
            before = source.args[0]
            if before.target is not FUNCTIONAL_BATCH_NORM or before.args[5] is not True:
                continue
            buffer = before.args[position]
            # (a buffer that other operations read too keeps the functional values)
            if isinstance(buffer, torch.fx.Node) and buffer.op == "placeholder" and buffer.name in buffers \
                    and all(user.target is FUNCTIONAL_BATCH_NORM and user.args[5] is True for user in buffer.users):
                args[position] = buffer
                chained[source.name] = buffers[buffer.name]
        node.args = tuple(args)
    if not chained:
        return buffer_mutations
    order = {node.name: i for i, node in enumerate(graph.nodes)}
    return dict(sorted({**buffer_mutations, **chained}.items(), key=lambda item: order.get(item[0], len(order))))


def capture(model: nn.Module, sample) -> CapturedGraph:
    """Export ``model`` on ``sample`` (non-strict) and functionalize the graph
    (:func:`_capture`), leaving the user's random generators where they were: export runs the
    forward (real draws where a branch is taken on the sample: :func:`_export_along_eager_paths`)."""
    device = device_of(model, as_input_tuple(sample))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return _capture(model, sample)


# lower the export's graphs in place (rkgb.decompose) instead of retracing them with
# ``run_decompositions``: the same graphs (tests/test_decompose.py), 5x less time for that step
# (Llama-12: 5.1 -> 1.0 s on a slow day). False: always retrace (a switch for the tests)
LOWER_FUNCTIONAL_GRAPHS = True


def _lazy_graph_modules():
    """The export's graph modules write and compile their Python code only when it is read or
    run (``torch.fx``'s lazy graph modules, as Inductor builds them): export and
    ``run_decompositions`` make and recompile modules many times (their passes: placeholder
    names, runtime assertions, unlifting), whose code nothing here reads or runs. Measured on
    Llama-12 (d=768): the capture's median 9.7 -> 8.55 s (four runs each, interleaved, on a slow
    day), the same graphs."""
    return torch.fx._lazy_graph_module._use_lazy_graph_module(True)


def _capture(model: nn.Module, sample) -> CapturedGraph:
    """Export ``model`` on ``sample`` (non-strict) and functionalize the graph.

    What the forward prints while it is traced is written to ``sys.stdout`` as it would have
    been, followed by a ``UserWarning``: the compiled module runs the captured graph, so Python
    side effects of ``forward`` (print, logging, counters) happen once, here, never per call.

    Raises:
        CaptureError: torch.export failed; the message names the model class and repeats
            torch's reason, which points at the user's source line.
    """
    args = as_input_tuple(sample)
    _check_no_module_hooks(model)
    _check_batch_norm_momentum(model)
    printed = io.StringIO()  # what the forward prints while it is traced (see below)
    watch = _ForwardWatch({id(p) for p in model.parameters()} | {id(a) for a in args if isinstance(a, torch.Tensor)})
    functions = CustomFunctions(model)
    hooks = _TensorHooks()
    try:
        # random ops whose results are unused still advance the generator in eager: the
        # export's dead-code elimination keeps them only when told that randomness is an effect
        with warnings.catch_warnings(), torch._inductor.config.patch(fallback_random=True), \
                contextlib.redirect_stdout(printed), functions, hooks, _lazy_graph_modules():
            warnings.simplefilter("ignore", FutureWarning)
            # (the watch follows the user's forward: not the retrace of run_decompositions, which
            # it slowed by a tenth)
            with watch, _host_random_draws(model), _distribution_checks_off():
                exported, real_values = _export_along_eager_paths(model, args, printed)
            inplace = user_inplace_ops(exported.graph)
            without_grad = _no_grad_regions(exported.graph)
            targets = {node.name: node.target for node in exported.graph.nodes}
            traced = TracedProgram.of(exported.graph)
            table = _hidden_mutations(exported.graph)
            with _math_attention() if real_values else contextlib.nullcontext():
                retraced = decompose_functional_graph(exported, table) if LOWER_FUNCTIONAL_GRAPHS else "lowering off"
                if retraced is not None:
                    exported = exported.run_decompositions(table)
            if real_values:
                _drop_real_values(exported.graph)
    except UnsupportedOperation:
        raise
    except Exception as error:  # torch raises many types; we re-raise one with context
        refused = _function_call_error(error)
        if refused is not None:  # a custom Function that rkgb.functions cannot apply as one operation
            raise UnsupportedOperation(f"{_model_name(model)}: {refused}") from error
        reason = str(error).strip().splitlines()
        if watch.blamed is not None and _raised_by_data_dependence(error):
            # torch's "Caused by" names this library's mode: the user's line instead (a data-dependent
            # guard that the model caught and went around, then another error: not blamed)
            reason = [line for line in reason if not line.startswith("Caused by: (rkgb/")]
            reason.insert(1, f"at {watch.blamed}")
        summary = "\n".join(reason[:12])
        hint = ""
        if watch.undecided and isinstance(error, GuardOnDataDependentSymNode):
            hint = (f"\nThe forward branches on {watch.undecided[-1]} (a LayerDrop, as in transformers' "
                    "BART and Whisper?): which layers run is random, a graph cannot follow it; set the drop "
                    "probability to 0 (e.g. config.encoder_layerdrop = config.decoder_layerdrop = 0.0).")
        elif watch.blamed is not None and "expert" in watch.blamed and "transformers" in watch.blamed:
            hint = ("\nA mixture-of-experts layer routes each token by its router's values (a loop over the "
                    "experts hit): with transformers 5, experts_implementation=\"batched_mm\" in the model's "
                    "config runs the experts without it (every shape fixed).")
        elif watch.packed:
            hint = ("\nThe forward packs sequences (torch.nn.utils.rnn.pack_padded_sequence): a packed batch's "
                    "layout depends on the values of the lengths, which a graph cannot follow; run the RNN on the "
                    "padded batch and mask the padded steps' outputs instead.")
        raise CaptureError(
            f"torch.export could not capture {_model_name(model)}: {type(error).__name__}: "
            f"{summary}\nRockmate needs a model that torch.export.export(model, sample, "
            f"strict=False) accepts (no data-dependent control flow on tensor values).{hint}"
        ) from error
    finally:
        sys.stdout.write(printed.getvalue())  # the user's prints, where they would have gone
    if printed.getvalue():
        warnings.warn(
            f"{_model_name(model)}'s forward printed while Rockmate captured it: Python side effects in "
            "forward (print, logging, counters in Python variables) run once, when Rockmate captures the "
            "model, not at each call of the compiled module", UserWarning, stacklevel=_stacklevel_of_caller())

    if watch.outside:
        raise UnsupportedOperation(
            f"{_model_name(model)}'s forward uses tensors that require grad but are not its parameters (a module "
            f"kept in a Python list, a dict or a global instead of an nn.ModuleList/ModuleDict attribute?): "
            f"{'; '.join(list(watch.outside.values())[:3])}. torch.export lifts them as constants, so they would "
            "get no gradient. Register their module as a submodule of the model (or pass them as inputs)")
    if hooks.registered:
        raise UnsupportedOperation(
            f"{_model_name(model)}'s forward registers gradient hooks on tensors (at {'; '.join(hooks.registered)}): "
            "torch.export keeps no trace of them, so the captured graph's gradients would skip them. Apply the "
            "hook's effect in the forward instead (a custom autograd.Function, which Rockmate applies as one "
            "operation, can scale or clip a gradient), or register hooks on the parameters, outside the forward.")
    if functions.refused:
        raise UnsupportedOperation(
            f"{_model_name(model)}'s forward applies custom torch.autograd.Function(s) to tensors that require "
            f"grad in a way Rockmate cannot stand for: {'; '.join(functions.refused)}. torch.export keeps a "
            "Function's forward and drops its backward, so Rockmate applies the Function itself as one operation "
            "(rkgb.functions), through Function.apply, with tensors and constants as positional arguments: pass "
            "the others as constants, or replace the Function by plain tensor operations.")
    _refuse_sparse_gradients(exported.graph)
    _refuse_value_dependent_shapes(exported.graph)
    detach_no_grad_results(exported.graph, without_grad, exported.graph_signature.output_specs)
    place_regenerated_views(exported.graph, traced)
    attention_in_kernel_layout(exported.graph, device_of(model, args))
    renamed: dict[str, str] = {}
    restore_dropout(exported.graph, device_of(model, args), renamed)
    restore_inplace_writes(exported.graph, renamed)
    differentiable_copies(exported.graph, renamed)
    varying = {spec.arg.name for spec in exported.graph_signature.input_specs
               if spec.kind in (InputKind.USER_INPUT, InputKind.PARAMETER)}
    requiring = {node.name for node in exported.graph.nodes if node.op == "placeholder" and node.name in varying
                 and getattr(node.meta.get("val"), "requires_grad", False)}
    mutations = {renamed.get(spec.arg.name, spec.arg.name) for spec in exported.graph_signature.output_specs
                 if spec.kind is not OutputKind.USER_OUTPUT}
    restore_inplace_ops(exported.graph, inplace, varying, renamed, requiring, mutations)
    merge_regenerated_views(exported.graph, targets)
    views_as_reshapes(exported.graph)
    type_as_dtype(exported.graph)
    dropouts_of_nothing(exported.graph)
    signature = exported.graph_signature
    parameters: dict[str, str] = {}
    buffers: dict[str, str] = {}
    constants: dict[str, torch.Tensor] = {}
    constant_paths: dict[str, str] = {}
    user_inputs: list[str] = []
    for spec in signature.input_specs:
        name = spec.arg.name
        if spec.kind is InputKind.PARAMETER:
            parameters[name] = spec.target
        elif spec.kind is InputKind.BUFFER:
            buffers[name] = spec.target
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            constants[name] = exported.constants[spec.target]
            constant_paths[name] = spec.target
        elif spec.kind is InputKind.USER_INPUT:
            user_inputs.append(name)
        else:
            raise CaptureError(f"unsupported input kind {spec.kind} for {name!r}")

    if len(user_inputs) != len(args):
        raise CaptureError(
            f"the model takes {len(args)} positional inputs but the export has {len(user_inputs)}; "
            "pass the sample as a tuple of positional arguments (no keyword arguments)"
        )
    inputs = [name if isinstance(value, torch.Tensor) else None for name, value in zip(user_inputs, args)]

    user_outputs: list[str] = []
    buffer_mutations: dict[str, str] = {}
    for spec in signature.output_specs:
        if spec.kind is OutputKind.USER_OUTPUT:
            user_outputs.append(renamed.get(spec.arg.name, spec.arg.name))
        elif spec.kind is OutputKind.BUFFER_MUTATION:
            buffer_mutations[renamed.get(spec.arg.name, spec.arg.name)] = spec.target
        elif spec.kind is OutputKind.PARAMETER_MUTATION:
            hint = "; nn.Embedding(max_norm=...) renormalizes its rows in place" if "renorm" in spec.arg.name else ""
            raise UnsupportedOperation(
                f"{_model_name(model)}'s forward writes into its parameter {spec.target!r} (by "
                f"{spec.arg.name!r}{hint}): Rockmate replays "
                "the forward's operations (recomputations, its own measures), which would write it again. "
                "Renormalize outside the forward (under torch.no_grad(), before the step), or drop max_norm")
        else:
            raise CaptureError(
                f"unsupported output kind {spec.kind} for {spec.arg.name!r}: Rockmate supports "
                "models that return tensors and mutate only buffers"
            )
    buffer_mutations = _chain_batch_norm_statistics(exported.graph, buffers, buffer_mutations)
    out_spec = exported.call_spec.out_spec
    output_is_tuple = not (out_spec is not None and out_spec.num_leaves == 1 and out_spec.is_leaf())
    return CapturedGraph(
        retraced=retraced,
        graph=exported.graph,
        parameters=parameters,
        buffers=buffers,
        constants=constants,
        constant_paths=constant_paths,
        inputs=inputs,
        user_outputs=user_outputs,
        buffer_mutations=buffer_mutations,
        output_is_tuple=output_is_tuple,
        out_spec=out_spec,
    )
