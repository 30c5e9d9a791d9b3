"""The options of a class of blocks: rk-Checkmate solved for a grid of (peak, save) budgets.

Rockmate (Zhao et al., ICML 2023, section 4.1) solves each distinct block for a grid of peak
budgets and save budgets, between the block's minimum and what it needs without any
recomputation. The published implementation solves every pair from scratch; here:

1. the bounds of the grid come from three solves: the autograd schedule (no recomputation,
   the top corner), the smallest peak, the smallest saved memory; the last two start from the
   lowest schedules that repairs find (:meth:`solvers.option_repair.ScheduleRepair.lowest`),
   which on the classes of 80-180 computes are far lower than what HiGHS finds alone in its
   time limit (LongT5's 161-compute class: a peak of 276 thousandths of the autograd
   schedule's instead of 385 after a 10 s retry, a saved memory of 18 instead of 240);
2. a pair is decided once every looser pair is done, from what those found alone (the solutions
   of incomparable pairs are left out, so that the answer does not depend on which of them
   happen to be done): its solve starts at once, beside the solves of other pairs
   (``workers`` solver processes at a time). In a row of solved pairs (one peak budget, the
   save budgets going down) each solve would wait for the one before: in the grids of big
   models (``OVERLAP_ROW_SOLVES_FROM`` recomputation binaries), once two pairs in a row were
   solved, the next pair is decided without the results of the one just before it, which is
   left out as an incomparable pair is, and the row's solves run two at a time. The Llama-12
   attention class (159 binaries): its hard row's seven solves of 0.3-0.6 s each had waited on
   one another; the grid 3.4-3.6 -> 2.8 s, the same option at every grid pair. Not on the GPT
   classes (65 binaries, solves of 0.02-0.3 s): there the pairs decided so lose the answer of
   the pair before (the bench GPT's class: one solve more, the grid 2.0 -> 2.4 s);
3. the optimal time of a looser pair is a lower bound for a tighter one, and every solution
   found so far whose measured (peak, saved) fits the pair is feasible for it: when the best of
   those is within the ILP's relative gap of the bound, the pair is answered without solving
   (this covers "the solution of a looser pair still fits"; a solve would promise no better).
   A pair tighter than an infeasible one is infeasible;
4. otherwise the solutions of the two nearest looser pairs (four where the two nearest give
   none) are repaired by :class:`solvers.option_repair.ScheduleRepair` until they fit; the
   best repaired solution may already meet the lower bound (no solve), else it is the solve's
   MIP start. A start near the optimum cuts CBC's time by a third (no feasibility pump, an
   early cutoff). Where no proven looser pair gives a start (a class whose solves stop at their
   time limit proves few pairs), the solutions of the looser pairs' stopped solves are
   repaired, the nearest to fitting first;
5. pairs with a save budget above the peak budget are the same as save = peak;
6. each ILP has a time limit and keeps its best feasible solution; with ``stalled_solves``, a
   class whose solves keep stopping at their limit with their start unbettered solves its later
   pairs that have a start in the start's neighbourhood only (``neighbourhood_flips``: local
   branching), or keeps their starts without solving them;
7. equal solutions are merged and dominated ones dropped (:func:`pareto_front`).

Measured on the GPT attention classes (2-core CPU, 10 x 10 grid, 1% gap, CBC): the model
building and the bounds take under half a second; the pairs take about 50 ILP solves on the
bench GPT, 40 on the tiny one (0.2-0.3 s of CBC each), the repairs about 1 s of Python in all
(0.5 s on the Llama-12 attention class since they measure with :mod:`solvers.stage_figures`).
See ``benchmarks/bench_solvers.py``.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from rkgb.cdgraph import CDGraph
from solvers.checkmate_ilp import RkCheckmateILP, default_ilp_solver
from solvers.option_repair import ScheduleRepair
from solvers.options import BlockOption, ClassOptions, autograd_option, no_grad_forward, option_from_computes

__all__ = ["GridReport", "SolveRecord", "grid_model", "solve_class_options", "pareto_front"]

# the repair of a pair starts from the answers of this many nearest looser pairs (measured on
# the GPT attention classes: a third seed, or the known solutions nearest to fitting, cost
# more Python time than they save solver time)
REPAIR_SEEDS = 2
# ... and up to this many where those give no fitting start: a solve without a start costs 3-10x
# one with (the Llama-12 attention class's grid: 1.2-1.5 s for its one pair left without a
# start, 0.1-0.3 s for most others; the grid 7.0-7.2 -> 6.4 s, the same options)
REPAIR_SEEDS_WITHOUT_START = 4
# CBC's options for the grid's solves: cutting planes off but probing (~15% less time over a
# grid than no cuts at all), pseudo-costs trusted after one strong branching (~15% less, the
# same optima). Whole-graph Checkmate keeps the defaults of :func:`make_pulp_solver`: with
# these it stopped at its 30 s limit on a worse schedule (2-layer GPT, budget 60%).
GRID_CBC_OPTIONS = ("cuts off", "probing on", "trust 1")
# the relative gap of the min-peak and min-save solves, by backend (the grid's gap otherwise): they
# set the class's minimum budget and the grid's range; HiGHS proves them exactly in ~0.1 s on the
# attention classes (0.04-0.15 s, against 0.08-0.39 s for CBC at the grid's 1%)
BOUND_GAP = {"highs": 0.0}
# a min-peak or min-save solve stopped by its time limit is retried with 5x the time unless its
# solution is already within this relative gap of the solver's bound (as the backend reports it:
# HiGHS does, CBC through pulp does not). Mamba2's 92-compute class: its min-peak solve stopped
# at 7.4% (retried: 7.4% lower, proven in 5.9 s); on its measured costs at 0.0008% (the retry
# had gained 0.0008% in 10 s). Nor is one retried that stopped past its root (a bound reported)
# on its start, the repairs' lowest schedule, unbettered: on the classes of MPNet (81 computes),
# RecurrentGemma (117) and LongT5 (137, 161) such retries gained 0.24%, 0, 0 and 0 in 10 s
BOUND_RETRY_GAP = 0.01
# repair the solutions of looser pairs' stopped solves where no proven looser pair gives a
# start (module docstring, 4). Mamba2's 92-compute class, 49 of its 67 solves at their 2 s
# limit: solves without a start 22 -> 3, its options faster at 562 of 1681 budget points (up
# to 29%), slower at 225 (up to 24%), within the noise of its wall-clock-limited solves (two
# runs of this code differ at 992 points); its plans at 13 budgets the same or up to 0.4%
# faster; the Llama-12, GPT-2 small and Gemma 2 classes unchanged (every pair started before)
REPAIR_FROM_KNOWN = True
# a neighbourhood solve is skipped where a looser pair's, from the same start, found nothing better
# (its neighbourhood there holds this pair's; a switch for the tests)
SKIP_SEARCHED_NEIGHBOURHOODS = True
# in the grid of a model with at least this many recomputation binaries, a pair whose nearest
# looser pair in its peak row (the same peak budget, the next save budget up) is solved after
# the pair before it in the row was solved too does not wait for that solve: it is decided
# without that pair's results (module docstring, 2). None: every pair waits for all its looser pairs
OVERLAP_ROW_SOLVES_FROM = 100


@dataclass
class SolveRecord:
    """One ILP solve of a grid: its budgets (bytes; None for the min-peak and min-save solves),
    objective (``"time"``, ``"peak"``, ``"save"``), the relative gap and time limit it was given,
    the start it was given (computes, or None), the schedule it returned (None: none), its
    objective value in the model's units and its wall-clock seconds. What
    ``benchmarks/bench_grid_certificates.py`` analyses."""

    peak_bytes: int | None
    save_bytes: int | None
    objective: str
    gap: float
    time_limit_s: float
    start: list[str] | None
    computes: list[str] | None
    value: float | None
    seconds: float
    time_limit_hit: bool


@dataclass
class GridReport:
    """How the grid was solved: what the benchmark prints.

    ``pairs`` grid pairs, of which ``solved`` by an ILP, ``reused`` (an earlier solution or a
    repaired one proven optimal by a looser pair), ``pruned_infeasible`` (tighter than an
    infeasible pair). ``repaired``: repaired solutions better than every fitting known one,
    found in ``repair_s`` seconds (CPU of the thread that repairs). Phases in seconds:
    ``build_s`` (the ILP model), ``bounds_s`` (the min-peak and min-save solves), ``grid_s``
    (the pairs), ``total_s``.
    """

    pairs: int = 0
    solved: int = 0
    reused: int = 0
    pruned_infeasible: int = 0
    time_limit_hits: int = 0
    grid_limit_skipped: int = 0
    stall_skipped: int = 0
    neighbourhood_solves: int = 0
    neighbourhood_skipped: int = 0
    overlapped: int = 0  # pairs decided beside the solve of the pair before them in their row
    repaired: int = 0
    repair_s: float = 0.0
    build_s: float = 0.0
    bounds_s: float = 0.0
    grid_s: float = 0.0
    total_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    # every ILP solve, in the order they ended, where a list is given (None: not recorded)
    solves: list[SolveRecord] | None = None


def pareto_front(options: list[BlockOption]) -> list[BlockOption]:
    """Merge equal options and drop dominated ones (keeps the first of equals)."""
    unique: dict[tuple, BlockOption] = {}
    for o in options:
        unique.setdefault(o.key(), o)
    kept = list(unique.values())
    front = [o for o in kept if not any(p is not o and p.dominates(o) and p.key() != o.key() for p in kept)]
    return sorted(front, key=lambda o: (o.saved_bytes, o.peak_bytes, o.time_s))


def grid_model(graph: CDGraph, *, forward_recompute: bool, lazy_recompute: bool, whole_runs: bool,
               top: BlockOption | None = None) -> RkCheckmateILP:
    """The rk-Checkmate model that the option grid of ``graph`` solves (its memory in thousandths
    of the autograd schedule's peak ``top``, numbers near 1e3 for the solver)."""
    top = autograd_option(graph) if top is None else top
    unit = max(1.0, top.peak_bytes / 1000.0)
    return RkCheckmateILP(graph, forward_recompute=forward_recompute, lazy_recompute=lazy_recompute,
                          memory_unit_bytes=unit, whole_runs=whole_runs)


def _linspace(low: float, high: float, count: int) -> list[int]:
    if count <= 1 or high <= low:
        return [int(high)]
    return sorted({int(round(low + (high - low) * i / (count - 1))) for i in range(count)})


def solve_class_options(
    graph: CDGraph,
    *,
    peak_steps: int = 10,
    save_steps: int = 10,
    time_limit_s: float = 10.0,
    ilp_solver: str | None = None,
    forward_recompute: bool = True,
    lazy_recompute: bool = False,
    gap: float = 0.0,
    warm_start: bool = True,
    repair: bool = True,
    workers: int = 2,
    grid_time_limit_s: float | None = None,
    whole_runs: bool = False,
    stalled_solves: int | None = None,
    neighbourhood_flips: int | None = None,
    report: GridReport | None = None,
    solver_slots: threading.Semaphore | None = None,
) -> ClassOptions:
    """The options of one class: rk-Checkmate on ``graph`` for a grid of budget pairs.

    Parameters
    ----------
    graph
        The class's CD-graph (anonymized names).
    peak_steps, save_steps
        Grid size; budgets are evenly spaced between the class's minimum and its
        no-recomputation maximum.
    time_limit_s
        Per ILP; a solve that hits it keeps its best solution and the option says so.
    ilp_solver
        ``"highs"`` (HiGHS in process, :mod:`solvers.highs_model`), ``"cbc"`` (bundled with
        pulp), ``"cpsat"`` or ``"scip"`` (OR-Tools); None: HiGHS where ``highspy`` is
        installed, else CBC.
    gap
        Relative optimality gap accepted from the ILP solver (0: proven optimal). A pair whose
        best known (or repaired) solution is within ``gap`` of its lower bound (a looser pair's
        time) is answered without a solve: on the GPT-2 attention class 35 solves instead of 64
        (16 s -> 11 s), and the bench GPT's plans at budgets 0.3-0.9 predict the same step
        times (to 5 digits) with 35% less planning time.
    warm_start
        Give CBC the best known (or repaired) solution that fits a pair as its first incumbent.
    repair
        Repair the solutions of looser pairs into solutions of the pair (module docstring, 4).
    workers
        ILPs solved at the same time, one solver process each (at most the CPU count). A pair
        is decided from the looser pairs' results only: the options do not depend on
        ``workers`` (unless a solve hits its time limit, which is wall-clock time).
    grid_time_limit_s
        Stop solving new pairs after this long (the options found so far are kept; the
        report counts the pairs left unsolved).
    stalled_solves
        Once this many solves have hit their time limit without bettering their start, the
        pairs decided after them that have a start are solved in its neighbourhood
        (``neighbourhood_flips``) or, without it, keep it without a solve (None: every pair
        solved in full). No solve of the Llama-12, GPT-2 small or Gemma 2 classes stops at its
        limit; the classes of 80-160 computes of tiny Mamba2, MPNet and MobileViT do (HiGHS's
        bound far under the start, which it returns after its 2 s).
    neighbourhood_flips
        With ``stalled_solves`` (HiGHS only): the pairs' solves search the schedules that change
        at most this many of the start's binary values (local branching, Fischetti and Lodi,
        Math. Programming 2003), which HiGHS explores in a fraction of its full solve's time and
        which betters the start where a few recomputations swapped do; such a solve proves no
        bound for tighter pairs. 3 stalls and 4 flips on Mamba2's 92-compute class (measured
        costs): its model planned in 47-53 s instead of 68 s (three runs), its plans at 13
        budgets within 0.67-1.68% of those of a grid with 10x the time per solve (the full
        solves' grid: 1.03%; the runs' noise is as large, their solves being cut by a wall-clock
        limit).
    whole_runs
        Recompute each run of forwards that only feed each other as a whole
        (:mod:`solvers.forward_runs`): fewer choices; on the GPT-2 and Llama attention classes
        1.5-2.5x faster, options within the ILP's gap of those of the full model.

    Returns
    -------
    ClassOptions, whose options always include the autograd option (no recomputation).
    """
    report = report if report is not None else GridReport()
    ilp_solver = default_ilp_solver() if ilp_solver is None else ilp_solver
    # a known solution this close to the lower bound answers a pair without a solve: the solve
    # itself would only promise as much (its relative gap)
    accept = max(float(gap), 1e-9)
    start = time.perf_counter()
    top = autograd_option(graph)
    options = [top]
    workers = max(1, min(int(workers), os.cpu_count() or 1))
    # one model per running solve (a solve sets the model's bounds, objective and values)
    built = [grid_model(graph, forward_recompute=forward_recompute, lazy_recompute=lazy_recompute,
                        whole_runs=whole_runs, top=top) for _ in range(workers)]
    models: queue.SimpleQueue[RkCheckmateILP] = queue.SimpleQueue()
    for model in built:
        models.put(model)
    report.build_s = time.perf_counter() - start

    def solve_one(peak, save, kwargs, limit_s=time_limit_s, within=gap):
        ilp = models.get()
        try:
            with solver_slots if solver_slots is not None else contextlib.nullcontext():
                solution = ilp.solve(peak, save, time_limit_s=limit_s, solver=ilp_solver, gap=within,
                                     cbc_options=GRID_CBC_OPTIONS, **kwargs)
            if report.solves is not None:
                report.solves.append(SolveRecord(
                    peak, save, kwargs.get("objective", "time"), within, limit_s, kwargs.get("start"),
                    solution.computes if solution.feasible else None,
                    solution.objective if solution.feasible else None, solution.solve_time_s, solution.time_limit_hit))
            return solution
        finally:
            models.put(ilp)

    def bound(objective: str, descended: tuple[list[str], BlockOption] | None):
        """The min-peak or min-save solve, from ``descended`` (the repairs' lowest schedule) as
        its start: the lowest schedule found and its option (None: none). It sets the grid's
        range and the class's minimum budget, so one stopped by the time limit (a loaded
        machine) is retried with 5x the time, unless it is within ``BOUND_RETRY_GAP`` of its
        bound or bettered nothing of its start (module constants)."""
        began = time.perf_counter()
        within = BOUND_GAP.get(ilp_solver, gap)
        source = f"min {objective}"
        value = (lambda o: o.peak_bytes) if objective == "peak" else (lambda o: o.saved_bytes)

        def lowest(solution):
            """The schedule of ``solution`` and its option, or the start's where the simulator
            measures the start lower (the solver keeps its start, but measures by its model)."""
            found = measured(solution, source)
            if descended is not None and (found is None or value(descended[1]) < value(found)):
                descended[1].source, descended[1].time_limit_hit = source, solution.time_limit_hit
                return descended
            return None if found is None else (solution.computes, found)

        kwargs = {"objective": objective, "start": None if descended is None else descended[0]}
        solution = solve_one(None, None, kwargs, within=within)
        best = lowest(solution)
        if best is not None and not solution.time_limit_hit:
            return best
        if best is not None and solution.gap is not None and solution.gap <= BOUND_RETRY_GAP:
            report.notes.append(f"min-{objective} solve hit its {time_limit_s} s limit within "
                                f"{solution.gap:.2%} of its bound: kept")
            return best
        if descended is not None and solution.gap is not None and math.isfinite(solution.gap) \
                and value(best[1]) >= value(descended[1]):
            # (past its root, where the solver has a bound: a loaded machine stops it before)
            report.notes.append(f"min-{objective} solve hit its {time_limit_s} s limit without bettering the "
                                f"repairs' schedule ({solution.gap:.1%} above its bound): kept")
            return best
        # (not where the retry, as long as this solve and 5x its limit, would end past the
        # grid's time limit: a block so big that writing and presolving its model take longer
        # than the limit itself, where more time finds nothing either)
        spent = time.perf_counter() - began
        if grid_time_limit_s is not None and \
                time.perf_counter() - start + spent + 4 * time_limit_s > grid_time_limit_s:
            report.notes.append(f"min-{objective} solve hit its {time_limit_s} s limit ({spent:.1f} s in all); "
                                "not retried: the retry would end past the grid's time limit")
            return best
        if best is not None and descended is not None:
            kwargs["start"] = best[0]
        again = solve_one(None, None, kwargs, 5 * time_limit_s, within=within)
        report.notes.append(f"min-{objective} solve hit its {time_limit_s} s limit; retried with "
                            f"{5 * time_limit_s} s ({'proven' if again.feasible and not again.time_limit_hit else 'limit hit again'})")
        retry = lowest(again)
        return retry if retry is not None else best

    def measured(solution, source: str) -> BlockOption | None:
        if not solution.feasible:
            return None
        option = option_from_computes(graph, solution.computes, source=source)
        option.time_limit_hit = solution.time_limit_hit
        return option

    # solves run in threads, each waiting for its solver process: ``workers`` solver processes
    # run at a time while the main thread decides (and repairs starts for) the next pairs
    repairer = None
    if repair:
        allowed = {(t, k) for t, slots in enumerate(built[0].slots) for k, r in slots if r is not None}
        repairer = ScheduleRepair(graph, allowed, lazy=lazy_recompute, tied=built[0].tied_forwards())
    autograd_computes = [c.name for c in graph.compute_nodes]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        # the repairs' lowest schedules (this thread, while the other bound solves) start the solves
        bounds_solves = []
        for objective in ("peak", "save"):
            descended = repairer.lowest(autograd_computes, objective) if repairer is not None and warm_start else None
            bounds_solves.append(pool.submit(bound, objective, descended))
        # (each the lowest schedule and its option, or None)
        lowest_peak, lowest_save = (f.result() for f in bounds_solves)
        for found in (lowest_peak, lowest_save):
            if found is not None:
                options.append(found[1])
                report.time_limit_hits += int(found[1].time_limit_hit)
        report.bounds_s = time.perf_counter() - start - report.build_s
        min_peak = lowest_peak[1].peak_bytes if lowest_peak else top.peak_bytes
        min_save = lowest_save[1].saved_bytes if lowest_save else top.saved_bytes
        peaks = _linspace(min_peak, top.peak_bytes, peak_steps)
        saves = _linspace(min_save, top.saved_bytes, save_steps)
        peak_range = max(1, top.peak_bytes - min_peak)
        save_range = max(1, top.saved_bytes - min_save)

        # every feasible solution found so far: (computes, option, origin); an option that fits a
        # pair is a feasible start (MIP start) for it, and the best of them is optimal when it is
        # no slower than the solution of a looser pair (a lower bound: tightening never helps).
        # ``origin``: (rank of the pair whose decision or solve found it, -1 for the bounds; its
        # count among that pair's); a pair reads the solutions of looser pairs only, so that what
        # it finds does not depend on which other pairs are done when it is decided
        known: list[tuple[list[str], BlockOption, tuple[int, int]]] = [
            (autograd_computes, top, (-1, 0))]
        for found in (lowest_peak, lowest_save):
            if found is not None:
                known.append((*found, (-1, len(known))))
        grid_options: list[tuple[tuple[int, int], BlockOption]] = []  # the grid's, by origin
        # (peak budget, save budget, near-optimal option, its computes) of pairs answered with a proof
        # (and the rank of the pair, -1 for the autograd schedule)
        answered: list[tuple[int, int, BlockOption, list[str], int]] = [
            (top.peak_bytes, top.saved_bytes, top, known[0][0], -1)]
        infeasible: list[tuple[int, int, int]] = []  # (peak budget, save budget, rank)
        # (peak budget, save budget, start, rank) of the neighbourhood solves that found nothing
        # better than their start: a tighter pair's neighbourhood of the same start has nothing better
        exhausted: list[tuple[int, int, tuple[str, ...], int]] = []
        stalls = 0  # solves that hit their time limit and returned their start unchanged

        # a save budget above the peak budget is the peak budget; equal pairs are solved once
        grid = [(peak, min(save, peak)) for peak in peaks for save in saves]
        report.pairs += len(grid)
        report.reused += len(grid) - len(set(grid))
        order = sorted(set(grid), key=lambda q: (-q[0], -q[1]))  # every looser pair before a pair
        rank = {q: i for i, q in enumerate(order)}
        looser = {q: [r for r in order if r != q and r[0] >= q[0] and r[1] >= q[1]] for q in order}
        tighter: dict[tuple[int, int], list[tuple[int, int]]] = {q: [] for q in order}
        for q in order:
            for r in looser[q]:
                tighter[r].append(q)
        waiting_for = {q: len(looser[q]) for q in order}
        # the pair after each pair in its row (the same peak budget, the next save budget down) and
        # the one before; ``unseen``: pair -> the rank of the pair before it in its row, where it
        # is decided beside that pair's solve, without its results (OVERLAP_ROW_SOLVES_FROM)
        row_after: dict[tuple[int, int], tuple[int, int]] = {}
        for q in order:
            row = [r for r in looser[q] if r[0] == q[0]]
            if row:
                row_after[min(row, key=lambda r: r[1])] = q
        row_before = {after: q for q, after in row_after.items()}
        unseen: dict[tuple[int, int], int] = {}
        started: set[tuple[int, int]] = set()  # the pairs whose solve started
        found_before_solve: dict[int, int] = {}  # pair rank -> solutions it found before its solve
        overlap = OVERLAP_ROW_SOLVES_FROM is not None and built[0].n_binaries >= OVERLAP_ROW_SOLVES_FROM
        found_by: dict[int, int] = {}  # pair rank -> solutions it found so far

        def remember(computes: list[str], option: BlockOption, q: tuple[int, int]) -> None:
            count = found_by.get(rank[q], 0)
            found_by[rank[q]] = count + 1
            known.append((computes, option, (rank[q], count)))
            grid_options.append(((rank[q], count), option))

        def from_looser(origin: tuple[int, int], q: tuple[int, int]) -> bool:
            """Whether pair ``q`` reads the solution of ``origin``: found by a looser pair, and
            not by the solve of the pair ``q`` is decided without (its repairs, made before its
            solve, are read)."""
            return origin[0] < 0 or (order[origin[0]][0] >= q[0] and order[origin[0]][1] >= q[1]
                                     and (origin[0] != unseen.get(q) or origin[1] < found_before_solve[origin[0]]))

        def seen(rank_of: int, q: tuple[int, int]) -> bool:
            """Whether pair ``q`` reads the answer, infeasibility or searched neighbourhood of the
            pair of rank ``rank_of`` (all found by its solve)."""
            return rank_of != unseen.get(q)

        def excess(option: BlockOption, peak: int, save: int) -> float:
            """How far ``option`` is from fitting (peak, save), relative to the grid's ranges."""
            return max(0, option.peak_bytes - peak) / peak_range + max(0, option.saved_bytes - save) / save_range

        def repaired_start(peak: int, save: int, best, bound: float | None):
            """The best of ``best`` and of the repairs of the nearest looser answers (each better
            repair is kept as a known solution and an option)."""
            looser_answers = sorted(
                (a for a in answered if peak <= a[0] and save <= a[1] and excess(a[2], peak, save) > 0
                 and seen(a[4], (peak, save))),
                key=lambda a: ((a[0] - peak) / peak_range + (a[1] - save) / save_range, -a[0], -a[1]))
            began = time.thread_time()

            def better(computes: list[str]) -> bool:
                """Repair ``computes``; whether that bettered ``best`` (then kept)."""
                nonlocal best
                found = repairer.repair(computes, peak, save)
                if found is None or (best is not None and found[1].time_s >= best[1].time_s):
                    return False
                best = found
                remember(*found, (peak, save))
                report.repaired += 1
                return True

            for tried, (_, _, _, computes, _) in enumerate(looser_answers):
                if tried >= REPAIR_SEEDS and (best is not None or tried >= REPAIR_SEEDS_WITHOUT_START):
                    break
                if better(computes) and bound is not None and best[1].time_s <= bound * (1 + accept):
                    break  # optimal: no need for another seed
            if best is None and REPAIR_FROM_KNOWN:
                # no proven looser pair gives a start: repair the known solutions of looser
                # pairs (those of solves stopped by their limit too), the nearest to fitting first
                nearest = sorted((entry for entry in known if from_looser(entry[2], (peak, save))),
                                 key=lambda entry: (excess(entry[1], peak, save), entry[2]))
                for computes, _, _ in nearest[:REPAIR_SEEDS_WITHOUT_START]:
                    better(computes)
            report.repair_s += time.thread_time() - began
            return best

        def decide(q: tuple[int, int]):
            """Answer pair ``q`` from the looser pairs' results (None), or start its solve:
            (the start given, the solve's future)."""
            peak, save = q
            if any(peak <= p and save <= s and seen(r, q) for p, s, r in infeasible):
                report.pruned_infeasible += 1
                return None
            fitting = [entry for entry in known if entry[1].peak_bytes <= peak and entry[1].saved_bytes <= save
                       and from_looser(entry[2], q)]
            best = min(fitting, key=lambda entry: (entry[1].time_s, entry[2]), default=None)
            best = None if best is None else best[:2]
            bound = max((o.time_s for p, s, o, _, r in answered if peak <= p and save <= s and seen(r, q)),
                        default=None)
            if best is not None and bound is not None and best[1].time_s <= bound * (1 + accept):
                report.reused += 1
                return None
            if repairer is not None:
                best = repaired_start(peak, save, best, bound)
                if best is not None and bound is not None and best[1].time_s <= bound * (1 + accept):
                    report.reused += 1
                    answered.append((peak, save, best[1], best[0], rank[q]))
                    return None
            if grid_time_limit_s is not None and time.perf_counter() - start > grid_time_limit_s:
                report.grid_limit_skipped += 1  # the best fitting option (if any) is already kept
                return None
            kwargs = {"start": best[0] if best is not None and warm_start else None}
            if best is not None and stalled_solves is not None and stalls >= stalled_solves:
                if neighbourhood_flips is None or ilp_solver != "highs":
                    report.stall_skipped += 1  # its start is already an option
                    return None
                start_key = tuple(best[0])
                if SKIP_SEARCHED_NEIGHBOURHOODS and any(peak <= p and save <= s and start_key == start_of
                                                        and seen(r, q) for p, s, start_of, r in exhausted):
                    report.neighbourhood_skipped += 1  # its neighbourhood was searched at a looser pair
                    return None
                report.neighbourhood_solves += 1
                kwargs = {"start": best[0], "flips": neighbourhood_flips}
            return best, pool.submit(solve_one, peak, save, kwargs)

        def conclude(q: tuple[int, int], best, solution) -> None:
            nonlocal stalls
            peak, save = q
            report.solved += 1
            option = measured(solution, f"peak<={peak}, save<={save}")
            searched = not solution.time_limit_hit and solution.neighbourhood
            if searched and (option is None or best[1].time_s <= option.time_s):
                # nothing better than the start in its neighbourhood: nor at tighter pairs
                exhausted.append((peak, save, tuple(best[0]), rank[q]))
            if option is None:
                if solution.time_limit_hit:
                    report.time_limit_hits += 1
                elif not solution.neighbourhood:  # (an empty neighbourhood proves nothing else)
                    infeasible.append((peak, save, rank[q]))
                return
            report.time_limit_hits += int(option.time_limit_hit)
            computes = solution.computes
            if solution.time_limit_hit and best is not None and best[1].time_s <= option.time_s:
                stalls += 1
            if best is not None and best[1].time_s < option.time_s:
                computes, option = best  # the solver stopped (time limit, gap) above the start
            else:
                remember(computes, option, q)
            if not solution.time_limit_hit and not solution.neighbourhood:  # a proof: a bound for tighter pairs
                answered.append((peak, save, option, computes, rank[q]))

        # each pair is decided once every looser pair is done (answered, solved or pruned), from
        # their results alone: the options do not depend on ``workers`` or on the solves' timing
        # (unless a solve hits its time limit, which is wall-clock time), and a pair's solve
        # starts as soon as its looser pairs are done, beside the solves of other pairs
        ready = [q for q in order if waiting_for[q] == 0]
        running: dict = {}  # future -> (pair, its start)

        def release(t: tuple[int, int]) -> None:
            waiting_for[t] -= 1
            if waiting_for[t] == 0:
                ready.append(t)

        def done(q: tuple[int, int]) -> None:
            for t in tighter[q]:
                if unseen.get(t) != rank[q]:  # (else released when its solve started)
                    release(t)

        while ready or running:
            while ready:
                ready.sort(key=rank.get)
                q = ready.pop(0)
                task = decide(q)
                if task is None:
                    done(q)
                else:
                    running[task[1]] = (q, task[0])
                    started.add(q)
                    found_before_solve[rank[q]] = found_by.get(rank[q], 0)
                    after = row_after.get(q)
                    if overlap and after is not None and row_before.get(q) in started:
                        unseen[after] = rank[q]
                        report.overlapped += 1
                        release(after)
            if running:
                finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for future in sorted(finished, key=lambda f: rank[running[f][0]]):
                    q, best = running.pop(future)
                    conclude(q, best, future.result())
                    done(q)
        options.extend(option for _, option in sorted(grid_options, key=lambda entry: entry[0]))
        if repairer is not None and repairer.mismatches:
            report.notes.append(f"{repairer.mismatches} repaired schedules measured otherwise by the simulator "
                                "than by the repairs' figures (dropped)")
    report.grid_s = time.perf_counter() - start - report.build_s - report.bounds_s
    front = pareto_front(options)
    report.total_s = time.perf_counter() - start
    return ClassOptions(
        graph=graph,
        options=front,
        no_grad=no_grad_forward(graph),
        solve_time_s=report.total_s,
        notes=[
            f"{report.pairs} pairs: {report.solved} solved, {report.reused} reused, "
            f"{report.pruned_infeasible} infeasible by dominance, {report.time_limit_hits} time limits hit, "
            f"{report.repaired} repaired starts"
            + (f", {report.grid_limit_skipped} left by the grid time limit" if report.grid_limit_skipped else "")
            + (f", {report.stall_skipped} kept their start (stalled solves)" if report.stall_skipped else "")
            + (f", {report.neighbourhood_solves} solved in their start's neighbourhood (stalled solves)"
               if report.neighbourhood_solves else "")
            + (f", {report.neighbourhood_skipped} whose start's neighbourhood a looser pair had searched"
               if report.neighbourhood_skipped else "")
        ],
    )
