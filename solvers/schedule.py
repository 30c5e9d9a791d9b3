"""Schedules and plans: what the solvers return and what the simulator and executor replay.

Following Checkmate (Jain et al., MLSys 2020), a schedule is a flat list of small records:
compute a node of the CD-graph, or forget a data node. The ``loss`` compute separates the
forward phase (before it, inclusive) from the backward phase. Names refer to the CD-graph the
schedule is for (a block's class graph, or the whole model's graph). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

__all__ = ["Compute", "Forget", "Operation", "Schedule", "Plan"]


@dataclass(frozen=True)
class Compute:
    """Run compute node ``node``; for a forward, ``with_grad`` says whether phantoms are made."""

    node: str
    with_grad: bool = True


@dataclass(frozen=True)
class Forget:
    """Free data node ``node``."""

    node: str


Operation = Union[Compute, Forget]


@dataclass
class Schedule:
    """A flat list of operations; ``loss_index`` is the position of ``Compute("loss")``."""

    ops: list[Operation] = field(default_factory=list)

    @property
    def loss_index(self) -> int:
        for i, op in enumerate(self.ops):
            if isinstance(op, Compute) and op.node == "loss":
                return i
        raise ValueError("the schedule has no loss operation")

    @property
    def forward_ops(self) -> list[Operation]:
        return self.ops[: self.loss_index]

    @property
    def backward_ops(self) -> list[Operation]:
        return self.ops[self.loss_index + 1 :]


@dataclass
class Plan:
    """The result of a solver on a whole model.

    ``predicted_peak`` and ``predicted_time`` are what the simulator measures on ``schedule``
    (with ``first_run_bytes``, what compute nodes allocate at their first run and the executor
    keeps, and plus ``held_bytes``, what it holds through the whole step besides the CD-graph's
    data: ``ModelChain``); ``baseline_time`` is the time without any recomputation. When ``feasible`` is False the schedule is empty and ``min_budget`` says the
    smallest budget this solver can meet.
    """

    feasible: bool
    budget: int
    solver: str
    schedule: Schedule
    predicted_peak: int = 0
    predicted_time: float = 0.0
    baseline_time: float = 0.0
    min_budget: int | None = None
    time_limit_hit: bool = False
    solve_time_s: float = 0.0
    held_bytes: int = 0
    first_run_bytes: dict = field(default_factory=dict)  # ModelChain.first_run_bytes
    notes: list[str] = field(default_factory=list)
    # where planning time went, in seconds: the solver's phases ("options of class 2", "dp");
    # ``Rockmate`` adds the graph builder's ("capture", "inspect", ...)
    timings: dict[str, float] = field(default_factory=dict)
