"""Every re-materialization method at budgets from its minimum to eager's peak, side by side:
the measured peak (the allocator's), the measured step time (median of interleaved runs) and
the predicted one, with the rivals as their users run them: eager PyTorch,
``torch.utils.checkpoint`` around every block (non-reentrant), ``checkpoint_sequential`` with
sqrt(n) segments, and ``torch.compile`` (aot_eager backend) with PyTorch's
``activation_memory_budget`` at several values; each rival's gradients are compared with
eager's (the largest difference; Rockmate's are bitwise, as the tests check).

    .venv/bin/python benchmarks/bench_pareto.py                     # zoo GPT, ResNet, RNN
    .venv/bin/python benchmarks/bench_pareto.py --models gpt --preset bench --steps 9

One intra-op thread, the flops cost model (deterministic plans; ``--cost-model measured`` plans
with the measured times, as users do). Budgets are fractions of
eager's allocator peak; a solver whose minimum is above a budget prints "infeasible" there.
Writes ``benchmarks/results/pareto_<preset>_<model>.csv`` and ``docs/figures/pareto_<model>.png``
(``pareto_<model>_<preset>.png`` for presets other than tiny; step time against measured peak, one
line per method) as each model ends.
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


def _compiled_with_budget(model: torch.nn.Module, budget: float, backend: str = "aot_eager") -> torch.nn.Module:
    """``torch.compile`` (``backend``: aot_eager, or inductor where a C++ compiler is there)
    with the activation-memory budget (a fraction of the saveable activations), PyTorch's own
    knapsack over what to save."""
    import torch._dynamo
    import torch._functorch.config as functorch_config

    torch._dynamo.reset()
    functorch_config.activation_memory_budget = budget
    compiled = torch.compile(model, backend=backend)
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
    for module in modules.values():  # warm-up: lazily made state (the loss's weights) is not measured
        _step(module, sample)()
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
    parser.add_argument("--compile-backend", default="aot_eager", help="torch.compile's backend (aot_eager, inductor)")
    parser.add_argument("--solvers", nargs="*", default=SOLVERS)
    parser.add_argument("--cost-model", default="flops", choices=["flops", "measured"],
                        help="the planners' costs: flops (deterministic plans) or measured times")
    parser.add_argument("--fractions", nargs="*", type=float, default=FRACTIONS)
    parser.add_argument("--plot", nargs="*", metavar="CSV", help="only plot these CSVs (written by this script) "
                        "into one figure, --out")
    parser.add_argument("--out", default=str(ROOT / "docs" / "figures" / "pareto.png"))
    parser.add_argument("--title", default="time against memory")
    args = parser.parse_args()
    if args.plot:
        plot_csv(args.plot, args.out, args.title)
        return
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
        for solver in args.solvers:
            for fraction in args.fractions:
                budget = int(eager_peak * fraction)
                try:
                    compiled = Rockmate(copy.deepcopy(model), sample, budget, solver=solver, cost_model=args.cost_model)
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
                rows.append(dict(model=name, method=solver if args.cost_model == "flops" else f"{solver} (measured costs)",
                                 budget=fraction, peak=peak / eager_peak, time=ratio,
                                 predicted=predicted, grad_difference=0.0))
        if not args.no_compile:
            # torch.compile last, each budget measured against eager in pairs (dynamo and its
            # compiled graphs stay in the process: they are kept out of the other measurements)
            for budget in (1.0, 0.5, 0.1):
                label = f"torch.compile budget {budget}" + ("" if args.compile_backend == "aot_eager"
                                                             else f" ({args.compile_backend})")
                try:
                    compiled = _compiled_with_budget(copy.deepcopy(model), budget, args.compile_backend)
                    _step(compiled, sample)()
                except Exception as error:  # reported: a rival that cannot run this model here
                    print(f"  {label}: {type(error).__name__}: {str(error)[:100]}")
                    continue
                both = _measure({label: compiled, "eager": reference["eager"]}, sample, args.steps)
                peak, seconds = both[label]
                difference = _grad_difference(compiled, reference["eager"], sample)
                print(f"  {label:32s} peak {peak / eager_peak:6.3f} of eager's, time {seconds / both['eager'][1]:6.3f}x, "
                      f"gradients {difference:.2e} from eager's")
                rows.append(dict(model=name, method=label, budget="", peak=peak / eager_peak,
                                 time=seconds / both["eager"][1], predicted="", grad_difference=difference))
        model_rows = [r for r in rows if r["model"] == name]
        suffix = "" if args.cost_model == "flops" else "_measured"
        stem = f"pareto_{name}" if args.preset == "tiny" else f"pareto_{name}_{args.preset}"
        _plot(f"zoo {name} ({args.preset}, {args.cost_model} costs): time against memory",
              ROOT / "docs" / "figures" / f"{stem}{suffix}.png", model_rows)
        results = ROOT / "benchmarks" / "results"
        results.mkdir(parents=True, exist_ok=True)
        path = results / f"pareto_{args.preset}_{name}{suffix}.csv"
        with open(path, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(model_rows[0]) if model_rows else ["model"])
            writer.writeheader()
            writer.writerows(model_rows)
        print(f"\nwritten: {path}", flush=True)


def _plot(title: str, path: Path, rows: list[dict], max_time: float = 2.0) -> None:
    """Step time against measured peak, one line per method, written to ``path``. Points
    slower than ``max_time`` x eager are listed under the plot instead of stretching it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axis = plt.subplots(figsize=(8, 5))
    colors = plt.get_cmap("tab20").colors
    methods = dict.fromkeys(r["method"] for r in rows)
    off_scale: dict[str, list[tuple[float, float]]] = {}
    for i, method in enumerate(methods):
        points = sorted((float(r["peak"]), float(r["time"])) for r in rows if r["method"] == method)
        off_scale[method] = [(p, t) for p, t in points if t > max_time]
        points = [(p, t) for p, t in points if t <= max_time]
        if not points:
            continue
        solver = any(r["budget"] not in ("", None) for r in rows if r["method"] == method)
        style = ("o-" if len(points) > 1 else "o") if solver else "s"
        color = {"rockmate": "red", "rockmate (measured costs)": "black"}.get(method, colors[i % len(colors)])
        axis.plot([p for p, _ in points], [t for _, t in points], style, label=method, color=color,
                  linewidth=2.5 if method.startswith("rockmate") else 1.0, markersize=7 if solver else 9)
    axis.set_xlabel("measured peak (allocator) / eager's")
    axis.set_ylabel("measured step time / eager's")
    far = [f"{m} at {min(p for p, _ in pts):.3f}-{max(p for p, _ in pts):.3f} of the peak, "
           f"{min(t for _, t in pts):.2f}-{max(t for _, t in pts):.2f}x" for m, pts in off_scale.items() if pts]
    axis.set_title(title + (f"\noff the scale: {'; '.join(far)}" if far else ""), fontsize=9)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7, loc="upper right")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_csv(paths: list[str], out: str, title: str) -> None:
    """One plot of the rows of several CSVs written by this script (e.g. the flops and the
    measured-costs runs of one model)."""
    rows: list[dict] = []
    for path in paths:
        with open(path, newline="") as file:
            rows += list(csv.DictReader(file))
    seen = set()
    unique = []  # a rival measured by each run: keep its first measurement
    for r in rows:
        key = (r["method"], r["budget"])
        if r["budget"] == "" and key in seen:
            continue
        seen.add(key)
        unique.append(r)
    _plot(title, Path(out), unique)


if __name__ == "__main__":
    main()
