"""The capture's time, its graph lowered in place (:mod:`rkgb.decompose`) against
``run_decompositions``'s retrace: medians of interleaved runs, one intra-op thread.

    .venv/bin/python benchmarks/bench_capture.py                                # the default models
    .venv/bin/python benchmarks/bench_capture.py --models llama-12 llama-24 --runs 3

Models: those of ``bench_planning.py`` (the zoo's bench GPT as ``gpt``, transformers models from
tiny configs, ``gpt2-small-12``, ``llama-12``, ``llama-24``: full width). The first capture of a
process is left out of the medians (it pays torch's warm-up: imports, dispatch caches) and shown
apart.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

import rkgb.capture as capture_module  # noqa: E402
from bench_planning import _model  # noqa: E402
from rockmate.api import _flat_call  # noqa: E402


def _timed(model, sample, lowered: bool) -> tuple[float, str | None]:
    capture_module.LOWER_FUNCTIONAL_GRAPHS = lowered
    try:
        start = time.perf_counter()
        captured = capture_module.capture(model, sample)
        return time.perf_counter() - start, captured.retraced
    finally:
        capture_module.LOWER_FUNCTIONAL_GRAPHS = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gpt", "gpt2", "bert", "llama", "t5", "gpt2-small-12", "llama-12"])
    parser.add_argument("--runs", type=int, default=3, help="of each way, interleaved")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    print(f"{'model':>14} {'lowered here':>12} {'retraced':>9} {'ratio':>6} {'first capture':>13}  how")
    for name in args.models:
        model, given = _model(name)
        _, flat, sample = _flat_call(model.train(), None, given.get("args"), given.get("kwargs"))
        first, _ = _timed(flat, sample, True)
        times: dict[bool, list[float]] = {True: [], False: []}
        how = None
        for _ in range(args.runs):
            for lowered in (False, True):
                seconds, retraced = _timed(flat, sample, lowered)
                times[lowered].append(seconds)
                if lowered:
                    how = retraced
        here, there = statistics.median(times[True]), statistics.median(times[False])
        print(f"{name:>14} {here:>11.2f}s {there:>8.2f}s {there / here:>6.2f} {first:>12.2f}s  "
              f"{'lowered in place' if how is None else 'retraced: ' + how}", flush=True)


if __name__ == "__main__":
    main()
