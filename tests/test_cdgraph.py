"""CD-graphs of the zoo: invariants, interfaces between blocks, validate() messages, rendering."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from rkgb.build import build
from rkgb.cdgraph import CDGraphError, ComputeKind, DataKind
from zoo import ZOO


@pytest.fixture(scope="module")
def gpt_graphs():
    model, sample = ZOO["gpt"].build(n_layer=3)
    return build(model, sample, cost_model="flops")


def test_every_class_and_the_whole_graph_validate(gpt_graphs):
    chain = gpt_graphs.model_chain
    for graph in chain.classes:
        graph.validate()
    whole = chain.whole_graph()
    whole.validate()
    # one forward and (for nodes that need grad) one backward per simplified node
    forwards = [c for c in whole.compute_nodes if c.kind is ComputeKind.FORWARD]
    assert len(forwards) == len(gpt_graphs.simplified.nodes)
    assert sum(c.kind is ComputeKind.LOSS for c in whole.compute_nodes) == 1


def test_blocks_chain_their_interfaces(gpt_graphs):
    chain = gpt_graphs.model_chain
    for i in range(1, len(chain.blocks)):
        previous, current = chain.block_graph(i - 1), chain.block_graph(i)
        assert current.input_data == previous.output_data
        assert set(current.input_grads) <= set(previous.output_grads)


def test_phantoms_and_fake_edges_are_found(gpt_graphs):
    whole = gpt_graphs.model_chain.whole_graph()
    phantoms = [d for d in whole.data_nodes if d.kind is DataKind.PHANTOMS and d.size_bytes]
    assert phantoms  # dropout masks, layer-norm statistics
    fake = [c for c in whole.backward_nodes() if c.needs_shape]
    assert fake  # the backward of an add needs no input data
    random = [c for c in whole.forward_nodes() if c.is_random]
    assert len(random) == 1 + 3 * 3  # embedding dropout + 3 per layer


def test_validate_names_the_node_and_the_rule(gpt_graphs):
    graph = gpt_graphs.model_chain.classes[3]
    broken_node = dataclasses.replace(graph.compute_nodes[1], needs=["nowhere.data"])
    broken = dataclasses.replace(graph, compute_nodes=[graph.compute_nodes[0], broken_node] + graph.compute_nodes[2:])
    broken.__post_init__()
    with pytest.raises(CDGraphError, match=f"{broken_node.name}.*nowhere.data"):
        broken.validate()
    reordered = dataclasses.replace(graph, compute_nodes=list(reversed(graph.compute_nodes)))
    reordered.__post_init__()
    with pytest.raises(CDGraphError, match="before the loss|after the loss"):
        reordered.validate()


def test_render_draws_blocks_and_cdgraphs(gpt_graphs, tmp_path):
    from rkgb.render import cdgraph_dot, forward_graph_dot

    if shutil.which("dot") is None:
        pytest.skip("graphviz's dot is not installed (apt-get install graphviz)")
    source = forward_graph_dot(gpt_graphs).source
    assert source.count("subgraph cluster_") == len(gpt_graphs.chain.blocks)
    path = cdgraph_dot(gpt_graphs.model_chain.classes[3]).render(tmp_path / "c3", format="svg")
    assert (tmp_path / "c3.svg").exists() and path.endswith(".svg")


def test_gpt_gradients_share_storage_and_come_in_parts(gpt_graphs):
    """The residual adds pass their gradient on (aliases); q, k, v are three parts of one
    gradient, which the two attention matmuls fill in separately."""
    whole = gpt_graphs.model_chain.whole_graph()
    adds = [c for c in whole.backward_nodes() if c.aliases]
    assert len(adds) >= 6
    split = [d for d in whole.data_nodes if d.kind is DataKind.GRAD and len(d.part_sizes) == 3]
    assert len(split) == 3  # one per layer
    partial = [c for c in whole.backward_nodes() if any(g in c.contributes for g in (d.name for d in split))]
    assert len(partial) == 2 * 3


def test_validate_rejects_an_input_gradient_that_is_only_an_alias():
    from solvers.toy_graphs import INPUT, NodeSpec, graph_from_specs

    with pytest.raises(CDGraphError, match="only an alias"):
        graph_from_specs([NodeSpec("r", [INPUT], 6, grad_aliases={INPUT: (0,)})], 6)
