"""The rk-Checkmate ILP of real blocks solved by each backend: CBC (through pulp) and HiGHS (in the
process, `solvers.highs_model`),
CP-SAT and SCIP (through OR-Tools' model builder).

    .venv/bin/python benchmarks/bench_ilp_backends.py                # GPT-2 and Llama attention
    .venv/bin/python benchmarks/bench_ilp_backends.py --limit 10     # seconds per solve

For the biggest class of each model (its attention block, from a tiny transformers config),
the same ILPs as an option grid solves: the minimum peak (objective "peak"), then the
recomputation time at peak budgets between that minimum and the no-recomputation peak
(objective "time", 1% gap). Prints each backend's seconds and objective per solve, the total,
and the objective's gap to the best backend's (quality must not drop for speed). One intra-op
thread, one solver thread.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path

try:  # before pulp: OR-Tools' bundled HiGHS and highspy's clash in one process (the one
    # imported first wins); pulp's HiGHS is then unavailable
    from ortools.linear_solver.python import model_builder  # noqa: F401
except ImportError:
    pass
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from bench_planning import _transformers_model  # noqa: E402
from rockmate.api import BuildOptions, _build_graphs, _flat_call  # noqa: E402
from solvers.block_options import autograd_option  # noqa: E402
from solvers.checkmate_ilp import RkCheckmateILP, highs_available, ortools_available  # noqa: E402


def biggest_class(name: str):
    model, call = _transformers_model(name)
    _, module, flat = _flat_call(model, call, None, None)
    graphs = _build_graphs(module, flat, BuildOptions(cost_model="flops"))
    chain = graphs.model_chain
    return max(chain.classes, key=lambda graph: len(graph.compute_nodes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=["gpt2", "llama"])
    parser.add_argument("--limit", type=float, default=30.0, help="seconds per solve")
    parser.add_argument("--pairs", type=int, default=4, help="time-objective solves per model")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    backends = ["cbc"] + (["highs"] if highs_available() else []) + \
        [b for b in ("cpsat", "scip") if ortools_available(b)]
    for name in args.models:
        graph = biggest_class(name)
        top = autograd_option(graph)
        # a unit that divides every size: integral coefficients (CP-SAT's integer model)
        unit = 0
        for size in [d.size_bytes for d in graph.data_nodes] + \
                [c.overhead(w) for c in graph.compute_nodes for w in (False, True)]:
            unit = math.gcd(unit, int(size))
        unit = max(1, unit)
        print(f"\n{name}: class of {len(graph.compute_nodes)} compute nodes, no-recomputation peak "
              f"{top.peak_bytes} B; {args.limit:.0f} s per solve")
        models = {b: RkCheckmateILP(graph, lazy_recompute=True, memory_unit_bytes=unit) for b in backends}
        results: dict[str, list[tuple[float, float | None]]] = {b: [] for b in backends}
        low = None
        solves = [("peak", None)]
        for b in backends:  # the minimum peak, each backend's own
            t0 = time.perf_counter()
            solution = models[b].solve(None, objective="peak", time_limit_s=args.limit, solver=b, gap=0.0)
            results[b].append((time.perf_counter() - t0, solution.objective if solution.feasible else None))
            if solution.feasible:
                peak = solution.objective * unit
                low = peak if low is None else min(low, peak)
        budgets = [low + (top.peak_bytes - low) * (i + 1) / (args.pairs + 1) for i in range(args.pairs)]
        for budget in budgets:
            solves.append(("time", budget))
            for b in backends:
                t0 = time.perf_counter()
                solution = models[b].solve(budget, objective="time", time_limit_s=args.limit, solver=b, gap=0.01)
                results[b].append((time.perf_counter() - t0, solution.objective if solution.feasible else None))
        header = "solve".ljust(22) + "".join(b.rjust(22) for b in backends)
        print(header)
        for i, (objective, budget) in enumerate(solves):
            label = "min peak" if objective == "peak" else f"time @ {budget / 1024:.0f} KiB"
            cells = []
            values = [results[b][i][1] for b in backends if results[b][i][1] is not None]
            best = min(values) if values else None
            for b in backends:
                seconds, value = results[b][i]
                gap = "" if value is None or not best else f" {100 * (value - best) / abs(best):+.1f}%"
                cells.append((f"{seconds:6.2f} s" + (gap if value is not None else " none")).rjust(22))
            print(label.ljust(22) + "".join(cells))
        totals = "".join(f"{sum(s for s, _ in results[b]):8.1f} s".rjust(22) for b in backends)
        print("total".ljust(22) + totals)


if __name__ == "__main__":
    main()
