"""Generators of small CD-graphs and chains, for tests and benchmarks (no torch).

As Checkmate's ``gen_linear_graph``, they make solver tests cheap and exhaustive: chains,
diamonds, nodes with several users, nodes with several outputs, phantoms, fake edges. Every
generated graph passes :meth:`CDGraph.validate`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from rkgb.cdgraph import (
    BlockInstance,
    CDGraph,
    ComputeKind,
    ComputeNode,
    DataKind,
    DataNode,
    ModelChain,
    compute_name,
    data_name,
)

__all__ = [
    "NodeSpec",
    "graph_from_specs",
    "linear_graph",
    "diamond_graph",
    "multi_output_graph",
    "random_graph",
    "attention_like_graph",
    "residual_graph",
    "split_graph",
    "chain_of",
    "random_chain",
]

INPUT = "in"


@dataclass
class NodeSpec:
    """One simplified node of a toy block.

    ``inputs`` are real edges (the forward reads their data), ``shape_inputs`` fake edges;
    ``backward_reads`` the data its backward reads (among ``inputs`` and itself);
    ``extra_outputs`` more data nodes produced by the same forward (several outputs), each of
    ``size_bytes``. ``grad_parts``: the sizes of the tensors of its gradient (a split's). Of its
    backward: ``grad_contributes[i]`` the parts of input ``i``'s gradient it contributes to
    (default all), ``grad_aliases[i]`` for each part of input ``i``'s gradient the part of its
    own gradient that its first contribution is (``-1``: a new tensor; an ``add`` passes its
    gradient on). ``no_grad_overhead_bytes``: the forward's temporary memory without grad.
    """

    name: str
    inputs: list[str]
    size_bytes: int
    phantoms_bytes: int = 0
    forward_time_s: float = 1.0
    backward_time_s: float = 2.0
    forward_overhead_bytes: int = 0
    backward_overhead_bytes: int = 0
    backward_reads: list[str] = field(default_factory=list)
    shape_inputs: list[str] = field(default_factory=list)
    extra_outputs: list[str] = field(default_factory=list)
    grad_parts: tuple[int, ...] = ()
    grad_contributes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    grad_aliases: dict[str, tuple[int, ...]] = field(default_factory=dict)
    no_grad_overhead_bytes: int | None = None


def graph_from_specs(
    specs: list[NodeSpec],
    input_bytes: int,
    *,
    name: str = "toy",
    input_requires_grad: bool = True,
    loss_time_s: float = 0.0,
    loss_overhead_bytes: int = 0,
) -> CDGraph:
    """Build a block's CD-graph from node specs listed in topological order.

    The block reads one input ``"in"`` and its output is the last spec's node. Every node has
    phantoms (possibly of size 0) and a backward producing the grads of its inputs.
    """
    data: list[DataNode] = [
        DataNode(data_name(INPUT, DataKind.DATA), DataKind.DATA, INPUT, input_bytes),
    ]
    if input_requires_grad:
        data.append(DataNode(data_name(INPUT, DataKind.GRAD), DataKind.GRAD, INPUT, input_bytes))
    owner = {INPUT: INPUT}
    sizes = {INPUT: input_bytes}
    forwards: list[ComputeNode] = []
    backwards: list[ComputeNode] = []
    for spec in specs:
        targets = [spec.name] + list(spec.extra_outputs)
        for t in targets:
            owner[t] = spec.name
            sizes[t] = spec.size_bytes
            data.append(DataNode(data_name(t, DataKind.DATA), DataKind.DATA, t, spec.size_bytes))
            data.append(DataNode(data_name(t, DataKind.GRAD), DataKind.GRAD, t, spec.size_bytes, spec.grad_parts))
        data.append(
            DataNode(data_name(spec.name, DataKind.PHANTOMS), DataKind.PHANTOMS, spec.name, spec.phantoms_bytes)
        )
        forwards.append(
            ComputeNode(
                name=compute_name(spec.name, ComputeKind.FORWARD),
                kind=ComputeKind.FORWARD,
                target=spec.name,
                time_s=spec.forward_time_s,
                overhead_bytes=spec.forward_overhead_bytes,
                needs=[data_name(i, DataKind.DATA) for i in spec.inputs],
                needs_shape=[data_name(i, DataKind.DATA) for i in spec.shape_inputs],
                produces=[data_name(t, DataKind.DATA) for t in targets]
                + [data_name(spec.name, DataKind.PHANTOMS)],
                no_grad_overhead_bytes=spec.no_grad_overhead_bytes,
            )
        )
        grads = [
            data_name(i, DataKind.GRAD)
            for i in spec.inputs
            if i != INPUT or input_requires_grad
        ]
        backwards.append(
            ComputeNode(
                name=compute_name(spec.name, ComputeKind.BACKWARD),
                kind=ComputeKind.BACKWARD,
                target=spec.name,
                time_s=spec.backward_time_s,
                overhead_bytes=spec.backward_overhead_bytes,
                needs=[data_name(t, DataKind.GRAD) for t in targets]
                + [data_name(spec.name, DataKind.PHANTOMS)]
                + [data_name(r, DataKind.DATA) for r in spec.backward_reads],
                produces=list(dict.fromkeys(grads)),
                contributes={data_name(i, DataKind.GRAD): v for i, v in spec.grad_contributes.items()},
                aliases={data_name(i, DataKind.GRAD): v for i, v in spec.grad_aliases.items()},
            )
        )
    out = specs[-1].name
    loss = ComputeNode(
        name="loss",
        kind=ComputeKind.LOSS,
        target="loss",
        time_s=loss_time_s,
        overhead_bytes=loss_overhead_bytes,
        needs=[data_name(out, DataKind.DATA)],
        produces=[data_name(out, DataKind.GRAD)],
    )
    graph = CDGraph(
        name=name,
        compute_nodes=forwards + [loss] + backwards[::-1],
        data_nodes=data,
        input_data=[data_name(INPUT, DataKind.DATA)],
        input_grads=[data_name(INPUT, DataKind.GRAD)] if input_requires_grad else [],
        output_data=[data_name(out, DataKind.DATA)],
        output_grads=[data_name(out, DataKind.GRAD)],
    )
    graph.validate()
    return graph


def linear_graph(n: int, size_bytes: int = 10, phantoms_bytes: int = 5, **kwargs) -> CDGraph:
    """A chain ``in -> n1 -> ... -> nn``; each backward reads its input's data."""
    specs = []
    previous = INPUT
    for i in range(1, n + 1):
        specs.append(
            NodeSpec(f"n{i}", [previous], size_bytes, phantoms_bytes, 1.0 + i % 3, 2.0,
                     backward_reads=[previous])
        )
        previous = f"n{i}"
    return graph_from_specs(specs, size_bytes, name=f"linear{n}", **kwargs)


def diamond_graph(**kwargs) -> CDGraph:
    """``in -> a -> (b, c) -> d``: a node with two users, a node with two inputs."""
    specs = [
        NodeSpec("a", [INPUT], 10, 4, 1.0, 2.0, forward_overhead_bytes=3),
        NodeSpec("b", ["a"], 20, 0, 3.0, 1.0, backward_reads=["a"]),
        NodeSpec("c", ["a"], 8, 6, 2.0, 2.0, backward_overhead_bytes=5, shape_inputs=[INPUT]),
        NodeSpec("d", ["b", "c"], 10, 0, 1.5, 2.5, backward_reads=["b", "c"]),
    ]
    return graph_from_specs(specs, 10, name="diamond", **kwargs)


def multi_output_graph(**kwargs) -> CDGraph:
    """``in -> s`` where ``s`` has two outputs ``s`` and ``s2``, both read by ``o``."""
    specs = [
        NodeSpec("s", [INPUT], 6, 2, 1.0, 1.0, extra_outputs=["s2"]),
        NodeSpec("t", ["s2"], 12, 5, 2.0, 2.0, backward_reads=["s2"]),
        NodeSpec("o", ["s", "t"], 6, 0, 1.0, 2.0, backward_reads=["s", "t"], forward_overhead_bytes=4),
    ]
    return graph_from_specs(specs, 6, name="multi_output", **kwargs)


def residual_graph(**kwargs) -> CDGraph:
    """``in -> a``, ``r = in + a`` (its backward passes ``r.grad`` itself to both), ``o``.

    ``in.grad`` is first ``r.grad`` itself, then ``a``'s backward adds to it out of place.
    """
    specs = [
        NodeSpec("a", [INPUT], 6, 2, 1.0, 2.0, backward_reads=[INPUT], forward_overhead_bytes=1,
                 no_grad_overhead_bytes=3),
        NodeSpec("r", [INPUT, "a"], 6, 0, 1.0, 1.0, grad_aliases={INPUT: (0,), "a": (0,)}),
        NodeSpec("o", ["r"], 6, 3, 2.0, 2.0, backward_reads=["r"], backward_overhead_bytes=2),
    ]
    return graph_from_specs(specs, 6, name="residual", **kwargs)


def split_graph(**kwargs) -> CDGraph:
    """``s`` is split in two tensors (a gradient in two parts): ``t`` reads the first and
    contributes to its part of ``s.grad`` only; ``o = s[1] + t`` passes its gradient on to
    ``t`` and to the second part of ``s.grad``."""
    specs = [
        NodeSpec("s", [INPUT], 8, 2, 1.0, 1.0, forward_overhead_bytes=1, no_grad_overhead_bytes=2,
                 grad_parts=(4, 4)),
        NodeSpec("t", ["s"], 4, 3, 2.0, 2.0, backward_reads=["s"], grad_contributes={"s": (0,)}),
        NodeSpec("o", ["s", "t"], 4, 0, 1.0, 1.0, grad_contributes={"s": (1,)},
                 grad_aliases={"s": (-1, 0), "t": (0,)}),
    ]
    return graph_from_specs(specs, 8, name="split", **kwargs)


def random_graph(rng: random.Random, n: int, *, name: str = "random", **kwargs) -> CDGraph:
    """A random DAG of ``n`` nodes: each node reads one or two earlier nodes."""
    specs: list[NodeSpec] = []
    names = [INPUT]
    unused: set[str] = set()
    for i in range(n):
        k = 1 if len(names) == 1 or rng.random() < 0.6 else 2
        inputs = rng.sample(names[-3:], min(k, len(names[-3:])))
        if i == n - 1:  # the output depends on every node, so that every grad is produced
            inputs = list(dict.fromkeys(inputs + sorted(unused - {INPUT})))
        unused -= set(inputs)
        unused.add(f"v{i}")
        reads = [x for x in inputs if rng.random() < 0.5]
        specs.append(
            NodeSpec(
                f"v{i}",
                inputs,
                rng.choice([2, 4, 6, 8, 10]),
                rng.choice([0, 0, 2, 5]),
                float(rng.randint(1, 4)),
                float(rng.randint(1, 5)),
                forward_overhead_bytes=rng.choice([0, 0, 3]),
                backward_overhead_bytes=rng.choice([0, 2]),
                backward_reads=reads,
            )
        )
        names.append(f"v{i}")
    return graph_from_specs(specs, rng.choice([2, 6, 10]), name=name, **kwargs)


def attention_like_graph(
    batch: int = 8,
    seq: int = 512,
    hidden: int = 768,
    heads: int = 12,
    *,
    bytes_per_element: int = 4,
    name: str = "attention_block",
) -> CDGraph:
    """A GPT-2-like transformer block (attention and MLP) as a CD-graph, with realistic sizes.

    About 20 simplified nodes: layer norm, q/k/v linears, head views (merged in their owners,
    so copies only), scores matmul, scaling, mask, softmax, dropout, matmul, projection,
    dropout, residual add, layer norm, MLP with GELU, dropout, residual add. Times are
    modelled as proportional to flops (1e12 flop/s) plus a memory term.
    """
    e = bytes_per_element
    act = batch * seq * hidden * e
    scores = batch * heads * seq * seq * e
    mlp = 4 * act
    flops = 1e12
    bandwidth = 1e12

    def linear_time(fan_in: int, out_bytes: int) -> float:
        return 2 * fan_in * out_bytes / e / flops + 2 * out_bytes / bandwidth

    def pointwise_time(out_bytes: int) -> float:
        return 2 * out_bytes / bandwidth

    mask_bytes = batch * heads * seq * seq  # dropout masks in bytes (bool)
    specs = [
        NodeSpec("ln1", [INPUT], act, 2 * batch * seq * e, pointwise_time(act) * 3, pointwise_time(act) * 6,
                 backward_reads=[INPUT]),
        NodeSpec("q", ["ln1"], act, 0, linear_time(hidden, act), 2 * linear_time(hidden, act), backward_reads=["ln1"]),
        NodeSpec("k", ["ln1"], act, 0, linear_time(hidden, act), 2 * linear_time(hidden, act), backward_reads=["ln1"]),
        NodeSpec("v", ["ln1"], act, 0, linear_time(hidden, act), 2 * linear_time(hidden, act), backward_reads=["ln1"]),
        NodeSpec("kt", ["k"], act, 0, pointwise_time(act), pointwise_time(act)),
        NodeSpec("scores", ["q", "kt"], scores, 0, linear_time(seq, scores) / heads,
                 2 * linear_time(seq, scores) / heads, backward_reads=["q", "kt"]),
        NodeSpec("scaled", ["scores"], scores, 0, pointwise_time(scores), pointwise_time(scores)),
        NodeSpec("masked", ["scaled"], scores, mask_bytes // 8, pointwise_time(scores), pointwise_time(scores)),
        NodeSpec("softmax", ["masked"], scores, 0, 2 * pointwise_time(scores), 2 * pointwise_time(scores),
                 backward_reads=["softmax"], backward_overhead_bytes=scores),
        NodeSpec("attn_drop", ["softmax"], scores, mask_bytes, pointwise_time(scores), pointwise_time(scores)),
        NodeSpec("context", ["attn_drop", "v"], act, 0, linear_time(seq, act), 2 * linear_time(seq, act),
                 backward_reads=["attn_drop", "v"]),
        NodeSpec("merged", ["context"], act, 0, pointwise_time(act), pointwise_time(act),
                 shape_inputs=["ln1"]),
        NodeSpec("proj", ["merged"], act, 0, linear_time(hidden, act), 2 * linear_time(hidden, act),
                 backward_reads=["merged"]),
        NodeSpec("resid_drop", ["proj"], act, act // 4, pointwise_time(act), pointwise_time(act)),
        NodeSpec("res1", [INPUT, "resid_drop"], act, 0, pointwise_time(act), pointwise_time(act)),
        NodeSpec("ln2", ["res1"], act, 2 * batch * seq * e, pointwise_time(act) * 3, pointwise_time(act) * 6,
                 backward_reads=["res1"]),
        NodeSpec("fc", ["ln2"], mlp, 0, linear_time(hidden, mlp), 2 * linear_time(hidden, mlp),
                 backward_reads=["ln2"]),
        NodeSpec("gelu", ["fc"], mlp, 0, 3 * pointwise_time(mlp), 3 * pointwise_time(mlp), backward_reads=["fc"],
                 forward_overhead_bytes=mlp),
        NodeSpec("fc_proj", ["gelu"], act, 0, linear_time(4 * hidden, act), 2 * linear_time(4 * hidden, act),
                 backward_reads=["gelu"]),
        NodeSpec("mlp_drop", ["fc_proj"], act, act // 4, pointwise_time(act), pointwise_time(act)),
        NodeSpec("res2", ["res1", "mlp_drop"], act, 0, pointwise_time(act), pointwise_time(act)),
    ]
    return graph_from_specs(specs, act, name=name)


def chain_of(classes: list[CDGraph], class_of_block: list[int]) -> ModelChain:
    """A chain whose block ``i`` is an instance of ``classes[class_of_block[i]]``.

    Every class graph must read ``"in"`` and produce one output data node; block ``i``'s node
    ``x`` is named ``b{i}_x`` and its input is block ``i-1``'s output (``"input"`` for the
    first).
    """
    blocks = []
    previous = "input"
    for i, c in enumerate(class_of_block):
        graph = classes[c]
        names = {node.target: f"b{i}_{node.target}" for node in graph.data_nodes}
        names[INPUT] = previous
        blocks.append(BlockInstance(index=i, class_index=c, names=names))
        out_target = graph.data(graph.output_data[0]).target
        previous = names[out_target]
    chain = ModelChain(classes=classes, blocks=blocks)
    for i in range(len(blocks)):
        chain.block_graph(i).validate()
    chain.whole_graph().validate()
    return chain


def random_chain(rng: random.Random, n_blocks: int, n_classes: int = 2, nodes_per_block: int = 3) -> ModelChain:
    """A chain of ``n_blocks`` random blocks drawn from ``n_classes`` random classes.

    Block interfaces have equal sizes across classes (a class's input is as large as its
    output) so that any class can follow any other.
    """
    size = rng.choice([4, 6, 8])
    classes = []
    for c in range(n_classes):
        g = random_graph(rng, nodes_per_block, name=f"class{c}")
        # force the interface sizes to ``size`` so classes can be chained
        for d in g.data_nodes:
            if d.target in (INPUT, g.data(g.output_data[0]).target) and d.kind is not DataKind.PHANTOMS:
                d.size_bytes = size
        classes.append(g)
    return chain_of(classes, [rng.randrange(n_classes) for _ in range(n_blocks)])
