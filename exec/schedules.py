"""Simple schedules over a simplified graph: no recomputation, recompute all, random valid ones.

These are not solvers: they need no costs and make no choices worth optimizing. They exist to
run and test the executor (and as the ``"none"`` plan) independently of :mod:`solvers`.

The rule they follow for what a backward needs is the conservative one: ``bwd_x`` needs
``x.data``, ``x.phantoms``, ``x.grad`` and the data of every node ``x`` reads. ``fwd_x`` needs
the data of every node ``x`` reads. :func:`with_forgets` then frees every data node right after
its last use before it is recomputed (or for good).
"""

from __future__ import annotations

import math
import random as _random

from rkgb.simplify import SimplifiedGraph
from solvers.schedule import Compute, Forget, Operation, Schedule

__all__ = [
    "no_recomputation_schedule",
    "recompute_all_schedule",
    "random_schedule",
    "with_forgets",
]


def _uses_and_makes(graph: SimplifiedGraph, op: Compute) -> tuple[list[str], list[str], list[str]]:
    """(data nodes used, data nodes made anew, data nodes it accumulates into) of a compute."""
    if op.node == "loss":
        owners = graph.output_owners
        return [f"{o}.data" for o in owners], [], [f"{o}.grad" for o in owners]
    kind, _, name = op.node.partition("_")
    node = graph.node(name)
    deps = [f"{d}.data" for d in node.data_deps]
    if kind == "fwd":
        made = [f"{name}.data"] + ([f"{name}.phantoms"] if op.with_grad else [])
        return deps, made, []
    uses = [f"{name}.data", f"{name}.phantoms", f"{name}.grad"] + deps
    return uses, [], [f"{d}.grad" for d in node.data_deps]


def with_forgets(graph: SimplifiedGraph, ops: list[Operation]) -> Schedule:
    """Insert a ``Forget`` after the last use of each data node before it is made again.

    The data of the model's outputs is never forgotten; a node's phantoms are forgotten right
    after its backward (which consumes its autograd graph).
    """
    computes = [op for op in ops if isinstance(op, Compute)]
    keep = {f"{o}.data" for o in graph.output_owners}
    # events[d]: list of (index, kind) with kind "make", "use"
    last_touch: dict[int, list[str]] = {}
    alive_since: dict[str, int] = {}
    touched: dict[str, int] = {}

    def close(d: str) -> None:
        if d in touched and d not in keep:
            last_touch.setdefault(touched[d], []).append(d)
        touched.pop(d, None)

    for index, op in enumerate(computes):
        uses, made, accumulated = _uses_and_makes(graph, op)
        for d in uses:
            touched[d] = index
        for d in made:
            close(d)  # the previous copy dies before (or while) the new one is made
            touched[d] = index
            alive_since[d] = index
        for d in accumulated:
            touched[d] = index
    for d in list(touched):
        close(d)
    result: list[Operation] = []
    for index, op in enumerate(computes):
        result.append(op)
        for d in last_touch.get(index, []):
            result.append(Forget(d))
    return Schedule(result)


def _order(graph: SimplifiedGraph) -> list[str]:
    return [node.name for node in graph.nodes]


def no_recomputation_schedule(graph: SimplifiedGraph) -> Schedule:
    """Every forward once with grad, the loss, every backward in reverse order."""
    order = _order(graph)
    ops: list[Operation] = [Compute(f"fwd_{n}", True) for n in order]
    ops.append(Compute("loss"))
    ops += [Compute(f"bwd_{n}") for n in reversed(order)]
    return with_forgets(graph, ops)


class _Builder:
    """Builds a schedule while tracking which data is alive; recomputes what is missing."""

    def __init__(self, graph: SimplifiedGraph) -> None:
        self.graph = graph
        self.ops: list[Operation] = []
        self.alive: set[str] = set()

    def compute(self, name: str, with_grad: bool) -> None:
        for dep in self.graph.node(name).data_deps:
            self.ensure(dep)
        self.ops.append(Compute(f"fwd_{name}", with_grad))
        self.alive.add(name)

    def ensure(self, name: str) -> None:
        if name not in self.alive:
            self.compute(name, False)


def recompute_all_schedule(
    graph: SimplifiedGraph, checkpoints: set[str] | None = None, stress: bool = False
) -> Schedule:
    """Forward without grad keeping only ``checkpoints``; recompute the rest in the backward.

    ``checkpoints`` defaults to the output nodes and every ``ceil(sqrt(n))``-th node. With
    ``stress``, each node's inputs are forgotten and recomputed *after* its autograd graph is
    built and before its backward, so that the backward reads recomputed data.
    """
    order = _order(graph)
    if checkpoints is None:
        step = max(1, math.ceil(math.sqrt(len(order))))
        checkpoints = {order[i] for i in range(step - 1, len(order), step)}
    checkpoints = set(checkpoints) | set(graph.output_owners)
    builder = _Builder(graph)
    for name in order:
        builder.compute(name, False)
    builder.ops.append(Compute("loss"))
    builder.alive = set(checkpoints)
    for name in reversed(order):
        builder.compute(name, True)
        if stress:
            deps = [d for d in graph.node(name).data_deps if d not in checkpoints]
            builder.alive -= set(deps)
            for dep in deps:
                builder.ensure(dep)
        builder.ops.append(Compute(f"bwd_{name}"))
        if name not in checkpoints:
            builder.alive.discard(name)
    return with_forgets(graph, builder.ops)


def random_schedule(graph: SimplifiedGraph, seed: int, forget_probability: float = 0.3) -> Schedule:
    """A random valid schedule: random grad modes, random forgets and recomputations.

    The first computation of every node happens in graph order in the forward phase (so that
    random operations draw the same numbers as eager PyTorch).
    """
    rng = _random.Random(seed)
    order = _order(graph)
    keep = set(graph.output_owners)
    builder = _Builder(graph)
    has_graph: set[str] = set()
    for name in order:
        with_grad = rng.random() < 0.5
        builder.compute(name, with_grad)
        if with_grad:
            has_graph.add(name)
        if rng.random() < forget_probability:  # recompute an earlier node now
            victim = rng.choice(order[: order.index(name) + 1])
            builder.alive.discard(victim)
            builder.ensure(victim)
        for other in list(builder.alive):
            if other not in keep and rng.random() < forget_probability:
                builder.alive.discard(other)
    for output in graph.output_owners:
        builder.ensure(output)
    builder.ops.append(Compute("loss"))
    for name in reversed(order):
        if name not in has_graph or rng.random() < forget_probability:
            builder.compute(name, True)
        else:
            for dep in graph.node(name).data_deps:
                builder.ensure(dep)
        deps = list(graph.node(name).data_deps) + [name]
        for dep in deps:
            if dep not in keep and rng.random() < forget_probability:
                builder.alive.discard(dep)  # forgotten after the graph is built, recomputed below
        for dep in deps:
            builder.ensure(dep)
        builder.ops.append(Compute(f"bwd_{name}"))
        has_graph.discard(name)
        for other in list(builder.alive):
            if other not in keep and rng.random() < forget_probability:
                builder.alive.discard(other)
    return with_forgets(graph, builder.ops)
