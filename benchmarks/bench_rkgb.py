"""Graph-builder benchmark: time of each phase on a GPT-2-small-sized model, and how it grows
with depth (only capture should: inspection is per class, not per block).

    .venv/bin/python benchmarks/bench_rkgb.py [--layers 12 24]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from rkgb.build import build  # noqa: E402
from zoo import ZOO  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 24])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("GPT-2 small sized (d=768, 12 heads, seq 256, batch 2, vocab 50257), "
          f"{args.threads} threads, measured cost model (3 repeats)")
    print(f"{'layers':>6} {'nodes':>6} {'blocks':>6} {'classes':>7} {'capture s':>9} {'simplify s':>10} "
          f"{'inspect s':>9} {'cdgraph s':>9} {'total s':>8}")
    for layers in args.layers:
        model, sample = ZOO["gpt"].build("small", n_layer=layers)
        start = time.perf_counter()
        graphs = build(model, sample)
        total = time.perf_counter() - start
        s = graphs.phase_seconds
        print(f"{layers:>6} {len(graphs.simplified.nodes):>6} {len(graphs.chain.blocks):>6} "
              f"{len(graphs.chain.classes):>7} {s['capture']:>9.2f} {s['simplify_and_cut']:>10.2f} "
              f"{s['inspect']:>9.2f} {s['cdgraph']:>9.3f} {total:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
