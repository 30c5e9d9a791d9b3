"""The simulator: literal figures on tiny graphs, and every invalid schedule is rejected by name."""

import pytest

from solvers.schedule import Compute, Forget, Schedule
from solvers.simulate import InvalidSchedule, schedule_from_computes, simulate
from solvers.toy_graphs import linear_graph, multi_output_graph, residual_graph, split_graph


def autograd_ops():
    return [
        Compute("fwd_n1"),
        Compute("fwd_n2"),
        Compute("loss"),
        Compute("bwd_n2"),
        Forget("n2.phantoms"),
        Forget("n2.grad"),
        Forget("n2.data"),
        Compute("bwd_n1"),
        Forget("n1.phantoms"),
        Forget("n1.grad"),
        Forget("n1.data"),
    ]


def test_literal_peak_and_time():
    # in(10) -> n1(10, phantoms 5) -> n2(10, phantoms 5); bwd_n2 reads n1, bwd_n1 reads in
    g = linear_graph(2)
    result = simulate(g, Schedule(autograd_ops()), keep_outputs=False)
    # fwd_n1: 15; fwd_n2: 15 + 15 = 30; loss: 30 + 10 (n2.grad) = 40;
    # bwd_n2: 40 + 10 (n1.grad) = 50 -> peak 50
    assert result.memory_during[:4] == [15, 30, 40, 50]
    assert result.peak_bytes == 50
    assert result.saved_bytes == 30
    assert result.time_s == pytest.approx(2.0 + 3.0 + 0.0 + 2.0 + 2.0)
    # at the end only the input grad is alive (plus the input, not counted)
    assert result.alive_at_end == {"in.data", "in.grad"}


def test_recomputation_counts_twice_while_it_runs():
    g = linear_graph(1)
    ops = [Compute("fwd_n1", False), Compute("fwd_n1"), Compute("loss")]
    result = simulate(g, ops, keep_outputs=False)
    # second forward: 10 alive + 10 (new data) + 5 (phantoms)
    assert result.memory_during[1] == 25
    assert result.saved_bytes == 15


def test_greedy_schedule_is_valid_and_frees_everything():
    g = multi_output_graph()
    schedule = schedule_from_computes(g, [c.name for c in g.compute_nodes], protected=set(g.input_grads))
    result = simulate(g, schedule, keep_outputs=False)
    assert result.alive_at_end == {"in.data", "in.grad"}


@pytest.mark.parametrize(
    "ops, message",
    [
        ([Compute("fwd_n2")], "operation 0 (Compute(node='fwd_n2', with_grad=True)): needs 'n1.data'"),
        ([Compute("fwd_n1"), Forget("n1.data"), Forget("n1.data")], "operation 2 (Forget(node='n1.data')): 'n1.data' is not alive"),
        ([Compute("fwd_n1"), Forget("n1.data"), Compute("fwd_n2")], "operation 2 (Compute(node='fwd_n2', with_grad=True)): needs 'n1.data'"),
        ([Compute("fwd_x")], "unknown compute node 'fwd_x'"),
        ([Forget("nope.data")], "unknown data node 'nope.data'"),
        ([Forget("in.data")], "is an input of the graph"),
        ([Compute("fwd_n1"), Compute("fwd_n2"), Forget("n2.data")], "is a model output"),
        ([Compute("fwd_n1"), Compute("fwd_n2"), Compute("loss"), Compute("loss")], "already ran"),
        ([Compute("fwd_n1"), Compute("fwd_n2", False), Compute("loss"), Compute("bwd_n2")], "needs 'n2.phantoms'"),
        (
            [Compute("fwd_n1"), Compute("fwd_n2"), Compute("loss"), Compute("bwd_n2"), Compute("bwd_n2")],
            "operation 4 (Compute(node='bwd_n2', with_grad=True)): 'bwd_n2' already ran",
        ),
    ],
)
def test_invalid_schedules_name_the_operation(ops, message):
    g = linear_graph(2)
    with pytest.raises(InvalidSchedule) as error:
        simulate(g, ops, keep_outputs=True)
    assert message in str(error.value)


def test_consumed_phantoms_cannot_serve_again():
    g = linear_graph(1)
    # bwd_n1 runs once, so consume via a second graph-level check: phantoms consumed flag
    ops = [Compute("fwd_n1"), Compute("loss"), Compute("bwd_n1"), Compute("bwd_n1")]
    with pytest.raises(InvalidSchedule, match="already ran"):
        simulate(g, ops, keep_outputs=False)


def test_lost_gradient_contribution_is_rejected():
    # in is read by two nodes: its grad accumulates; forgetting it in between loses a part
    from solvers.toy_graphs import NodeSpec, graph_from_specs

    g = graph_from_specs(
        [NodeSpec("a", ["in"], 4), NodeSpec("b", ["in", "a"], 4)], 4, name="accumulate"
    )
    ops = [
        Compute("fwd_a"), Compute("fwd_b"), Compute("loss"), Compute("bwd_b"),
        Forget("in.grad"), Compute("bwd_a"),
    ]
    with pytest.raises(InvalidSchedule, match="accumulates into gradient 'in.grad'"):
        simulate(g, ops, keep_outputs=False)


def _autograd_memory(graph):
    schedule = schedule_from_computes(graph, [c.name for c in graph.compute_nodes], protected=set(graph.input_grads))
    result = simulate(graph, schedule, keep_outputs=False)
    return {str(op): m for op, m in zip(schedule.ops, result.memory_during)}, result


def test_an_add_passes_one_gradient_to_both_inputs():
    # r = in + a: bwd_r's contributions to in.grad and a.grad are r.grad itself (6 bytes once)
    memory, result = _autograd_memory(residual_graph())
    alive_before = 8  # a.phantoms 2 + r.grad 6
    assert memory[str(Compute("bwd_r"))] == alive_before
    assert memory[str(Forget("r.grad"))] == alive_before  # in.grad and a.grad still hold it
    # bwd_a's contribution to in.grad is a new 6-byte tensor, which waits (as eager's engine
    # adds a node's outputs only after releasing its inputs) while the shared one lives on
    assert memory[str(Compute("bwd_a"))] == alive_before + 6
    assert memory[str(Forget("a.grad"))] == 2 + 6 + 6
    assert memory[str(Forget("a.phantoms"))] == 6 + 6
    # at the end it joins in.grad out of place (a sum of 6 while both live: 18), then the
    # shared tensor and the contribution go
    assert result.memory_at_end == 6 and result.peak_bytes == 25


def test_gradient_parts_and_partial_contributions():
    # s.grad is two tensors of 4: bwd_o's first contribution to part 1 is o.grad itself,
    # bwd_t's to part 0 is new
    memory, result = _autograd_memory(split_graph())
    assert memory[str(Compute("bwd_o"))] == 17  # s 8 + s.phantoms 2 + t.phantoms 3 + o.grad 4
    assert memory[str(Compute("bwd_t"))] == 21  # + part 0 of s.grad
    assert memory[str(Forget("t.grad"))] == 21  # part 1 of s.grad still holds o.grad's tensor
    assert result.peak_bytes == 21 and result.memory_at_end == 8


def test_forward_without_grad_has_its_own_temporary_memory():
    g = residual_graph()
    with_grad = simulate(g, [Compute("fwd_a")], keep_outputs=False).memory_during[0]
    without = simulate(g, [Compute("fwd_a", False)], keep_outputs=False).memory_during[0]
    assert (with_grad, without) == (6 + 2 + 1, 6 + 3)
