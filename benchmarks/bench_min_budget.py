"""Minimum budgets of Rockmate and Rotor against the operation floor (not a timed test).

Run ``python benchmarks/bench_min_budget.py [--no-transformers]``. For each GPT, with the flops
cost model: ``min_budget("rockmate") / min_budget("rotor")`` (the paper's figure: 440 MB
against 720 MB on GPT2-large), and the operation floor (:func:`solvers.bounds.operation_floor`),
a lower bound on the peak of every plan that runs eager's operations out of place with the
backward in eager's order. ``floor / rotor`` is the best ratio any such plan could reach;
``rockmate / floor`` is how far Rockmate's minimum is from that bound.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from rkgb.build import build  # noqa: E402
from solvers import RockmateSolver, RotorSolver, operation_floor  # noqa: E402
from zoo import ZOO  # noqa: E402


def report(label: str, model: nn.Module, sample: tuple) -> None:
    start = time.perf_counter()
    chain = build(model, sample, cost_model="flops").model_chain
    floor = operation_floor(chain.whole_graph())
    rockmate = RockmateSolver(cache=None).min_budget(chain)
    rotor = RotorSolver().min_budget(chain)
    print(f"{label}: rockmate / rotor {rockmate / rotor:.3f}; floor / rotor {floor.bytes / rotor:.3f} "
          f"(floor {floor.bytes} B, set by {floor.node}); rockmate / floor {rockmate / floor.bytes:.3f} "
          f"[{time.perf_counter() - start:.0f} s]", flush=True)


class _Logits(nn.Module):
    """transformers' GPT-2 returning its logits only."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--no-transformers", action="store_true", help="only the zoo's GPT")
    args = parser.parse_args()
    torch.manual_seed(0)
    for layers, seq in ((2, 16), (3, 16), (4, 16), (2, 64), (2, 256)):
        report(f"zoo GPT, {layers} layers, seq {seq}", *ZOO["gpt"].build(seq_len=seq, n_layer=layers))
    if args.no_transformers:
        return
    from transformers import GPT2Config, GPT2LMHeadModel

    # the second is GPT2-large's shape (d=1280, 20 heads of 64), 2 layers, a 512 sequence
    for seq, d, heads in ((256, 64, 4), (512, 1280, 20)):
        config = GPT2Config(n_layer=2, n_embd=d, n_head=heads, n_positions=seq, vocab_size=256,
                            attn_implementation="eager")
        model = _Logits(GPT2LMHeadModel(config)).train()
        report(f"transformers GPT-2 (gelu_new), 2 layers, d {d}, {heads} heads, seq {seq}, batch 2",
               model, (torch.randint(0, 256, (2, seq)),))


if __name__ == "__main__":
    main()
