"""Graphviz drawings of the graph builder's output: the simplified forward graph with its
blocks coloured by class, and CD-graphs. ``dot`` must be installed (the message says how)."""

from __future__ import annotations

import shutil

from .cdgraph import CDGraph, ComputeKind

__all__ = ["forward_graph_dot", "cdgraph_dot"]

_PALETTE = ["#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69",
            "#fccde5", "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f"]

_INSTALL_HINT = (
    "graphviz's `dot` program was not found; install it (Debian/Ubuntu: "
    "`apt-get install graphviz`, macOS: `brew install graphviz`, conda: "
    "`conda install graphviz`) and make sure `dot` is on PATH"
)


def _graphviz():
    try:
        import graphviz
    except ImportError as error:  # an optional dependency: say how to get it
        raise ImportError("rendering needs the Python package graphviz: pip install graphviz") from error
    if shutil.which("dot") is None:
        raise RuntimeError(_INSTALL_HINT)
    return graphviz


def forward_graph_dot(graphs):
    """The simplified forward graph; each block is a cluster coloured by its class."""
    graphviz = _graphviz()
    dot = graphviz.Digraph("forward", graph_attr={"rankdir": "TB"})
    for block in graphs.chain.blocks:
        colour = _PALETTE[block.class_index % len(_PALETTE)]
        with dot.subgraph(name=f"cluster_{block.index}") as cluster:
            cluster.attr(label=f"block {block.index} (class {block.class_index})", style="filled", color=colour)
            for name in block.nodes:
                node = graphs.simplified.node(name)
                target = getattr(node.main.target, "__name__", str(node.main.target))
                cluster.node(name, f"{name}\n{target}", shape="box", style="filled", fillcolor="white")
    for node in graphs.simplified.nodes:
        for dep in node.data_deps:
            dot.edge(dep, node.name)
    return dot


def cdgraph_dot(graph: CDGraph):
    """A CD-graph: compute nodes as boxes (blue forward, red backward), data nodes as ellipses."""
    graphviz = _graphviz()
    dot = graphviz.Digraph(graph.name)
    colours = {ComputeKind.FORWARD: "#4a7ebb", ComputeKind.BACKWARD: "#c0504d", ComputeKind.LOSS: "#333333"}
    for data in graph.data_nodes:
        dot.node(data.name, f"{data.name}\n{data.size_bytes} B", shape="ellipse")
    for compute in graph.compute_nodes:
        dot.node(compute.name, compute.name, shape="box", color=colours[compute.kind], fontcolor=colours[compute.kind])
        for need in compute.needs:
            dot.edge(need, compute.name)
        for need in compute.needs_shape:
            dot.edge(need, compute.name, style="dashed")
        for made in compute.produces:
            dot.edge(compute.name, made)
    return dot


