"""Property-based fuzzing of the whole pipeline on random models (:mod:`random_models`).

Property: for a random model, random dtype and input, at a random fraction of eager's peak,
either Rockmate trains it exactly (bitwise outputs, parameter and input gradients and buffers
over two steps) within the budget as the allocator measures it, at the fraction or at the
minimum that ``InfeasibleBudget`` gives; or it raises a named ``CaptureError`` or
``UnsupportedOperation``. Any other exception is a failure, and so is a plan without
recomputation predicted above eager's allocator peak, or a minimum above that plan's peak.

The ``ci`` profile (the default) runs a fixed-seed set of examples; ``--hypothesis-profile=long``
runs 2000 (``benchmarks/fuzz.py`` reports that run's figures).
"""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from random_models import check_program, programs  # noqa: E402

# the profiles ("ci", the default, and "long") are registered in conftest.py

# small option grids: the property is about exactness and the budget, not the plan's quality
GRID = dict(peak_steps=3, save_steps=3)


@given(program=programs(), fraction=st.sampled_from([0.0, 0.3, 0.5, 0.8, 1.0]))
def test_random_models_are_exact_and_within_budget(program, fraction):
    check_program(program, fraction, **GRID)
