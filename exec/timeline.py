"""One training step's memory, predicted against measured by the allocator, operation by operation.

The plan predicts the memory while each operation of its schedule runs (the simulator,
:func:`solvers.simulate.simulate`, plus what the executor holds through the step,
``Plan.held_bytes``). :func:`measure_timeline` runs one step of a compiled module with each
operation inside a profiler range (``CompiledModule.markers``) and reads the allocator's own
events (:func:`rkgb.memory.allocator_events`: every allocation and free, kernels' scratch
included), so that each operation gets the peak the allocator saw while it ran. Where the two
differ, :meth:`Timeline.worst` names the operation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from rkgb.memory import allocator_events_and_ranges
from solvers.schedule import Compute, Forget, Schedule
from solvers.simulate import simulate

from .codegen import MARKER_PREFIX
from .merge import executed_positions, same_call

__all__ = ["Timeline", "measure_timeline"]


@dataclass
class Timeline:
    """Memory during each operation of a schedule (bytes above the start of the step).

    ``predicted[i]`` and ``measured[i]`` belong to ``labels[i]`` (the operation, e.g.
    ``Compute(fwd_linear)``); ``measured[i]`` is None for an operation that ran no code (a
    forget of a merged node's gradient). ``measured_peak`` is the peak of the whole step
    (the loss's own code included); ``loss_peak`` the peak between the forward and the
    backward phases (the user's loss).
    """

    labels: list[str]
    predicted: list[int]
    measured: list[int | None]
    measured_peak: int
    predicted_peak: int

    def worst(self) -> tuple[int, str, int, int] | None:
        """The operation measured furthest above its prediction: (index, label, measured,
        predicted), or None when every measure is within its prediction."""
        worst = None
        for i, (label, p, m) in enumerate(zip(self.labels, self.predicted, self.measured)):
            if m is not None and m > p and (worst is None or m - p > worst[2] - worst[3]):
                worst = (i, label, m, p)
        return worst

    def peak_operation(self) -> tuple[int, str]:
        """The operation where the measured memory is highest."""
        index = max(range(len(self.measured)), key=lambda i: self.measured[i] or -1)
        return index, self.labels[index]


def _predicted(compiled, plan, merged: dict[str, str]) -> list[int]:
    """The predicted memory during each operation of ``plan.schedule`` as the code runs it:
    a merged island's backward (exec.merge) runs the backwards it absorbs, and the forgets in
    between take effect after them; the absorbed backward's own operation runs no code."""
    positions = executed_positions(plan.schedule, merged)
    during = simulate(compiled.cdgraph, [plan.schedule.ops[i] for i in positions],
                      first_run_bytes=plan.first_run_bytes,
                      same_call=same_call(plan.schedule, merged)).memory_during
    predicted = [0] * len(positions)
    for step, i in enumerate(positions):
        predicted[i] = during[step] + plan.held_bytes
    absorbed_by = {f"bwd_{b}": f"bwd_{a}" for a, b in merged.items()}
    ops = plan.schedule.ops
    for step, i in enumerate(positions):
        op = ops[i]
        if isinstance(op, Compute) and op.node in absorbed_by:
            # the chain's backwards run inside this operation; the absorbed ones are no-ops
            chain = [i]
            while step + 1 < len(positions) and isinstance(ops[positions[step + 1]], Compute) \
                    and ops[positions[step + 1]].node == absorbed_by.get(ops[chain[-1]].node):
                step += 1
                chain.append(positions[step])
            predicted[i] = max(predicted[j] for j in chain)
            for j in chain[1:]:
                predicted[j] = predicted[j - 1]
    return predicted


def measure_timeline(compiled, args: tuple, loss_fn: Callable[[Any], torch.Tensor], plan) -> Timeline:
    """Run one training step of ``compiled`` (an :class:`exec.runtime.CompiledModule`) on
    ``args`` with ``loss_fn(outputs).backward()``, and return its timeline against ``plan``.

    The allocator's events come from the profiler: the CPU allocator's, or the CUDA caching
    allocator's where ``args`` are on CUDA; the step's gradients accumulate into the parameters
    as any step's do.
    """
    schedule: Schedule = plan.schedule
    predicted = _predicted(compiled, plan, compiled.runner_for(args).merged)

    def step():
        loss = loss_fn(compiled(*args))
        if loss is not None:
            loss.backward()

    compiled.markers = True
    try:
        device_type = next((x.device.type for x in args if isinstance(x, torch.Tensor)), "cpu")
        events, named = allocator_events_and_ranges(step, prefix=MARKER_PREFIX, device_type=device_type)
    finally:
        compiled.markers = False
    ranges = {int(name[len(MARKER_PREFIX):]): span for name, span in named.items()}
    measured: list[int | None] = [None] * len(schedule.ops)
    i = 0
    starts = sorted((start, end, index) for index, (start, end) in ranges.items())
    # memory at each event; each range's peak is the highest level while it is open
    levels = [(event.time_ns, event.current_bytes) for event in events]
    peak = max((level for _, level in levels), default=0)
    before = 0  # the level when the next range opens
    for start, end, index in starts:
        while i < len(levels) and levels[i][0] < start:
            before = levels[i][1]
            i += 1
        inside = []
        for t, level in levels[i:]:
            if t > end:
                break
            inside.append(level)
        if isinstance(schedule.ops[index], Forget):  # predicted: the memory after the forget
            measured[index] = inside[-1] if inside else before
        else:
            measured[index] = max([before] + inside)
    return Timeline(
        labels=[str(op) for op in schedule.ops],
        predicted=predicted,
        measured=measured,
        measured_peak=peak,
        predicted_peak=plan.predicted_peak,
    )
