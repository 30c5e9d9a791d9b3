"""The gradient layouts (:func:`rkgb.inspect.gradient_layouts`) of a model on the CPU come from a
run on meta tensors: they must be those of the run on fake tensors of the model's own device,
the reference (the same meta functions, but an op whose composite chooses its kernel by device,
the attention, chooses otherwise on the meta device)."""

from __future__ import annotations

import pytest
import torch

import rkgb.build
from rockmate import Rockmate
from zoo import ZOO


def _layouts_of_both_runs(monkeypatch) -> list[dict]:
    """Patch the build so that it finds each graph's layouts on meta tensors and on fake tensors;
    returns the list that gets, per build, ``{on_meta: (layouts, receivers, unreached)}``."""
    runs: list[dict] = []
    original = rkgb.build.gradient_layouts

    def both(graph, model, sample, receivers=None, unreached=None):
        found = {}
        for on_meta in (True, False):
            reached, missed = set(), set()
            found[on_meta] = (original(graph, model, sample, reached, missed, on_meta=on_meta), reached, missed)
        runs.append(found)
        layouts, reached, missed = found[True]
        if receivers is not None:
            receivers.update(reached)
        if unreached is not None:
            unreached.update(missed)
        return layouts

    monkeypatch.setattr(rkgb.build, "gradient_layouts", both)
    return runs


def _assert_the_same(runs: list[dict]) -> None:
    assert runs, "no gradient layouts were found"
    for found in runs:
        meta, fake = found[True], found[False]
        assert meta[0] is not None, "the run on meta tensors failed"
        assert fake[0] is not None
        differing = {name: (meta[0].get(name), fake[0].get(name)) for name in set(meta[0]) | set(fake[0])
                     if meta[0].get(name) != fake[0].get(name)}
        assert not differing, f"layouts on meta tensors against fake tensors': {differing}"
        assert meta[1] == fake[1], "the gradients' receivers differ"
        assert meta[2] == fake[2], "the outputs that the loss's backward does not reach differ"


@pytest.mark.parametrize("name", ["resnet", "transformer_encoder", "unet", "rnn", "multi_io", "gpt"])
def test_zoo_models_get_the_layouts_of_fake_tensors_from_meta_tensors(monkeypatch, name):
    runs = _layouts_of_both_runs(monkeypatch)
    model, sample = ZOO[name].build("tiny")
    Rockmate(model, sample, "10GB", solver="none", cost_model="flops")
    _assert_the_same(runs)


# the attention in its three kernels on the CPU: flash with a causal flag (rotary Llama, GQA),
# flash with a float mask (BART, CLIP's vision tower: a sequence of 17), math (GPT-2's eager)
@pytest.mark.parametrize("name", ["llama", "bart", "clip_vision", "gpt2", "whisper"])
def test_transformers_attention_gets_the_layouts_of_fake_tensors_from_meta_tensors(monkeypatch, name):
    pytest.importorskip("transformers")
    from test_transformers import MODELS

    runs = _layouts_of_both_runs(monkeypatch)
    torch.manual_seed(0)
    model, call = MODELS[name]()
    Rockmate(model.train(), call, "10GB", solver="none", cost_model="flops")
    _assert_the_same(runs)


def test_a_failed_run_on_meta_tensors_leaves_the_layouts_to_fake_tensors(monkeypatch):
    """Where the meta run fails halfway (an op without a meta function; here, the backward of the
    first matrix product made to fail), the fake run finds the layouts: the same layouts and
    receivers as a run on fake tensors alone."""
    import rkgb.inspect

    model, sample = ZOO["gpt"].build("tiny")
    found: list = []
    original = rkgb.build.gradient_layouts

    def record(graph, model, sample, receivers=None, unreached=None):
        reached = set()
        reference = original(graph, model, sample, reached, set(), on_meta=False)
        layouts = original(graph, model, sample, receivers, unreached)
        found.append((layouts, reference, set(receivers), reached))
        return layouts

    dispatch = rkgb.inspect._FactoriesOnMeta.__torch_dispatch__
    failures = []

    def failing(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default and not torch.is_grad_enabled():
            failures.append(func)
            raise NotImplementedError("no meta function (a test)")
        return dispatch(self, func, types, args, kwargs)

    monkeypatch.setattr(rkgb.inspect._FactoriesOnMeta, "__torch_dispatch__", failing)
    monkeypatch.setattr(rkgb.build, "gradient_layouts", record)
    Rockmate(model, sample, "10GB", solver="none", cost_model="flops")
    (layouts, reference, receivers, reached), = found
    assert failures == [torch.ops.aten.mm.default]
    assert layouts is not None and layouts == reference
    assert receivers == reached and receivers
