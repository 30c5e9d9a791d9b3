"""The exactness and budget check shared by the tests: a compiled model trained next to eager.

:func:`check_training` trains ``Rockmate(model, sample, budget)`` and an eager copy of ``model``
side by side over a few SGD steps, with the same seeds (dropout), and asserts what the project
promises: outputs, parameter gradients, input gradients and buffers bitwise equal to eager's
at every step; the allocator's peak of each whole step (model and loss) within the budget, and
within ``tolerance`` of the plan's prediction (the failure names the operation of the schedule
whose memory is furthest above its prediction).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from rkgb.cdgraph import parameter_sums
from rkgb.memory import allocated_bytes, measure_allocator_peak, tensor_bytes

__all__ = ["bitwise_equal", "DotLoss", "LOSS_BYTES", "loss_bytes", "CheckReport", "check_training", "eager_peak", "step_peak"]

# the loss's own scalars (its dot products, their sum, the gradient of the sum), which the
# test allocates beside the module's memory
LOSS_BYTES = 64


def loss_bytes(device: torch.device) -> int:
    """The loss's own allocations beside the module's: :data:`LOSS_BYTES` on the CPU; on CUDA
    the same eight scalars, each a block of the caching allocator (:func:`allocated_bytes`)."""
    return LOSS_BYTES // 8 * allocated_bytes(8, device)


def _device_of(sample) -> torch.device:
    for x in sample:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


_SAME_SIZE_INTEGER = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (NaNs included: a step that diverges must diverge the
    same way; ``torch.equal`` calls two NaNs different)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        integer = _SAME_SIZE_INTEGER[a.element_size()] if not a.is_complex() else None
        if integer is not None:
            return torch.equal(a.contiguous().view(integer), b.contiguous().view(integer))
    return torch.equal(a, b)


def _flat(outputs) -> tuple:
    if isinstance(outputs, dict):  # a model that returns {"loss": ..., ...}: its tensors, in order
        return tuple(torch.utils._pytree.tree_leaves(outputs))
    return outputs if isinstance(outputs, tuple) else (outputs,)


def model_loss(outputs) -> torch.Tensor:
    """The loss a model returns (``outputs["loss"]``): the step's backward is from it alone."""
    return outputs["loss"]


class DotLoss:
    """``sum_i <outputs_i, W_i>`` over the floating outputs that require grad, with weights
    drawn once, outside the measured region.

    Its forward allocates scalars (and a copy of an output that is not contiguous, which
    :meth:`copies` counts) and its backward only the outputs' gradients, which the plan
    counts: the measured peak is the compiled module's.
    """

    def __init__(self, outputs, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.weights = [
            torch.randn(o.numel(), generator=generator, dtype=o.dtype).to(o.device) if o.is_floating_point()
            else None
            for o in _flat(outputs)
        ]

    def __call__(self, outputs):
        terms = [torch.dot(o.reshape(-1), w) for o, w in zip(_flat(outputs), self.weights)
                 if w is not None and o.requires_grad]
        return sum(terms[1:], terms[0]) if terms else None

    def copies(self, outputs) -> int:
        """Bytes that the loss's forward copies (reshapes of outputs that are not contiguous),
        as the allocator rounds them on CUDA."""
        return sum(tensor_bytes(o) for o, w in zip(_flat(outputs), self.weights)
                   if w is not None and o.requires_grad and not o.is_contiguous())


def _step(module, sample, loss, result: dict, drop: bool = False):
    """One training step; ``drop``: it keeps the loss alone, the outputs dropped before the
    backward (``held_outputs="loss"``), and its outputs are that loss."""
    def step():
        inputs = tuple(x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
                       for x in sample)
        outputs = module(*inputs)
        value = loss(outputs)
        if drop:
            outputs = None if value is None else (value.detach(),)
        if value is not None:
            value.backward()
        result["outputs"] = _flat(outputs) if outputs is not None else []
        result["input_grads"] = [x.grad if isinstance(x, torch.Tensor) else None for x in inputs]

    return step


def eager_peak(model, sample, loss, drop: bool = False) -> int:
    """The allocator's peak of one eager training step (after a warm-up step), with the
    parameters' gradients allocated as after a first step; ``drop``: a step that keeps the loss
    alone."""
    return step_peak(copy.deepcopy(model), sample, loss, drop)


def step_peak(module, sample, loss, drop: bool = False) -> int:
    """The allocator's peak of one training step of ``module`` (eager, or a compiled one) after
    a warm-up step, with the parameters' gradients allocated as after a first step; ``drop``: a
    step that keeps the loss alone."""
    for p in module.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    step = _step(module, sample, loss, {}, drop)
    step()
    return measure_allocator_peak(step, device=_device_of(sample))


@dataclass
class CheckReport:
    """What :func:`check_training` measured."""

    compiled: object
    budget: int
    predicted_peak: int
    measured_peaks: list[int]
    eager_peak: int
    at_minimum: bool


def _train(module, params, sample, loss, steps: int, seed: int, drop: bool = False):
    trained = [p for p in params if p.requires_grad]
    optimizer = torch.optim.SGD(trained, lr=0.05) if trained else None
    torch.manual_seed(seed)
    history = []
    for _ in range(steps):
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=False)
        result: dict = {}
        peak = measure_allocator_peak(_step(module, sample, loss, result, drop), device=_device_of(sample))
        outputs = [o.detach().clone() for o in result["outputs"]]
        grads = [None if p.grad is None else p.grad.clone() for p in params]
        history.append((outputs, grads, result["input_grads"], peak))
        if optimizer is not None:
            optimizer.step()
    return history


def check_training(model, sample, fraction: float, solver: str = "rockmate", *, steps: int = 3,
                   at_minimum: bool = True, tolerance: float = 0.03, loss=None, **options) -> CheckReport | None:
    """Train ``model`` compiled at ``fraction`` of eager's allocator peak next to an eager copy.

    Asserts bitwise equal outputs, parameter and input gradients and buffers at each step,
    the compiled step's allocator peak within the budget (the loss's own scalars and copies
    aside) and within ``tolerance`` under the plan's prediction. Below the solver's minimum,
    the error must give that minimum; with ``at_minimum`` the check runs again at it (the
    tightest plan: the hardest case), otherwise returns None. ``options`` go to ``Rockmate``
    (``cost_model="flops"`` by default: deterministic plans). ``loss``: the step's loss of the
    outputs (default: a :class:`DotLoss` of every output; :func:`model_loss` for a model that
    returns its own). With ``held_outputs="loss"`` among the options, the steps keep the loss
    alone (the outputs dropped before the backward, as the plan takes them to be) and compare it
    in place of the outputs.
    """
    from rockmate import InfeasibleBudget, Rockmate

    options.setdefault("cost_model", "flops")
    sample = tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)
    reference = copy.deepcopy(model)
    for p in list(model.parameters()) + list(reference.parameters()):
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    device = _device_of(sample)
    with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        probe = copy.deepcopy(model)(*sample)
    if loss is None:
        loss = DotLoss(probe)
        slack = loss_bytes(device) + loss.copies(probe)
    else:
        slack = loss_bytes(device)
    drop = options.get("held_outputs") == "loss"
    eager = eager_peak(model, sample, loss, drop)
    budget = max(1, int(eager * fraction))
    minimum = False
    try:
        compiled = Rockmate(model, sample, budget, solver=solver, **options)
    except InfeasibleBudget as error:
        assert error.minimum is not None and error.minimum > budget, str(error)
        assert str(error.minimum) in str(error)
        if not at_minimum:
            return None
        budget, minimum = error.minimum, True
        compiled = Rockmate(model, sample, budget, solver=solver, **options)
    predicted = compiled.plan.predicted_peak
    assert predicted <= budget, (predicted, budget)
    # the sums of shared parameters' contributions, which the plan counts for gradient
    # accumulation (a .grad that holds values): these steps zero the gradients, nothing is summed
    shared = sum(parameter_sums(compiled.plan.first_run_bytes).values())
    params = list(model.parameters())
    expected = _train(reference, list(reference.parameters()), sample, loss, steps, 1, drop)
    got = _train(compiled, params, sample, loss, steps, 1, drop)
    peaks = []
    for step, ((out_e, grad_e, in_e, _), (out_g, grad_g, in_g, peak)) in enumerate(zip(expected, got)):
        for i, (a, b) in enumerate(zip(out_e, out_g)):
            assert bitwise_equal(a, b), f"step {step}: output {i} differs"
        for (path, _), a, b in zip(reference.named_parameters(), grad_e, grad_g):
            assert (a is None) == (b is None), f"step {step}: gradient of {path}: {a} against {b}"
            assert a is None or bitwise_equal(a, b), f"step {step}: gradient of {path} differs"
        for i, (a, b) in enumerate(zip(in_e, in_g)):
            assert (a is None) == (b is None), f"step {step}: gradient of input {i}: {a} against {b}"
            assert a is None or bitwise_equal(a, b), f"step {step}: gradient of input {i} differs"
        if not (peak <= budget + slack and (1 - tolerance) * (predicted - shared) <= peak <= predicted + slack):
            raise AssertionError(f"step {step}: allocator peak {peak} B against a predicted {predicted} B "
                                 f"(budget {budget} B): " + where_memory_differs(compiled, sample, loss))
        peaks.append(peak)
    for (path, a), b in zip(reference.named_buffers(), model.buffers()):
        assert bitwise_equal(a, b), f"buffer {path} differs"
    return CheckReport(compiled, budget, predicted, peaks, eager, minimum)


def where_memory_differs(compiled, sample, loss) -> str:
    """The operation of the schedule whose allocator peak is furthest above its prediction."""
    from exec.timeline import measure_timeline

    # (the loss reads the outputs in the model's structure: a dict's "loss", model_loss)
    timeline = measure_timeline(compiled.compiled, tuple(sample), lambda outputs: loss(compiled._structured(outputs)),
                                compiled.plan)
    worst = timeline.worst()
    if worst is None:
        index, label = timeline.peak_operation()
        return f"no operation above its prediction; the measured peak is at operation {index}, {label}"
    index, label, measured, predicted = worst
    return f"operation {index}, {label}, measured {measured} B against a predicted {predicted} B"
