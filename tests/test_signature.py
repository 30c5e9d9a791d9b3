"""Models called as their users call them: keyword inputs, non-tensor arguments, structured outputs.

``Rockmate(model, {"x": ..., "labels": ...}, budget)`` (or ``args=``/``kwargs=``) returns a
module called with the same arguments as the model, returning the model's output structure;
outputs and gradients bitwise equal to eager's over several steps (dropout included); a call
that differs from the sample in structure or in a non-tensor value is a clear error.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rockmate import Rockmate, min_budget


class KeywordModel(nn.Module):
    """``model(x, mask=..., scale=..., labels=...)`` -> dict with a loss when given labels."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.drop = nn.Dropout(0.2)

    def forward(self, x, mask=None, scale=1.0, labels=None, extra=()):
        h = self.drop(torch.relu(self.a(x))) * scale
        if mask is not None:
            h = h * mask
        logits = self.b(h)
        out = {"logits": logits, "hidden": [h, h.sum(-1)]}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits.reshape(-1, 4), labels.reshape(-1))
        return out


def _keyword_sample():
    generator = torch.Generator().manual_seed(0)
    return dict(x=torch.randn(2, 5, 8, generator=generator), mask=torch.ones(2, 5, 1),
                scale=2.0, labels=torch.randint(0, 4, (2, 5), generator=generator))


def _train_both(model, compiled, call, loss_of, steps=3):
    reference = copy.deepcopy(model)
    for step in range(steps):
        torch.manual_seed(step)
        expected = reference(**call)
        torch.manual_seed(step)
        got = compiled(**call)
        yield expected, got
        loss_of(expected).backward()
        loss_of(got).backward()
        for (path, a), b in zip(reference.named_parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad), f"step {step}: gradient of {path}"


def test_keyword_inputs_and_dict_outputs_are_exact():
    torch.manual_seed(0)
    model = KeywordModel().train()
    sample = _keyword_sample()
    budget = min_budget(copy.deepcopy(model), sample, cost_model="flops")
    compiled = Rockmate(model, sample, budget, cost_model="flops")
    for expected, got in _train_both(model, compiled, sample, lambda out: out["loss"] + out["hidden"][1].sum()):
        assert type(got) is dict and sorted(got) == ["hidden", "logits", "loss"]
        assert isinstance(got["hidden"], list) and len(got["hidden"]) == 2
        for key in ("logits", "loss"):
            assert torch.equal(expected[key], got[key]), key
        assert torch.equal(expected["hidden"][0], got["hidden"][0])
    assert compiled.model is model


def test_args_and_kwargs_together():
    torch.manual_seed(0)
    model = KeywordModel().train()
    sample = _keyword_sample()
    x = sample.pop("x")
    compiled = Rockmate(model, args=(x,), kwargs=sample, budget="1GB", cost_model="flops")
    torch.manual_seed(1)
    got = compiled(x, **sample)
    torch.manual_seed(1)
    assert torch.equal(copy.deepcopy(model)(x, **sample)["loss"], got["loss"])


def test_a_call_unlike_the_sample_is_a_clear_error():
    torch.manual_seed(0)
    model = KeywordModel().train()
    sample = _keyword_sample()
    compiled = Rockmate(model, sample, "1GB", cost_model="flops")
    with pytest.raises(ValueError, match="keyword argument 'scale' is 3.0 here and was 2.0"):
        compiled(**dict(sample, scale=3.0))
    with pytest.raises(TypeError, match="0 positional argument.*received 1 positional"):
        compiled(sample["x"], mask=sample["mask"], scale=2.0, labels=sample["labels"])
    with pytest.raises(TypeError, match="keywords"):
        compiled(**{k: v for k, v in sample.items() if k != "labels"})
    with pytest.raises(TypeError, match="not both"):
        Rockmate(model, sample, "1GB", kwargs=sample)
    with pytest.raises(TypeError, match="needs a budget"):
        Rockmate(model, sample)


def test_positional_model_returning_a_dict_keeps_its_structure():
    class Dict(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x):
            y = self.a(x)
            return {"y": y, "z": [torch.tanh(y)]}

    torch.manual_seed(0)
    model = Dict()
    x = torch.randn(3, 8)
    compiled = Rockmate(model, x, "1GB", cost_model="flops")
    out = compiled(x)
    assert type(out) is dict and isinstance(out["z"], list)
    assert torch.equal(out["z"][0], model(x)["z"][0])
    with pytest.raises(TypeError, match="keyword arguments"):
        compiled(x=x)


def test_transformers_called_with_keywords_and_labels():
    """GPT-2 from transformers called as its users do, ``model(input_ids=..., attention_mask=...,
    labels=..., use_cache=False)``, its ``CausalLMOutput`` returned: at its minimum budget, the
    loss and gradients bitwise equal to eager's over three steps. The mask that every layer
    reads is recomputed where read: the layers stay blocks of their own."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=16, vocab_size=64,
                                     attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (2, 16), generator=generator)
    call = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, use_cache=False)
    budget = min_budget(copy.deepcopy(model), call, cost_model="flops")
    compiled = Rockmate(model, call, budget, cost_model="flops")
    assert len(compiled.graphs.chain.blocks) >= 2 + config.n_layer * 2
    for expected, got in _train_both(model, compiled, call, lambda out: out.loss):
        assert type(got) is type(expected)
        assert torch.equal(expected.loss, got.loss) and torch.equal(expected.logits, got.logits)
