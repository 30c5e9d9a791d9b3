"""``solver="articulation"``: greedy checkpoints at articulation points (OpenAI's gradient
checkpointing, Bulatov and Salimans 2018), run exactly."""

from __future__ import annotations

import pytest

from exactness import check_training
from solvers.articulation import greedy_checkpoints
from solvers.rotor_dp import BlockCosts, ChainCosts, OptionCosts, strategy_peak
from solvers.sqrt_segments import segment_actions
from zoo import ZOO


def _chain(sizes: list[int]) -> ChainCosts:
    """A chain whose block k keeps ``sizes[k]`` bytes for its backward and outputs as much."""
    blocks = [BlockCosts(options=[OptionCosts(forward_peak=s, backward_peak=2 * s, saved=s, end=s,
                                              forward_time=1.0, backward_time=2.0)],
                         no_grad_peak=s, no_grad_time=1.0, output_bytes=s, output_grad_bytes=s, class_key=k)
              for k, s in enumerate(sizes)]
    return ChainCosts(blocks, loss_time=0.0, loss_overhead=0)


def test_greedy_adds_the_checkpoint_that_lowers_the_peak_most():
    costs = _chain([100, 10, 100, 10, 100, 10])
    path = greedy_checkpoints(costs, 6)
    assert path[0][0] == [0]  # no checkpoint: no recomputation
    assert len(path) == 6 and path[-1][0] == [0, 1, 2, 3, 4, 5]
    peaks = [peak for _, peak in path]
    for starts, peak in path:  # each step's peak is the DP model's of its segments
        assert peak == strategy_peak(costs, segment_actions(6, starts))
    # the first checkpoint is the best single one
    best = min(strategy_peak(costs, segment_actions(6, [0, k])) for k in range(1, 6))
    assert peaks[1] == best < peaks[0]


@pytest.mark.parametrize("name", ["gpt", "rnn"])
def test_articulation_is_exact_and_under_budget(name):
    """At 50% of eager's peak (or its minimum): bitwise over 3 steps, the allocator's peak
    within the budget."""
    model, sample = ZOO[name].build()
    report = check_training(model, sample, 0.5, "articulation", steps=3, at_minimum=True)
    plan = report.compiled.plan
    assert plan.solver == "articulation"
    assert plan.predicted_peak <= report.budget
