"""A primal heuristic for the option grid: repair a known schedule until it fits tighter budgets.

The ILP of a grid pair is solved much faster when the solver starts from a good feasible
solution (CBC's MIP start): without one, CBC spends most of a solve finding a first solution
(feasibility pump) and then improving it. The solution of a looser neighbouring pair is
usually a few recomputations away from the optimum of the tighter pair, so this module starts
from it and adds recomputations, greedily and measured by the simulator, until the schedule
fits; then it removes the recomputations that are no longer needed.

A solution is a sequence of computes in Checkmate's stages (stage ``t`` runs compute node
``t`` last, after recomputations of earlier forward nodes); the schedule, its peak, saved
memory and time are those of :func:`solvers.options.option_from_computes`, as for every option:
the search measures its candidates with :class:`solvers.stage_figures.StageFigures` (the
simulator's figures, 6-8x faster), and the schedule it returns is measured by the simulator.
Only the recomputations that the ILP models (``allowed``) are used, and with
``lazy=True`` each recomputation serves a later operation of its own stage, so that the result
is a valid MIP start.
"""

from __future__ import annotations

import math

from rkgb.cdgraph import CDGraph, ComputeKind
from solvers.options import BlockOption, option_from_computes
from solvers.simulate import effective_needs, operation_outputs
from solvers.stage_figures import SequenceFigures, StageFigures

__all__ = ["ScheduleRepair"]

Stages = tuple[tuple[int, ...], ...]  # per stage, the forward nodes recomputed (sorted)


class ScheduleRepair:
    """Greedy repair of schedules of one CD-graph (see the module's documentation).

    Parameters
    ----------
    graph
        The class's CD-graph.
    allowed
        ``(stage, forward index)`` pairs a recomputation may use (the ILP's ``R`` variables).
    lazy
        Every recomputation must serve a later operation of its stage.
    max_evaluations
        Sequences evaluated per :meth:`repair` call, measured or found in the cache of earlier
        calls' (~0.3 ms each on a 59-compute attention class).
    tied
        Per stage, the groups of forwards that the ILP recomputes together (one variable: a
        run of forwards, ``RkCheckmateILP(whole_runs=True)``): a repair recomputes all of a
        group or none, so that its schedules stay valid MIP starts.
    """

    def __init__(self, graph: CDGraph, allowed: set[tuple[int, int]], *, lazy: bool = True,
                 max_evaluations: int = 30, tied: dict[int, list[list[int]]] | None = None) -> None:
        self.graph = graph
        self.nodes = graph.compute_nodes
        self.names = [c.name for c in self.nodes]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.allowed = allowed
        self.lazy = lazy
        self.max_evaluations = max_evaluations
        self.tied = tied or {}
        self.needs = [set(effective_needs(graph, c)) for c in self.nodes]
        self.outputs = [set(operation_outputs(graph, c, True)) for c in self.nodes]
        self.producer: dict[str, int] = {}
        for i, c in enumerate(self.nodes):
            if c.kind is ComputeKind.FORWARD:
                for d in self.outputs[i]:
                    self.producer.setdefault(d, i)
        self.inputs = set(graph.input_data)
        self.loss = next(i for i, c in enumerate(self.nodes) if c.kind is ComputeKind.LOSS)
        self.figures = StageFigures(graph)
        self._cache: dict[Stages, SequenceFigures | None] = {}
        self.evaluations = 0
        # repaired schedules that the simulator measured otherwise than the figures did (none:
        # the figures are the simulator's; such a schedule is dropped, not returned)
        self.mismatches = 0

    # -- representation ------------------------------------------------------------------
    def stages_of(self, computes: list[str]) -> Stages:
        extra: list[list[int]] = [[] for _ in self.nodes]
        stage = 0
        for name in computes:
            i = self.index[name]
            if i == stage:
                stage += 1
            elif stage < len(self.nodes):
                extra[stage].append(i)
        return tuple(tuple(sorted(set(e))) for e in extra)

    def computes_of(self, stages: Stages) -> list[str]:
        return [self.names[k] for t, extra in enumerate(stages) for k in (*extra, t)]

    def time_of(self, stages: Stages) -> float:
        """The time of the option of ``stages`` (:meth:`evaluate`'s ``time_s``, summed as the
        simulator sums it: the forwards before the loss, then the rest in order), without
        simulating it."""
        forward = backward = 0.0
        after_loss = False
        for t, extra in enumerate(stages):
            for k in (*extra, t):
                node = self.nodes[k]
                if node.kind is ComputeKind.LOSS:
                    after_loss = True
                elif node.kind is ComputeKind.FORWARD and not after_loss:
                    forward += node.time_s
                else:
                    backward += node.time_s
        return forward + backward

    def evaluate(self, stages: Stages) -> SequenceFigures | None:
        """The figures of the schedule of ``stages`` (None: the simulator refuses it)."""
        if stages not in self._cache:
            self.evaluations += 1
            positions, stage_of = self._sequence(stages)
            self._cache[stages] = self.figures.figures(positions, stage_of)
        return self._cache[stages]

    @staticmethod
    def _sequence(stages: Stages) -> tuple[list[int], list[int]]:
        positions: list[int] = []
        stage_of: list[int] = []
        for t, extra in enumerate(stages):
            positions.extend(extra)
            positions.append(t)
            stage_of.extend([t] * (len(extra) + 1))
        return positions, stage_of

    def _lazy(self, stages: list[list[int]]) -> Stages:
        """Drop the recomputations that serve no later operation of their stage (then complete
        the tied groups that keep a member)."""
        if self.lazy:
            for t, extra in enumerate(stages):
                if not extra:
                    continue
                kept: list[int] = []
                read = set(self.needs[t])
                for k in sorted(extra, reverse=True):
                    if self.outputs[k] & read:
                        kept.append(k)
                        read |= self.needs[k]
                stages[t] = kept
        for t, groups in self.tied.items():
            if not stages[t]:
                continue
            extra = set(stages[t])
            for group in groups:
                if extra.intersection(group):
                    extra.update(group)
            stages[t] = list(extra)
        return tuple(tuple(sorted(set(e))) if e else () for e in stages)

    # -- moves ---------------------------------------------------------------------------
    def _candidates(self, stages: Stages, peak: float, save: float) -> list[Stages]:
        positions, op_stage = self._sequence(stages)
        figures = self.evaluate(stages)
        bit = self.figures.bit
        targets: set[tuple[int, int]] = set()  # (stage, forward) to recompute there

        def next_use(d: str, after: int) -> None:
            for position in range(after + 1, len(positions)):
                if d in self.needs[positions[position]]:
                    t = op_stage[position]
                    if (t, self.producer[d]) in self.allowed:
                        targets.add((t, self.producer[d]))
                    return

        if figures.saved_bytes > save:
            loss_position = positions.index(self.loss)
            for d in self.figures.alive(figures.alive_at_loss):
                if d in self.producer and d not in self.inputs and self.graph.size(d) > 0:
                    next_use(d, loss_position)
        if figures.schedule_peak_bytes > peak and figures.peak_position >= 0:
            node = positions[figures.peak_position]
            for d in self.figures.alive(figures.alive_at_peak):
                if d in self.producer and d not in self.inputs and self.graph.size(d) > 0 and d not in self.needs[node]:
                    next_use(d, figures.peak_position)
        moves: list[Stages] = []
        for t, k in sorted(targets):
            alone = [list(e) for e in stages]
            alone[t].append(k)
            moves.append(self._lazy(alone))
            # with the chain of its inputs that are not alive when the stage starts
            chain = [list(e) for e in stages]
            todo, added = [k], set(chain[t])
            while todo:
                j = todo.pop()
                if j in added:
                    continue
                added.add(j)
                chain[t].append(j)
                for d in self.needs[j]:
                    p = self.producer.get(d)
                    alive = d in self.inputs or (d in bit and figures.stage_starts[t] >> bit[d] & 1)
                    if p is not None and not alive and (t, p) in self.allowed and p not in added:
                        todo.append(p)
            moves.append(self._lazy(chain))
        return list(dict.fromkeys(moves))

    # -- search --------------------------------------------------------------------------
    def lowest(self, computes: list[str], objective: str, *, step: float = 0.03, attempts: int = 6,
               evaluations: int = 60) -> tuple[list[str], BlockOption]:
        """A schedule of least peak (``objective="peak"``) or least saved memory (``"save"``)
        that repairs find from ``computes``: repaired to a target ``step`` under its value, then
        to targets ever nearer to it (``step`` halved at each failure, ``attempts`` failures in a
        row end it), each repair with ``evaluations`` sequences. The start of the option grid's
        min-peak and min-save solves (:func:`solvers.block_options.solve_class_options`), whose
        LP bound on the classes of 80-180 computes is too weak for HiGHS to find a good schedule
        in its time limit: LongT5's 161-compute class, none in 2 s and a peak of 385 thousandths
        of the autograd schedule's after 12 s, where this finds 276 in 1.6 s; on the Llama-12
        attention class both its results are the ILP's optima (770.7 and 55.0, in 0.1 s).
        """
        if objective not in ("peak", "save"):
            raise ValueError(f"objective must be 'peak' or 'save', got {objective!r}")

        def value(option: BlockOption) -> float:
            return option.peak_bytes if objective == "peak" else option.saved_bytes

        best = (list(computes), option_from_computes(self.graph, list(computes), source="repair"))
        failures = 0
        while failures < attempts:
            target = value(best[1]) * (1 - step / 2 ** failures)
            peak, save = (target, math.inf) if objective == "peak" else (math.inf, target)
            found = self.repair(best[0], peak, save, evaluations=evaluations)
            if found is None or value(found[1]) >= value(best[1]):
                failures += 1
                continue
            best, failures = found, 0
        return best

    def repair(self, computes: list[str], peak: float, save: float,
               evaluations: int | None = None) -> tuple[list[str], BlockOption] | None:
        """A schedule near ``computes`` that fits ``peak`` and ``save`` (bytes), or None.

        Greedy: while the schedule does not fit, evaluate every move (recompute, at the stage
        of its next use, a data node alive at the loss or at the peak; alone, or with the chain
        of its inputs that are not alive then) and keep a fitting one of least time, else the
        one that removes the most excess memory per second of recomputation. Then drop the
        recomputations that the fit does not need: of the removals that keep it fitting, the one
        that saves the most time first, again until none fits. ``evaluations``: the sequences
        it may ask for (``max_evaluations`` by default).
        """
        budget = self.max_evaluations if evaluations is None else evaluations
        # the evaluations this repair asks for, found in the cache or not, count against its
        # budget: its result depends on its arguments alone, not on what earlier repairs (in an
        # order that the grid's solves' timing decides) left in the cache
        asked = 0

        def evaluate(stages: Stages) -> SequenceFigures | None:
            nonlocal asked
            asked += 1
            return self.evaluate(stages)

        scale = max(b for b in (peak, save, 1.0) if b != math.inf)

        def excess(o: SequenceFigures | BlockOption) -> float:
            return (max(0, o.peak_bytes - peak) + max(0, o.saved_bytes - save)) / scale

        current = self._lazy([list(e) for e in self.stages_of(computes)])
        option = evaluate(current)
        if option is None:
            return None
        while excess(option) > 0:
            if asked >= budget:
                return None
            # the moves by their time (known without simulating them): the first that fits is
            # the fitting one of least time, and the slower ones need no simulation
            scored, fitting = [], None
            for move in sorted(self._candidates(current, peak, save), key=self.time_of):
                new = evaluate(move)
                if new is None:
                    continue
                if excess(new) == 0:
                    fitting = (move, new)
                    break
                scored.append((move, new))
            if fitting is not None:
                current, option = fitting
                break
            better = [(m, o) for m, o in scored if excess(o) < excess(option)]
            if not better:
                return None
            current, option = max(
                better, key=lambda mo: (excess(option) - excess(mo[1])) / max(mo[1].time_s - option.time_s, 1e-12))
        improved = True
        while improved and asked < budget:
            improved = False
            removals = []
            for t, extra in enumerate(current):
                for k in extra:
                    smaller = [list(e) for e in current]
                    smaller[t].remove(k)
                    removals.append(self._lazy(smaller))
            timed = sorted(((self.time_of(move), move) for move in dict.fromkeys(removals)), key=lambda tm: tm[0])
            for time_s, move in timed:
                if time_s >= option.time_s:
                    break
                new = evaluate(move)
                if new is not None and excess(new) == 0:
                    current, option, improved = move, new, True
                    break
        computes = self.computes_of(current)
        measured = option_from_computes(self.graph, computes, source="repair")
        if excess(measured) > 0 or measured.time_s != option.time_s:
            self.mismatches += 1
            return None
        return computes, measured
