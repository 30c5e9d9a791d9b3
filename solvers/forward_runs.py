"""Runs of forwards that only feed each other: recomputed as a whole by rk-Checkmate.

rk-Checkmate's model (``solvers.checkmate_ilp``) has a recomputation variable per forward and
stage, and most forwards of a transformer block are small steps whose result nobody but the
next step reads: a rotary embedding's slices, cat and products, a norm's square, mean and root,
a scale and a mask before a softmax. A *run* is a range of consecutive forwards ``k, ..., j``
where every member but the last has one result, read by a later member of the run only (no
backward reads it, no other forward, it is not a block output). Such a result is not worth
keeping across stages unless it is a checkpoint: a backward never reads it, and keeping the
run's result instead costs no more bytes and saves the whole run's time, but where the result
is smaller than the run's and computing it takes more than ``CHEAP_SHARE`` of the block's
forward time (a projection before a bigger expansion: Llama's rotated keys before their
repetition over the query heads, a small matmul before a big activation), keeping it is a plan
of its own: the run is cut after it. So the ILP recomputes a run as a whole (one variable per
run and stage) and frees its inner results within the stage that makes them
(``RkCheckmateILP(whole_runs=True)``); its memory is still counted operation by operation, so
the options keep their exact figures. It is a coarsening of the choices only, not of the graph:
each run is one decision per stage, as the issue on planning speed suggested ("presolve of
nodes whose decision is forced"). Runs are contiguous ranges of the forwards, so the first runs
keep the program's order.

Measured (10 x 10 grid, CBC, 1% gap, 2 workers, this 2-core CPU, with the repairs' starts
completed to whole runs): the 59-compute attention class of a Llama of GPT-2 small's width
16.7 s -> 6.8 s (23 of its 29 forwards in 6 runs), its options at the grid's 100 pairs as
fast as before on average (at most 0.75% slower at a pair, the ILP's gap is 1%); the tiny
Llama's class 18.7 -> 9.2 s (at most 1.4%, on average 0.14% slower); the tiny GPT-2's
31-compute class 6.0 -> 4.0 s with the same options. Merging every run regardless of the
sizes (a small result kept inside its run) was faster still but up to 7% slower on pairs of
the GPT-2 class; merging each run into one compute node of a smaller graph (its inputs then
held to its end) was 6x faster but raised the Llama class's smallest peak by 7%.
"""

from __future__ import annotations

from rkgb.cdgraph import CDGraph, ComputeKind, ComputeNode
from solvers.simulate import operation_outputs

__all__ = ["forward_runs", "CHEAP_SHARE"]

# a result smaller than its run's stays in the run where computing it from the run's inputs takes
# at most this share of the block's forward time: keeping it would save that little
CHEAP_SHARE = 0.02


def _result_bytes(graph: CDGraph, node: ComputeNode) -> int:
    return sum(graph.size(d) for d in operation_outputs(graph, node, False))


def _only_reader(graph: CDGraph, node: ComputeNode) -> str | None:
    """The forward that alone reads ``node``'s only result, where nothing else does (no
    backward, not the loss, not a block output); None otherwise."""
    results = operation_outputs(graph, node, False)
    if len(results) != 1 or results[0] in graph.output_data or results[0] in graph.input_data:
        return None
    readers = [c for c in graph.compute_nodes if results[0] in c.needs]  # (a shape read needs nothing alive)
    if len(readers) != 1 or readers[0].kind is not ComputeKind.FORWARD:
        return None
    return readers[0].name


def _contiguous_runs(forwards: list[ComputeNode], reader_of: dict[str, str | None]) -> list[list[ComputeNode]]:
    """The maximal runs among ``forwards`` (consecutive in the graph): decided from the last
    back, k joins the run of its only reader j (``reader_of``) when j is among them and j's
    run starts right after k."""
    position = {c.name: i for i, c in enumerate(forwards)}
    last_of: dict[str, str] = {}
    first_of: dict[str, int] = {}
    for node in reversed(forwards):
        reader = reader_of[node.name]
        last = last_of.get(reader) if reader is not None else None
        if last is not None and first_of[last] == position[node.name] + 1:
            last_of[node.name] = last
            first_of[last] = position[node.name]
        else:
            last_of[node.name] = node.name
            first_of[node.name] = position[node.name]
    runs: dict[str, list[ComputeNode]] = {}
    for node in forwards:
        runs.setdefault(last_of[node.name], []).append(node)
    return list(runs.values())


def _checkpoint(graph: CDGraph, run: list[ComputeNode], cheap_s: float) -> int | None:
    """The last member of ``run`` worth keeping on its own: a result smaller than the run's
    whose computation from the run's inputs (it and the members it depends on) takes more
    than ``cheap_s``; None if there is none."""
    root_bytes = _result_bytes(graph, run[-1])
    producer = {d: i for i, c in enumerate(run) for d in c.produces}
    for i in reversed(range(len(run) - 1)):
        node = run[i]
        if _result_bytes(graph, node) >= root_bytes:
            continue
        ancestors, todo = set(), [i]
        while todo:
            j = todo.pop()
            if j not in ancestors:
                ancestors.add(j)
                todo += [producer[d] for d in run[j].needs if d in producer]
        if sum(run[j].time_s for j in ancestors) > cheap_s:
            return i
    return None


def forward_runs(graph: CDGraph) -> list[list[str]]:
    """The runs of ``graph``'s forwards (module docstring), each in order; runs of one
    forward left out."""
    forwards = graph.forward_nodes()
    cheap_s = CHEAP_SHARE * sum(c.time_s for c in forwards)
    reader_of = {c.name: _only_reader(graph, c) for c in forwards}
    found: list[list[ComputeNode]] = []
    pending = [forwards]
    while pending:
        for run in _contiguous_runs(pending.pop(), reader_of):
            cut = _checkpoint(graph, run, cheap_s)
            if cut is None:
                found.append(run)
            else:  # the two sides apart (each split into valid runs again)
                pending += [run[:cut + 1], run[cut + 1:]]
    runs = [[c.name for c in run] for run in found if len(run) > 1]
    order = {c.name: i for i, c in enumerate(forwards)}
    return sorted(runs, key=lambda run: order[run[0]])
