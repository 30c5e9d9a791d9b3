"""Run a simplified graph node by node (the reference semantics of the simplified graph)."""

from __future__ import annotations

import operator
from typing import Iterable

import torch
import torch.fx
from torch import nn

from .capture import FUNCTIONAL_BATCH_NORM, as_input_tuple
from .simplify import SimplifiedGraph, SimplifiedNode

__all__ = ["run_lines", "tensor_args", "initial_environment", "global_requires_grad", "run_simplified_forward",
           "batch_norm_updating", "batch_norm_not_updating", "batch_norms_in_place", "inspected_targets",
           "GRAD_MODE_NUMERICS", "in_grad_mode", "EAGER_KERNELS", "eager_target", "REQUIRES_GRAD_DISPATCH",
           "with_eager_requires_grad"]


def run_lines(lines: Iterable[torch.fx.Node], env: dict[str, object], targets: dict | None = None) -> None:
    """Execute fx nodes in order, reading their arguments from and writing results to ``env``
    (``targets``: the function to call instead of a line's own target, by line name; else
    :func:`eager_target`)."""
    for fx_node in lines:
        args, kwargs = torch.fx.node.map_arg((fx_node.args, fx_node.kwargs), lambda n: env[n.name])
        target = targets.get(fx_node.name) if targets else None
        env[fx_node.name] = (target or eager_target(fx_node.target))(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# Batch norms as eager dispatches them
# --------------------------------------------------------------------------------------------
#
# ``F.batch_norm`` calls ``at::batch_norm``, whose ``_batch_norm_impl_index`` chooses the kernel
# at run time: cuDNN's on CUDA (where its conditions hold: dtypes, eps, batch size), MIOpen's on
# ROCm, the native one elsewhere; autograd then records that kernel's backward (e.g.
# ``CudnnBatchNormBackward0``). The exported graph names the native kernel instead
# (``_native_batch_norm_legit_functional``), whose results on CUDA differ from cuDNN's in the
# last bits. Every batch norm of a graph therefore runs through ``_batch_norm_impl_index``, as
# eager's does (on the CPU that is the native kernel, the same bits as before).


def _dispatched_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    result, mean, rstd, _reserve, _backend = torch.ops.aten._batch_norm_impl_index.default(
        input, weight, bias, running_mean, running_var, training, momentum, eps, torch.backends.cudnn.enabled)
    return result, mean, rstd


def functional_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """``aten._native_batch_norm_legit_functional`` as eager computes it: the running statistics
    of copies updated in place by eager's kernel (the copies are the op's new values)."""
    new_mean, new_var = running_mean.clone(), running_var.clone()
    result, mean, rstd = _dispatched_batch_norm(input, weight, bias, new_mean, new_var, training, momentum, eps)
    return result, mean, rstd, new_mean, new_var


def batch_norm_no_training(input, weight, bias, running_mean, running_var, momentum, eps):
    """``aten._native_batch_norm_legit_no_training`` (a BatchNorm in eval mode inside a trained
    model) through eager's dispatch."""
    return _dispatched_batch_norm(input, weight, bias, running_mean, running_var, False, momentum, eps)


def batch_norm_no_stats(input, weight, bias, training, momentum, eps):
    """``aten._native_batch_norm_legit.no_stats`` (no running statistics) through eager's dispatch."""
    return _dispatched_batch_norm(input, weight, bias, None, None, training, momentum, eps)


# the graph's batch norm ops and the functions that run them as eager does
EAGER_KERNELS = {
    FUNCTIONAL_BATCH_NORM: functional_batch_norm,
    torch.ops.aten._native_batch_norm_legit_no_training.default: batch_norm_no_training,
    torch.ops.aten._native_batch_norm_legit.no_stats: batch_norm_no_stats,
    torch.ops.aten._native_batch_norm_legit.default: _dispatched_batch_norm,
    torch.ops.aten.native_batch_norm.default: _dispatched_batch_norm,
}


def eager_target(target):
    """The function that runs a graph line's ``target`` as eager does (:data:`EAGER_KERNELS`)."""
    return EAGER_KERNELS.get(target, target)


def batch_norm_updating(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """The functional batch norm's five results as eager makes them: the running statistics
    updated in place by eager's kernel (see :data:`EAGER_KERNELS`), the buffers themselves
    returned as their new values. The functional op updates copies of them (two tensors more, which eager
    does not have); the normalized result, the saved statistics and the new running
    statistics are the same, bit for bit."""
    result, mean, rstd = _dispatched_batch_norm(input, weight, bias, running_mean, running_var, training,
                                                momentum, eps)
    return result, mean, rstd, running_mean, running_var


def batch_norm_not_updating(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """The functional batch norm run again (a recomputation, the inspection): the same result
    and saved statistics from the batch (training mode reads no running statistics), the
    buffers left alone and returned unchanged (no running statistics passed to the kernel)."""
    result, mean, rstd = _dispatched_batch_norm(input, weight, bias, None, None, training, momentum, eps)
    return result, mean, rstd, running_mean, running_var


def batch_norms_in_place(graph: SimplifiedGraph, node) -> set[str]:
    """The lines of ``node`` that are training-mode functional batch norms whose new running
    statistics the step writes at once (:meth:`SimplifiedGraph.updates_written_at_once`): the
    executor runs :func:`batch_norm_updating` at the node's first run and
    :func:`batch_norm_not_updating` at the others, the inspection the latter."""
    at_once = graph.updates_written_at_once(node)
    if not at_once:
        return set()
    found = set()
    for line in node.lines:
        if line.target is FUNCTIONAL_BATCH_NORM and line.args[5] is True:
            updates = [user for user in line.users if user.target is operator.getitem and user.args[1] in (3, 4)]
            if updates and all(user.name in at_once for user in updates):
                found.add(line.name)
    return found


_aten = torch.ops.aten
# operations whose kernels compute other values without grad than with it: the CPU LSTM's
# oneDNN inference kernel rounds otherwise than its training kernel (1 ulp on a few elements);
# cuDNN's recurrent kernels have an inference and a training variant too
GRAD_MODE_NUMERICS = frozenset({
    _aten.lstm.input, _aten.lstm.data, _aten.gru.input, _aten.gru.data,
    _aten.rnn_tanh.input, _aten.rnn_tanh.data, _aten.rnn_relu.input, _aten.rnn_relu.data,
})


def in_grad_mode(op):
    """``op``, run with grad where the caller runs without it, its results detached: a forward
    without grad (a plan's, to keep nothing for the backward) of a node that eager runs with
    grad computes eager's values (:data:`GRAD_MODE_NUMERICS`). Its temporary memory is the
    training kernel's, which the inspection measures the same way."""
    def run(*args, **kwargs):
        if torch.is_grad_enabled():
            return op(*args, **kwargs)
        with torch.enable_grad():
            results = op(*args, **kwargs)
        if isinstance(results, torch.Tensor):
            return results.detach()
        return type(results)(value.detach() if isinstance(value, torch.Tensor) else value for value in results)
    return run


# operations whose kernel depends on which of their inputs require grad: on CPU, scaled dot
# product attention takes its fused (flash) kernel unless the attention mask requires grad (a
# relative position bias: Swin), where it takes the math one, whose values differ in the last
# bits; CUDA's backend choice reads its inputs' requires_grad too
REQUIRES_GRAD_DISPATCH = frozenset({_aten.scaled_dot_product_attention.default})


def with_eager_requires_grad(op, requires: tuple[bool, ...]):
    """``op`` with its tensor arguments (in :func:`tensor_args` order) requiring grad as in
    eager (``requires``), run with grad, its result detached: a plan's forward without grad of
    a node that eager runs with grad, whose operation picks its kernel from that
    (:data:`REQUIRES_GRAD_DISPATCH`), computes eager's values. The arguments are detached aliases
    (no copy); the graph recorded is dropped with the result's."""
    def run(*args, **kwargs):
        flags = iter(requires)

        def as_in_eager(value):
            if isinstance(value, torch.Tensor):
                wanted = next(flags)
                return value.detach().requires_grad_(wanted and value.is_floating_point())
            return value

        args = [as_in_eager(value) for value in args]
        kwargs = {key: as_in_eager(value) for key, value in kwargs.items()}
        with torch.enable_grad():
            return op(*args, **kwargs).detach()
    return run


def inspected_targets(graph: SimplifiedGraph, node, requires_grad: bool = False) -> dict:
    """The functions the inspection calls instead of some of ``node``'s lines (see
    :func:`batch_norms_in_place`; and :func:`in_grad_mode` where the node requires grad)."""
    targets = {name: batch_norm_not_updating for name in batch_norms_in_place(graph, node)}
    if requires_grad:
        targets.update({line.name: in_grad_mode(line.target) for line in node.lines if line.target in GRAD_MODE_NUMERICS})
    return targets


def tensor_args(line: torch.fx.Node) -> list[torch.fx.Node]:
    """The fx nodes among a line's arguments, one per occurrence, in argument order (the
    order of :func:`torch.fx.node.map_arg`)."""
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((line.args, line.kwargs), lambda n: found.append(n) or n)
    return found


def initial_environment(graph: SimplifiedGraph, model: nn.Module, sample) -> dict[str, object]:
    """Values of the globals: parameters, buffers, constants, inputs and their views."""
    captured = graph.captured
    env: dict[str, object] = dict(captured.placeholder_values(model))
    for name, value in zip(captured.inputs, as_input_tuple(sample)):
        if name is not None:
            env[name] = value
    run_lines(graph.global_views, env)
    # the new values of the buffers that the step writes first (the model's buffers left alone)
    run_lines(graph.buffer_updates_first, env)
    return env


def global_requires_grad(graph: SimplifiedGraph, model: nn.Module, sample) -> dict[str, bool]:
    """Which globals require grad: parameters (by placeholder name), the sample's inputs, and
    the views of these (when their base does)."""
    captured = graph.captured
    flags = {name: model.get_parameter(path).requires_grad for name, path in captured.parameters.items()}
    for name, value in zip(captured.inputs, as_input_tuple(sample)):
        if name is not None:
            flags[name] = isinstance(value, torch.Tensor) and value.requires_grad
    for line in graph.global_views:
        flags[line.name] = any(flags.get(arg.name, False) for arg in line.all_input_nodes)
    return flags


def run_node(node: SimplifiedNode, env: dict[str, object]) -> None:
    run_lines(node.lines, env)


def run_simplified_forward(graph: SimplifiedGraph, model: nn.Module, sample):
    """Compute the model's outputs by running each simplified node in order.

    Returns ``(outputs, buffer_updates)`` with ``outputs`` a tuple in the model's output order
    and ``buffer_updates`` a dict buffer path -> new value. Does not modify the model.
    """
    env = initial_environment(graph, model, sample)
    run_lines(graph.buffer_updates_prologue, env)
    for node in graph.nodes:
        run_node(node, env)
        # a batch norm's new running statistics that a later call of it reads from the buffer
        # (rkgb.capture._chain_batch_norm_statistics): eager's call wrote them there
        for line in node.lines:
            if line.target is operator.getitem and line.args[0].target is FUNCTIONAL_BATCH_NORM \
                    and line.args[1] in (3, 4) and line.args[0].args[5] is True:
                buffer = line.args[0].args[line.args[1]]
                if isinstance(buffer, torch.fx.Node) and buffer.op == "placeholder":
                    env[buffer.name] = env[line.name]
    outputs = tuple(env[name] for name in graph.outputs)
    updates = {path: env[name] for name, path in graph.captured.buffer_mutations.items()}
    return outputs, updates
