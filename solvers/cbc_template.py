"""CBC through pulp, with a model's MPS text written once and only its budgets written per solve.

An option grid (:mod:`solvers.block_options`) solves one rk-Checkmate model for 40-60 pairs of
(peak, save) budgets: only the upper bounds of the two budget variables change from one solve
to the next. pulp writes the whole MPS file for every solve (~45 ms on the 59-compute Llama
attention class: 5228 columns, 8434 rows) and reads back every row and column of CBC's solution
(~15 ms): Python time under the GIL, which the grid's second solver thread and its repairs wait
for, ~55 ms per solve against CBC's own 0.1-0.5 s. :class:`MPSTemplate` keeps the text written
once per objective (the budget variables unbounded above) and inserts the budgets' bound lines;
:class:`TemplateCBC` runs CBC on it as ``pulp.PULP_CBC_CMD`` does, asking CBC for the nonzero
columns only. CBC reads the same model either way (bound lines may come in any order in an MPS
file), so the solutions are pulp's. A MIP start lists the integer columns only (CBC fixes them
and solves the LP for the others, which is what it does with a full start too): pulp's
``writesol`` and ``assignVarsVals`` cost ~10 ms per solve on that class, under the GIL.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass

import pulp
from pulp import constants
from pulp.mps_lp import writeMPSBoundLines

__all__ = ["Columns", "MPSTemplate", "TemplateCBC"]


@dataclass
class Columns:
    """The columns of a written text: its variables in writing order, the variable of each
    column name, and the integer columns as (position, name, variable), what a MIP start lists."""

    variables: list[pulp.LpVariable]
    by_name: dict[str, pulp.LpVariable]
    integers: list[tuple[int, str, pulp.LpVariable]]


class MPSTemplate:
    """The MPS text of ``prob`` by objective, with the ``budgets`` variables' bounds left out.

    The text stays valid while the problem's structure does: the same variables (bounds and
    categories), constraints and objective. A caller that changes anything but the budgets'
    bounds calls :meth:`invalidate` (``RkCheckmateILP.fix_liveness``, ``relaxed_liveness``); the
    counts of variables and constraints are checked at each use as well.
    """

    def __init__(self, prob: pulp.LpProblem, budgets: list[pulp.LpVariable]) -> None:
        self.prob = prob
        self.budgets = budgets
        # objective key -> (text before the bound lines, text after, variable names, its columns)
        self._texts: dict[str, tuple[str, str, dict[str, str], Columns]] = {}
        self._shape = (0, 0)

    def invalidate(self) -> None:
        self._texts.clear()

    def text(self, key: str) -> tuple[str, Columns]:
        """The MPS text of the problem as it stands (its objective named by ``key``) and its
        columns."""
        shape = (self.prob.numVariables(), self.prob.numConstraints())
        if shape != self._shape:
            self.invalidate()
            self._shape = shape
        if key not in self._texts:
            self._texts[key] = self._write()
        head, tail, names, columns = self._texts[key]
        bounds = "".join(line for v in self.budgets for line in writeMPSBoundLines(names[v.name], v, True))
        return head + bounds + tail, columns

    def _write(self) -> tuple[str, str, dict[str, str], Columns]:
        kept = [(v, v.lowBound, v.upBound) for v in self.budgets]
        for v in self.budgets:
            # no bound line (MPS's default for a continuous column); text() inserts their lines
            v.lowBound, v.upBound = 0, None
        handle, path = tempfile.mkstemp(suffix=".mps")
        os.close(handle)
        try:
            variables, names, _, _ = self.prob.writeMPS(path, rename=1)
            with open(path) as f:
                text = f.read()
        finally:
            os.remove(path)
            for v, low, up in kept:
                v.lowBound, v.upBound = low, up
        cut = text.index("\nBOUNDS\n") + len("\nBOUNDS\n")
        columns = Columns(
            variables=list(variables),
            by_name={names[v.name]: v for v in variables},
            integers=[(i, names[v.name], v) for i, v in enumerate(variables) if v.cat == constants.LpInteger])
        return text[:cut], text[cut:], dict(names), columns



class TemplateCBC(pulp.PULP_CBC_CMD):
    """``pulp.PULP_CBC_CMD`` writing the problem from ``template`` (objective ``key``)."""

    def __init__(self, template: MPSTemplate, key: str, **options) -> None:
        super().__init__(**options)
        self.template, self.key = template, key

    def solve_CBC(self, lp: pulp.LpProblem, use_mps: bool = True):
        if lp is not self.template.prob or lp.sense != constants.LpMinimize \
                or self.optionsDict.get("presolve") is not None or self.optionsDict.get("cuts") is not None:
            return super().solve_CBC(lp, use_mps)
        if not self.executable(self.path):
            raise pulp.PulpSolverError(f"Pulp: cannot execute {self.path} cwd: {os.getcwd()}")
        text, columns = self.template.text(self.key)
        mps, solution, start = self.create_tmp_files(lp.name, "mps", "sol", "mst")
        try:
            with open(mps, "w") as f:
                f.write(text)
            args = [self.path, mps]
            if self.optionsDict.get("warmStart", False):
                with open(start, "w") as f:  # pulp's writesol's format, the integer columns only
                    f.write("Stopped on time - objective value 0\n")
                    f.writelines(f"{i:>7} {name} {v.varValue or 0:>15} {0:>23}\n" for i, name, v in columns.integers)
                args += ["-mips", start]
            if self.timeLimit is not None:
                args += ["-sec", str(self.timeLimit)]
            for option in self.options + self.getOptions():
                args += ("-" + option).split()
            # "normal": the nonzero columns (a variable not printed is 0), not every row
            args += ["-solve" if self.mip else "-initialSolve", "-printingOptions", "normal", "-solution", solution]
            with open(os.devnull, "w") as pipe:
                if subprocess.call(args, stdout=pipe, stderr=pipe, stdin=subprocess.DEVNULL) != 0:
                    raise pulp.PulpSolverError("Pulp: Error while trying to execute " + self.path)
            if not os.path.exists(solution):
                raise pulp.PulpSolverError("Pulp: Error while executing " + self.path)
            status, sol_status = self.get_status(solution)
            values: dict[str, float] = {}  # by variable name
            with open(solution) as f:
                next(f)  # the status line
                for line in f:
                    fields = line.split()
                    if len(fields) < 3:
                        break
                    if fields[0] == "**":  # (an infeasible row or column)
                        fields = fields[1:]
                    if fields[1] in columns.by_name:
                        values[columns.by_name[fields[1]].name] = float(fields[2])
        finally:
            self.delete_tmp_files(mps, solution, start)
        for v in columns.variables:  # a column CBC does not print is 0
            v.varValue = values.get(v.name, 0.0)
        lp.assignStatus(status, sol_status)
        return status
