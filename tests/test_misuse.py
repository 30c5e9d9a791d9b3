"""Ordinary uses and misuses of a compiled module: a result equal to eager's, or a clear error.

Budgets that cannot be read, calls unlike the sample, a model cast after building, copies
(``deepcopy``, ``pickle``, ``torch.save``), optimizers over several steps, frozen parameters,
integer inputs, half precisions, autocast, and models torch.export cannot capture.
"""

from __future__ import annotations

import copy
import io
import pickle
import re

import pytest
import torch
from torch import nn

from rockmate import Rockmate
from random_models import GradientReversal, StraightThrough  # custom autograd.Functions
from rkgb.errors import CaptureError, UnsupportedOperation


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4))


X = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))


def _compiled(model=None, sample=X, budget="1GB"):
    return Rockmate(model if model is not None else _mlp(), sample, budget, cost_model="flops")


def _same_training(compiled, model_of_compiled, reference, sample, steps=3, optimizer=None):
    """Train both (loss: squares of the outputs) and assert bitwise equal parameters and grads."""
    optimizers = [optimizer(m.parameters()) for m in (model_of_compiled, reference)] if optimizer else []
    for step in range(steps):
        for index, module in enumerate((compiled, reference)):
            torch.manual_seed(step)
            module(sample).pow(2).sum().backward()
            if optimizers:
                optimizers[index].step()
                optimizers[index].zero_grad()
        for (path, a), b in zip(reference.named_parameters(), model_of_compiled.parameters()):
            assert torch.equal(a, b), f"step {step}: {path}"
            assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad), f"step {step}: {path}.grad"


@pytest.mark.parametrize("budget, message", [
    (-1, "positive"), (0, "positive"), (float("nan"), "finite"), (float("inf"), "finite"),
    ("12 parsecs", "cannot read the budget"), ("lots", "cannot read the budget"), (True, "budget must be"),
    ([1], "budget must be"),
])
def test_unreadable_budgets_are_clear_errors(budget, message):
    with pytest.raises(ValueError, match=message):
        _compiled(budget=budget)


def test_a_missing_budget_is_a_clear_error():
    with pytest.raises(TypeError, match="needs a budget"):
        Rockmate(_mlp(), X)


def test_calls_unlike_the_sample_are_clear_errors():
    # (another shape alone gets its own plan: test_rockmate, test_calls_with_other_shapes_...)
    compiled = _compiled()
    with pytest.raises(ValueError, match="dtype torch.float64.*build Rockmate again"):
        compiled(X.double())
    with pytest.raises(ValueError, match="expected 1 positional inputs, received 2"):
        compiled(X, X)


def test_a_model_cast_after_building_is_a_clear_error():
    compiled = _compiled()
    compiled.to(torch.float64)
    with pytest.raises(ValueError, match="cast or moved after Rockmate was built"):
        compiled(X.double())


def test_an_input_on_another_device_is_a_clear_error():
    """The user calls a module built on the CPU with an input on the meta device: a ValueError
    naming the input's device and the sample's, and saying to build Rockmate again."""
    compiled = _compiled()
    with pytest.raises(ValueError, match=r"input 0 has shape \[3, 8\], dtype torch.float32, device meta, but the "
                                         r"module was compiled for .* device cpu; .*build Rockmate again"):
        compiled(X.to("meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_input_on_cuda_is_a_clear_error():
    """The user calls a module built on the CPU with a CUDA input (the model left on the CPU):
    the same ValueError, naming cuda:0 and cpu."""
    compiled = _compiled()
    with pytest.raises(ValueError, match=r"device cuda:0, but the module was compiled for .* device cpu; "
                                         r".*build Rockmate again"):
        compiled(X.cuda())


def test_a_model_moved_to_meta_after_building_is_a_clear_error():
    """The user moves the compiled module (so its model) to the meta device and calls it, with
    the CPU sample or a meta input: the error of a cast after building, naming both devices."""
    compiled = _compiled()
    compiled.to("meta")
    assert compiled.model[0].weight.device.type == "meta"
    for x in (X, X.to("meta")):
        with pytest.raises(ValueError, match=r"the model's 0.weight is torch.float32 on meta but the plan was made "
                                             r"for torch.float32 on cpu: the model was cast or moved after "
                                             r"Rockmate was built"):
            compiled(x)


class _Prints(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        print("forward of _Prints")
        return self.lin(x)


def test_a_forward_that_prints_warns_at_capture_and_the_compiled_calls_print_nothing(capsys):
    """The user's forward calls ``print``: building prints it once (torch.export traces the
    forward) and warns, at the user's ``Rockmate(...)`` line, that Python side effects run once at
    capture; training is exact, and only the eager copy's three calls print."""
    torch.manual_seed(0)
    model = _Prints()
    reference = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"_Prints's forward printed while Rockmate captured it: Python side "
                                         r"effects in forward \(print, logging, counters in Python variables\) "
                                         r"run once, when Rockmate captures the model, not at each call") as record:
        compiled = _compiled(model)
    assert [w.filename for w in record if w.category is UserWarning] == [__file__]
    assert capsys.readouterr().out == "forward of _Prints\n"
    _same_training(compiled, model, reference, X)
    assert capsys.readouterr().out == "forward of _Prints\n" * 3  # the eager copy's calls only


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_train_exactly_like_the_original(how):
    compiled = _compiled()
    compiled(X).sum().backward()  # a copy keeps the model's gradients as they are
    if how == "deepcopy":
        copied = copy.deepcopy(compiled)
    elif how == "pickle":
        copied = pickle.loads(pickle.dumps(compiled))
    else:
        buffer = io.BytesIO()
        torch.save(compiled, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    assert copied.model is not compiled.model and copied.plan.budget == compiled.plan.budget
    reference = copy.deepcopy(compiled.model)
    _same_training(copied, copied.model, reference, X)


def test_building_leaves_the_models_gradients_alone():
    """A model that holds gradients (built after a step, mid-training, or for a new input
    shape): the inspection's backwards accumulated into them in place, so that the user's
    next step added onto changed gradients."""
    model = _mlp()
    model(X).pow(2).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    _compiled(model)
    for a, p in zip(before, model.parameters()):
        assert torch.equal(a, p.grad)


def test_state_dict_round_trip():
    compiled, other = _compiled(), _compiled(nn.Sequential(*[copy.deepcopy(m) for m in _mlp()]))
    with torch.no_grad():
        for p in compiled.model.parameters():
            p.add_(1.0)
    other.load_state_dict(compiled.state_dict())
    for a, b in zip(compiled.model.parameters(), other.model.parameters()):
        assert torch.equal(a, b)


def test_a_state_dict_saved_to_disk_loads_into_a_new_build(tmp_path):
    """The user saves ``compiled.state_dict()`` with ``torch.save``, builds Rockmate again on a
    differently initialized model and loads the file into it: its parameters are the saved ones,
    and it trains (SGD, 3 steps) bitwise like an eager model holding the same weights."""
    compiled = _compiled()
    with torch.no_grad():
        for p in compiled.model.parameters():
            p.add_(1.0)
    torch.save(compiled.state_dict(), tmp_path / "w.pt")
    fresh = _compiled(_mlp(seed=1))
    assert not torch.equal(fresh.model[0].weight, compiled.model[0].weight)
    fresh.load_state_dict(torch.load(tmp_path / "w.pt", weights_only=True))
    for a, b in zip(compiled.model.parameters(), fresh.model.parameters()):
        assert torch.equal(a, b)
    reference = _mlp(seed=2)
    reference.load_state_dict(fresh.model.state_dict())
    _same_training(fresh, fresh.model, reference, X, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))


def test_the_compiled_state_dict_is_the_models():
    """A checkpoint of the compiled module is the model's: the same keys (and order), it loads
    into the eager model and the eager model's into the compiled module (whose earlier keys,
    under ``compiled.model.``, load too), also as a submodule of a bigger module."""
    compiled, eager = _compiled(), _mlp(seed=1)
    assert list(compiled.state_dict()) == list(eager.state_dict())
    eager.load_state_dict(compiled.state_dict())
    for a, b in zip(compiled.model.parameters(), eager.parameters()):
        assert torch.equal(a, b)
    other = _mlp(seed=2)
    compiled.load_state_dict(other.state_dict())
    for a, b in zip(compiled.model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    compiled.load_state_dict({f"compiled.model.{key}": value for key, value in eager.state_dict().items()})
    for a, b in zip(compiled.model.parameters(), eager.parameters()):
        assert torch.equal(a, b)
    outer = torch.nn.ModuleDict({"body": compiled, "head": torch.nn.Linear(4, 2)})
    keys = list(outer.state_dict())
    assert keys == [f"body.{key}" for key in eager.state_dict()] + ["head.weight", "head.bias"]
    outer.load_state_dict(outer.state_dict())
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "extra"'):
        compiled.load_state_dict({**eager.state_dict(), "extra": torch.zeros(1)})


def test_adamw_over_five_steps_is_exact():
    model = _mlp()
    reference = copy.deepcopy(model)
    _same_training(_compiled(model), model, reference, X, steps=5, optimizer=torch.optim.AdamW)


def test_frozen_parameters_and_a_parameter_unfrozen_after_building():
    model = _mlp()
    model[0].weight.requires_grad_(False)
    compiled = _compiled(model)
    model[0].weight.requires_grad_(True)  # eager gives it a gradient: so must the plan
    reference = copy.deepcopy(model)
    _same_training(compiled, model, reference, X)


def test_all_parameters_frozen_and_an_input_that_requires_grad():
    model = _mlp()
    for p in model.parameters():
        p.requires_grad_(False)
    x = X.clone().requires_grad_()
    compiled = _compiled(model, x)
    reference = copy.deepcopy(model)
    x_ref = X.clone().requires_grad_()
    for module, inp in ((compiled, x), (reference, x_ref)):
        torch.manual_seed(0)
        module(inp).pow(2).sum().backward()
    assert torch.equal(x.grad, x_ref.grad)


def test_integer_inputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4))
    ids = torch.randint(0, 10, (3, 5), generator=torch.Generator().manual_seed(0))
    reference = copy.deepcopy(model)
    _same_training(_compiled(model, ids), model, reference, ids)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models(dtype):
    model = _mlp().to(dtype)
    reference = copy.deepcopy(model)
    _same_training(_compiled(model, X.to(dtype)), model, reference, X.to(dtype))


def test_autocast_built_inside_is_exact_and_a_different_autocast_is_a_clear_error():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4), nn.Softmax(-1),
                          nn.LayerNorm(4))
    reference = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled = _compiled(model)
        for step in range(3):
            outputs = []
            for module in (compiled, reference):
                torch.manual_seed(step)
                outputs.append(module(X))
                outputs[-1].float().pow(2).sum().backward()
            assert outputs[0].dtype == outputs[1].dtype == torch.bfloat16
            assert torch.equal(outputs[0], outputs[1])
            for a, b in zip(model.parameters(), reference.parameters()):
                assert torch.equal(a.grad, b.grad)
    with pytest.raises(ValueError, match="called with autocast off but built with autocast"):
        compiled(X)
    plain = _compiled(_mlp())
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="built with autocast off"):
        plain(X)


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y * 2 if y.sum() > 0 else y


class _NumPy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y * float(y.detach().numpy().mean())


@pytest.mark.parametrize("model, what", [(_DataDependent, "data-dependent"), (_NumPy, "numpy")])
def test_models_export_cannot_capture_are_capture_errors(model, what, capfd):
    with pytest.raises(CaptureError, match=f"could not capture {model.__name__}") as raised:
        _compiled(model())
    if what == "data-dependent":
        # the user's line, not Rockmate's capture mode, which torch blamed ("Caused by: (rkgb/...")
        assert "test_misuse.py" in str(raised.value) and "y.sum() > 0" in str(raised.value)
        assert "rkgb/capture.py" not in str(raised.value)
    # torch's own account of a data-dependent failure (a warning, then the graph traced so far)
    # is not printed: the error repeats its reason and the user's line
    assert "def forward" not in capfd.readouterr().err


class _EarlyBranchThenDeep(nn.Module):
    """A branch on values that the shapes do not determine (the input's sum), then many layers."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(8, 8) for _ in range(40)])

    def forward(self, x):
        return self.layers(x * 2 if x.sum() > 0 else x)


def test_the_real_values_attempt_stops_at_its_first_undetermined_decision(monkeypatch):
    """After export meets a branch on values, the capture tries again with the sample's real
    values (for branches that the shapes decide); a branch on values the shapes do not decide
    ends that attempt where it is met, not after tracing the rest of the forward (BART, T5:
    ~2 s a build), and the user's error is the same."""
    from rkgb import capture

    attempts = []
    real_export = capture._export_quietly

    def recorded(*args, **kwargs):
        try:
            result = real_export(*args, **kwargs)
        except BaseException as error:
            attempts.append(type(error).__name__)
            raise
        attempts.append("exported")
        return result

    model = _EarlyBranchThenDeep()
    monkeypatch.setattr(capture, "_export_quietly", recorded)
    linear_calls = []
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **k: linear_calls.append(1) or real_linear(*a, **k))
    with pytest.raises(CaptureError, match=r"(?s)could not capture _EarlyBranchThenDeep.*x\.sum\(\) > 0"):
        _compiled(model)
    assert attempts[:2] == ["GuardOnDataDependentSymNode", "_UndeterminedDecision"]
    # (where transformers is imported, a third attempt runs along its paths under a compiler)
    assert attempts[2:] in ([], ["GuardOnDataDependentSymNode"])
    assert linear_calls == []  # neither attempt traced a layer after the branch


class _CaughtGuardThenCache(nn.Module):
    """Meets a data-dependent branch, catches it and goes around (as transformers' mask
    helpers do), then returns a value export refuses: the error is not the caught branch's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        try:
            skip = bool(y.sum() > 0)
        except Exception:  # the guard, which the model handles itself
            skip = False
        return y * 2 if skip else y, object()


def test_a_caught_data_dependent_guard_is_not_blamed_for_another_error():
    with pytest.raises(CaptureError) as raised:
        _compiled(_CaughtGuardThenCache())
    assert "y.sum() > 0" not in str(raised.value)


def test_module_hooks_registered_after_building_are_a_clear_error():
    """A forward hook on a submodule (logging activations) registered after building was never
    called, silently; hooks on the Rockmate module itself run as on any module."""
    model = _mlp()
    compiled = _compiled(model)
    calls = []
    compiled.register_forward_hook(lambda module, inputs, output: calls.append("compiled"))
    compiled(X).sum().backward()
    handle = model[0].register_forward_hook(lambda module, inputs, output: calls.append("inner"))
    with pytest.raises(RuntimeError, match=r"module '0' of the model has forward hooks, registered after "
                                           r"Rockmate was built.*never run"):
        compiled(X)
    handle.remove()
    compiled(X).sum().backward()
    assert calls == ["compiled", "compiled"]



def _transformers_hook(name: str):
    """A hook named as one of transformers 5's (rkgb.capture.module_hooks)."""
    def hook(module, inputs, output):
        if name == "make_inputs_require_grads":
            output.requires_grad_(True)
    hook.__name__, hook.__module__ = name, "transformers.modeling_utils"
    return hook


def test_transformers_hooks_whose_effect_the_graph_holds_are_allowed():
    """transformers 5 registers ``make_inputs_require_grads`` on the input embeddings at
    ``gradient_checkpointing_enable()`` (a no-op where the embeddings are trained) and
    ``output_capturing_hook`` on the layers at a first call recording their outputs (an effect
    on what the forward returns, which the export captures): built and trained as eager, before
    or after the build; on frozen embeddings, ``make_inputs_require_grads`` changes what requires
    grad: refused, as any hook."""
    model, reference = _mlp(), _mlp()
    model[0].register_forward_hook(_transformers_hook("make_inputs_require_grads"))
    compiled = _compiled(model)
    model[3].register_forward_hook(_transformers_hook("output_capturing_hook"))
    _same_training(compiled, model, reference, X)
    frozen = _mlp()
    frozen[0].requires_grad_(False)
    frozen[0].register_forward_hook(_transformers_hook("make_inputs_require_grads"))
    with pytest.raises(CaptureError, match=r"module '0' \(Linear\) has forward hooks"):
        _compiled(frozen)

class _MaskedSelection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h[h > 0]


def test_shapes_that_depend_on_values_are_a_clear_error():
    # (a boolean mask's selection: export gives it an unbacked size; the graph builder failed
    # with torch's "Could not extract specialized integer from data-dependent expression")
    with pytest.raises(UnsupportedOperation, match=r"aten.index .*test_misuse.py.* makes a tensor whose shape "
                                                   r"\(\[u\d+\]\) depends on the values of tensors"):
        _compiled(_MaskedSelection())


class _PackedLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 16, batch_first=True)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        return nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True)[0]


def test_packed_sequences_are_a_clear_error():
    # (export failed deep in nn.LSTM: "zeros(): argument 'size' ... got FakeTensor")
    with pytest.raises(CaptureError, match=r"packs sequences.*run the RNN on the padded batch"):
        _compiled(_PackedLSTM(), (torch.randn(3, 5, 8), torch.tensor([5, 3, 2])))


class _PythonRandomMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        import random

        keep = 1.0 if random.random() < 0.5 else 0.0  # drawn once at capture, reused at every step
        return self.lin(x) * keep


def test_python_random_draws_in_the_forward_are_a_clear_error():
    import random

    state = random.getstate()
    with pytest.raises(UnsupportedOperation, match=r"draws random numbers from random \(not torch's generator\)"):
        _compiled(_PythonRandomMask())
    assert random.getstate() == state


_UNREGISTERED = nn.Linear(8, 8)  # a module the model uses without registering it


class _UsesAnUnregisteredModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.heads = [nn.Linear(8, 8)]  # a Python list, not an nn.ModuleList

    def forward(self, x):
        return self.heads[0](self.lin(x)) + _UNREGISTERED(x)


def test_trained_tensors_outside_the_model_are_a_clear_error():
    """Parameters of modules kept in a Python list or a global were lifted by export as
    constants: they silently got no gradient, where eager trains them."""
    with pytest.raises(UnsupportedOperation, match=r"not its parameters .*Parameter of shape \[8, 8\] at .*test_misuse"):
        _compiled(_UsesAnUnregisteredModule())


class _CumulativeBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=None)

    def forward(self, x):
        return self.norm(self.lin(x))


class _RenormalizedEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.lin = nn.Embedding(20, 8, max_norm=1.0), nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(self.embedding(x.abs().long() % 20))


@pytest.mark.parametrize("model, message", [
    (_CumulativeBatchNorm, r"module 'norm' \(BatchNorm1d\) has momentum=None"),
    (_RenormalizedEmbedding, r"writes into its parameter 'embedding.weight' .*max_norm"),
])
def test_forwards_that_cannot_be_replayed_are_clear_errors(model, message, capfd):
    # a cumulative batch norm failed inside export (a data-dependent guard, with torch's dump of
    # the graph on stderr); an embedding with max_norm gave "unsupported output kind"
    with pytest.raises(UnsupportedOperation, match=message):
        _compiled(model())
    assert "def forward" not in capfd.readouterr().err


class _CustomGradients(nn.Module):
    def __init__(self, reverse_input_only: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.reverse_input_only = reverse_input_only

    def forward(self, x):
        if self.reverse_input_only:  # applied to a tensor that requires no grad: never differentiated
            x = GradientReversal.apply(x, 0.5)
        h = StraightThrough.apply(torch.tanh(self.a(x)))
        h = torch.relu(self.b(h))
        return self.c(GradientReversal.apply(h, 0.5) if not self.reverse_input_only else h)


@pytest.mark.parametrize("fraction", [1.0, 0.0])
def test_custom_autograd_functions_train_with_their_own_backward(fraction):
    """torch.export keeps a Function's forward and drops its backward (the gradients would have
    the opposite sign here): each Function is captured as one operation that applies it
    (rkgb.functions), so that its own backward runs. Bitwise over 3 steps, within the budget, at
    eager's peak and at the minimum (recomputing the Functions' forwards)."""
    from exactness import check_training

    torch.manual_seed(0)
    report = check_training(_CustomGradients(), (torch.randn(6, 8),), fraction)
    assert report is not None
    code = report.compiled.code
    assert "apply_GradientReversal" in code and "apply_StraightThrough" in code


class _NoisyStraightThrough(torch.autograd.Function):
    """A Function that draws random numbers in its forward (a noise it saves for its backward)."""

    @staticmethod
    def forward(ctx, x):
        noise = torch.nn.functional.dropout(torch.ones_like(x), 0.5, True)
        ctx.save_for_backward(noise)
        return x * noise + 0.1

    @staticmethod
    def backward(ctx, grad):
        (noise,) = ctx.saved_tensors
        return grad * noise * 0.5


class _NoisyLayers(nn.Module):
    def __init__(self, noisy=_NoisyStraightThrough.apply) -> None:
        super().__init__()
        self.a, self.c, self.noisy = nn.Linear(16, 64), nn.Linear(64, 4), noisy
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))

    def forward(self, x):
        h = self.a(x)
        for layer in self.layers:
            h = h + layer(torch.tanh(self.noisy(h)))
        return self.c(h)


def test_a_random_custom_function_recomputed_replays_its_draws():
    """A Function's forward may draw random numbers: its operation counts as random, so that a
    recomputation replays the generator's state. At the minimum budget the Functions run again
    in the backward, and the training stays bitwise over 3 steps."""
    from exactness import check_training

    torch.manual_seed(0)
    report = check_training(_NoisyLayers(), (torch.randn(64, 16),), 0.0)
    assert report.at_minimum
    assert report.compiled.code.count("apply__NoisyStraightThrough") > 2 * 6  # forwards, and again


def test_a_custom_autograd_function_without_grad_trains_exactly():
    """A Function applied to a tensor that requires no grad: traced as export does."""
    model = _CustomGradients(reverse_input_only=True)
    reference = copy.deepcopy(model)
    compiled = _compiled(model)
    _same_training(compiled, compiled.model, reference, X)


class _ScaledBy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factors):
        ctx.factors = factors
        return x * factors[0]

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factors[1], None


class _ListArgument(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return _ScaledBy.apply(self.a(x), [2.0, 3.0])


class _MaskOnContext(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mask = x > 0  # held by the backward node, not through save_for_backward
        return x * ctx.mask

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.mask


class _ContextTensor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return _MaskOnContext.apply(self.a(x))


@pytest.mark.parametrize("model, name, what", [
    (_ListArgument, "_ScaledBy", "neither a tensor nor a constant"),
    (_ContextTensor, "_MaskOnContext", r"keeps tensors on ctx \(mask\)"),
])
def test_custom_functions_that_cannot_be_one_operation_are_clear_errors(model, name, what):
    """A Function given an argument that is neither a tensor nor a constant (a list), or keeping
    a tensor on its ctx (which the memory model would not see), cannot be applied as one
    operation: refused with its name and line, never traced without its backward."""
    with pytest.raises(UnsupportedOperation, match=rf"{name} \(at .*test_misuse.py:\d+\).*{what}"):
        _compiled(model())


@torch.library.custom_op("rockmate_test::doubled_gradient_tanh", mutates_args=())
def _doubled_gradient_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x)


@_doubled_gradient_tanh.register_fake
def _(x):
    return torch.empty_like(x)


def _save_output(ctx, inputs, output):
    ctx.save_for_backward(output)


def _doubled_tanh_backward(ctx, grad):
    (y,) = ctx.saved_tensors
    return 2 * grad * (1 - y * y)  # its own formula: not the derivative of its forward


_doubled_gradient_tanh.register_autograd(_doubled_tanh_backward, setup_context=_save_output)


@torch.library.custom_op("rockmate_test::mask_on_context", mutates_args=())
def _mask_on_context(x: torch.Tensor) -> torch.Tensor:
    return x * (x > 0)


@_mask_on_context.register_fake
def _(x):
    return torch.empty_like(x)


def _keep_mask(ctx, inputs, output):
    ctx.mask = inputs[0] > 0  # held by the backward node, not through save_for_backward


_mask_on_context.register_autograd(lambda ctx, grad: grad * ctx.mask, setup_context=_keep_mask)


@torch.library.custom_op("rockmate_test::noisy", mutates_args=())
def _noisy(x: torch.Tensor) -> torch.Tensor:
    return x + 0.1 * torch.randn_like(x)  # draws, with no tag saying so


@_noisy.register_fake
def _(x):
    return torch.empty_like(x)


_noisy.register_autograd(lambda ctx, grad: grad)


class _CustomOperators(nn.Module):
    def __init__(self, operator) -> None:
        super().__init__()
        self.a, self.b, self.operator = nn.Linear(8, 16), nn.Linear(16, 8), operator

    def forward(self, x):
        return self.b(self.operator(self.a(x)) + 1)


def test_a_custom_operator_with_its_own_autograd_trains_exactly():
    """A torch.library custom operator with ``register_autograd``: export keeps the operator as
    one node, whose autograd kernel runs its own backward when the plan calls it (refused before
    as a Function with a non-tensor argument: the dispatcher's keyset). Its backward doubles
    autograd's derivative, so a plan that differentiated its forward would not be bitwise."""
    from exactness import check_training

    torch.manual_seed(0)
    for fraction in (1.0, 0.0):
        report = check_training(_CustomOperators(torch.ops.rockmate_test.doubled_gradient_tanh), (X,), fraction)
    assert report.at_minimum and "doubled_gradient_tanh" in report.compiled.code


def test_a_custom_operator_recomputed_replays_its_draws():
    """A custom operator may draw inside its kernel without a tag saying so: counted as random
    (rkgb.simplify._is_random), its recomputation replays the generator's state. At the minimum
    budget the operator runs again in the backward, and the training stays bitwise."""
    from exactness import check_training

    torch.manual_seed(0)
    report = check_training(_NoisyLayers(torch.ops.rockmate_test.noisy), (torch.randn(64, 16),), 0.0)
    assert report.at_minimum
    code = report.compiled.code
    assert len(re.findall(r"# fwd_noisy", code)) > 6  # six operators, some run again
    assert "rng_get()" in code  # the generator's state kept to replay them


def test_a_custom_operator_keeping_tensors_on_its_context_is_a_clear_error():
    """Its context's tensors are out of the memory model's sight: the plan could let go of them
    before its backward reads them (transformers 5's MoE grouped_mm_fallback keeps its offsets
    so: the experts' gradients were zeros, silently). Refused with its name and line."""
    with pytest.raises(UnsupportedOperation, match=r"custom operator rockmate_test_mask_on_context_default "
                                                   r"\(at .*test_misuse.py:\d+\).*\(mask\)"):
        _compiled(_CustomOperators(torch.ops.rockmate_test.mask_on_context))


class _Reverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        return -grad


_reverse = _Reverse.apply  # bound at import, before any capture


class _StoredApply(nn.Module):
    def __init__(self, stored: bool) -> None:
        super().__init__()
        self.a, self.b, self.stored, self.reverse = nn.Linear(8, 8), nn.Linear(8, 8), stored, _Reverse.apply

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.tanh(self.reverse(h) if self.stored else _reverse(h)))


def test_an_apply_kept_in_a_module_attribute_trains_exactly():
    """``self.reverse = GradReverse.apply`` in ``__init__``: the apply was bound before the
    capture patched ``Function.apply``, so export traced the Function's forward without its
    backward (the gradient reversal lost: silently wrong gradients). While capturing, such
    attributes hold the patched apply."""
    from exactness import check_training

    torch.manual_seed(0)
    check_training(_StoredApply(stored=True), (X,), 1.0)


def test_an_apply_bound_elsewhere_before_the_capture_is_a_clear_error():
    """``reverse = GradReverse.apply`` at a module's top level: out of the capture's reach, but
    seen (each Function's forward is watched while capturing): refused, never silently wrong."""
    with pytest.raises(UnsupportedOperation, match=r"_Reverse \(at .*test_misuse.py:\d+\).*bound before"):
        _compiled(_StoredApply(stored=False))


class _SparseEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(50, 8, sparse=True)
        self.lin = nn.Linear(8, 4)

    def forward(self, ids):
        return self.lin(torch.tanh(self.table(ids)))


IDS = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(2))


def test_a_sparse_embedding_gradient_is_a_clear_error():
    """``nn.Embedding(sparse=True)``: a gradient whose size depends on the indices' values (it
    crashed inside the inspection: "Cannot access storage of SparseTensorImpl")."""
    with pytest.raises(UnsupportedOperation, match=r"aten.embedding \(in module 'table'.*sparse=False"):
        _compiled(_SparseEmbedding(), IDS)


def test_a_frozen_sparse_embedding_trains_exactly():
    """The same embedding frozen: no gradient, nothing sparse; bitwise."""
    model = _SparseEmbedding()
    model.table.weight.requires_grad_(False)
    reference = copy.deepcopy(model)
    compiled = _compiled(model, IDS)
    _same_training(compiled, compiled.model, reference, IDS)


class _NoGradScale(nn.Module):
    """A scale computed from the activations and a layer under ``torch.no_grad()``: eager builds
    no graph there, so no gradient reaches ``b`` nor, through the scale, ``a``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        with torch.no_grad():
            scale = self.b(h).abs().mean() + 1
        return self.c(h * scale)


def _spectral_norm_model() -> nn.Module:
    torch.manual_seed(0)
    from torch.nn.utils import parametrizations

    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), parametrizations.spectral_norm(nn.Linear(16, 32)), nn.Tanh(),
                         nn.Linear(32, 4))


@pytest.mark.parametrize("make", [_NoGradScale, _spectral_norm_model], ids=["no_grad_block", "spectral_norm"])
@pytest.mark.parametrize("fraction", [1.0, 0.0])
def test_regions_without_grad_give_no_gradient(make, fraction):
    """Export's functional graph loses the grad mode of a ``torch.no_grad()`` region: its results
    were differentiated (a spectral norm's power iteration added 0.3% to the weight's gradient;
    ``b`` got a gradient). They are detached where read (rkgb.capture.detach_no_grad_results):
    bitwise over 3 steps, the buffers (the power iteration's ``u``, ``v``) too, within budget."""
    from exactness import check_training

    torch.manual_seed(0)
    assert check_training(make().train(), (torch.randn(6, 8),), fraction) is not None


class _HookInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h.register_hook(lambda grad: grad * 0.5)  # halves the gradient on its way back
        return self.b(h)


def test_a_gradient_hook_registered_in_the_forward_is_a_clear_error():
    """export keeps no trace of a tensor hook the forward registers: the gradients of ``a`` would
    be twice eager's. Refused with the line that registers it."""
    with pytest.raises(UnsupportedOperation, match=r"registers gradient hooks on tensors \(at .*test_misuse.py:\d+\)"):
        _compiled(_HookInForward())


class _SampledTokens(nn.Module):
    """Tokens sampled from the model's own softmax (``multinomial``), embedded and read on."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.table, self.b = nn.Linear(8, 16), nn.Embedding(16, 8), nn.Linear(8, 4)

    def forward(self, x):
        p = torch.softmax(self.a(x), -1)
        tokens = torch.multinomial(p, 1).squeeze(-1)
        return self.b(self.table(tokens) + x) + p.sum(-1, keepdim=True)


@pytest.mark.parametrize("fraction", [1.0, 0.0])
def test_sampling_from_the_models_own_probabilities(fraction):
    """The inspection gives later blocks synthesized inputs of the right shape; a block that
    samples from its input (``multinomial``) needs real probabilities (it crashed inside the
    inspection: "probability tensor contains either inf, nan or element < 0"). Bitwise, the
    draws replayed, within budget."""
    from exactness import check_training

    torch.manual_seed(0)
    assert check_training(_SampledTokens().train(), (torch.randn(16, 8),), fraction) is not None


class _ReturnsAMetric(nn.Module):
    """A loss and a metric computed under ``torch.no_grad()``, both returned."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        logits = self.b(torch.tanh(self.a(x)))
        with torch.no_grad():
            confidence = logits.softmax(-1).max(-1).values.mean()
        return logits.square().mean(), confidence


def test_a_result_computed_without_grad_and_returned_requires_no_grad():
    """The metric requires no grad, as eager's; a loss that adds it gets eager's gradients."""
    model = _ReturnsAMetric()
    reference = copy.deepcopy(model)
    compiled = _compiled(model)
    for step in range(2):
        (loss, metric), (eager_loss, eager_metric) = compiled(X), reference(X)
        assert not metric.requires_grad and torch.equal(metric, eager_metric)
        (loss + metric).backward()
        (eager_loss + eager_metric).backward()
        for (path, a), b in zip(reference.named_parameters(), compiled.model.parameters()):
            assert torch.equal(a.grad, b.grad), f"step {step}: {path}.grad"


class _MovingAverage(nn.Module):
    """A buffer updated in place in the forward and read after the update (an EMA)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        self.ema.mul_(0.9).add_(h.detach().mean(0) * 0.1)
        return self.b(h * self.ema)


@pytest.mark.parametrize("fraction", [1.0, 0.0])
def test_a_buffer_read_after_its_update_in_the_forward(fraction):
    """(Was ``KeyError: 'add'`` inside inspection.) Bitwise outputs, gradients and buffers over
    three steps, at eager's peak and at the minimum (recomputation reads the buffer's copy)."""
    from exactness import check_training

    torch.manual_seed(0)
    check_training(_MovingAverage(), (X,), fraction, steps=3, tolerance=0.1)
