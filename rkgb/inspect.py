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
- forward and backward times: the median of repeats (CUDA events on GPU), or a deterministic
  cost model from FLOPs and bytes (``cost_model="flops"``) for reproducible tests.
"""

from __future__ import annotations

import operator
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from .blocks import Block, Chain
from .interpret import initial_environment, run_lines
from .memory import AllocationTracker
from .saved import SavedTensors
from .simplify import SimplifiedGraph, SimplifiedNode

__all__ = ["NodeMeasure", "BlockMeasure", "inspect_chain", "COST_MODELS"]

COST_MODELS = ("measured", "flops")

# the deterministic cost model: a machine doing 1e11 FLOP/s and moving 1e10 bytes/s
_FLOPS_PER_S = 1e11
_BYTES_PER_S = 1e10


@dataclass
class NodeMeasure:
    """What one simplified node costs (anonymized name ``n3`` inside its class)."""

    name: str
    data_bytes: int
    phantom_bytes: int = 0
    requires_grad: bool = False
    forward_overhead_bytes: int = 0
    backward_overhead_bytes: int = 0
    forward_time_s: float = 0.0
    backward_time_s: float = 0.0
    backward_reads: list[str] = field(default_factory=list)  # nodes whose data bwd needs
    backward_shapes: list[str] = field(default_factory=list)  # deps whose shape only bwd needs
    grads_to: list[str] = field(default_factory=list)  # deps that receive a gradient
    data_deps: list[str] = field(default_factory=list)
    is_random: bool = False


@dataclass
class BlockMeasure:
    """Measures of one class, in anonymized names (``in`` for the block's input)."""

    class_index: int
    nodes: list[NodeMeasure]
    input_bytes: int
    input_requires_grad: bool
    outputs: list[str]
    has_input: bool


class _Clock:
    """Wall-clock timing (CUDA events on GPU) or the deterministic FLOP/byte model."""

    def __init__(self, cost_model: str, device: torch.device, repeats: int) -> None:
        if cost_model not in COST_MODELS:
            raise ValueError(f"cost_model must be one of {COST_MODELS}, got {cost_model!r}")
        self.cost_model = cost_model
        self.device = device
        self.repeats = repeats

    def __call__(self, fn, bytes_moved: int) -> float:
        if self.cost_model == "flops":
            from torch.utils.flop_counter import FlopCounterMode

            with FlopCounterMode(display=False) as counter:
                fn()
            return counter.get_total_flops() / _FLOPS_PER_S + bytes_moved / _BYTES_PER_S
        samples = []
        for _ in range(self.repeats):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) / 1000)
            else:
                begin = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - begin)
        return statistics.median(samples)


class _PeakMeter:
    """Peak of allocated bytes while a function runs, above what was allocated before."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tracker = AllocationTracker() if device.type != "cuda" else None

    def __enter__(self):
        if self.tracker is not None:
            self.tracker.__enter__()
        return self

    def __exit__(self, *exc):
        if self.tracker is not None:
            self.tracker.__exit__(*exc)

    def measure(self, fn) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - before
        before = self.tracker.current_bytes
        self.tracker.reset_peak()
        fn()
        return self.tracker.peak_bytes - before


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _outputs_of(node: SimplifiedNode, env) -> list[torch.Tensor]:
    return [env[o.fx_name] for o in node.outputs]


def _device_of(model: nn.Module) -> torch.device:
    for value in list(model.parameters()) + list(model.buffers()):
        return value.device
    return torch.device("cpu")


def inspect_chain(
    graph: SimplifiedGraph,
    chain: Chain,
    model: nn.Module,
    sample,
    cost_model: str = "measured",
    repeats: int = 3,
) -> list[BlockMeasure]:
    """Measure the representative block of every class; returns one BlockMeasure per class.

    The model's parameters, buffers, gradients and the global RNG state are left as found.
    """
    device = _device_of(model)
    clock = _Clock(cost_model, device, repeats)
    representatives = {cls.representative: cls.index for cls in chain.classes}
    position = {node.name: i for i, node in enumerate(graph.nodes)}
    last_use: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        for dep in node.data_deps:
            last_use[dep] = i
    for block in chain.blocks:
        if block.index in representatives and block.input_node is not None:
            last_use[block.input_node] = max(last_use.get(block.input_node, 0), position[block.nodes[-1]])

    saved_grads = {p: p.grad for p in model.parameters()}
    measures: dict[int, BlockMeasure] = {}
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            env = initial_environment(graph, model, sample)
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)  # as after a first step: not counted
                next_node = 0
                for block in chain.blocks:
                    if block.index in representatives:
                        measures[representatives[block.index]] = _inspect_block(
                            graph, block, env, model, clock, device, representatives[block.index]
                        )
                    remaining = [b for b in chain.blocks[block.index + 1 :] if b.index in representatives]
                    if all(_floating_input(graph, b) for b in remaining):
                        # the rest only needs inputs of the right shape: skip the forward of
                        # the repeated blocks, so that inspection does not grow with depth
                        for later in remaining:
                            _synthesize_input(graph, later, env, device)
                            measures[representatives[later.index]] = _inspect_block(
                                graph, later, env, model, clock, device, representatives[later.index]
                            )
                        break
                    for name in block.nodes:
                        run_lines(graph.node(name).lines, env)
                        next_node += 1
                        for dep in graph.node(name).data_deps:
                            if last_use.get(dep, -1) <= next_node - 1:
                                _drop(graph.node(dep), env)
    finally:
        for p, grad in saved_grads.items():
            p.grad = grad
    return [measures[i] for i in range(len(chain.classes))]


def _floating_input(graph: SimplifiedGraph, block: Block) -> bool:
    if block.input_node is None:
        return False
    return all(o.dtype.is_floating_point for o in graph.node(block.input_node).outputs)


def _synthesize_input(graph: SimplifiedGraph, block: Block, env, device) -> None:
    """Random values of the right shape and dtype for the block's input and its views."""
    node = graph.node(block.input_node)
    generator = torch.Generator(device=device).manual_seed(block.index)
    for output in node.outputs:
        env[output.fx_name] = torch.randn(output.shape, dtype=output.dtype, device=device, generator=generator)
    run_lines(_view_lines(node), env)


def _view_lines(node: SimplifiedNode) -> list:
    """The body lines that rebuild views from the node's outputs (not its getitems)."""
    outputs = {o.fx_name for o in node.outputs}
    return [
        line
        for line in node.body
        if line.name not in outputs and not (line.target is operator.getitem and line.args[0] is node.main)
    ]


def _drop(node: SimplifiedNode, env) -> None:
    for line in node.lines:
        env.pop(line.name, None)


def _inspect_block(graph, block: Block, outer_env, model, clock, device, class_index) -> BlockMeasure:
    anonymous = {real: anon for anon, real in block.anonymous_names().items()}
    saved = SavedTensors()
    global_names = graph.global_names()
    globals_ = [v for k, v in outer_env.items() if isinstance(v, torch.Tensor) and k in global_names]
    saved.register_globals(globals_)
    params = [p for p in model.parameters() if p.requires_grad]
    env = dict(outer_env)
    leaves: dict[str, list[torch.Tensor]] = {}
    islands: dict[str, list[torch.Tensor]] = {}

    def make_leaves(node: SimplifiedNode, values: list[torch.Tensor]) -> None:
        made = []
        for output, value in zip(node.outputs, values):
            leaf = value.detach()
            if value.requires_grad or (value.dtype.is_floating_point and node.name == block.input_node):
                leaf.requires_grad_()
            env[output.fx_name] = leaf
            made.append(leaf)
        leaves[node.name] = made
        saved.register_data(node.name, made)
        with torch.enable_grad():
            run_lines(_view_lines(node), env)

    input_bytes, input_requires_grad = 0, False
    if block.input_node is not None:
        input_node = graph.node(block.input_node)
        make_leaves(input_node, _outputs_of(input_node, outer_env))
        input_bytes = sum(o.size_bytes for o in input_node.outputs)
        input_requires_grad = any(t.requires_grad for t in leaves[input_node.name])

    results: list[NodeMeasure] = []
    with _PeakMeter(device) as meter:
        for name in block.nodes:
            node = graph.node(name)
            forward_lines = node.prelude + [node.main] + [
                line for line in node.body if line.name in {o.fx_name for o in node.outputs}
            ]
            result: dict[str, object] = {}

            def forward_with_grad():
                with saved.island(name), torch.enable_grad():
                    run_lines(forward_lines, env)
                outputs = _outputs_of(node, env)
                saved.finish_island(name, outputs)
                result["outputs"] = outputs

            peak = meter.measure(forward_with_grad)
            outputs = result["outputs"]
            data_bytes = _storage_bytes(outputs)
            phantom_bytes = saved.phantom_bytes(name)
            requires_grad = any(t.requires_grad for t in outputs)

            forward_time = clock(_rerun(forward_lines, env, requires_grad), data_bytes)
            islands[name] = outputs
            make_leaves(node, outputs)
            measure = NodeMeasure(
                name=anonymous[name],
                data_bytes=data_bytes,
                phantom_bytes=phantom_bytes if requires_grad else 0,
                requires_grad=requires_grad,
                forward_overhead_bytes=max(0, peak - data_bytes - phantom_bytes),
                forward_time_s=forward_time,
                data_deps=[anonymous[d] for d in node.data_deps],
                is_random=node.is_random,
            )
            results.append(measure)

        # the loss: gradients of the block's outputs
        for name in block.output_nodes:
            for leaf in leaves[name]:
                if leaf.requires_grad:
                    leaf.grad = torch.ones_like(leaf)

        for measure, name in reversed(list(zip(results, block.nodes))):
            node = graph.node(name)
            if not measure.requires_grad:
                continue
            outputs = [t for t in islands[name] if t.requires_grad]
            grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves[name] if leaf.requires_grad]
            dep_leaves = [t for d in node.data_deps for t in leaves.get(d, []) if t.requires_grad]
            new_grad_bytes = _storage_bytes([t for t in dep_leaves if t.grad is None])
            reads = sorted(saved.references_of(name))
            measure.backward_reads = [anonymous[r] for r in reads if r in anonymous]
            measure.backward_shapes = [anonymous[d] for d in node.data_deps if d not in reads]
            measure.grads_to = [anonymous[d] for d in node.data_deps if any(t.requires_grad for t in leaves.get(d, []))]
            inputs = dep_leaves + params
            measure.backward_time_s = clock(
                lambda: torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True),
                measure.data_bytes + new_grad_bytes,
            )
            peak = meter.measure(lambda: torch.autograd.backward(outputs, grads))
            measure.backward_overhead_bytes = max(0, peak - new_grad_bytes)
            for leaf in leaves[name]:
                leaf.grad = None
            saved.free_phantoms(name)
    return BlockMeasure(
        class_index=class_index,
        nodes=results,
        input_bytes=input_bytes,
        input_requires_grad=input_requires_grad,
        outputs=[anonymous[n] for n in block.output_nodes],
        has_input=block.input_node is not None,
    )


def _rerun(lines, env, with_grad: bool):
    """A function that runs ``lines`` again on a copy of ``env`` (for timing)."""

    def run():
        with torch.set_grad_enabled(with_grad):
            run_lines(lines, dict(env))

    return run
