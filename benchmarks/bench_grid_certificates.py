"""What an option grid's certificates cost: the floor of a class's grid time with this ILP.

An option of the grid is certified within the grid's gap (1%) of its pair's optimum: by a
looser pair's optimum (tightening never helps) or by a solve of its own, whose proof is the
solver's bound. This benchmark solves the largest class of a model (or ``--class``) as
``Rockmate`` does, records every ILP solve (:class:`solvers.block_options.SolveRecord`), and
prints:

1. the pairs that need a certificate of their own: those whose optimum (the block's time, as
   the grid compares them) is more than the gap above every looser solved pair's (no grid
   order, repair or bound from the grid's other pairs can answer them);
2. what those pairs' options would lose without their solve: the best schedule known before it
   (the repairs' start) against the solve's, in the block's time;
3. the certificates' own cost: the bound solves (min peak, min save) and those pairs' solves
   again, each with its own result given as the start (the optimum known, only the proof
   left), summed on one core, and that sum over the grid's workers (a floor on the grid's wall
   time with this formulation and backend, before the models' build and the repairs).

    .venv/bin/python benchmarks/bench_grid_certificates.py                 # the tiny Llama
    .venv/bin/python benchmarks/bench_grid_certificates.py --models llama-12 gpt2

Models as in ``bench_planning.py`` (measured costs, one intra-op thread).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from rockmate import Rockmate  # noqa: E402
from solvers.block_options import GridReport, grid_model, solve_class_options  # noqa: E402
from solvers.options import option_from_computes  # noqa: E402
from solvers.registry import RockmateSolver  # noqa: E402


def class_graphs(name: str):
    """The class graphs of model ``name`` (bench_planning's models), without solving them."""
    import bench_planning

    model, given = bench_planning._model(name)
    os.environ["ROCKMATE_CACHE_DIR"] = "off"
    top = Rockmate(model, **given, budget=10**13, solver="none")
    return top.graphs.model_chain.classes


def certificates(graph, settings: RockmateSolver) -> dict:
    """Solve ``graph``'s grid with ``settings`` and measure its certificates (module docstring)."""
    report = GridReport(solves=[])
    began = time.perf_counter()
    solve_class_options(graph, **settings.grid_arguments(), report=report)
    grid_s = time.perf_counter() - began
    pairs = [s for s in report.solves if s.peak_bytes is not None and s.computes is not None]
    block_time = {id(s): option_from_computes(graph, s.computes).time_s for s in pairs}
    own = [s for s in pairs if not any(
        o is not s and o.peak_bytes >= s.peak_bytes and o.save_bytes >= s.save_bytes
        and block_time[id(o)] * (1 + settings.gap) >= block_time[id(s)] for o in pairs)]
    # the options those pairs would keep without their solve: the start
    losses = [option_from_computes(graph, s.start).time_s / block_time[id(s)] - 1 for s in own if s.start is not None]
    # the bound solves and those pairs' solves again, their own result as the start: the proofs alone
    ilp = grid_model(graph, forward_recompute=settings.forward_recompute, lazy_recompute=settings.lazy_recompute,
                     whole_runs=settings.whole_runs)
    proof_s = 0.0
    for s in report.solves:
        if s.computes is not None and (s.peak_bytes is None or any(s is o for o in own)):
            proof_s += ilp.solve(s.peak_bytes, s.save_bytes, objective=s.objective, time_limit_s=s.time_limit_s,
                                 solver=settings.ilp_solver, gap=s.gap, start=s.computes).solve_time_s
    return dict(grid_s=grid_s, solves=len(report.solves), solve_s=sum(s.seconds for s in report.solves),
                pairs=len(pairs), own=len(own), own_s=sum(s.seconds for s in own),
                lossy=sum(1 for x in losses if x > settings.gap), worst_loss=max(losses, default=0.0),
                proof_s=proof_s, floor_s=proof_s / max(1, settings.workers), build_s=report.build_s,
                repair_s=report.repair_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=["llama"])
    parser.add_argument("--class", dest="class_index", type=int, default=None,
                        help="the class to solve (default: the one of most computes)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    settings = RockmateSolver(cache=None)
    for name in args.models:
        classes = class_graphs(name)
        index = args.class_index if args.class_index is not None else \
            max(range(len(classes)), key=lambda i: len(classes[i].compute_nodes))
        graph = classes[index]
        figures = certificates(graph, settings)
        print(f"{name} class {index} ({len(graph.compute_nodes)} computes): grid {figures['grid_s']:.2f} s, "
              f"{figures['solves']} solves ({figures['solve_s']:.2f} s of the solver)")
        print(f"  pairs needing a certificate of their own: {figures['own']} of the {figures['pairs']} solved "
              f"({figures['own_s']:.2f} s of their solves)")
        print(f"  without their solve (the repairs' start kept): {figures['lossy']} options more than "
              f"{settings.gap:.0%} slower, the worst {figures['worst_loss']:.1%}")
        print(f"  the bounds' and those pairs' solves again from their own result: {figures['proof_s']:.2f} s on one core, "
              f"{figures['floor_s']:.2f} s over {settings.workers} workers (plus the models' build "
              f"{figures['build_s']:.2f} s and the repairs {figures['repair_s']:.2f} s)")


if __name__ == "__main__":
    main()
