"""The zoo on a CUDA device: exactness and the budget as the CUDA caching allocator counts it.

For each model, preset and fraction of eager's allocator peak, trains ``Rockmate(model, sample,
budget)`` next to eager over 3 steps (:func:`exactness.check_training`: bitwise outputs,
gradients and buffers; each step's ``torch.cuda.max_memory_allocated`` within the budget and
near the prediction; below the minimum budget, at the minimum) and prints one row per case:
eager's peak, the budget, the predicted and measured peaks, the planning time, and what failed
(an assertion's message, which names the operation furthest above its prediction). Rows are
also written as JSON lines to ``--out``.

    python benchmarks/gpu_check.py [--models gpt resnet] [--presets tiny bench] [--out rows.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import exactness  # noqa: E402
from exactness import check_training  # noqa: E402
from zoo import ZOO  # noqa: E402

# the requested bytes' peak of each measured step (c10's ``requested_bytes``: the sizes asked
# for, before the allocator's rounding and before a cached block bigger than the request is
# handed out whole), beside ``max_memory_allocated``'s
REQUESTED: list[int] = []


def _measured_with_requested(fn, *args, device=None):
    torch.cuda.synchronize()
    start = torch.cuda.memory_stats()["requested_bytes.all.current"]
    peak = _allocator_peak(fn, *args, device=device)
    REQUESTED.append(torch.cuda.memory_stats()["requested_bytes.all.peak"] - start)
    return peak


_allocator_peak = exactness.measure_allocator_peak
exactness.measure_allocator_peak = _measured_with_requested


def _eager_is_deterministic(name: str, preset: str, dtype: torch.dtype) -> bool:
    """Two eager copies trained the same way (3 SGD steps, same seeds): the same gradients?"""
    runs = []
    for _ in range(2):
        model, sample = ZOO[name].build(preset, dtype, device="cuda")
        loss = exactness.DotLoss(model(*sample))
        runs.append(exactness._train(model, list(model.parameters()), sample, loss, 3, 1))
    return all(exactness.bitwise_equal(a, b) for step_a, step_b in zip(*runs)
               for a, b in zip(step_a[1], step_b[1]) if a is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=sorted(ZOO))
    parser.add_argument("--presets", nargs="+", default=["tiny", "bench"])
    parser.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.3])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default=None)
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.backends.cudnn.deterministic = True (eager's own convolutions reproducible)")
    args = parser.parse_args()
    torch.backends.cudnn.deterministic = args.deterministic
    dtype = getattr(torch, args.dtype)
    out = open(args.out, "a") if args.out else None
    print(f"{torch.__version__} on {torch.cuda.get_device_name()}", flush=True)
    for name in args.models:
        for preset in args.presets:
            for fraction in args.fractions:
                row = dict(model=name, preset=preset, fraction=fraction, dtype=args.dtype,
                           deterministic=args.deterministic)
                start = time.perf_counter()
                REQUESTED.clear()
                try:
                    model, sample = ZOO[name].build(preset, dtype, device="cuda")
                    report = check_training(model, sample, fraction, at_minimum=True)
                    row.update(ok=True, eager=report.eager_peak, budget=report.budget,
                               predicted=report.predicted_peak, measured=report.measured_peaks,
                               at_minimum=report.at_minimum)
                except Exception as error:  # a failed case is a row of the report, not the end
                    row.update(ok=False, error=f"{type(error).__name__}: {error}",
                               where=traceback.format_exc(limit=-3))
                    if "differs" in str(error):
                        row["eager_deterministic"] = _eager_is_deterministic(name, preset, dtype)
                row["requested"] = list(REQUESTED)  # eager's (warm-up, measured), then each step's
                row["seconds"] = round(time.perf_counter() - start, 1)
                print(json.dumps(row), flush=True)
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
