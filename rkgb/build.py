"""From nn.Module + sample to the chain of blocks with one measured CD-graph per class."""

from __future__ import annotations

import hashlib
import operator
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .blocks import INPUT_NAME, SIDE_PREFIX, Block, BlockClass, Chain, cut_chain
from .capture import CapturedGraph, as_input_tuple, capture, device_of
from .cdgraph import BlockInstance, CDGraph, ComputeKind, ComputeNode, DataKind, DataNode, FirstRun, ModelChain
from .cdgraph import input_grad_key, input_views_key, parameter_sum_key, views_key_input
from .cdgraph import compute_name as cname
from .cdgraph import data_name as dname
from .disk_cache import source_digest
from .functions import function_identity
from .inspect import BlockMeasure, gradient_layouts, inspect_chain
from .interpret import global_requires_grad, tensor_args
from .memory import storage_bytes, tensor_bytes
from .simplify import (SimplifiedGraph, gradient_needs, parameter_gradient_sources, simplify, split_of_view,
                       summed_input_views, summed_parameter_views, summing_view_chain)

__all__ = ["ModelGraphs", "build", "cdgraph_of_class"]


@dataclass
class ModelGraphs:
    """Everything the graph builder knows about a model, phase by phase."""

    captured: CapturedGraph
    simplified: SimplifiedGraph
    chain: Chain
    measures: list[BlockMeasure]
    model_chain: ModelChain
    phase_seconds: dict[str, float] = field(default_factory=dict)
    measures_from_cache: bool = False  # the measures were read from a MeasureCache
    # the data nodes that a step keeping the model's loss alone drops: the last block's outputs
    # but the loss (``ModelChain.dropped_outputs`` with held_outputs="loss")
    droppable_outputs: list[str] = field(default_factory=list)


def cdgraph_of_class(measure: BlockMeasure) -> CDGraph:
    """The CD-graph of a class from its measures (anonymized names, ``in`` for the input)."""
    D, G, P = DataKind.DATA, DataKind.GRAD, DataKind.PHANTOMS
    data: list[DataNode] = []
    forwards: list[ComputeNode] = []
    backwards: list[ComputeNode] = []
    input_data, input_grads = [], []
    if measure.has_input:
        data.append(DataNode(dname(INPUT_NAME, D), D, INPUT_NAME, measure.input_bytes))
        input_data.append(dname(INPUT_NAME, D))
        if measure.input_requires_grad:
            data.append(_grad_node(INPUT_NAME, measure.input_grad_parts))
    # side inputs (rkgb.blocks): inputs of the block besides its chain input, never freed here
    for side in measure.side_inputs:
        data.append(DataNode(dname(side.name, D), D, side.name, side.data_bytes))
        input_data.append(dname(side.name, D))
        if side.requires_grad:
            data.append(_grad_node(side.name, side.grad_parts))
    grad_exists = {n.name for n in measure.nodes if n.requires_grad}
    grad_exists.update(side.name for side in measure.side_inputs if side.requires_grad)
    if measure.input_requires_grad:
        grad_exists.add(INPUT_NAME)
    for node in measure.nodes:
        x = node.name
        data.append(DataNode(dname(x, D), D, x, node.data_bytes))
        produces = [dname(x, D)]
        if node.requires_grad:
            data.append(_grad_node(x, node.grad_parts))
            data.append(DataNode(dname(x, P), P, x, node.phantom_bytes))
            produces.append(dname(x, P))
        forwards.append(
            ComputeNode(
                name=cname(x, ComputeKind.FORWARD),
                kind=ComputeKind.FORWARD,
                target=x,
                time_s=node.forward_time_s,
                overhead_bytes=node.forward_overhead_bytes,
                needs=[dname(d, D) for d in node.data_deps],
                produces=produces,
                is_random=node.is_random,
                no_grad_overhead_bytes=node.no_grad_overhead_bytes,
            )
        )
        if node.requires_grad:
            needs = [dname(x, G)] + [dname(r, D) for r in node.backward_reads]
            if node.phantom_bytes:
                needs.append(dname(x, P))
            backwards.insert(
                0,
                ComputeNode(
                    name=cname(x, ComputeKind.BACKWARD),
                    kind=ComputeKind.BACKWARD,
                    target=x,
                    time_s=node.backward_time_s,
                    overhead_bytes=node.backward_overhead_bytes,
                    handoff_overhead_bytes=node.handoff_overhead_bytes,
                    needs=needs,
                    needs_shape=[dname(d, D) for d in node.backward_shapes],
                    produces=[dname(d, G) for d in node.grads_to if d in grad_exists],
                    contributes={
                        dname(d, G): tuple(parts) for d, parts in node.grad_contributions.items() if d in grad_exists
                    },
                    aliases={
                        dname(d, G): tuple(parts) for d, parts in node.grad_aliases.items() if d in grad_exists
                    },
                    contribution_aliases={
                        dname(d, G): tuple(sources) for d, sources in node.grad_contribution_aliases.items()
                        if d in grad_exists
                    },
                    shared={
                        dname(d, G): tuple(parts) for d, parts in node.grad_shared.items() if d in grad_exists
                    },
                    owned={
                        dname(d, G): tuple(parts) for d, parts in node.grad_owned.items() if d in grad_exists
                    },
                    together={
                        dname(d, G): tuple(groups) for d, groups in node.grad_together.items() if d in grad_exists
                    },
                    together_storages=tuple(node.together_storages),
                    optional=node.optional_backward,
                ),
            )
    boundary = ([INPUT_NAME] if measure.input_requires_grad else []) + \
        [side.name for side in measure.side_inputs if side.requires_grad]
    for name in boundary:
        _drop_lasting_aliases(backwards, dname(name, G))
    output_data = [dname(o, D) for o in measure.outputs]
    # (an output whose gradient comes from no part outside the block: a model output that the
    # user's loss gives none, read by no later block, rkgb.inspect)
    output_grads = [dname(o, G) for o in measure.outputs if o in grad_exists and measure.output_parts.get(o) != []]
    for name in boundary:
        if any(dname(name, G) in b.produces for b in backwards):
            input_grads.append(dname(name, G))
    loss = ComputeNode(
        name=cname("loss", ComputeKind.LOSS),
        kind=ComputeKind.LOSS,
        target="loss",
        time_s=0.0,
        overhead_bytes=0,
        needs=list(output_data),
        produces=list(output_grads),
        # the parts that come from after the block (a view that only the block's own nodes read
        # gets its gradient from them)
        contributes={dname(o, G): tuple(parts) for o, parts in measure.output_parts.items() if o in grad_exists and parts},
        # the user's loss makes the outputs' gradients: a view of its own result (a reshape's
        # backward) is not added into in place, so none is taken to be
        shared={g.name: tuple(range(len(g.part_sizes))) for g in data if g.name in output_grads},
        # ... each in a storage of its own all the same (exec.runtime checks it)
        owned={g.name: tuple(range(len(g.part_sizes))) for g in data if g.name in output_grads},
    )
    graph = CDGraph(
        name=f"class{measure.class_index}",
        compute_nodes=forwards + [loss] + backwards,
        data_nodes=data,
        input_data=input_data,
        input_grads=input_grads,
        side_data=[dname(side.name, D) for side in measure.side_inputs],
        output_data=output_data,
        output_grads=output_grads,
    )
    graph.validate()
    return graph


def _grad_node(target: str, parts: list[int]) -> DataNode:
    """The gradient of ``target``: one tensor per tensor of it that other nodes read."""
    return DataNode(dname(target, DataKind.GRAD), DataKind.GRAD, target, sum(parts),
                    tuple(parts) if len(parts) > 1 else ())


def _drop_lasting_aliases(backwards: list[ComputeNode], input_grad: str) -> None:
    """Count a part of the block's input gradient as its own tensor when its only contribution
    is an alias (the block's backward passes its output gradient through unchanged).

    Chain figures add blocks up: block ``i``'s input gradient is block ``i-1``'s output
    gradient, freed by block ``i-1``'s backward. An alias that lasted to the end of the block
    would tie it to gradients of later blocks (the model's output gradients, which autograd
    holds until the backward ends). Counting it apart over-estimates, only while both are
    alive, and only in such pass-through blocks. The whole model's graph, whose figures are
    the plan's prediction, keeps them (``ComputeNode.boundary_aliases``).
    """
    producers = [c for c in backwards if input_grad in c.produces]
    for c in producers:
        # (contributions of both kinds to the input gradient: counted as new tensors, as before)
        c.contribution_aliases.pop(input_grad, None)
        sources = c.aliases.get(input_grad)
        if sources is None:
            continue
        kept, dropped = list(sources), [-1] * len(sources)
        for i, j in enumerate(sources):
            contributors = [p for p in producers if i in p.contributes.get(input_grad, (i,))]
            if j >= 0 and len(contributors) == 1:
                kept[i], dropped[i] = -1, j
        if any(j >= 0 for j in dropped):  # the whole model's graph keeps them
            c.boundary_aliases[input_grad] = tuple(dropped)
        if any(j >= 0 for j in kept):
            c.aliases[input_grad] = tuple(kept)
        else:
            del c.aliases[input_grad]


def held_bytes(graph: SimplifiedGraph, model: nn.Module) -> int:
    """The memory the executor holds through a step besides the nodes' data (see
    :class:`rkgb.cdgraph.ModelChain`): none so far, all of it is first-run memory."""
    return 0


def first_run_bytes(graph: SimplifiedGraph, model: nn.Module, sample, grad_accumulation: bool = True,
                    needs: dict | None = None) -> dict[str, tuple[FirstRun, ...]]:
    """What compute nodes allocate at their first run and the executor keeps to the end of the
    step (:class:`rkgb.cdgraph.ModelChain`): the generator state of a random node (on CPU; on
    CUDA the states are host memory), the gradient of a model input that requires grad, made
    by the first backward (in the backward's order) of a node reading it, and with
    ``grad_accumulation`` the sum of a shared parameter's contributions
    (:func:`rkgb.cdgraph.parameter_sum_key`). ``needs``: :func:`rkgb.simplify.gradient_needs`
    (found here when not given)."""
    args = as_input_tuple(sample)
    result: dict[str, list[FirstRun]] = {}
    if device_of(model, args).type == "cpu":
        state = torch.get_rng_state().nbytes
        for node in graph.nodes:
            if node.is_random:
                result.setdefault(cname(node.name, ComputeKind.FORWARD), []).append(
                    FirstRun(f"{node.name}.rng", state, only_if_rerun=True))
    snapshot = set(graph.snapshot_buffers())
    for node in graph.nodes:
        for name in graph.reads(node) & snapshot:  # copied for recomputations (exec.codegen)
            size = storage_bytes(model.get_buffer(graph.captured.buffers[name]))
            result.setdefault(cname(node.name, ComputeKind.FORWARD), []).append(
                FirstRun(f"{name}.snapshot", size, only_if_rerun=True))
    for node in graph.nodes:
        # the buffers' new values, written when the forward ends (those written at once are
        # temporaries of the node's first run: its measured overhead)
        late = [name for name in node.buffer_updates if name not in graph.updates_written_at_once(node)]
        if late:
            lines = {line.name: line for line in node.lines}
            size = sum(tensor_bytes(lines[name].meta["val"]) for name in late)
            result.setdefault(cname(node.name, ComputeKind.FORWARD), []).append(
                FirstRun(f"{node.name}.buffer_update", size, until_loss=True, in_overhead=True))
    # a view of a node's result made in each of its readers (rkgb.simplify, view groups): the
    # executor sums the view's gradient apart until the view's place in the backward. The
    # CD-graph counts that sum as the base's gradient, made by the first reader's backward;
    # where the base's gradient is already there (from the loss, or from nodes made after the
    # view), the sum is a second tensor until it joins (by the base node's backward at the latest)
    captured_lines = {line.name: line for line in graph.captured.graph.nodes}
    position = {name: i for i, name in enumerate(captured_lines)}
    holder = {line.name: node for node in graph.nodes for line in node.lines}
    for view, base in graph.grouped_views.items():
        view_readers = [node for node in graph.nodes if any(line.name == view for line in node.prelude)]
        base_node = graph.node(graph.owner.get(base, base))
        chain = summing_view_chain(captured_lines[view])
        if chain is not None:
            # a group summed at the size of its views (an expand's, exec.codegen), from the
            # first reader's backward to the view's place (by the base's backward at the latest),
            # beside the base's gradient that the CD-graph counts from then on
            group = FirstRun(f"{base}.grad.views.{view}", tensor_bytes(chain[-1].meta["val"]),
                             until=cname(base_node.name, ComputeKind.BACKWARD))
            for reader in view_readers:
                result.setdefault(cname(reader.name, ComputeKind.BACKWARD), []).append(group)
            continue
        late = base in graph.outputs or any(
            user.name in holder and holder[user.name] is not base_node and holder[user.name] not in view_readers
            and position[holder[user.name].main.name] > position[view]
            for user in captured_lines[base].users)
        if not late:
            continue
        group = FirstRun(f"{base}.grad.views.{view}", tensor_bytes(captured_lines[base].meta["val"]),
                         until=cname(base_node.name, ComputeKind.BACKWARD))
        for reader in view_readers:
            result.setdefault(cname(reader.name, ComputeKind.BACKWARD), []).append(group)
    # a view of a trained parameter made once, whose backward sums (an expand), that several
    # nodes read: the executor sums its gradients at the view's size from the first reader's
    # backward on, and runs the view's backward on the sum at the view's place (exec.codegen)
    if needs is None:
        needs = gradient_needs(graph, global_requires_grad(graph, model, sample))
    trained = {name for name, path in graph.captured.parameters.items() if model.get_parameter(path).requires_grad}

    def delivery(view: str) -> str | None:
        """Where the executor passes a view group's sum on (exec.codegen._deliver_view_groups):
        before the first backward of a node made before the view, at the latest that of the
        last such node; None: at the backward's end."""
        node = graph.last_node_before(view, lambda name: needs[name].requires_grad)
        return cname(node.name, ComputeKind.BACKWARD) if node is not None else None

    for view, chain in summed_parameter_views(graph, trained).items():
        total = FirstRun(input_grad_key(view), tensor_bytes(chain[-1].meta["val"]), accumulates=True,
                         until=delivery(view))
        for node in graph.nodes:
            if needs[node.name].requires_grad:
                for _ in range(_contributions(node, view, graph)):
                    result.setdefault(cname(node.name, ComputeKind.BACKWARD), []).append(total)
    readers = graph.readers()
    # a parameter read by several nodes (tied weights, an unrolled RNN's weights): where its
    # .grad holds values when the step starts (gradient accumulation), the executor builds the
    # sum of the step's contributions apart and adds it to the old .grad at the end of the
    # backward, as eager's engine sums them before accumulating (exec.runtime._stash_grad): one
    # parameter-sized buffer from the first contribution on. Counted whether or not .grad will
    # hold values (the plan cannot know): where it does not, the plan over-estimates by it.
    # Without grad_accumulation, a step that finds values there is refused (exec.runtime).
    # Only the readers whose backward runs contribute (one whose results get no gradient, a
    # layer feeding an unused batch norm, adds nothing: no sum where one reader is left)
    # (a view of it whose gradients are summed apart, exec.codegen, contributes once)
    summed_views = summed_parameter_views(graph, trained)
    for name, path in graph.captured.parameters.items() if grad_accumulation else ():
        parameter = model.get_parameter(path)
        contributing = [reader for reader in readers.get(name, ()) if needs[reader].requires_grad]
        if not parameter.requires_grad or len(contributing) < 2:
            continue
        if any(chain[0].all_input_nodes[0].name == name for chain in summed_views.values()):
            direct, views = parameter_gradient_sources(graph, name, summed_views)
            if len([reader for reader in direct if needs[reader].requires_grad]) + views < 2:
                continue
        # (added into the old .grad once the last contribution is in, as eager's AccumulateGrad
        # does: before the backward of the node made last before the first reader, exec.codegen;
        # at the backward's end where a view group of it joins later, at the view's place)
        first = min(contributing, key=lambda reader: position[graph.node(reader).main.name])
        viewed = any(chain[0].all_input_nodes[0].name == name for chain in summed_views.values())
        total = FirstRun(parameter_sum_key(name), storage_bytes(parameter), in_overhead=True,
                         until=None if viewed else delivery(graph.node(first).main.name))
        for reader in contributing:
            result.setdefault(cname(reader, ComputeKind.BACKWARD), []).append(total)
    # the outputs that the user's loss gives a gradient (not those that the model's own loss
    # reaches, output_gradients="auto": a returned input among them gets none from the loss;
    # fuzz seed 277, a returned input read by the model's loss, whose gradient the plan took to
    # come first from the loss, a dense sum that a later contribution was added into in place)
    graded = set(graph.gradient_outputs)
    for name, value in zip(graph.captured.inputs, args):
        if name is None or not (isinstance(value, torch.Tensor) and value.requires_grad):
            continue
        size = tensor_bytes(value)
        grad = FirstRun(input_grad_key(name), size, accumulates=True)
        # views of the input made in nodes' preludes: the executor sums each one's gradient
        # apart (exec.codegen, view groups), as eager's view buffer does, until the view's place
        # in the backward (after other contributions to the input's gradient, maybe), where it
        # joins the input's
        grouped: dict[str, list[str]] = {}
        returned: dict[str, int] = {}
        # views whose backward sums (an expand's) or that are smaller than the input (a slice, a
        # split's pieces: rkgb.simplify.summed_input_views): the executor sums their gradients at
        # the view's size, as a model input's gradient of their own (the inspection reads them as leaves),
        # and runs the views' backward on the sum, which joins the input's gradient at the
        # view's place, after every reader's backward: counted from the backward of the first
        # reader made (the last to run where nothing is recomputed)
        summed = summed_input_views(graph, {name})
        roots: dict[str, list] = {}  # the summed groups (their first views) -> their readers
        summed_lines = {line.name for _, chain in summed.values() for line in chain}
        for view, (_, chain) in summed.items():
            view_grad = FirstRun(input_grad_key(view), tensor_bytes(chain[-1].meta["val"]), accumulates=True,
                                 until=delivery(chain[0].name))  # (the group is named by its first view)
            view_readers = [node for node in graph.nodes if any(line.name == view for line in node.prelude)]
            for node in view_readers:
                result.setdefault(cname(node.name, ComputeKind.BACKWARD), []).extend(
                    [view_grad] * _contributions(node, view, graph))
            # (once per group, a split's pieces one: the groups join one after the other, each
            # view's backward making an input-sized tensor, added and freed before the next one)
            roots.setdefault(chain[0].name, []).extend(view_readers)
        for root, group_readers in roots.items():
            # (made where the group is delivered, its readers' contributions there: the view's
            # backward makes a dense tensor of its own, a later contribution added into it)
            joined = FirstRun(input_grad_key(name), size, accumulates=True, owned=True, after_flush=True,
                              delivery=delivery(root), releases=tuple(
                                  input_grad_key(view) for view, (_, chain) in summed.items() if chain[0].name == root))
            first = min(group_readers, key=lambda node: position[node.main.name])
            result.setdefault(cname(first.name, ComputeKind.BACKWARD), []).append(joined)
        for view, view_readers in graph.input_view_readers(name).items():
            if view in summed_lines:
                continue
            # (a view of the input alone that the user gets: the loss's contribution opens its
            # group, as exec.codegen makes it from the group's alias)
            returned[view] = int(view in graded) if len(captured_lines[view].all_input_nodes) == 1 else 0
            if view_readers or returned[view]:
                grouped[view] = view_readers
        for line in graph.global_views:  # a view of the input that the user gets, made once
            if line.name in graded and line.name not in returned and \
                    [arg.name for arg in line.all_input_nodes] == [name] and len(tensor_args(line)) == 1:
                returned[line.name] = 1
                grouped[line.name] = []
        direct: dict[str, int] = {}
        for reader in readers.get(name, ()):  # views of the input included (their owner is it)
            direct[reader] = _contributions(graph.node(reader), name, graph, set(grouped) | summed_lines)
            result.setdefault(cname(reader, ComputeKind.BACKWARD), []).extend([grad] * direct[reader])
        # a view made after every node that reads it (``out = x.clone(); out[:, 0] = x[:, -1]``:
        # the ``select`` after the ``clone``) has its place in the backward before theirs: its
        # group is delivered empty (exec.codegen._deliver_view_groups), and each read's
        # contribution joins the input's gradient at once, as a direct read's does
        for view in [view for view, view_readers in grouped.items() if view_readers and not returned[view]]:
            if all(position[view] > position[graph.node(reader).main.name] for reader in grouped[view]):
                for reader in grouped.pop(view):
                    direct[reader] = direct.get(reader, 0) + 1
                    result.setdefault(cname(reader, ComputeKind.BACKWARD), []).append(grad)
        # an output that is the input (or a view of it): the loss gives the input a gradient
        # (a tensor returned several times gets one gradient: :func:`_loss_contributions`)
        outputs = sum(graph.owner.get(output) == name for output in graded) - \
            sum(returned[view] for view in grouped)
        result.setdefault("loss", []).extend([grad] * outputs)
        # a group's sum is the input's gradient where it is the only way the gradient comes
        # (it becomes the gradient when it joins); else a second tensor meanwhile, until the
        # group joins the input's gradient at the view's place (``FirstRun.delivery``; one
        # buffer for the input's views, as a group's sum joins the input's gradient before the
        # next group's first contribution)
        alone = len(grouped) == 1 and outputs == 0 and not any(direct.values()) and not summed
        apart = _overlapping_groups(graph, grouped, returned, needs)
        for view, view_readers in grouped.items():
            key = grad if alone else FirstRun(input_views_key(name, view if view in apart else None), size,
                                              accumulates=True, delivery=delivery(view))
            result.setdefault("loss", []).extend([key] * returned[view])
            for reader in view_readers:
                result.setdefault(cname(reader, ComputeKind.BACKWARD), []).append(key)
            # readers that only split the view sum the pieces apart first (exec.codegen's
            # "<view>.pieces" groups): one more buffer until it joins the view's sum
            splitting = [reader for reader in view_readers if _only_splits(graph.node(reader), view)]
            if splitting and (returned[view] or len(splitting) < len(view_readers)):
                pieces = FirstRun(f"{input_views_key(name)}.pieces.{view}", size)
                for reader in splitting:
                    result.setdefault(cname(reader, ComputeKind.BACKWARD), []).append(pieces)
    result = {name: [e for i, e in enumerate(entries) if e.accumulates or e not in entries[:i]]
              for name, entries in result.items()}
    return {name: tuple(entries) for name, entries in result.items() if entries}


def _overlapping_groups(graph: SimplifiedGraph, grouped: dict[str, list], returned: dict[str, int],
                        needs: dict) -> set[str]:
    """The views of one model input whose groups are open together in the backward (a group opens
    at the first of its contributions, the backward of its last reader or the loss, and joins the
    input's gradient at its delivery, :func:`first_run_bytes`; the backwards run in the reverse
    order of the nodes): each gets a buffer of its own (fuzz seed 283: a second group's first
    contribution came before the first group joined, and was taken to be added into it)."""
    order = {node.name: i for i, node in enumerate(graph.nodes)}
    spans: dict[str, tuple[int, int]] = {}
    for view, view_readers in grouped.items():
        starts = [order[reader] for reader in view_readers] + ([len(order)] if returned[view] else [])
        if not starts:
            continue
        node = graph.last_node_before(view, lambda name: needs[name].requires_grad)
        spans[view] = (order[node.name] if node is not None else -1, max(starts))
    return {view for view, (end, start) in spans.items()
            if any(other != view and max(end, other_end) < min(start, other_start)
                   for other, (other_end, other_start) in spans.items())}


def _input_grad_aliases(entries: dict[str, tuple[FirstRun, ...]], measures, blocks: list[BlockInstance],
                        simplified: SimplifiedGraph) -> dict[str, tuple[FirstRun, ...]]:
    """``entries`` (:func:`first_run_bytes`) where a backward's contributions to a model input's
    gradient are its own incoming gradient (``FirstRun.alias``), dense tensors of their own
    (``FirstRun.owned``) or storages its contributions to gradients' parts share
    (``FirstRun.together``), as the inspection saw them (``NodeMeasure.input_grad_aliases``,
    ``input_grad_owned``, ``input_grad_together``), where it saw one per entry."""
    result = dict(entries)
    representatives: dict[int, BlockInstance] = {}
    for block in blocks:
        representative = representatives.setdefault(block.class_index, block)
        aliased = [measure for measure in measures[block.class_index].nodes if measure.input_grad_aliases]
        if not aliased:
            continue
        # (the measures name the globals its representative reads: a view of another parameter
        # in another layer of the class, Perceiver's latents or a learned query per layer)
        same = _globals_read_alike(simplified, representative, block)
        for measure in aliased:
            name = cname(block.names[measure.name], ComputeKind.BACKWARD)
            for input_name, sources in measure.input_grad_aliases.items():
                key = input_grad_key(same.get(input_name, input_name))
                own = [i for i, entry in enumerate(result.get(name, ())) if entry.key == key]
                owned = measure.input_grad_owned.get(input_name, [False] * len(sources))
                groups = measure.input_grad_together.get(input_name, [])
                groups = groups + [-1] * (len(sources) - len(groups))
                # (the inspection's sink also saw the contributions through views of the input
                # that the executor sums apart, in the views' group: where every contribution
                # is alike, which one is which does not matter)
                views = [i for i, entry in enumerate(result.get(name, ()))
                         if views_key_input(entry.key) == same.get(input_name, input_name)]
                if len(own) < len(sources) == len(own) + len(views) and \
                        len(set(zip(sources, owned, groups))) == 1:
                    own = sorted(own + views)
                if len(own) != len(sources) or not any(j >= 0 for j in sources) and not any(owned) \
                        and not any(g >= 0 for g in groups):
                    continue
                updated = list(result[name])
                for i, j, dense, group in zip(own, sources, owned, groups):
                    updated[i] = replace(updated[i], alias=j, owned=dense, together=group)
                result[name] = tuple(updated)
    return result


def _globals_read_alike(simplified: SimplifiedGraph, representative: BlockInstance,
                        block: BlockInstance) -> dict[str, str]:
    """The names of what ``block`` reads where its class's representative reads another
    (the same line of the same node, the same argument): representative's name -> block's."""
    same: dict[str, str] = {}
    if block is representative:
        return same
    for anonymous, name in block.names.items():
        theirs = representative.names.get(anonymous)
        if theirs is None or anonymous == INPUT_NAME or anonymous.startswith(SIDE_PREFIX):  # nodes of its own
            continue
        for line, other in zip(simplified.node(theirs).lines, simplified.node(name).lines):
            for read, other_read in zip(line.all_input_nodes, other.all_input_nodes):
                if read.name != other_read.name:
                    same.setdefault(read.name, other_read.name)
    return same


def _only_splits(node, view: str) -> bool:
    """Whether ``node`` reads grouped view ``view`` (made in its prelude) only through one split
    (:func:`rkgb.simplify.split_of_view`): its reads then form a split group."""
    line = next((line for line in node.lines if line.name == view), None)
    return line is not None and split_of_view(line, node.lines) is not None


def _contributions(node, name: str, graph: SimplifiedGraph, grouped: set[str] = frozenset()) -> int:
    """How many contributions a node's backward makes to the gradient of global ``name``: one
    per read when it reads it more than once (the executor gives each read its own alias,
    :class:`rkgb.gradsink.GradientQueue`), and one more for its reads through views; reads
    through the ``grouped`` views (and their pieces) go to those views' groups, not counted."""
    family = set(grouped) | {line.name for line in node.lines if line.target is operator.getitem
                             and isinstance(line.args[0], torch.fx.Node) and line.args[0].name in grouped}
    lines = [line for line in node.lines if line.name not in family]
    reads = sum(arg.name == name for line in lines for arg in tensor_args(line))
    through_views = any(graph.owner.get(arg.name) == name and arg.name != name and arg.name not in family
                        for line in lines for arg in tensor_args(line))
    if not reads and not through_views:
        return 0
    return (reads if reads > 1 else 1) + (1 if reads > 1 and through_views else 0)


def _loss_contributions(simplified: SimplifiedGraph, real: str, needs) -> tuple[int, ...] | None:
    """The loss's contributions to the parts of output node ``real``'s gradient: one for each part
    the user gets (once for ``return h, h``: the executor returns one tensor twice, as eager
    does, and the engine sums its two gradients before handing it over, see
    :func:`_repeated_outputs_transient`), none for a part only nodes read; None where that is
    one per part."""
    parts = [name for name in simplified.exported(simplified.node(real)) if needs[real].exported.get(name, False)]
    returned = set(simplified.gradient_outputs)
    contributions = tuple(i for i, name in enumerate(parts) if name in returned)
    return None if contributions == tuple(range(len(parts))) else contributions


def _repeated_outputs_transient(simplified: SimplifiedGraph, needs, global_requires_grad: dict[str, bool]) -> int:
    """The loss's temporary memory for the tensors the model returns more than once.

    The user's loss gives each return its own gradient; the engine adds them in the buffer of
    the tensor's one output gate (``exec.runtime``) as they come, as eager's engine does in the
    buffer of the tensor's node: the first (a view of the loss's result, which is not added
    into in place), the next and their sum are held at once, before the sum alone is handed
    over. Two tensors of the largest such output beyond its gradient (sums are made one at a
    time)."""
    returned = simplified.gradient_outputs
    repeated = {name for name in returned if returned.count(name) > 1}
    largest = 0
    for line in simplified.captured.graph.nodes:
        if line.name not in repeated:
            continue
        owner = simplified.owner.get(line.name, line.name)
        if owner in needs:
            gets_gradient = needs[owner].exported.get(line.name, False)
        else:
            gets_gradient = global_requires_grad.get(line.name, global_requires_grad.get(owner, False))
        if gets_gradient:
            largest = max(largest, tensor_bytes(line.meta.get("val")))
    return 2 * largest


def _early_output_contributions(simplified: SimplifiedGraph, names: list[str], needs) -> dict[str, tuple[int, ...]]:
    """For the model outputs made before the last block (``names``), the loss's contributions to
    their gradients' parts where not one per part (:func:`_loss_contributions`)."""
    found = {dname(real, DataKind.GRAD): _loss_contributions(simplified, real, needs) for real in names}
    return {grad: contributions for grad, contributions in found.items() if contributions is not None}


def _count_repeated_outputs(graph: CDGraph, simplified: SimplifiedGraph, last: Block, needs,
                            global_requires_grad: dict[str, bool]) -> None:
    """The loss of the last block's class contributes to its outputs' gradients as the user's
    loss does (:func:`_loss_contributions`: once for ``return h, h``), with the temporary sums
    of the repeated outputs' gradients (:func:`_repeated_outputs_transient`)."""
    loss = graph.loss
    loss.overhead_bytes = _repeated_outputs_transient(simplified, needs, global_requires_grad)
    for anonymous, real in last.anonymous_names().items():
        grad = dname(anonymous, DataKind.GRAD)
        if grad not in loss.produces:
            continue
        contributions = _loss_contributions(simplified, real, needs)
        if contributions is not None:
            loss.contributes[grad] = contributions
    graph.validate()


def _tensor_signature(value) -> tuple | None:
    if not isinstance(value, torch.Tensor):
        return None
    return (tuple(value.shape), tuple(value.stride()), str(value.dtype), value.device.type, value.requires_grad)


def _graph_lines(captured: CapturedGraph) -> list:
    """The captured graph, node by node: op, arguments, and its value's shape, strides, dtype,
    device and ``requires_grad``."""
    return [(node.op, str(node.target), _arguments(node), repr(node.kwargs),
             [_tensor_signature(v) for v in tree_leaves(node.meta.get("val"))])
            for node in captured.graph.nodes]


def _arguments(node: torch.fx.Node) -> str:
    """A node's arguments, with a custom Function's process-wide index replaced by what it
    stands for (:func:`rkgb.functions.function_identity`)."""
    if node.target is torch.ops.rockmate.function_call.default:
        return repr((function_identity(node.args[0]), *node.args[1:]))
    return repr(node.args)


def layouts_key(captured: CapturedGraph, device: torch.device, without_gradient=frozenset()) -> str:
    """The key of a build's gradient layouts (:func:`rkgb.inspect.gradient_layouts`, two fake
    forward and backward passes: 1.9 s of a second build of a 12-layer Llama of GPT-2 small's
    width) in :class:`rkgb.disk_cache.MeasureCache`: the captured graph, node by node (the
    simplified graph is made from it), the outputs that the user's loss gives no gradient, the
    device, torch's version (the ops' meta functions) and the graph builder's source."""
    content = repr(("gradient layouts", source_digest(), torch.__version__, str(device), _graph_lines(captured),
                    sorted(without_gradient)))
    return hashlib.sha256(content.encode()).hexdigest()


def measures_key(captured: CapturedGraph, chain: Chain, requires_grad: dict[str, bool], layouts, device: torch.device,
                 cost_model: str, repeats: int, without_gradient=frozenset(), optional_gradient=frozenset()) -> str:
    """The key of a build's measures in :class:`rkgb.disk_cache.MeasureCache`: what they depend
    on. The captured graph, node by node (its op, arguments, and its value's shape, strides,
    dtype, device and ``requires_grad``), which globals require grad, the chain of blocks and
    classes, the gradient layouts, the outputs that the user's loss gives no gradient (and those it
    may give none), the device
    (with a GPU's name), torch's version, the settings
    that choose kernels (threads, deterministic algorithms, cuDNN, TF32: their scratch memory
    and times), the cost model and the graph builder's own source
    (:func:`rkgb.disk_cache.source_digest`). Not the values of tensors: no measure depends on
    them (but the timings, which a second build takes from the first)."""
    lines = _graph_lines(captured)
    blocks = [(b.index, b.class_index, tuple(b.nodes), b.input_node, tuple(b.side_inputs)) for b in chain.blocks]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    # the settings that choose kernels (and so their scratch memory and times)
    kernels = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
               torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
               torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    content = repr((source_digest(), torch.__version__, str(device), gpu, kernels, cost_model, repeats, lines,
                    sorted(requires_grad.items()), blocks, sorted((k, repr(v)) for k, v in layouts.items()),
                    sorted(without_gradient), sorted(optional_gradient)))
    return hashlib.sha256(content.encode()).hexdigest()


def _with_classes(chain: Chain, classes_of_blocks: list[int]) -> Chain:
    """``chain`` with each block in the class ``classes_of_blocks`` gives it (in place)."""
    members: dict[int, list[int]] = {}
    for block, index in zip(chain.blocks, classes_of_blocks):
        block.class_index = index
        members.setdefault(index, []).append(block.index)
    chain.classes = [BlockClass(index, members[index]) for index in sorted(members)]
    return chain


def build(model: nn.Module, sample, cost_model: str = "measured", repeats: int = 3,
          grad_accumulation: bool = True, max_block_nodes: int | None = 40, measure_cache=None,
          loss_index: Callable[[CapturedGraph], int | None] | None = None, output_gradients: str = "auto",
          held_outputs: str = "all", on_capture: Callable[[CapturedGraph], None] | None = None) -> ModelGraphs:
    """Run the whole graph builder: capture, simplify, cut, inspect, CD-graphs.

    Args:
        model: the module to train (in train mode).
        sample: a tensor or a tuple of positional inputs, on the device of the model.
        cost_model: ``"measured"`` (median of ``repeats`` timings) or ``"flops"``
            (deterministic, for tests).
        grad_accumulation: count the sums of shared parameters' gradients that a step
            accumulating into ``.grad`` makes (:func:`first_run_bytes`).
        max_block_nodes: split bigger blocks with side inputs (:func:`rkgb.blocks.cut_chain`).
        measure_cache: a :class:`rkgb.disk_cache.MeasureCache`: the measures of a build with the
            same :func:`measures_key` are read from it instead of measured (None: measure).
        loss_index: asked once the model is captured, the index among its outputs of the loss it
            returns (None: it returns none); None: not asked.
        output_gradients: ``"auto"``: where the model returns its loss, the step's backward runs
            from it alone (the outputs it reaches get no gradient from the user); ``"all"``: the
            user's loss gives every output a gradient.
        held_outputs: ``"all"``: the step holds the model's outputs to its end; ``"loss"``: it
            keeps the model's loss alone (or nothing), the outputs of the last block dropped once
            the forward returns them (``ModelChain.dropped_outputs``).
        on_capture: called with the captured graph once the model is captured (``rockmate.api``
            keeps its objects out of the garbage collector's full collections from there).
    """
    seconds: dict[str, float] = {}
    clock = time.perf_counter()
    captured = capture(model, sample)
    seconds["capture"] = time.perf_counter() - clock
    if on_capture is not None:
        on_capture(captured)
    clock = time.perf_counter()
    simplified = simplify(captured)
    index = None if loss_index is None else loss_index(captured)
    loss_name = simplified.outputs[index] if index is not None and 0 <= index < len(simplified.outputs) else None
    if loss_name is not None and output_gradients == "auto":
        simplified.outputs_without_gradient = frozenset(name for name in simplified.outputs if name != loss_name)
    # which tensors a backward from the outputs reaches (and the layouts of their gradients)

    def find_layouts() -> list:
        receivers: set[str] = set()
        unreached: set[str] = set()
        return [gradient_layouts(simplified, model, sample, receivers, unreached), receivers, unreached]

    device = device_of(model, as_input_tuple(sample))
    if measure_cache is None:
        layouts, receivers, unreached = find_layouts()
    else:
        key = layouts_key(captured, device, simplified.outputs_without_gradient)
        layouts, receivers, unreached = measure_cache.get_or_compute(key, find_layouts)
    simplified.gradient_receivers = None if layouts is None else receivers
    # an output that the loss's backward does not reach is taken to get a gradient from the user
    # (its backward would not run otherwise); all of them where the layouts are not known
    simplified.outputs_with_optional_gradient = frozenset() if layouts is None else \
        simplified.outputs_without_gradient & unreached
    simplified.outputs_without_gradient = frozenset() if layouts is None else \
        simplified.outputs_without_gradient - unreached
    requires_grad = global_requires_grad(simplified, model, sample)
    needs = gradient_needs(simplified, requires_grad)
    chain = cut_chain(simplified, needs, max_block_nodes)
    seconds["simplify_and_cut"] = time.perf_counter() - clock
    clock = time.perf_counter()

    def measure() -> list:
        """The measures, and the class of each block (inspection splits a class whose blocks
        receive their gradients in different layouts, :func:`rkgb.inspect.split_by_output_layouts`)."""
        measures = inspect_chain(simplified, chain, model, sample, cost_model=cost_model, repeats=repeats,
                                 layouts=layouts or {})
        return [[block.class_index for block in chain.blocks], measures]

    from_cache = False
    if measure_cache is None:
        classes_of_blocks, measures = measure()
    else:
        key = measures_key(captured, chain, requires_grad, layouts or {}, device, cost_model, repeats,
                           simplified.outputs_without_gradient, simplified.outputs_with_optional_gradient)
        hits = measure_cache.hits
        classes_of_blocks, measures = measure_cache.get_or_compute(key, measure)
        from_cache = measure_cache.hits > hits
    chain = _with_classes(chain, classes_of_blocks)
    seconds["inspect"] = time.perf_counter() - clock
    clock = time.perf_counter()
    classes = [cdgraph_of_class(m) for m in measures]
    if chain.blocks:
        _count_repeated_outputs(classes[chain.blocks[-1].class_index], simplified, chain.blocks[-1], needs,
                                requires_grad)
    instances = [BlockInstance(b.index, b.class_index, b.anonymous_names()) for b in chain.blocks]
    last_nodes = set(chain.blocks[-1].nodes) if chain.blocks else set()
    early = [name for name in simplified.output_owners if name not in last_nodes]
    # (those that the user's loss gives no gradient get theirs from the next blocks alone)
    graded = {simplified.owner.get(name, name) for name in simplified.gradient_outputs}
    model_chain = ModelChain(classes=classes, blocks=instances, held_bytes=held_bytes(simplified, model),
                             early_outputs=[dname(name, DataKind.DATA) for name in early],
                             early_without_gradient=[dname(name, DataKind.DATA) for name in early
                                                     if name not in graded],
                             early_contributions=_early_output_contributions(simplified, early, needs))
    # (the data of a node that the loss is, or a view of, stays: the user holds the loss; so do
    # scalars, which a model returning a tuple may hold its loss among: `return loss, logits`)
    kept = simplified.owner.get(loss_name, loss_name) if loss_name is not None else None
    values = {node.name: node.meta.get("val") for node in captured.graph.nodes}
    scalars = {simplified.owner.get(name, name) for name in simplified.outputs
               if isinstance(values.get(name), torch.Tensor) and values[name].dim() == 0}
    droppable = [dname(name, DataKind.DATA) for name in simplified.output_owners
                 if name in last_nodes and name != kept and name not in scalars]
    if held_outputs == "loss":
        model_chain.dropped_outputs = droppable
    computes = {c.name for c in model_chain.whole_graph().compute_nodes}
    entries = first_run_bytes(simplified, model, sample, grad_accumulation, needs)
    model_chain.first_run_bytes = {name: entries for name, entries in _input_grad_aliases(entries, measures, instances, simplified).items()
                                   if name in computes}  # the backwards of nodes without grad do not run
    seconds["cdgraph"] = time.perf_counter() - clock
    return ModelGraphs(captured, simplified, chain, measures, model_chain, seconds, from_cache, droppable)
