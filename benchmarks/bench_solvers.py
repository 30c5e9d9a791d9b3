"""Benchmarks of the solvers (not timed tests): the DP, the option grid, plan quality.

Run ``python benchmarks/bench_solvers.py [--quick]``. Every function takes plain data (a
ModelChain or ChainCosts), so the real GPT chains from rkgb can be plugged in:
``bench_option_grid(chain)``, ``bench_quality(make_chain, layers)``.
"""

from __future__ import annotations

import argparse
import random
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
    solve_class_options,
)
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


def bench_option_grid(chain: ModelChain, peak_steps: int = 10, save_steps: int = 10,
                      ilp_solver: str = "cbc", time_limit_s: float = 2.0, **settings) -> None:
    """Solve time of each class's option grid, per phase (settings: RockmateSolver's defaults)."""
    defaults = dict(forward_recompute=False, lazy_recompute=True, gap=0.01)
    defaults.update(settings)
    for index, graph in enumerate(chain.classes):
        report = GridReport()
        options = solve_class_options(graph, peak_steps=peak_steps, save_steps=save_steps,
                                      ilp_solver=ilp_solver, time_limit_s=time_limit_s, report=report,
                                      **defaults)
        print(f"class {index} ({graph.name}, {len(graph.compute_nodes)} C-nodes, {ilp_solver}): "
              f"{report.total_s:.2f} s total = build {report.build_s:.2f} + bounds {report.bounds_s:.2f} "
              f"+ grid {report.grid_s:.2f}; {report.pairs} pairs: {report.solved} solved, "
              f"{report.reused} reused, {report.pruned_infeasible} pruned; "
              f"{report.time_limit_hits} time limits; {len(options.options)} options")


def gpt_like_chain(layers: int, seq: int = 256, batch: int = 4) -> ModelChain:
    block = attention_like_graph(batch=batch, seq=seq, name="gpt_block")
    return chain_of([block], [0] * layers)


def bench_quality(layers_list=(2, 3, 4), checkmate_time_limit_s: float = 120.0) -> None:
    """Rockmate against whole-graph Checkmate and Rotor on GPT-like chains."""
    for layers in layers_list:
        chain = gpt_like_chain(layers)
        rockmate, rotor = RockmateSolver(), RotorSolver()
        checkmate = CheckmateSolver(time_limit_s=checkmate_time_limit_s)
        top = simulate(chain.whole_graph(), no_recompute_schedule(chain)).peak_bytes
        start = time.perf_counter()
        rk_min = rockmate.min_budget(chain)
        rk_time = time.perf_counter() - start
        ro_min = rotor.min_budget(chain)
        print(f"GPT-like {layers} layers: no-recompute peak {top / MiB:.0f} MiB; min budget rockmate "
              f"{rk_min / MiB:.0f} MiB, rotor {ro_min / MiB:.0f} MiB (ratio {rk_min / ro_min:.2f}); "
              f"rockmate options in {rk_time:.1f} s")
        print("  budget MiB | rockmate time | checkmate time | rotor time | rk/cm")
        for fraction in (0.5, 0.65, 0.8, 1.0):
            budget = int(rk_min + fraction * (top - rk_min))
            a = rockmate.solve(chain, budget)
            c = checkmate.solve(chain, budget)
            r = rotor.solve(chain, budget)
            ratio = a.predicted_time / c.predicted_time if c.feasible and a.feasible else float("nan")
            print(f"  {budget / MiB:10.0f} | {a.predicted_time * 1e3:11.3f}ms | "
                  f"{c.predicted_time * 1e3 if c.feasible else float('nan'):12.3f}ms"
                  f"{' (limit)' if c.time_limit_hit else ''} | "
                  f"{r.predicted_time * 1e3 if r.feasible else float('nan'):8.3f}ms | {ratio:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="skip the quality table")
    parser.add_argument("--ilp-solver", default="cbc", choices=["cbc", "highs"])
    args = parser.parse_args()
    bench_dp()
    bench_option_grid(gpt_like_chain(1), ilp_solver=args.ilp_solver)
    if not args.quick:
        bench_quality()


if __name__ == "__main__":
    main()
