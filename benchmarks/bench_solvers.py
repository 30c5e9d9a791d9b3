"""Benchmarks of the solvers (not timed tests): the DP, the option grid, plan quality.

Run ``python benchmarks/bench_solvers.py [--quick | --grids-only]``. Every function takes plain data (a
ModelChain or ChainCosts), so the real GPT chains from rkgb can be plugged in:
``bench_option_grid(chain)``, ``bench_quality(layers)`` (the real GPT chains of rkgb,
flops cost model), ``bench_attention_grids()``.
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rkgb.cdgraph import ModelChain  # noqa: E402
from solvers import (  # noqa: E402
    BlockCosts,
    ChainCosts,
    CheckmateSolver,
    GridReport,
    OptionCosts,
    RockmateSolver,
    RotorSolver,
    simulate,
    solve_chain,
    highs_available,
    solve_class_options,
)
from solvers.bounds import operation_floor  # noqa: E402
from solvers.registry import no_recompute_schedule  # noqa: E402
from solvers.toy_graphs import attention_like_graph, chain_of  # noqa: E402

MiB = 1 << 20


def random_costs(rng: random.Random, n_blocks: int, n_options: int, identical: bool = False) -> ChainCosts:
    """Synthetic DP input: ``n_blocks`` blocks of ``n_options`` Pareto-like options each."""

    def block(key) -> BlockCosts:
        options = []
        for i in range(n_options):
            saved = int(100 * MiB * (i + 1) / n_options)
            options.append(OptionCosts(saved + 40 * MiB, saved + 60 * MiB, saved, 8 * MiB,
                                       1.0 + rng.random() * (n_options - i) / n_options, 2.0))
        return BlockCosts(options, no_grad_peak=30 * MiB, no_grad_time=1.0, output_bytes=8 * MiB,
                          output_grad_bytes=8 * MiB, class_key=key)

    if identical:
        one = block(0)
        return ChainCosts([one] * n_blocks)
    return ChainCosts([block(i) for i in range(n_blocks)])


def bench_dp(repeat: int = 3) -> None:
    rng = random.Random(0)
    for n, options, identical in ((26, 30, False), (256, 5, True), (256, 30, True)):
        costs = random_costs(rng, n, options, identical)
        top = sum(o.options[-1].saved for o in costs.blocks) + 200 * MiB
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            strategy = solve_chain(costs, top // 3, slots=500)
            best = min(best, time.perf_counter() - start)
        kind = "identical" if identical else "distinct"
        print(f"DP {n:4d} {kind} blocks x {options:2d} options x 500 slots: {best:6.3f} s "
              f"(feasible: {strategy is not None})")


def _cpu() -> tuple[float, float]:
    """CPU seconds of this process and of its finished children (the CBC processes)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time(), children.ru_utime + children.ru_stime


def bench_option_grid(chain: ModelChain, peak_steps: int = 10, save_steps: int = 10,
                      ilp_solver: str = "cbc", time_limit_s: float = 2.0, **settings) -> None:
    """Solve time of each class's option grid, per phase (settings: RockmateSolver's defaults).

    Wall-clock seconds, and CPU seconds of Python and of the solver processes (CBC runs as a
    subprocess; HiGHS in this process): on a shared machine the CPU seconds are the steadier
    figure. No option cache is involved.
    """
    defaults = dict(forward_recompute=False, lazy_recompute=True, gap=0.01, workers=2)
    defaults.update(settings)
    for index, graph in enumerate(chain.classes):
        report = GridReport()
        wall = time.perf_counter()
        own, children = _cpu()
        options = solve_class_options(graph, peak_steps=peak_steps, save_steps=save_steps,
                                      ilp_solver=ilp_solver, time_limit_s=time_limit_s, report=report,
                                      **defaults)
        wall = time.perf_counter() - wall
        own_end, children_end = _cpu()
        print(f"class {index} ({graph.name}, {len(graph.compute_nodes)} C-nodes, {ilp_solver}, "
              f"{defaults['workers']} workers): {wall:.2f} s wall, CPU {own_end - own:.2f} s Python + "
              f"{children_end - children:.2f} s solver processes; build {report.build_s:.2f} + bounds "
              f"{report.bounds_s:.2f} + grid {report.grid_s:.2f} (repairs {report.repair_s:.2f} s CPU); "
              f"{report.pairs} pairs: {report.solved} solved, {report.reused} reused, "
              f"{report.pruned_infeasible} pruned; {report.repaired} repaired starts; "
              f"{report.time_limit_hits} time limits; {len(options.options)} options")


def gpt_like_chain(layers: int, seq: int = 256, batch: int = 4) -> ModelChain:
    """A synthetic GPT-like chain (toy graphs, no torch)."""
    block = attention_like_graph(batch=batch, seq=seq, name="gpt_block")
    return chain_of([block], [0] * layers)


def real_gpt_chain(layers: int | None = None, preset: str | None = None) -> ModelChain:
    """The chain rkgb builds for the test zoo's GPT (flops cost model): ``layers`` layers of the
    tiny GPT (d=32, 4 heads, seq 16), or ``preset="bench"`` (4 layers, d=256, seq 128, batch 4)."""
    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root), str(root / "tests")]
    from rkgb.build import build
    from zoo import ZOO

    model, sample = ZOO["gpt"].build(preset) if preset else ZOO["gpt"].build(n_layer=layers)
    return build(model, sample, cost_model="flops").model_chain


def attention_class(chain: ModelChain) -> int:
    """Index of the class with the most compute nodes (the attention sub-block of a GPT)."""
    return max(range(len(chain.classes)), key=lambda i: len(chain.classes[i].compute_nodes))


def bench_quality(layers_list=(2, 3, 4), fractions=(0.5, 0.6, 0.7, 0.8, 0.9),
                  checkmate_time_limit_s: float = 30.0, ilp_solver: str = "cbc") -> None:
    """Rockmate against whole-graph Checkmate and Rotor on the real GPT chains (rkgb, flops).

    Budgets are fractions of the no-recomputation peak; times are the simulator's predictions.
    """
    for layers in layers_list:
        start = time.perf_counter()
        chain = real_gpt_chain(layers)
        build_s = time.perf_counter() - start
        rockmate, rotor = RockmateSolver(ilp_solver=ilp_solver, cache=None), RotorSolver()
        checkmate = CheckmateSolver(time_limit_s=checkmate_time_limit_s, ilp_solver=ilp_solver)
        top = simulate(chain.whole_graph(), no_recompute_schedule(chain)).peak_bytes
        start = time.perf_counter()
        rockmate.chain_costs(chain)
        options_s = time.perf_counter() - start
        start = time.perf_counter()
        rk_min = rockmate.min_budget(chain)
        rk_min_s = time.perf_counter() - start
        ro_min = rotor.min_budget(chain)
        start = time.perf_counter()
        cm_min = checkmate.min_budget(chain)
        cm_min_s = time.perf_counter() - start
        print(f"GPT {layers} layers ({len(chain.blocks)} blocks, {len(chain.classes)} classes): no-recompute peak "
              f"{top} B; build {build_s:.1f} s; rockmate options {options_s:.1f} s, min budget {rk_min_s:.2f} s; "
              f"checkmate min budget {cm_min_s:.1f} s")
        for index, report in sorted(rockmate.reports.items()):
            graph = chain.classes[index]
            print(f"  class {index} ({len(graph.compute_nodes)} C-nodes): grid {report.total_s:.2f} s "
                  f"(bounds {report.bounds_s:.2f} + pairs {report.grid_s:.2f}); {report.pairs} pairs, "
                  f"{report.solved} solved, {report.reused} reused, {report.time_limit_hits} time limits")
        floor = operation_floor(chain.whole_graph())
        print(f"  min budget / top: rockmate {rk_min / top:.3f}, rotor {ro_min / top:.3f}, checkmate "
              f"{cm_min / top:.3f}; rockmate / rotor = {rk_min / ro_min:.3f}")
        print(f"  operation floor (no plan of these ops goes lower): {floor.bytes / top:.3f} of top, set by "
              f"{floor.node}; floor / rotor = {floor.bytes / ro_min:.3f}, rockmate / floor = {rk_min / floor.bytes:.3f}")
        print("  budget/top | rockmate ms | checkmate ms       | rotor ms | rk/cm  | rk plan s | cm plan s | "
              "checkmate from rockmate's plan ms | rk/that")
        for fraction in fractions:
            budget = int(fraction * top)
            a = rockmate.solve(chain, budget)
            c = checkmate.solve(chain, budget)
            r = rotor.solve(chain, budget)

            def ms(plan):
                return f"{plan.predicted_time * 1e3:.5f}" if plan.feasible else "infeasible"

            ratio = a.predicted_time / c.predicted_time if c.feasible and a.feasible else float("nan")
            limit = " (limit)" if c.time_limit_hit else ""
            # the same ILP given Rockmate's plan as its first incumbent: how much better a whole-graph
            # plan the time limit finds, starting from Rockmate's
            w = checkmate.solve(chain, budget, start_schedule=a.schedule) if a.feasible else c
            warm = a.predicted_time / w.predicted_time if w.feasible and a.feasible else float("nan")
            limit_w = " (limit)" if w.time_limit_hit else ""
            print(f"  {fraction:10.2f} | {ms(a):>11} | {ms(c) + limit:>18} | {ms(r):>8} | {ratio:.4f} | "
                  f"{a.solve_time_s:9.2f} | {c.solve_time_s:9.1f} | {ms(w) + limit_w:>33} | {warm:.4f}")


def bench_attention_grids(solvers=("cbc", "highs"), **settings) -> None:
    """The option grid (10 x 10) of the attention class, tiny GPT (2 layers) and bench GPT."""
    for label, chain in (("tiny GPT", real_gpt_chain(2)), ("bench GPT", real_gpt_chain(preset="bench"))):
        index = attention_class(chain)
        for solver in solvers:
            if solver == "highs" and not highs_available():
                continue
            print(f"{label}, attention class:", end=" ")
            bench_option_grid(ModelChain_of(chain, index), ilp_solver=solver, **settings)


def ModelChain_of(chain: ModelChain, index: int):
    """A view of ``chain`` with only class ``index`` (what bench_option_grid iterates)."""

    class _One:
        classes = [chain.classes[index]]

    return _One()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="skip the quality table")
    parser.add_argument("--grids-only", action="store_true",
                        help="only the attention-class option grids (no DP, no quality table)")
    parser.add_argument("--grid-solvers", default="cbc,highs",
                        help="ILP solvers of the option grids (comma-separated; highs when installed)")
    parser.add_argument("--workers", type=int, default=2, help="ILPs of a grid solved at the same time")
    parser.add_argument("--no-repair", action="store_true", help="grids without repaired MIP starts")
    parser.add_argument("--ilp-solver", default="cbc", choices=["cbc", "highs"])
    parser.add_argument("--layers", default="2,3,4", help="GPT layers of the quality table")
    parser.add_argument("--checkmate-time-limit", type=float, default=30.0)
    args = parser.parse_args()
    grid_settings = {"workers": args.workers, "repair": not args.no_repair}
    if not args.grids_only:
        bench_dp()
    bench_attention_grids(tuple(args.grid_solvers.split(",")), **grid_settings)
    if not (args.quick or args.grids_only):
        bench_quality(tuple(int(x) for x in args.layers.split(",")), ilp_solver=args.ilp_solver,
                      checkmate_time_limit_s=args.checkmate_time_limit)


if __name__ == "__main__":
    main()
