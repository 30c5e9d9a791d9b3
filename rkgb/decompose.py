"""``run_decompositions({})`` without its retrace, for graphs that write no input in place.

torch.export's training graph keeps CompositeImplicitAutograd operations that alias or draw
(``reshape``, ``contiguous``, ``to``, ``flatten``, ``dropout``), regions run without grad
(``wrap_with_set_grad_enabled``), constants made fresh (``torch.tensor(...)``:
``lift_fresh_copy``, ``detach_``) and in-place writes (``add_``, ``masked_fill_``, ``x[i] = v``);
``ExportedProgram.run_decompositions({})`` lowers them by tracing the whole program again
(``ep.module()``, ``aot_export_module`` with functionalization and fake tensors): half of the
capture's time (Llama-12 at d=768: 5.1-5.6 of its 10-12 s on a slow day), growing with depth.
The retrace

- calls each operation again on the fake values of its arguments, which the dispatcher hands
  on normalized (positional arguments up to the last one not at its default, keyword-only ones
  where not at theirs);
- lowers the CompositeImplicitAutograd operations that export does not preserve through their
  kernels (the Python dispatcher's decompositions first: ``dropout`` to ``native_dropout``),
  keeping the preserved ones whole (``linear``, ``layer_norm``, ``scaled_dot_product_attention``:
  ``torch.export.exported_program._override_composite_implicit_decomp``);
- where the graph writes in place, runs the operations on functional tensors (torch's
  functionalization: a write becomes its functional operation and the views of the written
  tensor are made again from its new value, ``copy_`` onto a tensor of the graph's own its
  functional form);
- inlines the regions without grad, makes a constant's fresh copy a ``clone``;
- gives each new node the metadata of the operation it comes from and its provenance
  (``from_node``), orders the inputs as its unlifted module lists them, and drops dead code.

:func:`decompose_functional_graph` does that on the graph as it is: each operation is called on
the fake values (functional ones where the graph writes in place) under a dispatch mode that
records the operations reaching it (those the retrace would write: in make_fx's proxy slot,
below functionalization, where there is one), in a graph that then replaces the export's. A
graph with anything else (a write into an input, a parameter or a buffer, whose new value the
retrace makes an output; BatchNorm's running statistics; another higher-order operation; a
custom operator or Function) is left to ``run_decompositions``: the function says why and
changes nothing. Its graphs are the retrace's, node for node (operations, arguments, names,
fake values with their aliasing, stack traces, module paths, provenance;
``tests/test_decompose.py``, and 46 zoo and transformers models of the tests, 42 of them lowered
here), but for the stack traces of a region's operations (the region's own lines, where the
retrace's point into its generated code) and for the views that functionalization makes again
for the outputs (no module stack and no ``torch_fn``, where the retrace leaves on them those it
was at: an empty module stack and its last operation's).
"""

from __future__ import annotations

import contextlib
import functools
import operator

import torch
import torch.fx
from torch.fx.traceback import NodeSource, NodeSourceAction
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils import _pytree as pytree
from torch.export.graph_signature import InputKind, OutputKind

__all__ = ["decompose_functional_graph"]

# the metadata that the retrace copies from an operation to the nodes it lowers to
# (torch.fx.traceback.preserve_node_meta; ``val`` is the recorded fake value)
_COPIED = ("stack_trace", "nn_module_stack", "torch_fn", "source_fn_stack", "custom")
# a placeholder of a parameter or buffer takes these from the last operation reading it
# (torch._export.utils._collect_param_buffer_metadata: torch.fx.proxy._COPY_META_FIELDS
# without ``custom``, ``nn_module_stack`` and ``stack_trace``)
_PARAMETER_FIELDS = ("torch_fn", "source_fn_stack", "original_aten", "recompute", "ac_graph_id",
                     "has_backward_hook", "from_node", "quantization_tag", "_numeric_debug_handle",
                     "partitioner_tag")
_PASS = "rkgb.decompose"
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


class _NotFunctional(Exception):
    """The graph needs the whole retrace (``run_decompositions``)."""


class _Recorder(TorchDispatchMode):
    """Writes a node for every operation that reaches the dispatcher's Python key (below autograd
    and the CompositeImplicitAutograd decompositions), its tensor arguments read from the nodes
    that made them (``node_of``: ``id(tensor)`` -> node)."""

    def __init__(self, graph: torch.fx.Graph, node_of: dict, keep: list) -> None:
        super().__init__()
        self.graph = graph
        self.node_of = node_of
        self.keep = keep  # the recorded values (their ids stay theirs while the graph is built)
        self.source: torch.fx.Node | None = None
        self.meta: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.OpOverload) and func.namespace == "prim":
            return func(*args, **kwargs)  # (a fake tensor's device query: no operation)
        if not isinstance(func, torch._ops.OpOverload) or func._schema.is_mutable or func.namespace != "aten":
            raise _NotFunctional(f"{func} reached the graph")
        out = func(*args, **kwargs)
        if any(isinstance(leaf, _SYMBOLIC) for leaf in pytree.tree_leaves((args, kwargs, out))):
            raise _NotFunctional(f"{func} reads or makes a symbolic value")  # (``.item()``: the retrace's nodes for it)

        def node_arg(value):
            if isinstance(value, torch.Tensor):
                node = self.node_of.get(id(value))
                if node is None:
                    raise _NotFunctional(f"{func} reads a tensor that no node made")
                return node
            return value

        # (named as the retrace names them: the operation's name, numbered in the graph)
        node = self.graph.create_node("call_function", func, pytree.tree_map(node_arg, tuple(args)),
                                      pytree.tree_map(node_arg, dict(kwargs)),
                                      name=self.graph._target_to_str(func.overloadpacket.__name__))
        self._annotate(node, out)
        if isinstance(out, (tuple, list)):
            for index, value in enumerate(out):
                if isinstance(value, torch.Tensor):
                    item = self.graph.create_node("call_function", operator.getitem, (node, index), {}, name="getitem")
                    self._annotate(item, value)
                    self.made(value, item)
        elif isinstance(out, torch.Tensor):
            self.made(out, node)
        return out

    def at(self, source: torch.fx.Node | None, stack_trace: str | None = None) -> None:
        """The nodes recorded next come from ``source`` (its metadata, ``stack_trace`` in place
        of its own where given); None: from no operation (no provenance, no metadata)."""
        self.source = source
        self.meta = {} if source is None else {key: source.meta[key] for key in _COPIED if key in source.meta}
        if stack_trace is not None:
            self.meta["stack_trace"] = stack_trace

    def _annotate(self, node: torch.fx.Node, value) -> None:
        node.meta.update(self.meta)
        if self.source is not None:  # (None: functionalization's views made again for the outputs)
            node.meta["from_node"] = [NodeSource(self.source, _PASS, NodeSourceAction.CREATE)]
        node.meta["val"] = value

    def made(self, value: torch.Tensor, node: torch.fx.Node) -> None:
        """``value`` is made by ``node`` (an operation's result, a placeholder)."""
        self.node_of[id(value)] = node
        self.keep.append(value)


class _FunctionalizedRecorder(_Recorder):
    """The recorder below functionalization: in the slot of make_fx's proxy mode (an infra
    mode, which the dispatcher runs after the functionalization mode and before the fake one),
    so that it records the functional operations that functionalization writes, as the
    retrace's proxy mode does."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._mode_key = torch._C._TorchDispatchModeKey.PROXY
        # (functionalization asks the proxy mode's tracer for the node of a view it makes again
        # after a write, whose stack trace the view made again takes: the retrace's replay)
        self.tracer = _Tracker(self.node_of)

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True

    def _annotate(self, node: torch.fx.Node, value) -> None:
        super()._annotate(node, value)
        replayed = torch.fx.traceback.get_current_replay_node()
        if replayed is not None:  # (torch.fx.proxy.TracerBase.create_node)
            node.meta["is_functional_regenerated"] = True
            for key in ("custom", "stack_trace"):
                if key in replayed.meta:
                    node.meta[key] = replayed.meta[key]


class _Tracker:
    """What functionalization reads of make_fx's tracer: ``tensor_tracker[tensor].proxy.node``."""

    class _Entry:
        def __init__(self, node: torch.fx.Node) -> None:
            self.proxy = self
            self.node = node

    def __init__(self, node_of: dict) -> None:
        self.tensor_tracker = self
        self.node_of = node_of

    def __getitem__(self, tensor: torch.Tensor) -> "_Tracker._Entry":
        node = self.node_of.get(id(tensor))
        if node is None:
            raise KeyError(tensor)
        return self._Entry(node)


@functools.lru_cache(maxsize=1)
def _preserved_operations() -> dict:
    """The CompositeImplicitAutograd operations that ``run_decompositions({})`` keeps whole (each
    -> the marker that keeps it), as it splits its empty table; found once per process (0.2 s:
    every registered operation is looked at). The graph's operations are aten's (custom ones
    are left to ``run_decompositions``), whose registrations do not change."""
    from torch.export.exported_program import _split_decomp_table_to_cia_and_python_decomp

    preserved, python_table = _split_decomp_table_to_cia_and_python_decomp({})
    assert not python_table
    return preserved


def _fake_mode(graph: torch.fx.Graph):
    for node in graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch._subclasses.fake_tensor.FakeTensor):
            return value.fake_mode
    return None


def _check_operations(graph: torch.fx.Graph) -> bool:
    """What the lowering cannot stand for, found before any work: an operation of another
    namespace, a higher-order operation but a region without grad, a symbolic value, a write
    into an input or a buffer. Returns whether the graph writes in place (its tensors of its own:
    functionalized)."""
    writes = False
    for node in graph.nodes:
        if _symbolic(node.meta.get("val")):
            # (``.item()``, a shape read from values: calling it again makes a new symbol, which
            # the retrace after would find pending)
            raise _NotFunctional(f"{node.name} is a symbolic value")
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        target = node.target
        if isinstance(target, torch._ops.HigherOrderOperator):
            if getattr(target, "__name__", "") != "wrap_with_set_grad_enabled" or node.args[0] is not False:
                raise _NotFunctional(f"higher-order operation {target}")
            region = node.graph.owning_module.get_submodule(node.args[1].target) \
                if isinstance(node.args[1], torch.fx.Node) else None
            if isinstance(region, torch.fx.GraphModule):
                writes |= _check_operations(region.graph)
        elif not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
            raise _NotFunctional(f"{target}")
        elif target._schema.is_mutable and target is not torch.ops.aten.detach_.default:
            written = _written_input(node)
            if written is not None:  # (the retrace makes its new value an output: not done here)
                raise _NotFunctional(f"{written}, an input, is written in place by {node.name}")
            writes = True
        elif target in _WRITING_STATISTICS and node.args[5] is True and node.args[3] is not None:
            raise _NotFunctional(f"{node.name} writes its running statistics (buffers) in place")
    return writes


# operations whose kernels write their running statistics in place in training (args: input,
# weight, bias, running_mean, running_var, training, ...): their buffers become outputs
_WRITING_STATISTICS = {torch.ops.aten.batch_norm.default, torch.ops.aten.instance_norm.default}


def _written_input(node: torch.fx.Node) -> str | None:
    """The placeholder (an input, parameter or buffer) that the in-place operation ``node``
    writes, through the views its written argument is made of; None where it writes a tensor
    of the graph's own."""
    for argument, value in zip(node.target._schema.arguments, node.args):
        if argument.alias_info is None or not argument.alias_info.is_write or not isinstance(value, torch.fx.Node):
            continue
        while value is not None:  # (up the views' bases: earlier nodes, to a placeholder or not)
            if value.op == "placeholder":
                return value.name
            value = value.args[0] if _is_view_of_first(value) else None
    return None


def _is_view_of_first(node: torch.fx.Node) -> bool:
    """Whether ``node`` returns a view of its first argument, a node, that it does not write
    (``view``, ``slice``, ``select``, ``t``, ``expand``...)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    schema = target._schema
    first = schema.arguments[0].alias_info if schema.arguments else None
    return first is not None and not first.is_write and bool(schema.returns) \
        and schema.returns[0].alias_info is not None


def _symbolic(value) -> bool:
    """Whether ``value`` is or holds a symbolic number (a tensor's size or stride too)."""
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, _SYMBOLIC):
            return True
        if isinstance(leaf, torch.Tensor) and any(isinstance(d, _SYMBOLIC) for d in (*leaf.shape, *leaf.stride())):
            return True
    return False


def _check_signature(exported) -> None:
    signature = exported.graph_signature
    for spec in signature.input_specs:
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.USER_INPUT, InputKind.CONSTANT_TENSOR):
            raise _NotFunctional(f"input {spec.arg.name} of kind {spec.kind}")
    for spec in signature.output_specs:
        if spec.kind is not OutputKind.USER_OUTPUT:
            raise _NotFunctional(f"output {spec.arg.name} of kind {spec.kind}")


def decompose_functional_graph(exported, decompositions: dict) -> str | None:
    """Lower ``exported`` (a training graph of torch.export) in place as
    ``exported.run_decompositions(decompositions)`` would, where it writes no input in place
    (module docstring). Returns None where it did, else why it left the graph as it was (for
    ``run_decompositions``)."""
    if decompositions:
        return "decompositions asked for"
    try:
        _check_signature(exported)
        graph, renamed = _lowered(exported, functionalize=_check_operations(exported.graph))
    except _NotFunctional as reason:
        return str(reason)
    except Exception as error:  # noqa: BLE001 a case this lowering does not know: the retrace's exact one instead
        return f"the lowering failed ({type(error).__name__}: {error})"
    signature = exported.graph_signature
    for spec in signature.output_specs:
        spec.arg.name = renamed.get(spec.arg.name, spec.arg.name)
    order = {node.name: i for i, node in enumerate(n for n in graph.nodes if n.op == "placeholder")}
    signature.input_specs.sort(key=lambda spec: order[spec.arg.name])
    exported.graph_module.graph = graph
    return None


def _lowered(exported, functionalize: bool = False):
    """The lowered graph and the names its outputs took (old name -> new). ``functionalize``:
    the graph writes in place; its operations run on functional tensors (torch's
    functionalization, as the retrace's), the recorder below it."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
    from torch.export.exported_program import _override_composite_implicit_decomp
    from torch.export._trace import _ignore_backend_decomps

    old = exported.graph
    fake_mode = _fake_mode(old)
    if fake_mode is None:
        raise _NotFunctional("no fake values")
    cia_to_decomp = _preserved_operations()
    graph = torch.fx.Graph()
    node_of: dict[int, torch.fx.Node] = {}  # id(fake value) -> its node in the new graph
    keep: list = []
    value_of: dict[torch.fx.Node, object] = {}  # old node -> its value in the new graph
    recorder = (_FunctionalizedRecorder if functionalize else _Recorder)(graph, node_of, keep)
    functional_inputs: list = []
    renamed: dict[str, str] = {}
    # the retrace's dispatch: below autograd (its values require no grad, but the
    # placeholders'), the Python dispatcher's decompositions, the preserved operations whole
    # (the override patches every such operation: entered once, not per node)
    order = _placeholder_order(exported.graph_signature)
    placeholders = sorted((node for node in old.nodes if node.op == "placeholder"), key=lambda n: order[n.name])
    functional = FunctionalTensorMode(pre_dispatch=False, export=True, _allow_token_discovery=True) \
        if functionalize else contextlib.nullcontext()
    with fake_mode, torch.no_grad(), _ignore_backend_decomps(), enable_python_dispatcher(), \
            _override_composite_implicit_decomp(cia_to_decomp), functional, recorder:
        for node in placeholders + [node for node in old.nodes if node.op != "placeholder"]:
            if node.op == "placeholder":
                new = graph.placeholder(node.name, type_expr=node.type)
                new.name = node.name  # (a builtin's name too: ``input``, as the retrace keeps it)
                new.meta = dict(node.meta)
                value = node.meta.get("val")
                if isinstance(value, torch.Tensor):
                    recorder.made(value, new)
                    if functionalize:
                        value = FunctionalTensor.to_functional(value)
                        functional_inputs.append((node.name, value))
                value_of[node] = value
            elif node.op == "output":
                if functionalize:  # (what the syncs make again comes from no operation, as in the retrace)
                    recorder.at(None)
                    for name, value in functional_inputs:
                        torch._sync(value)
                        if torch._functionalize_has_data_mutation(value.elem) \
                                or torch._functionalize_has_metadata_mutation(value.elem):
                            raise _NotFunctional(f"{name}, an input, is written in place")

                def new_output(arg):
                    value = value_of[arg]
                    if functionalize and isinstance(value, FunctionalTensor):
                        torch._sync(value)
                        value = torch._from_functional_tensor(value.elem)
                    found = node_of.get(id(value)) if isinstance(value, torch.Tensor) else None
                    if found is None or found.op == "placeholder":
                        raise _NotFunctional("an output that is not a computed tensor")
                    if found.name != arg.name:
                        renamed[arg.name] = found.name
                    return found

                output = graph.output(torch.fx.node.map_arg(node.args[0], new_output))
                output.meta = dict(node.meta)
                output.meta["from_node"] = [NodeSource(node, _PASS, NodeSourceAction.CREATE)]
            elif node.op == "call_function":
                value_of[node] = _lower(node, value_of, recorder, functionalize)
            elif node.op == "get_attr" and node.users and all(
                    user.op == "call_function" and isinstance(user.target, torch._ops.HigherOrderOperator)
                    for user in node.users):
                value_of[node] = getattr(exported.graph_module, node.target)  # (a region's module, inlined)
            else:
                raise _NotFunctional(f"a {node.op} node")
    names = [spec.arg.name for spec in exported.graph_signature.output_specs]
    if len(set(renamed.get(n, n) for n in names)) != len(names):
        raise _NotFunctional("two outputs of one node")
    graph.eliminate_dead_code()  # (the retrace's: what a lowering made that nothing reads)
    with fake_mode, torch.no_grad():
        _values_without_grad(graph)
    _parameter_metadata(exported, graph)
    graph.lint()
    return graph, renamed


def _lower(node: torch.fx.Node, value_of: dict, recorder: "_Recorder", functionalize: bool):
    """The value of ``node`` in the new graph, the operations it lowers to recorded there by the
    recorder entered (``functionalize``: below functionalization, which stands for the fresh
    constants' copies and the writes)."""
    target = node.target
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: value_of[n])
    if target is operator.getitem:
        return args[0][args[1]]
    if isinstance(target, torch._ops.HigherOrderOperator):
        # a region run without grad (``torch.no_grad()``, an ``@torch.no_grad`` method): its
        # module's operations inlined, each from the region's node (its metadata)
        if getattr(target, "__name__", "") != "wrap_with_set_grad_enabled" or args[0] is not False \
                or kwargs or not isinstance(args[1], torch.fx.GraphModule):
            raise _NotFunctional(f"higher-order operation {target}")
        return _inlined(node, args[1], args[2:], recorder, functionalize)
    recorder.at(node)
    if functionalize and isinstance(target, torch._ops.OpOverload) and target.namespace == "aten":
        return target(*args, **kwargs)
    if target is torch.ops.aten.detach_.default and isinstance(args[0], torch.Tensor) \
            and not args[0].requires_grad and not kwargs:
        return args[0]  # (a constant made fresh, ``torch.tensor(...)``: nothing for functionalization to write)
    elif target is torch.ops.aten.lift_fresh_copy.default:
        call = torch.ops.aten.clone.default  # (functionalization's copy of a constant)
    elif isinstance(target, torch._ops.OpOverload) and target.namespace == "aten":
        if target._schema.is_mutable:
            raise _NotFunctional(f"{target} writes in place")
        call = target
    else:
        raise _NotFunctional(f"{target}")
    return call(*args, **kwargs)


def _inlined(node: torch.fx.Node, region: torch.fx.GraphModule, args, recorder: "_Recorder",
             functionalize: bool):
    """The results of the region ``node`` runs without grad, its operations recorded as the
    retrace inlines them: each from ``node`` (its provenance, module path and function), with
    the stack trace of the region's own operation (the retrace's is its generated code's line)."""
    inner: dict[torch.fx.Node, object] = {}
    placeholders = iter(args)
    result = None
    for sub in region.graph.nodes:
        if sub.op == "placeholder":
            inner[sub] = next(placeholders)
        elif sub.op == "output":
            result = torch.fx.node.map_arg(sub.args[0], inner.__getitem__)
        elif sub.op == "call_function":
            sub_args, sub_kwargs = torch.fx.node.map_arg((sub.args, sub.kwargs), inner.__getitem__)
            if sub.target is operator.getitem:
                inner[sub] = sub_args[0][sub_args[1]]
                continue
            if not (isinstance(sub.target, torch._ops.OpOverload) and sub.target.namespace == "aten") \
                    or (sub.target._schema.is_mutable and not functionalize):
                raise _NotFunctional(f"{sub.target} in a region without grad")
            recorder.at(node, sub.meta.get("stack_trace"))
            inner[sub] = sub.target(*sub_args, **sub_kwargs)
        else:
            raise _NotFunctional(f"a {sub.op} node in a region without grad")
    return result


def _values_without_grad(graph: torch.fx.Graph) -> None:
    """The retrace's values, traced below autograd, require no grad; a view of a parameter
    recorded here came out of its kernel before autograd marked it as requiring grad: its
    alias without grad stands for it (the same storage)."""
    for node in graph.nodes:
        if node.op == "call_function":
            node.meta["val"] = pytree.tree_map_only(
                torch.Tensor, lambda t: t.detach() if t.requires_grad else t, node.meta["val"])


def _placeholder_order(signature) -> dict[str, int]:
    """The place of each input in the retraced graph (placeholder name -> rank): parameters, then
    buffers, in the order of ``named_parameters`` and ``named_buffers`` of the unlifted module
    that the retrace traces (``ExportedProgram.module()``), then the user's inputs as they were.
    Its modules come in the order of the export's inputs; the retrace registers each tensor
    constant as a buffer of its module, after the module's own
    (``torch._export.utils._register_constants_as_buffers``), so that a constant goes with the
    buffers, in its module's place (Llama's causal mask value before its rotary embedding's
    buffers, which a submodule holds)."""
    children: dict[str, list[str]] = {"": []}
    own: dict[str, dict[str, list[str]]] = {"": {"parameters": [], "buffers": [], "constants": []}}

    def module_of(path: str) -> str:
        owner = path.rpartition(".")[0]
        parts = owner.split(".") if owner else []
        for depth in range(len(parts)):
            child, parent = ".".join(parts[:depth + 1]), ".".join(parts[:depth])
            if child not in children:
                children[child] = []
                own[child] = {"parameters": [], "buffers": [], "constants": []}
                children[parent].append(child)
        return owner

    kind_of = {InputKind.PARAMETER: "parameters", InputKind.BUFFER: "buffers", InputKind.CONSTANT_TENSOR: "constants"}
    for spec in signature.input_specs:
        if spec.kind in kind_of:
            own[module_of(spec.target)][kind_of[spec.kind]].append(spec.arg.name)
    ranked: list[str] = []
    for kinds in (("parameters",), ("buffers", "constants")):
        pending = [""]
        while pending:
            module = pending.pop()
            for kind in kinds:
                ranked.extend(own[module][kind])
            pending.extend(reversed(children[module]))
    ranked.extend(spec.arg.name for spec in signature.input_specs if spec.kind is InputKind.USER_INPUT)
    order: dict[str, int] = {}
    for name in ranked:
        order.setdefault(name, len(order))
    if len(order) != len(signature.input_specs):
        raise _NotFunctional("inputs the retrace's order does not place")
    return order


def _parameter_metadata(exported, graph: torch.fx.Graph) -> None:
    """A parameter's or buffer's placeholder takes the metadata of the last operation that
    reads it, as ``run_decompositions`` gives it (module constant ``_PARAMETER_FIELDS``)."""
    signature = exported.graph_signature
    kinds = {spec.arg.name: spec.kind for spec in signature.input_specs}
    last_reader: dict[str, torch.fx.Node] = {}
    for node in exported.graph.nodes:
        if node.op == "call_function" and not isinstance(node.target, torch._ops.HigherOrderOperator):
            for arg in node.all_input_nodes:
                if arg.op == "placeholder" and kinds.get(arg.name) in (InputKind.PARAMETER, InputKind.BUFFER):
                    last_reader[arg.name] = node
    for placeholder in graph.nodes:
        if placeholder.op != "placeholder" or kinds.get(placeholder.name) not in (InputKind.PARAMETER, InputKind.BUFFER):
            continue
        reader = last_reader.get(placeholder.name)
        if reader is None:  # (one read by no operation, a tied parameter's other name: its own)
            placeholder.meta["from_node"] = [NodeSource(placeholder, _PASS, NodeSourceAction.CREATE)]
            continue
        for key in _PARAMETER_FIELDS:
            if key == "from_node":
                placeholder.meta[key] = [NodeSource(reader, _PASS, NodeSourceAction.CREATE)]
            elif key in reader.meta:
                placeholder.meta[key] = reader.meta[key]
