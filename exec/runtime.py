"""The compiled module: an ``nn.Module`` that runs a schedule through generated code.

:class:`CompiledModule` wraps the model; in training mode with grad enabled, its forward calls
an ``autograd.Function`` whose ``forward`` runs the generated forward phase and whose
``backward`` runs the generated backward phase (Rockmate, ICML 2023, section 5). Each simplified
node is an autograd island: its backward is a nested ``torch.autograd.backward`` from its own
outputs, so the parameters' gradients accumulate in ``p.grad`` directly, as in eager PyTorch
(optimizers, hooks and ``zero_grad`` work unchanged). A node read by one node only, which the
schedule always runs right before it, shares that node's island (:mod:`exec.merge`): one
engine call and no leaf between them.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch
from torch import nn

from rkgb.capture import as_input_tuple
from rkgb.cdgraph import LOSS_NAME, DataKind, data_name, parameter_sums
from rkgb.gradsink import GradientQueue, GradSink, ParameterSink, accumulate, gradient_node, handoff, handoff_backward
from rkgb.interpret import batch_norm_not_updating, batch_norm_updating, in_grad_mode, with_eager_requires_grad
from rkgb.saved import SavedTensors
from rkgb.simplify import SimplifiedGraph
from solvers.schedule import Compute, Schedule

from .codegen import GeneratedCode, generate, node_infos
from .merge import plan_merges

__all__ = ["CompiledModule", "StepState"]


class StepState:
    """The values of one training step: leaves, island outputs, views, RNG states, ...

    Attributes are named after the graph's fx nodes (see :mod:`exec.codegen`); ``saved`` is
    the step's registry of saved tensors.
    """

    def __init__(self, saved: SavedTensors) -> None:
        self.saved = saved
        self.queue = GradientQueue()  # gradient contributions waiting for their sinks


# -- helpers called by the generated code ---------------------------------------------------


_engine = torch.autograd.Variable._execution_engine


def _run_backward(tensors: tuple, grads: tuple) -> None:
    """``torch.autograd.backward(tensors, grads)`` without its argument processing (the
    generated code passes tuples of tensors and gradients of the right shapes)."""
    _engine.run_backward(tensors, grads, False, False, (), True, True)


def _late_views_gradient(base: torch.Tensor, views_of, leaves: tuple[torch.Tensor, ...], sink) -> None:
    """Pass late views' gradients (``leaves``' ``.grad``, cleared) through the views' backwards
    alone into the gradient sink of the result they view (``base``'s leaf): where eager's engine
    runs the view's backward, before the nodes made before the view
    (``exec.codegen._result_views_made_late``). The views are made again by ``views_of`` from an
    alias of the base (its data or its placeholder: a view's backward reads no data), their
    gradients handed over by a :func:`rkgb.gradsink.handoff` root so that the engine's buffers own
    them (added in place, in the engine's order, as eager's are)."""
    grads = tuple(leaf.grad for leaf in leaves)
    if all(grad is None for grad in grads):
        return
    for leaf in leaves:
        leaf.grad = None
    with torch.enable_grad():
        alias = base.detach().requires_grad_()
        root = handoff(*views_of(alias))
    root.grad_fn.pending = grads
    del grads
    (base_grad,) = _engine.run_backward((root,), (root.detach(),), False, False, (alias,), True, False)
    sink((base_grad,))


def _backward_outputs(tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """Backward from the tensors that require grad and received a gradient (a tensor returned
    several times has one gate, so one gradient: :meth:`CompiledModule.forward`)."""
    roots, root_grads = [], []
    for tensor, grad in zip(tensors, grads):
        if grad is not None and tensor.requires_grad:
            roots.append(tensor)
            root_grads.append(grad)
    if roots:
        torch.autograd.backward(roots, root_grads)  # checks shapes: the user's gradients


def _stash_grad(parameter: torch.Tensor, path: str = "") -> torch.Tensor | None:
    """Set aside a ``.grad`` that holds values (gradient accumulation over several steps).

    Eager PyTorch sums the gradient contributions of a parameter read by several nodes (tied
    weights, an unrolled RNN) and adds the sum to ``.grad`` once: ``g + (c1 + c2 + ...)``.
    Islands add each contribution as it comes: ``(g + c1) + c2 ...``, equal only when ``g`` is
    zero or None. So the old ``.grad`` is set aside, the contributions build the sum in
    ``.grad``, and :func:`_restore_grad` adds it to the old one, as eager does. (A check of one
    pass over the gradient; the sum takes one more parameter-sized buffer, as in eager.)
    """
    grad = parameter.grad
    if grad is None or not bool(grad.any()):
        return None
    parameter.grad = None
    return grad


def _refuse_accumulation(parameter: torch.Tensor, path: str = "") -> None:
    """:func:`_stash_grad` for a plan built with ``grad_accumulation=False``, which does not
    count the sum of a shared parameter's contributions: a ``.grad`` holding values is refused
    (the step would go over the budget by the parameter's size) before anything runs."""
    grad = parameter.grad
    if grad is not None and bool(grad.any()):
        raise RuntimeError(
            f"Rockmate: parameter {path!r} is read by several nodes and its .grad holds values (gradient "
            f"accumulation): eager sums this step's contributions apart before adding them, one more buffer of "
            f"{parameter.untyped_storage().nbytes()} bytes, which this plan (built with grad_accumulation=False) "
            f"does not count. Build with grad_accumulation=True (the default), or zero the gradients before each "
            f"step (optimizer.zero_grad())")


def _restore_grad(parameter: torch.Tensor, stash: torch.Tensor | None) -> None:
    if stash is None:
        return
    if parameter.grad is not None:
        stash.add_(parameter.grad)
    parameter.grad = stash


def _rng_helpers(device: torch.device):
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()

        def rng_get():
            return torch.get_rng_state(), torch.cuda.get_rng_state(index)

        def rng_set(state):
            torch.set_rng_state(state[0])
            torch.cuda.set_rng_state(state[1], index)

        return rng_get, rng_set
    return torch.get_rng_state, torch.set_rng_state


class _ParameterCollector:
    """Takes a parameter's gradient contributions instead of its ``AccumulateGrad`` node, for a
    backward that must not accumulate them into ``.grad`` (``torch.autograd.grad(loss, params)``
    returns them instead, ``backward(inputs=...)`` leaves them out): a prehook on the node adds
    them up as eager's ``InputBuffer`` would (:func:`rkgb.gradsink.accumulate`), and the compiled
    module's backward returns the sum to the engine, which uses it as eager's engine would."""

    def __init__(self, parameter: torch.Tensor) -> None:
        self.grad: torch.Tensor | None = None
        self.handle = gradient_node(parameter).register_prehook(self)

    def __call__(self, grad_outputs):
        if grad_outputs[0] is not None:
            # held by self.grad alone: one reference
            self.grad = accumulate(self.grad, grad_outputs[0], self.grad is not None and self.grad._use_count() == 1)
        return (None,)


class _Accumulators:
    """The ``AccumulateGrad`` nodes of the parameters, found once (``get_gradient_edge`` makes a
    view of a leaf to reach its node: ~7 us a parameter, at every backward before) and again for
    a parameter that is another tensor since (the previous one is let go)."""

    def __init__(self, count: int) -> None:
        self.found: list[tuple[torch.Tensor | None, object]] = [(None, None)] * count

    def engine_accumulates_into(self, index: int, parameter: torch.Tensor) -> bool:
        """Whether the running backward accumulates into ``parameter.grad`` (``loss.backward()``),
        or not (``torch.autograd.grad``, ``backward(inputs=...)`` without it)."""
        tensor, node = self.found[index]
        if tensor is not parameter:
            node = gradient_node(parameter)
            self.found[index] = (parameter, node)
        try:
            return torch._C._will_engine_execute_node(node)
        except RuntimeError:  # the engine raises for a leaf while it runs torch.autograd.grad()
            return False


_SECOND_BACKWARD = (
    "Rockmate: a second backward through one forward of the compiled module (retain_graph=True, or two "
    "backwards from one loss): the plan frees what it used as the backward goes; run the forward again "
    "for another backward"
)


class _Handover:
    """The gradients of one forward's outputs, handed over by :class:`_OutputGate`s; the
    outputs' versions when the forward returned them, and those whose values the backward
    reads (:func:`_check_outputs_unchanged`)."""

    __slots__ = ("grads", "versions", "names", "read_by_backward", "dropped")

    def __init__(self, names: Sequence[str], read_by_backward: frozenset[int] | None = None) -> None:
        self.grads: list[torch.Tensor | None] = [None] * len(names)
        self.versions: list[int] = []
        self.names = names  # the outputs' names in the user's terms (for the error)
        self.read_by_backward = read_by_backward  # None: any of them, for all we know
        # the outputs that the plan takes the step to drop, and the executor let go of
        self.dropped: list[tuple[int, _StorageWatch]] = []


class _OutputGate(torch.autograd.Function):
    """The identity on one output of the compiled module, whose backward hands the output's
    gradient over to the step (:class:`_Handover`) instead of passing it to the engine.

    The engine keeps the gradients it passes to a node until that node's backward returns; for
    the compiled module, that is the end of the whole backward. Handed over, an output's
    gradient is the step's alone, freed after its last use, as eager frees it.
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, handover: _Handover, index: int):
        ctx.handover, ctx.index = handover, index
        # a new tensor over the output's storage, not a view: the user may write it in place
        # (``F.relu(out, inplace=True)``), as eager allows, where the plan's backward does not
        # read its values; it shares the version counter, which the backward checks
        return output.detach()

    @staticmethod
    def backward(ctx, grad):
        if ctx.handover is None:
            raise RuntimeError(_SECOND_BACKWARD)
        ctx.handover.grads[ctx.index] = grad
        ctx.handover = None
        return None, None, None


def _check_outputs_unchanged(handover: _Handover, outputs: Sequence[torch.Tensor]) -> None:
    """Refuse a backward whose plan reads the values of an output that was written in place
    after the forward returned it (eager raises too where its backward saved that tensor:
    "modified by an inplace operation"); an output the backward does not read may be written."""
    for i, (output, version) in enumerate(zip(outputs, handover.versions)):
        if output._version != version and (handover.read_by_backward is None or i in handover.read_by_backward):
            raise RuntimeError(
                f"Rockmate: output {i} of the compiled module ({handover.names[i]}) was modified by an in-place "
                "operation after the forward returned it, and the plan's backward reads its values (a backward "
                "that saved it, or a recomputation): write a copy instead (out = out.clone() first, or an "
                "out-of-place operation)")


def _outputs_read_by_backward(graph: SimplifiedGraph, read: set[str] | None, cdgraph) -> frozenset[int] | None:
    """Indices of the user outputs whose values a backward or recomputation of the schedule
    reads (``read``: :func:`_data_read_after_loss`), or may read (an output that is not a node's
    data: a model input, a buffer); None, all of them, without a CD-graph."""
    if read is None:
        return None
    indices = set()
    for i, name in enumerate(graph.outputs):
        data = data_name(graph.owner.get(name, name), DataKind.DATA)
        if data in read or not cdgraph.has_data(data):
            indices.add(i)
    return frozenset(indices)


def _data_read_after_loss(schedule: Schedule, cdgraph) -> set[str] | None:
    """The data nodes that the computations after the loss of ``schedule`` read (backwards and
    recomputations); None without a CD-graph with a loss."""
    if cdgraph is None or not cdgraph.has_compute(LOSS_NAME):
        return None
    after_loss, read = False, set()
    for op in schedule.ops:
        if not isinstance(op, Compute):
            continue
        if op.node == LOSS_NAME:
            after_loss = True
        elif after_loss and cdgraph.has_compute(op.node):
            read.update(cdgraph.compute(op.node).needs)
    return read


def outputs_to_release(graph: SimplifiedGraph, read: set[str] | None, cdgraph, infos) -> frozenset[str]:
    """The nodes whose data the model returns (as the node's own tensors, not views of them) and
    no computation after the loss reads (``read``: :func:`_data_read_after_loss`): the forward
    lets go of them as it returns.

    Eager frees such an output when the user drops it (a training loop that keeps only the loss,
    as transformers' ``Trainer`` does with the logits); held by the step's state, it would stay
    to the end of the backward. The plan still counts it alive through the step (the user may
    hold it: ``solvers.simulate``'s ``keep_outputs``); released, it is freed where the user lets go.
    """
    if read is None:
        return frozenset()
    returned: dict[str, set[str]] = {}
    for name in graph.outputs:
        returned.setdefault(graph.owner.get(name, name), set()).add(name)
    released = set()
    for node, names in returned.items():
        data = data_name(node, DataKind.DATA)
        if node in infos and cdgraph.has_data(data) and data not in read \
                and names <= set(infos[node].exported):
            released.add(node)
    return frozenset(released)


def _warn_if_unplanned(grads: list[torch.Tensor | None], graph: SimplifiedGraph, names: Sequence[str]) -> None:
    """Warn where the loss gave a gradient to an output that the plan counts none for (the model
    returns its own loss, from which alone the plan takes the backward to run: ``rockmate``'s
    ``output_gradients``; ``names``: the outputs' in the user's terms). The executor passes it on
    as eager does: the gradients are exact, but the plan did not count that tensor."""
    if not graph.outputs_without_gradient:
        return
    for i, (grad, name) in enumerate(zip(grads, graph.outputs)):
        if grad is not None and name in graph.outputs_without_gradient:
            warnings.warn(
                f"Rockmate: the loss gave a gradient to output {i} ({names[i]}, {grad.numel() * grad.element_size()} B) "
                "besides the model's own loss, from which alone the plan takes the backward to run: the gradients are "
                "exact, but the step's peak may exceed the plan by up to that much; build with "
                "output_gradients='all' to count it",
                stacklevel=2,
            )
            return


def _dropped_outputs(graph: SimplifiedGraph, cdgraph, released: frozenset[str]) -> list[int]:
    """The indices of the outputs that the plan takes the step to drop once the forward returns
    them (``CDGraph.dropped_outputs``: ``rockmate``'s ``held_outputs="loss"``) and that the
    executor lets go of then (``released``: :func:`outputs_to_release`)."""
    dropped = set(getattr(cdgraph, "dropped_outputs", ()))
    return [i for i, name in enumerate(graph.outputs) if graph.owner.get(name, name) in released
            and data_name(graph.owner.get(name, name), DataKind.DATA) in dropped]


class _StorageWatch:
    """Whether a tensor's storage is still alive, without holding it (a weak reference to the
    storage: the user's tensor keeps it, or a view of it that the user keeps)."""

    __slots__ = ("handle", "nbytes")

    def __init__(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        self.handle, self.nbytes = storage._weak_ref(), storage.nbytes()

    def alive(self) -> bool:
        return not torch.UntypedStorage._expired(self.handle)

    def __del__(self) -> None:
        torch.UntypedStorage._free_weak_ref(self.handle)


def _warn_if_held(handover: _Handover) -> None:
    """Warn where an output that the plan takes the step to have dropped is still alive at the
    backward (the user holds it, or a view of it): its memory is not in the plan after the
    forward; the gradients are exact. (A tensor that the loss saved for its own backward is
    freed by that backward, which runs before the model's.)"""
    for i, watch in handover.dropped:
        if watch.alive():
            warnings.warn(
                f"Rockmate: the step still holds output {i} ({handover.names[i]}, {watch.nbytes} B) at its backward, "
                "which the plan (held_outputs='loss') takes it to drop once the forward returns: the gradients are "
                "exact, but the step's peak may exceed the plan by up to that much; drop it (and its views) before "
                "the backward (loss = model(**batch).loss) or build with held_outputs='all'",
                stacklevel=3,
            )
            return


def _warn_if_shared(grads: list[torch.Tensor | None]) -> None:
    """Warn where the loss handed an output's gradient over as part of a bigger tensor.

    The plan frees each output's gradient once the first autograd node of its backward has used
    it (``solvers.simulate``: the loss's gradients are the step's alone), as eager's engine
    frees a gradient it holds alone; a part of a bigger tensor (the loss read a ``cat`` or a
    ``stack`` of the outputs) keeps that tensor alive until every part has been used. (An
    expanded scalar, the gradient of a ``sum`` or a ``mean``, holds no memory to free.)"""
    for i, grad in enumerate(grads):
        if grad is None or 0 in grad.stride():
            continue
        # (a view of a bigger tensor; read without asking for the storage, whose Python object,
        # once made, would keep the engine from summing into this gradient in place: rkgb.gradsink)
        base = grad._base
        if base is not None and base.numel() > grad.numel():
            warnings.warn(
                f"Rockmate: the loss's gradient of output {i} is part of a bigger tensor "
                f"({base.numel() * base.element_size()} B; did the loss read a cat or a stack of the outputs?): "
                "the plan frees each output's gradient after its first use, which that tensor delays; the "
                f"step's peak may exceed the plan by up to {grad.numel() * grad.element_size()} B. Compute the "
                "loss from each output separately to keep the budget",
                stacklevel=2,
            )
            return


class _ScheduleFunction(torch.autograd.Function):
    """``forward``: the forward phase; ``backward``: the backward phase (reentrant).

    The islands' backwards accumulate the parameters' gradients into ``.grad`` as they go, as
    eager's ``AccumulateGrad`` would at the end; where the running backward does not accumulate
    into a parameter, its contributions are collected and returned to the engine instead
    (:class:`_ParameterCollector`), and so are those of a parameter with hooks, read through an
    alias of its own in the islands (its hooks run once, on the whole gradient, as in eager).
    """

    @staticmethod
    def forward(ctx, runner: "_Runner", handover: _Handover, state: StepState, *tensors: torch.Tensor):
        ctx.set_materialize_grads(False)
        inputs = tensors[: runner.input_count]
        with torch.enable_grad():
            outputs = runner.code.forward_phase(state, *inputs)
        # outputs that do not require grad in the model (computed from inputs alone) do not here
        ctx.mark_non_differentiable(*[out for out, held in zip(outputs, state.outputs) if not held.requires_grad])
        ctx.state = state
        ctx.runner = runner
        ctx.handover = handover
        ctx.parameters = tensors[runner.input_count:]
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        state, runner = ctx.state, ctx.runner
        ctx.state = None
        if state is None:
            raise RuntimeError(_SECOND_BACKWARD)
        if torch.is_grad_enabled():
            raise RuntimeError(
                "Rockmate: backward with create_graph=True (gradients of gradients) is not supported: each "
                "node's graph is freed when its backward ends; compute higher-order gradients on the model itself"
            )
        parameters = ctx.parameters
        collectors = {
            i: _ParameterCollector(p) for i, p in enumerate(parameters)
            if p.requires_grad and i not in runner.aliased_parameters and not runner.accumulators.engine_accumulates_into(i, p)
        }
        _check_outputs_unchanged(ctx.handover, state.outputs)
        _warn_if_held(ctx.handover)
        names = ctx.handover.names
        # the outputs' gradients come from their gates (the engine passes None here)
        state.grad_outputs, ctx.handover.grads, ctx.handover = ctx.handover.grads, None, None
        _warn_if_shared(state.grad_outputs)
        _warn_if_unplanned(state.grad_outputs, runner.module.graph, names)
        try:
            with torch.enable_grad():
                runner.code.backward_phase(state)
        finally:
            for collector in collectors.values():
                collector.handle.remove()
        grads = [None, None, None]  # the runner, the handover, the step's state
        for name, requires_grad in zip(runner.input_names, runner.input_requires_grad):
            grads.append(getattr(state, name).grad if requires_grad else None)
        for i in range(len(parameters)):
            if i in runner.aliased_parameters:
                grads.append(getattr(state, runner.aliased_parameters[i]).grad)
            else:
                grads.append(collectors[i].grad if i in collectors else None)
        return tuple(grads)


class _Runner:
    """Generated code for one pattern of ``requires_grad`` of inputs and parameters."""

    def __init__(self, module: "CompiledModule", input_requires_grad: list[bool], parameter_requires_grad: list[bool],
                 hooked: tuple[bool, ...] = (), markers: bool = False):
        graph = module.graph
        captured = graph.captured
        self.input_names = [name for name in captured.inputs if name is not None]
        self.input_count = len(self.input_names)
        self.input_requires_grad = input_requires_grad
        self.parameter_count = len(module._parameter_refs)
        self.accumulators = _Accumulators(self.parameter_count)  # the parameters' AccumulateGrad nodes
        # parameters with hooks, read through an alias of their own: index -> state attribute
        aliased = {name for (name, _, _), flag in zip(module._parameter_refs, hooked) if flag}
        self.aliased_parameters = {i: f"param_{name}" for i, (name, _, _) in enumerate(module._parameter_refs)
                                   if name in aliased}
        requires: dict[str, bool] = {}
        for name, flag in zip(self.input_names, input_requires_grad):
            requires[name] = flag
        for (name, _module, _attribute), flag in zip(module._parameter_refs, parameter_requires_grad):
            requires[name] = flag
        # views of globals require grad when their base does
        for line in graph.global_views:
            requires[line.name] = any(requires.get(arg.name, False) for arg in line.all_input_nodes)
            graph.owner.setdefault(line.name, line.name)
        self.infos = node_infos(graph, requires)
        rng_get, rng_set = _rng_helpers(module.device)
        helpers = {
            "rng_get": rng_get,
            "rng_set": rng_set,
            "run_backward": _run_backward,
            "backward_outputs": _backward_outputs,
            "handoff": handoff,
            "handoff_backward": handoff_backward,
            "late_views_gradient": _late_views_gradient,
            "no_grad": torch.no_grad,
            "grad_sink": GradSink,
            "parameter_sink": ParameterSink,
            "batch_norm_updating": batch_norm_updating,
            "in_grad_mode": in_grad_mode,
            "with_eager_requires_grad": with_eager_requires_grad,
            "batch_norm_not_updating": batch_norm_not_updating,
            # a plan that counts the shared parameters' sums (grad_accumulation=True), or a
            # module without a plan's first-run memory, sums apart; another refuses to
            "stash_grad": _stash_grad if module.first_run_bytes is None or parameter_sums(module.first_run_bytes)
            else _refuse_accumulation,
            "restore_grad": _restore_grad,
            "mark": torch.profiler.record_function,
        }
        released = outputs_to_release(graph, module._read_after_loss, module.cdgraph, self.infos)
        # (those that the plan takes the step to drop: checked at the backward, _warn_if_held)
        self.dropped_outputs = _dropped_outputs(graph, module.cdgraph, released)
        self.merged = plan_merges(graph, module.schedule, self.infos, module.cdgraph, module.peak_limit,
                                  module.first_run_bytes) if module.merge_islands else {}
        self.code: GeneratedCode = generate(
            graph, module.schedule, self.infos, input_requires_grad, helpers, module.device, self.merged, markers,
            aliased_parameters=aliased,
            trained_parameters={name for (name, _, _), flag in zip(module._parameter_refs, parameter_requires_grad)
                                if flag},
            released_outputs=released,
        )
        self.module = module

    def new_state(self, global_tensors: list[torch.Tensor]) -> StepState:
        """The state of one step; ``global_tensors``: the parameters, buffers and constants now."""
        saved = SavedTensors()
        saved.register_globals(global_tensors)
        return StepState(saved)


def autocast_state() -> tuple:
    """Which autocast is on, per device type (enabled, dtype): what a capture records."""
    return tuple((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                 for device in ("cpu", "cuda"))


def _describe_autocast(state: tuple) -> str:
    on = [f"{device}:{str(dtype).replace('torch.', '')}" for device, enabled, dtype in state if enabled]
    return "(" + ", ".join(on) + ")" if on else "off"


class _MatmulsInBackward(torch.autograd.Function):
    """Identity whose backward runs a matrix product with a bias and one without."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        a = torch.ones(2, 2, device=grad.device)
        torch.addmm(torch.ones(2, device=grad.device), a, a)
        torch.mm(a, a)
        return grad


def warm_engine_thread(device: torch.device) -> None:
    """Make cuBLAS's per-thread workspaces of the autograd engine's ``device`` thread now.

    cuBLAS and cuBLASLt keep a workspace per thread and stream, allocated from the caching
    allocator at their first product there and kept for the process. Eager's steps run
    products with a bias (cuBLASLt's path) only in the forward thread; a plan that recomputes
    a linear layer runs one in the engine's thread, whose first run would add that workspace
    (1 MiB by default) to the first step's peak."""
    x = torch.zeros(1, device=device, requires_grad=True)
    _MatmulsInBackward.apply(x).sum().backward()


class CompiledModule(nn.Module):
    """``model`` executed by ``schedule``: same outputs, gradients and buffer updates.

    Parameters
    ----------
    model:
        The original module. It stays a submodule: its parameters and buffers are used (and
        updated) in place, and it runs as is in ``eval()`` mode or under ``torch.no_grad()``.
    graph:
        The simplified graph of ``model`` on ``sample`` (:func:`rkgb.simplify.simplify`).
    schedule:
        Operations on the graph's CD-graph names (``fwd_x``, ``bwd_x``, ``loss``, ``x.data``,
        ``x.grad``, ``x.phantoms``); see :mod:`solvers.schedule`.
    sample:
        The sample the graph was captured on: calls must have the same shapes and dtypes.
    cdgraph, peak_limit, first_run_bytes:
        The whole model's CD-graph, the plan's predicted peak of it and its first-run memory
        (``Plan.first_run_bytes``): islands are merged (:mod:`exec.merge`) only where the
        simulated peak of the real execution order stays within ``peak_limit``. Without them,
        every merge the schedule allows is made.
    merge_islands:
        ``False`` keeps one autograd island per node.

    Raises
    ------
    exec.codegen.ScheduleError
        The schedule names an unknown node or runs a backward without an autograd graph.
    """

    def __init__(self, model: nn.Module, graph: SimplifiedGraph, schedule: Schedule, sample, *,
                 cdgraph=None, peak_limit: int | None = None, first_run_bytes=None,
                 merge_islands: bool = True) -> None:
        super().__init__()
        self.model = model
        self.graph = graph
        self.schedule = schedule
        self.cdgraph = cdgraph
        self.peak_limit = peak_limit
        self.first_run_bytes = first_run_bytes
        self.merge_islands = merge_islands
        # the data nodes that the computations after the loss read (one pass over the schedule)
        self._read_after_loss = _data_read_after_loss(schedule, cdgraph)
        self._read_by_backward = _outputs_read_by_backward(graph, self._read_after_loss, cdgraph)
        # the outputs' places in the model's output structure (``out['logits']``), set by the
        # caller that knows it (rockmate.Rockmate); None: named by their graph's names
        self.output_labels: list[str] | None = None
        sample = as_input_tuple(sample)
        captured = graph.captured
        self._sample_signature = [
            (tuple(value.shape), value.dtype, value.device) if isinstance(value, torch.Tensor) else value
            for value in sample
        ]
        tensors = [value for value in sample if isinstance(value, torch.Tensor)]
        self.device = tensors[0].device if tensors else next(model.parameters()).device
        # (placeholder, owning module, attribute) of every parameter, buffer
        self._parameter_refs = [(name, *self._owner_of(path)) for name, path in captured.parameters.items()]
        self._buffer_refs = [(name, *self._owner_of(path)) for name, path in captured.buffers.items()]
        # plain tensor attributes (not parameters nor buffers) behind constant placeholders
        self._constant_refs = []
        for name, path in captured.constant_paths.items():
            try:
                module, attribute = self._owner_of(path)
            except AttributeError:  # (not an attribute's path: a tensor made in the forward)
                continue
            if getattr(module, attribute, None) is captured.constants[name]:
                self._constant_refs.append((name, module, attribute))
        self._runners: dict[tuple, _Runner] = {}
        # the dtype and device of each parameter and buffer at build time: the plan's sizes and
        # kernels are theirs (a model cast or moved afterwards needs a new plan)
        self._state_signature = self._current_state_signature(*self._current_tensors())
        self._autocast = autocast_state()  # the graph holds the casts of the build's autocast
        # run each schedule operation inside a profiler range (exec.timeline), off by default
        self.markers = False
        self.runner_for(sample)  # the code of the sample's pattern, generated now
        if self.device.type == "cuda":
            warm_engine_thread(self.device)

    def describe_outputs(self) -> list[str]:
        """Each output as errors and warnings name it: its place in the model's output structure
        (``out['logits']``) where known, else its name in the captured graph."""
        if self.output_labels is not None:
            return self.output_labels
        return [repr(name) for name in self.graph.outputs]

    def _owner_of(self, path: str) -> tuple[nn.Module, str]:
        module_path, _, attribute = path.rpartition(".")
        return self.model.get_submodule(module_path), attribute

    def _runner(self, input_requires_grad: list[bool], parameter_requires_grad: list[bool],
                hooked: tuple[bool, ...] = (), markers: bool = False) -> _Runner:
        key = (tuple(input_requires_grad), tuple(parameter_requires_grad), tuple(hooked), markers)
        runner = self._runners.get(key)
        if runner is None:
            runner = self._runners[key] = _Runner(self, input_requires_grad, parameter_requires_grad, hooked, markers)
        return runner

    def _current_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The model's parameters and buffers behind the graph's placeholders, as they are now
        (a module may have replaced one): read once per call, each through ``Module.__getattr__``."""
        return [getattr(m, a) for _, m, a in self._parameter_refs], [getattr(m, a) for _, m, a in self._buffer_refs]

    @property
    def code(self) -> str:
        """The generated source of the schedule (for the sample's ``requires_grad`` pattern)."""
        return next(iter(self._runners.values())).code.source

    def _current_state_signature(self, parameters: list[torch.Tensor],
                                 buffers: list[torch.Tensor]) -> list[tuple[str, torch.dtype, torch.device]]:
        captured = self.graph.captured
        paths = {**captured.parameters, **captured.buffers}
        refs = self._parameter_refs + self._buffer_refs
        return [(paths.get(name, name), t.dtype, t.device) for (name, _, _), t in zip(refs, parameters + buffers)]

    def _check_state(self, parameters: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
        """A clear error where the model was cast or moved (``.to(torch.float64)``, ``.cuda()``)
        after the plan was made."""
        for (name, dtype, device), tensor in zip(self._state_signature, parameters + buffers):
            now_dtype, now_device = tensor.dtype, tensor.device
            if now_dtype != dtype or now_device != device:
                raise ValueError(
                    f"Rockmate: the model's {name} is {now_dtype} on {now_device} but the plan was made for "
                    f"{dtype} on {device}: the model was cast or moved after Rockmate was built; build "
                    f"Rockmate again after .to(...), with a sample of the new dtype and device")

    def _check_inputs(self, args: tuple, parameters: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
        self._check_state(parameters, buffers)
        if autocast_state() != self._autocast:
            raise ValueError(
                f"Rockmate: called with autocast {_describe_autocast(autocast_state())} but built with autocast "
                f"{_describe_autocast(self._autocast)}: the captured graph holds the casts of the build's "
                f"autocast; build Rockmate inside the same torch.autocast(...) context as the training step")
        if len(args) != len(self._sample_signature):
            raise ValueError(
                f"Rockmate expected {len(self._sample_signature)} positional inputs, received "
                f"{len(args)}; Rockmate must be rebuilt for a new input signature"
            )
        for index, (value, expected) in enumerate(zip(args, self._sample_signature)):
            if isinstance(value, torch.Tensor) and isinstance(expected, tuple):
                received = (tuple(value.shape), value.dtype, value.device)
                if received != expected:
                    raise ValueError(
                        f"Rockmate: input {index} has shape {list(received[0])}, dtype "
                        f"{received[1]}, device {received[2]}, but the module was compiled for "
                        f"shape {list(expected[0])}, dtype {expected[1]}, device {expected[2]}; "
                        "the plan is specific to the sample's shapes, dtypes and devices: build Rockmate "
                        "again with a sample like this input"
                    )
            elif isinstance(value, torch.Tensor) or isinstance(expected, tuple) or value != expected:
                raise ValueError(
                    f"Rockmate: input {index} is {value!r} but the module was compiled for "
                    f"{expected!r}; Rockmate must be rebuilt for new non-tensor inputs"
                )

    def differs_only_in_shapes(self, args: tuple) -> bool:
        """Whether ``args`` are a call like the sample's but for the shapes of some tensors
        (same count, dtypes, devices and non-tensor values): a call that another plan serves."""
        if len(args) != len(self._sample_signature):
            return False
        differs = False
        for value, expected in zip(args, self._sample_signature):
            if isinstance(value, torch.Tensor) != isinstance(expected, tuple):
                return False
            if not isinstance(value, torch.Tensor):
                if value != expected:
                    return False
                continue
            if (value.dtype, value.device) != expected[1:]:
                return False
            differs |= tuple(value.shape) != expected[0]
        return differs

    def sample_tensors_shapes(self) -> list[tuple[int, ...]]:
        """The shapes of the sample's tensors."""
        return [expected[0] for expected in self._sample_signature if isinstance(expected, tuple)]

    def runner_for(self, args: tuple, parameters: list[torch.Tensor] | None = None) -> _Runner:
        """The generated code that a call with ``args`` runs (one per pattern of requires_grad);
        ``parameters``: the model's now (read here where not given)."""
        tensors = [value for value in args if isinstance(value, torch.Tensor)]
        parameters = self._current_tensors()[0] if parameters is None else parameters
        hooked = tuple(p.requires_grad and bool(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None))
                       for p in parameters)
        return self._runner(
            [bool(t.requires_grad) for t in tensors], [bool(p.requires_grad) for p in parameters], hooked, self.markers
        )

    def forward(self, *args):
        if not (self.training and self.model.training and torch.is_grad_enabled()):
            return self.model(*args)
        parameters, buffers = self._current_tensors()
        self._check_inputs(args, parameters, buffers)
        tensors = [value for value in args if isinstance(value, torch.Tensor)]
        runner = self.runner_for(args, parameters)
        self._bind_globals(runner, parameters, buffers)
        handover = _Handover(self.describe_outputs(), self._read_by_backward)
        state = runner.new_state([*parameters, *buffers, *self.graph.captured.constants.values()])
        outputs = list(_ScheduleFunction.apply(runner, handover, state, *tensors, *parameters))
        handover.versions = [output._version for output in outputs]
        # a tensor the model returns several times is one object, behind one gate, as in eager:
        # the engine sums its gradients in that gate's buffer as they come (separate gates would
        # hold them all at once)
        returned: dict[str, torch.Tensor] = {}
        for i, (output, name) in enumerate(zip(outputs, self.graph.outputs)):
            if name in returned:
                outputs[i] = returned[name]
            else:
                returned[name] = outputs[i] = _OutputGate.apply(output, handover, i) if output.requires_grad else output
        handover.dropped = [(i, _StorageWatch(outputs[i])) for i in runner.dropped_outputs]
        if self.graph.captured.output_is_tuple:
            return tuple(outputs)
        return outputs[0]

    def _bind_globals(self, runner: _Runner, parameters: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
        """Bind the current parameter, buffer and tensor-attribute tensors (a module may have
        replaced one)."""
        namespace = runner.code.globals
        for (name, _, _), tensor in zip(self._parameter_refs, parameters):
            namespace[name] = tensor
        for (name, _, _), tensor in zip(self._buffer_refs, buffers):
            namespace[name] = tensor
        for name, value in self.graph.captured.constants.items():
            namespace[name] = value
        for name, module, attribute in self._constant_refs:
            namespace[name] = self._current_constant(name, getattr(module, attribute, None))

    def _current_constant(self, name: str, value) -> torch.Tensor:
        """A plain tensor attribute of the model as it is now (the user may have replaced the
        tensor the capture read: ``model.scale = new``), where it is like the captured one."""
        captured = self.graph.captured.constants[name]
        if value is captured:
            return value
        path = self.graph.captured.constant_paths[name]
        if not isinstance(value, torch.Tensor) or (value.shape, value.dtype, value.device) != \
                (captured.shape, captured.dtype, captured.device):
            described = f"a tensor of shape {list(value.shape)}, {value.dtype}, {value.device}" \
                if isinstance(value, torch.Tensor) else repr(type(value).__name__)
            raise ValueError(
                f"Rockmate: the model's tensor attribute {path!r} is now {described}; the plan was made for a "
                f"tensor of shape {list(captured.shape)}, {captured.dtype}, {captured.device}: build Rockmate again")
        return value
