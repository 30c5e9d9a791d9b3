"""Random small models for fuzzing the whole pipeline: a grammar of operations, drawn by hypothesis.

A :class:`Program` is a list of :class:`Instruction` over a list of values: value 0 is the
model's input ``x`` of shape ``(batch, seq, dim)``, and every instruction appends one value of
that same shape, computed from earlier values. :class:`ProgramModel` runs a program as an
``nn.Module`` written as a user would write it (``torch.nn`` modules, ``F.*`` calls, views,
slicing, in-place updates, buffers), so that ``torch.export`` sees ordinary Python code.

The grammar covers what users write and what broke the compiler before: linear layers (tied,
frozen), 1-d and 2-d convolutions, activations (in place too), softmax, layer and batch norms,
dropout (unused too), residual sums and products of earlier values (``h * h + h``), cat, split
and chunk, views and transposes, slicing and index assignment, matmuls, reductions, in-place
updates of intermediates, a buffer counter updated then read, several outputs that may alias
each other or the input, outputs that do not require grad, graphs without parameters, a dropout
of values made from constants alone, values written into a zeros made from constants.

:func:`programs` is the hypothesis strategy; :func:`check_program` is the property (exact, or
a named error, and the allocator's peak within the budget).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Instruction", "Program", "program", "ProgramModel", "OPS", "programs", "make", "check_program", "CheckResult",
           "StraightThrough", "GradientReversal"]

# op name -> number of value inputs
OPS: dict[str, int] = {
    "linear": 1,
    "linear_tied": 1,  # reuses the first linear of the program (a tied weight) if any
    "linear_frozen": 1,
    "linear_relu_inplace": 1,
    "conv1d": 1,
    "conv2d": 1,
    "relu": 1,
    "gelu": 1,
    "tanh": 1,
    "sigmoid": 1,
    "silu": 1,
    "hardswish": 1,
    "softmax": 1,
    "layer_norm": 1,
    "layer_norm_plain": 1,  # without affine parameters
    "batch_norm": 1,
    "batch_norm_unused": 1,  # computed (buffers updated), result unused: returns its input
    "dropout": 1,
    "dropout_unused": 1,  # draws random numbers, result unused: returns its input
    "add": 2,
    "sub": 2,
    "mul": 2,
    "square_plus": 1,  # h * h + h: three gradient contributions
    "cat_linear": 2,
    "cat_time": 2,
    "chunk_mul": 1,
    "split_swap": 1,
    "transpose_tanh": 1,
    "reshape_softmax": 1,
    "index_assign": 2,
    "attention": 2,
    "mean_scale": 1,
    "sum_add": 1,
    "inplace_mul": 2,
    "copy_into": 1,
    "counter": 1,  # a buffer incremented in the forward, then read
    "scale": 1,  # a constant factor: parameter-free
    "identity_view": 1,  # a view of its input
    "straight_through": 1,  # a custom autograd.Function: rounding, its own (clipped) backward
    "grad_reverse": 1,  # a custom autograd.Function with a constant: identity, negated backward
    "positions_dropout": 1,  # a dropout of values made from constants alone, read twice (XLNet)
    "gate_write": 1,  # values that carry gradients written into a zeros made from constants
    "expanded_query": 1,  # a trained parameter expanded to the batch once, read by two nodes (Perceiver)
    "broadcast_mean": 1,  # a result read, then expanded (the view's backward sums) and read by two nodes
    "halves": 1,  # disjoint slices of a result read by two nodes, one of them a cat
    "batch_norm_twice": 2,  # one BatchNorm applied to two values (a siamese encoder's two views)
}


class StraightThrough(torch.autograd.Function):
    """Rounding to quarters with a straight-through gradient, clipped where the input is beyond 1."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x.abs() <= 1)


class _Query(nn.Module):
    """A trained parameter of one vector: learned queries or latents, expanded to the batch."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.randn(dim))


class GradientReversal(torch.autograd.Function):
    """Identity forward (a copy), backward negated and scaled by a constant."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


@dataclass(frozen=True)
class Instruction:
    op: str
    inputs: tuple[int, ...]
    p: float = 0.1  # the dropout rate, where it is used


@dataclass(frozen=True)
class Program:
    """A random model: its instructions, which values it returns, shapes, dtype and inputs."""

    instructions: tuple[Instruction, ...]
    outputs: tuple[int, ...]
    batch: int = 2
    seq: int = 4
    dim: int = 8
    dtype: torch.dtype = torch.float32
    input_requires_grad: bool = False
    seed: int = 0

    def source(self) -> str:
        """The program as readable lines (for failure reports)."""
        lines = [f"x = randn({self.batch}, {self.seq}, {self.dim}, dtype={self.dtype}, "
                 f"requires_grad={self.input_requires_grad})  # v0"]
        for i, ins in enumerate(self.instructions, start=1):
            args = ", ".join(f"v{j}" for j in ins.inputs)
            extra = f", p={ins.p}" if "dropout" in ins.op else ""
            lines.append(f"v{i} = {ins.op}({args}{extra})")
        lines.append("return " + ", ".join(f"v{j}" for j in self.outputs))
        return "\n".join(lines)


def program(instructions, outputs, **shape) -> Program:
    """A :class:`Program` from ``[(op, inputs), ...]`` (regression cases written by hand)."""
    return Program(tuple(Instruction(op, tuple(inputs)) for op, inputs in instructions), tuple(outputs), **shape)


class ProgramModel(nn.Module):
    """A :class:`Program` as an ``nn.Module``."""

    def __init__(self, program: Program) -> None:
        super().__init__()
        self.program = program
        d = program.dim
        layers: dict[str, nn.Module] = {}
        first_linear = None
        for i, ins in enumerate(program.instructions):
            key = f"op{i}"
            if ins.op in ("linear", "linear_relu_inplace") or (ins.op == "linear_tied" and first_linear is None):
                layers[key] = nn.Linear(d, d)
                first_linear = first_linear or key
            elif ins.op == "linear_frozen":
                layers[key] = nn.Linear(d, d, bias=False).requires_grad_(False)
            elif ins.op == "conv1d":
                layers[key] = nn.Conv1d(d, d, 3, padding=1)
            elif ins.op == "conv2d":
                layers[key] = nn.Conv2d(1, 1, 3, padding=1)
            elif ins.op == "layer_norm":
                layers[key] = nn.LayerNorm(d)
            elif ins.op == "layer_norm_plain":
                layers[key] = nn.LayerNorm(d, elementwise_affine=False)
            elif ins.op in ("batch_norm", "batch_norm_unused", "batch_norm_twice"):
                layers[key] = nn.BatchNorm1d(d)
            elif ins.op == "cat_linear":
                layers[key] = nn.Linear(2 * d, d)
            elif ins.op == "expanded_query":
                layers[key] = _Query(d)
        self.layers = nn.ModuleDict(layers)
        self.tied = first_linear
        if any(ins.op == "counter" for ins in program.instructions):
            self.register_buffer("count", torch.zeros((), dtype=program.dtype))

    def forward(self, x):
        values = [x]
        seq = self.program.seq
        for i, ins in enumerate(self.program.instructions):
            key = f"op{i}"
            a = values[ins.inputs[0]]
            b = values[ins.inputs[1]] if len(ins.inputs) > 1 else None
            op = ins.op
            if op in ("linear", "linear_frozen"):
                out = self.layers[key](a)
            elif op == "linear_tied":
                out = self.layers[self.tied](a)
            elif op == "linear_relu_inplace":
                out = F.relu(self.layers[key](a), inplace=True)
            elif op == "conv1d":
                out = self.layers[key](a.transpose(1, 2)).transpose(1, 2)
            elif op == "conv2d":
                out = self.layers[key](a.unsqueeze(1)).squeeze(1)
            elif op in ("relu", "gelu", "tanh", "sigmoid", "silu", "hardswish"):
                out = getattr(F, op)(a)
            elif op == "softmax":
                out = F.softmax(a, dim=-1)
            elif op in ("layer_norm", "layer_norm_plain"):
                out = self.layers[key](a)
            elif op == "batch_norm":
                out = self.layers[key](a.transpose(1, 2)).transpose(1, 2)
            elif op == "batch_norm_twice":
                norm = self.layers[key]
                out = norm(a.transpose(1, 2)).transpose(1, 2) * norm(b.transpose(1, 2)).transpose(1, 2)
            elif op == "batch_norm_unused":
                self.layers[key](a.transpose(1, 2))
                out = a
            elif op == "dropout":
                out = F.dropout(a, ins.p, self.training)
            elif op == "dropout_unused":
                F.dropout(a, ins.p, self.training)
                out = a
            elif op == "add":
                out = a + b
            elif op == "sub":
                out = a - b
            elif op == "mul":
                out = a * b
            elif op == "square_plus":
                out = a * a + a
            elif op == "cat_linear":
                out = self.layers[key](torch.cat([a, b], dim=-1))
            elif op == "cat_time":
                half = seq // 2
                out = torch.cat([a[:, :half], b[:, half:]], dim=1)
            elif op == "chunk_mul":
                left, right = a.chunk(2, dim=-1)
                out = torch.cat([right * left, left], dim=-1)
            elif op == "split_swap":
                left, right = a.split(a.shape[-1] // 2, dim=-1)
                out = torch.cat([right, left], dim=-1)
            elif op == "transpose_tanh":
                out = torch.tanh(a.transpose(1, 2)).transpose(1, 2)
            elif op == "reshape_softmax":
                out = a.reshape(a.shape[0], -1).softmax(-1).reshape(a.shape)
            elif op == "index_assign":
                out = a.clone()
                out[:, 0] = b[:, -1]
            elif op == "attention":
                scores = (a @ b.transpose(1, 2)) / math.sqrt(a.shape[-1])
                out = scores.softmax(-1) @ b
            elif op == "mean_scale":
                out = a * a.mean(-1, keepdim=True)
            elif op == "sum_add":
                out = a + a.sum(1, keepdim=True)
            elif op == "inplace_mul":
                out = a * 1.5
                out.mul_(b)
            elif op == "copy_into":
                out = torch.empty_like(a)
                out.copy_(a.sin())
            elif op == "counter":
                self.count += 1
                out = a * self.count
            elif op == "scale":
                out = a * 0.5
            elif op == "identity_view":
                out = a.view(a.shape)
            elif op == "straight_through":
                out = StraightThrough.apply(a)
            elif op == "positions_dropout":
                positions = torch.arange(a.shape[1], dtype=a.dtype)[:, None] * torch.arange(a.shape[2], dtype=a.dtype)
                positions = F.dropout(torch.sin(positions / a.shape[2]), ins.p, self.training)
                out = (a + positions) * torch.sigmoid(positions)
            elif op == "gate_write":
                gate = torch.zeros(a.shape[0], a.shape[1], dtype=a.dtype)
                gate[:, 0] = a[:, 0, 0]
                out = a * gate[..., None] + torch.tanh(gate)[..., None]  # (read by two nodes)
            elif op == "expanded_query":
                query = self.layers[key].query.expand(a.shape)
                out = query * torch.tanh(a) + query
            elif op == "halves":
                half = a.shape[1] // 2
                out = torch.cat([a[:, :half], torch.tanh(a[:, half:])], dim=1)
            elif op == "broadcast_mean":
                mean = a.mean(0)
                early = torch.sigmoid(mean)
                wide = mean[None].expand(a.shape[0], -1, -1)
                out = wide * a + wide + early
            elif op == "grad_reverse":
                out = GradientReversal.apply(a, 0.5)
            else:  # pragma: no cover - the grammar lists every op
                raise ValueError(f"unknown op {op!r}")
            values.append(out)
        outs = tuple(values[j] for j in self.program.outputs)
        return outs[0] if len(outs) == 1 else outs


def programs(max_length: int = 8):
    """The hypothesis strategy of :class:`Program`."""
    from hypothesis import strategies as st

    names = sorted(OPS)

    @st.composite
    def draw_program(draw) -> Program:
        length = draw(st.integers(1, max_length))
        instructions = []
        for i in range(length):
            op = draw(st.sampled_from(names))
            # mostly the latest values: chains, with edges jumping back now and then
            inputs = tuple(draw(st.integers(max(0, i - 3), i)) if draw(st.booleans()) else i for _ in range(OPS[op]))
            p = draw(st.sampled_from([0.1, 0.5])) if "dropout" in op else 0.1
            instructions.append(Instruction(op, inputs, p))
        count = length + 1
        outputs = tuple(sorted(set(draw(st.lists(st.integers(0, count - 1), min_size=1, max_size=3)))))
        if count - 1 not in outputs and draw(st.booleans()):
            outputs = outputs + (count - 1,)
        return Program(
            instructions=tuple(instructions),
            outputs=outputs,
            batch=draw(st.sampled_from([2, 3])),
            seq=draw(st.sampled_from([4, 6])),
            dim=draw(st.sampled_from([8, 16])),
            dtype=draw(st.sampled_from([torch.float32, torch.float64])),
            input_requires_grad=draw(st.booleans()),
            seed=draw(st.integers(0, 2**16)),
        )

    return draw_program()


class LossInside(nn.Module):
    """The program's model returning its own loss, as a transformers model called with labels
    does: ``{"loss": sum_i <outputs_i, W_i>, "outputs": outputs}`` over the outputs ``read`` (the
    others are returned alone: the loss's backward does not reach them, unless through another)."""

    def __init__(self, model: nn.Module, outputs: tuple, read: list[int], seed: int) -> None:
        super().__init__()
        self.model, self.read = model, list(read)
        self.unread = [i for i, o in enumerate(outputs) if o.requires_grad and o.is_floating_point() and i not in read]
        generator = torch.Generator().manual_seed(seed)
        for i in self.read:
            self.register_buffer(f"w{i}", torch.randn(outputs[i].numel(), generator=generator,
                                                      dtype=outputs[i].dtype), persistent=False)

    def forward(self, x):
        outputs = self.model(x)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        terms = [torch.dot(outputs[i].reshape(-1), getattr(self, f"w{i}")) for i in self.read]
        return {"loss": sum(terms[1:], terms[0]), "outputs": outputs}


def with_loss_inside(model: nn.Module, x: torch.Tensor, seed: int) -> LossInside | None:
    """``model`` returning its loss (:class:`LossInside`) over its outputs that require grad (for
    an odd ``seed`` where there are several, all but the last: an output the loss does not read);
    None where no output requires grad."""
    with torch.random.fork_rng(devices=[]):
        outputs = model(x)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    graded = [i for i, o in enumerate(outputs) if o.requires_grad and o.is_floating_point()]
    if not graded:
        return None
    return LossInside(model, outputs, graded[:-1] if len(graded) > 1 and seed % 2 else graded, seed)


@dataclass
class CheckResult:
    """What :func:`check_program` saw: the outcome and the figures behind it."""

    outcome: str  # "exact", "at_minimum" (the budget was below it), "unsupported", "eager_fails"
    budget: int = 0
    measured_peak: int = 0
    predicted_peak: int = 0
    eager_peak: int = 0
    no_recompute_peak: int = 0  # predicted
    no_recompute_measured: int = 0  # the allocator's peak of a step of that plan
    notes: list[str] = field(default_factory=list)


def make(program: Program) -> tuple[ProgramModel, torch.Tensor]:
    """The model of ``program`` (parameters drawn from its seed) and its input."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(program.seed)
        model = ProgramModel(program).to(program.dtype).train()
    generator = torch.Generator().manual_seed(program.seed + 1)
    x = torch.randn(program.batch, program.seq, program.dim, generator=generator, dtype=program.dtype)
    return model, x.requires_grad_(program.input_requires_grad)


def check_program(program: Program, fraction: float, solver: str = "rockmate", steps: int = 2,
                  loss_inside: bool = False, **options) -> CheckResult:
    """The fuzzing property on one program at ``fraction`` of eager's allocator peak.

    Either eager PyTorch cannot train the model (the outcome "eager_fails"), or the model is
    unsupported (``CaptureError``/``UnsupportedOperation``, the outcome
    "unsupported"), or :func:`exactness.check_training` holds over ``steps`` steps (bitwise
    outputs, parameter and input gradients and buffers; the allocator's peak within the budget
    and the prediction), at ``fraction`` or, when that is below the solver's minimum (which
    ``InfeasibleBudget`` must give), at the minimum. Also: the plan without recomputation
    predicts no more than eager's allocator peak (its outputs held through the step), and the
    solver's minimum is no more than that plan's peak. AssertionError otherwise, with the
    program's source. ``loss_inside``: the model returns its own loss (:func:`with_loss_inside`),
    the step's backward is from it alone (``output_gradients="auto"``). With
    ``held_outputs="loss"`` among the options, every step keeps the loss alone (eager's too).
    """
    from exactness import DotLoss, check_training, eager_peak, model_loss, step_peak
    from rockmate import CaptureError, Rockmate, UnsupportedOperation, min_budget

    options.setdefault("cost_model", "flops")
    model, x = make(program)
    where = "\n" + program.source()
    result = CheckResult("exact")
    if loss_inside:
        inside = with_loss_inside(model, x, program.seed + 2)
        if inside is None and not x.requires_grad:  # (a loss needs an output that requires grad)
            x = x.detach().requires_grad_()
            inside = with_loss_inside(model, x, program.seed + 2)
        model = inside
        if model is None:
            result.outcome = "no_gradient"
            return result
        where += f"\nthe model returns its loss, of the outputs {model.read}"
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        probe = copy.deepcopy(model)(x)
    loss = model_loss if loss_inside else DotLoss(probe)
    drop = options.get("held_outputs") == "loss"
    try:
        eager = eager_peak(model, (x,), loss, drop)
    except RuntimeError as error:  # eager cannot train it either (a saved buffer written again)
        result.outcome = "eager_fails"
        result.notes.append(str(error))
        return result
    try:
        build = {key: value for key, value in options.items() if key in ("cost_model", "max_block_nodes", "held_outputs")}
        none = Rockmate(copy.deepcopy(model), x, 10**12, solver="none", **build)
    except (CaptureError, UnsupportedOperation) as error:
        result.outcome = "unsupported"
        result.notes.append(str(error))
        return result
    result.no_recompute_peak, result.eager_peak = none.plan.predicted_peak, eager
    result.no_recompute_measured = step_peak(none, (x,), loss, drop)
    # the executor matches eager's memory but where an island's engine call holds more at once
    # than eager's engine does (a leaf read twice, merged islands): at most two tensors more
    tensor = max((o.size_bytes for n in none.graphs.simplified.nodes for o in n.outputs), default=0)
    if loss_inside and x.requires_grad:
        # (the model's loss reads the input through a view, x.reshape(-1): its gradient's view
        # group is counted apart, an input-sized sum that a step may not make)
        tensor = max(tensor, x.numel() * x.element_size())
    # and the functional graph's batch norms return the new running statistics, which the
    # executor holds to the end of the forward (eager writes them in place)
    statistics = sum(entry.bytes for entries in none.plan.first_run_bytes.values() for entry in entries
                     if entry.until_loss)
    copies = 0 if loss_inside else loss.copies(probe)
    if drop:  # (the outputs made before the last block count held with held_outputs="loss" too)
        whole = none.graphs.model_chain.whole_graph()
        copies += sum(whole.size(d) for d in none.graphs.model_chain.early_outputs if whole.has_data(d))
    # (an output that the model's loss does not read, nor its backward reach, counts a gradient
    # from the user and its backward all the same, output_gradients: not compared with eager)
    assert (loss_inside and model.unread) or none.plan.predicted_peak <= eager + copies + 2 * tensor + statistics, (
        f"the plan without recomputation predicts {none.plan.predicted_peak} B, above eager's allocator "
        f"peak {eager} B by more than two tensors of {tensor} B and the new statistics {statistics} B{where}")
    minimum = min_budget(copy.deepcopy(model), x, solver=solver, **options)
    assert minimum <= none.plan.predicted_peak, (
        f"the minimum {minimum} B is above the no-recomputation plan's peak {none.plan.predicted_peak} B{where}")
    try:
        report = check_training(model, (x,), fraction, solver, steps=steps, tolerance=1.0,
                                loss=model_loss if loss_inside else None, **options)
    except AssertionError as error:
        raise AssertionError(f"{error}{where}") from error
    except Exception as error:  # any other exception is a failure of the property
        raise AssertionError(f"{type(error).__name__}: {error}{where}") from error
    result.outcome = "at_minimum" if report.at_minimum else "exact"
    result.budget, result.predicted_peak = report.budget, report.predicted_peak
    result.measured_peak = max(report.measured_peaks)
    return result
