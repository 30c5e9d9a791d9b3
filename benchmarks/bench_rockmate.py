"""End-to-end benchmark: Rockmate against eager PyTorch on the GPT-like benchmark model.

For budgets of 100% (no recomputation needed) and 50% of eager's activation peak, prints the
budget, predicted and measured peak, predicted and measured step time, and eager's step time.
One thread; runs of eager and Rockmate are interleaved; medians and ratios are reported.
With ``--device cuda`` the model runs on the GPU: peaks are ``torch.cuda.max_memory_allocated``'s
and each step's time is taken after ``torch.cuda.synchronize``.

    .venv/bin/python benchmarks/bench_rockmate.py [--preset bench] [--steps 20] [--warmup 5] [--device cuda]
                                                  [--held-outputs loss]

The step keeps the loss alone (``loss_fn(rk(x)).backward()``); ``--held-outputs loss`` plans for that
(``held_outputs="loss"``), the default for a step that holds the outputs too.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from rkgb.memory import measure_allocator_peak  # noqa: E402
from rockmate import Rockmate, format_bytes  # noqa: E402
from zoo import ZOO  # noqa: E402


class _DotLoss:
    """<outputs, W> with W drawn once: its own memory is a scalar; the outputs' gradient is
    planned by Rockmate, so measured peaks compare with the predicted ones."""

    def __init__(self) -> None:
        self.weights = None

    def __call__(self, outputs):
        flat = outputs.reshape(-1)
        if self.weights is None:
            self.weights = torch.randn(flat.numel(), dtype=flat.dtype,
                                       generator=torch.Generator().manual_seed(0)).to(flat.device)
        return torch.dot(flat, self.weights)


_loss = _DotLoss()


def _step(module, sample, track: bool):
    """One forward + backward; (wall seconds, peak bytes or None, CPU seconds). The peak is the
    allocator's (the profiler's allocation events on CPU, kernels' scratch included), timed
    apart from the untracked steps."""
    for p in module.parameters():
        if p.grad is not None:
            p.grad.zero_()
    device = sample[0].device
    _synchronize(device)
    start, cpu = time.perf_counter(), time.process_time()
    if track:
        peak = measure_allocator_peak(lambda: _loss(module(*sample)).backward(), device=device)
        return time.perf_counter() - start, peak, time.process_time() - cpu
    _loss(module(*sample)).backward()
    _synchronize(device)
    return time.perf_counter() - start, None, time.process_time() - cpu


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps of each, interleaved")
    parser.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5])
    parser.add_argument("--solver", default="rockmate")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--held-outputs", default="all", choices=["all", "loss"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, sample = ZOO["gpt"].build(args.preset, device=args.device)
    eager = copy.deepcopy(model)
    for p in list(model.parameters()) + list(eager.parameters()):
        p.grad = torch.zeros_like(p)
    _step(eager, sample, False)
    eager_peak = _step(eager, sample, True)[1]
    config = ZOO["gpt"].config(args.preset)
    where = torch.cuda.get_device_name(args.device) if sample[0].is_cuda else "1 thread"
    print(f"GPT-like '{args.preset}': {config}; eager activation peak {format_bytes(eager_peak)}; {where}")
    print("times: medians of interleaved steps; 'cpu' is the process's CPU time (robust when the "
          "machine is shared), 'ratio' wall / eager wall")
    print(f"{'budget':>12} {'pred peak':>11} {'meas peak':>11} {'pred ms':>8} {'meas ms':>8} "
          f"{'eager ms':>8} {'ratio':>6} {'cpu ms':>7} {'eager cpu':>9} {'cpu ratio':>9} {'plan s':>7}")
    for fraction in args.fractions:
        budget = int(eager_peak * fraction)
        start = time.perf_counter()
        compiled = Rockmate(model, sample, budget, solver=args.solver, held_outputs=args.held_outputs)
        plan_s = time.perf_counter() - start
        measured_peak = _step(compiled, sample, True)[1]
        for _ in range(args.warmup):  # the heap settles over the first steps (glibc, caches)
            _step(eager, sample, False)
            _step(compiled, sample, False)
        eager_runs, rock_runs = [], []
        for _ in range(args.steps):
            eager_runs.append(_step(eager, sample, False))
            rock_runs.append(_step(compiled, sample, False))
        e, r = statistics.median(x[0] for x in eager_runs), statistics.median(x[0] for x in rock_runs)
        ec, rc = statistics.median(x[2] for x in eager_runs), statistics.median(x[2] for x in rock_runs)
        print(f"{format_bytes(budget):>12} {format_bytes(compiled.plan.predicted_peak):>11} "
              f"{format_bytes(measured_peak):>11} {compiled.plan.predicted_time * 1e3:>8.1f} {r * 1e3:>8.1f} "
              f"{e * 1e3:>8.1f} {r / e:>6.3f} {rc * 1e3:>7.1f} {ec * 1e3:>9.1f} {rc / ec:>9.3f} {plan_s:>7.1f}",
              flush=True)


if __name__ == "__main__":
    main()
