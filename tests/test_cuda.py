"""Rockmate on a CUDA device: bitwise-exact training and the budget as the CUDA caching allocator
counts it (``torch.cuda.max_memory_allocated``), on the zoo. Skipped where there is no GPU (CI);
``benchmarks/gpu_check.py`` runs the same checks on larger presets and times the steps."""

from __future__ import annotations

import pytest
import torch

from exactness import check_training
from rockmate import Rockmate
from zoo import ZOO

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`:FutureWarning"),
]


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.3])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_exact_and_under_budget_on_cuda(name, fraction):
    model, sample = ZOO[name].build(device="cuda")
    report = check_training(model, sample, fraction, at_minimum=True)
    assert all(peak <= report.budget + 2048 for peak in report.measured_peaks)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_other_dtypes_on_cuda(dtype):
    model, sample = ZOO["gpt"].build(dtype=dtype, device="cuda")
    check_training(model, sample, 0.5, at_minimum=True)


def test_planning_leaves_the_users_cuda_generator_alone():
    """Planning runs the model (dropout draws): the user's CUDA random state is as before."""
    model, sample = ZOO["gpt"].build(device="cuda")
    torch.cuda.manual_seed(7)
    before = torch.cuda.get_rng_state()
    Rockmate(model, sample, "50%")
    assert torch.equal(torch.cuda.get_rng_state(), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_branch_on_shape_determined_values_beside_fused_attention_on_cuda(dtype):
    """The capture takes the branch as eager does by propagating real values (test_graph_shapes'
    _CausalUnlessPacked, transformers 5's packed-sequence test): through CUDA's fused attention
    kernels that failed (their random-state outputs against their fake kernels', BART on an H200,
    torch 2.11), so the math kernel runs while real values propagate; the graph keeps the
    composite attention, whose kernel is chosen at run time. Eager's is_causal branch, bitwise."""
    import re

    from test_graph_shapes import _CausalUnlessPacked

    torch.manual_seed(0)
    x = torch.randn(2, 12, 16, device="cuda", dtype=dtype)
    model = _CausalUnlessPacked().to(device="cuda", dtype=dtype)
    code = Rockmate(model, x, "1GB", solver="none").code
    assert re.search(r"scaled_dot_product_attention\.default\(\w+, \w+, \w+, None, 0\.0, True\)", code)
    check_training(_CausalUnlessPacked().to(device="cuda", dtype=dtype), (x,), 0.0, at_minimum=True)
