"""One simulator for every schedule: validity, peak memory and time on a CD-graph.

The simulator is the single source of truth of the solvers: every solver builds a schedule,
replays it here, and reports the peak and time measured here (as Checkmate does with its
``Scheduler``; Jain et al., "Checkmate: Breaking the Memory Wall with Optimal Tensor
Rematerialization", MLSys 2020). The memory model is the one of ``rkgb.cdgraph``:

- the memory is the sum of the sizes of the storages of the alive data nodes, except
  ``graph.input_data`` (owned by whoever runs before: the user for a model, the previous block
  for a block). A data node has its own storage, but for a gradient whose first contribution
  is an alias (``ComputeNode.aliases``): it shares the storage of the gradient it aliases,
  which is counted once and freed when the last of them is forgotten;
- while a compute node runs, the memory also holds its temporary memory
  (``ComputeNode.overhead(with_grad)``) and the new memory of what it produces: every data
  node a forward produces, counted in full even when that node is already alive (a
  recomputation holds the old and the new copy until the operation ends); for each gradient
  a backward (or the loss) produces, as the executor accumulates it (autograd's
  ``InputBuffer``): a first contribution is the gradient's (new memory unless it is an alias
  of a part of the backward's own gradient); a contribution to a gradient that is alive waits
  (new memory unless it is such an alias) until the next compute node starts (or the schedule
  ends): as eager's engine, which adds a node's outputs into the next buffers only after
  releasing its inputs, the executor adds it after the forgets that follow the backward. Then
  it is added in place into a gradient whose storage nothing else holds (eager's buffer steals
  it), or into a new tensor (``old + grad``) where the storage is shared (an alias of another
  gradient), the old one released;
- a backward whose incoming gradient has no other holder (``_Storages.held_alone``) counts
  ``ComputeNode.handoff_overhead_bytes`` as its temporary memory: the executor hands that
  gradient over to the engine, which frees it once used (``rkgb.gradsink.handoff``);
- ``Compute(fwd_x, with_grad=False)`` produces no phantoms;
- ``bwd_x`` needs, besides its ``needs``, ``x.grad`` and ``x.phantoms`` (when those nodes
  exist), and consumes the phantoms: they cannot serve another backward;
- a backward node and the loss run at most once (running a backward twice would accumulate
  its gradients twice).

This module also holds :func:`schedule_from_computes`, which turns a sequence of compute
nodes into a schedule with the fewest bytes alive at every step (forget right after the last
use, phantoms only when a backward will read them). Every solver builds its schedules with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rkgb.cdgraph import CDGraph, ComputeKind, ComputeNode, DataKind, FirstRun, data_name, input_grad_key, views_key_input
from solvers.schedule import Compute, Forget, Operation, Schedule

__all__ = [
    "InvalidSchedule",
    "gradient_profile",
    "SimulationResult",
    "simulate",
    "effective_needs",
    "operation_outputs",
    "phantoms_of",
    "schedule_from_computes",
]


class InvalidSchedule(ValueError):
    """A schedule breaks the execution semantics; the message names the operation and the rule."""


@dataclass
class SimulationResult:
    """What a replay measures.

    ``memory_during[i]`` is the memory while operation ``i`` runs (for a ``Forget``, the memory
    after it). ``alive_after_forward`` is the set alive just before the loss (``None`` when
    the schedule has no loss) and ``saved_bytes`` its size.
    """

    peak_bytes: int
    time_s: float
    memory_during: list[int]
    alive_at_end: set[str]
    saved_bytes: int = 0
    alive_after_forward: set[str] | None = None
    forward_peak_bytes: int = 0
    backward_peak_bytes: int = 0
    forward_time_s: float = 0.0
    backward_time_s: float = 0.0
    peak_index: int = -1
    memory_at_end: int = 0
    notes: list[str] = field(default_factory=list)


class _Storages:
    """Which storage each part of each alive data node holds, and the bytes of those held.

    A data node is one tensor (one part), or several for a gradient (``DataNode.parts``); each
    part holds a storage, its own or one it shares (an alias). ``memory`` is the bytes of the
    storages held, each counted once.
    """

    def __init__(self, graph: CDGraph, uncounted: set[str]) -> None:
        self.graph = graph
        self.uncounted = uncounted  # data nodes whose storages are not counted (inputs)
        self.storage: dict[str, list[int | None]] = {}  # alive node -> storage of each part
        self.holders: dict[int, int] = {}
        self.bytes: dict[int, int] = {}
        # contributions waiting to be added into alive gradients: (node, part, storage, optional:
        # made by a backward that a step may not run, ComputeNode.optional)
        self.pending: list[tuple[str, int, int, bool]] = []
        self.shared: set[int] = set()  # storages that another tensor shares (ComputeNode.shared)
        # shared storages that the gradient holds alone all the same (ComputeNode.owned: a view
        # of a result of its own size; the outputs' gradients from the loss, exec.runtime)
        self.owned: set[int] = set()
        # the gradients of model inputs (FirstRun keys), held as data nodes of one part each
        self.first_run_sizes: dict[str, int] = {}
        # storages of model inputs' gradients that are dense tensors of their own (FirstRun.owned,
        # and the sums made of them): a later contribution is added in place once held alone
        self.addable: set[int] = set()
        # the storages of the last backward's groups (ComputeNode.together) -> storage
        self.made: dict[int, int] = {}
        # those storages that are one dense tensor passed to several gradients' parts: once one
        # holds it alone, a contribution is added into it in place (not a slice of a bigger one)
        self.whole: set[int] = set()
        self.memory = 0
        self._next = 0

    def _part_size(self, d: str, part: int) -> int:
        if d in self.first_run_sizes:
            return self.first_run_sizes[d]
        return 0 if d in self.uncounted else self.graph.data(d).part_sizes[part]

    def _hold(self, d: str, part: int, storage: int) -> None:
        parts = self.storage.setdefault(
            d, [None] * (1 if d in self.first_run_sizes else len(self.graph.data(d).part_sizes)))
        old = parts[part]
        parts[part] = storage
        self.holders[storage] += 1
        if self.holders[storage] == 1:
            self.memory += self.bytes[storage]
        if old is not None:
            self._release(old)

    def _hold_new(self, d: str, part: int, size: int = 0) -> int:
        """``part`` of ``d`` holds a new storage (of at least ``size`` bytes); return its bytes."""
        self._next += 1
        size = max(size, self._part_size(d, part))
        self.bytes[self._next] = size
        self.holders[self._next] = 0
        self._hold(d, part, self._next)
        return size

    def _release(self, storage: int) -> None:
        self.holders[storage] -= 1
        if self.holders[storage] == 0:
            self.memory -= self.bytes.pop(storage)
            del self.holders[storage]
            self.shared.discard(storage)
            self.owned.discard(storage)
            self.addable.discard(storage)
            self.whole.discard(storage)

    def held_alone(self, d: str) -> bool:
        """Whether each storage of gradient ``d`` (alive) has no holder but ``d`` (the engine
        frees it once used where it is handed over): not an alias of another gradient, not a
        slice of a bigger tensor (``shared`` but not ``owned``), not waiting to be added."""
        return all(storage is None or (self.holders[storage] == 1
                                       and (storage not in self.shared or storage in self.owned))
                   for storage in self.storage.get(d, ()))

    def add(self, d: str) -> int:
        """``d`` becomes alive with new storages (replacing its old ones); return their bytes.
        (:meth:`_hold_new` for each part, inlined: the simulator's most frequent step)"""
        sizes = self.graph.data(d).part_sizes
        parts = self.storage.get(d)
        if parts is None:
            parts = self.storage[d] = [None] * len(sizes)
        counted = d not in self.uncounted
        total = 0
        for i, size in enumerate(sizes):
            size = size if counted else 0
            self._next += 1
            self.bytes[self._next] = size
            self.holders[self._next] = 1
            self.memory += size
            old, parts[i] = parts[i], self._next
            if old is not None:
                self._release(old)
            total += size
        return total

    def hold_for_user(self, d: str) -> None:
        """``d``'s storages get one more holder that never lets go (the user's output)."""
        for storage in self.storage.get(d, ()):
            if storage is not None:
                self.holders[storage] += 1

    def forget(self, d: str) -> None:
        for i, storage in enumerate(self.storage.pop(d)):
            if storage is not None:
                self._release(storage)

    def _new(self, size: int) -> int:
        """A new storage of ``size`` bytes held once (by a waiting contribution)."""
        self._next += 1
        self.bytes[self._next] = size
        self.holders[self._next] = 1
        self.memory += size
        return self._next

    def compute(self, node: ComputeNode, outputs: list[str]) -> int:
        """Apply ``node``'s productions; return the new bytes it holds while it runs (those of
        the contributions that wait for :meth:`flush` included)."""
        # the new storages that several parts' contributions are views of (ComputeNode.together),
        # for contribute_first_run too
        made = self.made = {}
        if node.kind is ComputeKind.FORWARD:
            return sum(self.add(d) for d in outputs)
        before = self.memory
        own = self.storage.get(data_name(node.target, DataKind.GRAD))
        for d in outputs:
            count = len(self.graph.data(d).part_sizes)
            parts = self.storage.setdefault(d, [None] * count)
            sources = node.aliases.get(d, ())
            groups = node.together.get(d, ())
            each = node.contribution_aliases.get(d)  # per contribution, where of both kinds
            for k, i in enumerate(node.contributes.get(d, range(count))):
                j = each[k] if each is not None else (sources[i] if i < len(sources) else -1)
                alias = own[j] if j >= 0 and own is not None and own[j] is not None else None
                group = groups[i] if alias is None and i < len(groups) else -1
                if group >= 0 and group in made:
                    alias = made[group]  # a view of a storage another part's contribution made
                if parts[i] is None:  # the first contribution: the gradient's own
                    if alias is not None:
                        self._hold(d, i, alias)
                    else:
                        self._hold_new(d, i, self._group_size(node, group))
                        if group >= 0:
                            self._made_for_group(node, group, parts[i])
                        elif i in node.shared.get(d, ()):
                            self.shared.add(parts[i])
                            if i in node.owned.get(d, ()):
                                self.owned.add(parts[i])
                    continue
                # a contribution to a gradient alive: it waits for the flush
                if alias is not None:
                    self.holders[alias] += 1
                    storage = alias
                else:
                    size = 0 if d in self.uncounted else self.graph.data(d).part_sizes[i]
                    storage = self._new(max(size, self._group_size(node, group)))
                    if group >= 0:
                        self._made_for_group(node, group, storage)
                self.pending.append((d, i, storage, node.optional))
        return self.memory - before

    def _made_for_group(self, node: ComputeNode, group: int, storage: int) -> None:
        """``storage`` is the new storage of ``node``'s group ``group`` (ComputeNode.together):
        the other parts' contributions of the group hold it too (so nothing adds into it in place
        while they do), and a whole tensor takes a later contribution in place once held alone."""
        self.made[group] = storage
        self.shared.add(storage)
        if node.together_storages[group][1]:
            self.whole.add(storage)

    def _group_size(self, node: ComputeNode, group: int) -> int:
        """The bytes of the new storage ``group`` of ``node`` (ComputeNode.together); 0 for -1
        and where every part it goes to is uncounted (a graph's input gradient)."""
        if group < 0 or all(d in self.uncounted for d, groups in node.together.items() if group in groups):
            return 0
        return node.together_storages[group][0]

    def contribute_first_run(self, node: ComputeNode, entry: FirstRun) -> int:
        """A contribution of ``node`` to a model input's gradient (``entry``, accumulating) as
        the executor's sink takes it: the first one becomes the gradient, a later one waits for
        the flush (which adds it into a new sum); either shares the storage of the node's own
        gradient where it is a part of it (``entry.alias``), else is a new tensor. Return the new
        bytes."""
        before = self.memory
        d = _FIRST_RUN + entry.key
        self.first_run_sizes[d] = entry.bytes
        own = self.storage.get(data_name(node.target, DataKind.GRAD)) if entry.alias >= 0 else None
        alias = own[entry.alias] if own is not None and entry.alias < len(own) else None
        if alias is None and entry.together >= 0:
            # the storage that the node's contributions to gradients' parts are views of too
            alias = self.made.get(entry.together)
        if d not in self.storage:
            if alias is not None:
                self._hold(d, 0, alias)
            else:
                self._hold_new(d, 0)
            # a dense tensor of its own, or the node's own gradient passed on where nothing else
            # shares that (once the node's gradient goes, the sink's alone: added into in place)
            if entry.owned or (alias is not None and alias not in self.shared):
                self.addable.add(self.storage[d][0])
        elif alias is not None:
            self.holders[alias] += 1
            self.pending.append((d, 0, alias, node.optional))
        else:
            self.pending.append((d, 0, self._new(entry.bytes), node.optional))
        return self.memory - before

    def join_views(self, key: str, size: int, owned: bool) -> int:
        """The sum of a model input's view group (``size`` bytes, counted apart until now) joins
        the input's gradient ``key`` (:func:`rkgb.cdgraph.input_views_key`, ``FirstRun.delivery``,
        ``rkgb.gradsink.GradientQueue.deliver``): it becomes the gradient where there is none yet
        (a dense tensor of its own where ``owned``: later contributions are added into it in
        place), else it is added into it, in place where the gradient is a dense tensor held
        alone, else into a new sum (``old + grad``). Return the new bytes while it joins, the
        group's sum still there (the caller frees it after)."""
        d = _FIRST_RUN + key
        if d not in self.storage:
            self.first_run_sizes[d] = size
            self._hold_new(d, 0)
            if owned:
                self.addable.add(self.storage[d][0])
            return 0
        if not self._sums_anew(d, self.storage[d][0]):
            return 0
        made = self._hold_new(d, 0)  # then the old one goes
        self.addable.add(self.storage[d][0])
        return made

    def _sums_anew(self, d: str, held: int) -> bool:
        """Whether a contribution joins ``d``'s storage ``held`` as a new tensor (``old + grad``):
        where another holder keeps it, where it is shared (a slice of a bigger tensor, an alias),
        or for a model input's gradient, unless the inspection saw a dense tensor of its own
        there (else a view of a bigger tensor, an expanded one, or a group's sum); a group's one
        tensor passed to several parts (``whole``) is the gradient's alone once the others are
        gone: added into in place, as the executor's sink does."""
        return self.holders[held] > 1 or (held in self.shared and held not in self.whole) or \
            (d in self.first_run_sizes and held not in self.addable and held not in self.whole)

    def release_first_run(self, key: str) -> None:
        """The gradient of first-run ``key`` (accumulating) joins another and is freed."""
        d = _FIRST_RUN + key
        for waiting in [waiting for waiting in self.pending if waiting[0] == d]:
            self.pending.remove(waiting)
            self._release(waiting[2])
        if d in self.storage:
            self.forget(d)

    def flush(self, only: str | None = None) -> int:
        """Add the waiting contributions (to gradient ``only``, or all) into their gradients;
        return the peak while it runs: what was there, plus the new sums whose old gradient
        another holder keeps (fuzz seed 65: `tanh(x)` read by two adds that pass one gradient
        on: two sums beside it), plus the biggest of the other new sums (the executor hands the
        contributions over in the order the engine made them, which the CD-graph does not know:
        a sum may come before the contributions added in place are freed)."""
        start = self.memory
        # the new sums whose old gradient another holder keeps (an alias, a contribution still
        # waiting: their storages stay to the flush's end) add up; of the others, whose old one
        # goes at once, the biggest
        lasting = biggest = 0
        flushed = [entry for entry in self.pending if only is None or entry[0] == only]
        for d, i, storage, optional in flushed:
            held = self.storage[d][i]
            if self._sums_anew(d, held):
                if self.holders[held] > 1:
                    lasting += self._part_size(d, i)
                else:
                    biggest = max(biggest, self._part_size(d, i))
                # (a step that does not run the backward that made it keeps the old one: a
                # later contribution is added as into that one, ComputeNode.optional)
                kept = [kind for kind in (self.shared, self.owned, self.addable, self.whole) if held in kind] \
                    if optional else []
                self._hold_new(d, i)  # then the old one goes
                new = self.storage[d][i]
                for kind in kept:
                    kind.add(new)
                if d in self.first_run_sizes and not optional:
                    self.addable.add(new)  # old + grad: a dense tensor of its own
            self._release(storage)  # the contribution (added in place into a gradient held alone)
        self.pending = [entry for entry in self.pending if entry not in flushed]
        return start + lasting + biggest


_FIRST_RUN = "first run: "  # the data-node names of the model inputs' gradients in _Storages


def _flush(storages: _Storages, kept: int, waiting: list[int]) -> int:
    """Flush the waiting contributions (the CD-graph's, and the first-run gradients', each a new
    sum while the old one and it live); return the peak while it runs.

    The executor hands them over in the order the engine made them, mixed: the peak is what
    was there before, plus the biggest sum made while all the others still wait."""
    if not waiting and not storages.pending:
        return storages.memory + kept
    before = storages.memory + kept + sum(waiting)
    extra = storages.flush() - (before - kept - sum(waiting))
    peak = before + max([extra] + waiting)
    waiting.clear()  # each sum replaces its old gradient; the contributions go
    return peak


def _contribute_deferred(storages: _Storages, kept: int, waiting: list[int], deferred: list,
                         first_runs: set[str]) -> int:
    """The contributions of ``deferred`` (``FirstRun.after_flush``: (node, entry) pairs) made
    and joined one after the other, once the others have joined; return the peak while they are."""
    peak = 0
    for node, entry in deferred:
        storages.contribute_first_run(node, entry)
        first_runs.add(entry.key)
        # the view's backward made its result beside the group's sum, which is freed before the
        # result joins the gradient (rkgb.gradsink.GradientQueue._join)
        peak = max(peak, storages.memory + kept + sum(waiting))
        for key in entry.releases:
            if key in first_runs:
                first_runs.discard(key)
                storages.release_first_run(key)
        peak = max(peak, _flush(storages, kept, waiting))
    return peak


def phantoms_of(graph: CDGraph, node: ComputeNode) -> str | None:
    """Name of the phantoms data node of a forward or backward node, or None if it has none."""
    name = data_name(node.target, DataKind.PHANTOMS)
    return name if graph.has_data(name) else None


def _memoized(graph: CDGraph, node: ComputeNode, figure, *args) -> list[str]:
    """``figure(graph, node, *args)``, kept on the graph for the next calls (graphs are not
    changed after they are built; the node itself is kept with the result, so that a node of
    another graph with the same name is never confused with it). The simulator asks for a
    node's needs and outputs several times per operation: memoized, the option grid of a
    59-compute class spends a third less time in its 2000 simulations."""
    return list(_memo(graph, node, figure, *args))


def _memo(graph: CDGraph, node: ComputeNode, figure, *args) -> tuple[str, ...]:
    """:func:`_memoized` without the copy, for the simulator's own loops, which only read it
    (the copies were 8% of a repair's schedule and simulation on the Llama attention class)."""
    memo = graph.__dict__.get("_structure_memo")
    if memo is None:
        memo = graph.__dict__["_structure_memo"] = {}
    key = (figure, id(node), args)
    found = memo.get(key)
    if found is None or found[0] is not node:
        found = memo[key] = (node, tuple(figure(graph, node, *args)))
    return found[1]


def _needs(graph: CDGraph, node: ComputeNode) -> list[str]:
    needs = list(node.needs)
    if node.kind is ComputeKind.BACKWARD:
        for extra in (data_name(node.target, DataKind.GRAD), phantoms_of(graph, node)):
            if extra is not None and graph.has_data(extra) and extra not in needs:
                needs.append(extra)
    return needs


def _outputs(graph: CDGraph, node: ComputeNode, with_grad: bool) -> list[str]:
    outputs = [d for d in node.produces if graph.data(d).kind is not DataKind.PHANTOMS]
    if node.kind is ComputeKind.FORWARD and with_grad:
        phantoms = phantoms_of(graph, node)
        if phantoms is not None:
            outputs.append(phantoms)
    return outputs


def effective_needs(graph: CDGraph, node: ComputeNode) -> list[str]:
    """The data nodes that must be alive while ``node`` runs (its ``needs``, plus a backward's
    own gradient and phantoms)."""
    return _memoized(graph, node, _needs)


def operation_outputs(graph: CDGraph, node: ComputeNode, with_grad: bool = True) -> list[str]:
    """The data nodes that ``Compute(node, with_grad)`` makes alive."""
    return _memoized(graph, node, _outputs, with_grad)


def simulate(
    graph: CDGraph,
    schedule: Schedule | list[Operation],
    *,
    keep_outputs: bool = True,
    initially_alive: set[str] | None = None,
    first_run_bytes: dict[str, tuple[FirstRun, ...]] | None = None,
    same_call: set[int] | None = None,
) -> SimulationResult:
    """Replay ``schedule`` on ``graph``; return its peak memory and time.

    Parameters
    ----------
    graph
        The CD-graph whose node names the schedule uses (a class graph or a whole model's).
    schedule
        The operations to replay.
    keep_outputs
        When True (a whole model), ``graph.held_outputs`` may never be forgotten: the user holds
        the model's outputs (but those the step drops, ``CDGraph.dropped_outputs``). Their
        gradients are the executor's (the engine hands them over and lets go,
        :mod:`exec.runtime`), freed after their last use. Block options are simulated with False.
    initially_alive
        Data nodes alive at the start besides ``graph.input_data`` (counted in the memory).
    first_run_bytes
        Memory that compute nodes allocate at their first run and the executor keeps to the end
        of the step, by key (``ModelChain.first_run_bytes``: the generator state of a random
        node, the gradient of a model input): the first run of a node with a key allocates it
        (for ``only_if_rerun`` keys, only when the node runs again later in ``schedule``;
        ``until_loss`` keys are freed at the loss); a later run holds that much more while it
        runs (a replay saves the outer state, an accumulation adds into a new tensor).
    same_call
        Indices of backwards that run in the same engine call as the backward before them (a
        merged island, :mod:`exec.merge`): the contributions of that one wait through them.

    Returns
    -------
    SimulationResult

    Raises
    ------
    InvalidSchedule
        naming the operation: an unknown node, a compute whose input is not alive (use after
        free), a forget of a dead node (double free), of an input, of a kept output, a backward
        or loss run twice, a backward reading consumed phantoms, a gradient accumulated into
        after it was forgotten.
    """
    ops = schedule.ops if isinstance(schedule, Schedule) else list(schedule)
    inputs = set(graph.input_data)
    # the user holds the outputs (their gradients are the executor's, freed after their last use)
    protected = set(inputs) | (set(graph.held_outputs) if keep_outputs else set())
    alive: set[str] = set(inputs) | set(initially_alive or ())
    consumed: set[str] = set()
    forgotten_grads: set[str] = set()
    ran_once: set[str] = set()
    first_runs: set[str] = set()  # keys of first_run_bytes allocated so far
    runs: dict[str, int] = {}  # compute node -> how many times the schedule runs it
    for op in ops:
        if isinstance(op, Compute):
            runs[op.node] = runs.get(op.node, 0) + 1
    kept = 0  # their bytes
    released_by: dict[str, list] = {}  # compute node -> the first-run entries freed as it starts
    for entries in (first_run_bytes or {}).values():
        for entry in entries:
            if entry.until is not None and entry not in released_by.get(entry.until, []):
                released_by.setdefault(entry.until, []).append(entry)
    waiting: list[int] = []  # contributions to first-run gradients waiting for the next compute
    # the contributions made where view groups are delivered (FirstRun.after_flush): the compute
    # node before which they are (None: the backward's end) -> (node, entry)
    deliveries: dict[str | None, list] = {}
    held_back: list[str] = []  # backwards in the engine call of the one before (merged islands)
    # the sums of model inputs' view groups that join the inputs' gradients where the compute
    # node is about to start (the view's place in the backward); those of None stay to the end
    joins: dict[str, list[FirstRun]] = {}
    for name, entries in (first_run_bytes or {}).items():
        for entry in entries:
            if entry.after_flush and graph.has_compute(name):
                deliveries.setdefault(entry.delivery, []).append((graph.compute(name), entry))
            elif entry.delivery is not None and views_key_input(entry.key) is not None and \
                    entry not in joins.get(entry.delivery, ()):
                joins.setdefault(entry.delivery, []).append(entry)
    storages = _Storages(graph, inputs)
    for d in sorted(alive):
        storages.add(d)
    memory = storages.memory
    peak = memory
    peak_index = -1
    time_s = 0.0
    memory_during: list[int] = []
    alive_after_forward: set[str] | None = None
    saved = 0
    forward_peak = memory
    backward_peak = 0
    forward_time = backward_time = 0.0
    after_loss = False

    def where(i: int, op: Operation) -> str:
        return f"operation {i} ({op})"

    for i, op in enumerate(ops):
        if isinstance(op, Forget):
            if not graph.has_data(op.node):
                raise InvalidSchedule(f"{where(i, op)}: unknown data node {op.node!r}")
            if op.node not in alive:
                raise InvalidSchedule(
                    f"{where(i, op)}: {op.node!r} is not alive (double free, or never computed)"
                )
            if op.node in protected:
                what = "an input of the graph" if op.node in inputs else "a model output, held by the user"
                raise InvalidSchedule(f"{where(i, op)}: {op.node!r} is {what} and cannot be forgotten")
            alive.discard(op.node)
            consumed.discard(op.node)
            if graph.data(op.node).kind is DataKind.GRAD:
                forgotten_grads.add(op.node)
            storages.forget(op.node)
            memory = storages.memory
            memory_during.append(memory + kept + sum(waiting))
            continue
        if not isinstance(op, Compute):
            raise InvalidSchedule(f"{where(i, op)}: not a Compute or a Forget")
        if not graph.has_compute(op.node):
            raise InvalidSchedule(f"{where(i, op)}: unknown compute node {op.node!r}")
        node = graph.compute(op.node)
        # the contributions of the previous backward join their gradients (the executor
        # flushes them as the next compute starts)
        if same_call and i in same_call:
            # in the engine call of the backward before: only what that one gave this node's
            # gradient joins it (in the engine's buffer), the rest still waits
            flushed = storages.flush(only=data_name(node.target, DataKind.GRAD)) + kept + sum(waiting)
        else:
            flushed = _flush(storages, kept, waiting)
        # what is delivered or freed where this node's backward starts (for a backward in the
        # engine call of the one before, a merged island's: after that call, exec.codegen)
        releasing: list = []
        view_sums: list = []  # (FirstRun entries of inputs' view groups)
        if released_by or deliveries or joins:
            if same_call and i in same_call:
                held_back.append(node.name)
            else:
                for name in held_back + [node.name]:
                    if name in deliveries:  # view groups' backwards, while their sums are there
                        flushed = max(flushed, _contribute_deferred(storages, kept, waiting, deliveries.pop(name),
                                                                    first_runs))
                    releasing.extend(released_by.get(name, ()))
                    view_sums.extend(joins.pop(name, ()))
                held_back.clear()
        # the sums of the inputs' view groups whose place this is join the inputs' gradients
        for entry in view_sums:
            if entry.key in first_runs:
                first_runs.discard(entry.key)
                grad_key = input_grad_key(views_key_input(entry.key))
                before = storages.memory + kept + sum(waiting)
                flushed = max(flushed, before + storages.join_views(grad_key, entry.bytes, entry.owned))
                first_runs.add(grad_key)
                kept -= entry.bytes
        # then the view groups whose place this is join their bases' gradients (exec.codegen's
        # deliveries): a new sum (the base's gradient may be held elsewhere: the loss's) while
        # the group's own sum and the old gradient live (a shared parameter's sum, in_overhead,
        # is added into the old .grad in place)
        joined = [entry.bytes for entry in releasing if entry.key in first_runs and not entry.in_overhead]
        if joined:
            flushed = max(flushed, storages.memory + kept + sum(waiting) + max(joined))
        for entry in releasing:
            if entry.key in first_runs:
                first_runs.discard(entry.key)
                if entry.accumulates:  # a gradient of its own (a view group summed at its size)
                    storages.release_first_run(entry.key)
                else:
                    kept -= entry.bytes
        memory = storages.memory
        if flushed > peak:
            peak, peak_index = flushed, i
        backward_peak = max(backward_peak, flushed) if after_loss else backward_peak
        if node.kind is not ComputeKind.FORWARD:
            if node.name in ran_once:
                raise InvalidSchedule(
                    f"{where(i, op)}: {node.name!r} already ran; a backward or the loss runs once"
                )
            ran_once.add(node.name)
        if node.kind is ComputeKind.LOSS:
            if after_loss:
                raise InvalidSchedule(f"{where(i, op)}: second loss")
            # what the forward keeps only to its end (the buffers' new values) is gone
            for entries in (first_run_bytes or {}).values():
                for entry in entries:
                    if entry.until_loss and entry.key in first_runs:
                        first_runs.discard(entry.key)
                        kept -= entry.bytes
            alive_after_forward = set(alive)
            saved = memory
            after_loss = True
        for d in _memo(graph, node, _needs):
            if d not in alive:
                raise InvalidSchedule(
                    f"{where(i, op)}: needs {d!r}, which is not alive (use after free, or "
                    "never computed); compute it earlier or forget it later"
                )
            if d in consumed:
                raise InvalidSchedule(
                    f"{where(i, op)}: phantoms {d!r} were consumed by an earlier backward; "
                    "recompute the forward with grad first"
                )
        outputs = _memo(graph, node, _outputs, op.with_grad)
        for d in outputs:
            if d in forgotten_grads:
                raise InvalidSchedule(
                    f"{where(i, op)}: accumulates into gradient {d!r}, which was forgotten "
                    "after an earlier contribution (that contribution would be lost)"
                )
        if keep_outputs and node.kind is ComputeKind.FORWARD:
            for d in outputs:
                if d in alive and d in protected:
                    # a model output computed again: the user's tensor keeps the storage of
                    # the first run to the end of the step, beside the new one
                    storages.hold_for_user(d)
        overhead = node.overhead(op.with_grad or node.kind is not ComputeKind.FORWARD)
        if node.kind is ComputeKind.BACKWARD:
            overhead = node.backward_overhead(storages.held_alone(data_name(node.target, DataKind.GRAD)))
        added = storages.compute(node, outputs)
        again = 0
        for entry in (first_run_bytes or {}).get(node.name, ()):
            if entry.after_flush:  # made where its group is delivered (deliveries)
                continue
            if entry.accumulates and views_key_input(entry.key) is None:  # a model input's gradient
                added += storages.contribute_first_run(node, entry)
                first_runs.add(entry.key)
                continue
            if entry.key in first_runs:
                if entry.until is not None:  # held from the first run to its end: nothing more
                    pass
                elif entry.accumulates:  # a contribution that waits for the next compute node
                    waiting.append(entry.bytes)
                elif entry.only_if_rerun or entry.until_loss:  # the outer generator state, saved
                    again += entry.bytes  # while a replay runs (the buffers' values made again)
                # else: a buffer the later runs add into in place (a parameter's sum)
            elif not entry.only_if_rerun or runs[node.name] > 1:
                first_runs.add(entry.key)
                kept += entry.bytes
                if entry.in_overhead:  # in the node's measured temporary memory meanwhile
                    again -= entry.bytes
        during = memory + kept + sum(waiting) + again + overhead + added
        memory_during.append(max(during, flushed))
        if during > peak:
            peak, peak_index = during, i
        if node.kind is ComputeKind.FORWARD and not after_loss:
            forward_peak = max(forward_peak, during)
            forward_time += node.time_s
        elif node.kind is ComputeKind.BACKWARD:
            backward_peak = max(backward_peak, during)
            backward_time += node.time_s
        elif node.kind is ComputeKind.FORWARD:
            backward_peak = max(backward_peak, during)
            backward_time += node.time_s
        time_s += node.time_s
        for d in outputs:
            consumed.discard(d)
            alive.add(d)
        memory = storages.memory
        if node.kind is ComputeKind.BACKWARD:
            phantoms = phantoms_of(graph, node)
            if phantoms is not None:
                consumed.add(phantoms)
    flushed = _flush(storages, kept, waiting)
    left = [pair for pairs in deliveries.values() for pair in pairs]  # (at the end, the backward's)
    if left and after_loss:
        flushed = max(flushed, _contribute_deferred(storages, kept, waiting, left, first_runs))
    # the sum of an input's view group still open when the backward ends (input_views_key)
    # joins the input's gradient then: a new tensor where that gradient exists already
    # (exec.codegen's last group delivery, rkgb.gradsink.accumulate)
    joining = [key for key in first_runs if (name := views_key_input(key)) is not None
               and input_grad_key(name) in first_runs]
    if joining:
        sizes = {entry.key: entry.bytes for entries in first_run_bytes.values() for entry in entries}
        flushed = max(flushed, storages.memory + kept + max(sizes[key] for key in joining))
    if flushed > peak:
        peak, peak_index = flushed, len(ops) - 1
    if after_loss:
        backward_peak = max(backward_peak, flushed)
    memory = storages.memory
    return SimulationResult(
        peak_bytes=peak,
        time_s=time_s,
        memory_during=memory_during,
        alive_at_end=alive,
        saved_bytes=saved,
        alive_after_forward=alive_after_forward,
        forward_peak_bytes=forward_peak,
        backward_peak_bytes=backward_peak,
        forward_time_s=forward_time,
        backward_time_s=backward_time,
        peak_index=peak_index,
        memory_at_end=memory + kept,
    )


def gradient_profile(graph: CDGraph, protected: set[str]) -> tuple[list[int], list[int], list[int], list[int]]:
    """The memory of the gradients along the graph's own order of compute nodes.

    Gradients are made by the loss and the backwards only, each of which runs once, in the
    graph's order (every schedule of a solver keeps that order and only adds forwards): their
    memory does not depend on the schedule. With the forgetting of
    :func:`schedule_from_computes` (after the last use; never ``protected`` nodes) and the
    simulator's rules (aliases, accumulation, contributions waiting for the next compute
    node), returns ``start[t]``, the bytes of gradient storages alive when compute node ``t``
    starts (``start[len(nodes)]``: at the end), ``added[t]``, the new bytes that compute node
    ``t`` holds while it runs, and ``flush[t]``, the peak of the gradients' bytes while the
    contributions of the backward before ``t`` join their gradients (before ``t`` starts: in a
    schedule, before the first compute node after that backward), and ``overhead[t]``, the
    temporary memory of backward ``t`` (:meth:`ComputeNode.backward_overhead`: whether its
    incoming gradient is held alone depends on the gradients only; 0 for the others).
    """
    nodes = graph.compute_nodes
    made_by_forward = {d for c in nodes if c.kind is ComputeKind.FORWARD for d in operation_outputs(graph, c, True)}
    grads = {d.name for d in graph.data_nodes if d.name not in made_by_forward and d.name not in graph.input_data}
    last_event: dict[str, int] = {}
    for i, c in enumerate(nodes):
        if c.kind is not ComputeKind.FORWARD:
            for d in effective_needs(graph, c) + operation_outputs(graph, c, True):
                if d in grads:
                    last_event[d] = i
    storages = _Storages(graph, set(graph.input_data))
    start = [0] * (len(nodes) + 1)
    added = [0] * len(nodes)
    flush = [0] * (len(nodes) + 1)
    overhead = [0] * len(nodes)
    for i, c in enumerate(nodes):
        flush[i] = storages.flush()
        start[i] = storages.memory
        if c.kind is ComputeKind.FORWARD:
            continue
        overhead[i] = c.overhead(True) if c.kind is ComputeKind.LOSS else \
            c.backward_overhead(storages.held_alone(data_name(c.target, DataKind.GRAD)))
        outputs = [d for d in operation_outputs(graph, c, True) if d in grads]
        added[i] = storages.compute(c, outputs)
        for d in dict.fromkeys(effective_needs(graph, c) + outputs):
            if d in storages.storage and d in grads and d not in protected and last_event.get(d) == i:
                storages.forget(d)
    flush[len(nodes)] = storages.flush()
    start[len(nodes)] = storages.memory
    return start, added, flush, overhead


def schedule_from_computes(
    graph: CDGraph,
    computes: list[str],
    *,
    protected: set[str] | None = None,
    initially_alive: set[str] | None = None,
    keep_at_end: set[str] | None = None,
) -> Schedule:
    """The schedule running ``computes`` in order with the fewest bytes alive at every step.

    A data node is forgotten right after the operation where its next event is not a use (its
    last use, or its production when nothing reads it before it is produced again); a forward
    keeps its phantoms (``with_grad=True``) only when a backward reads them before the forward
    runs again. For a fixed sequence of computes this is pointwise minimal in memory, so the
    peak and the memory saved across the loss are both the smallest possible; the ILP searches
    sequences of computes only and relies on this.

    Parameters
    ----------
    protected
        Data nodes never forgotten (besides ``graph.input_data``).
    initially_alive
        Data nodes alive at the start besides the inputs.
    keep_at_end
        Data nodes that must stay alive after the last compute.
    """
    protected = set(graph.input_data) | set(protected or ())
    keep_at_end = set(keep_at_end or ())
    nodes = [graph.compute(name) for name in computes]
    needs = [_memo(graph, node, _needs) for node in nodes]
    produces = [_memo(graph, node, _outputs, True) for node in nodes]
    # the events of each data node in order: (position, "use" or "produce")
    events: dict[str, list[tuple[int, str]]] = {}
    for i in range(len(nodes)):
        for d in needs[i]:
            events.setdefault(d, []).append((i, "use"))
        for d in produces[i]:
            events.setdefault(d, []).append((i, "produce"))
    # where each data node's search for its next event starts (the loop below asks in order of
    # position: the events before the last position asked are passed once)
    seen: dict[str, int] = {}

    def next_event(d: str, after: int) -> str | None:
        """The next event of ``d`` after position ``after``: "use", "produce" or None."""
        found = events.get(d, ())
        k = seen.get(d, 0)
        while k < len(found) and found[k][0] <= after:
            k += 1
        seen[d] = k
        if k < len(found):
            if found[k][1] == "produce" and graph.data(d).kind is DataKind.GRAD:
                return "use"  # a gradient accumulates: it must stay alive until its last use
            return found[k][1]
        return "use" if d in keep_at_end else None

    ops: list[Operation] = []
    alive: set[str] = set(graph.input_data) | set(initially_alive or ())
    for d in sorted(alive - protected):
        if next_event(d, -1) != "use":
            ops.append(Forget(d))
            alive.discard(d)
    for i, node in enumerate(nodes):
        with_grad = True
        if node.kind is ComputeKind.FORWARD:
            phantoms = phantoms_of(graph, node)
            with_grad = phantoms is not None and next_event(phantoms, i) == "use"
        ops.append(Compute(node.name, with_grad))
        outputs = produces[i] if with_grad else _memo(graph, node, _outputs, False)
        alive.update(outputs)
        touched = needs[i] + outputs
        for d in touched:
            if d in alive and d not in protected and next_event(d, i) != "use":
                ops.append(Forget(d))
                alive.discard(d)
    return Schedule(ops)
