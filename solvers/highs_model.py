"""rk-Checkmate's model solved by HiGHS in this process: built once, re-solved per budget pair.

HiGHS (Huangfu and Hall, "Parallelizing the dual revised simplex method", Mathematical
Programming Computation 2018; its MIP solver: Galabova et al.) solves the model through
``highspy`` without a solver process, an MPS file or a solution file: the model's arrays are
made once from the pulp problem, and each solve passes them to a fresh ``Highs`` instance (no
state carried from one pair to the next, so the options do not depend on the order of the
solves), sets the two budget columns' bounds, the objective and the MIP start, and reads the
solution back into the pulp variables, as pulp's own solvers do. ``Highs.run`` lets go of the
GIL: the option grid's two solves run on the two cores while the main thread repairs starts.

Measured on the dumped models of three attention classes' option grids (one core each, the
models read from MPS files, the MIP starts the repairs give; 2026-11-27, twenty-seventh
session), CBC (pulp's, the tuned options of the grid) against HiGHS 1.16 with the settings
below: Llama-12's class 5.17 s against 4.55 s for its 26 solves with a start (0.56 s against
0.22 s for its two bound solves), GPT-2 small's 2.35 s against 1.52 s, the bench GPT's 2.59 s
against 2.26 s; the same optima within the 1% gap. HiGHS's defaults were slower (12.9 s on the
Llama class: its sub-MIP heuristics, RINS and RENS, and its restarts spent up to 2.2 s on pairs
whose start was already optimal).
"""

from __future__ import annotations

import functools
import math
import os
import threading
from dataclasses import dataclass

import pulp

__all__ = ["HighsModel", "highs_usable", "pulp_statuses", "HIGHS_SETTINGS"]

# HiGHS's settings for rk-Checkmate's models (module docstring): the sub-MIP heuristics (RINS,
# RENS), the reduced-cost heuristic, the restarts and symmetry detection cost more than they find
# on these models, where a start (a repaired neighbour) is given; the feasibility jump stays on
# for the solves without one (the bound solves)
HIGHS_SETTINGS = {
    "mip_heuristic_run_rins": False,
    "mip_heuristic_run_rens": False,
    "mip_heuristic_run_root_reduced_cost": False,
    "mip_allow_restart": False,
    "mip_detect_symmetry": False,
}

_BANNER_LOCK = threading.Lock()
_BANNER_SHOWN = False


@functools.lru_cache(maxsize=1)
def highs_usable() -> bool:
    """Whether ``highspy`` can be imported and its options are those :data:`HIGHS_SETTINGS`
    names (HiGHS >= 1.11); asked once per process."""
    try:
        import highspy
    except ImportError:
        return False
    highs = _new_highs(highspy)
    return all(highs.setOptionValue(name, value) == highspy.HighsStatus.kOk
               for name, value in HIGHS_SETTINGS.items())


def _new_highs(highspy):
    """A ``Highs`` instance, quiet: the first one of the process prints HiGHS's banner on the
    process's standard output (C++), which is sent to /dev/null while it is made."""
    global _BANNER_SHOWN
    if _BANNER_SHOWN:
        highs = highspy.Highs()
    else:
        with _BANNER_LOCK:
            saved = os.dup(1)
            try:
                with open(os.devnull, "w") as null:
                    os.dup2(null.fileno(), 1)
                    highs = highspy.Highs()
            finally:
                os.dup2(saved, 1)
                os.close(saved)
            _BANNER_SHOWN = True
    highs.setOptionValue("output_flag", False)
    return highs


@dataclass
class _Arrays:
    """The model's arrays in HiGHS's form: columns in the order of ``variables``, rows by row."""

    lp: object  # highspy.HighsLp
    variables: list[pulp.LpVariable]
    column: dict[str, int]  # variable name -> column
    integers: list[int]  # the integer columns (what a MIP start gives)


class HighsModel:
    """The pulp problem ``prob`` in HiGHS's arrays, with the ``budgets`` variables' bounds set at
    each solve (the rest of the model fixed, as :class:`solvers.cbc_template.MPSTemplate`
    assumes: a caller that changes anything else calls :meth:`invalidate`)."""

    def __init__(self, prob: pulp.LpProblem, budgets: list[pulp.LpVariable]) -> None:
        self.prob = prob
        self.budgets = budgets
        self._arrays: _Arrays | None = None
        self._shape = (0, 0)
        # the relative gap between the last solve's best solution and its bound (None: no
        # solution, or no solve yet)
        self.final_gap: float | None = None

    def invalidate(self) -> None:
        self._arrays = None

    def arrays(self) -> _Arrays:
        """The arrays of the problem as it stands (made again where its shape changed). One thread
        solves a model at a time (the option grid gives each worker a model of its own)."""
        shape = (self.prob.numVariables(), self.prob.numConstraints())
        if shape != self._shape or self._arrays is None:
            self._arrays = self._build()
            self._shape = shape
        return self._arrays

    def _build(self) -> _Arrays:
        import highspy

        variables = list(self.prob.variables())
        column = {v.name: i for i, v in enumerate(variables)}
        lp = highspy.HighsLp()
        lp.num_col_ = len(variables)
        lp.col_lower_ = [-math.inf if v.lowBound is None else float(v.lowBound) for v in variables]
        lp.col_upper_ = [math.inf if v.upBound is None else float(v.upBound) for v in variables]
        lp.col_cost_ = [0.0] * len(variables)
        lp.integrality_ = [highspy.HighsVarType.kInteger if v.cat == pulp.LpInteger else highspy.HighsVarType.kContinuous
                           for v in variables]
        lower, upper, starts, indices, values = [], [], [0], [], []
        # (PuLP 3.3 lists them when called, and deprecates its mapping; older ones have the mapping only)
        constraints = self.prob.constraints() if callable(self.prob.constraints) else self.prob.constraints.values()
        for constraint in constraints:
            bound = -float(constraint.constant)
            if constraint.sense == pulp.LpConstraintLE:
                lower.append(-math.inf)
                upper.append(bound)
            elif constraint.sense == pulp.LpConstraintGE:
                lower.append(bound)
                upper.append(math.inf)
            else:
                lower.append(bound)
                upper.append(bound)
            for variable, coefficient in constraint.items():
                indices.append(column[variable.name])
                values.append(float(coefficient))
            starts.append(len(indices))
        lp.num_row_ = len(lower)
        lp.row_lower_ = lower
        lp.row_upper_ = upper
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.num_col_ = len(variables)
        lp.a_matrix_.num_row_ = len(lower)
        lp.a_matrix_.start_ = starts
        lp.a_matrix_.index_ = indices
        lp.a_matrix_.value_ = values
        integers = [i for i, v in enumerate(variables) if v.cat == pulp.LpInteger]
        return _Arrays(lp, variables, column, integers)

    def solve(self, time_limit_s: float | None, gap: float, start: bool, flips: int | None = None) -> None:
        """Solve the problem as it stands (its objective, the budgets' bounds and, with ``start``,
        the integer variables' values as a MIP start), as ``prob.solve`` would: the variables'
        values, ``prob.status`` and ``prob.sol_status`` are set. With ``flips`` (and ``start``),
        only the solutions that change at most that many of the start's binary values are
        searched.

        Raises:
            RuntimeError: HiGHS refused the model or failed while solving it (the caller falls
                back to another solver).
        """
        import highspy

        self.final_gap = None
        arrays = self.arrays()
        highs = _new_highs(highspy)
        settings = {"threads": 1, "mip_rel_gap": float(gap), **HIGHS_SETTINGS}
        if time_limit_s is not None:
            settings["time_limit"] = float(time_limit_s)
        if start:
            settings["mip_heuristic_run_feasibility_jump"] = False
        for name, value in settings.items():
            if highs.setOptionValue(name, value) != highspy.HighsStatus.kOk:
                raise RuntimeError(f"HiGHS {highs.version()} refused its option {name}={value!r}")
        if highs.passModel(arrays.lp) == highspy.HighsStatus.kError:
            raise RuntimeError("HiGHS refused the model")
        for v in self.budgets:
            highs.changeColBounds(arrays.column[v.name], -math.inf if v.lowBound is None else float(v.lowBound),
                                  math.inf if v.upBound is None else float(v.upBound))
        objective = self.prob.objective
        if objective is not None:
            costs = {arrays.column[v.name]: float(c) for v, c in objective.items()}
            highs.changeColsCost(len(costs), list(costs), list(costs.values()))
        if start:
            given = [(i, arrays.variables[i].varValue) for i in arrays.integers
                     if arrays.variables[i].varValue is not None]
            if flips is not None and given:
                # local branching (Fischetti and Lodi, "Local branching", Math. Programming 2003):
                # at most ``flips`` of the start's binary values change. (Added before the start
                # is given: a new row drops the solution HiGHS holds.)
                binary = [(i, x) for i, x in given
                          if arrays.variables[i].lowBound == 0 and arrays.variables[i].upBound == 1]
                ones = sum(1 for _, x in binary if x > 0.5)
                highs.addRow(-math.inf, float(flips - ones), len(binary), [i for i, _ in binary],
                             [-1.0 if x > 0.5 else 1.0 for _, x in binary])
            if given:
                highs.setSolution(len(given), [i for i, _ in given], [float(x) for _, x in given])
        if highs.run() == highspy.HighsStatus.kError:
            raise RuntimeError(f"HiGHS failed: {highs.modelStatusToString(highs.getModelStatus())}")
        status = highs.getModelStatus()
        statuses = pulp_statuses(status, highs.getInfo().primal_solution_status == 2)  # kSolutionStatusFeasible
        if statuses is None:
            raise RuntimeError(f"HiGHS ended with {highs.modelStatusToString(status)}")
        if statuses[1] in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            for v, value in zip(arrays.variables, highs.getSolution().col_value):
                v.varValue = value
            self.final_gap = 0.0 if status == highspy.HighsModelStatus.kOptimal else float(highs.getInfo().mip_gap)
        else:
            for v in arrays.variables:
                v.varValue = None
        self.prob.assignStatus(*statuses)


def pulp_statuses(status, found: bool) -> tuple[int, int] | None:
    """pulp's ``(status, sol_status)`` for HiGHS's model status ``status`` (``found``: HiGHS holds
    a feasible solution), as pulp reads CBC's: a solve stopped by a limit with a solution is
    ``IntegerFeasible`` (the time limit hit, its best schedule kept), without one ``NotSolved``;
    None for a failure (the caller falls back to another solver)."""
    import highspy

    model = highspy.HighsModelStatus
    if status == model.kOptimal:
        return pulp.LpStatusOptimal, pulp.LpSolutionOptimal
    if status in (model.kInfeasible, model.kUnboundedOrInfeasible):
        return pulp.LpStatusInfeasible, pulp.LpSolutionInfeasible
    if status in (model.kTimeLimit, model.kInterrupt, model.kSolutionLimit, model.kIterationLimit):
        return (pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible) if found else \
            (pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound)
    return None
