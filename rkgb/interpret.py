"""Run a simplified graph node by node (the reference semantics of the simplified graph)."""

from __future__ import annotations

from typing import Iterable

import torch
import torch.fx
from torch import nn

from .capture import as_input_tuple
from .simplify import SimplifiedGraph, SimplifiedNode

__all__ = ["run_lines", "tensor_args", "initial_environment", "global_requires_grad", "run_simplified_forward"]


def run_lines(lines: Iterable[torch.fx.Node], env: dict[str, object]) -> None:
    """Execute fx nodes in order, reading their arguments from and writing results to ``env``."""
    for fx_node in lines:
        args, kwargs = torch.fx.node.map_arg((fx_node.args, fx_node.kwargs), lambda n: env[n.name])
        env[fx_node.name] = fx_node.target(*args, **kwargs)


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
    outputs = tuple(env[name] for name in graph.outputs)
    updates = {path: env[name] for name, path in graph.captured.buffer_mutations.items()}
    return outputs, updates
