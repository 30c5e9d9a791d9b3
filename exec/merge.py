"""Merged autograd islands: a node whose only reader always runs right after it shares its island.

Each simplified node is normally an autograd island of its own (Rockmate, ICML 2023, section
5): its outputs are detached into leaves, and its backward is one nested call of the autograd
engine from those leaves' gradients. On small operations that costs more than the operation
(a nested engine call, a leaf, a gradient hook: tens of microseconds per node on CPU). When a
node ``a`` is read with grad by one node ``b`` only, and the schedule always runs ``fwd_b``
with grad right after ``fwd_a`` with grad and ``bwd_a`` right after ``bwd_b`` (only forgets in
between, none of ``a``'s data in the forward, where runs of nodes without grad may come in
between too: a dropout's mask), ``b`` can read ``a``'s outputs directly instead of through leaves: ``b``'s
backward then runs ``a``'s in the same engine call, exactly as eager PyTorch would (the
gradient reaches ``a``'s backward without a leaf in between: same tensor, same layout).

The one difference with the schedule is when the forgets between ``bwd_b`` and ``bwd_a`` take
effect: after ``a``'s backward rather than before it. :func:`plan_merges` replays the
schedule as it will really run (:func:`executed_order`) in the simulator and keeps only the
merges under which the peak stays within the plan's predicted peak: the budget promise holds.
"""

from __future__ import annotations

from solvers.schedule import Compute, Forget, Operation, Schedule
from solvers.simulate import simulate

__all__ = ["merge_candidates", "without_shared_reads", "closed_merges", "grad_readers", "plan_merges", "executed_order",
           "executed_positions", "same_call"]


def grad_readers(graph, infos) -> dict[str, list[str]]:
    """Each node -> the nodes requiring grad that read one of its tensors, in graph order."""
    found: dict[str, list[str]] = {node.name: [] for node in graph.nodes}
    for reader in graph.nodes:
        if infos[reader.name].requires_grad:
            for holder in graph.reads(reader):
                if holder in found:  # (a node, not a global)
                    found[holder].append(reader.name)
    return found


def merge_candidates(graph, infos) -> dict[str, str]:
    """``a -> b`` for every node ``a`` that requires grad (its exported tensors too, none of
    them a model output), ``b`` the first of the nodes that read it with grad. Nodes without
    grad may read it too (a dropout's mask, made like its input: they read ``a``'s data, which
    the merged island still holds); where other nodes read it with grad, the merge stands only
    if they share ``b``'s island too (:func:`closed_merges`). Independent of the schedule."""
    outputs = {graph.owner.get(name, name) for name in graph.outputs}
    candidates = {}
    for name, with_grad in grad_readers(graph, infos).items():
        info = infos[name]
        if name in outputs or not info.requires_grad or not info.exported or not with_grad:
            continue
        if all(info.exported_requires_grad[o] for o in info.exported):
            candidates[name] = with_grad[0]
    return candidates


def chain_heads(merges: dict[str, str]) -> dict[str, str]:
    """Each node of a merged island -> the island's first node (following ``a -> b`` back)."""
    merged_into = {b: a for a, b in merges.items()}
    heads: dict[str, str] = {}
    for node in set(merges) | set(merges.values()):
        head = node
        while head in merged_into:
            head = merged_into[head]
        heads[node] = head
    return heads


def closed_merges(merges: dict[str, str], readers: dict[str, list[str]]) -> dict[str, str]:
    """The merges whose ``a`` has every reader with grad (``readers``) in its own island:
    each such reader reads ``a``'s outputs directly. Merges are dropped until that holds (a
    drop splits an island, which may leave another reader outside)."""
    merges = dict(merges)
    while True:
        heads = chain_heads(merges)
        dropped = [a for a in merges
                   if any(heads.get(reader, reader) != heads[a] for reader in readers.get(a, ()))]
        if not dropped:
            return merges
        for a in dropped:
            del merges[a]


def compute_positions(ops: list[Operation]) -> dict[str, list[int]]:
    """The positions of each compute node's runs in ``ops``."""
    positions: dict[str, list[int]] = {}
    for i, op in enumerate(ops):
        if isinstance(op, Compute):
            positions.setdefault(op.node, []).append(i)
    return positions


def _fits_schedule(ops: list[Operation], a: str, b: str, positions: dict[str, list[int]] | None = None,
                   between: frozenset[str] = frozenset()) -> bool:
    """``fwd_b`` (grad) after each ``fwd_a`` (grad) and only there, with only forgets of other
    data and runs of the nodes without grad ``between`` (a dropout's mask, drawn between its
    input and its product) in between; ``bwd_a`` after
    ``bwd_b`` with only forgets in between. ``positions``: :func:`compute_positions` of
    ``ops`` (only the runs of the four nodes are looked at)."""
    positions = compute_positions(ops) if positions is None else positions
    fwd_a, fwd_b, bwd_a, bwd_b, a_data = f"fwd_{a}", f"fwd_{b}", f"bwd_{a}", f"bwd_{b}", f"{a}.data"
    passable = {f"fwd_{n}" for n in between}

    def with_grad(op: Operation | None, node: str) -> bool:
        return isinstance(op, Compute) and op.node == node and op.with_grad

    def neighbour(i: int, step: int, skip_own: bool = True, forward: bool = False) -> Operation | None:
        """The first operation from ``i`` on (in direction ``step``) that is not a forget (of
        data other than ``a``'s, with ``skip_own``), nor, in the ``forward``, a run of a node
        ``between``."""
        i += step
        while 0 <= i < len(ops) and (
                isinstance(ops[i], Forget) and (not skip_own or ops[i].node != a_data)
                or forward and isinstance(ops[i], Compute) and ops[i].node in passable):
            i += step
        return ops[i] if 0 <= i < len(ops) else None

    for i in positions.get(fwd_a, ()):
        if ops[i].with_grad and not with_grad(neighbour(i, 1, forward=True), fwd_b):
            return False
    for i in positions.get(fwd_b, ()):
        if ops[i].with_grad and not with_grad(neighbour(i, -1, forward=True), fwd_a):
            return False
    backwards_b = positions.get(bwd_b, ())
    if not backwards_b or min(positions.get(bwd_a, [len(ops)])) < backwards_b[0]:
        return False  # (a bwd_a before the first bwd_b)
    for i in backwards_b:
        after = neighbour(i, 1, skip_own=False)
        if not (isinstance(after, Compute) and after.node == bwd_a):
            return False
    return True


def executed_order(schedule: Schedule, merged: dict[str, str]) -> Schedule:
    """The order in which a schedule really runs with ``merged`` islands (``a -> b``): the
    backwards of a merged chain run together at its last node's ``bwd``, and the forgets
    that the schedule placed between them take effect after the whole chain."""
    return Schedule([schedule.ops[i] for i in executed_positions(schedule, merged)])


def same_call(schedule: Schedule, merged: dict[str, str]) -> set[int]:
    """Indices, in :func:`executed_order`, of the backwards that run in the engine call of the
    one before them (``simulate``'s ``same_call``)."""
    absorbed = {f"bwd_{a}" for a in merged}
    return {i for i, op in enumerate(executed_order(schedule, merged).ops)
            if isinstance(op, Compute) and op.node in absorbed}


def executed_positions(schedule: Schedule, merged: dict[str, str]) -> list[int]:
    """:func:`executed_order` as positions in ``schedule.ops``."""
    absorbed_by = {f"bwd_{b}": f"bwd_{a}" for a, b in merged.items()}
    ops = schedule.ops
    out: list[int] = []
    i = 0
    while i < len(ops):
        op = ops[i]
        if isinstance(op, Compute) and op.node in absorbed_by:
            deferred: list[int] = []
            out.append(i)
            node = op.node
            i += 1
            while node in absorbed_by:
                while isinstance(ops[i], Forget):
                    deferred.append(i)
                    i += 1
                assert ops[i].node == absorbed_by[node]  # checked by _fits_schedule
                out.append(i)
                node = ops[i].node
                i += 1
            out += deferred
            continue
        out.append(i)
        i += 1
    return out


def without_shared_reads(graph, merges: dict[str, str]) -> dict[str, str]:
    """The merges that keep every merged island from reading one tensor in two of its nodes.

    Eager PyTorch sums all the gradient contributions to a tensor read several times (a
    parameter of an unrolled RNN) before adding them to its ``.grad``; islands add them one
    island at a time, in the same order, which rounds the same way only when each island
    brings one contribution. Two results of one node are two tensors (the query, key and value
    pieces of a split projection, each a leaf of its own: its gradient is never summed with
    another's). The outputs of a node merged into the island are no leaves: its readers there
    read them directly, and the engine sums their contributions as eager's does. Merges are
    taken in graph order.
    """
    chain_of: dict[str, str] = {}  # node -> first node of its merged chain
    reads: dict[str, set[str]] = {}  # first node of a chain -> tensors its nodes read
    kept: dict[str, str] = {}
    merged_into = {b: a for a, b in merges.items()}
    for node in graph.nodes:
        b = node.name
        a = merged_into.get(b)
        head = chain_of.get(a) if a is not None else None

        def inside(owner: str) -> bool:  # (a node merged into this island: read directly)
            return owner == b or owner == a or (owner in kept and chain_of.get(owner) == head)

        mine = {arg.name for line in node.lines for arg in line.all_input_nodes
                if not inside(graph.owner.get(arg.name, arg.name))}
        if head is not None and not reads[head] & mine:
            kept[a] = b
            chain_of[b] = head
            reads[head] |= mine
            continue
        chain_of[b] = b
        reads[b] = set(mine)
    return kept


def plan_merges(graph, schedule: Schedule, infos, cdgraph=None, peak_limit: int | None = None,
                first_run_bytes=None) -> dict[str, str]:
    """The merges (``a -> b``) the executor applies to ``schedule``.

    Every structurally valid merge is kept when no CD-graph is given (schedules written by
    hand, with no budget); with ``cdgraph`` and ``peak_limit`` (the plan's simulated peak,
    with the first-run memory ``first_run_bytes`` of ``Plan``), merges are added by groups (all,
    else each half in turn) and kept only if the simulated peak of the executed order stays
    within ``peak_limit``: a merged backward runs the absorbed one earlier, and with it what that
    one allocates the first time (an input's gradient).
    """
    ops = schedule.ops
    positions = compute_positions(ops)
    without_grad = frozenset(name for name, info in infos.items() if not info.requires_grad)
    candidates = {a: b for a, b in merge_candidates(graph, infos).items()
                  if _fits_schedule(ops, a, b, positions, without_grad)}
    readers = grad_readers(graph, infos)

    def consistent(merges: dict[str, str]) -> dict[str, str]:
        """Without shared reads and closed, each in view of the other (a dropped merge makes its
        node's outputs leaves again, which an island may then read twice)."""
        while True:
            kept = closed_merges(without_shared_reads(graph, merges), readers)
            if kept == merges:
                return kept
            merges = kept

    candidates = consistent(candidates)
    if cdgraph is None or peak_limit is None:
        return candidates
    def peak(merges: dict[str, str]) -> int:
        return simulate(cdgraph, executed_order(schedule, merges), first_run_bytes=first_run_bytes,
                        same_call=same_call(schedule, merges)).peak_bytes

    accepted: dict[str, str] = {}

    def admit(pending: list[tuple[str, str]]) -> None:
        """Keep ``pending`` (merges in graph order) if they fit together with those kept so far,
        else each half in turn: a simulation per group instead of one per merge (a 24-layer
        Llama planned with recomputation: 484 simulations of its whole schedule, 20 s, before)."""
        nonlocal accepted
        trial = consistent({**accepted, **dict(pending)})
        if peak(trial) <= peak_limit:
            accepted = trial
        elif len(pending) > 1:
            middle = len(pending) // 2
            admit(pending[:middle])
            admit(pending[middle:])

    if candidates:
        admit(list(candidates.items()))
    return accepted
