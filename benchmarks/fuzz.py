"""Fuzz the whole pipeline with random models (tests/random_models.py) and report the figures.

    .venv/bin/python benchmarks/fuzz.py              # 2000 cases (the "long" profile's count)
    .venv/bin/python benchmarks/fuzz.py --cases 200  # fewer
    .venv/bin/python benchmarks/fuzz.py --seed 7     # another fixed set of cases
    .venv/bin/python benchmarks/fuzz.py --replay benchmarks/results/fuzz_failures.pkl  # a run's failures again

Each case draws a random program (hypothesis, derandomized: a fixed set of cases for a seed)
and a budget fraction, and checks the fuzzing property (``random_models.check_program``):
bitwise outputs, gradients and buffers over two steps, the allocator's peak within the
budget, or a named error. Unlike the test (``tests/test_fuzz.py``), a failing case does not stop
the run: the summary counts outcomes, and failing programs are written to
``benchmarks/results/fuzz_failures.txt`` (each with its source, to become a regression test).
"""

from __future__ import annotations

import argparse
import collections
import os
import pickle
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from random_models import check_program, programs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="file name of the failures' report under benchmarks/results "
                        "(default fuzz_failures.txt; the programs are pickled beside it, .pkl)")
    parser.add_argument("--replay", help="a fuzz_failures.pkl: check those (program, fraction) pairs again")
    parser.add_argument("--max-block-nodes", type=int, default=None,
                        help="split blocks bigger than this with side inputs (rkgb.blocks; small: side "
                             "inputs on most programs); default: Rockmate's")
    parser.add_argument("--loss-inside", action="store_true",
                        help="the models return their own loss ({'loss': ..., 'outputs': ...}, as transformers' "
                             "models called with labels), the step's backward from it alone")
    parser.add_argument("--held-outputs", choices=["all", "loss"], default="all",
                        help="Rockmate's held_outputs; 'loss': every step (eager's too) keeps the loss alone")
    args = parser.parse_args()
    extra = {} if args.max_block_nodes is None else {"max_block_nodes": args.max_block_nodes}
    if args.loss_inside:
        extra["loss_inside"] = True
    if args.held_outputs != "all":
        extra["held_outputs"] = args.held_outputs
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    outcomes: collections.Counter = collections.Counter()
    failures: list[str] = []
    failing: list = []  # (program, fraction), pickled beside the report to replay them
    ratios: list[float] = []  # the plan without recomputation's predicted peak / eager's
    measured: list[float] = []  # ... its allocator peak / eager's
    worst: list = []  # the program whose plan without recomputation is highest above eager
    above_eager: list = []  # (ratio, program) of every plan without recomputation above eager's peak
    measured_above: list = []  # (ratio, program) of every such plan whose allocator peak is above eager's
    start = time.perf_counter()
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    report = results / Path(args.out or "fuzz_failures.txt").name  # (a path given: its file name)

    def save_failures() -> None:
        """Write the failures so far (a long run's are not lost when it is stopped)."""
        report.write_text("\n\n".join(failures) + ("\n" if failures else ""))
        with open(report.with_suffix(".pkl"), "wb") as file:
            pickle.dump(failing, file)
        with open(report.with_suffix(".above.pkl"), "wb") as file:
            pickle.dump(above_eager, file)
        with open(report.with_suffix(".measured_above.pkl"), "wb") as file:
            pickle.dump(measured_above, file)

    @seed(args.seed)
    @settings(max_examples=args.cases, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(program=programs(), fraction=st.sampled_from([0.0, 0.3, 0.5, 0.8, 1.0]))
    def case(program, fraction):
        try:
            result = check_program(program, fraction, peak_steps=3, save_steps=3, **extra)
        except AssertionError as error:
            outcomes["failure"] += 1
            failures.append(f"fraction {fraction}: {error}")
            failing.append((program, fraction))
            print(f"failure: fraction {fraction}: {str(error).splitlines()[0]}", flush=True)
            save_failures()
            return
        except Exception:  # any other exception is a failure of the property too
            outcomes["failure"] += 1
            failures.append(f"fraction {fraction}: {traceback.format_exc()}\n{program.source()}")
            failing.append((program, fraction))
            print(f"failure: fraction {fraction}: {traceback.format_exc().splitlines()[-1]}", flush=True)
            save_failures()
            return
        outcomes[result.outcome] += 1
        if result.outcome == "unsupported":  # allowed by the property, but worth reading
            print(f"unsupported: {result.notes[0].splitlines()[0]}\n{program.source()}", flush=True)
        if result.eager_peak:
            measured.append(result.no_recompute_measured / result.eager_peak)
            ratios.append(result.no_recompute_peak / result.eager_peak)
            if ratios[-1] >= max(ratios):
                worst[:] = [program]
            if ratios[-1] > 1.0:  # within the property's allowance, but above eager: kept to study
                above_eager.append((ratios[-1], program))
            if measured[-1] > 1.0:
                measured_above.append((measured[-1], program))
        done = sum(outcomes.values())
        if done % 100 == 0:
            print(f"{done} cases, {dict(outcomes)}, {time.perf_counter() - start:.0f} s", flush=True)

    if args.replay:
        with open(args.replay, "rb") as file:
            for program, fraction in pickle.load(file):
                case.hypothesis.inner_test(program=program, fraction=fraction)
    else:
        case()
    total = sum(outcomes.values())
    print(f"\n{total} cases in {time.perf_counter() - start:.0f} s: {dict(outcomes)}")
    if ratios:
        ratios.sort()
        at_most = sum(r <= 1.0 for r in ratios)
        print(f"plan without recomputation / eager's allocator peak: median {ratios[len(ratios) // 2]:.3f}, "
              f"max {ratios[-1]:.3f}, at most 1 in {at_most} of {len(ratios)} cases; the highest:\n"
              f"{worst[0].source()}")
        measured.sort()
        print(f"measured (that plan's allocator peak / eager's): median {measured[len(measured) // 2]:.3f}, "
              f"max {measured[-1]:.3f}, at most 1 in {sum(r <= 1.0 for r in measured)} of {len(measured)} cases")
    save_failures()
    print(f"failures: {len(failures)} (written to {os.path.relpath(report)})")


if __name__ == "__main__":
    main()
