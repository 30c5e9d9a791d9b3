"""Errors of the public API."""

from __future__ import annotations

from rkgb.errors import CaptureError, RkgbError, UnsupportedOperation

from .budget import format_bytes

__all__ = ["InfeasibleBudget", "CaptureError", "UnsupportedOperation", "RkgbError"]


class InfeasibleBudget(ValueError):
    """The budget is below what the solver can meet; ``minimum`` is the smallest it can."""

    def __init__(self, budget: int, minimum: int | None, solver: str) -> None:
        self.budget = budget
        self.minimum = minimum
        self.solver = solver
        if minimum is None:
            detail = "no budget is feasible for this solver"
        else:
            detail = f"the minimum budget for solver {solver!r} is {minimum} bytes ({format_bytes(minimum)})"
        super().__init__(f"budget of {budget} bytes ({format_bytes(budget)}) is infeasible: {detail}")
