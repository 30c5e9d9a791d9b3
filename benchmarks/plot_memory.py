"""One training step's memory, predicted by the plan against measured by the allocator, drawn.

    .venv/bin/python benchmarks/plot_memory.py                 # bench GPT and U-Net at 50%
    .venv/bin/python benchmarks/plot_memory.py --fraction 0.3

Writes ``docs/figures/memory_<model>.png`` (shown in the README) and prints, per model, the budget, the
predicted and measured peaks and the operation where the measured peak is (CPU: the profiler's
allocation events, kernels' scratch included). Deterministic plans (``cost_model="flops"``).
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from exactness import DotLoss, eager_peak  # noqa: E402
from rockmate import Rockmate, format_bytes  # noqa: E402
from rockmate.plot import plot_timeline  # noqa: E402
from zoo import ZOO  # noqa: E402

MODELS = {"gpt": ("gpt", "bench"), "unet": ("unet", "bench")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--fraction", type=float, default=0.5, help="of eager's allocator peak")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    results = ROOT / "docs" / "figures"  # committed: the README shows them
    for name in args.models:
        entry, preset = MODELS[name]
        model, sample = ZOO[entry].build(preset)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            loss = DotLoss(copy.deepcopy(model)(*sample))
        eager = eager_peak(copy.deepcopy(model), sample, loss)
        budget = int(eager * args.fraction)
        rk = Rockmate(model, sample, budget, cost_model="flops")
        for p in model.parameters():  # as in every step after the first: .grad buffers exist
            p.grad = torch.zeros_like(p)
        timeline = rk.memory_timeline(*sample, loss_fn=loss)
        path = plot_timeline(timeline, results / f"memory_{name}.png", budget=budget,
                             title=f"{name} ({preset}) at {args.fraction:.0%} of eager's peak "
                                   f"{format_bytes(eager)}: measured {format_bytes(timeline.measured_peak)}, "
                                   f"predicted {format_bytes(timeline.predicted_peak)}")
        index, label = timeline.peak_operation()
        print(f"{name}: budget {format_bytes(budget)}, predicted {format_bytes(timeline.predicted_peak)}, "
              f"measured {format_bytes(timeline.measured_peak)} (peak at operation {index}, {label}); {path}")


if __name__ == "__main__":
    main()
