"""Generate the Python source of a schedule: one function per phase, one ATen operation a line.

The executor of Rockmate (ICML 2023, section 5) runs a schedule of the CD-graph
(:mod:`rkgb.cdgraph`) as plain Python. :func:`generate` turns a schedule into two functions:

- ``forward_phase(s, *inputs)``: every operation before ``Compute("loss")``, then the buffer
  updates of the step; returns the model's outputs (detached);
- ``backward_phase(s)``: the gradients of the outputs (``s.grad_outputs``), then every operation after
  the loss.

``s`` is the state of one training step (:class:`exec.runtime.StepState`); every value that a
later operation may need lives in one of its attributes (``s.linear`` is the leaf holding the
data of node ``linear``, ``s._linear`` the output of its autograd island). Parameters, buffers,
constants, placeholder tensors and the few runtime helpers are globals of the generated code,
so that at run time a line costs one ATen call and nothing else: no dictionary lookups by name
and no interpretation of fx nodes.

Every decision that depends only on the schedule is taken here, at generation time: whether a
computation is the node's first of the step (create the leaf, record the RNG state, capture the
buffer updates) or a recomputation (assign ``.data``, replay the RNG state), whether it runs
with grad, and which views to drop when data is forgotten.
"""

from __future__ import annotations

import functools
import linecache
import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from rkgb.functions import applied_function
from rkgb.interpret import EAGER_KERNELS, GRAD_MODE_NUMERICS, REQUIRES_GRAD_DISPATCH, batch_norms_in_place, tensor_args
from rkgb.simplify import (NO_GRADIENT, SPLIT_TARGETS, SimplifiedGraph, SimplifiedNode, gradient_needs, parameter_gradient_sources,
                           split_of_view, summed_input_views, summed_parameter_views, summing_view_chain)
from solvers.schedule import Compute, Forget, Schedule
from .code_cache import compiled_source
from .merge import grad_readers

__all__ = ["GeneratedCode", "MARKER_PREFIX", "ScheduleError", "NodeInfo", "node_infos", "generate"]


MARKER_PREFIX = "rockmate:op:"  # profiler ranges of schedule operations (markers=True)


class ScheduleError(ValueError):
    """The schedule cannot be executed on this graph (unknown node, missing autograd graph)."""


@dataclass
class NodeInfo:
    """What the code generator needs to know about one simplified node.

    ``exported``: fx names of the node's tensors that other nodes (or the model's outputs)
    read: its result or views of it. Each gets a leaf (``s.<name>``) whose gradient is
    collected as is, so that a node's backward receives the same gradients as in eager PyTorch
    (summed at the same place, in the same layout). ``requires_grad``: whether the node's
    outputs depend on a tensor that requires grad (otherwise it has no island and no backward).
    ``updates``: fx name of a result -> buffer path it is the new value of.
    """

    node: SimplifiedNode
    exported: list[str]
    requires_grad: bool
    exported_requires_grad: dict[str, bool]
    metadata: dict[str, tuple[tuple[int, ...], torch.dtype]]
    updates: dict[str, str]


def node_infos(graph: SimplifiedGraph, global_requires_grad: dict[str, bool]) -> dict[str, NodeInfo]:
    """Static information on every node, given which globals (placeholder names) require grad;
    which nodes need a backward is :func:`rkgb.simplify.gradient_needs`."""
    infos: dict[str, NodeInfo] = {}
    needs = gradient_needs(graph, global_requires_grad)
    for node in graph.nodes:
        exported = graph.exported(node)
        values = {line.name: line.meta["val"] for line in [node.main] + node.body if line.name in exported}
        infos[node.name] = NodeInfo(
            node=node,
            exported=exported,
            requires_grad=needs[node.name].requires_grad,
            exported_requires_grad=dict(needs[node.name].exported),
            metadata={name: (tuple(int(d) for d in v.shape), v.dtype) for name, v in values.items()},
            updates=dict(node.buffer_updates),
        )
    return infos


@dataclass
class GeneratedCode:
    """The generated source, its compiled phase functions and the globals they read."""

    source: str
    filename: str
    forward_phase: Any
    backward_phase: Any
    globals: dict[str, Any]
    global_names: dict[str, str]  # placeholder name of a parameter/buffer/constant -> global name


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.indent = 1

    def __call__(self, text: str) -> None:
        self.lines.append("    " * self.indent + text)

    def comment(self, text: str) -> None:
        self("# " + text)


class _Generator:
    """Walk the schedule once, tracking statically what is alive, and write the code."""

    def __init__(
        self,
        graph: SimplifiedGraph,
        schedule: Schedule,
        infos: dict[str, NodeInfo],
        input_requires_grad: list[bool],
        device: torch.device,
        merged: dict[str, str] | None = None,
        markers: bool = False,
        aliased_parameters: set[str] | frozenset[str] = frozenset(),
        trained_parameters: set[str] | frozenset[str] = frozenset(),
        released_outputs: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        self.graph = graph
        # nodes whose data the model returns and no backward reads: the user's tensors alone
        # hold them once the forward returns (:func:`exec.runtime.outputs_to_release`)
        self.released_outputs = set(released_outputs)
        # parameters with hooks: the islands read an alias (s.param_<name>) whose gradient the
        # compiled module returns whole, so that the hooks run once (exec.runtime)
        self.aliased_parameters = set(aliased_parameters)
        self.markers = markers  # wrap each schedule operation in a profiler range (exec.timeline)
        # merged islands (exec.merge): a -> b, b reads a's outputs directly, not via leaves
        self.merged = dict(merged or {})
        # a merged node -> the nodes that read its outputs directly (with grad: all in its
        # island, exec.merge.closed_merges); its outputs' locals live until the last has run
        readers = grad_readers(graph, infos) if self.merged else {}
        self.raw_readers = {a: set(readers[a]) for a in self.merged}
        self.raw_outputs: dict[str, dict[str, str]] = {}  # merged node -> fx name -> local of its output
        self.raw_pending: dict[str, set[str]] = {}  # merged node -> its readers yet to run
        self.schedule = schedule
        self.infos = infos
        self.device = device
        self.globals: dict[str, Any] = {"torch": torch, "aten": torch.ops.aten}
        self.constant_count = 0
        captured = graph.captured
        self.input_names = [name for name in captured.inputs if name is not None]
        self.input_requires_grad = input_requires_grad
        # where each fx name lives at run time
        self.global_placeholders = set(captured.parameters) | set(captured.buffers) | set(captured.constants)
        self.state_names = {n.name for n in graph.global_views} | set(self.input_names)
        for info in infos.values():
            self.state_names |= set(info.exported)
        self.computed: set[str] = set()  # nodes computed at least once this step
        # nodes the schedule computes more than once (random ones replay their first numbers)
        counts: dict[str, int] = {}
        for op in schedule.ops:
            if isinstance(op, Compute) and op.node.startswith("fwd_"):
                counts[op.node[4:]] = counts.get(op.node[4:], 0) + 1
        self.recomputed = {name for name, count in counts.items() if count > 1}
        self.has_graph: set[str] = set()  # nodes with an unconsumed autograd island
        self.local_values: dict[str, str] = {}  # fx name -> local expression (prelude values)
        self.buffer_updates: list[tuple[str, str]] = []  # (buffer global, local value)
        # buffers the step updates that a node recomputed in the backward phase reads: copied
        # when the forward ends, before the update, and read from the copy afterwards
        self.phase = "forward"
        self.snapshots: dict[str, str] = {}
        # leaves whose gradient a GradSink collects: node outputs and inputs that require grad
        self.sink_names = {name for name, flag in zip(self.input_names, input_requires_grad) if flag}
        for name, info in infos.items():
            if name not in self.merged:
                self.sink_names |= {out for out in info.exported if info.exported_requires_grad[out]}
        self.position = {n.name: i for i, n in enumerate(graph.captured.graph.nodes)}
        self.contributions_waiting = False  # a backward ran since the last flush_gradients()
        snapshot = set(graph.snapshot_buffers())
        for node in graph.nodes:
            if node.name in self.recomputed:
                for name in graph.reads(node) & snapshot:
                    self.snapshots[name] = f"s.snapshot_{name}"
        for view in graph.global_views:  # views of a copied buffer are remade from the copy
            if graph.owner.get(view.name) in self.snapshots:
                self.snapshots[view.name] = f"s.snapshot_{view.name}"
        self.split_aliases: list[str] = []  # aliases of the island being written
        self.skipped_lines: set[str] = set()  # lines of the island being written that its reads alias
        self.read_by_one = graph.results_read_by_one_node()  # (their readers need no alias per read)
        # views of inputs that require grad made in nodes' preludes: each a group of gradient
        # contributions, joining the input's gradient where eager runs the view's backward
        # (rkgb.gradsink.GradientQueue.alias, _deliver_view_groups)
        self.view_groups = {view for name in self.input_names if name in self.sink_names
                            for view in graph.input_view_readers(name)}
        # and views of nodes' results made in each of their readers (rkgb.simplify)
        self.view_groups |= set(graph.grouped_views)
        # and a view of an input that the user gets (made once, before the nodes): its
        # gradient joins the input's where eager runs the view's backward, after those of the
        # nodes made after it (rkgb.build.first_run_bytes counts its sum meanwhile)
        self.view_groups |= {line.name for line in graph.global_views
                             if line.name in graph.outputs and self._input_of_view(line) is not None}
        # groups made in the readers' preludes whose views' backward sums (an expand), or of
        # inputs' views smaller than the input (a slice, a split's pieces): summed at the size of
        # the chain's last view, which the reads alias, and the chain's backward run once on the
        # sum (rkgb.simplify.summed_input_views): group -> its chain of views
        # (and splits of inputs read through their pieces, summed piece by piece: each piece
        # read -> (the split, the piece's index))
        self.split_pieces: dict[str, tuple[str, int]] = {}
        self.summing_groups = self._summing_groups()
        # views of trained parameters made once, whose backward sums, read by several nodes:
        # a group each, its sum through the views' backward into the parameter's gradient
        self.parameter_views = summed_parameter_views(graph, trained_parameters)
        self.trained_parameters = set(trained_parameters)
        self.view_groups |= set(self.parameter_views)
        self.view_functions: dict[str, str] = {}  # group -> the global name of its views' function
        self.delivered_groups: set[str] = set()
        # exported views in a node's body whose gradient joins the result's where eager runs
        # the view's backward: view -> the node (see _result_views_made_late)
        self.late_result_views = _result_views_made_late(graph, infos, self.merged)
        # late views -> the views of them that the node exports too (see _views_of_late_views)
        self.late_view_views = _views_of_late_views(graph, infos, self.late_result_views)
        self.body_lines = {line.name: line for node in graph.nodes for line in node.body}

    # -- expressions ---------------------------------------------------------------------
    def bind(self, value: Any, hint: str) -> str:
        self.constant_count += 1
        name = f"{hint}_{self.constant_count}"
        self.globals[name] = value
        return name

    def ref(self, fx_name: str) -> str:
        if fx_name in self.local_values:
            return self.local_values[fx_name]
        if fx_name in self.graph.updated_first:  # the buffer holds it (written before the forward)
            return self.graph.updated_first[fx_name]
        if self.phase == "backward" and fx_name in self.snapshots:
            return self.snapshots[fx_name]
        if fx_name in self.aliased_parameters:
            return f"s.param_{fx_name}"
        if fx_name in self.global_placeholders:
            return fx_name
        if fx_name in self.state_names:
            return f"s.{fx_name}"
        raise ScheduleError(f"the generated code refers to {fx_name!r}, which has no value here")

    def expr(self, value: Any, ref=None) -> str:
        """Python source for an fx argument; ``ref(node)`` (default: :meth:`ref` of its name)
        gives the source of a reference to a node."""
        if isinstance(value, torch.fx.Node):
            return ref(value) if ref is not None else self.ref(value.name)
        if isinstance(value, (list, tuple)):
            inner = ", ".join(self.expr(v, ref) for v in value)
            if isinstance(value, tuple):
                return f"({inner},)" if len(value) == 1 else f"({inner})"
            return f"[{inner}]"
        if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
            return repr(value)
        if isinstance(value, float):
            if math.isfinite(value):
                return repr(value)
            return self.bind(value, "constant")  # inf, -inf, nan
        if isinstance(value, torch.dtype):
            return str(value)  # torch.float32
        if isinstance(value, (torch.memory_format, torch.layout)):
            return str(value)
        if isinstance(value, torch.device):
            return self.bind(value, "device")
        return self.bind(value, "constant")

    def call(self, fx_node: torch.fx.Node, reads: list[str] | None = None, function: str | None = None) -> str:
        """Python source of one fx node's operation; ``reads``, when given, is the source of
        each of its tensor arguments, in order (see :meth:`split_reads`); ``function``: the
        name of the runtime helper to call instead of the line's own target."""
        ref = None
        if reads is not None:
            sources = iter(reads)
            ref = lambda _: next(sources)  # noqa: E731 - arguments in traversal order
        if fx_node.target is operator.getitem:
            return f"{self.expr(fx_node.args[0], ref)}[{self.expr(fx_node.args[1], ref)}]"
        if function is None:
            function = self.function(fx_node)
        args = [self.expr(a, ref) for a in fx_node.args]
        args += [f"{k}={self.expr(v, ref)}" for k, v in fx_node.kwargs.items()]
        return f"{function}({', '.join(args)})"

    @functools.cached_property
    def _sources_requiring_grad(self) -> frozenset[str]:
        """What the nodes read that requires grad in eager: the trained parameters, the inputs
        that require grad, the views of them made once, the exported tensors that get a gradient."""
        requiring = set(self.trained_parameters)
        requiring |= {name for name, flag in zip(self.input_names, self.input_requires_grad) if flag}
        for view in self.graph.global_views:
            if any(arg.name in requiring for arg in view.all_input_nodes):
                requiring.add(view.name)
        for info in self.infos.values():
            requiring |= {name for name, flag in info.exported_requires_grad.items() if flag}
        return frozenset(requiring)

    def requiring_grad_in_eager(self, node: SimplifiedNode) -> set[str]:
        """The fx names, among ``node``'s lines and what they read, of the floating-point values
        that require grad in eager: :attr:`_sources_requiring_grad` and what lines compute from
        them (:func:`rkgb.simplify.gradient_needs`, line by line)."""
        requiring = set(self._sources_requiring_grad)
        for line in node.lines:
            if line.target in NO_GRADIENT:
                continue
            value = line.meta.get("val")
            if isinstance(value, torch.Tensor) and value.is_floating_point() \
                    and any(arg.name in requiring for arg in line.all_input_nodes):
                requiring.add(line.name)
        return requiring

    def function(self, fx_node: torch.fx.Node) -> str:
        """Python source of the function that ``fx_node`` calls (an aten op by its name)."""
        target = fx_node.target
        if target is torch.ops.rockmate.function_call.default:
            # a custom autograd.Function applied as one operation (rkgb.functions): named after it
            return self.bind(target, f"apply_{applied_function(fx_node.args[0]).function.__name__}")
        if target in EAGER_KERNELS:  # a batch norm: eager's dispatch (rkgb.interpret.EAGER_KERNELS)
            function = EAGER_KERNELS[target]
            self.globals[function.__name__] = function
            return function.__name__
        if isinstance(target, torch._ops.OpOverload):
            namespace = target.namespace
            packet = target._overloadpacket.__name__
            return f"aten.{packet}.{target._overloadname}" if namespace == "aten" else self.bind(target, "op")
        return self.bind(target, getattr(target, "__name__", "function"))

    def _buffer_update(self, w: _Writer, path: str, value: str) -> None:
        """Keep ``value`` as the new value of the buffer at ``path``, written when the forward
        ends."""
        buffer = self._buffer_global(path)
        variable = f"new_{buffer}"
        self.buffer_updates.append((buffer, variable))
        w(f"{variable} = {value}")

    def _deliver_view_groups(self, w: _Writer, position: int) -> None:
        """Before the backward of a node made at ``position``: the view groups of views made
        after it join their inputs' gradients (eager runs a view's backward once every node
        made after the view has run its own), the latest view first (the engine runs the node
        made last first). ``position`` -1: every group not delivered yet (the backward's end)."""
        for view in sorted(self.view_groups | set(self.late_result_views), key=lambda name: -self.position[name]):
            if view not in self.delivered_groups and self.position[view] > position:
                self.delivered_groups.add(view)
                if view not in self.late_result_views:
                    w(f"s.queue.deliver({view!r})")
                    continue
                if self.contributions_waiting:
                    # (at a backward absorbed by a merged island, whose call ran before: the
                    # view's gradient may be among the waiting contributions; unflushed, it was
                    # left for the base's own backward to add, after contributions that eager
                    # adds after it: Mamba's first layers' gradients 1 ulp off)
                    w("flush_gradients()  # the view's gradient may be waiting")
                    self.contributions_waiting = False
                # the view's gradient, summed in its own sink, with those of the views of it that
                # the node exports (eager adds them into the view's buffer first: their backwards
                # run before the view's), through the views' backwards (no allocation: a reshape,
                # a transpose), made again from the result's leaf (the node's island may not be
                # made yet: a forward without grad, recomputed later), into the result's gradient
                base = self.late_result_views[view]
                views = [view] + self.late_view_views.get(view, [])
                # (and the splits whose pieces are among them, which the pieces are made from)
                made = set(views) | {self.body_lines[v].args[0].name for v in views
                                     if self.body_lines[v].target is operator.getitem}
                lines = [line for name, line in self.body_lines.items() if name in made]
                function = self.bind(_ViewsOfBase(base, lines, outputs=views), "views")
                w(f"late_views_gradient(s.{base}, {function}, {self.tuple(f's.{v}' for v in views)}, s.sink_{base})")

    def split_reads(self, w: _Writer, node: SimplifiedNode) -> dict[str, list[str]]:
        """Aliases for the leaves an island reads more than once (see
        :class:`rkgb.gradsink.GradientQueue`): writes one ``use(...)`` line per read and returns,
        for each line that reads one, the source of each of its tensor arguments."""
        counts: dict[str, int] = {}
        for line in node.lines:
            for arg in tensor_args(line):
                counts[arg.name] = counts.get(arg.name, 0) + 1
        own = {line.name for line in node.lines}
        split = {name for name, count in counts.items()
                 if count > 1 and name in self.sink_names and name not in self.local_values and name not in own
                 and self.read_by_one.get(name) != node.name}
        grouped = {line.name for line in node.prelude if line.name in self.view_groups}
        # a grouped view that the island reads more than once: each read makes its own view of
        # its own alias, so that the group sums each contribution in turn, as eager's view
        # buffer does (where the engine would sum the island's reads first)
        lines_by_name = {line.name: line for line in node.prelude}
        remade = {name for name in grouped if counts.get(name, 0) > 1 and self._base_of_grouped_view(lines_by_name[name])
                  and isinstance(lines_by_name[name].meta.get("val"), torch.Tensor)}  # (not a split's pieces)
        # groups summed at their views' size: the reads of the chain's last view are aliases of
        # that view (the chain's lines are not written), and so are the reads of views of
        # trained parameters that several nodes read
        through: dict[str, tuple[str, str, bool, str]] = {}  # view read -> (base, sink, global, group)
        for group in grouped & set(self.summing_groups):
            chain = self.summing_groups[group]
            base = chain[0].all_input_nodes[0].name
            if base not in self.sink_names:
                continue
            self.skipped_lines |= {view.name for view in chain}
            # (a split's: each piece read is an alias of that piece, summed as a group of its own)
            ends = [piece for piece, (split, _) in self.split_pieces.items() if split == group] or [chain[-1].name]
            self.skipped_lines |= set(ends)
            for end in ends:
                through[end] = (f"s.{base}", f"s.sink_{base}", base in self.input_names, group)
        if self.parameter_views:
            for line in node.lines:
                for arg in tensor_args(line):
                    if arg.name in self.parameter_views:
                        parameter = self.parameter_views[arg.name][0].all_input_nodes[0].name
                        through[arg.name] = (self.ref(parameter), self.parameter_sink(parameter), True, arg.name)
        reads: dict[str, list[str]] = {}
        for line in node.lines:
            args = tensor_args(line)
            if line.name in self.skipped_lines:
                continue
            if not any(arg.name in split or arg.name in remade or arg.name in through for arg in args) \
                    and line.name not in grouped:
                continue
            sources = []
            for k, arg in enumerate(args):
                if arg.name in through:
                    base, sink, is_global, group = through[arg.name]
                    chain = self.summing_groups.get(group) or self.parameter_views[group]
                    alias = self._read_alias(arg.name)
                    piece = f", piece={self.split_pieces[arg.name][1]}" if arg.name in self.split_pieces else ""
                    w(f"{alias} = use({base}, {sink}, ({-self.position[line.name]}, {k}), {is_global}, {group!r}, "
                      f"through={self.view_function(group, chain)}{piece})")
                    sources.append(alias)
                elif arg.name in remade:
                    view = lines_by_name[arg.name]
                    base = self._base_of_grouped_view(view)
                    alias = self._read_alias(base)
                    w(f"{alias} = use(s.{base}, s.sink_{base}, ({-self.position[line.name]}, {k}), "
                      f"{base in self.input_names}, {view.name!r})")
                    copy = self._read_alias(view.name)
                    w(f"{copy} = {self.call(view, [alias])}")
                    sources.append(copy)
                elif line.name in grouped and arg.name in self.sink_names and arg.name in self.input_names:
                    alias = self._read_alias(arg.name)
                    w(f"{alias} = use(s.{arg.name}, s.sink_{arg.name}, ({-self.position[line.name]}, {k}), True, "
                      f"{_group_argument(line, node.lines)})")
                    sources.append(alias)
                elif line.name in grouped and self.graph.grouped_views.get(line.name) == arg.name \
                        and arg.name in self.sink_names:
                    alias = self._read_alias(arg.name)
                    w(f"{alias} = use(s.{arg.name}, s.sink_{arg.name}, ({-self.position[line.name]}, {k}), False, "
                      f"{_group_argument(line, node.lines)})")
                    sources.append(alias)
                elif arg.name in split:
                    alias = self._read_alias(arg.name)
                    is_global = ", True" if arg.name in self.input_names else ""
                    w(f"{alias} = use(s.{arg.name}, s.sink_{arg.name}, ({-self.position[line.name]}, {k}){is_global})")
                    sources.append(alias)
                else:  # a line of the island (not written yet) or a value from outside
                    sources.append(arg.name if arg.name in own else self.ref(arg.name))
            reads[line.name] = sources
        return reads

    def _read_alias(self, name: str) -> str:
        """A fresh local for one read of ``name`` in the island being written (deleted after it)."""
        alias = f"{name}_read{len(self.split_aliases)}"
        self.split_aliases.append(alias)
        return alias

    def _base_of_grouped_view(self, line: torch.fx.Node) -> str | None:
        """What grouped view ``line`` reads, with a gradient sink: a model input, or the node
        result of a view group of results (``SimplifiedGraph.grouped_views``: fuzz seed 193's
        ``v3 = v1.view(...)`` read twice by one ``cat``, whose two contributions the island's
        engine summed before the group's first, where eager adds each in turn), else None."""
        base = self._input_of_view(line)
        if base is not None:
            return base
        result, args = self.graph.grouped_views.get(line.name), tensor_args(line)
        return result if result in self.sink_names and [arg.name for arg in args] == [result] else None

    def _input_of_view(self, line: torch.fx.Node) -> str | None:
        """The model input (with a gradient sink) that ``line``, a view, reads as its one fx
        argument, else None."""
        args = line.all_input_nodes
        if len(args) == 1 and len(tensor_args(line)) == 1 and args[0].name in self.sink_names \
                and args[0].name in self.input_names:
            return args[0].name
        return None

    def _summing_groups(self) -> dict[str, list[torch.fx.Node]]:
        """The prelude view groups whose chain of views sums in its backward
        (:func:`rkgb.simplify.summing_view_chain`), where every reader makes the whole chain in
        its prelude and reads its last view alone (not a split's pieces), and those of model
        inputs of :func:`rkgb.simplify.summed_input_views` (a split's group is the split alone,
        its pieces read recorded in ``split_pieces``)."""
        inputs = {name for name in self.input_names if name in self.sink_names}
        groups: dict[str, list[torch.fx.Node]] = {}
        for view, (_, chain) in summed_input_views(self.graph, inputs).items():
            if chain[0].target in SPLIT_TARGETS:  # a piece of a split: the group is the split's
                self.split_pieces[view] = (chain[0].name, chain[-1].args[1])
                chain = chain[:1]
            groups[chain[0].name] = chain
        preludes = [(node, {line.name for line in node.prelude}) for node in self.graph.nodes]
        for view in self.graph.grouped_views:
            readers = [(node, names) for node, names in preludes if view in names]
            line = next(line for line in readers[0][0].prelude if line.name == view) if readers else None
            chain = summing_view_chain(line) if line is not None else None
            if chain is not None and isinstance(chain[-1].meta.get("val"), torch.Tensor) and all(
                    all(v.name in names for v in chain) and split_of_view(line, node.lines) is None
                    for node, names in readers):
                groups[view] = chain
        return groups

    def view_function(self, group: str, chain: list[torch.fx.Node]) -> str:
        """The global name of a function making ``chain``'s last view from its first one's
        input (the ``through`` of :meth:`rkgb.gradsink.GradientQueue.alias`)."""
        if group not in self.view_functions:
            self.view_functions[group] = self.bind(_ViewChain(chain), "views")
        return self.view_functions[group]

    def parameter_sink(self, parameter: str) -> str:
        """Where a parameter view group's sum goes: the parameter's gradient (its alias's sink
        where it has hooks)."""
        if parameter in self.aliased_parameters:
            return f"s.sink_param_{parameter}"
        return f"s.psink_{parameter}"

    # -- operations ------------------------------------------------------------------------
    def target(self, compute_name: str) -> str:
        for prefix in ("fwd_", "bwd_"):
            if compute_name.startswith(prefix):
                name = compute_name[len(prefix):]
                if name in self.infos:
                    return name
        raise ScheduleError(
            f"the schedule computes {compute_name!r}, which names no node of the graph; compute "
            "nodes are 'loss', 'fwd_<node>' and 'bwd_<node>' for the simplified graph's nodes"
        )

    def forward(self, w: _Writer, name: str, with_grad: bool) -> None:
        info = self.infos[name]
        node = info.node
        with_grad = with_grad and info.requires_grad
        first = name not in self.computed
        w.comment(f"fwd_{name}" + (" (with grad)" if with_grad else " (no grad)")
                  + ("" if first else ", recomputation"))
        replayed = node.is_random and name in self.recomputed
        if replayed:
            if first:
                w(f"s.rng_{name} = rng_get()  # to replay its random numbers when recomputed")
            else:
                w(f"rng_outer = rng_get(); rng_set(s.rng_{name})")
        w(f"with island({name!r}):" if with_grad else "with no_grad():")
        w.indent += 1
        self.local_values = {}
        local_names = []
        merged_in = with_grad and name in self.merged  # b reads our outputs, not leaves
        for producer in [p for p, pending in self.raw_pending.items() if name in pending] if with_grad else ():
            # the island of a node merged into this one's: read its outputs, not its leaves
            # (kept until its last reader has run: runs without grad may come in between)
            self.local_values.update(self.raw_outputs[producer])
            self.raw_pending[producer].discard(name)
            if not self.raw_pending[producer]:
                del self.raw_pending[producer]
                local_names += self.raw_outputs.pop(producer).values()
        self.split_aliases = []
        self.skipped_lines = set()
        reads = self.split_reads(w, node) if with_grad else {}
        outputs = {out.fx_name for out in node.outputs}
        at_once = self.graph.updates_written_at_once(node) if first else set()
        # batch norms run as eager runs them: the running statistics updated in place at the
        # first run, left alone at the others (rkgb.interpret.batch_norms_in_place)
        in_place = batch_norms_in_place(self.graph, node)
        written: list[tuple[str, str]] = []  # (buffer global, new value) written after the island
        for line in node.lines:
            if line.name in self.skipped_lines:
                continue  # a view of a group summed at its size: its reads alias it (split_reads)
            update = info.updates.get(line.name)  # the buffer this line's value is the new value of
            if line.name in in_place:
                function = "batch_norm_updating" if first else "batch_norm_not_updating"
                w(f"{line.name} = {self.call(line, reads.get(line.name), function)}")
                self.local_values[line.name] = line.name
                local_names.append(line.name)
                continue
            if update is not None and line.name not in outputs:
                if line.target is operator.getitem and line.args[0].name in in_place:
                    continue  # the buffer itself, written in place by the batch norm
                if first and line.name in at_once:  # written as soon as the island has run
                    variable = f"new_{self._buffer_global(update)}"
                    w(f"{variable} = {self.call(line, reads.get(line.name))}")
                    written.append((self._buffer_global(update), variable))
                elif first:  # once per step, never on recomputation
                    self._buffer_update(w, update, self.call(line, reads.get(line.name)))
                continue
            function = None
            if not with_grad and info.requires_grad and line.target in GRAD_MODE_NUMERICS:
                # eager runs it with grad: its kernel's values (rkgb.interpret.in_grad_mode)
                function = f"in_grad_mode({self.function(line)})"
            elif not with_grad and info.requires_grad and line.target in REQUIRES_GRAD_DISPATCH:
                # its kernel as eager picks it (rkgb.interpret.with_eager_requires_grad)
                requiring = self.requiring_grad_in_eager(node)
                flags = tuple(arg.name in requiring for arg in tensor_args(line))
                function = f"with_eager_requires_grad({self.function(line)}, {flags})"
            w(f"{line.name} = {self.call(line, reads.get(line.name), function)}")
            self.local_values[line.name] = line.name
            local_names.append(line.name)
            if update is not None and first:
                # a new value that the forward reads again: computed at every run, the buffer
                # written from the first run's value when the forward ends
                self._buffer_update(w, update, line.name)
        w.indent -= 1
        if written:
            w.comment("new values of the buffers, once per step, written in place as eager does")
            w("with no_grad():")
            for buffer, value in written:
                w(f"    {buffer}.copy_({value})")
            w(f"del {', '.join(value for _, value in written)}")
        if self.split_aliases:
            w("release_uses()")
            local_names += self.split_aliases
        if replayed and not first:
            w("rng_set(rng_outer); del rng_outer")
        exported = info.exported
        if with_grad:
            # keep only the gradient edges of the island's outputs: holding the outputs
            # themselves would keep their memory (and their bases') alive after a forget
            w(f"finish_island({name!r}, {self.tuple(exported)})")
            if merged_in:
                w.comment(f"{self.merged[name]} reads these outputs: one island with it")
            else:
                grad_outputs = [out for out in exported if info.exported_requires_grad[out]]
                if grad_outputs:  # the root of its backward (rkgb.gradsink.handoff)
                    w(f"s._handoff_{name} = handoff{self.tuple(grad_outputs)}")
            self.has_graph.add(name)
        for out in exported:
            if first:
                # detach even without grad: a view keeps its base (and its memory) alive
                if info.exported_requires_grad[out] and name not in self.merged:
                    w(f"s.{out} = {out}.detach().requires_grad_(); s.sink_{out} = grad_sink(s.{out}, s.queue)")
                else:
                    w(f"s.{out} = {out}.detach()")
            else:
                w(f"s.{out}.data = {out}")
        if exported:
            w(f"register_data({name!r}, {self.tuple(f's.{o}' for o in exported)})")
        if merged_in:
            self.raw_outputs[name] = {out: out for out in exported}
            self.raw_pending[name] = set(self.raw_readers[name])
            local_names = [n for n in local_names if n not in self.raw_outputs[name]]
        if local_names:
            w(f"del {', '.join(local_names)}")
        self.local_values = {}
        self.computed.add(name)

    @staticmethod
    def tuple(items) -> str:
        items = list(items)
        return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"

    def _buffer_global(self, path: str) -> str:
        for placeholder, buffer_path in self.graph.captured.buffers.items():
            if buffer_path == path:
                return placeholder
        raise ScheduleError(f"buffer {path!r} has no placeholder in the captured graph")

    def placeholder(self, name: str, out: str) -> str:
        global_name = f"placeholder_{out}"
        if global_name not in self.globals:
            shape, dtype = self.infos[name].metadata[out]
            self.globals[global_name] = torch.empty((), dtype=dtype, device=self.device).expand(shape)
        return global_name

    def backward(self, w: _Writer, name: str) -> None:
        info = self.infos[name]
        w.comment(f"bwd_{name}")
        if not info.requires_grad:
            w("pass  # its outputs do not require grad: nothing to do")
            return
        if name not in self.has_graph:
            raise ScheduleError(
                f"bwd_{name} runs while {name} has no autograd graph: the schedule must run "
                f"Compute('fwd_{name}', with_grad=True) after the previous bwd_{name}"
            )
        if name in self.merged:
            w(f"pass  # ran within bwd_{self.merged[name]}: one island")
            self.has_graph.discard(name)
            return
        outs = [o for o in info.exported if info.exported_requires_grad[o]]
        if outs:
            # the gradients go to the engine alone, which frees each once used, as eager's does
            w(f"handoff_backward(s._handoff_{name}, {self.tuple(f's.{o}' for o in outs)})")
            w(f"s._handoff_{name} = None")
        # its contributions join the next gradients when the next compute starts, after the
        # forgets that follow it (the incoming gradient, the saved tensors): as eager's engine
        self.contributions_waiting = True
        self.has_graph.discard(name)

    def forget(self, w: _Writer, data_node: str) -> None:
        name, _, kind = data_node.rpartition(".")
        if name not in self.infos or kind not in ("data", "grad", "phantoms"):
            raise ScheduleError(
                f"the schedule forgets {data_node!r}, which names no data node of the graph; data "
                "nodes are '<node>.data', '<node>.grad' and '<node>.phantoms'"
            )
        info = self.infos[name]
        w.comment(f"forget {data_node}")
        if kind == "data":
            w(f"unregister_data({name!r})")
            for out in info.exported:
                w(f"s.{out}.data = {self.placeholder(name, out)}")
        elif kind == "grad":
            if name in self.merged:
                w(f"pass  # never materialized: {name} shares the island of {self.merged[name]}")
                return
            for out in info.exported:
                if info.exported_requires_grad[out]:
                    w(f"s.{out}.grad = None")
        else:
            w(f"free_phantoms({name!r})")

    def shared_parameters(self) -> list[str]:
        """Parameters whose gradient has several sources: the nodes that read them (directly or
        through views) and have a backward, a view whose gradients are summed apart counting
        once (as ``rkgb.build.first_run_bytes`` counts their sums: a reader whose results get no
        gradient, a layer feeding an unused batch norm, contributes nothing)."""
        readers = self.graph.readers()
        viewed = {chain[0].all_input_nodes[0].name for chain in self.parameter_views.values()}
        shared = []
        for name in self.graph.captured.parameters:
            contributing = [reader for reader in readers.get(name, ()) if self.infos[reader].requires_grad]
            if name in self.aliased_parameters or len(contributing) < 2:
                continue
            if name in viewed:
                direct, views = parameter_gradient_sources(self.graph, name, self.parameter_views)
                if len([reader for reader in direct if self.infos[reader].requires_grad]) + views < 2:
                    continue
            shared.append(name)
        return shared

    def restore_points(self, shared: list[str]) -> dict[str | None, list[str]]:
        """Where the sum of each ``shared`` parameter's contributions joins its old ``.grad``
        (``exec.runtime._restore_grad``): before the backward of the node made last before the
        parameter's first reader (its backward, the last of the readers', brings the last
        contribution; eager's ``AccumulateGrad`` adds the sum then, and frees it), as
        ``rkgb.build.first_run_bytes`` counts the sum; at the backward's end (None) where no such
        node has a backward, or where a view group of the parameter joins it at the view's place.
        Node name (or None) -> the parameters restored there."""
        readers = self.graph.readers()
        viewed = {chain[0].all_input_nodes[0].name for chain in self.parameter_views.values()}
        points: dict[str | None, list[str]] = {}
        for name in shared:
            point = None
            if name not in viewed:
                contributing = [reader for reader in readers.get(name, ()) if self.infos[reader].requires_grad]
                first = min(contributing, key=lambda reader: self.position[self.infos[reader].node.main.name])
                node = self.graph.last_node_before(self.infos[first].node.main.name,
                                                   lambda node: self.infos[node].requires_grad)
                point = node.name if node is not None else None
            points.setdefault(point, []).append(name)
        return points

    # -- phases ----------------------------------------------------------------------------
    def header(self, w: _Writer) -> None:
        w("saved = s.saved")
        w("island, finish_island = saved.island, saved.finish_island")
        w("register_data, unregister_data = saved.register_data, saved.unregister_data")
        w("free_phantoms = saved.free_phantoms")
        w("use, release_uses, flush_gradients = s.queue.alias, s.queue.release, s.queue.flush")

    def generate(self) -> str:
        ops = self.schedule.ops
        loss = self.schedule.loss_index
        inputs = ", ".join(self.input_names)
        head = f"def forward_phase(s{', ' if inputs else ''}{inputs}):"
        w = _Writer()
        w('"""The forward phase of the schedule; returns the outputs (detached)."""')
        self.header(w)
        for name, requires_grad in zip(self.input_names, self.input_requires_grad):
            if requires_grad:
                w(f"s.{name} = {name}.detach().requires_grad_(); s.sink_{name} = grad_sink(s.{name}, s.queue)")
            else:
                w(f"s.{name} = {name}")
        for name in sorted(self.aliased_parameters):
            w(f"s.param_{name} = {name}.detach().requires_grad_(); s.sink_param_{name} = grad_sink(s.param_{name}, s.queue)")
        summed = sorted({chain[0].all_input_nodes[0].name for chain in self.parameter_views.values()}
                        - self.aliased_parameters)
        if summed:
            w.comment("parameters whose views several nodes read: the views' gradients summed first, as eager")
            for name in summed:
                w(f"s.psink_{name} = parameter_sink({name})")
        if self.graph.updated_first:
            w.comment("buffer updates that nothing else reads: made first, in place, as eager makes them")
            w("with no_grad():")
            local_names = []
            for line in self.graph.buffer_updates_first:
                local = f"first_{line.name}"
                w(f"    {local} = {self.call(line)}")
                self.local_values[line.name] = local
                local_names.append(local)
            for name, buffer in self.graph.updated_first.items():
                w(f"    {buffer}.copy_({self.local_values[name]})")
            w(f"del {', '.join(local_names)}")
            self.local_values = {}
        if self.graph.global_views:
            w.comment("views of parameters, buffers and inputs")
            outputs = set(self.graph.outputs)
            for line in self.graph.global_views:
                base = self._input_of_view(line)
                if line.name in self.view_groups and line.name in outputs and base is not None:
                    # a grouped view that the user gets: the loss's contribution opens its group
                    w(f"s.{line.name} = {self.call(line, [f'use(s.{base}, s.sink_{base}, (1, 0), True, {line.name!r})'])}")
                else:
                    w(f"s.{line.name} = {self.call(line)}")
        for index, op in enumerate(ops[:loss]):
            self.operation(w, op, index, forward_phase=True)
        buffers = {name for name in self.snapshots if name in self.graph.captured.buffers}
        if buffers:
            w.comment("buffers the step updates, as they are before it (recomputations read these)")
            for name in sorted(buffers):
                w(f"{self.snapshots[name]} = {name}.clone()")
            self.local_values = {name: self.snapshots[name] for name in buffers}
            for view in self.graph.global_views:
                if view.name in self.snapshots:
                    w(f"{self.snapshots[view.name]} = {self.call(view)}")
            self.local_values = {}
        if self.graph.buffer_updates_prologue:
            w.comment("buffer updates computed from buffers alone (once per step)")
            for line in self.graph.buffer_updates_prologue:
                # a name of its own: nodes' preludes may recompute the same static line
                local = f"prologue_{line.name}"
                w(f"{local} = {self.call(line)}")
                self.local_values[line.name] = local
            for name, path in self.graph.captured.buffer_mutations.items():
                if name in self.local_values:
                    self.buffer_updates.append((self._buffer_global(path), self.local_values[name]))
            self.local_values = {}
        if self.buffer_updates:
            w.comment("new values of the buffers, once per step (never on recomputation)")
            w("with no_grad():")
            for buffer, value in self.buffer_updates:
                w(f"    {buffer}.copy_({value})")
            w(f"del {', '.join(value for _, value in self.buffer_updates)}")
        outputs = [self.ref(name) for name in self.graph.outputs]
        for name in self.graph.outputs:
            if self.graph.owner.get(name) in self.infos and self.graph.owner[name] not in self.computed:
                raise ScheduleError(f"output {name!r} is not computed before the loss")
        w(f"s.outputs = ({''.join(o + ', ' for o in outputs)})")
        if self.released_outputs:
            w("returned = tuple(output.detach() for output in s.outputs)")
            w.comment("outputs whose values no backward reads: from here the user's tensors alone hold them, as in")
            w.comment("eager, where an output the user drops before the backward is freed")
            for name in sorted(self.released_outputs):
                w(f"unregister_data({name!r})")
                for out in self.infos[name].exported:
                    w(f"s.{out}.data = {self.placeholder(name, out)}")
            w("return returned")
        else:
            w("return tuple(output.detach() for output in s.outputs)")
        forward_source = [head] + w.lines

        self.phase = "backward"
        w = _Writer()
        w('"""The backward phase of the schedule, from the gradients of the outputs (s.grad_outputs)."""')
        self.header(w)
        shared = self.shared_parameters()
        self.restores = self.restore_points(shared)
        if shared:
            w.comment("parameters read by several nodes: eager adds the sum of their contributions")
            w.comment("to a .grad that holds values once; islands add them one by one (same order)")
            for name in shared:
                w(f"s.stash_{name} = stash_grad({name}, {self.graph.captured.parameters[name]!r})")
        w.comment("loss: the gradients of the outputs")
        if self.markers:
            w(f"with mark('{MARKER_PREFIX}{loss}'):")
            w("    backward_outputs(s.outputs, s.grad_outputs)")
            w("    s.outputs = s.grad_outputs = None")
        else:
            w("backward_outputs(s.outputs, s.grad_outputs)")
            w("s.outputs = s.grad_outputs = None")
        self.contributions_waiting = True
        for index, op in enumerate(ops[loss + 1:], start=loss + 1):
            self.operation(w, op, index, forward_phase=False)
        if self.contributions_waiting:
            w("flush_gradients()")
        if self.view_groups:
            self._deliver_view_groups(w, -1)
            w("s.queue.close_groups()")
        for name in [name for names in self.restores.values() for name in names]:
            w(f"restore_grad({name}, s.stash_{name})")
        backward_source = ["def backward_phase(s):"] + w.lines
        return "\n".join(forward_source) + "\n\n\n" + "\n".join(backward_source) + "\n"

    def operation(self, w: _Writer, op, index: int, forward_phase: bool) -> None:
        if self.markers:
            w(f"with mark('{MARKER_PREFIX}{index}'):")
            w.indent += 1
            self._operation(w, op, forward_phase)
            w.indent -= 1
        else:
            self._operation(w, op, forward_phase)

    def _operation(self, w: _Writer, op, forward_phase: bool) -> None:
        if isinstance(op, Forget):
            self.forget(w, op.node)
        elif isinstance(op, Compute):
            absorbed = op.node.startswith("bwd_") and self.target(op.node) in self.merged
            # an absorbed backward runs no code (it ran in its reader's call): the contributions
            # join at the next operation that runs, after the forgets between (the simulator's
            # executed order, exec.merge.executed_order)
            if self.contributions_waiting and not absorbed:
                w("flush_gradients()  # the contributions of the last backward join their gradients")
                self.contributions_waiting = False
            if op.node == "loss":
                raise ScheduleError("the schedule has two loss operations; it must have exactly one")
            name = self.target(op.node)
            if op.node.startswith("bwd_") and not forward_phase:
                self._deliver_view_groups(w, self.position[self.infos[name].node.main.name])
                for parameter in self.restores.pop(name, ()):
                    w(f"restore_grad({parameter}, s.stash_{parameter})  # every contribution is in")
            if op.node.startswith("fwd_"):
                if not forward_phase and name not in self.computed:
                    raise ScheduleError(f"{op.node} is first computed after the loss; compute every node before")
                self.forward(w, name, op.with_grad)
            else:
                if forward_phase:
                    raise ScheduleError(f"{op.node} comes before the loss; backwards come after it")
                self.backward(w, name)
        else:
            raise ScheduleError(f"unknown schedule operation {op!r}: expected Compute or Forget")


# views whose backward only re-views the gradient (no allocation, no arithmetic)
_REVIEWING_VIEWS = {"view", "reshape", "_unsafe_view", "transpose", "permute", "t", "unsqueeze", "squeeze",
                    "alias", "view_as", "_reshape_alias", "swapaxes", "movedim"}


def _result_views_made_late(graph: SimplifiedGraph, infos: dict[str, "NodeInfo"],
                            merged: dict[str, str]) -> dict[str, str]:
    """Views of a node's result (or of an exported view of it) kept in its body and exported
    (the user gets them), made in eager after another node that reads what they view: view ->
    the fx name of what it views.

    Eager sums a view's contributions in the view's buffer and adds the sum into the result's
    gradient when the view's backward runs: before the backward of every node made before the
    view (the engine runs the latest made first). The node's island would run the view's backward
    with the node's own, after every reader of the result: ``h = lin(x); return h * h,
    h.view(...)`` sums ``(g_mul0 + g_mul1) + g_view`` where eager sums ``(g_view + g_mul0) +
    g_mul1``. The executor passes such a view's gradient through the view's backward alone
    (``exec.runtime._late_views_gradient``) at the view's place in the backward. Only views whose
    backward allocates nothing (a reshape, a transpose): the plan counts the view's gradient until
    the node's backward, and it becomes the result's gradient's storage sooner."""
    position = {n.name: i for i, n in enumerate(graph.captured.graph.nodes)}
    holder = {line.name: node for node in graph.nodes for line in node.lines}
    late: dict[str, str] = {}
    for node in graph.nodes:
        info = infos[node.name]
        if node.name in merged:
            continue
        body = {line.name: line for line in node.body}
        for out in info.exported:
            line = body.get(out)
            if line is None or not info.exported_requires_grad.get(out) or not line.args \
                    or getattr(line.target, "__name__", "").split(".")[0] not in _REVIEWING_VIEWS:
                continue
            # the result, or an exported view of it that requires grad (a view of a view)
            base = line.args[0]
            if base is node.main:
                if not info.exported_requires_grad.get(node.main.name):
                    continue
            elif not (isinstance(base, torch.fx.Node) and base.name in info.exported
                      and info.exported_requires_grad.get(base.name)):
                continue
            early = any(holder.get(user.name) not in (None, node) and position[holder[user.name].main.name] < position[out]
                        for user in base.users)
            if early:
                late[out] = base.name
    return late


def _views_of_late_views(graph: SimplifiedGraph, infos: dict[str, "NodeInfo"],
                         late: dict[str, str]) -> dict[str, list[str]]:
    """For each late view (:func:`_result_views_made_late`), the views of it (or of those, in
    body order) that its node also exports, requiring grad and not late themselves (Mamba's
    ``u = x.transpose(1, 2)`` read late, and ``u[..., None]``), and the pieces of a split of them
    (``h.view(h.shape).chunk(2, -1)`` read by other nodes, fuzz seed 193): eager adds their
    gradients into the late view's buffer (their backwards run before the view's; a split's sums
    its pieces' first) and passes the sum on at the view's place; passing the view's gradient
    alone there left theirs for the node's backward, summed in another order (a first layer's
    gradient 1 ulp off)."""
    holder = {line.name: node for node in graph.nodes for line in node.lines}
    found: dict[str, list[str]] = {}
    for view in late:
        node = holder[view]
        info = infos[node.name]
        family = {view}
        for line in node.body:
            if line.name not in info.exported or line.name in late or not info.exported_requires_grad.get(line.name):
                continue
            source = line.args[0] if line.args and isinstance(line.args[0], torch.fx.Node) else None
            if line.target is operator.getitem and source is not None and source.target in SPLIT_TARGETS:
                source = source.args[0]  # a piece of a split of the view: its backward sums the pieces
            elif getattr(line.target, "__name__", "").split(".")[0] not in _REVIEWING_VIEWS:
                continue
            if source is not None and source.name in family:
                family.add(line.name)
                found.setdefault(view, []).append(line.name)
    return found


def _group_argument(view: torch.fx.Node, lines) -> str:
    """The group (and pieces) argument of ``use(...)`` for a read of grouped view ``view`` in the
    island of ``lines``: the view's name, with the pieces it reads where it is a split. Where the
    island only splits the view (of the same shape as its input: ``x.view(x.shape).chunk(2)``),
    its reads form the group ``"<view>.pieces"``, summed piece by piece as eager's split node
    sums them, which joins the view's own group (the user's gradient of a returned view) when it
    is delivered (:meth:`rkgb.gradsink.GradientQueue.deliver`): eager adds the split's sum into
    the view's buffer as one contribution."""
    split = split_of_view(view, lines)
    if split is not None:
        pieces = _pieces_argument(split, lines)
        if pieces:
            return f"{view.name + '.pieces'!r}{pieces}"
    return f"{view.name!r}{_pieces_argument(view, lines)}"


def _pieces_argument(view: torch.fx.Node, lines) -> str:
    """``, pieces=(dim, ((index, start, length), ...))`` for a grouped view that is a split
    (``aten.split.Tensor``, ``aten.split_with_sizes``) of which ``lines`` read these pieces
    (:meth:`rkgb.gradsink.GradientQueue.alias`); empty for any other view."""
    if view.target not in SPLIT_TARGETS:
        return ""
    base, pieces = view.args[0].meta.get("val"), view.meta.get("val")
    if not isinstance(base, torch.Tensor) or not isinstance(pieces, (list, tuple)):
        return ""
    dim = (view.args[2] if len(view.args) > 2 else view.kwargs.get("dim", 0)) % base.dim()
    sizes = [int(piece.shape[dim]) for piece in pieces]  # the traced pieces' own sizes
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    read = sorted({line.args[1] for line in lines if line.target is operator.getitem and line.args[0] is view})
    if not read:
        return ""
    return f", pieces=({dim}, {tuple((i, starts[i], sizes[i]) for i in read)!r})"


def generate(
    graph: SimplifiedGraph,
    schedule: Schedule,
    infos: dict[str, NodeInfo],
    input_requires_grad: list[bool],
    runtime_globals: dict[str, Any],
    device: torch.device | str = "cpu",
    merged: dict[str, str] | None = None,
    markers: bool = False,
    aliased_parameters: set[str] | frozenset[str] = frozenset(),
    trained_parameters: set[str] | frozenset[str] = frozenset(),
    released_outputs: set[str] | frozenset[str] = frozenset(),
) -> GeneratedCode:
    """Generate, compile and register (in ``linecache``) the code of ``schedule``.

    ``runtime_globals`` are the helpers the code calls (``rng_get``, ``run_backward``, ...;
    see :mod:`exec.runtime`). Parameters, buffers and constants are globals named after their
    placeholders; the caller binds their tensors (:func:`bind_globals`). ``merged`` (``a ->
    b``, from :func:`exec.merge.plan_merges`): nodes whose island ``b``'s includes.
    ``markers``: run each schedule operation ``i`` inside ``mark("rockmate:op:<i>")`` (a
    ``torch.profiler.record_function``), for :mod:`exec.timeline`. ``aliased_parameters``: those
    read through an alias of their own (hooks); ``trained_parameters``: those that require grad.
    ``released_outputs``: nodes whose data the model returns and the backward phase never reads;
    the forward lets go of them as it returns (the user's tensors hold them from there).

    Raises:
        ScheduleError: the schedule names an unknown node, or runs a backward without an
            autograd graph.
    """
    generator = _Generator(graph, schedule, infos, input_requires_grad, torch.device(device), merged, markers,
                           aliased_parameters, trained_parameters, released_outputs)
    source = generator.generate()
    code, filename = compiled_source(source)  # (read back where the same source was compiled before)
    namespace = dict(generator.globals)
    namespace.update(runtime_globals)
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    exec(code, namespace)  # noqa: S102 - the namespace is private to this generated module
    return GeneratedCode(
        source=source,
        filename=filename,
        forward_phase=namespace["forward_phase"],
        backward_phase=namespace["backward_phase"],
        globals=namespace,
        global_names={name: name for name in generator.global_placeholders},
    )


class _ViewsOfBase:
    """Views made from one base, each of it or of one made before it (a late view and the
    views of it its node exports: :func:`_views_of_late_views`), as a function of the base:
    the values of ``outputs`` (default: every line's; a split is made for its pieces)."""

    def __init__(self, base: str, lines: list[torch.fx.Node], outputs: list[str] | None = None) -> None:
        self.base = base
        self.lines = [(line.name, line.target, line.args, line.kwargs) for line in lines]
        self.outputs = [line.name for line in lines] if outputs is None else list(outputs)

    def __call__(self, base: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values = {self.base: base}
        for name, target, args, kwargs in self.lines:
            args, kwargs = torch.fx.node.map_arg((args, kwargs), lambda node: values[node.name])
            values[name] = target(*args, **kwargs)
        return tuple(values[name] for name in self.outputs)

    def __repr__(self) -> str:
        return f"<views of {self.base}: {', '.join(name for name, *_ in self.lines)}>"


class _ViewChain(_ViewsOfBase):
    """A chain of view lines (:func:`rkgb.simplify.summing_view_chain`) as a function of the
    first one's input: what a view group summed at the view's size runs its backward through."""

    def __init__(self, chain: list[torch.fx.Node]) -> None:
        super().__init__(chain[0].args[0].name, chain)

    def __call__(self, base: torch.Tensor) -> torch.Tensor:
        return super().__call__(base)[-1]

    def __repr__(self) -> str:
        return f"<views {' -> '.join(name for name, *_ in self.lines)}>"
