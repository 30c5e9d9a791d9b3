"""Solvers by name, the whole-model plan, and the smallest budget each solver can meet.

``solve(chain, budget, solver)`` returns a :class:`~solvers.schedule.Plan` whose schedule uses
the names of ``chain.whole_graph()`` and whose predicted peak and time are the simulator's.

Solvers (Zhao et al., Rockmate, ICML 2023, section 5 for the baselines):

- ``"rockmate"``: rk-Checkmate options per class, then rk-Rotor over the chain;
- ``"rotor"``: rk-Rotor with one option per block (autograd: keep everything) or keep nothing;
- ``"checkmate"``: rk-Checkmate on the whole model's CD-graph (optimal reference, small models);
- ``"none"``: no recomputation (autograd).

A solver object is anything with ``name``, ``solve(chain, budget) -> Plan`` and
``min_budget(chain) -> int``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

from rkgb.cdgraph import DataKind, ModelChain, data_name, renamed_data
from solvers.block_options import GridReport, solve_class_options
from solvers.checkmate_ilp import RkCheckmateILP, default_ilp_solver
from solvers.option_cache import OptionCache, default_cache
from solvers.plan_cache import PlanCache, chain_times, plan_key
from solvers.options import (
    BlockOption,
    ClassOptions,
    autograd_option,
    no_grad_forward,
    rename_operations,
    with_outputs_kept,
)
from solvers.rotor_dp import BlockCosts, ChainAction, ChainCosts, ChainTable, OptionCosts, chain_table, solve_chain
from solvers.schedule import Compute, Forget, Operation, Plan, Schedule
from solvers.simulate import schedule_from_computes, simulate
from solvers.twin_classes import options_of_twin, twin_leads

__all__ = [
    "SOLVERS",
    "solve",
    "min_budget",
    "get_solver",
    "RockmateSolver",
    "RotorSolver",
    "CheckmateSolver",
    "NoRecomputeSolver",
    "ChainPlanner",
    "no_recompute_schedule",
]


# -- whole-model helpers --------------------------------------------------------------------
def no_recompute_schedule(chain: ModelChain) -> Schedule:
    """Autograd on the whole model: every node once, everything forgotten after its last use."""
    graph = chain.whole_graph()
    return schedule_from_computes(
        graph,
        [c.name for c in graph.compute_nodes],
        protected=set(graph.input_grads) | set(graph.held_outputs),
        keep_at_end=set(graph.held_outputs),
    )


def _baseline_time(chain: ModelChain) -> float:
    return sum(c.time_s for c in chain.whole_graph().compute_nodes)


def _plan(chain: ModelChain, budget: int, name: str, schedule: Schedule, **fields) -> Plan:
    result = simulate(chain.whole_graph(), schedule, keep_outputs=True)
    return Plan(
        feasible=True,
        budget=budget,
        solver=name,
        schedule=schedule,
        predicted_peak=result.peak_bytes,
        predicted_time=result.time_s,
        baseline_time=_baseline_time(chain),
        **fields,
    )


def _no_recompute_plan(chain: ModelChain, budget: int, name: str, **fields) -> Plan:
    """The plan that recomputes nothing (autograd's), under solver ``name``."""
    return _plan(chain, budget, name, no_recompute_schedule(chain), **fields)


def _infeasible(chain: ModelChain, budget: int, name: str, minimum: int, **fields) -> Plan:
    return Plan(
        feasible=False,
        budget=budget,
        solver=name,
        schedule=Schedule([]),
        baseline_time=_baseline_time(chain),
        min_budget=minimum,
        notes=[f"budget {budget} B is below the minimum {minimum} B of solver {name!r}"]
        + fields.pop("notes", []),
        **fields,
    )


def _keep_side_inputs(chain: ModelChain, ops: list[Operation]) -> list[Operation]:
    """``ops`` without the forgets of a side input (``rkgb.blocks``) that a later operation reads.

    A side input is also the chain input of the block after its producer, which a no-grad
    forward forgets once it has run (``ChainAction.forget_input``), and a block's options
    forget their input: the chain's figures hold a side input from its producer on
    (:func:`side_offsets`), so a forget while a later block still reads it is dropped (a Llama
    cut with ``max_block_nodes=10`` read a residual after its forget)."""
    side = {renamed_data(d, block.names) for block in chain.blocks for d in chain.classes[block.class_index].side_data}
    if not any(isinstance(op, Forget) and op.node in side for op in ops):
        return ops
    graph = chain.whole_graph()
    read_later: set[str] = set()
    kept: list[Operation] = []
    for op in reversed(ops):
        if isinstance(op, Forget):
            if op.node in side and op.node in read_later:
                continue
        elif graph.has_compute(op.node):
            read_later.update(d for d in graph.compute(op.node).needs if d in side)
        kept.append(op)
    kept.reverse()
    return kept


def side_offsets(chain: ModelChain) -> tuple[list[int], list[int]]:
    """Bytes that each block's figures leave out and the chain holds while the block runs: the
    side inputs (``rkgb.blocks``) and the model's outputs made by earlier blocks, alive from
    their block on, and the side inputs' gradients, which the blocks that read them make
    (counted over all of those blocks, their forwards too: a recomputation runs while the
    gradient is there). Second: the bytes of such tensors that each block makes, which its
    own figures count among what it keeps and its outputs, and the offsets count already."""
    offsets = [0] * len(chain.blocks)
    pinned = [0] * len(chain.blocks)
    made_by: dict[str, int] = {}
    sizes: dict[str, int] = {}
    early = set(chain.early_outputs)
    for block in chain.blocks:
        graph = chain.classes[block.class_index]
        for d in graph.output_data:
            real = renamed_data(d, block.names)
            made_by.setdefault(real, block.index)
            if real in early:
                sizes[real] = graph.size(d)
    readers: dict[str, list[int]] = {}
    grad_sizes: dict[str, int] = {}
    for block in chain.blocks:
        graph = chain.classes[block.class_index]
        for d in graph.side_data:
            real = renamed_data(d, block.names)
            readers.setdefault(real, []).append(block.index)
            sizes[real] = graph.size(d)
            grad = data_name(graph.data(d).target, DataKind.GRAD)
            if grad in graph.input_grads:
                grad_sizes[real] = max(grad_sizes.get(real, 0), graph.size(grad))
    for real, size in sizes.items():
        producer = made_by.get(real, -1)
        if producer >= 0:
            pinned[producer] += size
        for index in range(producer + 1, len(chain.blocks)):
            offsets[index] += size
        for index in range(producer + 1, max(readers.get(real, [producer])) + 1):
            offsets[index] += grad_sizes.get(real, 0)
    return offsets, pinned


def _progress(items, description: str, total: int | None = None):
    """``items`` with a progress bar on a terminal (tqdm, where installed; none in logs)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=description, total=total, leave=False, disable=None)


# -- chain planners (rk-Rotor over options) ---------------------------------------------------
@dataclass
class ChainPlanner:
    """rk-Rotor over the chain, given each class's options; shared by "rockmate" and "rotor"."""

    name: str
    slots: int = 500
    _classes: dict[int, tuple[object, ClassOptions]] = field(default_factory=dict, repr=False)
    option_seconds: dict[str, float] = field(default_factory=dict, repr=False)
    dp_seconds: float = 0.0
    last_table: ChainTable | None = field(default=None, repr=False)
    _reach: int | None = field(default=None, repr=False)

    def class_options(self, chain: ModelChain, index: int) -> ClassOptions:  # pragma: no cover
        raise NotImplementedError

    def _options_of(self, chain: ModelChain, index: int) -> ClassOptions:
        graph = chain.classes[index]
        if not self._has_options(chain, index):
            self._classes[id(graph)] = (graph, self.class_options(chain, index))
        return self._classes[id(graph)][1]

    def _has_options(self, chain: ModelChain, index: int) -> bool:
        cached = self._classes.get(id(chain.classes[index]))
        return cached is not None and cached[0] is chain.classes[index]

    @staticmethod
    def _timing_key(chain: ModelChain, index: int) -> str:
        return f"options of class {index} ({len(chain.classes[index].compute_nodes)} computes)"

    def _solve_classes(self, chain: ModelChain, indices: list[int]) -> None:
        """The options of the classes ``indices`` (kept for ``_options_of``), each class's
        seconds in ``option_seconds``: one class after another here."""
        for index in _progress(indices, f"{self.name}: options per class"):
            clock = time.perf_counter()
            self._options_of(chain, index)
            self.option_seconds[self._timing_key(chain, index)] = time.perf_counter() - clock

    def chain_costs(self, chain: ModelChain) -> tuple[ChainCosts, list[list[BlockOption]]]:
        """The DP's figures of ``chain`` and each block's options (the last block's keep its outputs)."""
        blocks: list[BlockCosts] = []
        per_block: list[list[BlockOption]] = []
        last = len(chain.blocks) - 1
        last_variants: dict[int, list[BlockOption]] = {}
        self.option_seconds = {}
        clock = time.perf_counter()
        self._solve_classes(chain, sorted({b.class_index for b in chain.blocks}))
        # (the classes' own seconds overlap where their grids run side by side)
        self.option_seconds["options"] = time.perf_counter() - clock
        offsets, pinned = side_offsets(chain)
        early = set(chain.early_outputs)
        dropped = set(chain.dropped_outputs)
        for block in chain.blocks:
            options = self._options_of(chain, block.class_index)
            graph = chain.classes[block.class_index]
            held = frozenset(d for d in graph.output_data if renamed_data(d, block.names) in early)
            # (the last block's outputs but those the step drops once the forward returns them)
            kept = frozenset(d for d in graph.output_data if renamed_data(d, block.names) not in dropped) \
                if block.index == last else held
            if block.index == last or held:
                key = (block.class_index, block.index == last, kept)
                if key not in last_variants:
                    last_variants[key] = [with_outputs_kept(graph, o, set(kept)) for o in options.options]
                block_options = last_variants[key]
            else:
                block_options = options.options
            per_block.append(block_options)
            offset = offsets[block.index]
            blocks.append(
                BlockCosts(
                    options=[
                        OptionCosts(
                            o.forward_peak_bytes + offset,
                            o.backward_peak_bytes + offset,
                            max(0, o.saved_bytes - pinned[block.index]),
                            o.end_bytes,
                            o.forward_time_s,
                            o.backward_time_s,
                        )
                        for o in block_options
                    ],
                    no_grad_peak=options.no_grad.peak_bytes + offset,
                    no_grad_time=options.no_grad.time_s,
                    output_bytes=max(0, sum(graph.size(d) for d in graph.output_data) - pinned[block.index]),
                    output_grad_bytes=sum(graph.size(d) for d in graph.output_grads),
                    class_key=(block.class_index, offset, pinned[block.index], held),
                )
            )
        loss = chain.classes[chain.blocks[last].class_index].loss
        return ChainCosts(blocks, loss_time=loss.time_s, loss_overhead=loss.overhead_bytes + offsets[last]), per_block

    def instantiate(self, chain: ModelChain, per_block: list[list[BlockOption]], actions: list[ChainAction]) -> Schedule:
        """The whole-model schedule of a chain strategy (real node names). A model output made
        before the last block (``rkgb.blocks``) is never forgotten: the user holds it; nor is a
        side input while a later operation reads it (:func:`_keep_side_inputs`)."""
        held = set(chain.early_outputs)
        ops: list[Operation] = []
        for a in actions:
            if a.kind == "loss":
                ops.append(Compute("loss"))
                continue
            block = chain.blocks[a.block]
            graph = chain.classes[block.class_index]
            if a.kind == "forward":
                ops += rename_operations(graph, per_block[a.block][a.option].forward_ops, block.names)
            elif a.kind == "backward":
                ops += rename_operations(graph, per_block[a.block][a.option].backward_ops, block.names)
            elif a.kind == "no_grad":
                ops += rename_operations(graph, self._options_of(chain, block.class_index).no_grad.ops, block.names)
                if a.forget_input:
                    ops += [Forget(real) for real in (renamed_data(d, block.names) for d in graph.chain_input_data)
                            if real not in held]
            elif a.kind == "forget_output":
                ops += [Forget(real) for real in (renamed_data(d, block.names) for d in graph.output_data)
                        if real not in held]
        return Schedule(_keep_side_inputs(chain, ops))

    def solve(self, chain: ModelChain, budget: int, reach: int | None = None) -> Plan:
        """``reach``: the DP's tables reach this many bytes too (``last_table``; the registry's
        raised targets read their strategies from them)."""
        self._reach, self.last_table = reach, None
        try:
            plan = self._solve(chain, budget)
        finally:
            self._reach = None
        plan.notes += [note for _, options in self._classes.values() for note in options.notes
                       if note.startswith(ROTOR_OPTIONS)]
        plan.timings.update(self.option_seconds)
        plan.timings["dp"] = self.dp_seconds
        return plan

    def _solve(self, chain: ModelChain, budget: int) -> Plan:
        start = time.perf_counter()
        plan, mismatch = self._attempt(chain, budget)
        if plan is not None:
            return plan
        infeasible = _infeasible(chain, budget, self.name, self.min_budget(chain),
                                 solve_time_s=time.perf_counter() - start)
        if mismatch:
            infeasible.notes.append(mismatch)
        return infeasible

    def _attempt(self, chain: ModelChain, budget: int, table: ChainTable | None = None) -> tuple[Plan | None, str | None]:
        """The plan of the DP within ``budget`` as the simulator judges it (None where there is
        none), and the note of a DP/simulator mismatch met on the way. ``table``: the DP's
        tables of this chain, read where they reach ``budget``; else a DP is made, its tables
        reaching the reach given to :meth:`solve` too, and kept in ``last_table``."""
        start = time.perf_counter()
        costs, per_block = self.chain_costs(chain)
        if table is not None and table.covers(int(budget)) and table.costs == costs:
            strategy = table.strategy(int(budget))
        else:
            clock = time.perf_counter()
            self.last_table = chain_table(costs, int(budget), self.slots, self._reach)
            strategy = None if self.last_table is None else self.last_table.strategy(int(budget))
            self.dp_seconds = time.perf_counter() - clock
        # the simulator is the judge of a strategy's peak; where the DP's own figure is lower
        # (a case its memory model misses), the plan is made again for a budget lowered by
        # that difference, a few times, and never returned over the budget
        mismatch, target = None, int(budget)
        for _ in range(4):
            if strategy is None:
                break
            schedule = self.instantiate(chain, per_block, strategy.actions)
            plan = _plan(chain, budget, self.name, schedule, solve_time_s=time.perf_counter() - start,
                         time_limit_hit=any(o.time_limit_hit for opts in per_block for o in opts))
            if plan.predicted_peak != strategy.peak_bytes:
                mismatch = (f"the DP predicted a peak of {strategy.peak_bytes} B where the simulator "
                            f"measures {plan.predicted_peak} B")
            if plan.predicted_peak <= budget:
                plan.notes.append(f"DP slot: {strategy.slot_bytes} B")
                if mismatch:
                    plan.notes.append(mismatch)
                return plan, mismatch
            target -= plan.predicted_peak - strategy.peak_bytes
            strategy = solve_chain(costs, target, self.slots) if target > 0 else None
        top = _no_recompute_plan(chain, budget, self.name)
        if top.predicted_peak <= budget:
            # the DP rounds memory up to its slots, block by block: at budgets within a few
            # slots of the no-recomputation peak it can miss the schedule that fits exactly
            top.solve_time_s = time.perf_counter() - start
            top.notes.append("the DP found no strategy; the no-recomputation schedule fits the budget")
            return top, mismatch
        return None, mismatch

    def min_budget(self, chain: ModelChain) -> int:
        """The smallest budget that :meth:`solve` meets: the DP's own minimum where the
        simulator agrees with it, else searched above it with the whole solve (DP and
        simulator) up to the no-recomputation peak, which always fits."""
        low = self._dp_min_budget(chain)
        if self._attempt(chain, low)[0] is not None:
            return low
        high = simulate(chain.whole_graph(), no_recompute_schedule(chain)).peak_bytes
        if high <= low:
            return high
        while high - low > max(1, high // 2000):
            middle = (low + high) // 2
            if self._attempt(chain, middle)[0] is None:
                low = middle
            else:
                high = middle
        return high

    def _dp_min_budget(self, chain: ModelChain) -> int:
        """The smallest budget the DP meets (binary search, to 0.05% or 1 byte), or the
        no-recomputation peak if that is lower (see :meth:`solve`)."""
        costs, _ = self.chain_costs(chain)
        top = simulate(chain.whole_graph(), no_recompute_schedule(chain)).peak_bytes
        high = max(1, top)
        if solve_chain(costs, high, self.slots) is None:
            return top
        low = 0
        while high - low > max(1, high // 2000):
            middle = (low + high) // 2
            if solve_chain(costs, middle, self.slots) is None:
                low = middle
            else:
                high = middle
        strategy = solve_chain(costs, high, self.slots)
        exact = strategy.peak_bytes
        if exact < high and solve_chain(costs, exact, self.slots) is not None:
            return exact
        return high


# how many times at most a plan's target is raised into the slack its exact peak leaves (_raised)
RAISED_TARGETS = 8

# the note of a class planned with Rotor's options by the Rockmate solver (RockmateSolver.max_ilp_computes)
ROTOR_OPTIONS = "Rotor's options for class"


@dataclass
class RockmateSolver(ChainPlanner):
    """Rockmate: rk-Checkmate options for each class (a grid of budgets), then rk-Rotor."""

    name: str = "rockmate"
    peak_steps: int = 10
    save_steps: int = 10
    time_limit_s: float = 2.0
    # HiGHS in process where highspy is installed, else CBC (solvers.checkmate_ilp.default_ilp_solver)
    ilp_solver: str = field(default_factory=default_ilp_solver)
    forward_recompute: bool = False
    lazy_recompute: bool = True
    gap: float = 0.01
    workers: int = 2  # ILPs of a grid solved at the same time (the options do not depend on it)
    # wall-clock cap on one class's grid: the pairs not started by then are left out (the
    # class keeps its lowest and fastest options, solved first); bounds planning time on
    # blocks of 60+ computes whose every ILP hits ``time_limit_s``. It counts the grid's waits
    # for a solver slot that the grid beside it holds (``_solve_classes``). None: no cap.
    # 30 s since the bound solves start from the repairs' lowest schedules (a 30 s cap had cut
    # LongT5's min-peak retry before, its minimum budget 18.8% higher): against 60 s, LongT5
    # 81.5 -> 51.5 s, RecurrentGemma 52.4 -> 33.8 s, MobileViT 109 -> 80 s, Mamba2 51 -> 35 s
    # (13-budget sweeps of their measured-cost chains), the same minimum budgets (LongT5's 4.6%
    # lower) and plans within -2.6%..+2.1% at equal budgets (the runs' noise: their solves are
    # cut by wall-clock limits)
    grid_time_limit_s: float | None = 30.0
    # a class with more computes gets Rotor's options (keep everything, or recompute the whole
    # block): its ILP is too big to plan in time (T5's merged encoder-decoder class of 245
    # computes: 205 s in the two bound solves alone, each far past its limit, and no option
    # found). None: no limit
    max_ilp_computes: int | None = 200
    # recompute runs of forwards that only feed each other as a whole (solvers.forward_runs):
    # attention classes' grids 1.5-2.5x faster, the same plans on the bench GPT, GPT-2, Llama
    whole_runs: bool = True
    # see solvers.block_options.solve_class_options: once this many solves of a class stopped at
    # their limit with their start unbettered, its later pairs with a start are solved in the
    # start's neighbourhood (``neighbourhood_flips`` binaries changed at most; None: keep the
    # start). No solve of the Llama-12, GPT-2 small or Gemma 2 classes stops at its limit
    stalled_solves: int | None = 3
    neighbourhood_flips: int | None = 4
    # classes whose CD-graphs differ only in measured costs, close ones, share one grid: the
    # lead's options measured on each twin's own graph (solvers.twin_classes). T5 (4 + 4
    # layers, two pairs of 45-47-compute twins): options 20.5 -> 12.1-13.8 s, plans at 13
    # budgets within -0.09..+0.17% of its own grids'; BART: the same plans, 1.75 -> 1.05 s
    share_twin_grids: bool = True
    _twins: dict[int, tuple[ModelChain, dict[int, int]]] = field(default_factory=dict, repr=False)
    reports: dict[int, GridReport] = field(default_factory=dict, repr=False)
    cache: OptionCache | None = field(default_factory=lambda: default_cache, repr=False)

    def _solve_classes(self, chain: ModelChain, indices: list[int]) -> None:
        """The classes' option grids two at a time (``workers``), the largest first, their ILP
        solves sharing ``workers`` solver slots: a grid alone leaves a core idle while its next
        pairs wait for the looser ones (T5's six attention and MLP classes: 27.3 s -> 24.1 s
        of wall time on 2 cores, the same options). Each grid is decided from its own solves
        only, so the options do not depend on which classes run together. A twin class
        (:meth:`twin_lead`) is done after its lead, from the lead's options."""
        todo = [index for index in indices if not self._has_options(chain, index)]
        twins = [index for index in todo if self.twin_lead(chain, index) != index]
        todo = [index for index in todo if index not in twins]
        if self.workers <= 1 or len(todo) <= 1:
            return super()._solve_classes(chain, indices)
        slots = threading.Semaphore(self.workers)

        def run(index: int) -> tuple[int, ClassOptions, float]:
            clock = time.perf_counter()
            options = self.class_options(chain, index, solver_slots=slots)
            return index, options, time.perf_counter() - clock

        self.option_seconds.update({self._timing_key(chain, index): 0.0  # (solved before)
                                    for index in indices if index not in todo})
        todo.sort(key=lambda index: -len(chain.classes[index].compute_nodes))
        with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="rockmate-class") as pool:
            futures = [pool.submit(run, index) for index in todo]
            for future in _progress(as_completed(futures), f"{self.name}: options per class", total=len(futures)):
                index, options, seconds = future.result()
                self._classes[id(chain.classes[index])] = (chain.classes[index], options)
                self.option_seconds[self._timing_key(chain, index)] = seconds
        for index in twins:
            clock = time.perf_counter()
            self._options_of(chain, index)
            self.option_seconds[self._timing_key(chain, index)] = time.perf_counter() - clock

    def settings(self) -> tuple:
        """What this solver's plans depend on besides the chain and the budget (the plan cache's
        key, :mod:`solvers.plan_cache`): its settings and the raise's."""
        skipped = {"reports", "cache", "option_seconds", "dp_seconds"}
        return tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                     if not f.name.startswith("_") and f.name not in skipped) + (("raised targets", RAISED_TARGETS),)

    def twin_lead(self, chain: ModelChain, index: int) -> int:
        """The class whose grid class ``index`` shares (:func:`solvers.twin_classes.twin_leads`
        among the chain's classes solved by a grid): ``index`` itself where none, or where
        ``share_twin_grids`` is off."""
        if not self.share_twin_grids:
            return index
        cached = self._twins.get(id(chain))
        if cached is None or cached[0] is not chain:
            used = {block.class_index for block in chain.blocks}
            grids = {i: chain.classes[i] for i in used if self._grid_solved(chain.classes[i])}
            cached = self._twins[id(chain)] = (chain, twin_leads(grids))
        return cached[1].get(index, index)

    def _grid_solved(self, graph) -> bool:
        return self.max_ilp_computes is None or len(graph.compute_nodes) <= self.max_ilp_computes

    def class_options(self, chain: ModelChain, index: int,
                      solver_slots: threading.Semaphore | None = None) -> ClassOptions:
        """``solver_slots``: shared with the grids running beside this one (at most that many
        ILP solves at a time)."""
        graph = chain.classes[index]
        computes = len(graph.compute_nodes)
        if not self._grid_solved(graph):
            note = (f"{ROTOR_OPTIONS} {index} ({computes} computes, above max_ilp_computes="
                    f"{self.max_ilp_computes}): keep everything, or recompute the whole block")
            return rotor_options(graph, notes=[note])
        lead = self.twin_lead(chain, index)
        if lead != index:
            return options_of_twin(self._options_of(chain, lead), lead, graph)
        settings = (self.peak_steps, self.save_steps, self.time_limit_s, self.ilp_solver,
                    self.forward_recompute, self.lazy_recompute, self.gap, self.grid_time_limit_s, self.whole_runs,
                    self.stalled_solves, self.neighbourhood_flips)
        report = GridReport()

        def compute() -> ClassOptions:
            return solve_class_options(chain.classes[index], **self.grid_arguments(), report=report,
                                       solver_slots=solver_slots)

        options = compute() if self.cache is None else \
            self.cache.get_or_compute(chain.classes[index], settings, compute, kind=ClassOptions)
        self.reports[index] = report
        return options

    def grid_arguments(self) -> dict:
        """The keyword arguments of :func:`solvers.block_options.solve_class_options` that this
        solver's settings give (its report and solver slots aside)."""
        return dict(peak_steps=self.peak_steps, save_steps=self.save_steps, time_limit_s=self.time_limit_s,
                    ilp_solver=self.ilp_solver, forward_recompute=self.forward_recompute,
                    lazy_recompute=self.lazy_recompute, gap=self.gap, workers=self.workers,
                    grid_time_limit_s=self.grid_time_limit_s, whole_runs=self.whole_runs,
                    stalled_solves=self.stalled_solves, neighbourhood_flips=self.neighbourhood_flips)


@dataclass
class RotorSolver(ChainPlanner):
    """Rotor: each block keeps everything (autograd) or nothing (recomputed later)."""

    name: str = "rotor"

    def class_options(self, chain: ModelChain, index: int) -> ClassOptions:
        return rotor_options(chain.classes[index])


def rotor_options(graph, notes: list[str] | None = None) -> ClassOptions:
    """Rotor's options of a class: keep everything (autograd), or, through its forward without
    grad, nothing (the whole block recomputed in the backward)."""
    return ClassOptions(graph=graph, options=[autograd_option(graph)], no_grad=no_grad_forward(graph),
                        notes=list(notes or []))


# -- whole-graph solvers ------------------------------------------------------------------------
@dataclass
class CheckmateSolver:
    """rk-Checkmate on the whole model's CD-graph: the optimal reference on small models."""

    name: str = "checkmate"
    time_limit_s: float = 60.0
    ilp_solver: str = "cbc"
    forward_recompute: bool = True
    _model: tuple[object, RkCheckmateILP] | None = field(default=None, repr=False)

    def _ilp(self, chain: ModelChain):
        graph = chain.whole_graph()
        if self._model is None or self._model[0] is not chain:
            unit = max(1.0, simulate(graph, no_recompute_schedule(chain)).peak_bytes / 1000.0)
            self._model = (chain, RkCheckmateILP(
                graph, keep_outputs=True, forward_recompute=self.forward_recompute, memory_unit_bytes=unit))
        return graph, self._model[1]

    def _schedule(self, graph, computes: list[str]) -> Schedule:
        return schedule_from_computes(
            graph, computes, protected=set(graph.input_grads) | set(graph.held_outputs),
            keep_at_end=set(graph.held_outputs),
        )

    def solve(self, chain: ModelChain, budget: int, *, start_schedule: Schedule | None = None) -> Plan:
        """The ILP's best plan within ``budget``. ``start_schedule``: a plan of another solver
        within the budget (Rockmate's), given to the ILP solver as its first incumbent (CBC's and
        HiGHS's MIP start), so that the result is never worse than it and the time limit is spent
        improving on it."""
        start = time.perf_counter()
        graph, ilp = self._ilp(chain)
        target = float(budget)
        time_limit_hit = False
        first = None if start_schedule is None else [op.node for op in start_schedule.ops if isinstance(op, Compute)]
        for _ in range(3):
            solution = ilp.solve(target, None, time_limit_s=self.time_limit_s, solver=self.ilp_solver, start=first)
            time_limit_hit |= solution.time_limit_hit
            if not solution.feasible:
                break
            schedule = self._schedule(graph, solution.computes)
            plan = _plan(chain, budget, self.name, schedule, time_limit_hit=solution.time_limit_hit,
                         solve_time_s=time.perf_counter() - start)
            if plan.predicted_peak <= budget:
                return plan
            target -= plan.predicted_peak - budget  # solver tolerance on large numbers
        # no schedule within the budget: the lowest-peak schedule the ILP finds either fits
        # after all (the time limit stopped the search above) or gives the minimum budget
        lowest = self._lowest(chain)
        if lowest.predicted_peak <= budget:
            lowest.budget = budget
            lowest.time_limit_hit = True
            lowest.solve_time_s = time.perf_counter() - start
            lowest.notes.append(f"no schedule found within {self.time_limit_s} s at budget {budget} B; "
                                "returning the lowest-peak schedule found, which fits")
            return lowest
        return _infeasible(chain, budget, self.name, lowest.predicted_peak, solve_time_s=time.perf_counter() - start,
                           time_limit_hit=time_limit_hit or lowest.time_limit_hit)

    def _lowest(self, chain: ModelChain) -> Plan:
        """The lowest-peak plan the ILP finds (the no-recomputation one if it finds none), with
        ``time_limit_hit`` when the search stopped at the time limit; its budget is its peak."""
        graph, ilp = self._ilp(chain)
        solution = ilp.solve(None, None, objective="peak", time_limit_s=self.time_limit_s, solver=self.ilp_solver)
        if not solution.feasible:
            plan = _no_recompute_plan(chain, 0, self.name, time_limit_hit=solution.time_limit_hit)
        else:
            plan = _plan(chain, 0, self.name, self._schedule(graph, solution.computes),
                         time_limit_hit=solution.time_limit_hit)
        plan.budget = plan.predicted_peak
        return plan

    def min_budget(self, chain: ModelChain) -> int:
        return self._lowest(chain).predicted_peak


@dataclass
class NoRecomputeSolver:
    """No recomputation: what PyTorch's autograd does."""

    name: str = "none"

    def solve(self, chain: ModelChain, budget: int) -> Plan:
        start = time.perf_counter()
        plan = _no_recompute_plan(chain, budget, self.name)
        plan.solve_time_s = time.perf_counter() - start
        if plan.predicted_peak > budget:
            return _infeasible(chain, budget, self.name, plan.predicted_peak)
        return plan

    def min_budget(self, chain: ModelChain) -> int:
        return simulate(chain.whole_graph(), no_recompute_schedule(chain)).peak_bytes


def _sqrt_solver(**options):
    """``"sqrt"``: segment checkpointing (:mod:`solvers.sqrt_segments`, which builds on this
    module's chain planner: imported when asked for)."""
    from solvers.sqrt_segments import SqrtSolver

    return SqrtSolver(**options)


def _articulation_solver(**options):
    """``"articulation"``: checkpoints at articulation points (:mod:`solvers.articulation`)."""
    from solvers.articulation import ArticulationSolver

    return ArticulationSolver(**options)


def _checkmate_lp_solver(**options):
    """``"checkmate-lp"``: Checkmate's LP relaxation and rounding (:mod:`solvers.checkmate_lp`)."""
    from solvers.checkmate_lp import CheckmateLPSolver

    return CheckmateLPSolver(**options)


def _knapsack_solver(method: str):
    """``"knapsack-<method>"``: PyTorch's activation-memory-budget knapsacks
    (:mod:`solvers.knapsack`)."""

    def make(**options):
        from solvers.knapsack import KnapsackSolver

        return KnapsackSolver(method=method, **options)

    return make


def _bptt_solver(**options):
    """``"bptt"``: revolve's binomial checkpointing (:mod:`solvers.bptt`)."""
    from solvers.bptt import BPTTSolver

    return BPTTSolver(**options)


SOLVERS = {
    "rockmate": RockmateSolver,
    "rotor": RotorSolver,
    "checkmate": CheckmateSolver,
    "none": NoRecomputeSolver,
    "sqrt": _sqrt_solver,
    "articulation": _articulation_solver,
    "checkmate-lp": _checkmate_lp_solver,
    "bptt": _bptt_solver,
    "knapsack-dp": _knapsack_solver("dp"),
    "knapsack-greedy": _knapsack_solver("greedy"),
    "knapsack-ilp": _knapsack_solver("ilp"),
    "knapsack-hirschberg": _knapsack_solver("hirschberg"),
}


def get_solver(solver: str | object, **options):
    """A solver object from a name of :data:`SOLVERS` (with ``options``) or a solver object."""
    if isinstance(solver, str):
        if solver not in SOLVERS:
            raise ValueError(f"solver must be one of {sorted(SOLVERS)} or a solver object, got {solver!r}")
        return SOLVERS[solver](**options)
    if options:
        raise ValueError("options are for solvers given by name; configure the solver object instead")
    for attribute in ("solve", "min_budget", "name"):
        if not hasattr(solver, attribute):
            raise TypeError(f"solver object {solver!r} has no {attribute!r}")
    return solver


def solve(chain: ModelChain, budget: int, solver: str | object = "rockmate", **options) -> Plan:
    """Plan a training step of ``chain`` within ``budget`` bytes.

    Parameters
    ----------
    chain
        The model's chain of blocks (from rkgb or :mod:`solvers.toy_graphs`).
    budget
        Bytes: the peak of activations, saved tensors, gradients of activations and temporaries.
    solver
        A name of :data:`SOLVERS` or a solver object; ``options`` go to the solver's
        constructor (e.g. ``peak_steps``, ``time_limit_s``, ``ilp_solver="highs"``).

    Returns
    -------
    Plan
        ``feasible=False`` with ``min_budget`` set when the budget is too small; never raises
        for a too small budget.
    """
    if budget < 0:
        raise ValueError(f"budget must be a number of bytes >= 0, got {budget!r}")
    solver = get_solver(solver, **options)
    budget = int(budget)
    cache = PlanCache(solver.cache.directory) if isinstance(solver, RockmateSolver) and solver.cache is not None \
        and solver.cache.directory and chain.blocks else None
    if cache is not None:
        began = time.perf_counter()
        key, times = plan_key(chain, budget, solver.settings()), chain_times(chain)
        cached = _cached_plan(chain, budget, solver.name, cache.get(key, times))
        if cached is not None:
            cached.timings["plan cache"] = cached.solve_time_s = time.perf_counter() - began
            return cached
    held = _held_bytes(chain)
    whole = no_recompute_schedule(chain)
    whole_peak = _exact_peak(chain, whole)
    whole_fits = whole_peak <= budget
    plan, exact = None, None  # (and the plan's exact peak, where already simulated)
    # every operation runs at least once: where the plan that recomputes nothing fits, no plan is
    # faster, and the solvers that plan for time need no option grid (a 61-compute recurrence at
    # 100%: 15 s of options before); it is taken below
    if chain.blocks and budget >= held and not (whole_fits and isinstance(solver, ChainPlanner)):
        plan = solver.solve(chain, budget - held, reach=budget) if isinstance(solver, ChainPlanner) \
            else solver.solve(chain, budget - held)
        if plan is not None and plan.feasible and isinstance(solver, ChainPlanner):
            plan, exact = _raised(chain, solver, budget, held, plan)
    lowest = None
    if plan is None or not plan.feasible:
        # below what the solver can plan with the first-run memory left aside as a whole, the
        # plan without recomputation, or the solver's plan at its minimum, may still fit, each
        # counted exactly
        if whole_fits:
            plan = _plan(chain, budget, solver.name, whole, notes=["the plan without recomputation fits the budget"])
            exact = whole_peak
        else:
            solver_minimum = None if not chain.blocks else \
                plan.min_budget if plan is not None and plan.min_budget is not None else solver.min_budget(chain)
            lowest = _lowest_exact_plan(chain, solver, solver_minimum)
            if lowest is not None and lowest.predicted_peak <= budget:
                lowest.notes.append("planned at the solver's minimum: with each first-run allocation counted from "
                                    "its node's first run, it fits the budget")
                plan, exact = lowest, lowest.predicted_peak
            elif plan is None:
                plan = _infeasible(chain, budget, solver.name, solver_minimum)
    _count_exactly(chain, plan, budget, exact)
    if not plan.feasible:
        plan.min_budget = _minimum(chain, plan.min_budget, lowest)
        plan.notes[0] = f"budget {budget} B is below the minimum {plan.min_budget} B of solver {plan.solver!r}"
    elif cache is not None:
        cache.put(key, times, {"ops": list(plan.schedule.ops), "notes": list(plan.notes),
                               "time_limit_hit": plan.time_limit_hit})
    return plan


def _cached_plan(chain: ModelChain, budget: int, name: str, fields: dict | None) -> Plan | None:
    """The plan of the plan cache's ``fields`` (:mod:`solvers.plan_cache`), its figures simulated
    on ``chain``; None where there are none or where it does not fit ``budget`` so counted."""
    if fields is None:
        return None
    plan = _plan(chain, budget, name, Schedule(list(fields["ops"])), notes=list(fields["notes"]),
                 time_limit_hit=bool(fields["time_limit_hit"]))
    _count_exactly(chain, plan, budget)
    return plan if plan.predicted_peak <= budget else None


def _count_exactly(chain: ModelChain, plan: Plan, budget: int, exact: int | None = None) -> None:
    """``plan`` for ``budget`` with the memory the executor holds besides the CD-graph's data
    (``ModelChain.held_bytes`` and ``first_run_bytes``): the solvers plan within the budget less
    all of it; the prediction counts each first-run allocation from the first run of its node
    (``exact``: that peak, where already simulated)."""
    plan.budget = budget
    plan.held_bytes = chain.held_bytes
    plan.first_run_bytes = chain.first_run_bytes
    if plan.feasible:
        plan.predicted_peak = _exact_peak(chain, plan.schedule) if exact is None else exact


def _raised(chain: ModelChain, solver: ChainPlanner, budget: int, held: int, plan: Plan) -> tuple[Plan, int]:
    """``plan`` (the solver's within ``budget`` less ``held``), or a faster plan of the solver
    within a higher target that still fits ``budget`` counted exactly; and that plan's exact
    peak (:func:`_exact_peak`).

    The solvers plan within the budget less all the first-run memory, as if alive from the
    step's start; counted from each allocation's first run, the plan's peak is lower, and the
    plan of a higher target may fit the budget too: without this, a plan could be slower than
    the plan of a lower budget (the zoo's GPT: at 15 of 17 budgets; with it, none, and
    RecurrentGemma's measured chain plans 0.9-28% faster at 10 of 13 budgets). The target is
    raised by the last plan's slack under the budget (by half as much after a plan that does
    not fit), ``RAISED_TARGETS`` times at most, until a plan that fits is no faster. The
    strategies are read from the DP's tables (:class:`solvers.rotor_dp.ChainTable`, the slot
    of the first plan's), made once more where they do not reach the target, then reaching as far
    again: a read costs the simulator's check alone (a 108-block MobileViT chain, 1.2 s per
    DP: its raise 4.9 -> 1.7 s; 13-budget sweeps of six measured chains 1.1-2.4x faster, plans
    within -4.2..+0.3% of four DPs of their own slots). Each raised plan is simulated once, as
    counted exactly (its time is the same either way; its peak is the judge, a DP/simulator
    mismatch included), and a strategy met before is not made again: the 24-layer Llama's raise
    1.0-1.2 -> 0.5-0.6 s; at 17 budgets of five zoo chains the same plans but at two of the
    U-Net's (2.9% faster and 0.06% slower: the plain simulation no longer rejects a plan that fits)."""
    began = time.perf_counter()
    best, target, table = plan, budget - held, solver.last_table
    exact = _exact_peak(chain, plan.schedule)
    step = budget - exact
    costs, per_block = solver.chain_costs(chain)
    time_limit_hit = any(o.time_limit_hit for options in per_block for o in options)
    # a strategy's actions -> its plan, its peak counted exactly: a raised target may lead to a
    # strategy met before (one of the 8 of the 24-layer Llama's), made and simulated once
    tried: dict[tuple, Plan] = {}
    for _ in range(RAISED_TARGETS):
        if step <= 0:
            break
        if table is None or not table.covers(target + step):  # (a reach as far again, for the next raises)
            table = chain_table(costs, budget - held, solver.slots, reach=target + 2 * step)
        strategy = None if table is None else table.strategy(target + step)
        if strategy is None:
            step //= 2
            continue
        key = tuple(strategy.actions)
        if key not in tried:
            schedule = solver.instantiate(chain, per_block, strategy.actions)
            # one simulation, the exact one: its time is the plan's (first-run memory changes the
            # peak only), its peak the judge (a DP/simulator mismatch shows as a peak over the budget)
            result = simulate(chain.whole_graph(), schedule, first_run_bytes=chain.first_run_bytes)
            tried[key] = Plan(feasible=True, budget=budget, solver=solver.name, schedule=schedule,
                              predicted_peak=chain.held_bytes + result.peak_bytes, predicted_time=result.time_s,
                              baseline_time=plan.baseline_time, time_limit_hit=time_limit_hit,
                              notes=[f"DP slot: {strategy.slot_bytes} B"])
        candidate = tried[key]
        if candidate.predicted_peak > budget:
            step //= 2  # too far: half as far
            continue
        target += step
        if candidate.predicted_time >= best.predicted_time:
            break  # fits, no faster: the slack left is the last plan's or less
        best, exact, step = candidate, candidate.predicted_peak, budget - candidate.predicted_peak
    if best is not plan:  # (the first plan's timings, the options' above all, and notes on its classes)
        best.timings = dict(plan.timings)
        best.notes += [note for note in plan.notes if note.startswith(ROTOR_OPTIONS)]
        best.solve_time_s = plan.solve_time_s
    best.timings["raised targets"] = time.perf_counter() - began
    best.solve_time_s += best.timings["raised targets"]
    return best, exact


def _lowest_exact_plan(chain: ModelChain, solver, solver_minimum: int | None = None) -> Plan | None:
    """The solver's plan at its own minimum budget, its ``predicted_peak`` counted exactly (each
    first-run allocation from its node's first run, not all of them from the start); None where
    the solver finds none.

    The solvers plan within the budget less all the first-run memory (generator states kept to
    replay random nodes, parameters' sums, input gradients: :func:`_held_bytes`), as if alive
    from the step's start; counted where it is made, the plan at the solver's minimum may fit a
    budget below that sum (a layer applied three times with dropouts: 0.89x of it). For the
    planners over the chain (their solves are dynamic programs over options already made); a
    whole-graph ILP would solve again at its time limit, and keeps the reserve."""
    if not chain.blocks or not isinstance(solver, ChainPlanner):
        return None
    internal = solver.min_budget(chain) if solver_minimum is None else int(solver_minimum)
    plan = solver.solve(chain, internal)
    if plan is None or not plan.feasible:
        return None
    plan.predicted_peak = _exact_peak(chain, plan.schedule)
    return plan


def _exact_peak(chain: ModelChain, schedule) -> int:
    """The predicted peak of ``schedule`` with what the executor holds besides the CD-graph's
    data: the chain's held bytes, and each first-run allocation from its node's first run."""
    return chain.held_bytes + simulate(chain.whole_graph(), schedule, first_run_bytes=chain.first_run_bytes).peak_bytes


def no_recompute_peak(chain: ModelChain) -> int:
    """The predicted peak (bytes) of the plan that recomputes nothing: autograd's, the memory
    a budget given as a fraction is a fraction of."""
    return _exact_peak(chain, no_recompute_schedule(chain))


def _minimum(chain: ModelChain, solver_minimum: int | None, lowest: Plan | None = None) -> int:
    """The smallest budget: the solver's minimum with the first-run memory left aside as a
    whole, the plan at the solver's minimum counted exactly (``lowest``,
    :func:`_lowest_exact_plan`), or the plan without recomputation counted exactly, whichever is
    smallest (:func:`solve` accepts each)."""
    exact = no_recompute_peak(chain)
    if solver_minimum is None:
        return exact
    candidates = [exact, _held_bytes(chain) + int(solver_minimum)]
    if lowest is not None:
        candidates.append(lowest.predicted_peak)
    return min(candidates)


def _held_bytes(chain: ModelChain) -> int:
    """What the solvers leave aside of a budget: the chain's held bytes, and all its first-run
    memory (generator states, input gradients: ModelChain.first_run_reserve) as if alive from
    the start; the plan's prediction then counts each from the first run of its node."""
    return chain.held_bytes + chain.first_run_reserve()


def min_budget(chain: ModelChain, solver: str | object = "rockmate", **options) -> int:
    """The smallest budget (bytes) that ``solver`` can meet on ``chain``."""
    solver = get_solver(solver, **options)
    if not chain.blocks:
        return _minimum(chain, None)
    solver_minimum = solver.min_budget(chain)
    return _minimum(chain, solver_minimum, _lowest_exact_plan(chain, solver, solver_minimum))
