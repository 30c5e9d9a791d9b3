"""The graph builder on the zoo: exact simplified graphs, separators, classes, measured sizes."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from rkgb.blocks import cut_chain, find_separators
from rkgb.build import build
from rkgb.capture import capture
from rkgb.cdgraph import DataKind
from rkgb.errors import CaptureError, UnsupportedOperation
from rkgb.interpret import run_simplified_forward
from rkgb.memory import AllocationTracker, allocator_events
from rkgb.simplify import SimplifiedGraph, SimplifiedNode, simplify
from zoo import ZOO


def _flat(outputs):
    return outputs if isinstance(outputs, tuple) else (outputs,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_simplified_graph_reproduces_the_model_bitwise(name, dtype):
    entry = ZOO[name]
    model, sample = entry.build(dtype=dtype)
    model.train()
    graph = simplify(capture(model, sample))
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    torch.manual_seed(3)
    outputs, updates = run_simplified_forward(graph, model, sample)
    for k, v in model.named_buffers():  # the simplified run leaves buffers untouched
        assert torch.equal(v, buffers[k])
    torch.manual_seed(3)
    expected = _flat(model(*sample))
    assert len(outputs) == len(expected)
    for got, want in zip(outputs, expected):
        assert torch.equal(got, want)
    for path, value in updates.items():  # BatchNorm statistics as eager updated them
        assert torch.equal(value, model.get_buffer(path))
    # one node per allocating op: no node is a view
    assert all(n.outputs or n.buffer_updates for n in graph.nodes)


def _toy_graph(edges: list[tuple[int, int]], count: int, outputs: list[int]) -> SimplifiedGraph:
    """A SimplifiedGraph whose nodes are bare names, for the separator search only."""
    nodes = [SimplifiedNode(name=f"v{i}", main=None) for i in range(count)]
    for a, b in edges:
        nodes[b].data_deps.append(f"v{a}")
    graph = SimplifiedGraph.__new__(SimplifiedGraph)
    graph.nodes = nodes
    graph.outputs = [f"v{i}" for i in outputs]
    graph.owner = {n.name: n.name for n in nodes}
    graph.__post_init__()
    return graph


def _is_separator_brute_force(count, edges, outputs, s) -> bool:
    """Definition: removing s disconnects everything before it from everything after it, it
    comes before every output and a later node reads it, or it is the last node; nodes with no
    predecessor read only globals."""
    if s == count - 1:
        return True
    users = {i: [b for a, b in edges if a == i] for i in range(count)}
    # every path from before s to after s goes through s: no edge jumps over it
    return all(not (a < s < b) for a, b in edges) and all(s < o for o in outputs) and bool(users[s])


def test_separators_match_brute_force_on_random_graphs():
    rng = random.Random(0)
    for _ in range(300):
        count = rng.randint(1, 9)
        edges = sorted({(a, b) for b in range(count) for a in range(b) if rng.random() < 0.3})
        outputs = sorted(rng.sample(range(count), rng.randint(1, min(2, count))))
        graph = _toy_graph(edges, count, outputs)
        found = find_separators(graph)
        expected = [f"v{s}" for s in range(count) if _is_separator_brute_force(count, edges, outputs, s)]
        assert found == expected, (edges, outputs)


def test_gpt_block_and_class_counts_do_not_grow_with_depth():
    counts = {}
    for layers in (2, 4, 12):
        model, sample = ZOO["gpt"].build(n_layer=layers)
        chain = cut_chain(simplify(capture(model, sample)))
        counts[layers] = (len(chain.blocks), len(chain.classes))
    classes = {c for _, c in counts.values()}
    assert len(classes) == 1, counts
    # two blocks per layer (attention and MLP, cut at the residual adds) plus a fixed number
    assert counts[12][0] - counts[4][0] == 2 * 8
    assert counts[4][0] - counts[2][0] == 2 * 2


def test_residual_stream_separators_in_a_transformer():
    model, sample = ZOO["gpt"].build(n_layer=3)
    graph = simplify(capture(model, sample))
    separators = set(find_separators(graph))
    adds = [n.name for n in graph.nodes if "add" in str(n.main.target) and len(n.data_deps) == 2]
    assert len(separators & set(adds)) >= 6


def test_measured_sizes_equal_allocation_tracking():
    """data + phantoms of every node of every class equal the bytes the node really keeps, as
    the allocator counts them."""
    model, sample = ZOO["gpt"].build()
    graphs = build(model, sample, cost_model="flops")
    from rkgb.saved import SavedTensors
    from rkgb.interpret import initial_environment, run_lines

    env = initial_environment(graphs.simplified, model, sample)
    saved = SavedTensors()
    saved.register_globals([env[k] for k in graphs.simplified.global_names()])
    checked = 0
    for block in graphs.chain.blocks:
        measure = graphs.measures[block.class_index]
        for node_name, node_measure in zip(block.nodes, measure.nodes):
            node = graphs.simplified.node(node_name)
            def run():
                with saved.island(node_name), torch.enable_grad():
                    run_lines(node.lines, env)
                saved.finish_island(node_name, [env[o.fx_name] for o in node.outputs])
                for line in node.prelude:  # static values are recomputed, not kept
                    env.pop(line.name)

            # the allocator's figure: it sees the Python numbers that ops wrap into tensors and
            # save (`x * 0.5`), which the dispatch does not
            events = allocator_events(run)
            kept = events[-1].current_bytes if events else 0
            outputs = [env[o.fx_name] for o in node.outputs]
            saved.register_data(node_name, outputs)
            assert node_measure.data_bytes == sum(o.size_bytes for o in node.outputs)
            assert kept == node_measure.data_bytes + (node_measure.phantom_bytes if node_measure.requires_grad else 0)
            checked += 1
    assert checked == len(graphs.simplified.nodes)


class _ScaledTanhs(torch.nn.Module):
    """Products by Python numbers, which autograd saves as tensors of their own (8 bytes each on
    CPU) without the saved-tensor hooks: ALBERT's GELU (`0.044715 * x ** 3`), 80 bytes above its
    prediction at eager's peak before they were counted."""

    def __init__(self, depth: int = 12) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.depth = depth

    def forward(self, x):
        h = self.lin(x)
        for _ in range(self.depth):
            h = torch.tanh(h * 0.75)
        return h


def test_a_saved_python_number_is_counted_with_the_phantoms():
    from exactness import check_training

    x = torch.randn(4, 8, 16)
    graphs = build(_ScaledTanhs(), x, cost_model="flops")
    number = torch.tensor(0.75, dtype=torch.float64).element_size()  # (a wrapped Python float)
    products = [node for measure in graphs.measures for node in measure.nodes if node.phantom_bytes == number]
    assert len(products) >= 1 and all(node.data_bytes == x.numel() * 4 for node in products)
    for fraction in (1.0, 0.0):  # each step's peak within the budget and under the prediction
        check_training(_ScaledTanhs(), (x,), fraction, at_minimum=True)


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_kept_memory_at_end_of_forward_matches_eager(name):
    model, sample = ZOO[name].build()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    graphs = build(model, sample, cost_model="flops")
    whole = graphs.model_chain.whole_graph()
    needed = set(whole.output_data)
    for c in whole.backward_nodes():
        needed.update(d for d in c.needs if d.endswith(".data"))
    predicted = sum(d.size_bytes for d in whole.data_nodes if d.kind is DataKind.PHANTOMS)
    predicted += sum(whole.size(d) for d in needed)
    with AllocationTracker() as tracker:
        out = model(*sample)
        eager = tracker.current_bytes
    del out
    assert abs(predicted - eager) <= 0.05 * eager, (predicted, eager)


def test_capture_error_names_the_model():
    class DataDependent(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x * 2
            return x

    with pytest.raises(CaptureError, match="DataDependent"):
        capture(DataDependent(), (torch.randn(3),))


def test_unsupported_operation_names_op_and_module():
    class Item(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return y * y.max().item()

    model = Item()
    try:
        graph = simplify(capture(model, (torch.randn(2, 4),)))
    except (CaptureError, UnsupportedOperation) as error:
        assert "item" in str(error).lower() or "Item" in str(error)
    else:  # export may turn .item() into a specialized constant: then it must still be exact
        outputs, _ = run_simplified_forward(graph, model, (torch.randn(2, 4),))


def test_dropout_runs_eagers_kernels():
    """torch.export lowers dropout to native_dropout; capture gives each device eager's kernels:
    on CPU eager's decomposition (a float noise drawn by bernoulli_, then mul), as three
    simplified nodes (one-byte mask, noise, product) so that the output and the noise can be
    recomputed without drawing again; on CUDA aten.dropout (the fused kernel)."""
    from rkgb.capture import capture, restore_dropout

    model, sample = ZOO["gpt"].build()
    dropouts = sum(isinstance(m, torch.nn.Dropout) for m in model.modules())
    captured = capture(model, sample)
    targets = [n.target for n in captured.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.native_dropout.default not in targets
    assert torch.ops.aten.dropout.default not in targets
    assert targets.count(torch.ops.aten.bernoulli_.float) == dropouts
    assert targets.count(torch.ops.aten.empty_like.default) == dropouts

    graph = simplify(captured)
    masks = [n for n in graph.nodes if n.name.startswith("dropout_mask")]
    assert len(masks) == dropouts and all(n.is_random and n.outputs[0].dtype == torch.uint8 for n in masks)
    noises = [n for n in graph.nodes if n.name.startswith("dropout_noise")]
    assert len(noises) == dropouts and not any(n.is_random for n in noises)
    products = [n for n in graph.nodes if n.main.target is torch.ops.aten.mul.Tensor and n.name.startswith("dropout")]
    assert len(products) == dropouts and not any(n.is_random for n in products)

    exported = torch.export.export(model, sample, strict=False).run_decompositions({})
    assert restore_dropout(exported.graph, torch.device("cuda")) == dropouts
    targets = [n.target for n in exported.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.dropout.default) == dropouts


def test_a_dropout_of_probability_zero_is_its_input_as_in_eager():
    """Eager's ``F.dropout(x, 0.0, training=True)`` returns ``x`` itself; export makes it a
    copy. The capture removes that copy (its readers read ``x``: no tensor of its own, and no
    autograd node whose place changed the order of ``x``'s gradient sum: the weight's gradient
    was not bitwise), but not a user's ``clone`` nor a dropout whose result is written in
    place; the model trains bitwise."""
    import torch.nn.functional as F

    from exactness import check_training

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            h = torch.softmax(self.lin(x), dim=-1)
            kept = F.dropout(h, 0.0, self.training)  # h itself
            copied = h.clone()  # a copy, as in eager
            written = F.dropout(h * 2, 0.0, self.training)
            written += h  # written in place again by the capture: stays a copy
            return kept @ self.lin.weight + copied + written

    torch.manual_seed(0)
    model, x = Model().train(), torch.randn(4, 8, 16)
    graph = capture(model, (x,)).graph
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.clone.default) == 2
    for fraction in (1.0, 0.5):
        check_training(model, (x,), fraction)


def test_inplace_ops_without_autograd_run_in_place_as_in_eager():
    """Where nothing an in-place op reads requires grad (a frozen stem, an input without grad),
    functionalization's out-of-place op is written in place again, whatever the op
    (``nn.ReLU(inplace=True)``, ``mul_``): no autograd runs there, so no gradient is held
    longer. The plan without recomputation then holds one activation less, eager's memory."""
    from exactness import DotLoss, check_training, eager_peak
    from rockmate import Rockmate

    class FrozenStem(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(inplace=True)).requires_grad_(False)
            self.head = torch.nn.Linear(32, 4)

        def forward(self, x):
            h = self.stem(x)
            h.mul_(x.sum(-1, keepdim=True))
            return self.head(h)

    torch.manual_seed(0)
    model, x = FrozenStem(), torch.randn(8, 16)
    graph = simplify(capture(model, x))
    written = {line.target for node in graph.nodes for line in node.body}
    assert {torch.ops.aten.relu_.default, torch.ops.aten.mul_.Tensor} <= written
    loss = DotLoss(model(x))
    eager = eager_peak(model, (x,), loss)
    none = Rockmate(copy.deepcopy(model), x, 10**12, solver="none", cost_model="flops")
    assert none.plan.predicted_peak <= eager
    check_training(model, (x,), 0.6, steps=2)


def test_residual_additions_run_in_place_as_in_eager():
    """``out += identity`` on a batch norm's result (the zoo ResNet's blocks) is written in
    place again after functionalization: a line of the batch norm's node, one activation less
    than the functional ``add`` node; ``nn.ReLU(inplace=True)`` stays a node of its own (its
    backward's new gradient would be held with the island's incoming one). Exactness and the
    budget on this model are checked by test_rockmate and test_conv_budget."""
    model, sample = ZOO["resnet"].build()
    blocks = sum(1 for m in model.modules() if type(m).__name__ == "BasicBlock")
    graph = simplify(capture(model, sample))
    writes = [line for node in graph.nodes for line in node.body if line.target is torch.ops.aten.add_.Tensor]
    assert len(writes) == blocks > 0
    assert all(node.main.target is not torch.ops.aten.add.Tensor or node.main.args[1] == 1
               for node in graph.nodes)  # (only the step counters' additions stay functional)
    assert any(node.main.target is torch.ops.aten.relu.default for node in graph.nodes)


def test_a_tensor_at_a_freed_incoming_gradients_address_is_no_alias_of_it():
    """The inspection tells the contributions that are aliases of a backward's incoming gradient
    by their storage: a new tensor that the allocator puts where a freed one was is not one."""
    from rkgb.inspect import _IncomingParts

    incoming = _IncomingParts()
    reused = 0
    # (the CPU allocator puts the new tensor where the freed one was in a few percent of tries
    # here: up to 2000 tries, until it happened 3 times)
    for _ in range(2000):
        if reused >= 3:
            break
        grad = torch.randn(64, dtype=torch.float64)
        incoming.add(grad, 0)
        assert incoming.part(grad) == 0 and incoming.part(grad[8:]) == 0
        address = grad.untyped_storage().data_ptr()
        del grad
        new = torch.randn(64, dtype=torch.float64)
        reused += new.untyped_storage().data_ptr() == address
        assert incoming.part(new) == -1
    assert reused  # the case happened (the CPU allocator reuses a freed block of that size)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("stats", [True, False])
def test_batch_norms_run_through_eagers_dispatch(training, stats):
    """The graph's batch norm ops run as ``F.batch_norm`` runs (``_batch_norm_impl_index``: cuDNN's
    kernel on CUDA, the native one here): the same result, running statistics and gradient
    function as eager's (rkgb.interpret.EAGER_KERNELS)."""
    from rkgb.interpret import EAGER_KERNELS

    aten = torch.ops.aten
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 5, 5, generator=generator, requires_grad=True)
    weight, bias = torch.randn(3, generator=generator), torch.randn(3, generator=generator)
    mean, var = torch.randn(3, generator=generator), torch.rand(3, generator=generator) + 0.5
    if not stats and not training:
        pytest.skip("eval mode reads running statistics")
    eager_mean, eager_var = (mean.clone(), var.clone()) if stats else (None, None)
    expected = torch.nn.functional.batch_norm(x, eager_mean, eager_var, weight, bias, training, 0.1, 1e-5)
    if training and stats:
        result, _, _, new_mean, new_var = EAGER_KERNELS[aten._native_batch_norm_legit_functional.default](
            x, weight, bias, mean, var, True, 0.1, 1e-5)
        assert torch.equal(new_mean, eager_mean) and torch.equal(new_var, eager_var)
    elif training:
        result = EAGER_KERNELS[aten._native_batch_norm_legit.no_stats](x, weight, bias, True, 0.1, 1e-5)[0]
    else:
        result = EAGER_KERNELS[aten._native_batch_norm_legit_no_training.default](
            x, weight, bias, mean, var, 0.1, 1e-5)[0]
    assert torch.equal(result, expected)
    assert type(result.grad_fn) is type(expected.grad_fn)


def test_measured_times_run_a_slow_op_once_and_a_fast_one_warmed_and_sampled():
    """The measured cost model (``rkgb.inspect._Clock``): an op whose first run takes
    ``SLOW_FIRST_RUN_S`` or more is timed by that run alone; a fast one runs once untimed, then
    ``repeats`` samples (fewer once they add up to ``SAMPLED_S``), its time the fastest."""
    import time

    from rkgb.inspect import SLOW_FIRST_RUN_S, _Clock

    clock = _Clock("measured", torch.device("cpu"), repeats=3)
    runs = []
    slow = clock(lambda: runs.append(time.sleep(SLOW_FIRST_RUN_S + 0.01)), 0)
    assert len(runs) == 1 and slow >= SLOW_FIRST_RUN_S
    runs.clear()
    fast = clock(lambda: runs.append(None), 0)
    assert len(runs) == 1 + 3 and 0 <= fast < SLOW_FIRST_RUN_S
