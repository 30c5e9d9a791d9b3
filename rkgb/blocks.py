"""Cut the simplified graph into a chain of blocks at 1-separators; group identical blocks.

A *1-separator* is a simplified node ``s`` such that no edge jumps over it: every node before
``s`` (in the graph's order) is used only by nodes up to ``s``. Edges from globals (parameters,
buffers, model inputs) do not count: globals are always available. Blocks are the pieces
ending at consecutive separators, so the input of a block is the previous block's last node
(Rockmate, ICML 2023, section 4).

The chain's semantics ask two more things of a separator that ends a block before the last:

- the model's outputs all come after it. The user holds every output until the backward, and
  the loss gives each its gradient: only the last block's outputs are held and receive one
  (an output in an earlier block would be forgotten, and its gradient from the loss lost);
- it is read by a later node: the next block's input is the separator, and a node that nothing
  reads (an unused dropout, kept because it draws random numbers) would make an input that no
  node of that block reads, while the nodes it replaces go unlinked.

Identical blocks (a transformer's layers) are recognized by an anonymized signature: the
sequence of operations with their constant arguments and tensor shapes, where references to
other nodes are replaced by their position in the block. Blocks with equal signatures form a
*class* that is inspected and solved once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from .simplify import GradientNeeds, SimplifiedGraph

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
    """(position of producer, position of consumer) of every data edge between nodes."""
    position = {node.name: i for i, node in enumerate(graph.nodes)}
    return [(position[dep], position[node.name]) for node in graph.nodes for dep in node.data_deps]


def find_separators(graph: SimplifiedGraph) -> list[str]:
    """Names of the 1-separators of the simplified graph, in order (see the module docstring);
    the last node is always one.

    Linear time: each edge marks the positions strictly between its ends as jumped over
    (a difference array), and the separators are the positions never jumped over, before the
    first output and read by a later node.
    """
    count = len(graph.nodes)
    if count == 0:
        return []
    position = {node.name: i for i, node in enumerate(graph.nodes)}
    first_output = min((position[o] for o in graph.output_owners), default=count)
    users = graph.users()
    jumps = [0] * (count + 2)
    for start, end in _edges(graph):
        if end > start + 1:
            jumps[start + 1] += 1
            jumps[end] -= 1
    separators = []
    running = 0
    for i, node in enumerate(graph.nodes):
        running += jumps[i]
        if i == count - 1 or (running == 0 and i < first_output and users[node.name]):
            separators.append(node.name)
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


def block_signature(graph: SimplifiedGraph, block: Block, needs: dict[str, GradientNeeds] | None = None) -> tuple:
    """The block's anonymized form: equal signatures mean identical CD-graphs (the same
    operations, and the same tensors getting gradients: ``needs``)."""
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
    names = block.nodes + ([block.input_node] if block.input_node is not None else [])
    gradients = tuple(tuple(needs[name].exported.values()) for name in names) if needs is not None else ()
    return (tuple(tokens), structure, outputs, block.input_node is None, gradients)


def cut_chain(graph: SimplifiedGraph, needs: dict[str, GradientNeeds] | None = None) -> Chain:
    """Cut at the separators and group identical blocks into classes (``needs``: which tensors
    get gradients, :func:`rkgb.simplify.gradient_needs`; blocks differing there differ)."""
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
    if blocks:  # the last block holds every output (find_separators)
        blocks[-1].output_nodes = list(graph.output_owners)

    classes: list[BlockClass] = []
    by_signature: dict[tuple, BlockClass] = {}
    for block in blocks:
        signature = block_signature(graph, block, needs)
        found = by_signature.get(signature)
        if found is None:
            found = BlockClass(len(classes), [])
            classes.append(found)
            by_signature[signature] = found
        found.blocks.append(block.index)
        block.class_index = found.index
    return Chain(blocks=blocks, classes=classes)
