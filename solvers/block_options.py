"""The options of a class of blocks: rk-Checkmate solved for a grid of (peak, save) budgets.

Rockmate (Zhao et al., ICML 2023, section 4.1) solves each distinct block for a grid of peak
budgets and save budgets, between the block's minimum and what it needs without any
recomputation. The published implementation solves every pair; here most pairs are answered
without a solve:

1. the bounds of the grid come from three solves: the autograd schedule (no recomputation,
   the top corner), the smallest peak, the smallest saved memory;
2. pairs are visited from the loosest to the tightest. The optimal time of a looser pair is a
   lower bound for a tighter one, and every solution found so far whose measured (peak, saved)
   fits the pair is feasible for it: when the best of those is no slower than the bound, the
   pair is answered without solving (this covers "the solution of a looser pair still fits");
   otherwise it is the MIP start of the solve (CBC). A pair tighter than an infeasible one is
   infeasible;
3. pairs with a save budget above the peak budget are the same as save = peak;
4. each ILP has a time limit and keeps its best feasible solution;
5. equal solutions are merged and dominated ones dropped (:func:`pareto_front`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rkgb.cdgraph import CDGraph
from solvers.checkmate_ilp import RkCheckmateILP
from solvers.options import BlockOption, ClassOptions, autograd_option, no_grad_forward, option_from_computes

__all__ = ["GridReport", "solve_class_options", "pareto_front"]


@dataclass
class GridReport:
    """How the grid was solved: what the benchmark prints."""

    pairs: int = 0
    solved: int = 0
    reused: int = 0
    pruned_infeasible: int = 0
    time_limit_hits: int = 0
    grid_limit_skipped: int = 0
    build_s: float = 0.0
    bounds_s: float = 0.0
    grid_s: float = 0.0
    total_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def pareto_front(options: list[BlockOption]) -> list[BlockOption]:
    """Merge equal options and drop dominated ones (keeps the first of equals)."""
    unique: dict[tuple, BlockOption] = {}
    for o in options:
        unique.setdefault(o.key(), o)
    kept = list(unique.values())
    front = [o for o in kept if not any(p is not o and p.dominates(o) and p.key() != o.key() for p in kept)]
    return sorted(front, key=lambda o: (o.saved_bytes, o.peak_bytes, o.time_s))


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
    ilp_solver: str = "cbc",
    forward_recompute: bool = True,
    lazy_recompute: bool = False,
    gap: float = 0.0,
    warm_start: bool = True,
    grid_time_limit_s: float | None = None,
    report: GridReport | None = None,
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
        ``"cbc"`` (bundled with pulp) or ``"highs"`` (``highspy``).
    gap
        Relative optimality gap accepted from the ILP solver (0: proven optimal).
    warm_start
        Give CBC the best known solution that fits a pair as its first incumbent.
    grid_time_limit_s
        Stop solving new pairs after this long (the options found so far are kept; the
        report counts the pairs left unsolved).

    Returns
    -------
    ClassOptions, whose options always include the autograd option (no recomputation).
    """
    report = report if report is not None else GridReport()
    start = time.perf_counter()
    top = autograd_option(graph)
    options = [top]
    unit = max(1.0, top.peak_bytes / 1000.0)
    ilp = RkCheckmateILP(graph, forward_recompute=forward_recompute, lazy_recompute=lazy_recompute,
                         memory_unit_bytes=unit)
    report.build_s = time.perf_counter() - start

    def measured(solution, source: str) -> BlockOption | None:
        if not solution.feasible:
            return None
        option = option_from_computes(graph, solution.computes, source=source)
        option.time_limit_hit = solution.time_limit_hit
        return option

    peak_solution = ilp.solve(None, None, objective="peak", time_limit_s=time_limit_s, solver=ilp_solver, gap=gap)
    save_solution = ilp.solve(None, None, objective="save", time_limit_s=time_limit_s, solver=ilp_solver, gap=gap)
    lowest_peak = measured(peak_solution, "min peak")
    lowest_save = measured(save_solution, "min save")
    for o in (lowest_peak, lowest_save):
        if o is not None:
            options.append(o)
            report.time_limit_hits += int(o.time_limit_hit)
    report.bounds_s = time.perf_counter() - start - report.build_s
    min_peak = lowest_peak.peak_bytes if lowest_peak else top.peak_bytes
    min_save = lowest_save.saved_bytes if lowest_save else top.saved_bytes
    peaks = _linspace(min_peak, top.peak_bytes, peak_steps)
    saves = _linspace(min_save, top.saved_bytes, save_steps)

    # every feasible solution found so far: (computes, option); an option that fits a pair is
    # a feasible start (MIP start) for it, and the best of them is optimal when it is no slower
    # than the solution of a looser pair (a lower bound: tightening budgets never helps)
    known: list[tuple[list[str], BlockOption]] = [([c.name for c in graph.compute_nodes], top)]
    for solution, option in ((peak_solution, lowest_peak), (save_solution, lowest_save)):
        if option is not None:
            known.append((solution.computes, option))
    # (peak budget, save budget, near-optimal option) of pairs answered with a proof
    answered: list[tuple[int, int, BlockOption]] = [(top.peak_bytes, top.saved_bytes, top)]
    infeasible: list[tuple[int, int]] = []
    for peak in sorted(peaks, reverse=True):
        for save in sorted(saves, reverse=True):
            save = min(save, peak)
            report.pairs += 1
            if any(peak <= p and save <= s for p, s in infeasible):
                report.pruned_infeasible += 1
                continue
            fitting = [(c, o) for c, o in known if o.peak_bytes <= peak and o.saved_bytes <= save]
            best = min(fitting, key=lambda co: co[1].time_s, default=None)
            bounds = [o.time_s for p, s, o in answered if peak <= p and save <= s]
            if best is not None and bounds and best[1].time_s <= max(bounds) * (1 + 1e-9):
                report.reused += 1
                continue
            if grid_time_limit_s is not None and time.perf_counter() - start > grid_time_limit_s:
                report.grid_limit_skipped += 1  # the best fitting option (if any) is already kept
                continue
            solution = ilp.solve(peak, save, time_limit_s=time_limit_s, solver=ilp_solver, gap=gap,
                                 start=best[0] if best is not None and warm_start else None)
            report.solved += 1
            option = measured(solution, f"peak<={peak}, save<={save}")
            if option is None:
                if not solution.time_limit_hit:
                    infeasible.append((peak, save))
                else:
                    report.time_limit_hits += 1
                continue
            report.time_limit_hits += int(option.time_limit_hit)
            if best is not None and best[1].time_s < option.time_s:
                option = best[1]  # the solver stopped (time limit, gap) above the start
            else:
                known.append((solution.computes, option))
                options.append(option)
            if not option.time_limit_hit:
                answered.append((peak, save, option))
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
            f"{report.pruned_infeasible} infeasible by dominance, {report.time_limit_hits} time limits hit"
            + (f", {report.grid_limit_skipped} left by the grid time limit" if report.grid_limit_skipped else "")
        ],
    )
