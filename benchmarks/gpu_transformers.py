"""transformers models on a CUDA device (or the CPU): exactness and the budget, as a user calls them.

For each architecture of ``tests/test_transformers.py`` (tiny configs, random init, called with
keywords and labels), trains ``Rockmate(model, call, budget)`` next to eager over 2 steps at 100%
and 50% of eager's allocator peak of the whole step (at the minimum where 50% is infeasible) and
prints one JSON row per model: whether eager itself is deterministic (two eager copies), eager's
peak, and per budget the budget, the predicted and measured peaks (``max_memory_allocated`` on
CUDA, the profiler's allocation events on CPU), whether the loss and every gradient are bitwise
eager's, and the planning time. Runs on whatever transformers is installed (the GPU machines
have 5.x, as the tests since the twenty-fourth session: 5.17.0).

    python benchmarks/gpu_transformers.py llama,bart,swin [--out rows.jsonl] [--held-outputs loss]

The step keeps the loss alone (``loss = model(**call).loss``, transformers' Trainer);
``--held-outputs loss`` builds with ``held_outputs="loss"``, which plans for that (the default
plans for a step that holds the outputs too).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import test_transformers as tt  # noqa: E402

from rkgb.memory import measure_allocator_peak  # noqa: E402
from rockmate import InfeasibleBudget, Rockmate  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _to_device(call: dict) -> dict:
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in call.items()}


def _zero_grads(model) -> None:
    """``.grad`` holding zeros, as after a first step: the budget leaves them out."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()


def _step(model, call: dict, seed: int):
    """(loss, gradients) of one step from zeroed gradients, dropout drawn from ``seed``."""
    torch.manual_seed(seed)
    _zero_grads(model)
    loss = tt._loss_of(model(**call))
    loss.backward()
    return loss.detach().clone(), [p.grad.clone() for p in model.parameters()]


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def _peak(model, call: dict, seed: int) -> int:
    _zero_grads(model)

    def step():
        torch.manual_seed(seed)
        tt._loss_of(model(**call)).backward()

    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return measure_allocator_peak(step, device=DEVICE)


def check(name: str, held_outputs: str = "all") -> dict:
    row: dict = dict(model=name, device=DEVICE, held_outputs=held_outputs)
    torch.manual_seed(0)
    model, call = tt.MODELS[name]()
    model, call = model.to(DEVICE).train(), _to_device(call)
    row["eager_deterministic"] = _same(_step(copy.deepcopy(model), call, 0), _step(copy.deepcopy(model), call, 0))
    row["eager_peak"] = peak = _peak(copy.deepcopy(model), call, 0)
    for fraction in (1.0, 0.5):
        budget = int(peak * fraction)
        start = time.perf_counter()
        try:
            compiled = Rockmate(copy.deepcopy(model), call, budget, held_outputs=held_outputs)
        except InfeasibleBudget as error:
            budget = error.minimum
            compiled = Rockmate(copy.deepcopy(model), call, budget, held_outputs=held_outputs)
        plan_s = time.perf_counter() - start
        reference = copy.deepcopy(model)
        measured, bitwise = [], True
        for seed in range(2):
            measured.append(_peak(compiled, call, seed))
            bitwise &= _same(_step(reference, call, seed), _step(compiled, call, seed))
        row[str(fraction)] = dict(budget=budget, predicted=compiled.plan.predicted_peak, measured=measured,
                                  bitwise=bitwise, plan_s=round(plan_s, 1))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", help="comma-separated names of tests/test_transformers.py's MODELS")
    parser.add_argument("--out", default=None, help="append the rows (JSON lines) to this file")
    parser.add_argument("--held-outputs", default="all", choices=["all", "loss"],
                        help="Rockmate's held_outputs (the step keeps the loss alone either way)")
    args = parser.parse_args()
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {DEVICE}", flush=True)
    out = open(args.out, "a") if args.out else None
    for name in args.models.split(","):
        try:
            row = check(name, args.held_outputs)
        except Exception as error:  # noqa: BLE001 a row that says what failed, and the next model
            traceback.print_exc()
            row = dict(model=name, error=f"{type(error).__name__}: {str(error)[:400]}")
        print(json.dumps(row), flush=True)
        if out is not None:
            out.write(json.dumps(row) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
