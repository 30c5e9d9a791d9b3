"""How Rockmate's capture took a transformers model's branches, against eager: a probe for
exactness differences that come from the captured path (which attention masks, which SDPA calls).

Prints (1) each export attempt of the capture that failed (a branch on tensor values along
eager's paths, ``rkgb.capture._export_along_eager_paths``) and the real-value decisions that the
retry recorded, whether they were taken as depending on the shapes alone; (2) the arguments of
every ``scaled_dot_product_attention`` call of eager's step (mask or not, ``is_causal``) and of
the plan's code. Used on the GPU for BART under transformers 5.17 (twenty-third session: the
plan's SDPA calls had masks, eager's none).

    python benchmarks/capture_probe.py bart [--device cuda]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import test_transformers as tt  # noqa: E402

import rkgb.capture as capture  # noqa: E402
from rockmate import Rockmate  # noqa: E402


def _watch_capture() -> None:
    """Report the capture's failed export attempts and its decisions on tensor values (on the
    process's own stderr: the capture holds back what the forward prints while it is traced)."""
    export, leave = capture._export_quietly, capture._RealValueDecisions.__exit__

    def reporting_export(model, args, shapes_logger="torch.fx.experimental.symbolic_shapes"):
        try:
            return export(model, args, shapes_logger)
        except Exception as error:
            retry = shapes_logger != "torch.fx.experimental.symbolic_shapes"
            print(f"export {'with real values' if retry else 'along eager paths'} failed: "
                  f"{type(error).__name__}: {str(error).splitlines()[0][:200]}", file=sys.__stderr__)
            raise

    def reporting_leave(decisions, *exc):
        print(f"decisions on values: {decisions.made}, on values the shapes do not determine: "
              f"{decisions.undetermined}; symbols read from values the shapes determine: "
              f"{sorted(map(str, decisions.values.symbols))}", file=sys.__stderr__)
        return leave(decisions, *exc)

    capture._export_quietly, capture._RealValueDecisions.__exit__ = reporting_export, reporting_leave


def _eager_attention_calls(model, call) -> list[str]:
    original, calls = F.scaled_dot_product_attention, []

    def logged(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **options):
        mask = "no mask" if attn_mask is None else f"mask {attn_mask.dtype} {list(attn_mask.shape)}"
        calls.append(f"{mask}, is_causal={is_causal}, dropout_p={dropout_p}, {options}")
        return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **options)

    F.scaled_dot_product_attention = logged
    try:
        tt._loss_of(copy.deepcopy(model)(**call)).backward()
    finally:
        F.scaled_dot_product_attention = original
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a name of tests/test_transformers.py's MODELS")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, call = tt.MODELS[args.model]()
    model = model.to(args.device).train()
    call = {k: (v.to(args.device) if isinstance(v, torch.Tensor) else v) for k, v in call.items()}
    _watch_capture()
    compiled = Rockmate(copy.deepcopy(model), call, "10GB", solver="none")
    print("eager's attention calls:")
    for line in _eager_attention_calls(model, call):
        print("  ", line)
    print("the plan's:")
    for line in compiled.code.splitlines():
        if "scaled_dot_product_attention.default(" in line:
            print("  ", line.strip()[:200])


if __name__ == "__main__":
    main()
