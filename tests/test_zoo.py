"""Tests of the model zoo: every model trains eagerly, is finite, and exports exactly."""

from __future__ import annotations

import time

import pytest
import torch

from zoo import ZOO, Attention, GPTConfig, gpt_config, weighted_loss

DTYPES = [torch.float32, torch.float64]

# torch.export's own deprecation noise (torch 2.13), not ours.
pytestmark = pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`:FutureWarning")


def _as_tuple(outputs):
    return outputs if isinstance(outputs, tuple) else (outputs,)


def _run_seeded(module, sample, seed=1234):
    torch.manual_seed(seed)
    return _as_tuple(module(*sample))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(ZOO))
def test_eager_forward_backward(name, dtype):
    model, sample = ZOO[name].build(dtype=dtype)
    assert model.training
    outputs = _as_tuple(model(*sample))
    assert all(o.dtype == dtype and torch.isfinite(o).all() for o in outputs)
    weighted_loss(outputs).backward()
    for parameter_name, parameter in model.named_parameters():
        assert parameter.dtype == dtype, parameter_name
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), parameter_name
    for tensor in sample:
        assert tensor.dtype in (dtype, torch.int64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(ZOO))
def test_export_matches_eager_bitwise(name, dtype):
    """torch.export (strict=False, train mode) and its decomposition replay eager exactly."""
    model, sample = ZOO[name].build(dtype=dtype)
    program = torch.export.export(model, sample, strict=False)
    decomposed = program.run_decompositions({})
    expected = _run_seeded(model, sample)
    for exported in (program.module(), decomposed.module()):
        actual = _run_seeded(exported, sample)
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert torch.equal(a, e)
    if ZOO[name].has_dropout:  # the seed matters: dropout is active
        assert not all(torch.equal(a, e) for a, e in zip(_run_seeded(model, sample, 99), expected))


def test_gpt_with_scaled_dot_product_attention_exports_exactly():
    model, sample = ZOO["gpt"].build(attention="sdpa")
    assert model.blocks[0].attn.attention is Attention.SDPA
    decomposed = torch.export.export(model, sample, strict=False).run_decompositions({})
    assert torch.equal(_run_seeded(decomposed.module(), sample)[0], _run_seeded(model, sample)[0])


def test_gpt_lm_head_is_tied_to_the_token_embedding():
    model = ZOO["gpt"].make_model()
    assert model.lm_head.weight is model.token_embedding.weight
    weighted_loss(model(*ZOO["gpt"].make_sample())).backward()
    assert model.token_embedding.weight.grad is model.lm_head.weight.grad


def test_gpt_configs():
    assert gpt_config() == GPTConfig()
    small = gpt_config("small")
    assert (small.n_layer, small.d_model, small.n_head) == (12, 768, 12)
    assert (small.seq_len, small.batch, small.vocab) == (256, 2, 50257)
    assert gpt_config("small", n_layer=2).n_layer == 2
    with pytest.raises(ValueError, match="multiple of n_head"):
        gpt_config(d_model=30)


def test_sample_shapes_follow_overrides():
    (tokens,) = ZOO["gpt"].make_sample(batch=3, seq_len=5)
    assert tokens.shape == (3, 5) and tokens.dtype == torch.int64
    a, b = ZOO["multi_io"].make_sample(torch.float64, batch=5)
    assert a.shape == (5, 16) and b.shape == (5, 4, 8) and a.dtype == b.dtype == torch.float64
    assert ZOO["rnn"].make_sample(steps=3)[0].shape == (2, 3, 16)


def test_every_preset_is_a_valid_configuration():
    for entry in ZOO.values():
        assert {"tiny", "bench"} <= set(entry.presets)
        for preset in entry.presets:
            entry.config(preset)


def test_bad_names_are_reported():
    with pytest.raises(TypeError, match="unknown configuration fields \\['n_layers'\\]"):
        ZOO["gpt"].make_model(n_layers=3)
    with pytest.raises(KeyError, match="unknown preset 'huge'"):
        ZOO["mlp"].make_model(preset="huge")


def test_models_and_samples_are_reproducible_and_leave_the_global_rng_alone():
    state = torch.get_rng_state()
    first, second = ZOO["mixer"].build(), ZOO["mixer"].build()
    assert torch.equal(torch.get_rng_state(), state)
    for p, q in zip(first[0].parameters(), second[0].parameters()):
        assert torch.equal(p, q)
    assert torch.equal(first[1][0], second[1][0])
    other = ZOO["mixer"].make_model(seed=1)
    assert not torch.equal(next(other.parameters()), next(first[0].parameters()))


def test_weighted_loss_is_fixed_and_covers_every_output():
    outputs = (torch.ones(2, 3), torch.ones(4, dtype=torch.int64), [torch.ones(5)])
    assert torch.equal(weighted_loss(outputs), weighted_loss(outputs))
    assert weighted_loss(outputs) != weighted_loss(outputs, seed=1)
    with pytest.raises(ValueError, match="no floating-point tensor"):
        weighted_loss(torch.ones(2, dtype=torch.int64))


@pytest.mark.parametrize("name", sorted(ZOO))
def test_tiny_models_are_fast(name):
    """A forward + backward well under 50 ms (about 4 ms each on one core; see conftest)."""
    model, sample = ZOO[name].build()
    weighted_loss(model(*sample)).backward()  # warm up
    best_s = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        weighted_loss(model(*sample)).backward()
        best_s = min(best_s, time.perf_counter() - start)
    assert best_s < 0.05
