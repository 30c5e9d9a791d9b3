"""Inspect each class of identical blocks: sizes, phantoms, temporary memory and times.

One block of each class (its representative) runs for real on the sample's device, node by
node, as the executor will run it: each node is an autograd island whose saved tensors go
through :class:`rkgb.saved.SavedTensors`. For each simplified node ``x`` we measure

- the bytes of ``x.data`` (its output storages) and of ``x.phantoms`` (saved tensors that alias
  no node's data), and which nodes' data its backward reads (real edges) or only the shape of
  (fake edges);
- the temporary memory of ``fwd_x`` and ``bwd_x``: the peak while the op runs above what was
  alive and what the op leaves behind (allocation tracking on CPU,
  ``torch.cuda.max_memory_allocated`` on CUDA; never process RSS);
- forward and backward times: the fastest of repeats after one untimed run (fewer for an op
  whose samples add up to 50 ms; CUDA events on
  GPU; on CPU with denormal numbers flushed to zero, :func:`_denormals_flushed`), or a
  deterministic cost model from FLOPs, bytes and random numbers drawn
  (``cost_model="flops"``) for reproducible tests.
"""

from __future__ import annotations

import contextlib
import operator
import time
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from .blocks import Block, BlockClass, Chain, side_name
from .capture import as_input_tuple, device_of
from .interpret import eager_target, global_requires_grad, initial_environment, inspected_targets, run_lines, tensor_args
from .memory import allocator_events, allocator_events_and_ranges, measure_allocator_peak, storage_bytes
from .gradsink import GradientQueue, GradSink, handoff, handoff_backward, non_overlapping_and_dense, owns_its_storage
from .saved import SavedTensors, storage_key
from .simplify import (OpKind, SimplifiedGraph, SimplifiedNode, classify, gradient_needs, summed_input_views,
                       summed_parameter_views)

__all__ = ["NodeMeasure", "BlockMeasure", "GradLayout", "GradSink", "inspect_chain", "COST_MODELS"]

COST_MODELS = ("measured", "flops")

# the deterministic cost model: a machine doing 1e11 FLOP/s and moving 1e10 bytes/s, which
# draws a random number in 9 ns (bernoulli_ on one CPU core: 4.8 ms for 2**19 elements, the
# time of a 400 MFLOP matmul; FLOP counters count no work for random ops)
_FLOPS_PER_S = 1e11
_BYTES_PER_S = 1e10
_RANDOM_S_PER_ELEMENT = 9e-9


class _RandomElements(TorchDispatchMode):
    """Counts the elements that random ops (tagged ``nondeterministic_seeded``) write."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            self.count += sum(t.numel() for t in tree_leaves(result) if isinstance(t, torch.Tensor))
        return result


@dataclass
class NodeMeasure:
    """What one simplified node costs (anonymized name ``n3`` inside its class)."""

    name: str
    data_bytes: int
    grad_parts: list[int] = field(default_factory=list)  # one gradient per exported tensor
    phantom_bytes: int = 0
    requires_grad: bool = False
    forward_overhead_bytes: int = 0
    no_grad_overhead_bytes: int = 0  # the same for a forward without grad (no phantoms kept)
    backward_overhead_bytes: int = 0
    # the same where the engine alone holds the incoming gradient and frees it once the
    # island's first autograd node has used it (rkgb.gradsink.handoff; None: no difference)
    handoff_overhead_bytes: int | None = None
    forward_time_s: float = 0.0
    backward_time_s: float = 0.0
    backward_reads: list[str] = field(default_factory=list)  # nodes whose data bwd needs
    backward_shapes: list[str] = field(default_factory=list)  # deps whose shape only bwd needs
    grads_to: list[str] = field(default_factory=list)  # deps that receive a gradient
    # dep -> the parts of its gradient that the backward contributes to (absent: all)
    grad_contributions: dict[str, list[int]] = field(default_factory=dict)
    # dep -> for each part of its gradient, the part of ours that its first contribution is
    grad_aliases: dict[str, list[int]] = field(default_factory=dict)
    # dep -> where a part gets contributions of both kinds (``h - h``: the incoming gradient,
    # then a new tensor), the part of ours that each contribution is, or -1, in the order of
    # grad_contributions (:attr:`rkgb.cdgraph.ComputeNode.contribution_aliases`)
    grad_contribution_aliases: dict[str, list[int]] = field(default_factory=dict)
    # dep -> the parts of its gradient whose first contribution, made here, shares its storage
    # (a view of a bigger result): the next contribution makes a new sum
    grad_shared: dict[str, list[int]] = field(default_factory=dict)
    # dep -> those of grad_shared whose storage the gradient holds alone all the same (a view of
    # a result of its own size, a transpose's gradient): freed with it
    grad_owned: dict[str, list[int]] = field(default_factory=dict)
    # dep -> for each part of its gradient, the group of new storages that the backward's one
    # contribution to it is a view of, shared with other parts' contributions, or -1
    # (:attr:`rkgb.cdgraph.ComputeNode.together`)
    grad_together: dict[str, list[int]] = field(default_factory=dict)
    # the (bytes, whole) of each of those storages (:attr:`rkgb.cdgraph.ComputeNode.together_storages`)
    together_storages: list[tuple[int, bool]] = field(default_factory=list)
    # model input (fx name) -> for each contribution of the backward to its gradient, the part
    # of ours that it is (an add's backward passes its incoming gradient on), or -1: a new tensor
    input_grad_aliases: dict[str, list[int]] = field(default_factory=dict)
    # model input (fx name) -> for each contribution, whether it is a dense tensor over a
    # storage of its own (:attr:`rkgb.cdgraph.FirstRun.owned`)
    input_grad_owned: dict[str, list[bool]] = field(default_factory=dict)
    # model input (fx name) -> for each contribution, the group of ``grad_together`` whose
    # storage it is (a view of), or -1 (:attr:`rkgb.cdgraph.FirstRun.together`)
    input_grad_together: dict[str, list[int]] = field(default_factory=dict)
    data_deps: list[str] = field(default_factory=list)
    is_random: bool = False
    backward_ran: bool = False  # a gradient reached it in the inspection
    # ... but not where the step gives none to the outputs that the model's loss does not reach
    # (:attr:`rkgb.cdgraph.ComputeNode.optional`)
    optional_backward: bool = False


@dataclass
class SideInputMeasure:
    """A side input of a class (``side0``...: a tensor of an earlier block that the block reads
    besides its chain input, ``rkgb.blocks``): its bytes and its gradient's parts, if any."""

    name: str
    data_bytes: int
    requires_grad: bool
    grad_parts: list[int] = field(default_factory=list)


@dataclass
class BlockMeasure:
    """Measures of one class, in anonymized names (``in`` for the block's input)."""

    class_index: int
    nodes: list[NodeMeasure]
    input_bytes: int
    input_requires_grad: bool
    outputs: list[str]
    has_input: bool
    # output node -> the parts of its gradient that come from outside the block (read after
    # it, or returned), where not all: the others come from the block's own nodes only
    output_parts: dict[str, list[int]] = field(default_factory=dict)
    input_grad_parts: list[int] = field(default_factory=list)
    side_inputs: list[SideInputMeasure] = field(default_factory=list)


@contextlib.contextmanager
def _denormals_flushed():
    """CPU timings with denormal numbers flushed to zero, the user's setting restored after.

    A randomly initialized attention's backward makes denormal floats, which x86 CPUs compute
    tens of times slower; which ops meet them changes with the dropout masks of each build:
    measured on GPT-2 small's attention block, one backward's share of the block's time was 14%
    in one build and 0.3% in the next, so that the plan cache, which reuses options only where
    the times are alike, re-solved the block (6.5 s; 44 s for a Llama's). The values computed
    while timing are thrown away."""
    probe = torch.tensor([1e-40], dtype=torch.float32)
    already = bool((probe * 1.0).item() == 0.0)  # flushing is on (or the platform has no denormals)
    if already or not torch.set_flush_denormal(True):
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


# seconds of timed runs after which an op's timing takes no more samples (:class:`_Clock`)
SAMPLED_S = 0.05
# a first run at least this long is the op's sample: its cold caches and fresh pages are nothing
# beside its time (the backward of the 12-layer Llama's lm head, d=768 x 32000 on 512 tokens:
# 0.626 s its first run, 0.619 s the next; GPT-2 small's lm head 0.929 and 0.945 s, its loss
# 0.417 and 0.41 s)
SLOW_FIRST_RUN_S = 0.2


class _Clock:
    """Wall-clock timing (CUDA events on GPU) or the deterministic FLOP/byte model."""

    def __init__(self, cost_model: str, device: torch.device, repeats: int) -> None:
        if cost_model not in COST_MODELS:
            raise ValueError(f"cost_model must be one of {COST_MODELS}, got {cost_model!r}")
        self.cost_model = cost_model
        self.device = device
        self.repeats = repeats

    def __call__(self, fn, bytes_moved: int, warmed: bool = False) -> float:
        """The time of ``fn`` (seconds); ``warmed``: it has just run (no untimed run first)."""
        if self.cost_model == "flops":
            from torch.utils.flop_counter import FlopCounterMode

            with FlopCounterMode(display=False) as counter, _RandomElements() as random:
                fn()
            return (counter.get_total_flops() / _FLOPS_PER_S + bytes_moved / _BYTES_PER_S
                    + random.count * _RANDOM_S_PER_ELEMENT)
        with _denormals_flushed() if self.device.type == "cpu" else contextlib.nullcontext():
            return self._fastest(fn, warmed)

    def _fastest(self, fn, warmed: bool = False) -> float:
        if not warmed:
            # the first run pays for cold caches and fresh pages, as training's steps do not: not
            # a sample, unless the op is so slow that this is nothing beside its time
            first = self._timed(fn)
            if first >= SLOW_FIRST_RUN_S:
                return first
        samples: list[float] = []
        # up to ``repeats`` samples, but no more once they add up to SAMPLED_S: a slow op's noise
        # is small beside its time (GPT-2 small's 10 ops over 20 ms, its lm head and loss among
        # them, took 6.9 s of its 11.2 s inspection with 3 samples each)
        while len(samples) < self.repeats and sum(samples) < SAMPLED_S:
            samples.append(self._timed(fn))
        # the fastest: noise on a shared machine only ever adds time, and a plan built on one
        # inflated sample avoids recomputing that op for the wrong reason
        return min(samples)

    def _timed(self, fn) -> float:
        """The seconds of one run of ``fn``."""
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1000
        begin = time.perf_counter()
        fn()
        return time.perf_counter() - begin


class _PeakMeter:
    """Peak of allocated bytes while a function runs, above what was allocated before: the
    allocator's own figure (:func:`rkgb.memory.measure_allocator_peak`), the buffers that
    kernels allocate inside themselves included."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._before_mark: int | None = None  # CUDA: the peak before mark() (absolute)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def measure(self, fn) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return measure_allocator_peak(fn, device=self.device)

    def measure_retained(self, fn) -> tuple[int, int]:
        """``(peak, retained)``: the peak of :meth:`measure` and the bytes still allocated when
        ``fn`` returns, both above what was allocated before ``fn``."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            fn()
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated(self.device) - start,
                    torch.cuda.memory_allocated(self.device) - start)
        events = allocator_events(fn)
        return max((event.current_bytes for event in events), default=0), (events[-1].current_bytes if events else 0)

    def measure_marked(self, fn) -> tuple[int, int | None]:
        """``(before, after)``: where ``fn`` called :meth:`mark`, its peak before that moment
        and its peak from that moment on; else ``(peak, None)`` (the peak of :meth:`measure`).
        Both above what was allocated before ``fn``."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._before_mark = None
            fn()
            torch.cuda.synchronize()
            end = torch.cuda.max_memory_allocated(self.device) - start
            before, self._before_mark = self._before_mark, None
            return (end, None) if before is None else (before - start, end)
        events, ranges = allocator_events_and_ranges(fn, prefix=_MARK)
        if _MARK not in ranges:
            return max((event.current_bytes for event in events), default=0), None
        at = ranges[_MARK][0]
        before = [event.current_bytes for event in events if event.time_ns < at]
        after = [event.current_bytes for event in events if event.time_ns >= at]
        return max(before, default=0), max(before[-1:] + after, default=0)

    def mark(self) -> None:
        """The moment :meth:`measure_marked` splits its figure at (the first call counts)."""
        if self.device.type == "cuda":
            if self._before_mark is None:
                torch.cuda.synchronize()
                self._before_mark = torch.cuda.max_memory_allocated(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
            return
        with torch.profiler.record_function(_MARK):
            pass


_MARK = "rockmate: incoming gradient handed off"


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            seen[t.untyped_storage().data_ptr()] = storage_bytes(t)
    return sum(seen.values())


def _outputs_of(node: SimplifiedNode, env) -> list[torch.Tensor]:
    return [env[o.fx_name] for o in node.outputs]


def inspect_chain(
    graph: SimplifiedGraph,
    chain: Chain,
    model: nn.Module,
    sample,
    cost_model: str = "measured",
    repeats: int = 3,
    layouts: dict[str, GradLayout] | None = None,
) -> list[BlockMeasure]:
    """Measure the representative block of every class; returns one BlockMeasure per class.

    The model's parameters, buffers, gradients and the global RNG state are left as found.
    ``layouts``: :func:`gradient_layouts` (found here when not given).
    """
    device = device_of(model, as_input_tuple(sample))
    needs = gradient_needs(graph, global_requires_grad(graph, model, sample))
    clock = _Clock(cost_model, device, repeats)
    representatives = {cls.representative: cls.index for cls in chain.classes}
    position = {node.name: i for i, node in enumerate(graph.nodes)}
    last_use: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        for dep in node.data_deps:
            last_use[dep] = i
    for block in chain.blocks:
        if block.index in representatives:
            for name in ([block.input_node] if block.input_node is not None else []) + block.side_inputs:
                last_use[name] = max(last_use.get(name, 0), position[block.nodes[-1]])

    # the user's gradients are set aside, not only their tensors: the inspection's backwards
    # accumulate into the .grad they find, in place (a model built after a step, or rebuilt by
    # a copy or for a new input shape, had its gradients changed by the build)
    saved_grads = {p: p.grad for p in model.parameters()}
    for p in saved_grads:
        p.grad = None
    try:
        if layouts is None:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                detached = tuple(
                    value.detach().requires_grad_(value.requires_grad) if isinstance(value, torch.Tensor) else value
                    for value in as_input_tuple(sample)
                )
                layouts = gradient_layouts(graph, model, detached) or {}
        # the traced layouts come from the ops' meta functions, which can differ from the kernels'
        # (a CPU batch norm's backward of a transposed input gives a contiguous gradient): a
        # block's output gradient is really what the next block's backward gives its input. A
        # block whose output layout was wrong is measured again, which can change the layout it
        # gives its own input: passes until none changes (one where the traced ones were right)
        measures: dict[int, BlockMeasure] = {}
        split_by_output_layouts(graph, chain, layouts)
        representatives = {cls.representative: cls.index for cls in chain.classes}
        again = representatives
        # the real layouts of the results, by fx name: found by the first pass, which runs every
        # block up to the last representative; a later pass re-measures some blocks only, whose
        # inputs are synthesized with these layouts (not the traced ones)
        strides: dict[str, tuple[int, ...]] = {}
        for _ in range(len(chain.blocks) + 1):
            received: dict[str, GradLayout] = {}
            measures.update(_inspect_blocks(graph, chain, model, sample, device, needs, clock, again,
                                            last_use, layouts, received, strides))
            # a block whose input comes in another real layout than its representative's is a
            # class of its own: what its ops save depends on it (a linear's reshape of a
            # transposed input is a copy of its own, of a contiguous one a view of the input)
            stale = split_by_input_layouts(graph, chain, strides)
            corrected = {name: layout for name, layout in _received_layouts(graph, chain, received).items()
                         if layouts.get(name) != layout}
            if corrected:
                layouts = {**layouts, **corrected}
                # a block of a class whose output gradient now differs from its representative's is
                # a class of its own (its backward's memory, and the layout it gives its input, differ)
                stale |= split_by_output_layouts(graph, chain, layouts)
                # and a representative whose output gradient changed is measured again
                for block in chain.blocks[1:]:
                    previous = chain.blocks[block.index - 1]
                    if block.input_node is not None and previous.index == chain.classes[previous.class_index].representative \
                            and any(n in corrected for n in graph.exported(graph.node(block.input_node))):
                        stale.add(previous.class_index)
            if not stale:
                break
            again = {cls.representative: cls.index for cls in chain.classes if cls.index in stale}
        if graph.outputs_with_optional_gradient:
            # a step may give the outputs that the model's loss does not reach a gradient or not
            # (``loss.backward()``): where none comes, the gradients that theirs would have been
            # summed with stay what they were (a view of a bigger gradient, which the next
            # contribution is not added into in place: fuzz seed 271, one tensor over the plan);
            # the blocks are measured that way too and each figure is the larger of the two
            given = graph.outputs_without_gradient
            graph.outputs_without_gradient = given | graph.outputs_with_optional_gradient
            try:
                everyone = {cls.representative: cls.index for cls in chain.classes}
                without = _inspect_blocks(graph, chain, model, sample, device, needs, clock, everyone,
                                          last_use, layouts, {}, strides)
            finally:
                graph.outputs_without_gradient = given
            for index, measure in without.items():
                _take_larger(measures[index], measure)
        return [measures[i] for i in range(len(chain.classes))]
    finally:
        for p, grad in saved_grads.items():
            p.grad = grad


def _take_larger(given: BlockMeasure, without: BlockMeasure) -> None:
    """``given`` (a class measured with a gradient for every output the plan counts one for) made
    to hold for a step that gives the optional ones none too (``without``, measured so), in place:
    each backward's temporary memory the larger of the two, and a gradient's first contribution
    taken to be shared (the next one not added into it in place) or not a dense tensor of its own
    where either measure saw it so. A node whose backward does not run without them keeps its
    figures (the other's are empty) and is marked optional."""
    for mine, theirs in zip(given.nodes, without.nodes):
        mine.optional_backward = mine.backward_ran and not theirs.backward_ran
        if mine.handoff_overhead_bytes is not None or theirs.handoff_overhead_bytes is not None:
            # (None: as without the hand-off)
            mine.handoff_overhead_bytes = max(m.backward_overhead_bytes if m.handoff_overhead_bytes is None
                                              else m.handoff_overhead_bytes for m in (mine, theirs))
        mine.backward_overhead_bytes = max(mine.backward_overhead_bytes, theirs.backward_overhead_bytes)
        for dep in set(mine.grad_shared) | set(theirs.grad_shared):
            # (a part is fresh, shared but freed with the gradient, or shared: the larger)
            shared = sorted(set(mine.grad_shared.get(dep, [])) | set(theirs.grad_shared.get(dep, [])))
            owned = [i for i in shared if all(i in m.grad_owned.get(dep, []) or i not in m.grad_shared.get(dep, [])
                                              for m in (mine, theirs))]
            mine.grad_shared[dep] = shared
            if owned:
                mine.grad_owned[dep] = owned
            else:
                mine.grad_owned.pop(dep, None)
        for name, flags in theirs.input_grad_owned.items():
            own = mine.input_grad_owned.get(name)
            if own is not None:
                mine.input_grad_owned[name] = [a and b for a, b in zip(own, flags)] if len(own) == len(flags) \
                    else [False] * len(own)


def _output_layouts(graph: SimplifiedGraph, block: Block, layouts: dict[str, GradLayout]) -> tuple:
    """The layouts of the gradients that ``block``'s outputs receive, in the order of its
    (class-level) outputs."""
    return tuple(layouts.get(name) for node in block.output_nodes for name in graph.exported(graph.node(node)))


def split_by_output_layouts(graph: SimplifiedGraph, chain: Chain, layouts: dict[str, GradLayout]) -> set[int]:
    """Split each class of ``chain`` (in place) into classes whose blocks' outputs receive their
    gradients in the same layouts; returns the indices of the new classes.

    Identical blocks are one class because one measure holds for all, but a backward's memory
    depends on the layout of the gradient it receives, which the next block decides (a CPU
    batch norm over a transposed input hands back a gradient in the input's transposed
    layout; the elementwise ops before it keep that layout, and a convolution's backward
    copies it to its own). The blocks that keep the representative's layouts stay in its
    class; each other group of layouts becomes a class, its first block its representative.
    """
    return _split_classes(chain, lambda block: _output_layouts(graph, block, layouts))


def _split_classes(chain: Chain, signature) -> set[int]:
    """Split each class of ``chain`` (in place) by ``signature(block)`` (None: not known, the
    block stays with its representative): the blocks that share the representative's stay in
    its class, each other group becomes a class, its first block its representative; returns
    the indices of the new classes."""
    new: set[int] = set()
    for cls in list(chain.classes):
        own = signature(chain.blocks[cls.representative])
        groups: dict[tuple, list[int]] = {}
        for index in cls.blocks:
            mine = signature(chain.blocks[index])
            groups.setdefault(own if mine is None or own is None else mine, []).append(index)
        if len(groups) == 1:
            continue
        for key, members in groups.items():
            if key == own:
                cls.blocks = members
                continue
            split = BlockClass(len(chain.classes), members)
            chain.classes.append(split)
            for index in members:
                chain.blocks[index].class_index = split.index
            new.add(split.index)
    return new


def split_by_input_layouts(graph: SimplifiedGraph, chain: Chain, strides: dict[str, tuple[int, ...]]) -> set[int]:
    """Split each class of ``chain`` (in place) into classes whose blocks get their inputs (and
    side inputs) in the same real layouts (``strides``, by fx name, as the kernels made them);
    returns the indices of the new classes.

    The blocks of a class run the same code, but what their ops save can depend on the layout of
    their input, which the block before decides: a linear's reshape of a transposed input is a
    copy, a phantom of its own, and of a contiguous one a view of the input, whose data its
    backward then needs (fuzz seed 295: two identical linears, the first reading a CPU batch
    norm's transposed result; measured on the first, the second's backward found its input
    forgotten). The input of a block that the inspection did not run (it synthesizes the inputs
    of the last classes, see :func:`_inspect_blocks`) has the layout of the same result in the
    first block of its producer's class, as :func:`_synthesize_node` makes it (a block's results'
    layouts follow from its code and its input's); a block whose input's layout is not known
    that way either stays in its class. The blocks that keep the representative's layouts stay in
    its class; each other group of layouts becomes a class, its first block its representative.
    """
    return _split_classes(chain, lambda block: _input_layouts(graph, chain, block, strides))


def _input_layouts(graph: SimplifiedGraph, chain: Chain, block: Block, strides: dict[str, tuple[int, ...]]) -> tuple:
    """The real strides of ``block``'s input and side inputs, in the order of its (class-level)
    inputs: as computed, else those of the same result in the first block of its producer's class
    (None where one is known neither way)."""
    names = ([block.input_node] if block.input_node is not None else []) + list(block.side_inputs)
    layouts = []
    for name in names:
        twin = _twin(graph, chain, name)
        for i, output in enumerate(graph.node(name).outputs):
            stride = strides.get(output.fx_name)
            if stride is None and twin is not None and i < len(twin.outputs):
                stride = strides.get(twin.outputs[i].fx_name)
            layouts.append(stride)
    return None if None in layouts else tuple(layouts)


def _received_layouts(graph: SimplifiedGraph, chain: Chain,
                      received: dict[str, GradLayout]) -> dict[str, GradLayout]:
    """The real layout of the gradient of every block's input, from what the backward of its
    class's representative gave (``received``, by the representative's tensor names). A model
    output gets the loss's gradient first, whose layout the sum keeps (added into it, or ``old +
    grad``): its layout stays the whole graph's (:func:`gradient_layouts`; fuzz seed 249: a
    convolution's output, returned and read by a batch norm in the next block, measured with
    the batch norm's transposed gradient, and its backward's copy of the sum not counted)."""
    out: dict[str, GradLayout] = {}
    returned = set(graph.gradient_outputs)
    for block in chain.blocks:
        if block.input_node is None:
            continue
        twin = chain.blocks[chain.classes[block.class_index].representative]
        if twin.input_node is None:
            continue
        names = graph.exported(graph.node(block.input_node))
        twin_names = graph.exported(graph.node(twin.input_node))
        for name, twin_name in zip(names, twin_names):
            if twin_name in received and name not in returned:
                out[name] = received[twin_name]
    return out


def _inspect_blocks(graph, chain, model, sample, device, needs, clock, representatives, last_use,
                    layouts, received, strides) -> dict[int, BlockMeasure]:
    """One pass of :func:`inspect_chain` over the blocks with the given output ``layouts``;
    ``received`` gets the layouts of the gradients that each inspected block's backward gives
    its input; ``strides`` the real layouts of the results computed (kept across passes). The
    parameters' gradients are None when it starts (the user's are set aside by
    :func:`inspect_chain`) and when it ends (its own dropped: the next pass starts alike)."""
    measures: dict[int, BlockMeasure] = {}
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            # the inputs as leaves of their own: the user's tensors get no gradient from inspection
            sample = tuple(
                value.detach().requires_grad_(value.requires_grad) if isinstance(value, torch.Tensor) else value
                for value in as_input_tuple(sample)
            )
            env = initial_environment(graph, model, sample)
            # the inputs' gradients are collected as the executor collects them
            queue = GradientQueue()
            given: set[str] = set()  # lines whose values are leaves of their own (not run in islands)
            input_sinks = {name: GradSink(env[name], queue) for name in graph.captured.inputs
                           if name is not None and isinstance(env[name], torch.Tensor) and env[name].requires_grad}
            # views of trained parameters whose gradients the executor sums at the view's size
            # before the view's backward (exec.codegen): leaves of their own here, whose
            # contributions are first-run memory as a model input's (rkgb.build.first_run_bytes)
            trained = {name for name, path in graph.captured.parameters.items()
                       if model.get_parameter(path).requires_grad}
            for view in summed_parameter_views(graph, trained):
                env[view] = env[view].detach().requires_grad_()
                input_sinks[view] = GradSink(env[view], queue)
            # and so are those of inputs' views made in each reader (their lines not run in islands)
            for view, (base, views) in summed_input_views(graph, set(input_sinks)).items():
                made = {base: env[base].detach()}
                run_lines(views, made)
                env[view] = made[view].requires_grad_()
                input_sinks[view] = GradSink(env[view], queue)
                given |= {line.name for line in views}
            with torch.no_grad():
                # as after a first step (not counted), for the parameters that the inspected
                # blocks read: the others get no gradient here (zeroing every gradient of a
                # 12-layer Llama of GPT-2 small's width took 1.3 s per pass)
                read = {id(env[name]) for name in _globals_read(graph, chain, representatives) if name in env}
                for p in model.parameters():
                    if p.requires_grad and p.grad is None and id(p) in read:
                        p.grad = torch.zeros_like(p)
                next_node = 0
                for block in chain.blocks:
                    if block.index in representatives:
                        measures[representatives[block.index]] = _inspect_block(
                            graph, block, env, model, clock, device, representatives[block.index], layouts, needs, input_sinks, queue,
                            strides, received, given)
                    remaining = [b for b in chain.blocks[block.index + 1 :] if b.index in representatives]
                    if all(_floating_input(graph, b) and not _reads_values(graph, b) for b in remaining):
                        # the rest only needs inputs of the right shape: skip the forward of
                        # the repeated blocks, so that inspection does not grow with depth
                        for later in remaining:
                            _synthesize_input(graph, chain, later, env, device, strides)
                            for side in later.side_inputs:
                                if not all(o.fx_name in env for o in graph.node(side).outputs):
                                    _synthesize_node(graph, chain, side, env, device, strides, later.index)
                            measures[representatives[later.index]] = _inspect_block(
                                graph, later, env, model, clock, device, representatives[later.index], layouts, needs, input_sinks, queue,
                                strides, received, given)
                        break
                    for name in block.nodes:
                        run_lines(graph.node(name).lines, env)
                        _record_strides(graph.node(name), env, strides)
                        next_node += 1
                        for dep in graph.node(name).data_deps:
                            if last_use.get(dep, -1) <= next_node - 1:
                                _drop(graph.node(dep), env)
    finally:
        for p in model.parameters():
            p.grad = None
    return measures


def _globals_read(graph: SimplifiedGraph, chain: Chain, representatives) -> set[str]:
    """The globals (parameters, buffers, inputs, their views and the bases of these views)
    that the nodes of the blocks in ``representatives`` read."""
    read = {name for block in chain.blocks if block.index in representatives
            for node in block.nodes for name in graph.node(node).globals_read}
    for line in reversed(graph.global_views):
        if line.name in read:
            read.update(arg.name for arg in line.all_input_nodes)
    return read


# ops that fail on some values of their floating inputs (a probability outside [0, 1])
_VALUE_DOMAIN_OPS = {torch.ops.aten.multinomial.default, torch.ops.aten.bernoulli.default,
                     torch.ops.aten.binomial.default, torch.ops.aten.poisson.default,
                     torch.ops.aten._standard_gamma.default, torch.ops.aten._sample_dirichlet.default}


def _reads_values(graph: SimplifiedGraph, block: Block) -> bool:
    """Whether the block's work depends on its input's values, not only on its shape: an op
    that fails outside a domain (``multinomial`` on a synthesized "probability"), or a floating
    value turned into integers (indices that a synthesized input would put out of range).
    Such a block is inspected on its real input (the forward runs up to it)."""
    for name in block.nodes:
        for line in graph.node(name).lines:
            if line.target in _VALUE_DOMAIN_OPS:
                return True
            value = line.meta.get("val")
            if isinstance(value, torch.Tensor) and not value.dtype.is_floating_point and value.dtype is not torch.bool \
                    and any(isinstance(arg.meta.get("val"), torch.Tensor) and arg.meta["val"].dtype.is_floating_point
                            for arg in line.all_input_nodes) \
                    and line.target in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype,
                                        torch.ops.aten.to.dtype_layout):
                return True
    return False


def _floating_input(graph: SimplifiedGraph, block: Block) -> bool:
    if block.input_node is None:
        return False
    return all(o.dtype.is_floating_point for name in [block.input_node] + block.side_inputs
               for o in graph.node(name).outputs)


def _record_strides(node: SimplifiedNode, env, strides: dict[str, tuple[int, ...]]) -> None:
    for output in node.outputs:
        value = env.get(output.fx_name)
        if isinstance(value, torch.Tensor):
            strides[output.fx_name] = tuple(value.stride())


def _synthesize_input(graph: SimplifiedGraph, chain: Chain, block: Block, env, device,
                      strides: dict[str, tuple[int, ...]]) -> None:
    """Random values of the right shape, dtype and layout for the block's input and its views.

    The layout matters: an elementwise op on a transposed view returns a transposed tensor,
    and the next block's ops (a linear's or a layer norm's contiguous copy of its input)
    depend on it. It is the real one of the same tensor in the first block of the producing
    block's class (already run: the layouts of a block's results follow from its code and
    its input's layout), else the traced one (the export's meta functions, which may differ
    from the kernels': a CPU batch norm of a transposed input returns a contiguous result).
    """
    _synthesize_node(graph, chain, block.input_node, env, device, strides, block.index)


def _synthesize_node(graph: SimplifiedGraph, chain: Chain, name: str, env, device,
                     strides: dict[str, tuple[int, ...]], seed: int) -> None:
    """Random values for node ``name``'s results and views (:func:`_synthesize_input`)."""
    node = graph.node(name)
    twin = _twin(graph, chain, name)
    generator = torch.Generator(device=device).manual_seed(seed)
    traced = {line.name: line.meta.get("val") for line in node.lines}
    for i, output in enumerate(node.outputs):
        value = torch.randn(output.shape, dtype=output.dtype, device=device, generator=generator)
        stride = strides.get(twin.outputs[i].fx_name) if twin is not None and i < len(twin.outputs) else None
        if stride is None and isinstance(traced.get(output.fx_name), torch.Tensor):
            stride = tuple(int(s) for s in traced[output.fx_name].stride())
        if stride is not None and stride != tuple(value.stride()):
            strided = torch.empty_strided(output.shape, stride, dtype=output.dtype, device=device)
            value = strided.copy_(value)
        env[output.fx_name] = value
    _rebuild_views(node, env)


def _twin(graph: SimplifiedGraph, chain: Chain, name: str) -> SimplifiedNode | None:
    """Node ``name``'s counterpart in the first block of its block's class (itself there), whose
    results' real layouts stand for its own; None for a node of no block."""
    producer = next((b for b in chain.blocks if name in b.nodes), None)
    if producer is None:
        return None
    twin_block = chain.blocks[chain.classes[producer.class_index].representative]
    return graph.node(twin_block.nodes[producer.nodes.index(name)])


def _rebuild_views(node: SimplifiedNode, env) -> None:
    """Rebuild the views of the node's synthesized outputs (not its getitems); its in-place
    writes are not run again (the synthesized values stand for the written ones): their
    results are the tensors they write into."""
    outputs = {o.fx_name for o in node.outputs}
    for line in node.body:
        if line.name in outputs or (line.target is operator.getitem and line.args[0] is node.main):
            continue
        if any(arg.name not in env for arg in line.all_input_nodes):
            continue  # a view of another node's result that this node makes (read only inside it)
        kind = classify(line)
        if kind in (OpKind.VIEW, OpKind.GETITEM):
            run_lines([line], env)
        elif kind is OpKind.INPLACE and line.args[0].name in env:
            env[line.name] = env[line.args[0].name]


def _drop(node: SimplifiedNode, env) -> None:
    for line in node.lines:
        env.pop(line.name, None)


class _GradState:
    """Which parts of gradients the simulator holds (``solvers.simulate``'s rules).

    The temporary memory of a backward is what the run measured (until its engine call ends)
    above what the simulator adds for the gradients it produces, computed here with the
    simulator's own rules: every contribution (the first, the gradient's own, or one waiting to
    join a gradient alive) is new memory unless it is an alias of a part of the incoming
    gradient; the sums made when waiting contributions join are the simulator's flush.
    """

    def __init__(self) -> None:
        self.alive: set[tuple[str, int]] = set()

    def produce(self, part: tuple[str, int], size: int, alias: bool) -> int:
        """Record a contribution to ``part``; return the bytes the simulator adds for it."""
        self.alive.add(part)
        return 0 if alias else size

    def forget(self, node: str) -> None:
        self.alive = {p for p in self.alive if p[0] != node}


class GradLayout(NamedTuple):
    """How eager PyTorch's backward hands a tensor its gradient: the strides, and the bytes of
    the storage under it (more than the tensor's own where the gradient is a slice of a bigger
    one, a ``cat``'s backward: eager's buffer keeps the view, and so the whole storage)."""

    stride: tuple[int, ...]
    storage_bytes: int
    # the fraction of that storage this gradient counts: a node's gradients that are slices of
    # one storage (the pieces of a `chunk` read by a `cat`, whose backward slices its gradient)
    # count it once between them, each by its own bytes (:func:`node_layouts`)
    share: float = 1.0
    # where in that storage it starts (elements), and which of the node's shared storages it is
    # a slice of (-1: none): the inspection makes such gradients over one storage, as eager's
    offset: int = 0
    group: int = -1

    @classmethod
    def of(cls, grad: torch.Tensor) -> "GradLayout":
        return cls(tuple(grad.stride()), int(grad.untyped_storage().nbytes()), offset=int(grad.storage_offset()))


def node_layouts(parts: list[tuple[str, torch.Tensor]]) -> dict[str, GradLayout]:
    """The layouts of the gradients of one node's exported tensors (fx name, gradient): those
    that are slices of one bigger storage share it (:attr:`GradLayout.share`). Real or fake
    tensors: a storage is told by its identity."""
    own = {name: grad.numel() * grad.element_size() for name, grad in parts}
    slices: dict[int, list[str]] = {}
    for name, grad in parts:
        storage = grad.untyped_storage()
        if storage.nbytes() > own[name]:
            slices.setdefault(storage._cdata, []).append(name)
    layouts = {}
    for name, grad in parts:
        layout = GradLayout.of(grad)
        sharing = slices.get(grad.untyped_storage()._cdata, [])
        if len(sharing) > 1:
            group = list(slices).index(grad.untyped_storage()._cdata)
            layout = layout._replace(share=own[name] / sum(own[m] for m in sharing), group=group)
        layouts[name] = layout
    return layouts


def _output_gradient(leaf: torch.Tensor, layout: GradLayout | None,
                     shared: dict[int, torch.Tensor]) -> torch.Tensor:
    """A gradient for an output of the block, in the layout the executor will give it (a view
    of a bigger storage where eager's is; the node's gradients that are slices of one storage,
    the pieces of a ``cat``'s gradient, over one storage: ``shared``, by group, for one node)."""
    if layout is None:
        return torch.ones_like(leaf)
    count = max(layout.storage_bytes // leaf.element_size(), 1)
    storage = shared.get(layout.group) if layout.group >= 0 else None
    if storage is None:
        storage = torch.empty(count, dtype=leaf.dtype, device=leaf.device)
        if layout.group >= 0:
            shared[layout.group] = storage
    offset = layout.offset if layout.offset + _extent(leaf.shape, layout.stride) <= count else 0
    return storage.as_strided(leaf.shape, layout.stride, offset).fill_(1)


def _extent(shape, stride) -> int:
    """The elements a tensor of ``shape`` and ``stride`` spans from its first one."""
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride)) if all(shape) else 0


def _held_bytes(leaf: torch.Tensor, layout: GradLayout | None) -> int:
    """The bytes that ``leaf``'s gradient holds: its own, or the bigger storage it is a slice of."""
    own = leaf.numel() * leaf.element_size()
    return own if layout is None else max(own, round(layout.storage_bytes * layout.share))


def gradient_layouts(graph: SimplifiedGraph, model: nn.Module, sample, receivers: set[str] | None = None,
                     unreached: set[str] | None = None, on_meta: bool | None = None) -> dict[str, GradLayout] | None:
    """The layout (:class:`GradLayout`) of the gradient of every exported tensor in eager
    PyTorch's backward.

    The executor passes gradients between nodes as eager PyTorch would, in their layouts;
    a backward's temporary memory depends on the layout of the gradient it receives (a
    linear's backward copies a gradient that is not in its output's layout). Inside a block
    the inspection produces real gradients; a block's output gradients come from the next
    block: their layouts are found here, by one forward and backward of the whole graph on
    tensors without data, meta or fake ones (:func:`_fake_backward`: no memory, no computation,
    the ops' meta functions give the strides). The
    model's outputs receive contiguous gradients, as a loss's usually are. The tensors it lists are those that a
    backward from the outputs reaches. ``receivers`` (filled when given) gets those of them
    that receive a gradient from outside their node, as the executor's leaves do (a model
    output, or a tensor another node reads and passes a gradient back to), not only through a
    view made in the node (``SimplifiedGraph.gradient_receivers``): each read by another node
    goes through an ``alias`` that tells. None if the run fails (an op without a meta
    function). The backward runs from the outputs that the user's loss gives a gradient
    (``graph.gradient_outputs``); ``unreached`` (filled when given) gets the other outputs that
    it does not reach: a gradient the user gives them has no backward but theirs, which a plan
    counting none for them would not run, so they are taken to get one (a second backward
    from them here).
    """
    try:
        # (the reads' aliases pass each gradient on as it is: the layouts are those of a run
        # without them, checked on every graph of the test suite when they were two runs)
        found: set[str] | None = None if receivers is None else set()
        grads = _fake_backward(graph, model, sample, found, unreached, on_meta)
        record: dict[str, GradLayout] = {}
        for node in graph.nodes:
            record.update(node_layouts([(n, grads[n]) for n in graph.exported(node) if n in grads]))
        grads = None
        if receivers is not None:
            receivers.update(name for name in record if name in found)
    except Exception:  # noqa: BLE001 - an op without a meta function: layouts are not known
        return None
    return record


class _FactoriesOnMeta(TorchDispatchMode):
    """For a run on meta tensors of a model on the CPU: sends the tensors that ops create
    (``empty``, ``arange``, ``full``, a copy ``to`` a device: the ops given a ``device``) to the
    meta device; :meth:`attention` runs the attention as the CPU would."""

    def __init__(self) -> None:
        super().__init__()
        self.on_cpu = False  # (while the CPU's choice of an attention kernel is asked)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.on_cpu and kwargs.get("device") is not None and torch.device(kwargs["device"]).type != "meta":
            kwargs = dict(kwargs, device=torch.device("meta"))
        return func(*args, **kwargs)

    def attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                  enable_gqa=False):
        """``aten.scaled_dot_product_attention`` on meta tensors as on the CPU. Its composite
        chooses a kernel by the tensors' device (``_fused_sdp_choice``, in C++): on the meta device
        always the math composite, whose gradients' layouts are not those of the CPU's flash kernel.
        The CPU's choice is asked on uninitialized CPU tensors of the same geometries (it reads no
        data); for the flash kernel, the composite's CPU branch is run (ATen's ``attention.cpp``: a
        boolean mask made additive, then ``_scaled_dot_product_flash_attention_for_cpu``)."""
        sdpa = torch.ops.aten.scaled_dot_product_attention.default
        self.on_cpu = True
        try:
            shadows = tree_map(_on_cpu, (query, key, value, attn_mask))
            choice = torch.ops.aten._fused_sdp_choice.default(*shadows, dropout_p, is_causal, scale=scale,
                                                               enable_gqa=enable_gqa)
        finally:
            self.on_cpu = False
        if choice != int(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.where(attn_mask.logical_not(), torch.scalar_tensor(-float("inf"), dtype=query.dtype),
                                    torch.scalar_tensor(0.0, dtype=query.dtype))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


def _on_cpu(value):
    """An uninitialized CPU tensor of a meta tensor ``value``'s geometry and ``requires_grad``
    (other values as they are)."""
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype).requires_grad_(value.requires_grad)
    return value


def _on_meta(value: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``value``'s shape, strides, dtype and ``requires_grad``."""
    tensor = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return tensor.requires_grad_() if value.requires_grad else tensor


def _fake_backward(graph: SimplifiedGraph, model: nn.Module, sample, from_readers: set[str] | None = None,
                   unreached: set[str] | None = None, on_meta: bool | None = None):
    """One forward and backward of ``graph`` on tensors without data; returns the gradient of
    every exported tensor that gets one (kept to the end: their storages told apart). With
    ``from_readers``, each read of another node's tensor goes through an ``alias`` whose hook
    adds the tensor's name there when a gradient comes back from that read (the model's outputs
    are added too). The backward runs from the outputs that the loss gives a gradient, then from
    those of the others that it did not reach (``unreached``, filled when given), whose first
    gradient is kept where both reach.

    A model on the CPU runs on meta tensors (unless ``on_meta=False``): the ops' meta functions
    (those that fake tensors run) in C++ dispatch, 2.5x faster than fake tensors' Python dispatch
    (the 24-layer Llama of ``benchmarks/bench_planning.py``: 0.4 s instead of 1.0-1.3 s), the
    attention run as the CPU would (:meth:`_FactoriesOnMeta.attention`). On the 1565 graphs of the
    test suite, the same layouts as fake tensors' but on two, where only the stride of a dimension
    of size 1 differs and meta's is eager's (a ``view``: ``(10, 1, 10)``, fake tensors'
    ``(320, 1, 10)``). Elsewhere, or where the meta run fails (an op without a meta function, a
    ``.item()``; unless ``on_meta=True``), fake tensors of the model's own devices
    (:class:`torch._subclasses.fake_tensor.FakeTensorMode`), whose meta functions may depend on
    the device (a convolution's memory format on CUDA)."""
    env = initial_environment(graph, model, sample)
    on_cpu = all(value.device.type == "cpu" for value in env.values() if isinstance(value, torch.Tensor))
    if on_meta or (on_meta is None and on_cpu):
        readers: set[str] | None = None if from_readers is None else set()
        missed: set[str] | None = None if unreached is None else set()
        try:
            values = {key: _on_meta(value) if isinstance(value, torch.Tensor) else value for key, value in env.items()}
            mode = _FactoriesOnMeta()
            attention = {line.name: mode.attention for node in graph.nodes for line in node.lines
                         if line.target is torch.ops.aten.scaled_dot_product_attention.default}
            grads = _abstract_backward(graph, values, mode, readers, missed, attention)
        except Exception:  # noqa: BLE001 - an op that meta tensors cannot run: fake tensors below
            if on_meta:
                raise
            grads = None
        if grads is not None:
            if from_readers is not None:
                from_readers.update(readers)
            if unreached is not None:
                unreached.update(missed)
            return grads
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    fake: dict[str, object] = {}
    for key, value in env.items():
        if isinstance(value, torch.Tensor):
            tensor = mode.from_tensor(value)
            if value.requires_grad and not tensor.requires_grad:
                tensor.requires_grad_()
            fake[key] = tensor
        else:
            fake[key] = value
    del env
    return _abstract_backward(graph, fake, mode, from_readers, unreached)


def _abstract_backward(graph: SimplifiedGraph, values: dict[str, object], mode, from_readers: set[str] | None,
                       unreached: set[str] | None, targets: dict | None = None) -> dict[str, torch.Tensor]:
    """:func:`_fake_backward` on the environment ``values`` (tensors without data) inside ``mode``
    (``targets``: the functions some lines run instead of their own, :func:`rkgb.interpret.run_lines`)."""
    grads: dict[str, torch.Tensor] = {}
    with mode, torch.enable_grad():
        run_lines(graph.buffer_updates_prologue, values)
        for node in graph.nodes:
            originals = {}
            if from_readers is not None:
                for line in node.lines:
                    for arg in line.all_input_nodes:
                        value = values.get(arg.name)
                        if arg.name in originals or graph.owner.get(arg.name) in (None, node.name) \
                                or not isinstance(value, torch.Tensor) or not value.requires_grad:
                            continue
                        originals[arg.name] = value
                        values[arg.name] = torch.ops.aten.alias.default(value)
                        values[arg.name].register_hook(lambda g, name=arg.name: from_readers.add(name))
            run_lines(node.lines, values, targets)
            values.update(originals)
            for name in graph.exported(node):
                value = values[name]
                if isinstance(value, torch.Tensor) and value.requires_grad:
                    value.register_hook(lambda g, name=name: grads.setdefault(name, g))
        outputs = [n for n in graph.outputs if isinstance(values.get(n), torch.Tensor) and values[n].requires_grad]
        if from_readers is not None:
            # (every output may receive one: the executor's leaves let a loss that reads them pass it on)
            from_readers.update(outputs)
        exported = {name for node in graph.nodes for name in graph.exported(node)}
        for n in dict.fromkeys(outputs):
            if n not in exported:  # a model input (or a view of one) returned: reached too?
                values[n].register_hook(lambda g, name=n: grads.setdefault(name, g))
        others = [n for n in outputs if n in graph.outputs_without_gradient]
        _backward_with_ones(values, [n for n in outputs if n not in others], retain_graph=bool(others))
        missed = list(dict.fromkeys(n for n in others if n not in grads))
        if unreached is not None:
            unreached.update(missed)
        _backward_with_ones(values, missed)
    return grads


def _backward_with_ones(fake: dict, roots: list[str], retain_graph: bool = False) -> None:
    """A backward from the tensors ``roots`` (names in ``fake``), each given a contiguous gradient
    of ones: a loss's gradient is contiguous whatever the output's layout (a reshape of it,
    cross-entropy's), so a transposed output's backward gets a contiguous one."""
    if roots:
        ones = [torch.ones(fake[n].shape, dtype=fake[n].dtype, device=fake[n].device) for n in roots]
        torch.autograd.backward([fake[n] for n in roots], ones, retain_graph=retain_graph)


def _phantoms_in_recording(saved: SavedTensors, node: str, device: torch.device):
    """``(move, bytes)``: ``move()``, called first inside a recording, replaces the phantoms of
    ``node`` that hold their storage alone with copies, so that the recording sees them freed
    when the backward's autograd nodes that saved them have run (the executor's backward frees
    each then, as eager's engine does: :attr:`rkgb.saved.SavedTensors.consume`); ``bytes``
    (theirs) is to be taken off the recording's peak. The CPU allocator does not report the
    free of a block allocated before a recording; a phantom that shares its storage with
    another tensor is not copied: its free is not credited. On CUDA the allocator's figures see
    every free: nothing to copy."""
    if device.type != "cpu":
        return (lambda: None), 0
    by_storage: dict[int, dict[int, list]] = {}  # storage -> tensor -> its packs
    for packed in saved.phantom_packs(node):
        by_storage.setdefault(storage_key(packed.tensor), {}).setdefault(id(packed.tensor), []).append(packed)
    movable = [list(tensors.values()) for tensors in by_storage.values() if _phantoms_hold_alone(tensors)]
    moved = sum(storage_bytes(groups[0][0].tensor) for groups in movable)

    def move() -> None:
        for groups in movable:
            first = groups[0][0].tensor
            if len(groups) == 1:
                copies = [first.clone()]
            else:  # tensors over one storage (a chunk's pieces): one copy of it, the same geometries over the copy
                storage = first.untyped_storage().clone()
                copies = [torch.empty(0, dtype=g[0].tensor.dtype, device=device).set_(
                    storage, g[0].tensor.storage_offset(), g[0].tensor.size(), g[0].tensor.stride()) for g in groups]
            for group, copy in zip(groups, copies):
                for packed in group:
                    packed.tensor = copy

    return move, moved


def _phantoms_hold_alone(tensors: dict[int, list]) -> bool:
    """Whether the phantom tensors (``id -> packs``) over one storage are all that holds it:
    one dense tensor over all of it (:func:`owns_its_storage`), or several tensors over it (a
    GRU cell's ``unsafe_chunk`` pieces, a ``chunk``'s views) whose only other holders are their
    bases, that nothing else holds (the storage counts the tensors, their bases and the
    wrapper asked)."""
    values = [packs[0].tensor for packs in tensors.values()]
    if len(values) == 1:
        return owns_its_storage(values[0])
    bases = {id(t._base) for t in values if t._base is not None}
    if bases & set(tensors):  # a base saved with its views: not told apart
        return False
    return torch._C._storage_Use_Count(values[0].untyped_storage()._cdata) <= len(values) + len(bases) + 1


class _IncomingFreed:
    """Post-hooks on the autograd nodes of an island's backward that mark the moment
    (:meth:`_PeakMeter.mark`) the engine would free the incoming gradient if nothing but the
    engine held it (the executor hands it over, :func:`rkgb.gradsink.handoff_backward`): when
    the last tensor over its storage in the engine's buffers has been used (a view's or an add's
    backward passes it on: it lives on in their results). Where a tensor over that storage
    leaves the island (a leaf's gradient) or joins a sum, no mark: nothing is credited."""

    def __init__(self, meter: _PeakMeter, grad: torch.Tensor, root) -> None:
        self.meter = meter
        self.storage = grad.untyped_storage().data_ptr()
        self.in_flight = 1  # tensors over the storage waiting in the engine's buffers
        self.handles = [node.register_hook(self) for node in _graph_nodes(root)]

    def _over(self, tensors) -> int:
        return sum(1 for t in tensors if t is not None and t.untyped_storage().data_ptr() == self.storage)

    def __call__(self, grad_inputs, grad_outputs):
        used = self._over(grad_outputs)
        if used and self.in_flight > 0:
            self.in_flight += self._over(grad_inputs) - used
            if self.in_flight == 0:
                self.meter.mark()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _graph_nodes(root) -> list:
    """The autograd nodes reachable from ``root`` (an island's: it ends at leaves)."""
    seen, stack = {}, [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(seen.values())


def _sole_views(tensors: list[torch.Tensor]) -> bool:
    """Views of one storage (one slice of a ``cat``'s gradient, or several) that alone hold it
    besides their base: the engine frees the whole storage once it has used them all."""
    return all(t._base is not None for t in tensors) \
        and torch._C._storage_Use_Count(tensors[0].untyped_storage()._cdata) <= len(tensors) + 2


def _copied_storage_of(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` (one, or views of one storage) over one copy of their storage, made now."""
    if len(tensors) == 1:
        return [_copied_storage(tensors[0])]
    storage = tensors[0].untyped_storage().clone()
    return [torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.size(), t.stride())
            for t in tensors]


def _copied_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` over a copy of its whole storage (same values, geometry and layout), made now:
    a dense tensor is cloned, a view re-made over a copy of the storage it views."""
    if tensor._base is None:
        return tensor.clone()
    storage = tensor.untyped_storage().clone()
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        storage, tensor.storage_offset(), tensor.size(), tensor.stride())


class _IncomingParts:
    """The storages of the parts of a backward's incoming gradient (storage key -> part), to
    tell which gradients that the backward makes are aliases of them.

    A storage is known by its data pointer only while it is alive: the engine frees an incoming
    gradient once used, and the allocator may hand its address to the next tensor (a new
    gradient of the same size), which a bare pointer would take for an alias. Each entry keeps a
    weak reference to its storage (storages keep their Python object while alive) and counts
    only while that storage is; a sink resolves each contribution when it receives it
    (:meth:`recorder`), while both are alive."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[int, weakref.ref]] = {}

    def add(self, tensor: torch.Tensor, part: int) -> None:
        storage = tensor.untyped_storage()
        self._entries[storage.data_ptr()] = (part, weakref.ref(storage))

    def pop(self, tensor: torch.Tensor) -> int | None:
        """The part of ``tensor``'s storage, no longer recorded (None if it is none)."""
        part = self.part(tensor)
        if part >= 0:
            del self._entries[tensor.untyped_storage().data_ptr()]
        return None if part < 0 else part

    def part(self, tensor: torch.Tensor) -> int:
        """The part of the incoming gradient whose storage ``tensor`` shares, or -1."""
        storage = tensor.untyped_storage()
        entry = self._entries.get(storage.data_ptr())
        return entry[0] if entry is not None and entry[1]() is storage else -1

    def recorder(self) -> "_AliasRecorder":
        return _AliasRecorder(self)


def _storages_made(pending: list, part_of_sink: dict[int, tuple[str, int]], input_sinks: dict[str, GradSink],
                   incoming: _IncomingParts) -> dict[tuple, list[tuple[int, int, bool]]]:
    """The storages (an identity, their bytes, whether the contribution is all of it) of the
    contributions waiting in ``pending`` (:class:`rkgb.gradsink.GradientQueue`) that are not
    parts of the incoming gradient (``incoming``): new tensors of the backward, or views of one
    (the slices of a `cat`'s gradient). By (gradient, part) for the sinks of ``part_of_sink``
    (sink -> its gradient's part), by (model input, -1 - the index of the contribution in the
    order its sink takes them) for ``input_sinks``. Read while they wait: every one of them is
    alive, so that equal storages are one."""
    made: dict[tuple, list[tuple[int, int, bool]]] = {}
    inputs = {id(sink): name for name, sink in input_sinks.items()}
    by_input: dict[str, list] = {}
    for entry in pending:
        if entry[3] is not None:  # (a view group's contribution: summed apart)
            continue
        grad = entry[2]
        # (whole: the storage's one dense tensor itself, not a view of part of it)
        whole = non_overlapping_and_dense(grad) and \
            grad.numel() * grad.element_size() == grad.untyped_storage().nbytes()
        storage = (-1, 0, False) if incoming.part(grad) >= 0 else \
            (grad.untyped_storage()._cdata, storage_bytes(grad), whole)
        where = part_of_sink.get(id(entry[1]))
        if where is not None:
            made.setdefault(where, []).append(storage)
        elif id(entry[1]) in inputs:
            by_input.setdefault(inputs[id(entry[1])], []).append((entry[0], storage))
    for name, entries in by_input.items():
        if all(rank is not None for rank, _ in entries):  # (the order the queue hands them over)
            entries.sort(key=lambda entry: entry[0])
        for k, (_, storage) in enumerate(entries):
            made[(name, -1 - k)] = [storage]
    return {where: storages for where, storages in made.items() if all(s[0] != -1 for s in storages)}


def _shared_storages(made: dict[tuple, list[tuple[int, int, bool]]], single: set[tuple[str, int]]
                     ) -> tuple[dict[tuple, int], list[tuple[int, bool]]]:
    """The groups of the contributions of :func:`_storages_made` that share one storage: the
    gradients' parts (and model inputs' contributions) whose one contribution is a view of a
    storage that another part's is too, at least one of them a gradient's part (``single``: the
    parts with one contribution). Returns (part -> group, (bytes, every member whole) of each
    group's storage)."""
    members: dict[int, list[tuple]] = {}
    storage: dict[int, tuple[int, bool]] = {}
    for where, storages in made.items():
        if len(storages) != 1 or (where[1] >= 0 and where not in single):
            continue  # (a part with several contributions)
        key, size, whole = storages[0]
        members.setdefault(key, []).append(where)
        storage[key] = (size, whole and storage.get(key, (0, True))[1])
    together: dict[tuple, int] = {}
    groups: list[tuple[int, bool]] = []
    for key, group in members.items():
        if len(group) > 1 and any(i >= 0 for _, i in group):
            together.update((member, len(groups)) for member in group)
            groups.append(storage[key])
    return together, groups


class _AliasRecorder(list):
    """A sink's ``keys`` (:class:`rkgb.gradsink.GradSink`) during the inspection: for each
    contribution, the part of the incoming gradient it is an alias of, or -1, resolved when the
    sink receives it."""

    def __init__(self, incoming: _IncomingParts) -> None:
        super().__init__()
        self.incoming = incoming
        self.owned: list[bool] = []  # each contribution a dense tensor over a storage of its own

    def record(self, grad: torch.Tensor) -> None:
        self.append(self.incoming.part(grad))
        self.owned.append(grad._base is None and grad.numel() * grad.element_size() == grad.untyped_storage().nbytes()
                          and non_overlapping_and_dense(grad))


def _measure_handoff(meter, island: list[torch.Tensor], leaves: list[torch.Tensor], incoming: _IncomingParts,
                     phantoms=((lambda: None), 0)) -> int:
    """The peak of an island's backward from several outputs, run as the executor runs it
    (:func:`rkgb.gradsink.handoff_backward`: the engine alone holds the incoming gradients and
    frees each once used), above what was allocated before it.

    The CPU allocator does not report the free of a block allocated before a recording starts,
    so each incoming gradient that the executor's engine can free is first copied inside the
    recording (the same values and layout: a dense tensor holding its storage alone, or a view
    that alone holds its storage, re-made over a copy of all of it), whose free is seen, and its
    bytes are taken off the peak; views of one storage that the incoming gradients alone hold (the
    slices of one ``cat``'s gradient) share one copy. A storage that other tensors hold too is not
    copied: its free is not credited. ``incoming`` (:class:`_IncomingParts`) follows the copies."""
    root = handoff(*island)
    on_cpu = island[0].device.type == "cpu"  # (CUDA's figures see every free: nothing to copy)
    by_storage: dict[int, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if on_cpu and leaf.grad is not None:
            by_storage.setdefault(storage_key(leaf.grad), []).append(i)
    copied = [group for group in by_storage.values() if _sole_views([leaves[i].grad for i in group])
              or (len(group) == 1 and owns_its_storage(leaves[group[0]].grad))]
    copied_bytes = sum(storage_bytes(leaves[group[0]].grad) for group in copied)

    move, moved = phantoms

    def run():
        move()
        for group in copied:
            parts = [incoming.pop(leaves[i].grad) for i in group]
            for i, copy in zip(group, _copied_storage_of([leaves[i].grad for i in group])):
                leaves[i].grad = copy
            for i, part in zip(group, parts):
                if part is not None:
                    incoming.add(leaves[i].grad, part)
            copy = None  # the leaves alone hold the copies, which the engine frees once used
        handoff_backward(root, tuple(leaves))

    return meter.measure(run) - copied_bytes - moved


def _inspect_block(graph, block: Block, outer_env, model, clock, device, class_index, layouts, needs,
                   input_sinks: dict[str, GradSink], queue: GradientQueue,
                   strides: dict[str, tuple[int, ...]],
                   received: dict[str, GradLayout] | None = None, given: set[str] = frozenset()) -> BlockMeasure:
    """Run one block node by node exactly as the executor runs it, and measure each node.

    Each node is an autograd island over all its lines; the tensors other nodes read (its
    *exported* tensors, :meth:`SimplifiedGraph.exported`) become detached leaves whose
    gradients a :class:`GradSink` collects, and the node's backward is a backward from the
    island's exported outputs with those gradients (outputs without a gradient are skipped).
    """
    anonymous = {real: anon for anon, real in block.anonymous_names().items()}
    saved = SavedTensors()
    global_names = graph.global_names()
    globals_ = [v for k, v in outer_env.items() if isinstance(v, torch.Tensor) and k in global_names]
    saved.register_globals(globals_)
    # the leaves outside the block that receive gradients: parameters and inputs that require grad;
    # an input's gradient is the step's first-run memory (rkgb.build.first_run_bytes), not a
    # backward's temporary
    params = [v for v in globals_ if v.requires_grad and v.is_leaf]
    input_leaves = [sink.leaf for sink in input_sinks.values()]
    env = dict(outer_env)
    leaves: dict[str, list[torch.Tensor]] = {}
    # the leaves that require grad, with their sinks: the parts of the node's gradient
    grad_leaves: dict[str, list[tuple[torch.Tensor, GradSink]]] = {}
    grad_names: dict[str, list[str]] = {}
    islands: dict[str, list[torch.Tensor]] = {}
    sink_of: dict[str, GradSink] = dict(input_sinks)  # fx name of a leaf -> its sink
    aliases: dict[str, list[torch.Tensor]] = {}  # island -> its per-read aliases (GradientQueue)
    position = {n.name: i for i, n in enumerate(graph.captured.graph.nodes)}
    read_by_one = graph.results_read_by_one_node()
    state = _GradState()

    def make_leaves(node: SimplifiedNode, names: list[str], values: list[torch.Tensor]) -> None:
        made, parts, part_names = [], [], []
        for fx_name, value in zip(names, values):
            leaf = value.detach()
            if needs[node.name].exported.get(fx_name, False):
                leaf.requires_grad_()
                parts.append((leaf, GradSink(leaf, queue)))
                part_names.append(fx_name)
            env[fx_name] = leaf
            made.append(leaf)
        sink_of.update({fx_name: sink for fx_name, (_, sink) in zip(part_names, parts)})
        leaves[node.name] = made
        grad_leaves[node.name] = parts
        grad_names[node.name] = part_names
        saved.register_data(node.name, made)

    def part_sizes(name: str) -> list[int]:
        """The parts of ``name``'s gradient. One that crosses the block's boundary (its input's,
        its outputs') counts the storage it holds, a bigger one where it is a slice (the chain's
        figures cannot share a storage between blocks, see ``rkgb.build._drop_lasting_aliases``);
        inside the block, such a slice is an alias of the gradient it is cut from."""
        crossing = name == block.input_node or name in block.output_nodes or name in block.side_inputs
        return [_held_bytes(leaf, layouts.get(fx_name) if crossing else None)
                for (leaf, _), fx_name in zip(grad_leaves.get(name, []), grad_names.get(name, []))]

    input_bytes, input_requires_grad, input_grad_parts = 0, False, []
    grad_parts_of: dict[str, list[int]] = {}  # the gradient parts of each node, as measured so far
    if block.input_node is not None:
        input_node = graph.node(block.input_node)
        names = graph.exported(input_node)
        make_leaves(input_node, names, [outer_env[n] for n in names])
        input_bytes = sum(o.size_bytes for o in input_node.outputs)
        input_requires_grad = bool(grad_leaves[input_node.name])
        input_grad_parts = part_sizes(input_node.name)
        grad_parts_of[input_node.name] = input_grad_parts
    side_measures = []
    for index, side in enumerate(block.side_inputs):
        side_node = graph.node(side)
        names = graph.exported(side_node)
        make_leaves(side_node, names, [outer_env[n] for n in names])
        grad_parts_of[side] = part_sizes(side)
        side_measures.append(SideInputMeasure(side_name(index), sum(o.size_bytes for o in side_node.outputs),
                                              bool(grad_leaves[side]), grad_parts_of[side]))

    results: list[NodeMeasure] = []
    with _PeakMeter(device) as meter:
        for name in block.nodes:
            node = graph.node(name)
            lines = node.lines
            exported = graph.exported(node)
            result: dict[str, object] = {}
            requires_grad = needs[name].requires_grad  # else it runs without grad, as the executor's
            # batch norms that eager's op runs in place; recurrent ops run with grad, as the
            # executor's forwards without grad run them (rkgb.interpret.in_grad_mode)
            targets = inspected_targets(graph, node, requires_grad)

            def forward_no_grad():
                scratch = dict(env)
                with torch.no_grad():
                    run_lines(lines, scratch, targets)

            no_grad_peak = meter.measure(forward_no_grad)

            def forward_with_grad():
                with saved.island(name), torch.set_grad_enabled(requires_grad):
                    aliases[name] = run_island_lines([line for line in lines if line.name not in given], env,
                                                     sink_of, queue, position, targets,
                                                     {fx for fx, reader in read_by_one.items() if reader == name})
                values = [env[n] for n in exported]
                saved.finish_island(name, values)
                result["exported"] = values
                result["outputs"] = _outputs_of(node, env)
                for line in lines:  # the executor keeps only the exported tensors (as leaves)
                    if line.name not in given:  # (a view summed at its size: every reader's leaf)
                        env.pop(line.name, None)

            peak, retained = meter.measure_retained(forward_with_grad)
            for value, output in zip(result["outputs"], node.outputs):
                strides[output.fx_name] = tuple(value.stride())
            values = result["exported"]
            # (a reshape that had to copy, see rkgb.capture.views_as_reshapes, holds its own)
            data_bytes = _storage_bytes(result["outputs"] + values)
            # and what the island's graph keeps without the saved-tensor hooks: a Python number
            # that an op wraps into a tensor and saves (``x * 0.044715``: 8 bytes on CPU, freed
            # with the autograd node), as eager's graph keeps it
            phantom_bytes = max(saved.phantom_bytes(name), retained - data_bytes)

            # (warmed: the node has just run twice, without and with grad, for its memory; that
            # run with grad is not its time: under the island's hooks, GPT-2 small's loss took
            # 0.224 s there once, 0.102 s in the rerun)
            forward_time = clock(_rerun(lines, env, requires_grad, targets), data_bytes, warmed=True)
            islands[name] = [t for t, out in zip(values, exported) if needs[name].exported[out]]
            make_leaves(node, exported, values)
            values = None
            result.clear()
            measure = NodeMeasure(
                name=anonymous[name],
                data_bytes=data_bytes,
                grad_parts=part_sizes(name) if requires_grad else [],
                phantom_bytes=phantom_bytes if requires_grad else 0,
                requires_grad=requires_grad,
                forward_overhead_bytes=max(0, peak - data_bytes - phantom_bytes),
                no_grad_overhead_bytes=max(0, no_grad_peak - data_bytes),
                forward_time_s=forward_time,
                data_deps=[anonymous[d] for d in node.data_deps],
                is_random=node.is_random,
            )
            results.append(measure)
            grad_parts_of[name] = measure.grad_parts

        # the loss: gradients of the block's outputs, for the tensors that a node after the
        # block reads or the model returns (a view read only inside the block gets its
        # gradient from its readers there, as in the executor)
        outside = {arg.name for node in graph.nodes if node.name not in block.nodes
                   for line in node.lines for arg in line.all_input_nodes} | set(graph.gradient_outputs)
        output_parts: dict[str, list[int]] = {}
        for name in block.output_nodes:
            names = grad_names.get(name, [])
            given = [i for i, fx_name in enumerate(names) if fx_name in outside]
            if not given and any(fx_name in graph.outputs_without_gradient for fx_name in names):
                output_parts[anonymous[name]] = []  # returned, but the loss gives it no gradient
            elif given and len(given) < len(names):
                output_parts[anonymous[name]] = given
            else:
                given = list(range(len(names)))
            shared: dict[int, torch.Tensor] = {}
            for i in given:
                leaf = grad_leaves[name][i][0]
                leaf.grad = _output_gradient(leaf, layouts.get(names[i]), shared)
                state.produce((name, i), 0, False)
            shared = None

        for measure, name in reversed(list(zip(results, block.nodes))):
            node = graph.node(name)
            if not measure.requires_grad:
                continue
            pairs = [(t, leaf.grad) for t, (leaf, _) in zip(islands[name], grad_leaves[name]) if leaf.grad is not None]
            outputs = [t for t, _ in pairs]
            grads = [g for _, g in pairs]
            # the storage of each part of the incoming gradient
            incoming = _IncomingParts()
            for j, (leaf, _) in enumerate(grad_leaves[name]):
                if leaf.grad is not None:
                    incoming.add(leaf.grad, j)
            targets = [d for d in node.data_deps if grad_leaves.get(d)]
            dep_leaves = [leaf for d in targets for leaf, _ in grad_leaves[d]]
            calls = {d: [sink.calls for _, sink in grad_leaves[d]] for d in targets}
            for d in targets:
                for _, sink in grad_leaves[d]:
                    sink.keys = incoming.recorder()  # which contributions are aliases of the incoming gradient
            new_grad_bytes = _storage_bytes([t for t in dep_leaves if t.grad is None])
            reads = sorted(saved.references_of(name))
            measure.backward_reads = [anonymous[r] for r in reads if r in anonymous]
            measure.backward_shapes = [anonymous[d] for d in node.data_deps if d not in reads]
            measure.grads_to = [anonymous[d] for d in targets]
            inputs = dep_leaves + aliases.pop(name, []) + params
            if outputs:
                measure.backward_ran = True
                saved.consume = False  # the timings keep the graph (and so the phantoms)
                measure.backward_time_s = clock(
                    lambda: torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True),
                    measure.data_bytes + new_grad_bytes,
                )
                saved.consume = True
                box = {"grads": grads}
                grads = pairs = None
                for leaf in input_leaves:
                    leaf.grad = None
                for sink in input_sinks.values():
                    sink.keys = incoming.recorder()  # the same for the contributions to the inputs
                # as the executor: the engine runs, the incoming gradient and the phantoms go,
                # then the contributions join the next gradients (the simulator's flush: not a
                # temporary of this backward)
                move_phantoms, moved = _phantoms_in_recording(saved, name, device)
                handed = None  # the peak where the engine alone holds the incoming gradient
                if len(islands[name]) > 1:  # several outputs: as the executor, rkgb.gradsink.handoff
                    box.clear()
                    peak = _measure_handoff(meter, islands[name], [leaf for leaf, _ in grad_leaves[name]], incoming,
                                            (move_phantoms, moved))
                else:
                    # the executor hands the incoming gradient over to the engine (one output
                    # too, rkgb.gradsink.handoff), which frees it once used, where no other
                    # tensor holds it; measured here held, with the moment it would be freed
                    # marked: the figure handed off is the peak before it, or the peak after it
                    # less that gradient
                    incoming_grad = box["grads"][0]
                    credit = storage_bytes(incoming_grad) \
                        if owns_its_storage(incoming_grad) or _sole_views([incoming_grad]) else 0
                    root = outputs[0].grad_fn if credit else None
                    hook = None if root is None else _IncomingFreed(meter, incoming_grad, root)
                    incoming_grad = root = None

                    def run_backward():
                        move_phantoms()
                        torch.autograd.backward(outputs, box.pop("grads"))

                    try:
                        peak, after = meter.measure_marked(run_backward)
                    finally:
                        if hook is not None:
                            hook.remove()
                    hook = None
                    if after is not None:
                        peak, handed = max(peak, after), max(peak, after - credit) - moved
                    peak -= moved
                move_phantoms = None
                # the contributions to the inputs' gradients that the engine call made are
                # first-run memory (the simulator counts each, but those that are the incoming
                # gradient): not a temporary of this backward
                sinks = {id(sink) for sink in input_sinks.values()}
                # (by the storages' identities of _storages_made: those that a gradient's part
                # shares are counted with that part's, below, and given back there)
                first_run_storages = {entry[2].untyped_storage()._cdata: storage_bytes(entry[2])
                                      for entry in queue.pending
                                      if id(entry[1]) in sinks and incoming.part(entry[2]) < 0}
                peak -= sum(first_run_storages.values())
                if handed is not None:
                    handed -= sum(first_run_storages.values())
                for leaf in leaves[name]:
                    leaf.grad = None
                saved.free_phantoms(name)
                made_in = _storages_made(queue.pending, {id(sink): (d, i) for d in targets
                                                          for i, (_, sink) in enumerate(grad_leaves[d])},
                                         input_sinks, incoming)
                queue.flush()
                for fx_name, sink in input_sinks.items():
                    if sink.keys:
                        measure.input_grad_aliases[fx_name] = list(sink.keys)
                        measure.input_grad_owned[fx_name] = list(sink.keys.owned)
                    sink.keys = None
                for leaf in input_leaves:
                    leaf.grad = None
            else:
                peak, handed = 0, None
                made_in, first_run_storages = {}, {}
            added = 0
            together, group_storages = _shared_storages(
                made_in, {(d, i) for d in targets for i, (_, sink) in enumerate(grad_leaves[d])
                          if sink.calls - calls[d][i] == 1})
            # a model input's contribution that is (a view of) a storage a gradient's part is too
            # (an add's gradient passed on to a parameter's expanded view and to a mul): counted
            # once, as that group's storage (the simulator's FirstRun.together), not also taken
            # off the peak as first-run memory (fuzz seed 137: the slices' backward's second
            # input-sized tensor was left out, 665 B over the budget)
            shared_first_runs = {made_in[member][0][0] for member in together if member[1] < 0}
            refund = sum(size for key, size in first_run_storages.items() if key in shared_first_runs)
            peak += refund
            if handed is not None:
                handed += refund
            for (input_name, k), group in together.items():
                if k < 0:  # (a model input's contribution: rkgb.cdgraph.FirstRun.together)
                    groups = measure.input_grad_together.setdefault(input_name, [])
                    groups.extend([-1] * (-k - len(groups)))
                    groups[-1 - k] = group
            counted: set[int] = set()
            for d in targets:
                sizes = grad_parts_of[d]
                contributed, sources, shared, owned = [], [], [], []
                each: list[int] = []  # the source of each contribution (aligned with contributed)
                mixed = False  # a part whose contributions are of both kinds
                for i, (leaf, sink) in enumerate(grad_leaves[d]):
                    count = sink.calls - calls[d][i]  # several: a node reading the part twice
                    # the part of the incoming gradient that every contribution is (an add's
                    # backward passes it on to each read), or -1
                    keys, sink.keys = list(sink.keys), None
                    kinds = set(keys)
                    source = next(iter(kinds)) if len(kinds) == 1 else -1
                    if count > 1 and len(keys) == count and len(kinds) > 1:
                        mixed = True  # (`h - h`: the first read's gradient is the incoming one)
                    else:
                        keys = [source] * count
                    group = together.get((d, i), -1)
                    if group >= 0:  # its storage counted once, for the group
                        added += 0 if group in counted else group_storages[group][0]
                        counted.add(group)
                        state.produce((d, i), 0, True)
                        contributed.append(i)
                        each.append(source)
                        sources.append(source)
                        if calls[d][i] == 0 and sink.first_shared:
                            shared.append(i)
                        continue
                    if count == 1 and source < 0 and sink.last_bytes > sizes[i]:
                        # a slice of a bigger tensor made inside this backward (the gradient of
                        # a `cat` of several nodes' results): it holds all of it, as eager's
                        # buffer does; counted so (over-counts where the other slices go first)
                        sizes[i] = sink.last_bytes
                    if count and calls[d][i] == 0 and sink.first_shared:
                        shared.append(i)
                        if sink.first_owned:
                            owned.append(i)
                    for key in keys:
                        contributed.append(i)
                        each.append(key)
                        added += state.produce((d, i), sizes[i], key >= 0)
                    sources.append(source)
                if contributed != list(range(len(sizes))):
                    measure.grad_contributions[anonymous[d]] = contributed
                if mixed:
                    measure.grad_contribution_aliases[anonymous[d]] = each
                if any(j >= 0 for j in sources):
                    measure.grad_aliases[anonymous[d]] = sources
                if shared:
                    measure.grad_shared[anonymous[d]] = shared
                if owned:
                    measure.grad_owned[anonymous[d]] = owned
                if any((d, i) in together for i in range(len(sizes))):
                    measure.grad_together[anonymous[d]] = [together.get((d, i), -1) for i in range(len(sizes))]
            measure.together_storages = group_storages
            measure.backward_overhead_bytes = max(0, peak - added)
            if handed is not None and handed < peak:
                measure.handoff_overhead_bytes = handed - added
            outputs = grads = pairs = incoming = None  # release the incoming gradients
            for leaf in leaves[name]:
                leaf.grad = None
            state.forget(name)
            islands[name] = []
            saved.free_phantoms(name)
    if received is not None and block.input_node is not None:
        received.update(node_layouts([
            (fx_name, leaf.grad)
            for (leaf, _), fx_name in zip(grad_leaves.get(block.input_node, []), grad_names.get(block.input_node, []))
            if leaf.grad is not None]))
    return BlockMeasure(
        class_index=class_index,
        nodes=results,
        input_bytes=input_bytes,
        input_grad_parts=input_grad_parts,
        input_requires_grad=input_requires_grad,
        outputs=[anonymous[n] for n in block.output_nodes],
        output_parts=output_parts,
        has_input=block.input_node is not None,
        side_inputs=side_measures,
    )


def run_island_lines(lines, env, sinks: dict[str, GradSink], queue: GradientQueue, position: dict[str, int],
                     targets: dict | None = None, read_alone: frozenset[str] | set[str] = frozenset()
                     ) -> list[torch.Tensor]:
    """Run an island's lines as the executor does (:func:`exec.codegen`): each read of a leaf
    that the island reads more than once goes through its own alias
    (:class:`rkgb.gradsink.GradientQueue`), but for the leaves in ``read_alone``, which no other
    island reads (``SimplifiedGraph.results_read_by_one_node``); ``targets``: functions called
    instead of some lines' own (:func:`rkgb.interpret.inspected_targets`). Returns the aliases
    made."""
    reads: dict[str, int] = {}
    for line in lines:
        for arg in tensor_args(line):
            reads[arg.name] = reads.get(arg.name, 0) + 1
    own = {line.name for line in lines}
    split = {name for name, count in reads.items()
             if count > 1 and name in sinks and name not in own and name not in read_alone}
    made: list[torch.Tensor] = []
    for line in lines:
        index = iter(range(1 << 30))

        def fetch(arg, line=line, index=index):
            k = next(index)
            if arg.name not in split:
                return env[arg.name]
            alias = queue.alias(env[arg.name], sinks[arg.name], (-position[line.name], k))
            made.append(alias)
            return alias

        args, kwargs = torch.fx.node.map_arg((line.args, line.kwargs), fetch)
        target = targets.get(line.name) if targets else None
        env[line.name] = (target or eager_target(line.target))(*args, **kwargs)
    queue.release()
    return made


def _rerun(lines, env, with_grad: bool, targets: dict | None = None):
    """A function that runs ``lines`` again on a copy of ``env`` (for timing)."""

    def run():
        with torch.set_grad_enabled(with_grad):
            run_lines(lines, dict(env), targets)

    return run
