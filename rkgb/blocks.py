"""Cut the simplified graph into a chain of blocks at 1-separators; group identical blocks.

A *1-separator* is a simplified node ``s`` such that no edge jumps over it: every node before
``s`` (in the graph's order) is used only by nodes up to ``s``, and the model's outputs are
``s`` or come after it. Edges from globals (parameters, buffers, model inputs) do not count:
globals are always available. Blocks are the pieces ending at consecutive separators, so the
input of a block is the previous block's last node (Rockmate, ICML 2023, section 4).

Identical blocks (a transformer's layers) are recognized by an anonymized signature: the
sequence of operations with their constant arguments and tensor shapes, where references to
other nodes are replaced by their position in the block. Blocks with equal signatures form a
*class* that is inspected and solved once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from .simplify import SimplifiedGraph

__all__ = ["Block", "BlockClass", "Chain", "find_separators", "cut_chain"]

INPUT_NAME = "in"


@dataclass
class Block:
    """Nodes of one block, in order; ``input_node`` is the previous block's output node."""

    index: int
    nodes: list[str]
    input_node: str | None
    output_nodes: list[str]
    class_index: int = -1

    def anonymous_names(self) -> dict[str, str]:
        """Class-level name -> this block's real name (``"n3"`` -> ``"linear_7"``)."""
        names = {f"n{i}": name for i, name in enumerate(self.nodes)}
        if self.input_node is not None:
            names[INPUT_NAME] = self.input_node
        return names


@dataclass
class BlockClass:
    index: int
    blocks: list[int]  # indices of its blocks; the first is the representative

    @property
    def representative(self) -> int:
        return self.blocks[0]


@dataclass
class Chain:
    blocks: list[Block]
    classes: list[BlockClass]


def _edges(graph: SimplifiedGraph) -> list[tuple[int, int]]:
    """(position of producer, position of consumer); the outputs' consumer is position N."""
    position = {node.name: i for i, node in enumerate(graph.nodes)}
    sink = len(graph.nodes)
    edges = [(position[dep], position[node.name]) for node in graph.nodes for dep in node.data_deps]
    users = graph.users()
    output_owners = set(graph.output_owners)
    for node in graph.nodes:
        if node.name in output_owners or not users[node.name]:
            edges.append((position[node.name], sink))
    return edges


def find_separators(graph: SimplifiedGraph) -> list[str]:
    """Names of the 1-separators of the simplified graph, in order.

    Linear time: each edge marks the positions strictly between its ends as jumped over
    (a difference array), and the separators are the positions never jumped over.
    """
    count = len(graph.nodes)
    jumps = [0] * (count + 2)
    for start, end in _edges(graph):
        if end > start + 1:
            jumps[start + 1] += 1
            jumps[end] -= 1
    separators = []
    running = 0
    for i in range(count):
        running += jumps[i]
        if running == 0:
            separators.append(graph.nodes[i].name)
    return separators


def _reference_token(fx_node: torch.fx.Node, local: dict[str, int], input_lines: dict[str, int], graph):
    if fx_node.name in local:
        return ("local", local[fx_node.name])
    value = fx_node.meta.get("val")
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
    dtype = str(value.dtype) if isinstance(value, torch.Tensor) else None
    stride = tuple(value.stride()) if isinstance(value, torch.Tensor) else None
    if fx_node.name in input_lines:
        return ("input", shape, dtype, stride)
    return ("global", shape, dtype)


def _constant_token(value):
    if isinstance(value, (list, tuple)):
        return tuple(_constant_token(v) for v in value)
    if isinstance(value, torch.fx.Node):
        raise AssertionError("references are tokenized separately")
    return repr(value)


def block_signature(graph: SimplifiedGraph, block: Block) -> tuple:
    """The block's anonymized form: equal signatures mean identical CD-graphs."""
    lines: list[torch.fx.Node] = []
    for name in block.nodes:
        lines += graph.node(name).lines
    local = {line.name: i for i, line in enumerate(lines)}
    input_lines = {}
    if block.input_node is not None:
        input_lines = {line.name: i for i, line in enumerate(graph.node(block.input_node).lines)}
    tokens = []
    for line in lines:
        def token(value):
            if isinstance(value, torch.fx.Node):
                return _reference_token(value, local, input_lines, graph)
            if isinstance(value, (list, tuple)):
                return tuple(token(v) for v in value)
            if isinstance(value, dict):
                return tuple(sorted((k, token(v)) for k, v in value.items()))
            return _constant_token(value)

        value = line.meta.get("val")
        meta = (tuple(value.shape), str(value.dtype)) if isinstance(value, torch.Tensor) else repr(type(value))
        tokens.append((str(line.target), token(line.args), token(line.kwargs), meta))
    structure = tuple(
        (len(graph.node(name).prelude), len(graph.node(name).body)) for name in block.nodes
    )
    outputs = tuple(block.nodes.index(name) for name in block.output_nodes)
    return (tuple(tokens), structure, outputs, block.input_node is None)


def cut_chain(graph: SimplifiedGraph) -> Chain:
    """Cut at the separators and group identical blocks into classes."""
    separators = set(find_separators(graph))
    blocks: list[Block] = []
    current: list[str] = []
    previous: str | None = None
    for node in graph.nodes:
        current.append(node.name)
        if node.name in separators:
            blocks.append(Block(len(blocks), current, previous, [node.name]))
            previous = node.name
            current = []
    if current:
        blocks.append(Block(len(blocks), current, previous, [n for n in graph.output_owners if n in current]))
    last = blocks[-1]
    last.output_nodes = [n for n in graph.output_owners if n in last.nodes] or last.output_nodes

    classes: list[BlockClass] = []
    by_signature: dict[tuple, BlockClass] = {}
    for block in blocks:
        signature = block_signature(graph, block)
        found = by_signature.get(signature)
        if found is None:
            found = BlockClass(len(classes), [])
            classes.append(found)
            by_signature[signature] = found
        found.blocks.append(block.index)
        block.class_index = found.index
    return Chain(blocks=blocks, classes=classes)
