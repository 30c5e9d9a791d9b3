"""Every re-materialization method at budgets from its minimum to eager's peak, side by side:
the measured peak (the allocator's), the measured step time (median of interleaved runs) and
the predicted one, with eager PyTorch and ``torch.utils.checkpoint`` around every block (the
rival as its users run it) for reference.

    .venv/bin/python benchmarks/bench_pareto.py                     # zoo GPT, ResNet, RNN
    .venv/bin/python benchmarks/bench_pareto.py --models gpt --steps 9

One intra-op thread, the flops cost model (deterministic plans). Budgets are fractions of
eager's allocator peak; a solver whose minimum is above a budget prints "infeasible" there.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from rkgb.memory import measure_allocator_peak  # noqa: E402
from rockmate import InfeasibleBudget, Rockmate  # noqa: E402
from zoo import ZOO  # noqa: E402

SOLVERS = ["rockmate", "rotor", "sqrt", "articulation", "bptt", "knapsack-dp", "knapsack-greedy", "checkmate-lp"]
FRACTIONS = [1.0, 0.8, 0.6, 0.4]


class _CheckpointEveryBlock(torch.nn.Module):
    """The model with ``torch.utils.checkpoint`` around each of its ``blocks`` (non-reentrant,
    the RNG state preserved: what a user writes)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        for i, block in enumerate(model.blocks):
            model.blocks[i] = _Checkpointed(block)

    def forward(self, *args):
        return self.model(*args)


class _Checkpointed(torch.nn.Module):
    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args):
        return checkpoint(self.block, *args, use_reentrant=False)


_WEIGHTS: dict[tuple, torch.Tensor] = {}


def _loss(output: torch.Tensor) -> torch.Tensor:
    """<output, W>, W drawn once per shape: the loss's own memory is a scalar."""
    flat = output.reshape(-1)
    key = (flat.numel(), flat.dtype)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = torch.randn(flat.numel(), dtype=flat.dtype, generator=torch.Generator().manual_seed(0))
    return torch.dot(flat, _WEIGHTS[key])


def _step(module, sample):
    def run():
        _loss(module(*sample)).backward()

    return run


def _measure(modules: dict[str, torch.nn.Module], sample, steps: int) -> dict[str, tuple[int, float]]:
    """Allocator peak and median step time of each module, runs interleaved."""
    peaks = {name: measure_allocator_peak(_step(m, sample)) for name, m in modules.items()}
    times: dict[str, list[float]] = {name: [] for name in modules}
    for _ in range(steps):
        for name, module in modules.items():
            start = time.perf_counter()
            _step(module, sample)()
            times[name].append(time.perf_counter() - start)
    return {name: (peaks[name], statistics.median(times[name])) for name in modules}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=["gpt", "resnet", "rnn"])
    parser.add_argument("--steps", type=int, default=7)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for name in args.models:
        model, sample = ZOO[name].build()
        sample = sample if isinstance(sample, tuple) else (sample,)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        reference = {"eager": copy.deepcopy(model)}
        if hasattr(model, "blocks"):
            reference["checkpoint every block"] = _CheckpointEveryBlock(copy.deepcopy(model))
        measured = _measure(reference, sample, args.steps)
        eager_peak, eager_time = measured["eager"]
        print(f"\n{name}: eager peak {eager_peak} B, step {eager_time * 1e3:.2f} ms")
        for label, (peak, seconds) in measured.items():
            print(f"  {label:28s} peak {peak / eager_peak:6.3f} of eager's, time {seconds / eager_time:6.3f}x")
        print(f"  {'solver':14s} {'budget':>7s} {'peak (meas.)':>13s} {'time (meas.)':>13s} {'time (pred.)':>13s}")
        for solver in SOLVERS:
            for fraction in FRACTIONS:
                budget = int(eager_peak * fraction)
                try:
                    compiled = Rockmate(copy.deepcopy(model), sample, budget, solver=solver, cost_model="flops")
                except InfeasibleBudget:
                    print(f"  {solver:14s} {fraction:7.2f} {'infeasible':>13s}")
                    continue
                except Exception as error:  # a solver that cannot plan this model (reported, not hidden)
                    print(f"  {solver:14s} {fraction:7.2f} error: {type(error).__name__}: {str(error)[:80]}")
                    continue
                for p in compiled.parameters():
                    p.grad = torch.zeros_like(p)
                both = _measure({solver: compiled, "eager": reference["eager"]}, sample, args.steps)
                peak, seconds = both[solver]
                plan = compiled.plan
                predicted = plan.predicted_time / plan.baseline_time if plan.baseline_time else float("nan")
                print(f"  {solver:14s} {fraction:7.2f} {peak / eager_peak:13.3f} {seconds / both['eager'][1]:12.3f}x "
                      f"{predicted:12.3f}x")


if __name__ == "__main__":
    main()
