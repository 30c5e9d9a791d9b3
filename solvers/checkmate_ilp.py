"""rk-Checkmate: the ILP that schedules one CD-graph under a peak budget and a save budget.

Checkmate (Jain et al., "Checkmate: Breaking the Memory Wall with Optimal Tensor
Rematerialization", MLSys 2020) schedules a graph in *frontier-advancing stages*: stage ``t``
runs node ``t`` for the first time, after optionally re-running earlier nodes. Rockmate
(Zhao et al., ICML 2023, section 4.1) adapts it to CD-graphs; so does this formulation:

- compute nodes are listed forwards, loss, backwards; stage ``t`` runs compute node ``t``
  last, after optional recomputations of forward nodes ``k < t`` (every forward node in a
  backward stage; none in the loss stage; none in forward stages when
  ``forward_recompute=False``). The loss and each backward run exactly once, in their stage;
- C-node executions (binary ``R[t, k]``) are separate from D-node liveness: ``S[t, d]`` (alive
  at the start of stage ``t``) and frees ``F[t, k, d]`` right after each operation ``k`` that
  reads or produces ``d``; a node with several outputs frees each on its own;
- a forward keeps its phantoms only if ``W[t, k]`` (``with_grad``); a backward consumes them;
- the memory while operation ``k`` of stage ``t`` runs is what is alive plus ``k``'s
  temporary memory (a forward's: with or without grad) and every data node it produces; it
  is bounded by the peak budget;
- what is alive when the loss runs is bounded by the save budget (what the block keeps for
  its backward);
- objective: the time of the recomputations.

Only ``R`` is integer. ``S``, ``W`` and ``F`` may be continuous: a data node is read only when
its liveness is exactly 1 and liveness only decreases between productions, so a fractional value
can only appear where the node is not needed, where it overestimates the memory. With integer
``R`` the feasible sequences of computes are exactly those whose greedy schedule
(:func:`solvers.simulate.schedule_from_computes`: forget after the last use) fits the budgets;
the solution is turned into that schedule and measured by the simulator.

Two reductions keep every optimum (checked against the plain model and brute force in
``tests/test_solvers_ilp.py``): phantoms of 0 bytes whose forward needs no more memory with grad
than without stay alive from the forward to the backward (:func:`_free_phantoms`), and with lazy
recomputation a stage only has variables for the forwards its own node depends on
(:func:`_forward_ancestors`). On the tiny Llama attention class (61 computes): 381 binaries
instead of 465, its option grid 49.9 s instead of 60.8 s (20 ILPs at their time limit instead of
28; 2 workers).

With ``whole_runs`` (the option grid's default, :mod:`solvers.forward_runs`), the forwards of a
run that only feed each other share one ``R`` per stage and the run's inner results are not kept
past its stage: a restriction (not a reduction), measured to keep the plans of the bench GPT,
GPT-2 and Llama, with a Llama attention class's grid 2.5x faster.

Data produced only by backward nodes and the loss (gradients) have a fixed liveness, as the
stage of every backward is fixed: they enter the model as constants, computed by the
simulator's own rules (:func:`solvers.simulate.gradient_profile`: gradients that share a
storage, accumulations). Data nodes and
recomputations that no later stage can use are not created.

The model is built once per graph; the budgets are the bounds of two variables, so a new pair
of budgets only changes two bounds before a re-solve.
"""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass, field

import pulp

from rkgb.cdgraph import CDGraph, ComputeKind, DataKind
from solvers.cbc_template import MPSTemplate, TemplateCBC
from solvers.forward_runs import forward_runs
from solvers.highs_model import HighsModel, highs_usable
from solvers.simulate import effective_needs, gradient_profile, operation_outputs, phantoms_of

__all__ = ["ILPSolution", "RkCheckmateILP", "default_ilp_solver", "make_pulp_solver", "highs_available",
           "ortools_available", "solve_with_ortools"]


def highs_available() -> bool:
    """Whether HiGHS (``pip install highspy``, 1.11 or later) can solve the models in this
    process (:mod:`solvers.highs_model`)."""
    return highs_usable()


def default_ilp_solver() -> str:
    """The ILP backend of the option grids: HiGHS in process where ``highspy`` is installed
    (faster on every attention class measured, :mod:`solvers.highs_model`), else CBC."""
    return "highs" if highs_available() else "cbc"


_WARNINGS_LOCK = threading.Lock()

# the backends of OR-Tools' model builder (``pip install ortools``), by our name
ORTOOLS_ENGINES = {"cpsat": "sat", "scip": "scip"}


def ortools_available(name: str = "cpsat") -> bool:
    """Whether OR-Tools can run backend ``name`` (``"cpsat"``, ``"scip"``)."""
    try:
        from ortools.linear_solver.python import model_builder
    except ImportError:
        return False
    return model_builder.ModelSolver(ORTOOLS_ENGINES[name]).solver_is_supported()


def solve_with_ortools(prob: pulp.LpProblem, name: str, time_limit_s: float | None, gap: float = 0.0,
                       threads: int = 1) -> None:
    """Solve the pulp problem ``prob`` with OR-Tools' backend ``name`` (``"cpsat"``: CP-SAT,
    Google's constraint-programming and SAT-based MIP solver, which scales the continuous
    variables; ``"scip"``), as ``prob.solve`` would: the variables' values, ``prob.status`` and
    ``prob.sol_status`` are set. The variables' current values (a start) become hints."""
    import math

    from ortools.linear_solver.python import model_builder as mb

    model = mb.ModelBuilder()
    variables = prob.variables()
    integral: set[str] = set()
    if name == "cpsat":
        # CP-SAT has no continuous variables (it scales them, which can make a model of
        # fractional byte counts infeasible): one that only appears in constraints of integral
        # coefficients and constants (a memory unit dividing every size) takes integral values
        # at the optimum, and becomes an integer variable
        fractional: set[str] = set()
        for constraint in prob.constraints.values():
            exact = float(constraint.constant).is_integer() and all(float(c).is_integer() for c in constraint.values())
            if not exact:
                fractional.update(v.name for v in constraint.keys())
        integral = {v.name for v in variables if v.cat != pulp.LpInteger and v.name not in fractional}
    mapped = {}
    for v in variables:
        low = -math.inf if v.lowBound is None else v.lowBound
        high = math.inf if v.upBound is None else v.upBound
        if v.name in integral:
            low, high = math.ceil(low) if low > -math.inf else -2**40, math.floor(high) if high < math.inf else 2**40
        var = model.new_var(low, high, v.cat == pulp.LpInteger or v.name in integral, v.name)
        mapped[v.name] = var
        if v.varValue is not None:
            model.add_hint(var, v.varValue)

    def expression(affine: pulp.LpAffineExpression):
        items = list(affine.items())
        return mb.LinearExpr.weighted_sum([mapped[v.name] for v, _ in items], [c for _, c in items],
                                          constant=affine.constant)

    for constraint in prob.constraints.values():
        expr = expression(constraint)
        if constraint.sense == pulp.LpConstraintLE:
            model.add(expr <= 0)
        elif constraint.sense == pulp.LpConstraintGE:
            model.add(expr >= 0)
        else:
            model.add(expr == 0)
    objective = expression(prob.objective) if prob.objective is not None else mb.LinearExpr.weighted_sum([], [])
    if prob.sense == pulp.LpMinimize:
        model.minimize(objective)
    else:
        model.maximize(objective)
    solver = mb.ModelSolver(ORTOOLS_ENGINES[name])
    if time_limit_s is not None:
        solver.set_time_limit_in_seconds(time_limit_s)
    if name == "cpsat":
        solver.set_solver_specific_parameters(f"num_workers:{max(1, threads)},relative_gap_limit:{gap}")
    elif name == "scip":
        solver.set_solver_specific_parameters(f"limits/gap = {gap}")
    status = solver.solve(model)
    solved = {mb.SolveStatus.OPTIMAL: (pulp.LpStatusOptimal, pulp.LpSolutionOptimal),
              mb.SolveStatus.FEASIBLE: (pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible)}
    if status in solved:
        prob.status, prob.sol_status = solved[status]
        for v in variables:
            v.varValue = float(solver.value(mapped[v.name]))
    elif status == mb.SolveStatus.INFEASIBLE:
        prob.status, prob.sol_status = pulp.LpStatusInfeasible, pulp.LpSolutionInfeasible
    elif status in (mb.SolveStatus.MODEL_INVALID, mb.SolveStatus.INVALID_SOLVER_PARAMETERS,
                    mb.SolveStatus.SOLVER_TYPE_UNAVAILABLE, mb.SolveStatus.INCOMPATIBLE_OPTIONS,
                    mb.SolveStatus.ABNORMAL):
        raise RuntimeError(f"OR-Tools {name}: {status.name} {solver.status_string}")
    else:  # no solution within the time limit
        prob.status, prob.sol_status = pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound


def make_pulp_solver(name: str, time_limit_s: float | None, gap: float = 0.0,
                     heuristics: bool = True, cbc_options: tuple[str, ...] = ("cuts off",),
                     template: tuple[MPSTemplate, str] | None = None) -> pulp.LpSolver:
    """A pulp solver by name: ``"cbc"`` (bundled); None for the backends solved without one,
    ``"highs"`` (in the process, :mod:`solvers.highs_model`) and OR-Tools' ``"cpsat"`` and
    ``"scip"``, after checking that their package is installed (an ImportError naming it).
    ``cbc_options``: CBC's command-line options. The default turns cutting planes off: on
    these models CBC's cuts barely move the bound and cost ~half of the solve time (measured:
    2x faster over a sample of grid pairs). ``heuristics=False`` turns CBC's primal heuristics
    off: for solves given a start near the optimum, where the feasibility pump and the dives
    only cost time (~20% less over an option grid). ``template``: the problem's
    :class:`solvers.cbc_template.MPSTemplate` and the objective's key, for CBC.
    """
    if name == "cbc":
        with _WARNINGS_LOCK, warnings.catch_warnings():  # the option grid builds solvers in threads
            warnings.simplefilter("ignore", DeprecationWarning)  # PuLP 4 renames the bundled CBC
            options = list(cbc_options) + ([] if heuristics else ["heur off"])
            # CBC's serial mode: with "-threads 1" (its threaded mode with one thread) about one
            # process in 30 that solve an option grid from a process that imported torch had a CBC
            # run of a trivial model take 10.0 s, whatever its time limit (measured on the bench
            # ResNet's 3-compute classes; none in 60 runs without it, and the same figures)
            settings = dict(msg=False, timeLimit=time_limit_s, gapRel=gap, threads=None, options=options)
            return pulp.PULP_CBC_CMD(**settings) if template is None else TemplateCBC(*template, **settings)
    if name == "highs":  # solved in process by solvers.highs_model; no pulp solver object
        if not highs_available():
            raise ImportError("ilp_solver='highs' needs the highspy package: pip install highspy")
        return None
    if name in ORTOOLS_ENGINES:  # solved by solve_with_ortools; this object is not used
        if not ortools_available(name):
            raise ImportError(f"ilp_solver={name!r} needs OR-Tools: pip install ortools")
        return None
    raise ValueError(f"ilp_solver must be 'cbc', 'highs', 'cpsat' or 'scip', got {name!r}")


@dataclass
class ILPSolution:
    """A solution: the computes in order (``computes``), or ``feasible=False``."""

    feasible: bool
    computes: list[str] = field(default_factory=list)
    objective: float = 0.0
    status: str = ""
    time_limit_hit: bool = False
    solve_time_s: float = 0.0
    # the relative gap between the solution and the solver's bound when it stopped (0: proven
    # within the gap asked for, as far as the backend says; None: not reported, CBC through pulp)
    gap: float | None = None
    # solved in the neighbourhood of its start only (local branching): no bound for other pairs
    neighbourhood: bool = False


class RkCheckmateILP:
    """The rk-Checkmate model of one CD-graph, built once and re-solved for many budgets.

    Parameters
    ----------
    graph
        The CD-graph (a block's class graph, or a whole model's graph).
    keep_outputs
        The graph's output data must be alive at the end (a whole model).
    forward_recompute
        Allow recomputations in the forward stages (Checkmate does; they only lower the
        forward peak and cost variables).
    lazy_recompute
        A recomputation must serve a later operation of its own stage: nothing is recomputed
        ahead of the stage that reads it. This removes many equivalent solutions (a value
        recomputed at any stage between its last use and its next use) and speeds up the
        solver a lot; it loses the rare schedules that recompute early because the inputs
        happen to be alive then.
    memory_unit_bytes
        Bytes per unit of memory in the model (numbers are kept near 1e3 for the solver).
    binary_saved
        Make the liveness at the loss (what the block keeps for its backward) binary. Valid
        (an integer ``R`` gives integer liveness where it matters) and faster to solve.
    keep_free_phantoms
        Keep alive from the forward to the backward the phantoms that cost nothing
        (:func:`_free_phantoms`): no schedule is lost, and the solver has fewer choices.
    """

    def __init__(
        self,
        graph: CDGraph,
        *,
        keep_outputs: bool = False,
        forward_recompute: bool = True,
        lazy_recompute: bool = False,
        memory_unit_bytes: float = 1.0,
        binary_saved: bool = True,
        keep_free_phantoms: bool = True,
        whole_runs: bool = False,
    ) -> None:
        self.graph = graph
        self.keep_outputs = keep_outputs
        self.unit = float(memory_unit_bytes)
        nodes = graph.compute_nodes
        self.nodes = nodes
        stage = {c.name: i for i, c in enumerate(nodes)}
        n_stages = len(nodes)
        loss = stage["loss"]
        self.loss_stage = loss
        forwards = [i for i, c in enumerate(nodes) if c.kind is ComputeKind.FORWARD]
        keep = set(graph.held_outputs) if keep_outputs else set()
        protected = set(graph.input_grads) | keep

        # which data have a variable liveness (made by forwards) and who makes / reads them
        producer: dict[str, int] = {}
        for k in forwards:
            for d in operation_outputs(graph, nodes[k], True):
                if d in producer:
                    raise ValueError(f"{graph.name}: data node {d!r} has two forward producers")
                producer[d] = k
        needs_of = [set(effective_needs(graph, c)) for c in nodes]
        outputs_of = [operation_outputs(graph, c, True) for c in nodes]
        data_index = {d.name: i for i, d in enumerate(graph.data_nodes)}
        users: dict[str, list[int]] = {}
        for i, c in enumerate(nodes):
            for d in needs_of[i]:
                users.setdefault(d, []).append(i)
        # last stage at which each forward's outputs / each data can be needed
        last_needed: dict[str, int] = {}
        last_useful: dict[int, int] = {}
        for k in reversed(forwards):
            outs = operation_outputs(graph, nodes[k], True)
            for d in outs:
                ell = n_stages if d in keep else -1
                for u in users.get(d, ()):
                    ell = max(ell, last_useful[u] if nodes[u].kind is ComputeKind.FORWARD else u)
                last_needed[d] = ell
            last_useful[k] = max([k] + [last_needed[d] for d in outs])
        self.last_needed = last_needed
        self.protected = protected

        # constant memory: gradients (made by backwards / the loss), alive at the start of each
        # stage, and what each backward / the loss adds while it runs (aliases, accumulations)
        grad_start, grad_added, grad_flush, grad_overhead = gradient_profile(graph, protected)
        const_alive = [b / self.unit for b in grad_start]
        const_flush = [b / self.unit for b in grad_flush]

        prob = pulp.LpProblem(f"rk_checkmate_{graph.name}", pulp.LpMinimize)
        self.prob = prob
        self.producer = producer
        self.peak_var = _variable(prob, "peak_budget", lowBound=0)
        self.save_var = _variable(prob, "save_budget", lowBound=0)
        # the model's MPS text for CBC, written once per objective (solvers.cbc_template)
        self.mps = MPSTemplate(prob, [self.peak_var, self.save_var])
        # ... and its arrays for HiGHS, made once (solvers.highs_model)
        self.highs = HighsModel(prob, [self.peak_var, self.save_var])
        size = {d.name: d.size_bytes / self.unit for d in graph.data_nodes}

        # runs of forwards recomputed as a whole: one R variable per run and stage
        run_of: dict[int, int] = {}
        kept_until: dict[str, int] = {}  # a run's inner result: not kept past the run's stage
        if whole_runs:
            for run in forward_runs(graph):
                for name in run:
                    run_of[stage[name]] = stage[run[-1]]
                for name in run[:-1]:
                    for d in operation_outputs(graph, nodes[stage[name]], False):
                        kept_until[d] = stage[run[-1]]
        run_vars: dict[tuple[int, int], pulp.LpVariable] = {}
        # slots of each stage: (k, R variable or None when mandatory)
        self.slots: list[list[tuple[int, pulp.LpVariable | None]]] = []
        recompute_time = []
        for t in range(n_stages):
            slots: list[tuple[int, pulp.LpVariable | None]] = []
            if t != loss and (t > loss or forward_recompute):
                # lazily, a recomputation serves (through the ones after it) the stage's own node
                useful = _forward_ancestors(needs_of[t], producer, needs_of) if lazy_recompute else None
                for k in forwards:
                    if k >= t:
                        break
                    if last_useful[k] >= t and (useful is None or k in useful):
                        key = (t, run_of.get(k, k))
                        r = run_vars.get(key)
                        if r is None:
                            r = run_vars[key] = _variable(prob, f"R_{t}_{k}", cat=pulp.LpBinary)
                        slots.append((k, r))
                        recompute_time.append(nodes[k].time_s * r)
            slots.append((t, None))
            self.slots.append(slots)

        # S[t, d]: alive at the start of stage t, for producer(d) < t <= last_needed(d)
        alive_at_start: dict[tuple[int, str], pulp.LpVariable] = {}
        alive_by_stage: list[list[str]] = [[] for _ in range(n_stages)]
        for d, p in producer.items():
            for t in range(p + 1, min(last_needed[d], n_stages - 1, kept_until.get(d, n_stages)) + 1):
                # what is alive at the loss (the block's saved set) is binary: CBC then branches
                # on "keep d for the backward or not" instead of on fractional recomputations
                cat = pulp.LpBinary if t == loss and binary_saved else pulp.LpContinuous
                alive_at_start[t, d] = _variable(prob, f"S_{t}_{data_index[d]}", lowBound=0, upBound=1, cat=cat)
                alive_by_stage[t].append(d)
        self.saved_vars = {d: v for (t, d), v in alive_at_start.items() if t == loss}
        # phantoms that cost nothing: kept from the forward to the backward (module docstring)
        self.free_phantoms = _free_phantoms(graph, [nodes[k] for k in forwards]) if keep_free_phantoms else set()
        self.kept_alive: set[str] = set()  # their liveness variables (fix_liveness restores them)
        for (t, d), v in alive_at_start.items():
            if d in self.free_phantoms:
                v.lowBound = 1
                self.kept_alive.add(v.name)

        def run(r: pulp.LpVariable | None) -> object:
            return 1 if r is None else r

        n_rows = 0
        if lazy_recompute:
            # a recomputation serves a later operation of its own stage (no recomputing ahead)
            for t in range(n_stages):
                for i, (k, r) in enumerate(self.slots[t]):
                    if r is None:
                        continue
                    made = set(outputs_of[k])
                    readers = [x for j, x in self.slots[t][i + 1 :] if made & needs_of[j]]
                    # (a reader recomputed with it, in one run, is its own variable: no constraint)
                    if any(x is None or x is r for x in readers):
                        continue
                    prob += r <= pulp.lpSum(readers)
                    n_rows += 1
        for t in range(n_stages):
            slots = self.slots[t]
            # with_grad variables of the forwards of this stage
            with_grad: dict[int, object] = {}
            for k, r in slots:
                node = nodes[k]
                if node.kind is not ComputeKind.FORWARD:
                    continue
                phantoms = phantoms_of(graph, node)
                if phantoms is not None and last_needed.get(phantoms, -1) >= t:
                    w = _variable(prob, f"W_{t}_{k}", lowBound=0, upBound=1)
                    if r is not None:
                        prob += w <= r
                        n_rows += 1
                    with_grad[k] = w
            # liveness of each variable data node along the stage, with its frees
            frees: dict[int, list[tuple[str, pulp.LpVariable]]] = {k: [] for k, _ in slots}
            touched = set(alive_by_stage[t])
            for k, _ in slots:
                touched.update(d for d in needs_of[k] if d in producer)
                if nodes[k].kind is ComputeKind.FORWARD:
                    touched.update(d for d in outputs_of[k] if d in producer)
            for d in sorted(touched):
                live: object = alive_at_start.get((t, d), 0)
                live_is_zero = (t, d) not in alive_at_start
                for k, r in slots:
                    node = nodes[k]
                    made = None
                    if node.kind is ComputeKind.FORWARD and producer.get(d) == k:
                        if graph.data(d).kind is DataKind.PHANTOMS:
                            made = with_grad.get(k)
                        else:
                            made = run(r)
                    if made is not None:
                        if not live_is_zero:
                            prob += live + made <= 1
                            n_rows += 1
                        live = live + made
                        live_is_zero = False
                    if d in needs_of[k]:
                        if live_is_zero:
                            raise ValueError(
                                f"{graph.name}: {node.name!r} needs {d!r}, which cannot be alive at stage {t}"
                            )
                        prob += live >= run(r)
                        n_rows += 1
                    if not live_is_zero and d not in keep and (made is not None or d in needs_of[k]):
                        f = _variable(prob, f"F_{t}_{k}_{data_index[d]}", lowBound=0, upBound=1)
                        frees[k].append((d, f))
                        live = live - f
                        prob += live >= 0
                        n_rows += 1
                if live_is_zero:
                    continue
                following = alive_at_start.get((t + 1, d))
                if following is not None:
                    prob += following == live
                elif d in keep and t == n_stages - 1:
                    prob += live == 1
                else:
                    prob += live == 0
                n_rows += 1
            # memory along the stage
            before = _variable(prob, f"U_{t}_start", lowBound=0)
            prob += before == pulp.lpSum(size[d] * alive_at_start[t, d] for d in alive_by_stage[t])
            if t == loss:
                prob += before + const_alive[t] <= self.save_var
            if grad_flush[t] > grad_start[t]:  # the previous backward's contributions join
                prob += before + const_flush[t] <= self.peak_var
            for i, (k, r) in enumerate(slots):
                node = nodes[k]
                x = run(r)
                variable_made = []
                for d in outputs_of[k]:
                    if d in producer:
                        made = with_grad.get(k) if graph.data(d).kind is DataKind.PHANTOMS else x
                        if made is not None:
                            variable_made.append(size[d] * made)
                if node.kind is ComputeKind.FORWARD:
                    # without grad unless W says so (and phantoms are kept); the clip keeps a
                    # fractional W from lowering the memory (exact unless a no-grad run needs
                    # more than a run with grad and its phantoms, where it over-estimates)
                    overhead = node.overhead(False) / self.unit * x
                    w = with_grad.get(k)
                    if w is not None:
                        phantoms = phantoms_of(graph, node)
                        extra = max(node.overhead(True) - node.overhead(False), -graph.size(phantoms))
                        overhead = overhead + extra / self.unit * w
                else:
                    overhead = (grad_overhead[k] + grad_added[k]) / self.unit * x
                during = before + overhead + pulp.lpSum(variable_made)
                prob += during + const_alive[t] <= self.peak_var
                n_rows += 2
                if i + 1 < len(slots):
                    after = _variable(prob, f"U_{t}_{i}", lowBound=0)
                    prob += after == before + pulp.lpSum(variable_made) - pulp.lpSum(
                        size[d] * f for d, f in frees[k]
                    )
                    before = after
        self.variables = list(prob.variables())  # (sorted by name; the model's structure is fixed from here)
        self.time_unit = max(sum(c.time_s for c in nodes), 1e-30) / 1000.0
        self.time_objective = pulp.lpSum(recompute_time) * (1.0 / self.time_unit)
        self.n_binaries = len(run_vars)
        self.n_rows = n_rows
        self.mandatory_time = sum(c.time_s for c in nodes)

    def tied_forwards(self) -> dict[int, list[list[int]]]:
        """Per stage, the groups of forwards that share one recomputation variable (the runs
        of ``whole_runs``): a MIP start recomputes all of a group or none."""
        tied: dict[int, list[list[int]]] = {}
        for t, slots in enumerate(self.slots):
            by_variable: dict[str, list[int]] = {}
            for k, r in slots:
                if r is not None:
                    by_variable.setdefault(r.name, []).append(k)
            groups = [group for group in by_variable.values() if len(group) > 1]
            if groups:
                tied[t] = groups
        return tied

    # ------------------------------------------------------------------------------------
    def solve(
        self,
        peak_bytes: float | None,
        save_bytes: float | None = None,
        *,
        objective: str = "time",
        time_limit_s: float | None = 30.0,
        solver: str = "cbc",
        warm_start: bool = False,
        gap: float = 0.0,
        start: list[str] | None = None,
        cbc_options: tuple[str, ...] | None = None,
        flips: int | None = None,
    ) -> ILPSolution:
        """Solve for a peak budget and a save budget (bytes; None: unbounded).

        ``objective="time"`` minimizes the recomputation time; ``"peak"`` minimizes the peak
        (then ``peak_bytes`` is ignored), for the smallest budget the graph can meet;
        ``"save"`` minimizes what is alive at the loss (then ``save_bytes`` is ignored).
        ``start``: a feasible sequence of computes (a solution of another pair of budgets that
        fits this one) given to the solver as its first incumbent (CBC's MIP start); CBC's
        heuristics are then off. ``cbc_options``: see :func:`make_pulp_solver`. ``flips`` (HiGHS,
        with a start): search only the solutions that change at most that many of the start's
        binary values (local branching); the solution says ``neighbourhood`` and proves nothing
        beyond it.
        """
        self.peak_var.lowBound = 0
        self.peak_var.upBound = None if (peak_bytes is None or objective == "peak") else peak_bytes / self.unit
        self.save_var.upBound = None if save_bytes is None else save_bytes / self.unit
        if objective == "time":
            self.prob.setObjective(self.time_objective)
        elif objective == "peak":
            self.prob.setObjective(self.peak_var + 1e-4 * self.time_objective)
        elif objective == "save":
            self.save_var.upBound = None
            self.prob.setObjective(self.save_var + 1e-4 * self.time_objective)
        else:
            raise ValueError(f"objective must be 'time', 'peak' or 'save', got {objective!r}")
        # with a start (a neighbouring pair's solution, repaired to fit), CBC's heuristics are
        # not worth their time
        extra = {} if cbc_options is None else {"cbc_options": cbc_options}
        backend = make_pulp_solver(solver, time_limit_s, gap, heuristics=start is None,
                                   template=(self.mps, objective), **extra)
        if start is not None and solver in ("cbc", "highs", *ORTOOLS_ENGINES):
            self._set_start(start)
            warm_start = True
        if warm_start and solver == "cbc":
            backend.optionsDict["warmStart"] = True
        start = time.perf_counter()
        self._solve_with_fallback(backend, solver, time_limit_s, gap, warm_start, flips=flips)
        elapsed = time.perf_counter() - start
        status = pulp.LpStatus[self.prob.status]
        has_solution = self.prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
        limit_hit = self.prob.sol_status == pulp.LpSolutionIntegerFeasible or (
            time_limit_s is not None and elapsed >= time_limit_s * 0.98 and not has_solution
            and status != "Infeasible"
        )
        if not has_solution:
            return ILPSolution(False, status=status, time_limit_hit=limit_hit, solve_time_s=elapsed)
        computes = []
        for slots in self.slots:
            for k, r in slots:
                if r is None or (r.varValue is not None and r.varValue > 0.5):
                    computes.append(self.nodes[k].name)
        objective_value = pulp.value(self.prob.objective) or 0.0
        return ILPSolution(
            True,
            computes=computes,
            objective=objective_value,
            status=status,
            time_limit_hit=limit_hit,
            solve_time_s=elapsed,
            gap=self.highs.final_gap if solver == "highs" else None,
            neighbourhood=flips is not None,
        )


    def relaxed_liveness(self, peak_bytes: float | None, *, objective: str = "time",
                         time_limit_s: float | None = 30.0, solver: str = "cbc") -> dict[str, float] | None:
        """The LP relaxation (every integer variable continuous in its bounds): the value of
        each liveness variable ``S`` (by name) at its optimum, or None where the LP is
        infeasible (then so is the ILP). Checkmate's first phase (Jain et al., MLSys 2020)."""
        integer = [v for v in self.variables if v.cat == pulp.LpInteger]
        for v in integer:
            v.cat = pulp.LpContinuous
        self._structure_changed()
        try:
            solution = self.solve(peak_bytes, objective=objective, time_limit_s=time_limit_s, solver=solver)
        finally:
            for v in integer:
                v.cat = pulp.LpInteger
            self._structure_changed()
        if not solution.feasible:
            return None
        return {v.name: float(v.varValue or 0.0) for v in self.variables if v.name.startswith("S_")}

    def fix_liveness(self, values: dict[str, float] | None) -> None:
        """Fix each liveness variable named in ``values`` to its value (0 or 1), or free them
        all again (None): Checkmate's second phase solves the recomputations given them."""
        self._structure_changed()
        for v in self.variables:
            if not v.name.startswith("S_"):
                continue
            if values is None:
                v.lowBound, v.upBound = (1 if v.name in self.kept_alive else 0), 1
            elif v.name in values:
                v.lowBound = v.upBound = values[v.name]

    def _structure_changed(self) -> None:
        """The model changed beyond its budgets' bounds (categories, fixed liveness): the solvers'
        copies of it are made again."""
        self.mps.invalidate()
        self.highs.invalidate()

    def _solve_with_fallback(self, backend: pulp.LpSolver | None, solver: str, time_limit_s: float | None,
                             gap: float, warm_start: bool = False, flips: int | None = None) -> None:
        """Solve with ``backend`` (HiGHS in process for ``"highs"``, with the integer variables'
        values as a start where ``warm_start``); where the backend itself fails (CBC's
        executable crashing, a HiGHS error), solve again with the other backend (HiGHS where
        installed, else CBC, without a start), so that no backend's exception reaches the user."""
        try:
            if solver in ORTOOLS_ENGINES:
                solve_with_ortools(self.prob, solver, time_limit_s, gap)
            elif solver == "highs":
                self.highs.solve(time_limit_s, gap, start=warm_start, flips=flips)
            else:
                self.prob.solve(backend)
            return
        except (pulp.PulpSolverError, OSError, RuntimeError) as error:
            first_error = error
        fallback = "highs" if solver == "cbc" and highs_available() else "cbc"
        for v in self.variables:  # no stale start for the fallback
            v.varValue = None
        try:
            if fallback == "highs":
                self.highs.solve(time_limit_s, gap, start=False)
            else:
                self.prob.solve(make_pulp_solver(fallback, time_limit_s, gap))
        except (pulp.PulpSolverError, OSError, RuntimeError) as error:
            raise RuntimeError(
                f"the ILP solvers failed on a block of {len(self.nodes)} nodes: {solver}: {first_error}; {fallback}: {error}"
            ) from error

    def _set_start(self, computes: list[str]) -> None:
        """Give every integer variable the value of ``computes`` (a feasible sequence)."""
        from solvers.simulate import schedule_from_computes, simulate

        for v in self.variables:
            v.varValue = None
        names = [c.name for c in self.nodes]
        position = 0
        for slots in self.slots:
            mandatory = names[slots[-1][0]]
            stage_computes = []
            while position < len(computes) and computes[position] != mandatory:
                stage_computes.append(computes[position])
                position += 1
            position += 1
            for k, r in slots:
                if r is not None:
                    r.varValue = 1.0 if names[k] in stage_computes else 0.0
        schedule = schedule_from_computes(self.graph, computes, protected=self.protected)
        alive = simulate(self.graph, schedule, keep_outputs=self.keep_outputs).alive_after_forward or set()
        for d, v in self.saved_vars.items():
            # (the free phantoms' liveness is fixed to 1: the schedule forgets them where their
            # forward runs again before their backward; kept, they cost nothing)
            v.varValue = 1.0 if d in alive or v.name in self.kept_alive else 0.0


def _free_phantoms(graph: CDGraph, forwards) -> set[str]:
    """The phantoms of 0 bytes of the forwards whose run with grad needs no more memory than
    their run without (an addition, a view, an activation that saves its output).

    Keeping them from the forward to the backward costs no memory, and running a recomputation
    of such a node with grad or without costs the same: every schedule has an equivalent one
    that keeps them, so the ILP keeps them (``S`` fixed to 1 over their lifetime). Measured on the
    tiny Llama attention class (61 computes, 25 of its 30 forwards), with the option grid's
    settings: its grid's ILPs hit their time limit 20 times instead of 34 (81 s instead of
    110 s, one worker); the GPT-2 class's grid 10.4 s instead of 12.4 s with the same options."""
    free = set()
    for node in forwards:
        phantoms = phantoms_of(graph, node)
        if phantoms is not None and graph.size(phantoms) == 0 and node.overhead(True) == node.overhead(False):
            free.add(phantoms)
    return free


def _forward_ancestors(needs, producer: dict[str, int], needs_of: list[set[str]]) -> set[int]:
    """The forwards whose outputs ``needs`` depend on, through forwards (``producer``: data ->
    the forward making it; ``needs_of``: what each operation reads): what a stage can recompute
    for its own node when recomputations are lazy."""
    found: set[int] = set()
    pending = [producer[d] for d in needs if d in producer]
    while pending:
        k = pending.pop()
        if k in found:
            continue
        found.add(k)
        pending.extend(producer[d] for d in needs_of[k] if d in producer)
    return found


def _variable(prob: pulp.LpProblem, name: str, lowBound=None, upBound=None, cat=pulp.LpContinuous):
    """A variable of ``prob`` (PuLP >= 3.3 attaches variables to their model)."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lowBound, upBound, cat=cat)
    return pulp.LpVariable(name, lowBound, upBound, cat=cat)
