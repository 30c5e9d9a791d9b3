"""The figures of a block option from its sequence of computes, without building its schedule.

:func:`solvers.options.option_from_computes` builds the schedule of a sequence of computes
(:func:`solvers.simulate.schedule_from_computes`: each data node forgotten after its last use)
and replays it in the simulator, with every storage of every gradient: about 2 ms per sequence
on a 59-compute attention class. The option grid's repairs (:mod:`solvers.option_repair`)
measure about 1300 such sequences per grid, only to compare their peaks, saved bytes and times.

Those sequences only add recomputations of forwards to the graph's own order: every backward
and the loss run once, in the graph's order, so the gradients' memory does not depend on the
sequence (:func:`solvers.simulate.gradient_profile` gives it once per graph: alive at each
stage's start, added and temporary while each backward runs, the peak of the contributions
joining their gradients as a stage starts). What varies is the data the forwards make, each one
storage of its own: this module follows those alone, with the schedule's forgetting rule and the
simulator's accounting, and adds the profile. The figures are the simulator's exactly (the same
peaks, saved bytes, end bytes and times; the same invalid sequences): ``tests/test_stage_figures.py``
compares them on thousands of sequences of toy, random and real class graphs. They take 0.29 ms
a sequence on that class (1.73 ms for the schedule and its simulation), 0.11 ms on GPT-2 small's
29-compute attention class (0.86 ms).

It serves the repairs' search only: the option a repair returns is measured again by the
simulator, which stays the single source of truth of every option (:mod:`solvers.simulate`).
"""

from __future__ import annotations

from dataclasses import dataclass

from rkgb.cdgraph import CDGraph, ComputeKind
from solvers.options import PhaseFigures
from solvers.simulate import effective_needs, gradient_profile, operation_outputs, phantoms_of

__all__ = ["SequenceFigures", "StageFigures"]

_USE, _PRODUCE = 1, 2  # the kinds of a data node's next event (0: none)


@dataclass
class SequenceFigures(PhaseFigures):
    """What :func:`solvers.simulate.simulate` measures of the schedule of a sequence of computes
    (the figures of :class:`solvers.options.BlockOption`), and what the repairs read of its
    replay: ``schedule_peak_bytes``, the simulation's peak (the loss's own run included, which
    an option's peaks leave out), ``peak_position``, the position in the sequence of the compute
    where it is (-1 where it is at the schedule's end, after a forget), and the forward data
    alive where each stage starts, before that compute and at the loss, as bit masks over
    :attr:`StageFigures.names` (:meth:`StageFigures.alive` gives their names)."""

    schedule_peak_bytes: int
    saved_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    forward_time_s: float
    backward_time_s: float
    end_bytes: int
    peak_position: int
    stage_starts: list[int]
    alive_at_peak: int
    alive_at_loss: int


class StageFigures:
    """The figures of sequences of computes of one CD-graph (see the module's documentation).

    ``figures(positions)`` takes the sequence as indices into ``graph.compute_nodes``, each
    stage's recomputations (forwards) before its own node, and returns None for a sequence the
    simulator refuses (a forward's input not alive; phantoms read after a backward consumed them).
    """

    def __init__(self, graph: CDGraph) -> None:
        nodes = graph.compute_nodes
        self.nodes = nodes
        inputs = set(graph.input_data)
        self.inputs = frozenset(inputs)
        # the data the forwards make: followed here (the rest are inputs, never forgotten and
        # not counted, and gradients, which the profile gives)
        made: list[str] = []
        for c in nodes:
            if c.kind is ComputeKind.FORWARD:
                made.extend(d for d in operation_outputs(graph, c, True) if d not in made)
        self.names = made
        self.bit = index = {d: i for i, d in enumerate(made)}  # each one's bit in the masks
        self.size = [0 if d in inputs else sum(graph.data(d).part_sizes) for d in made]
        self.kind = [c.kind for c in nodes]
        self.time = [c.time_s for c in nodes]
        # per compute node: the followed data it needs, makes with and without grad, its phantoms
        self.needs = [tuple(index[d] for d in effective_needs(graph, c) if d in index) for c in nodes]
        self.made_with_grad = [tuple(index[d] for d in operation_outputs(graph, c, True) if d in index)
                               for c in nodes]
        self.made_without_grad = [tuple(index[d] for d in operation_outputs(graph, c, False) if d in index)
                                  for c in nodes]
        self.phantoms = []
        for c in nodes:
            p = phantoms_of(graph, c)
            self.phantoms.append(index[p] if p is not None and p in index else -1)
        self.overhead = [(c.overhead(False), c.overhead(True)) for c in nodes]
        # the gradients, as every sequence has them (option_from_computes protects the input
        # gradients, as here)
        protected = set(graph.input_grads)
        self.grad_start, self.grad_added, self.grad_flush, self.grad_overhead = gradient_profile(graph, protected)
        # whether a gradient is forgotten after the last backward (then the schedule ends with a
        # forget whatever the forward data do): one it reads or makes that is not protected
        last = nodes[-1]
        grads = {d.name for d in graph.data_nodes if d.name not in index and d.name not in inputs}
        self.grad_forget_at_end = any(
            d in grads and d not in protected
            for d in (*effective_needs(graph, last), *operation_outputs(graph, last, True)))

    def figures(self, positions: list[int], stage_of: list[int]) -> SequenceFigures | None:
        """The figures of the sequence ``positions`` (compute-node indices; ``stage_of``: the stage
        of each, the stage of node ``t`` ending with ``t`` itself)."""
        count = len(positions)
        needs, made_with, made_without = self.needs, self.made_with_grad, self.made_without_grad
        # the kind of each followed data node's next event after each position (_USE, _PRODUCE
        # or 0), for the data the position touches: a backward pass over the sequence
        upcoming = [0] * len(self.names)
        next_after: list[dict[int, int]] = [None] * count  # type: ignore[list-item]
        for position in range(count - 1, -1, -1):
            k = positions[position]
            touched = {d: upcoming[d] for d in needs[k]}
            for d in made_with[k]:
                touched[d] = upcoming[d]
            next_after[position] = touched
            for d in made_with[k]:
                upcoming[d] = _PRODUCE
            for d in needs[k]:
                upcoming[d] = _USE
        size = self.size
        alive = [False] * len(self.names)
        mask = 0  # the same, as bits
        consumed = [False] * len(self.names)
        memory = 0  # of the followed data
        peak = 0
        peak_position = -1
        forgot_last = False  # the last compute is followed by forgets of forward data
        forward_peak = backward_peak = 0
        forward_time = backward_time = 0.0
        after_loss = False
        saved = 0
        stage = -1
        stage_starts: list[int] = []
        alive_at_peak = alive_last = alive_at_loss = 0
        start, flush = self.grad_start, self.grad_flush
        for position, k in enumerate(positions):
            t = stage_of[position]
            if t != stage:  # the contributions of the backward before join their gradients
                stage = t
                flushed = memory + flush[t]
                while len(stage_starts) <= t:
                    stage_starts.append(mask)
            else:
                flushed = memory + start[t]
            gradients = start[t]
            if flushed > peak:
                peak, peak_position, alive_at_peak = flushed, position, mask
            if after_loss and flushed > backward_peak:
                backward_peak = flushed
            kind = self.kind[k]
            if kind is ComputeKind.LOSS:
                alive_at_loss = mask
                saved = memory + gradients
                after_loss = True
            for d in needs[k]:
                if not alive[d] or consumed[d]:
                    return None
            if kind is ComputeKind.FORWARD:
                phantoms = self.phantoms[k]
                with_grad = phantoms >= 0 and next_after[position][phantoms] == _USE
                made = made_with[k] if with_grad else made_without[k]
                during = memory + gradients + self.overhead[k][with_grad] + sum(size[d] for d in made)
            else:
                made = ()
                during = memory + gradients + self.grad_overhead[k] + self.grad_added[k]
            if during > peak:
                peak, peak_position, alive_at_peak = during, position, mask
            alive_last = mask
            if kind is ComputeKind.FORWARD:
                if after_loss:
                    backward_peak = max(backward_peak, during)
                    backward_time += self.time[k]
                else:
                    forward_peak = max(forward_peak, during)
                    forward_time += self.time[k]
            elif kind is ComputeKind.BACKWARD:
                backward_peak = max(backward_peak, during)
                backward_time += self.time[k]
            for d in made:
                consumed[d] = False
                if not alive[d]:
                    alive[d] = True
                    mask |= 1 << d
                    memory += size[d]
            if kind is ComputeKind.BACKWARD and self.phantoms[k] >= 0:
                consumed[self.phantoms[k]] = True
            # forgotten after their last use, or where they are made again before any use
            following = next_after[position]
            for d in (*needs[k], *made):
                if alive[d] and following[d] != _USE:
                    alive[d] = False
                    mask &= ~(1 << d)
                    consumed[d] = False
                    memory -= size[d]
                    forgot_last = position == count - 1
        n = len(self.nodes)
        flushed = memory + flush[n]
        if flushed > peak:
            # at the schedule's last operation: the last compute, unless forgets follow it
            peak = flushed
            if count and not (self.grad_forget_at_end or forgot_last):
                peak_position, alive_at_peak = count - 1, alive_last
            else:
                peak_position, alive_at_peak = -1, 0
        if after_loss:
            backward_peak = max(backward_peak, flushed)
        return SequenceFigures(
            schedule_peak_bytes=peak,
            saved_bytes=saved,
            forward_peak_bytes=forward_peak,
            backward_peak_bytes=backward_peak,
            forward_time_s=forward_time,
            backward_time_s=backward_time,
            end_bytes=memory + start[n],
            peak_position=peak_position,
            stage_starts=stage_starts,
            alive_at_peak=alive_at_peak,
            alive_at_loss=alive_at_loss,
        )

    def alive(self, mask: int) -> frozenset[str]:
        """The names of the forward data of bit mask ``mask``, and the graph's inputs."""
        names = self.names
        return frozenset(names[d] for d in range(mask.bit_length()) if mask >> d & 1) | self.inputs
