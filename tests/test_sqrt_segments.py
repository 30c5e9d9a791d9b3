"""``solver="sqrt"``: checkpoint_sequential's segments (Chen et al., 2016), run exactly."""

from __future__ import annotations

import pytest

from exactness import check_training
from solvers.rotor_dp import ChainAction
from solvers.sqrt_segments import segment_actions, segment_bounds
from zoo import ZOO


def test_segments_are_cut_as_checkpoint_sequential_cuts():
    assert segment_bounds(9, 3) == [0, 3, 6]
    assert segment_bounds(10, 3) == [0, 3, 6]  # the last segment takes the rest
    assert segment_bounds(4, 9) == [0, 1, 2, 3]
    actions = segment_actions(4, [0, 2])
    kinds = [(a.kind, a.block) for a in actions]
    # blocks 0-1 without grad (block 1 forgets its input), 2-3 with autograd, the loss, their
    # backwards, then block 1's output forgotten and blocks 0-1 again with autograd
    assert kinds == [("no_grad", 0), ("no_grad", 1), ("forward", 2), ("forward", 3), ("loss", -1),
                     ("backward", 3), ("backward", 2), ("forget_output", 1), ("forward", 0), ("forward", 1),
                     ("backward", 1), ("backward", 0)]
    assert actions[1] == ChainAction("no_grad", 1, forget_input=True)


@pytest.mark.parametrize("name", ["gpt", "rnn"])
def test_sqrt_is_exact_and_under_budget(name):
    """At 50% of eager's peak (or the fewest segments' minimum): bitwise over 3 steps, the
    allocator's peak within the budget."""
    model, sample = ZOO[name].build()
    report = check_training(model, sample, 0.5, "sqrt", steps=3, at_minimum=True)
    assert report.compiled.plan.solver == "sqrt"
