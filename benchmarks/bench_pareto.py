"""Every re-materialization method at budgets from its minimum to eager's peak, side by side:
the measured peak (the allocator's), the measured step time (median of interleaved runs) and
the predicted one, with the rivals as their users run them: eager PyTorch,
``torch.utils.checkpoint`` around every block (non-reentrant), ``checkpoint_sequential`` with
sqrt(n) segments, and ``torch.compile`` (aot_eager backend) with PyTorch's
``activation_memory_budget`` at several values; each rival's gradients are compared with
eager's (the largest difference; Rockmate's are bitwise, as the tests check).

    .venv/bin/python benchmarks/bench_pareto.py                     # zoo GPT, ResNet, RNN
    .venv/bin/python benchmarks/bench_pareto.py --models gpt --preset bench --steps 9

One intra-op thread, the flops cost model (deterministic plans). Budgets are fractions of
eager's allocator peak; a solver whose minimum is above a budget prints "infeasible" there.
Writes ``benchmarks/results/pareto.csv`` and ``docs/figures/pareto_<model>.png`` (step time
against measured peak, one line per method).
"""

from __future__ import annotations

import argparse
import copy
import csv
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

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


class _SequentialSegments(torch.nn.Module):
    """The model's ``blocks`` run by ``checkpoint_sequential`` in round(sqrt(n)) segments."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        blocks = list(model.blocks)
        self.segments = max(1, round(len(blocks) ** 0.5))
        inner = torch.nn.Sequential(*blocks)
        runner = _Segments(inner, self.segments)
        model.blocks = torch.nn.Sequential(runner) if isinstance(model.blocks, torch.nn.Sequential) \
            else torch.nn.ModuleList([runner])

    def forward(self, *args):
        return self.model(*args)


class _Segments(torch.nn.Module):
    def __init__(self, blocks: torch.nn.Sequential, segments: int) -> None:
        super().__init__()
        self.blocks, self.segments = blocks, segments

    def forward(self, x):
        return checkpoint_sequential(self.blocks, self.segments, x, use_reentrant=False)


def _compiled_with_budget(model: torch.nn.Module, budget: float) -> torch.nn.Module:
    """``torch.compile`` (aot_eager) with the activation-memory budget (a fraction of the
    saveable activations), PyTorch's own knapsack over what to save."""
    import torch._dynamo
    import torch._functorch.config as functorch_config

    torch._dynamo.reset()
    functorch_config.activation_memory_budget = budget
    compiled = torch.compile(model, backend="aot_eager")
    return compiled


def _grad_difference(module, reference, sample) -> float:
    """The largest absolute difference between the parameters' gradients of one step."""
    for m in (module, reference):
        for p in m.parameters():
            p.grad = None
        torch.manual_seed(0)  # the same dropout masks
        _step(m, sample)()
    return max(((a.grad - b.grad).abs().max().item() for a, b in zip(module.parameters(), reference.parameters())
                if a.grad is not None and b.grad is not None), default=0.0)


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
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--no-compile", action="store_true", help="leave out torch.compile's budgets")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rows: list[dict] = []
    for name in args.models:
        model, sample = ZOO[name].build(preset=args.preset)
        sample = sample if isinstance(sample, tuple) else (sample,)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        reference = {"eager": copy.deepcopy(model)}
        if hasattr(model, "blocks"):
            reference["checkpoint every block"] = _CheckpointEveryBlock(copy.deepcopy(model))
            reference["checkpoint_sequential sqrt(n)"] = _SequentialSegments(copy.deepcopy(model))
        if not args.no_compile:
            for budget in (1.0, 0.5, 0.1):
                try:
                    reference[f"torch.compile budget {budget}"] = _compiled_with_budget(copy.deepcopy(model), budget)
                    _step(reference[f"torch.compile budget {budget}"], sample)()
                except Exception as error:  # reported: a rival that cannot run this model here
                    reference.pop(f"torch.compile budget {budget}", None)
                    print(f"  torch.compile budget {budget}: {type(error).__name__}: {str(error)[:100]}")
        measured = _measure(reference, sample, args.steps)
        eager_peak, eager_time = measured["eager"]
        print(f"\n{name}: eager peak {eager_peak} B, step {eager_time * 1e3:.2f} ms")
        for label, (peak, seconds) in measured.items():
            difference = 0.0 if label == "eager" else _grad_difference(reference[label], reference["eager"], sample)
            print(f"  {label:32s} peak {peak / eager_peak:6.3f} of eager's, time {seconds / eager_time:6.3f}x, "
                  f"gradients {difference:.2e} from eager's")
            rows.append(dict(model=name, method=label, budget="", peak=peak / eager_peak, time=seconds / eager_time,
                             predicted="", grad_difference=difference))
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
                ratio = seconds / both["eager"][1]
                print(f"  {solver:14s} {fraction:7.2f} {peak / eager_peak:13.3f} {ratio:12.3f}x {predicted:12.3f}x")
                rows.append(dict(model=name, method=solver, budget=fraction, peak=peak / eager_peak, time=ratio,
                                 predicted=predicted, grad_difference=0.0))
        _plot(name, [r for r in rows if r["model"] == name])
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    with open(results / "pareto.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]) if rows else ["model"])
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nwritten: {results / 'pareto.csv'}")


def _plot(name: str, rows: list[dict]) -> None:
    """Step time against measured peak, one line per method (docs/figures/pareto_<name>.png)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axis = plt.subplots(figsize=(7, 4.5))
    methods = dict.fromkeys(r["method"] for r in rows)
    for method in methods:
        points = sorted((r["peak"], r["time"]) for r in rows if r["method"] == method)
        style = "o-" if len(points) > 1 else "s"
        axis.plot([p for p, _ in points], [t for _, t in points], style, label=method)
    axis.set_xlabel("measured peak / eager's")
    axis.set_ylabel("step time / eager's")
    axis.set_title(f"zoo {name}: time against memory")
    axis.legend(fontsize=7)
    figures = ROOT / "docs" / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(figures / f"pareto_{name}.png", dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    main()
