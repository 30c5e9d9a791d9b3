"""Runs of forwards that only feed each other: recomputed as a whole by rk-Checkmate.

rk-Checkmate's model (``solvers.checkmate_ilp``) has a recomputation variable per forward and
stage, and most forwards of a transformer block are small steps whose result nobody but the
next step reads: a rotary embedding's slices, cat and products, a norm's square, mean and
root, a scale and a mask before a softmax. A *run* is a range of consecutive forwards
``k, ..., j`` where every member but the last has one result, read by a later member of the
run only (no backward reads it, no other forward, it is not a block output), and no smaller
than the run's result. Such a result is never worth keeping across stages: a backward never
reads it, and keeping the run's result instead costs no more bytes and saves the whole run's
time. So the ILP recomputes a run as a whole (one variable per run and stage) and frees its
inner results within the stage that makes them (``RkCheckmateILP(whole_runs=True)``); its
memory is still counted operation by operation, so the options keep their exact figures.
Coarsening the graph this way is the classic step of rematerialization planners (Jain et al.,
"Checkmate", MLSys 2020, section 6, contract chains of cheap pointwise ops; Bartan et al.,
"Moccasin", ICML 2023, plan on the same kind of reduced graph). Runs are contiguous ranges of
the forwards, so the first runs keep the program's order.

Measured (10 x 10 grid, CBC, 1% gap, 2 workers, this 2-core CPU): the 59-compute attention
class of a Llama of GPT-2 small's width 16.7 s -> 11.2 s (12 of its 29 forwards in runs), the
tiny Llama's 18.7 -> 12.3 s, the tiny GPT-2's 31-compute class 6.0 -> 3.9 s with the same
options. Merging every run regardless of the sizes (results smaller than the run's kept
inside it) was 1.9x faster but up to 7% slower on some pairs of the GPT-2 class (a small
matmul result is the checkpoint of a big activation after it); merging the runs into one
compute node of a smaller graph (inputs then held to the run's end) was 6x faster but raised
the Llama class's smallest peak by 7%.
"""

from __future__ import annotations

from rkgb.cdgraph import CDGraph, ComputeKind, ComputeNode, DataKind

__all__ = ["forward_runs"]


def _result_bytes(graph: CDGraph, node: ComputeNode) -> int:
    return sum(graph.size(d) for d in node.produces if graph.data(d).kind is not DataKind.PHANTOMS)


def _only_reader(graph: CDGraph, node: ComputeNode) -> str | None:
    """The forward that alone reads ``node``'s only result, where nothing else does (no
    backward, not the loss, not a block output); None otherwise."""
    results = [d for d in node.produces if graph.data(d).kind is not DataKind.PHANTOMS]
    if len(results) != 1 or results[0] in graph.output_data or results[0] in graph.input_data:
        return None
    readers = [c for c in graph.compute_nodes if results[0] in c.needs]  # (a shape read needs nothing alive)
    if len(readers) != 1 or readers[0].kind is not ComputeKind.FORWARD:
        return None
    return readers[0].name


def forward_runs(graph: CDGraph) -> list[list[str]]:
    """The runs of ``graph``'s forwards (module docstring), each in order; runs of one
    forward left out."""
    forwards = graph.forward_nodes()
    position = {c.name: i for i, c in enumerate(forwards)}
    # decided from the last forward back: k joins the run of its only reader j when that run
    # starts right after k and k's result is no smaller than the run's
    last_of: dict[str, str] = {}
    first_of: dict[str, int] = {}
    for node in reversed(forwards):
        reader = _only_reader(graph, node)
        last = last_of.get(reader) if reader is not None else None
        if last is not None and first_of[last] == position[node.name] + 1 and \
                _result_bytes(graph, node) >= _result_bytes(graph, graph.compute(last)):
            last_of[node.name] = last
            first_of[last] = position[node.name]
        else:
            last_of[node.name] = node.name
            first_of[node.name] = position[node.name]
    runs: dict[str, list[str]] = {}
    for node in forwards:
        runs.setdefault(last_of[node.name], []).append(node.name)
    return [names for names in runs.values() if len(names) > 1]
