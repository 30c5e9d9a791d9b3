"""The repairs' figures of a sequence of computes equal the simulator's, on every kind of graph.

:class:`solvers.stage_figures.StageFigures` follows only the data the forwards make and takes
the gradients' memory from :func:`solvers.simulate.gradient_profile`; these tests replay the
same sequences in the simulator (schedule, peaks, saved and end bytes, times, the peak's place,
the data alive where each stage starts, at the peak and at the loss) and compare every figure.
"""

from __future__ import annotations

import random

import pytest

from rkgb.build import build
from rkgb.cdgraph import ComputeKind
from solvers.options import option_from_computes
from solvers.schedule import Forget
from solvers.simulate import InvalidSchedule, operation_outputs, schedule_from_computes, simulate
from solvers.stage_figures import StageFigures
from solvers.toy_graphs import (
    attention_like_graph,
    diamond_graph,
    linear_graph,
    multi_output_graph,
    random_graph,
    residual_graph,
    split_graph,
)
from zoo import ZOO


def simulated(graph, computes):
    """The simulator's figures of ``computes`` and its replay's alive sets (as the repairs read
    them before :mod:`solvers.stage_figures`), or None where it refuses the sequence."""
    try:
        option = option_from_computes(graph, computes)
    except InvalidSchedule:
        return None
    schedule = schedule_from_computes(graph, computes, protected=set(graph.input_grads))
    result = simulate(graph, schedule, keep_outputs=False)
    index = {c.name: i for i, c in enumerate(graph.compute_nodes)}
    alive, starts, at_peak, peak_position, stage, position = set(graph.input_data), [], set(), -1, 0, 0
    for i, op in enumerate(schedule.ops):
        if isinstance(op, Forget):
            alive.discard(op.node)
            continue
        while len(starts) <= stage:
            starts.append(set(alive))
        if i == result.peak_index:
            at_peak, peak_position = set(alive), position
        stage += index[op.node] == stage
        alive.update(operation_outputs(graph, graph.compute(op.node), op.with_grad))
        position += 1
    return option, result, starts, at_peak, peak_position


def random_sequences(graph, rng: random.Random, count: int):
    """``count`` sequences of the graph's own order with random recomputations before each stage."""
    nodes = graph.compute_nodes
    forwards = [i for i, c in enumerate(nodes) if c.kind is ComputeKind.FORWARD]
    for _ in range(count):
        chance = rng.choice([0.02, 0.05, 0.1, 0.3])
        positions, stage_of = [], []
        for t in range(len(nodes)):
            extra = sorted(k for k in forwards if k < t and rng.random() < chance)
            positions += extra + [t]
            stage_of += [t] * (len(extra) + 1)
        yield positions, stage_of


def assert_same_figures(graph, count: int, seed: int = 0) -> int:
    figures = StageFigures(graph)
    followed = set(figures.names) | set(graph.input_data)
    nodes = graph.compute_nodes
    compared = 0
    for positions, stage_of in random_sequences(graph, random.Random(seed), count):
        mine = figures.figures(positions, stage_of)
        reference = simulated(graph, [nodes[k].name for k in positions])
        assert (mine is None) == (reference is None)
        if mine is None:
            continue
        option, result, starts, at_peak, peak_position = reference
        assert (mine.forward_peak_bytes, mine.backward_peak_bytes, mine.saved_bytes, mine.end_bytes,
                round(mine.forward_time_s, 15), round(mine.backward_time_s, 15)) == option.key()
        assert (mine.peak_bytes, mine.time_s) == (option.peak_bytes, option.time_s)
        assert mine.schedule_peak_bytes == result.peak_bytes
        assert mine.peak_position == peak_position
        if peak_position >= 0:
            assert figures.alive(mine.alive_at_peak) == at_peak & followed
        assert [figures.alive(mask) for mask in mine.stage_starts] == [s & followed for s in starts]
        assert figures.alive(mine.alive_at_loss) == result.alive_after_forward & followed
        compared += 1
    return compared


@pytest.mark.parametrize("make", [lambda: linear_graph(6), diamond_graph, multi_output_graph, residual_graph,
                                  split_graph, attention_like_graph],
                         ids=["linear", "diamond", "multi_output", "residual", "split", "attention_like"])
def test_figures_of_toy_graphs_are_the_simulators(make):
    assert assert_same_figures(make(), 150) == 150


@pytest.mark.parametrize("seed", range(8))
def test_figures_of_random_graphs_are_the_simulators(seed):
    graph = random_graph(random.Random(seed), 8 + 2 * seed, name=f"random{seed}")
    assert assert_same_figures(graph, 100, seed) == 100


@pytest.mark.parametrize("name", ["gpt", "transformer_encoder", "mixer", "resnet"])
def test_figures_of_the_zoos_classes_are_the_simulators(name):
    """Real blocks: phantoms, dropout masks, gradients that alias their inputs' (views, adds),
    contributions summed into gradients held elsewhere, batch norms."""
    model, sample = ZOO[name].build("tiny")
    chain = build(model, sample, cost_model="flops").model_chain
    compared = sum(assert_same_figures(graph, 40, seed) for seed, graph in enumerate(chain.classes))
    assert compared == 40 * len(chain.classes)
