"""exec: run a schedule of the CD-graph as generated Python code inside an ``nn.Module``.

Public entry point::

    from exec import CompiledModule
    module = CompiledModule(model, graph, schedule, sample)
    outputs = module(*sample)        # same outputs, gradients and buffer updates as model
    print(module.code)               # the generated forward and backward phases

``graph`` is :func:`rkgb.simplify.simplify` of :func:`rkgb.capture.capture` on ``(model,
sample)``; ``schedule`` a :class:`solvers.schedule.Schedule` on the CD-graph names of that
graph (``fwd_x``, ``bwd_x``, ``loss``, ``x.data``, ``x.phantoms``, ``x.grad``).
:mod:`exec.schedules` builds simple schedules (no recomputation, recompute all, random) to run
without a solver. See :mod:`exec.codegen` for what the generated code looks like and
:mod:`exec.runtime` for the autograd glue (Rockmate, ICML 2023, section 5).
"""

from .codegen import ScheduleError
from .runtime import CompiledModule
from .schedules import no_recomputation_schedule, random_schedule, recompute_all_schedule

__all__ = [
    "CompiledModule",
    "ScheduleError",
    "no_recomputation_schedule",
    "recompute_all_schedule",
    "random_schedule",
]
