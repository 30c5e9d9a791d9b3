"""The public face: ``Rockmate(model, sample, budget)`` and ``min_budget(model, sample)``.

The pipeline (Zhao et al., "Rockmate: an Efficient, Fast, Automatic and Generic Tool for
Re-materialization in PyTorch", ICML 2023): the graph builder (:mod:`rkgb`) captures the
model, cuts it into a chain of blocks and measures each class of identical blocks; a solver
(:mod:`solvers`) plans what to keep and what to recompute under the budget; the executor
(:mod:`exec`) runs that plan as generated Python code inside an ``nn.Module``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from torch import nn

from exec import CompiledModule
from rkgb.build import ModelGraphs, build
from rkgb.cdgraph import ComputeKind
from rkgb.errors import describe_fx_node
from solvers import registry
from solvers.bounds import operation_floor
from solvers.schedule import Plan
from solvers.simulate import simulate

from .budget import format_bytes, parse_budget
from .errors import InfeasibleBudget

__all__ = ["Rockmate", "min_budget", "BuildOptions"]


@dataclass(frozen=True)
class BuildOptions:
    """How the graph builder measures the model.

    ``cost_model``: ``"measured"`` (fastest of ``repeats`` timings on the model's device, after
    one untimed run) or ``"flops"`` (a deterministic model from FLOPs, bytes and random numbers
    drawn, for reproducible plans).
    """

    cost_model: str = "measured"
    repeats: int = 3


def _split_options(options: dict) -> tuple[BuildOptions, dict]:
    build_keys = {"cost_model", "repeats"}
    build_options = BuildOptions(**{k: v for k, v in options.items() if k in build_keys})
    return build_options, {k: v for k, v in options.items() if k not in build_keys}


@contextlib.contextmanager
def _train_mode(model: nn.Module):
    """Capture in train mode (the graph Rockmate runs is the training one)."""
    modes = {module: module.training for module in model.modules()}
    model.train()
    try:
        yield
    finally:
        for module, mode in modes.items():
            module.training = mode


def _build_graphs(model: nn.Module, sample, build_options: BuildOptions) -> ModelGraphs:
    with _train_mode(model):
        return build(model, sample, cost_model=build_options.cost_model, repeats=build_options.repeats)


class Rockmate(nn.Module):
    """``model`` compiled to train within ``budget`` bytes of activation memory.

    The returned module computes the same outputs, parameter gradients and buffer updates as
    ``model`` (bitwise where eager PyTorch is deterministic, dropout included), while the
    memory allocated during one forward + backward stays under ``budget``. In ``eval()`` mode
    or under ``torch.no_grad()`` it runs ``model`` as is.

    Args:
        model: the ``nn.Module`` to train; its parameters receive the gradients.
        sample: a tensor or a tuple of positional inputs with the shapes and dtypes of the
            training inputs (the plan is specific to them).
        budget: bytes (int) or a string such as ``"300MiB"`` or ``"1.5GB"``.
        solver: ``"rockmate"`` (default), ``"rotor"``, ``"checkmate"`` (whole graph, small
            models), ``"none"`` (no recomputation), or a solver object.
        **options: ``cost_model`` and ``repeats`` for the graph builder; the rest go to the
            solver (e.g. ``slots``, ``time_limit_s``).

    Attributes:
        plan: the :class:`solvers.schedule.Plan` (``budget``, ``predicted_peak``,
            ``predicted_time``, ``baseline_time``, ``solver``, ``schedule``).
        code: the generated Python source of the forward and backward phases.

    Raises:
        InfeasibleBudget: the budget is below the solver's minimum (given in the message).
        ValueError: the budget cannot be read.
        rkgb.errors.CaptureError, rkgb.errors.UnsupportedOperation: the model cannot be
            captured; the message names the module path and the operation.

    Example::

        rk = Rockmate(model, sample, "300MiB")
        loss = loss_fn(rk(*sample), target)
        loss.backward()
    """

    def __init__(self, model: nn.Module, sample, budget, solver="rockmate", **options) -> None:
        super().__init__()
        budget_bytes = parse_budget(budget)
        build_options, solver_options = _split_options(options)
        self.graphs = _build_graphs(model, sample, build_options)
        plan: Plan = registry.solve(self.graphs.model_chain, budget_bytes, solver, **solver_options)
        if not plan.feasible:
            floor, operation = _operation_floor(self.graphs)
            raise InfeasibleBudget(budget_bytes, plan.min_budget, plan.solver, floor, operation)
        self.plan = plan
        whole = self.graphs.model_chain.whole_graph()
        self.compiled = CompiledModule(
            model, self.graphs.simplified, plan.schedule, sample,
            cdgraph=whole, peak_limit=simulate(whole, plan.schedule).peak_bytes,
        )

    @property
    def model(self) -> nn.Module:
        return self.compiled.model

    @property
    def code(self) -> str:
        """The generated source of the forward and backward phases (like ``GraphModule.code``)."""
        return self.compiled.code

    def forward(self, *args):
        return self.compiled(*args)

    def render(self, directory) -> list[str]:
        """Draw the forward graph, the blocks, the CD-graphs and the schedule with graphviz.

        Returns the paths of the files written. Needs the ``dot`` program (Debian/Ubuntu:
        ``apt-get install graphviz``; macOS: ``brew install graphviz``).
        """
        from .render import render_all

        return render_all(self.graphs, self.plan, directory)

    def extra_repr(self) -> str:
        plan = self.plan
        return (
            f"budget={format_bytes(plan.budget)}, predicted_peak={format_bytes(plan.predicted_peak)}, "
            f"solver={plan.solver!r}, blocks={len(self.graphs.chain.blocks)}, "
            f"classes={len(self.graphs.chain.classes)}"
        )


def _operation_floor(graphs: ModelGraphs) -> tuple[int, str]:
    """The operation floor of the model (bytes) and the operation that sets it, described with
    its module path and source line."""
    whole = graphs.model_chain.whole_graph()
    floor = operation_floor(whole)
    held = graphs.model_chain.held_bytes  # (first-run memory depends on the plan: not in a floor)
    if not floor.node:
        return held + floor.bytes, "the memory held through the step (copies of buffers)"
    node = whole.compute(floor.node)
    if node.kind is ComputeKind.LOSS:
        return held + floor.bytes, "the loss (with the model's outputs and their gradients)"
    names = {n.name for n in graphs.simplified.nodes}
    what = describe_fx_node(graphs.simplified.node(node.target).main) if node.target in names else node.target
    return held + floor.bytes, ("the backward of " if node.kind is ComputeKind.BACKWARD else "") + what


def min_budget(model: nn.Module, sample, solver="rockmate", **options) -> int:
    """The smallest budget (bytes) that ``solver`` can meet for ``model`` on ``sample``."""
    build_options, solver_options = _split_options(options)
    graphs = _build_graphs(model, sample, build_options)
    return registry.min_budget(graphs.model_chain, solver, **solver_options)
