"""Rockmate(model, sample, budget) on the zoo: bitwise-exact training and the budget promise."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from exactness import LOSS_BYTES, DotLoss, check_training, eager_peak
from rkgb.cdgraph import parameter_sums
from rkgb.memory import measure_allocator_peak
from rockmate import InfeasibleBudget, Rockmate, budget_fraction, format_bytes, min_budget, parse_budget
from zoo import ZOO

STEPS = 3


def _check_exact_training(name, dtype, fraction, solver, at_minimum_if_infeasible=False, options=None, **build):
    model, sample = ZOO[name].build(dtype=dtype, **build)
    return _check_exact(model, sample, fraction, solver, at_minimum_if_infeasible, **(options or {}))


def _check_exact(model, sample, fraction, solver="rockmate", at_minimum_if_infeasible=False, **options):
    """:func:`exactness.check_training` over STEPS steps; returns the compiled module (None when
    the budget is infeasible and not retried at the minimum)."""
    report = check_training(model, sample, fraction, solver, steps=STEPS, at_minimum=at_minimum_if_infeasible,
                            **options)
    return None if report is None else report.compiled


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.3])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_rockmate_is_exact_and_under_budget(name, fraction):
    """At 100%, 50% and 30% of eager's peak; below the minimum, at the minimum itself."""
    _check_exact_training(name, torch.float32, fraction, "rockmate", at_minimum_if_infeasible=fraction == 0.3)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_float64(name):
    _check_exact_training(name, torch.float64, 0.5, "rockmate")


@pytest.mark.parametrize("solver", ["rotor", "none", "checkmate", "checkmate-lp"])
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_other_solvers(name, solver):
    # (exactness, not the optimum: the whole-graph ILP stops at 10 s instead of its 60 s)
    options = {"time_limit_s": 10.0} if solver == "checkmate" else {}
    _check_exact_training(name, torch.float32, 1.0 if solver == "none" else 0.6, solver, options=options,
                          **({"n_layer": 1} if name == "gpt" else {}))


def test_infeasible_budget_gives_the_minimum():
    model, sample = ZOO["gpt"].build()
    minimum = min_budget(model, sample, cost_model="flops")
    with pytest.raises(InfeasibleBudget) as info:
        Rockmate(model, sample, minimum // 2, cost_model="flops")
    assert info.value.minimum == minimum
    # (and as a share of the peak without recomputation, the figure a fraction budget reads)
    baseline = info.value.baseline
    assert f"is {minimum} bytes ({format_bytes(minimum)}), {minimum / baseline:.1%} of the {baseline} bytes that " \
           "the plan without recomputation peaks at" in str(info.value)
    # the operation floor: what no plan of eager's operations goes below, and the op that sets it
    # (the zoo GPT's seq-16 floor is the backward of the last MLP's second linear)
    # (the solvers leave the generator states of the 7 dropouts aside, and one more for a replay)
    error = info.value
    state = torch.get_rng_state().nbytes
    assert error.floor == 65664
    # (and the sum of the tied embedding's contributions, for gradient accumulation): the
    # solver's minimum with all of that reserved from the start is 1.068x the floor plus them;
    # counted where each is made, the plan at the solver's minimum needs less (eighteenth session)
    tied = model.token_embedding.weight.untyped_storage().nbytes()
    assert error.floor + tied <= minimum < 1.068 * error.floor + 8 * state + tied - 8000
    assert "the backward of aten." in error.floor_operation and "in module" in error.floor_operation
    assert "zoo.py" in error.floor_operation  # the user's source line, not torch's nn.Linear
    assert f"goes below {error.floor} bytes" in str(error) and error.floor_operation in str(error)
    compiled = Rockmate(model, sample, minimum, cost_model="flops")
    assert compiled.plan.predicted_peak <= minimum


def test_budget_strings():
    assert parse_budget("300MiB") == 300 * 2**20
    assert parse_budget("1.5GB") == 1_500_000_000
    assert parse_budget(1024) == 1024
    with pytest.raises(ValueError, match="MiB"):
        parse_budget("lots")
    with pytest.raises(ValueError):
        parse_budget(-5)


def test_a_fraction_is_of_the_peak_without_recomputation():
    """``0.5`` and ``"50%"`` (PyTorch's activation_memory_budget convention) are half of the
    plan without recomputation's peak; bitwise, and the allocator's peak within that budget."""
    from solvers import registry

    assert budget_fraction(0.5) == budget_fraction("50%") == 0.5 and budget_fraction(1.0) == 1.0
    assert budget_fraction(1024) is None and budget_fraction("300MiB") is None and budget_fraction(3e8) is None
    with pytest.raises(ValueError, match="fraction of a model's peak"):
        parse_budget(0.5)
    with pytest.raises(ValueError, match="in percent"):
        budget_fraction("150%")
    model, sample = ZOO["gpt"].build()
    reference = copy.deepcopy(model)
    half = Rockmate(model, sample, 0.5, cost_model="flops")
    peak = registry.no_recompute_peak(half.graphs.model_chain)
    assert half.plan.budget == int(0.5 * peak) and half.plan.predicted_peak <= half.plan.budget
    assert any("50% of the" in note for note in half.plan.notes)
    assert Rockmate(copy.deepcopy(model), sample, "50%", cost_model="flops").plan.budget == half.plan.budget
    assert Rockmate(copy.deepcopy(model), sample, 1.0, solver="none", cost_model="flops").plan.budget == peak
    for p in list(model.parameters()) + list(reference.parameters()):
        p.grad = torch.zeros_like(p)  # (the budget leaves the parameters' gradients out)
    loss = DotLoss(reference(*sample))
    for step in range(2):
        torch.manual_seed(step)
        measured = measure_allocator_peak(lambda: loss(half(*sample)).backward())
        assert measured <= half.plan.budget + LOSS_BYTES
        torch.manual_seed(step)
        loss(reference(*sample)).backward()
        for a, b in zip(model.parameters(), reference.parameters()):
            assert torch.equal(a.grad, b.grad)
    # a smaller last batch is planned within the same bytes (its own 50% may be infeasible)
    with pytest.warns(UserWarning, match="planned again"):
        half(*(value[:1, :10] for value in sample))
    assert [variant.plan.budget for variant in half._variants.values()] == [half.plan.budget]
    with pytest.raises(InfeasibleBudget, match=r"0\.01 of the \d+ bytes that the plan without recomputation") as info:
        Rockmate(copy.deepcopy(model), sample, 0.01, cost_model="flops")
    assert f"{info.value.minimum / peak:.1%} of that peak" in str(info.value)


def test_a_model_built_in_eval_mode_runs_plain_until_trained():
    """Built from a model in eval mode (captured as model.train() makes it): a call while the
    model is still in eval mode runs the plain model (planning again for the submodules' modes
    recursed without end); after rk.train(), the plan, bitwise eager's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2)).eval()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 8)
    compiled = Rockmate(model, x, 10**9, cost_model="flops")
    assert torch.equal(compiled(x), reference(x))
    compiled.train()
    reference.train()
    torch.manual_seed(1)
    compiled(x).sum().backward()
    torch.manual_seed(1)
    reference(x).sum().backward()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert not compiled._variants


def test_eval_and_no_grad_run_the_plain_model():
    model, sample = ZOO["gpt"].build()
    compiled = Rockmate(model, sample, 10**9, cost_model="flops")
    compiled.eval()
    assert torch.equal(compiled(*sample), model(*sample))
    compiled.train()
    with torch.no_grad():
        torch.manual_seed(0)
        a = compiled(*sample)
        torch.manual_seed(0)
        b = model(*sample)
    assert torch.equal(a, b)


def test_a_wrong_input_dtype_is_a_clear_error():
    model, sample = ZOO["mlp"].build()
    compiled = Rockmate(model, sample, 10**9, cost_model="flops")
    with pytest.raises(ValueError, match="dtype torch.float64"):
        compiled(sample[0].double())


def test_calls_with_other_shapes_are_planned_again_within_the_budget():
    """A last, smaller batch (and any new shape) was a ValueError: the user had to build
    another Rockmate. It gets its own plan at its first call (a warning says so, once), with the
    same budget; training stays bitwise eager's across the shapes, dropout included."""
    import warnings

    model, sample = ZOO["gpt"].build()
    reference = copy.deepcopy(model)
    budget = int(0.5 * eager_peak(model, sample, DotLoss(model(*sample))))
    compiled = Rockmate(model, sample, budget, cost_model="flops")
    for p in list(model.parameters()) + list(reference.parameters()):
        p.grad = torch.zeros_like(p)  # (the budget leaves the parameters' gradients out)
    small = tuple(value[:1, :10] for value in sample)  # (batch 2, length 16 -> 1, 10)
    for step, inputs in enumerate([sample, small, sample, small]):
        loss = DotLoss(reference(*inputs))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.manual_seed(step)
            measured = measure_allocator_peak(lambda: loss(compiled(*inputs)).backward())
        planned = [w for w in caught if "planned again" in str(w.message)]
        assert len(planned) == (1 if step == 1 else 0), [str(w.message) for w in caught]
        assert measured <= budget + LOSS_BYTES
        torch.manual_seed(step)
        loss(reference(*inputs)).backward()
        for a, b in zip(model.parameters(), reference.parameters()):
            assert torch.equal(a.grad, b.grad)
    assert len(compiled._variants) == 1


class _Tempered(torch.nn.Module):
    """Python values the forward reads, which export bakes into the graph: a temperature, a
    dropout's p; and a plain tensor attribute (not a buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.dropout, self.act = torch.nn.Dropout(0.1), torch.nn.ReLU()
        self.temperature = 1.0
        self.scale = torch.ones(16)

    def forward(self, x):
        return self.head(self.dropout(self.act(self.linear(x)) * self.scale)) / self.temperature


def test_the_model_state_guard_sees_every_change_the_full_comparison_sees():
    """The guard the compiled module runs at each call (``ModelState._as_built``: identities,
    without walking the module tree) against the full comparison, on each kind of change: a
    list attribute changed in place, a submodule added, replaced or removed, a parameter
    replaced by one of another shape or given data of another shape, a buffer removed."""
    from rockmate.model_state import ModelState

    class AnyReLU(torch.nn.ReLU):
        """A module that says it equals any other: the guard compares modules by identity."""

        def __eq__(self, other):
            return True

        __hash__ = torch.nn.ReLU.__hash__

    def model():
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        net[0].sizes = [4, 4]
        net[0].shape = (4, 2)  # a tuple of numbers: kept as the object itself
        net[0].nested = (4, [2])  # a tuple holding a list: a frozen copy
        net.register_buffer("steps", torch.zeros(()))
        return net

    changes = [lambda m: m[0].sizes.append(8), lambda m: m.add_module("extra", torch.nn.ReLU()),
               lambda m: m.__setitem__(1, torch.nn.GELU()), lambda m: delattr(m, "1"),
               lambda m: m.__setitem__(1, AnyReLU()),
               lambda m: setattr(m[0], "weight", torch.nn.Parameter(torch.zeros(5, 4))),
               lambda m: setattr(m[0].weight, "data", torch.zeros(2, 8)), lambda m: delattr(m, "steps"),
               lambda m: setattr(m[0], "shape", (4, 3)), lambda m: m[0].nested[1].append(1)]
    for change in changes:
        net = model()
        state = ModelState.of(net)
        assert state._as_built() and state.changed() == []
        change(net)
        assert not state._as_built() and state.changed(), change
    # an equal tuple put in place of the build's is no change
    net = model()
    state = ModelState.of(net)
    net[0].shape = tuple([4, 2])
    assert state._as_built() and state.changed() == []


def test_new_values_of_python_attributes_are_planned_again(monkeypatch):
    """A temperature or a dropout's p changed after building trained silently on the build's
    value (export holds them as constants); a tensor attribute replaced, on the old tensor. Now
    a change of a module's simple attribute plans again (a warning, once per new value) and a
    replaced tensor attribute is read as it is now; bitwise eager's at every step."""
    import warnings

    import rockmate.api

    torch.manual_seed(0)
    model = _Tempered()
    reference = copy.deepcopy(model)
    x = torch.randn(6, 8)
    compiled = Rockmate(model, x, 10**9, cost_model="flops")
    wider = torch.nn.Linear(16, 6)
    changes = [lambda m: None, lambda m: setattr(m, "temperature", 2.0),
               lambda m: setattr(m.dropout, "p", 0.5), lambda m: setattr(m, "scale", torch.full((16,), 3.0)),
               lambda m: (setattr(m, "temperature", 1.0), setattr(m.dropout, "p", 0.1)),
               lambda m: setattr(m, "act", torch.nn.GELU()),  # a module replaced: another graph
               lambda m: setattr(m, "head", copy.deepcopy(wider))]  # parameters of other shapes
    planned_again = []
    for step, change in enumerate(changes):
        change(model)
        change(reference)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.manual_seed(step)
            compiled(x).square().sum().backward()
        planned_again.append([str(w.message) for w in caught if "planned again" in str(w.message)])
        torch.manual_seed(step)
        reference(x).square().sum().backward()
        for a, b in zip(model.parameters(), reference.parameters()):
            assert torch.equal(a.grad, b.grad), f"step {step}"
    # (the temperature, then p, each a new plan; a new tensor needs none; back to the build's
    # values: the first plan)
    assert [len(messages) for messages in planned_again] == [0, 1, 1, 0, 0, 1, 1]
    assert "a model changed since the build: temperature = 2.0 (built with 1.0)" in planned_again[1][0]
    assert "dropout.p = 0.5 (built with 0.1)" in planned_again[2][0]
    assert "module 'act' is now a GELU (built with ReLU)" in planned_again[5][0]
    assert "module 'head' is now a Linear (built with Linear)" in planned_again[6][0]
    monkeypatch.setattr(rockmate.api, "_MOST_VARIANTS", 2)
    model.temperature = 3.0
    with pytest.raises(RuntimeError, match=r"after 2 plans for other calls already.*register_buffer"):
        compiled(x)
    model.temperature, model.scale = 1.0, torch.ones(8)  # (the last plan's state, another tensor)
    with pytest.raises(ValueError, match=r"tensor attribute 'scale' is now a tensor of shape \[8\]"):
        compiled(x)


def test_torch_compile_runs_the_plan_as_it_is():
    """``torch.compile`` of a model around Rockmate crashed inside the executor (dynamo traced
    its bookkeeping); the module is now a graph break: the plan runs as it is, exact."""
    model, sample = ZOO["mlp"].build()
    reference = copy.deepcopy(model)
    compiled = torch.compile(torch.nn.Sequential(Rockmate(model, sample, 10**9, cost_model="flops")),
                             backend="aot_eager")
    for step in range(2):
        torch.manual_seed(step)
        compiled(*sample).pow(2).sum().backward()
        torch.manual_seed(step)
        reference(*sample).pow(2).sum().backward()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_code_is_readable_and_render_writes_files(tmp_path):
    import shutil

    model, sample = ZOO["gpt"].build()
    compiled = Rockmate(model, sample, 10**9, cost_model="flops")
    assert "aten.linear" in compiled.code
    if shutil.which("dot") is None:
        pytest.skip("graphviz's dot is not installed (apt-get install graphviz)")
    written = compiled.render(tmp_path)
    assert any(path.endswith("forward.svg") for path in written)
    assert all((tmp_path / p).exists() or __import__("os").path.exists(p) for p in written)


@pytest.mark.parametrize("name", ["gpt", "rnn"])
def test_gradient_accumulation_is_exact(name):
    """Gradients accumulated over several steps without zeroing (micro-batches) equal eager's,
    also for parameters read by several nodes (the GPT's tied embedding, the RNN's weights)."""
    model, sample = ZOO[name].build()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        probe = copy.deepcopy(model)(*sample)
    loss = DotLoss(probe)
    budget = int(0.5 * eager_peak(model, sample, loss))
    try:
        compiled = Rockmate(model, sample, budget, cost_model="flops")
    except InfeasibleBudget as error:  # the RNN: its minimum is above half of eager's peak
        budget = error.minimum
        compiled = Rockmate(model, sample, budget, cost_model="flops")
    # the sum of a shared parameter's contributions, built apart while .grad holds values
    assert parameter_sums(compiled.plan.first_run_bytes), "the plan counts the shared parameters' sums"
    peaks = []

    def step_holding_the_outputs():  # as the plan counts them (a loop that drops them frees them sooner)
        outputs = module(*sample)
        loss(outputs).backward()
        return outputs

    for module in (reference, compiled):
        torch.manual_seed(0)
        for step in range(STEPS):
            peak = measure_allocator_peak(step_holding_the_outputs)
            if module is compiled and step > 0:  # .grad holds values: the sums are built apart
                peaks.append(peak)
    for (path, a), b in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), path
    predicted = compiled.plan.predicted_peak
    slack = LOSS_BYTES + loss.copies(probe)
    assert peaks and all(0.97 * predicted <= peak <= min(predicted, budget) + slack for peak in peaks), \
        (peaks, predicted, budget)


def test_gradient_accumulation_on_a_parameter_read_twice_with_one_contributing_reader():
    """A tied linear whose second reader feeds an unused batch norm gets one contribution: no sum
    apart (none is planned), added into .grad as eager's AccumulateGrad does, over steps without
    zeroing. The executor took it for a shared parameter and refused the step ("its .grad holds
    values ... which this plan does not count"); found by measuring fuzz programs' steps."""
    from random_models import make
    from random_models import program as written

    program = written([("conv1d", [0]), ("linear_tied", [1]), ("conv2d", [0]), ("linear_tied", [3]),
                       ("batch_norm_unused", [4]), ("add", [5, 5])], [0, 2], batch=2, seq=4, dim=16,
                      dtype=torch.float64)
    model, x = make(program)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        probe = copy.deepcopy(model)(x)
    loss = DotLoss(probe)
    compiled = Rockmate(model, x, 10**9, cost_model="flops")
    assert not parameter_sums(compiled.plan.first_run_bytes)
    for module in (reference, compiled):
        for _ in range(STEPS):
            loss(module(x)).backward()
    for (path, a), b in zip(reference.named_parameters(), model.parameters()):
        assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad)), path


def test_without_grad_accumulation_the_sums_are_not_counted_and_accumulating_is_refused():
    """grad_accumulation=False: the plan leaves out the tied embedding's sum (a lower minimum);
    a step whose shared parameter's .grad holds values is a clear error, zeroed ones train."""
    model, sample = ZOO["gpt"].build()
    with_sums = min_budget(model, sample, cost_model="flops")
    without = min_budget(model, sample, cost_model="flops", grad_accumulation=False)
    assert without < with_sums
    # (the default's refusal of that budget names the option and the tied embedding's sum)
    tied = next(p for name, p in model.named_parameters() if "emb" in name)
    with pytest.raises(InfeasibleBudget, match=rf"gradient sum of each parameter that several operations read "
                                               rf"\(1, {tied.numel() * 4} bytes.*grad_accumulation=False plans"):
        Rockmate(copy.deepcopy(model), sample, without, cost_model="flops")
    compiled = Rockmate(model, sample, without, cost_model="flops", grad_accumulation=False)
    loss = DotLoss(compiled(*sample).detach())
    loss(compiled(*sample)).backward()  # .grad None: nothing to sum apart
    with pytest.raises(RuntimeError, match="grad_accumulation=True .* zero the gradients"):
        loss(compiled(*sample)).backward()
    for p in model.parameters():
        p.grad = None
    loss(compiled(*sample)).backward()


def test_transformers_gpt2_is_exact_and_under_budget():
    """transformers' GPT-2 (random init from a config, eager attention) at 50% of eager's peak:
    outputs and gradients bitwise equal over 3 steps, measured peak equal to the plan's."""
    transformers = pytest.importorskip("transformers")

    class LogitsOf(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids, use_cache=False).logits

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=16, vocab_size=64,
                                     attn_implementation="eager")
    torch.manual_seed(0)
    model = LogitsOf(transformers.GPT2LMHeadModel(config)).train()
    sample = (torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0)),)
    # (a 3x3 grid: the decoder's 50-compute class takes 16 s with the 10x10 one; exactness here)
    assert _check_exact(model, sample, 0.5, at_minimum_if_infeasible=True, peak_steps=3, save_steps=3) is not None


def test_transformers_bart_is_exact_and_under_budget():
    """transformers' BART (an encoder-decoder, random init from a config, called with labels) at
    50% of eager's peak: its LayerDrop draws (``torch.rand([]) < 0.0``, decided at capture) and
    ``shift_tokens_right``'s writes into a ``new_zeros`` (static lines recomputed with the writes
    where read) as eager: loss and gradients bitwise equal over 3 steps."""
    transformers = pytest.importorskip("transformers")

    class LossOf(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids, labels):
            return self.model(input_ids=ids, labels=labels, use_cache=False).loss

    config = transformers.BartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=1,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=32)
    torch.manual_seed(0)
    model = LossOf(transformers.BartForConditionalGeneration(config)).train()
    generator = torch.Generator().manual_seed(0)
    sample = (torch.randint(0, 64, (2, 12), generator=generator), torch.randint(0, 64, (2, 12), generator=generator))
    # (a 3x3 grid: the decoder's 50-compute class takes 16 s with the 10x10 one; exactness here)
    assert _check_exact(model, sample, 0.5, at_minimum_if_infeasible=True, peak_steps=3, save_steps=3) is not None


class _StridedDropout(torch.nn.Module):
    """Dropouts on a model input, on a transposed (non-contiguous) activation and at a high
    rate: on CPU each is captured as a one-byte mask, its float noise and a product."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(12, 16), torch.nn.Linear(10, 8)
        self.d0, self.d1, self.d2 = torch.nn.Dropout(0.5), torch.nn.Dropout(0.3), torch.nn.Dropout(0.77)

    def forward(self, x):
        h = self.a(self.d0(x))
        h = self.d1(h.transpose(1, 2))
        return self.d2(torch.tanh(self.b(h)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_dropout_decomposition_is_exact(dtype, fraction):
    """Eager's dropout, decomposed at capture (mask, noise, product), draws eager's numbers and
    keeps eager's layouts, also where recomputed: bitwise equal over 3 steps."""
    torch.manual_seed(0)
    model = _StridedDropout().to(dtype)
    sample = (torch.randn(4, 10, 12, dtype=dtype, generator=torch.Generator().manual_seed(1)),)
    compiled = _check_exact(model, sample, fraction, at_minimum_if_infeasible=True)
    # every draw of the mask is eager's first one or a replay of its RNG state
    assert compiled.code.count("bernoulli_") == 3 + compiled.code.count("rng_set(s.rng_")


def test_a_build_freezes_older_objects_and_leaves_the_collector_as_it_was(monkeypatch):
    """While it builds, Rockmate keeps the objects alive before it out of Python's full
    collections (gc.freeze), and those of the captured graph from the capture on; after, the
    collector is as it was, and a process that froze objects itself keeps its own frozen set,
    no more."""
    import gc

    import rkgb.build
    import rockmate.api

    seen = []
    real, real_simplify = rockmate.api._build_graphs, rkgb.build.simplify

    def build(*args, **kwargs):
        seen.append(gc.get_freeze_count())
        return real(*args, **kwargs)

    def simplify(captured):  # (right after the capture)
        seen.append(gc.get_freeze_count())
        return real_simplify(captured)

    monkeypatch.setattr(rockmate.api, "_build_graphs", build)
    monkeypatch.setattr(rkgb.build, "simplify", simplify)
    model, sample = ZOO["mlp"].build()
    before = gc.get_freeze_count()
    assert before == 0
    Rockmate(model, sample, "1GB", cost_model="flops")
    assert 0 < seen[-2] < seen[-1] and gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        min_budget(copy.deepcopy(model), sample, cost_model="flops")
        # (not unfrozen, nothing more frozen; frozen objects freed by their last reference leave the count)
        assert 0 < seen[-1] <= seen[-2] <= frozen and 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


class _LanguageModel(torch.nn.Module):
    """Returns its loss and its logits, as a transformers model called with labels does."""

    def __init__(self, dim: int = 32, vocab: int = 128) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, dim)
        self.hidden = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.hidden(self.embedding(ids))))
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        return loss, logits


def test_a_returned_result_that_the_user_drops_is_freed_as_in_eager():
    """A training loop that keeps the loss alone (transformers' Trainer: the logits dropped before
    the backward): eager frees the logits there, whose values the backward does not read; so does
    the compiled module, whose forward lets go of them as it returns (before, it held them to the
    end of the backward: one logits-sized tensor above eager's peak). A loop that holds them is
    within the plan, which counts them held."""
    torch.manual_seed(0)
    model = _LanguageModel()
    ids, labels = torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))
    reference = copy.deepcopy(model)
    # (the plan without recomputation frees each tensor after its last use, as eager does)
    compiled = Rockmate(model, (ids, labels), 10**9, solver="none", cost_model="flops")
    logits_bytes = 2 * 16 * 128 * 4
    peaks = {}
    for name, module in (("eager", reference), ("compiled", compiled)):
        for p in module.parameters():
            p.grad = torch.zeros_like(p)
        peaks[name] = [measure_allocator_peak(lambda: module(ids, labels)[0].backward()) for _ in range(2)]

        def holding():
            outputs = module(ids, labels)
            outputs[0].backward()
            return outputs

        peaks[name + " holding"] = measure_allocator_peak(holding)
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert peaks["compiled"] == peaks["eager"], peaks
    assert peaks["compiled holding"] == peaks["eager holding"] >= peaks["eager"][0] + logits_bytes, peaks
    assert peaks["compiled holding"] <= compiled.plan.predicted_peak, (peaks, compiled.plan.predicted_peak)


class _LanguageModelOutput(_LanguageModel):
    """Returns ``{"loss": ..., "logits": ...}``, as a transformers model called with labels does."""

    def forward(self, ids, labels):
        loss, logits = super().forward(ids, labels)
        return {"loss": loss, "logits": logits}


def test_a_model_that_returns_its_loss_is_planned_for_a_backward_from_that_loss():
    """The model returns its loss (a dict's ``loss``): the plan counts no gradient from the user for
    the logits (``output_gradients="auto"``), whose gradient comes from the loss's backward alone
    as in ``outputs["loss"].backward()``: its prediction is the allocator's peak of a loop that holds
    the outputs, where counting one (``"all"``) predicted a logits-sized tensor more. A loss that
    also reads the logits gets exact gradients and a warning that the plan did not count them."""
    torch.manual_seed(0)
    model = _LanguageModelOutput()
    call = {"ids": torch.randint(0, 128, (2, 16)), "labels": torch.randint(0, 128, (2, 16))}
    logits_bytes = 2 * 16 * 128 * 4
    reference = copy.deepcopy(model)
    compiled = Rockmate(model, call, 10**9, solver="none", cost_model="flops")
    every = Rockmate(copy.deepcopy(model), call, 10**9, solver="none", cost_model="flops", output_gradients="all")
    assert every.plan.predicted_peak == compiled.plan.predicted_peak + logits_bytes
    # called with positional inputs (the capture's own output structure): the same
    positional = Rockmate(copy.deepcopy(model), (call["ids"], call["labels"]), 10**9, solver="none", cost_model="flops")
    assert positional.plan.predicted_peak == compiled.plan.predicted_peak

    def holding(module):
        def step():
            outputs = module(**call)
            outputs["loss"].backward()
            return outputs
        return step

    for module in (reference, compiled):
        for p in module.parameters():
            p.grad = torch.zeros_like(p)
    eager = measure_allocator_peak(holding(reference))
    measured = measure_allocator_peak(holding(compiled))
    assert measured == eager <= compiled.plan.predicted_peak + LOSS_BYTES, (measured, eager, compiled.plan.predicted_peak)
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    # the memory timeline's default step is the model's loss too (no warning, within the plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        timeline = compiled.memory_timeline(**call)
    assert timeline.measured_peak <= compiled.plan.predicted_peak
    for module in (reference, compiled):
        for p in module.parameters():
            p.grad = None
        torch.manual_seed(0)
        outputs = module(**call)
        if module is compiled:
            with pytest.warns(UserWarning, match=r"gave a gradient to output 1 \(out\['logits'\], 16384 B\) besides the "
                                                 r"model's own loss.*output_gradients='all'"):
                (outputs["loss"] + 1e-3 * outputs["logits"].square().sum()).backward()
        else:
            (outputs["loss"] + 1e-3 * outputs["logits"].square().sum()).backward()
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    with pytest.raises(ValueError, match="output_gradients='some'"):
        Rockmate(copy.deepcopy(model), call, 10**9, output_gradients="some")


def test_a_step_that_keeps_the_loss_alone_is_planned_without_the_logits():
    """``held_outputs="loss"``: the step keeps the model's loss alone (``loss = model(**batch)["loss"]``,
    as transformers' Trainer), so the plan frees the logits where it no longer needs them, as eager
    does once the step drops them: the plan without recomputation predicts eager's peak of that
    loop (not one logits-sized tensor above it), the minimum budget is a logits-sized tensor lower,
    and at that minimum the loop trains bitwise within the plan. A loop that holds the outputs
    anyway is warned about at its backward."""
    torch.manual_seed(0)
    model = _LanguageModelOutput()
    call = {"ids": torch.randint(0, 128, (2, 16)), "labels": torch.randint(0, 128, (2, 16))}
    logits_bytes = 2 * 16 * 128 * 4
    reference = copy.deepcopy(model)

    def dropping(module):
        return lambda: module(**call)["loss"].backward()

    for p in reference.parameters():
        p.grad = torch.zeros_like(p)
    eager = measure_allocator_peak(dropping(reference))
    held = Rockmate(copy.deepcopy(model), call, 10**9, solver="none", cost_model="flops")
    dropped = Rockmate(copy.deepcopy(model), call, 10**9, solver="none", cost_model="flops", held_outputs="loss")
    assert held.plan.predicted_peak - dropped.plan.predicted_peak == logits_bytes
    assert dropped.plan.predicted_peak <= eager <= dropped.plan.predicted_peak + LOSS_BYTES, \
        (dropped.plan.predicted_peak, eager)
    minimum = min_budget(copy.deepcopy(model), call, cost_model="flops", held_outputs="loss")
    assert minimum <= min_budget(copy.deepcopy(model), call, cost_model="flops") - logits_bytes
    # (the default's refusal of that budget names the option)
    with pytest.raises(InfeasibleBudget, match=rf"outputs held through the step \({logits_bytes} bytes.*"
                                               r"held_outputs='loss' plans without them"):
        Rockmate(copy.deepcopy(model), call, minimum, cost_model="flops")
    compiled = Rockmate(model, call, minimum, cost_model="flops", held_outputs="loss")
    for module in (reference, compiled):
        for p in module.parameters():
            p.grad = torch.zeros_like(p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):  # (gradients accumulated over two steps)
            dropping(reference)()
            measured = measure_allocator_peak(dropping(compiled))
            assert measured <= compiled.plan.predicted_peak + LOSS_BYTES, (measured, compiled.plan.predicted_peak)
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    outputs = compiled(**call)
    with pytest.warns(UserWarning, match=r"still holds output 1 \(out\['logits'\], 16384 B\) at its backward.*"
                                         r"held_outputs='all'"):
        outputs["loss"].backward()
    # (a view of it held keeps it too)
    outputs = compiled(**call)
    loss, last_position = outputs["loss"], outputs["logits"][:, -1]
    del outputs
    with pytest.warns(UserWarning, match=r"still holds output 1 \(out\['logits'\], 16384 B\)"):
        loss.backward()
    with pytest.raises(ValueError, match="held_outputs='logits'"):
        Rockmate(copy.deepcopy(model), call, 10**9, held_outputs="logits")
    # a model that returns a tuple (loss, logits): its scalar outputs count held (the loss among them)
    args = (call["ids"], call["labels"])
    held = Rockmate(_LanguageModel(), args, 10**9, solver="none", cost_model="flops")
    dropped = Rockmate(_LanguageModel(), args, 10**9, solver="none", cost_model="flops", held_outputs="loss")
    assert held.plan.predicted_peak - dropped.plan.predicted_peak == logits_bytes
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dropped(*args)[0].backward()


def test_a_loss_planned_with_its_model_keeps_the_whole_step_under_the_budget():
    """``WithLoss(model, loss_fn)``: outside the model, an MSE's saved difference of the outputs
    and the target is the user's memory, above the plan by that tensor; planned together it is
    counted (the step measured at the prediction, the loss's scalar aside), and the pair trains
    bitwise at 50% of eager's peak (or the minimum) with the gradients in the model's own
    parameters."""
    import torch.nn.functional as F
    from torch import nn

    from exactness import step_peak
    from rockmate import WithLoss

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
    x, y = torch.randn(8, 16), torch.randn(8, 32)
    outside = Rockmate(copy.deepcopy(model), x, 10**9, solver="none", cost_model="flops", held_outputs="loss")
    measured_outside = step_peak(outside, (x,), lambda out: F.mse_loss(out, y), drop=True)
    assert measured_outside - outside.plan.predicted_peak >= y.numel() * y.element_size()
    pair = WithLoss(model, F.mse_loss)
    together = Rockmate(copy.deepcopy(pair), (x, y), 10**9, solver="none", cost_model="flops")
    measured = step_peak(together, (x, y), lambda loss: loss)
    assert measured == measured_outside  # the same step: eager's operations, nothing recomputed
    assert together.plan.predicted_peak <= measured <= together.plan.predicted_peak + LOSS_BYTES
    check_training(pair, (x, y), 0.5, loss=lambda loss: loss)
    with pytest.raises(InfeasibleBudget) as error:  # named in the user's terms: the model's module
        Rockmate(pair, (x, y), 0.5, cost_model="flops")
    assert "in module 'model.2'" in str(error.value) and "with_loss.py" not in str(error.value), str(error.value)
    compiled = Rockmate(pair, (x, y), error.value.minimum, cost_model="flops")
    compiled(x, y).backward()
    assert all(p.grad is not None for p in model.parameters())
    assert list(pair.state_dict()) == [f"model.{key}" for key in model.state_dict()]
    with pytest.raises(TypeError, match="the target is the last positional argument"):
        pair()
