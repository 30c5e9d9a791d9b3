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

*Side inputs.* A tensor that many later layers read (an encoder's output read by every decoder
layer's cross-attention, T5's position bias read by every attention) jumps over every position
between its producer and its last reader, so that no separator is left there and the layers
merge into one block. Such a tensor is made a *side input* (:func:`choose_side_inputs`): its
edges do not count in the separator search, as a global's; the block that makes it holds it as
one of its outputs until its own backward (so the tensor is never forgotten while a reader may
still run), and each block that reads it gets it as an input beside the chain's one, whose
gradient its backward contributes to (the contributions add up across blocks as autograd adds
them, later readers first). Side inputs are chosen only where a block would otherwise have
more than ``max_block_nodes`` nodes, and only tensors that at least two nodes beyond their own
block and the next one read (or the user, for a model output), but a small *skip connection*.

A tensor read by one node beyond the next block is left to the block's own plan, which may
recompute it. The bench U-Net's first skip (3.4% of its activations), pinned, raised its minimum
budget from 0.312 to 0.382 of its activations and its predicted step times at 0.4-1.0 of them
by up to 3.8% (flops costs; 0.394 to 0.484 with measured ones), for a plan barely faster to find
(36 -> 32 s). Branches off the main line read once beyond the next block, pinned, cut planning
3-5x but moved the minimum budget both ways (flops costs): MT5 at 2 layers (its position
biases) +5.9%, LongT5 -7.2%, MPNet -4.5%, RecurrentGemma +9.1%, Mamba2 +20.4% (its chunked
scan's intermediates, pinned through the next layer): left to their blocks. A skip connection
(a block's last node, the main line's activation, the next block's input) under
``SKIP_BYTES_FRACTION`` (1%) of the graph's activation bytes is pinned: MobileViT's residuals
(0.02-0.13%, read again by the fusion after each block's transformer) put back made blocks of
57-95 nodes and a 77 s first build; pinned, blocks of at most 14 nodes and 12.5-16.6 s, the same
minimum budget and predicted step times within 0.7% (flops costs).

Identical blocks (a transformer's layers) are recognized by an anonymized signature: the
sequence of operations with their constant arguments and tensor shapes, where references to
other nodes are replaced by their position in the block. Blocks with equal signatures form a
*class* that is inspected and solved once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from .simplify import GradientNeeds, SimplifiedGraph

__all__ = ["Block", "BlockClass", "Chain", "find_separators", "choose_side_inputs", "cut_chain", "side_name"]

INPUT_NAME = "in"
SIDE_PREFIX = "side"
# a skip connection of at least this fraction of the graph's activation bytes is not pinned
SKIP_BYTES_FRACTION = 0.01


def side_name(index: int) -> str:
    """The class-level name of a block's ``index``-th side input (``"side0"``)."""
    return f"{SIDE_PREFIX}{index}"


@dataclass
class Block:
    """Nodes of one block, in order; ``input_node`` is the previous block's output node (None
    for the first block, or for one that does not read it); ``side_inputs``: nodes of earlier
    blocks that it reads besides (see the module docstring); ``output_nodes``: its last node,
    the side inputs it makes for later blocks, or the model's outputs for the last block."""

    index: int
    nodes: list[str]
    input_node: str | None
    output_nodes: list[str]
    class_index: int = -1
    side_inputs: list[str] = field(default_factory=list)

    def anonymous_names(self) -> dict[str, str]:
        """Class-level name -> this block's real name (``"n3"`` -> ``"linear_7"``)."""
        names = {f"n{i}": name for i, name in enumerate(self.nodes)}
        if self.input_node is not None:
            names[INPUT_NAME] = self.input_node
        names.update({side_name(i): name for i, name in enumerate(self.side_inputs)})
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


def _edges(graph: SimplifiedGraph, side: frozenset[str] | set[str] = frozenset()) -> list[tuple[int, int]]:
    """(position of producer, position of consumer) of every data edge between nodes (but
    the edges from ``side`` inputs)."""
    position = {node.name: i for i, node in enumerate(graph.nodes)}
    return [(position[dep], position[node.name]) for node in graph.nodes for dep in node.data_deps
            if dep not in side]


def find_separators(graph: SimplifiedGraph, side: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Names of the 1-separators of the simplified graph, in order (see the module docstring);
    the last node is always one. Edges from the ``side`` inputs do not count.

    Linear time: each edge marks the positions strictly between its ends as jumped over
    (a difference array), and the separators are the positions never jumped over, before the
    first output and read by a later node.
    """
    count = len(graph.nodes)
    if count == 0:
        return []
    position = {node.name: i for i, node in enumerate(graph.nodes)}
    first_output = min((position[o] for o in graph.output_owners if o not in side), default=count)
    users = graph.users()
    jumps = [0] * (count + 2)
    for start, end in _edges(graph, side):
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


def _separator_state(graph: SimplifiedGraph, side: set[str], position: dict[str, int]) -> list[tuple[int, int]]:
    """The (first, last) positions of the blocks that the separators cut, given ``side``."""
    ranges, start = [], 0
    for name in find_separators(graph, side):
        ranges.append((start, position[name]))
        start = position[name] + 1
    return ranges


def choose_side_inputs(graph: SimplifiedGraph, max_block_nodes: int = 40, max_trials: int = 200) -> set[str]:
    """The nodes to make side inputs (see the module docstring), so that blocks have at most
    about ``max_block_nodes`` nodes where the graph allows it; blocks already that small are
    left as they are.

    Greedy: while the largest block is too big, the node whose edges jump over most of its
    positions (a tensor that all its layers read; a model output, which the user reads at
    the end) stops counting in the separator search; two such tensors may have to go before
    the block splits (T5's decoder reads the encoder's output and its own position bias).
    Then the side inputs that no separator needs are put back, and those that fewer than two
    nodes beyond their own block and the next one read but a skip connection (a block's last
    node) under ``SKIP_BYTES_FRACTION`` of the activations. Each trial is one linear separator
    search.
    """
    count = len(graph.nodes)
    if count == 0:
        return set()
    position = {node.name: i for i, node in enumerate(graph.nodes)}
    users = graph.users()
    reach = {node.name: max((position[u] for u in users[node.name]), default=-1) for node in graph.nodes}
    for name in graph.output_owners:  # the user reads the outputs after the last node
        reach[name] = count
    side: set[str] = set()
    ranges = _separator_state(graph, side, position)
    for _ in range(max_trials):
        first, last = max(ranges, key=lambda r: r[1] - r[0])
        if last - first + 1 <= max_block_nodes:
            break
        best, covered = None, 0
        for name, end in reach.items():
            start = position[name] + 1
            cover = min(end - 1, last) - max(start, first) + 1
            if name not in side and end > start and cover > covered:
                best, covered = name, cover
        if best is None:
            break
        side.add(best)
        ranges = _separator_state(graph, side, position)
    for name in sorted(side, key=position.get):  # put back those that no separator needs
        if _separator_state(graph, side - {name}, position) == ranges:
            side.discard(name)
    outputs = set(graph.output_owners)
    least_pinned = SKIP_BYTES_FRACTION * sum(node.size_bytes for node in graph.nodes)

    def spare(name: str) -> bool:  # read once at most beyond the next block, and no small skip connection
        if name in outputs or _readers_beyond(name, users, position, ranges) >= 2:
            return False
        ends_its_block = any(last == position[name] for _, last in ranges)
        return not ends_its_block or graph.node(name).size_bytes >= least_pinned

    while True:
        found = next((name for name in sorted(side, key=position.get) if spare(name)), None)
        if found is None:
            return side
        side.discard(found)
        ranges = _separator_state(graph, side, position)


def _readers_beyond(name: str, users: dict[str, list[str]], position: dict[str, int],
                    ranges: list[tuple[int, int]]) -> int:
    """How many nodes read node ``name`` beyond its own block and the next one."""
    index = next(i for i, r in enumerate(ranges) if r[0] <= position[name] <= r[1])
    last = ranges[min(index + 1, len(ranges) - 1)][1]
    return len({u for u in users[name] if position[u] > last})


def _reference_token(fx_node: torch.fx.Node, local: dict[str, int], input_lines: dict[str, int], graph,
                     side_lines: dict[str, tuple[int, int]] | None = None):
    if fx_node.name in local:
        return ("local", local[fx_node.name])
    value = fx_node.meta.get("val")
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
    dtype = str(value.dtype) if isinstance(value, torch.Tensor) else None
    stride = tuple(value.stride()) if isinstance(value, torch.Tensor) else None
    if fx_node.name in input_lines:
        return ("input", shape, dtype, stride)
    if side_lines and fx_node.name in side_lines:
        return ("side", side_lines[fx_node.name], shape, dtype, stride)
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
    side_lines = {line.name: (k, i) for k, name in enumerate(block.side_inputs)
                  for i, line in enumerate(graph.node(name).lines)}
    tokens = []
    for line in lines:
        def token(value):
            if isinstance(value, torch.fx.Node):
                return _reference_token(value, local, input_lines, graph, side_lines)
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
    names = block.nodes + ([block.input_node] if block.input_node is not None else []) + block.side_inputs
    gradients = tuple(tuple(needs[name].exported.values()) for name in names) if needs is not None else ()
    return (tuple(tokens), structure, outputs, block.input_node is None, len(block.side_inputs), gradients)


def _link_side_inputs(graph: SimplifiedGraph, blocks: list[Block], side: set[str]) -> None:
    """Give each block the side inputs it reads (in the order of its first reads) and each
    producer the side inputs it makes as outputs; a block that does not read the previous
    block's output (the decoder's embeddings after an encoder) has no chain input."""
    block_of = {name: block.index for block in blocks for name in block.nodes}
    for block in blocks:
        inside = set(block.nodes)
        reads: list[str] = []
        for name in block.nodes:
            for dep in graph.node(name).data_deps:
                if dep not in inside and dep != block.input_node and dep not in reads:
                    reads.append(dep)
        assert all(dep in side for dep in reads), f"block {block.index} reads {reads} across a separator"
        block.side_inputs = reads
        if block.input_node is not None and not any(
                block.input_node in graph.node(name).data_deps for name in block.nodes):
            block.input_node = None
        for dep in reads:
            producer = blocks[block_of[dep]]
            if dep not in producer.output_nodes:
                producer.output_nodes.append(dep)
    for name in graph.output_owners:  # a model output made before the last block (a side input)
        producer = blocks[block_of[name]]
        if producer is not blocks[-1] and name not in producer.output_nodes:
            producer.output_nodes.append(name)


def cut_chain(graph: SimplifiedGraph, needs: dict[str, GradientNeeds] | None = None,
              max_block_nodes: int | None = 40) -> Chain:
    """Cut at the separators and group identical blocks into classes (``needs``: which tensors
    get gradients, :func:`rkgb.simplify.gradient_needs`; blocks differing there differ).
    ``max_block_nodes``: make side inputs of the tensors that many blocks read where blocks
    would be bigger (:func:`choose_side_inputs`); None: never."""
    side = choose_side_inputs(graph, max_block_nodes) if max_block_nodes else set()
    separators = set(find_separators(graph, side))
    blocks: list[Block] = []
    current: list[str] = []
    previous: str | None = None
    for node in graph.nodes:
        current.append(node.name)
        if node.name in separators:
            blocks.append(Block(len(blocks), current, previous, [node.name]))
            previous = node.name
            current = []
    if blocks:  # the last block holds every output (find_separators) but side ones
        last = set(blocks[-1].nodes)
        blocks[-1].output_nodes = [name for name in graph.output_owners if name in last]
    _link_side_inputs(graph, blocks, side)

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
