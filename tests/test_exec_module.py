"""The executor: generated code, exactness against eager PyTorch, memory, errors."""

from __future__ import annotations

import copy
import linecache

import pytest
import torch
from conftest import seed_everything
from zoo import ZOO, weighted_loss

from exec import (
    CompiledModule,
    ScheduleError,
    no_recomputation_schedule,
    random_schedule,
    recompute_all_schedule,
)
from rkgb.capture import capture
from rkgb.cdgraph import parameter_sum_key
from rkgb.memory import AllocationTracker
from rkgb.simplify import simplify
from solvers.schedule import Compute, Schedule

SCHEDULES = {
    "none": no_recomputation_schedule,
    "recompute_all": lambda graph: recompute_all_schedule(graph, stress=True),
    "random": lambda graph: random_schedule(graph, seed=3),
}


def _compile(name: str, dtype: torch.dtype, schedule: str, **overrides):
    model, sample = ZOO[name].build(dtype=dtype, **overrides)
    reference = copy.deepcopy(model)
    graph = simplify(capture(copy.deepcopy(model), sample))
    compiled = CompiledModule(model, graph, SCHEDULES[schedule](graph), sample)
    return compiled, reference, sample


def _as_tuple(outputs):
    return outputs if isinstance(outputs, tuple) else (outputs,)


def _assert_same_training(compiled: CompiledModule, reference: torch.nn.Module, sample, steps: int = 3):
    """Outputs, parameter and input gradients, buffers: bitwise equal over ``steps`` SGD steps."""
    model = compiled.model
    for step in range(steps):
        seed_everything(step)
        expected = _as_tuple(reference(*sample))
        weighted_loss(expected).backward()
        expected_input_grads = [t.grad for t in sample if t.requires_grad]
        for t in sample:
            t.grad = None
        seed_everything(step)
        received = _as_tuple(compiled(*sample))
        weighted_loss(received).backward()
        received_input_grads = [t.grad for t in sample if t.requires_grad]
        for t in sample:
            t.grad = None
        assert len(received) == len(expected)
        for a, b in zip(received, expected):
            assert torch.equal(a, b), f"step {step}: outputs differ"
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            assert p.grad is None or torch.equal(p.grad, q.grad), f"step {step}: grad of {name} differs"
        for a, b in zip(received_input_grads, expected_input_grads):
            assert torch.equal(a, b), f"step {step}: input grads differ"
        for (name, a), b in zip(model.named_buffers(), reference.buffers()):
            assert torch.equal(a, b), f"step {step}: buffer {name} differs"
        with torch.no_grad():
            for m in (model, reference):
                for p in m.parameters():
                    p -= 0.1 * p.grad
        model.zero_grad()
        reference.zero_grad()


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("name", ["gpt", "resnet", "mixer", "mlp"])
def test_bitwise_equal_to_eager_float64(name, schedule):
    compiled, reference, sample = _compile(name, torch.float64, schedule)
    _assert_same_training(compiled, reference, sample)


@pytest.mark.parametrize("schedule", ["none", "recompute_all"])
@pytest.mark.parametrize("name", ["gpt", "resnet", "transformer_encoder", "unet", "rnn"])
def test_bitwise_equal_to_eager_float32(name, schedule):
    compiled, reference, sample = _compile(name, torch.float32, schedule)
    _assert_same_training(compiled, reference, sample)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_schedules_gpt(seed):
    model, sample = ZOO["gpt"].build()
    reference = copy.deepcopy(model)
    graph = simplify(capture(copy.deepcopy(model), sample))
    compiled = CompiledModule(model, graph, random_schedule(graph, seed=seed, forget_probability=0.5), sample)
    _assert_same_training(compiled, reference, sample, steps=2)


def test_input_that_requires_grad():
    model, sample = ZOO["multi_io"].build(dtype=torch.float64)
    sample = tuple(t.requires_grad_() if t.is_floating_point() else t for t in sample)
    assert any(t.requires_grad for t in sample)
    reference = copy.deepcopy(model)
    graph = simplify(capture(copy.deepcopy(model), sample))
    compiled = CompiledModule(model, graph, recompute_all_schedule(graph, stress=True), sample)
    _assert_same_training(compiled, reference, sample, steps=2)
    # the same module called with inputs that do not require grad: another variant of the code
    plain = tuple(t.detach() for t in sample)
    _assert_same_training(compiled, reference, plain, steps=1)


def test_generated_code_is_readable_and_registered():
    compiled, _, sample = _compile("gpt", torch.float32, "recompute_all")
    code = compiled.code
    assert "def forward_phase(s, tokens):" in code and "def backward_phase(s):" in code
    assert "aten.linear.default(" in code and "# fwd_linear (no grad)" in code
    assert "# fwd_linear (with grad), recomputation" in code
    assert "# forget linear.data" in code and "# bwd_linear" in code
    assert "rng_set(s.rng_dropout" in code  # a dropout replays its RNG state
    filename = next(iter(compiled._runners.values())).code.filename
    assert linecache.getline(filename, 1).startswith("def forward_phase")


def test_traceback_points_at_generated_line():
    compiled, _, sample = _compile("mlp", torch.float32, "none")
    _, module, attribute = compiled._parameter_refs[0]
    setattr(module, attribute, torch.nn.Parameter(torch.zeros(3, 3)))  # a wrong weight: linear fails
    with pytest.raises(RuntimeError) as info:
        compiled(*sample)
    frames = [entry for entry in info.traceback if str(entry.path).startswith("<rockmate-generated")]
    assert frames and "aten.linear.default" in str(frames[-1].statement)


def test_buffers_updated_once_per_step():
    compiled, reference, sample = _compile("resnet", torch.float32, "recompute_all")
    compiled(*sample)
    reference(*sample)
    for (name, a), b in zip(compiled.model.named_buffers(), reference.buffers()):
        assert torch.equal(a, b), name
    assert compiled.model.stem[1].num_batches_tracked.item() == 1


def test_eval_and_no_grad_run_the_model():
    compiled, reference, sample = _compile("gpt", torch.float32, "none")
    compiled.eval()
    reference.eval()
    assert torch.equal(compiled(*sample), reference(*sample))
    compiled.train()
    reference.train()
    with torch.no_grad():
        seed_everything(0)
        a = compiled(*sample)
        seed_everything(0)
        b = reference(*sample)
    assert torch.equal(a, b) and not a.requires_grad


def test_new_shape_raises():
    compiled, _, sample = _compile("mlp", torch.float32, "none")
    with pytest.raises(ValueError, match=r"shape \[3, 16\].*compiled for shape \[4, 16\].*build Rockmate again"):
        compiled(torch.randn(3, *sample[0].shape[1:]))


def test_unknown_node_raises():
    model, sample = ZOO["mlp"].build()
    graph = simplify(capture(copy.deepcopy(model), sample))
    schedule = Schedule([Compute("fwd_nonexistent"), Compute("loss")])
    with pytest.raises(ScheduleError, match="fwd_nonexistent"):
        CompiledModule(model, graph, schedule, sample)


def _peak_bytes(name: str, schedule: str) -> int:
    compiled, _, sample = _compile(name, torch.float32, schedule)
    seed_everything(0)
    weighted_loss(compiled(*sample)).backward()  # grads allocated, as after a first step
    with AllocationTracker() as tracker:
        weighted_loss(compiled(*sample)).backward()
    return tracker.peak_bytes


def test_recompute_all_uses_less_memory():
    plain = _peak_bytes("gpt", "none")
    recomputed = _peak_bytes("gpt", "recompute_all")
    assert recomputed < 0.8 * plain, (recomputed, plain)


def test_islands_merge_where_the_schedule_allows_and_the_peak_stays():
    """A node read by one node only shares its island (exec.merge) when the schedule runs them
    back to back; the real execution order's simulated peak stays within the plan's."""
    from exec.merge import executed_order
    from rockmate import Rockmate
    from solvers.simulate import simulate

    model, sample = ZOO["gpt"].build()
    reference = copy.deepcopy(model)
    for budget in (10**9, 120_000):
        compiled = Rockmate(copy.deepcopy(model), sample, budget, cost_model="flops")
        runner = next(iter(compiled.compiled._runners.values()))
        whole = compiled.graphs.model_chain.whole_graph()
        order = executed_order(compiled.plan.schedule, runner.merged)
        # the plan's peak: the schedule's, with the generator states kept for the dropouts
        plan = compiled.plan
        # (and the sum of the tied embedding's contributions, for gradient accumulation)
        tied = parameter_sum_key("p_lm_head_weight")
        entries = [entry for entries in plan.first_run_bytes.values() for entry in entries]
        assert entries and all(entry.bytes == torch.get_rng_state().nbytes and entry.only_if_rerun
                               for entry in entries if entry.key != tied)
        assert {entry.key for entry in entries if not entry.only_if_rerun} == {tied}
        with_states = simulate(whole, executed_order(plan.schedule, {}), first_run_bytes=plan.first_run_bytes)
        assert with_states.peak_bytes + plan.held_bytes == plan.predicted_peak
        # merges keep the schedule's own peak
        assert simulate(whole, order).peak_bytes <= simulate(whole, plan.schedule).peak_bytes
        if budget == 10**9:  # no recomputation: every linear chain of single readers merges
            assert len(runner.merged) >= 10
            assert compiled.code.count("one island") >= 2 * len(runner.merged)
    unmerged = CompiledModule(model, compiled.graphs.simplified, compiled.plan.schedule, sample, merge_islands=False)
    assert "one island" not in unmerged.code
    _assert_same_training(unmerged, reference, sample, steps=2)


def test_no_island_reads_one_tensor_twice():
    """Unrolled RNN cells all read the same weights: merging two cells would sum their
    weight gradients before adding them to .grad, which rounds differently from eager."""
    compiled, reference, sample = _compile("rnn", torch.float32, "none")
    runner = next(iter(compiled._runners.values()))
    cells = [a for a, b in runner.merged.items() if "rnn" in a and "rnn" in b]
    assert cells == []
    _assert_same_training(compiled, reference, sample, steps=2)


def test_islands_merge_across_dropout_masks_and_nodes_read_by_several():
    """A dropout's mask is a node without grad that reads its input (it is made like it) and
    runs between the input and the product: the input's island now merges with the product's
    (a reader without grad reads the data the merged island still holds). The query/key and the
    value pieces of one projection, read by two nodes of one chain, are two tensors, not one
    read twice. And a node read with grad by several nodes merges where they all share one
    island (its outputs read directly there, the engine summing their contributions as eager's
    does). The zoo's GPT planned without recomputation: 35 of its 56 nodes merged (26 before:
    21 islands instead of 30), bitwise equal to eager."""
    from exec.merge import chain_heads, grad_readers, merge_candidates, without_shared_reads

    from rockmate import Rockmate

    model, sample = ZOO["gpt"].build()
    reference = copy.deepcopy(model)
    planned = Rockmate(model, sample, 10**9, cost_model="flops")
    compiled, graph = planned.compiled, planned.graphs.simplified
    runner = next(iter(compiled._runners.values()))
    infos = runner.infos
    readers = graph.readers()
    # the inputs of the dropouts' products, read by their masks (without grad) too
    into_dropouts = [a for a, b in runner.merged.items()
                     if any(not infos[r].requires_grad for r in readers[a]) and b.startswith("dropout")]
    assert len(into_dropouts) >= 4, runner.merged
    chains = without_shared_reads(graph, merge_candidates(graph, infos))
    assert "dropout_1" in chains  # the attention's chain: q and k read by its first matmul, v by its last
    # a node read with grad by several nodes of one island merges into it: the projection
    # (query and key read by the first matmul, value by the last), the residual stream (read by
    # the next layer norm and by the next addition)
    assert runner.merged.get("linear") == "matmul" and "dropout" in runner.merged
    heads = chain_heads(runner.merged)
    assert all(heads[reader] == heads["linear"] for reader in grad_readers(graph, infos)["linear"])
    assert len(runner.merged) >= 35
    _assert_same_training(compiled, reference, sample, steps=3)


def test_a_node_read_outside_its_island_keeps_its_leaves():
    """``x`` read with grad by ``r1`` and ``r3``: merged into ``r1``'s island only where ``r3``
    is in it too (its outputs are then read directly by both); a dropped merge splits an island,
    which may leave another node's reader outside in turn."""
    from exec.merge import chain_heads, closed_merges

    readers = {"x": ["r1", "r3"], "r1": ["r2"], "r2": ["r3"], "w": ["x"]}
    assert closed_merges({"x": "r1", "r1": "r2", "r2": "r3"}, readers) == {"x": "r1", "r1": "r2", "r2": "r3"}
    assert closed_merges({"x": "r1", "r1": "r2"}, readers) == {"r1": "r2"}
    # w -> x stands alone once x leaves r1's island
    assert closed_merges({"w": "x", "x": "r1", "r1": "r2"}, readers) == {"w": "x", "r1": "r2"}
    assert chain_heads({"w": "x", "r1": "r2"}) == {"w": "w", "x": "w", "r1": "r1", "r2": "r1"}


def test_executed_order_runs_a_merged_chain_at_its_last_backward():
    from exec.merge import executed_order
    from solvers.schedule import Forget

    ops = [Compute("fwd_a"), Compute("fwd_b"), Compute("fwd_c"), Compute("loss"),
           Compute("bwd_c"), Forget("c.grad"), Compute("bwd_b"), Forget("b.grad"), Forget("b.data"),
           Compute("bwd_a"), Forget("a.grad")]
    order = executed_order(Schedule(ops), {"a": "b", "b": "c"})
    assert [str(getattr(op, "node")) for op in order.ops[4:]] == [
        "bwd_c", "bwd_b", "bwd_a", "c.grad", "b.grad", "b.data", "a.grad"]


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return h, self.b(h)


def test_a_loss_that_reads_a_cat_of_the_outputs_is_warned_about():
    """The plan frees each output's gradient once used (exec.runtime); a loss that makes them
    as slices of one tensor keeps it alive longer: said, with the bytes at stake. A loss per
    output (each gradient its own storage) is not warned about, nor an expanded scalar's."""
    import warnings

    from rockmate import Rockmate

    torch.manual_seed(0)
    model, x = _TwoHeads(), torch.randn(4, 8)
    rk = Rockmate(copy.deepcopy(model), x, 10**9, cost_model="flops")
    with pytest.warns(UserWarning, match=r"gradient of output 0 is part of a bigger tensor .* up to 128 B"):
        (torch.cat(rk(x), dim=-1) ** 2).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h, y = rk(x)
        ((h ** 2).sum() + (y ** 2).sum()).backward()
        h, y = rk(x)
        (h.sum() + y.mean()).backward()


def test_the_dense_layout_test_agrees_with_torchs():
    """``rkgb.gradsink.non_overlapping_and_dense`` (c10's test in Python, instead of torch's own
    Python test, ~50 us a call on every transposed gradient) on random strided views and
    permuted tensors: the same answer as ``torch._prims_common``'s."""
    import itertools
    import random

    from torch._prims_common import is_non_overlapping_and_dense_or_false

    from rkgb.gradsink import non_overlapping_and_dense

    generator, storage, checked = random.Random(0), torch.empty(1000), 0
    for _ in range(2000):
        dim = generator.randint(1, 4)
        sizes = [generator.choice([0, 1, 2, 3, 4]) for _ in range(dim)]
        strides = [generator.choice([0, 1, 2, 3, 4, 6, 8, 12, 16, 24]) for _ in range(dim)]
        views = [storage.as_strided(sizes, strides)] + [torch.empty(sizes).permute(*order)
                                                         for order in itertools.permutations(range(dim))]
        for view in views:
            assert non_overlapping_and_dense(view) == bool(is_non_overlapping_and_dense_or_false(view)), \
                (list(view.shape), view.stride())
            checked += 1
    assert checked > 4000


def test_gradient_node_is_torchs_gradient_edge_node():
    """``rkgb.gradsink.gradient_node`` (the leaves' AccumulateGrad without torch's context
    manager) is ``get_gradient_edge(t).node`` for leaves, parameters and results, under grad and
    without it, and leaves the grad mode as it found it."""
    from torch.autograd.graph import get_gradient_edge

    from rkgb.gradsink import gradient_node

    parameter = torch.nn.Parameter(torch.randn(3))
    for enabled in (True, False):
        with torch.set_grad_enabled(enabled):
            leaf = torch.randn(2, 3).requires_grad_()
            with torch.enable_grad():
                result = leaf * parameter
            for tensor in (leaf, parameter, result):
                node = gradient_node(tensor)
                assert node is get_gradient_edge(tensor).node and node is gradient_node(tensor)
                assert torch.is_grad_enabled() is enabled
