"""Graphviz drawings for debugging (forward graph, CD-graphs of the classes) and the schedule
as text, written together by ``Rockmate.render(directory)``."""

from __future__ import annotations

import os

from rkgb.build import ModelGraphs
from rkgb.render import cdgraph_dot, forward_graph_dot
from solvers.schedule import Compute, Forget, Plan

__all__ = ["render_all", "schedule_text"]

def schedule_text(plan: Plan) -> str:
    """The schedule, one operation a line."""
    lines = [f"# solver {plan.solver}, budget {plan.budget} B, predicted peak {plan.predicted_peak} B, "
             f"predicted time {plan.predicted_time:.6f} s (no recomputation: {plan.baseline_time:.6f} s)"]
    for op in plan.schedule.ops:
        if isinstance(op, Compute):
            lines.append(f"compute {op.node}" + ("" if op.with_grad else " (no grad)"))
        elif isinstance(op, Forget):
            lines.append(f"forget  {op.node}")
    return "\n".join(lines) + "\n"


def render_all(graphs: ModelGraphs, plan: Plan, directory) -> list[str]:
    """Write forward.svg, class<i>.svg for each class and schedule.txt into ``directory``."""
    os.makedirs(directory, exist_ok=True)
    written = [forward_graph_dot(graphs).render(os.path.join(directory, "forward"), format="svg", cleanup=True)]
    for graph in graphs.model_chain.classes:
        written.append(cdgraph_dot(graph).render(os.path.join(directory, graph.name), format="svg", cleanup=True))
    path = os.path.join(directory, "schedule.txt")
    with open(path, "w") as handle:
        handle.write(schedule_text(plan))
    written.append(path)
    return written
