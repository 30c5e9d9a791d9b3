"""Errors of the public API."""

from __future__ import annotations

from rkgb.errors import CaptureError, RkgbError, UnsupportedOperation

from .budget import format_bytes

__all__ = ["InfeasibleBudget", "CaptureError", "UnsupportedOperation", "RkgbError"]


class InfeasibleBudget(ValueError):
    """The budget is below what the solver can meet; ``minimum`` is the smallest it can.

    ``floor`` (bytes, when known) is the operation floor (:func:`solvers.bounds.operation_floor`):
    no plan that runs the model's operations as eager PyTorch does goes below it, whatever the
    solver; ``floor_operation`` names the operation that needs it, in the user's terms.
    """

    def __init__(self, budget: int, minimum: int | None, solver: str, floor: int | None = None,
                 floor_operation: str = "", asked=None, baseline: int | None = None, hint: str = "") -> None:
        """``asked``: the budget as the user gave it where it was a fraction; ``baseline``: the
        peak without recomputation (bytes), which the message compares the minimum with;
        ``hint``: an option that may lower the minimum, said at the message's end."""
        self.budget = budget
        self.minimum = minimum
        self.solver = solver
        self.floor = floor
        self.floor_operation = floor_operation
        self.baseline = baseline
        given = share = ""
        if baseline:
            if asked is not None:
                given = f" ({asked!r} of the {baseline} bytes that the plan without recomputation peaks at)"
                share = "" if minimum is None else f", {minimum / baseline:.1%} of that peak"
            elif minimum is not None:
                share = (f", {minimum / baseline:.1%} of the {baseline} bytes that the plan without recomputation "
                         "peaks at")
        if minimum is None:
            detail = "no budget is feasible for this solver"
        else:
            detail = f"the minimum budget for solver {solver!r} is {minimum} bytes ({format_bytes(minimum)}){share}"
        if floor is not None:
            detail += (f"; no plan that runs the model's operations as eager PyTorch does goes below {floor} "
                       f"bytes ({format_bytes(floor)}), which {floor_operation or 'one operation'} needs on its own "
                       "(with the gradients alive at that point): below it, recomputation cannot help")
        super().__init__(f"budget of {budget} bytes ({format_bytes(budget)}){given} is infeasible: {detail}{hint}")
