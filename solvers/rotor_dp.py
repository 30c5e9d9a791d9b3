"""rk-Rotor: the dynamic program over a chain of blocks, each with several options.

Rotor (Beaumont et al., "Optimal checkpointing for heterogeneous chains", 2019; Herrmann et
al., "Optimal checkpointing for heterogeneous chains: how to train deep neural networks with
limited memory", 2019) solves a chain where each stage either keeps everything it needs for
its backward, or keeps only its input and is recomputed later. Rockmate's rk-Rotor (Zhao et
al., ICML 2023, section 4.2) replaces "keep everything" by the block's options.

Memory model (bytes; exactly what the simulator measures on the instantiated schedule)
------------------------------------------------------------------------------------------
Blocks are ``1..n``; ``a_i`` is the size of block ``i``'s output data, ``g_i`` of its output
grads (``g_0``: the model's input grads), option figures are those of :class:`BlockOption`.
``Opt(s, t)`` runs the forward and backward of blocks ``s..t``; it starts with ``x_{s-1}``
alive (owned outside) and, when ``t < n``, the output grads ``g_t`` alive (owned inside); it
ends with ``g_{s-1}`` (plus ``a_n`` when ``t = n``: the user keeps the model's outputs). Let
``D_t = g_t`` if ``t < n`` else 0 and ``K_t = a_n`` if ``t = n`` else 0. Its peak ``P(s, t)``,
relative to what is alive outside it, is:

* option ``o`` of block ``s`` (``s < t``):
  ``max(D_t + fwd_peak_o, saved_o + P(s+1, t), K_t + bwd_peak_o)``;
* option ``o`` of block ``s = t < n``: ``max(D_t + fwd_peak_o, bwd_peak_o)``;
* option ``o`` of block ``s = t = n``:
  ``max(fwd_peak_o, saved_o + loss_overhead + g_n, bwd_peak_o)`` (the variant keeping outputs);
* forward without grad of ``s..s'-1`` (``x_{k-1}`` is forgotten after block ``k``'s forward for
  ``k > s``), then ``Opt(s', t)``, then forget ``x_{s'-1}``, then ``Opt(s, s'-1)``:
  ``max(D_t + max_k([k > s] a_{k-1} + no_grad_peak_k), a_{s'-1} + P(s', t), K_t + P(s, s'-1))``.

The DP works on memory slots relative to the budget (``slots`` of ``ceil(budget / slots)``
bytes; sizes are rounded up, so a feasible answer is feasible in bytes), is vectorized over the
slots, and over a block's options and the splits of a sub-chain, with numpy (the first of equal
times kept, as one after another would: the same strategies on 1200 DPs of random and
transformer chains; a 52-block Llama-24 chain's DP 0.13 -> 0.08 s), iterative (no recursion),
and solves once each sub-chain whose sequence of classes it has already seen (a chain of 256
identical blocks has only 2 x 256 distinct sub-chains). The sub-chains' times are the rows of
one array, each split's shifted times gathered from it at once (a 108-block MobileViT chain's
DP 1.4 -> 1.2 s). A slot's figures depend on the lower slots only: the tables made for one
budget and reaching further (:class:`ChainTable`) give any budget up to there its strategy,
with no DP of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "OptionCosts",
    "BlockCosts",
    "ChainCosts",
    "ChainAction",
    "ChainStrategy",
    "ChainTable",
    "chain_table",
    "solve_chain",
    "strategy_peak",
    "strategy_time",
]

INFEASIBLE = np.inf


@dataclass(frozen=True)
class OptionCosts:
    forward_peak: int
    backward_peak: int
    saved: int
    end: int
    forward_time: float
    backward_time: float


@dataclass
class BlockCosts:
    """The figures of one block; ``class_key`` equal for blocks with equal figures."""

    options: list[OptionCosts]
    no_grad_peak: int
    no_grad_time: float
    output_bytes: int
    output_grad_bytes: int
    class_key: object = None


@dataclass
class ChainCosts:
    """The chain's blocks (the last one's options keep its outputs) and the loss."""

    blocks: list[BlockCosts]
    loss_time: float = 0.0
    loss_overhead: int = 0


@dataclass(frozen=True)
class ChainAction:
    """One step of a chain strategy.

    kind: ``"forward"`` (block, option), ``"no_grad"`` (block; ``forget_input``: forget the
    block's input data after it), ``"forget_output"`` (block), ``"loss"``, ``"backward"``
    (block, option).
    """

    kind: str
    block: int = -1
    option: int = -1
    forget_input: bool = False


@dataclass
class ChainStrategy:
    actions: list[ChainAction]
    time_s: float
    peak_bytes: int
    slot_bytes: int
    notes: list[str] = field(default_factory=list)


def strategy_time(costs: ChainCosts, actions: list[ChainAction]) -> float:
    """The time of ``actions`` (the sum of what they run)."""
    total = 0.0
    for a in actions:
        if a.kind == "forward":
            total += costs.blocks[a.block].options[a.option].forward_time
        elif a.kind == "backward":
            total += costs.blocks[a.block].options[a.option].backward_time
        elif a.kind == "no_grad":
            total += costs.blocks[a.block].no_grad_time
        elif a.kind == "loss":
            total += costs.loss_time
    return total


def strategy_peak(costs: ChainCosts, actions: list[ChainAction]) -> int:
    """The peak memory of ``actions`` in bytes, walking the block-level memory model."""
    blocks = costs.blocks
    memory = 0
    peak = 0
    for a in actions:
        if a.kind == "forward":
            o = blocks[a.block].options[a.option]
            peak = max(peak, memory + o.forward_peak)
            memory += o.saved
        elif a.kind == "no_grad":
            b = blocks[a.block]
            peak = max(peak, memory + b.no_grad_peak)
            memory += b.output_bytes
            if a.forget_input:
                memory -= blocks[a.block - 1].output_bytes
        elif a.kind == "forget_output":
            memory -= blocks[a.block].output_bytes
        elif a.kind == "loss":
            peak = max(peak, memory + costs.loss_overhead + blocks[-1].output_grad_bytes)
            memory += blocks[-1].output_grad_bytes
        elif a.kind == "backward":
            o = blocks[a.block].options[a.option]
            context = memory - o.saved - blocks[a.block].output_grad_bytes
            peak = max(peak, context + o.backward_peak)
            memory = context + o.end
        else:  # pragma: no cover - defensive
            raise ValueError(f"unknown chain action {a.kind!r}")
    return peak


def _best_option(figures: np.ndarray, inner: bool, last: bool, d_t: int, k_t: int, loss_slots: int,
                 loss_time: float, following: np.ndarray | None, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The best time at each memory slot over a block's options (``figures``: one row of forward
    peak, backward peak, saved slots and time per option) and the option giving it (the first of
    equals; -1 where none fits): all options at once, the same figures as one after another.
    ``inner``: the sub-chain goes on after the block (``following``: its times by slot, after
    ``size`` infeasible slots)."""
    if len(figures) == 0:
        return np.full(size, INFEASIBLE), np.full(size, -1, dtype=np.int32)
    slot_numbers = np.arange(size)
    forward, backward, saved, time = (figures[:, i] for i in range(4))
    if inner:
        threshold = np.maximum(d_t + forward, k_t + backward)
        # the following sub-chain's times shifted by each option's saved slots
        columns = np.maximum(size + slot_numbers[None, :] - saved.astype(np.int64)[:, None], 0)
        candidates = following[columns] + time[:, None]
    else:
        threshold = np.maximum(np.maximum(forward, saved + loss_slots), backward) if last \
            else np.maximum(d_t + forward, backward)
        candidates = np.repeat((time + loss_time if last else time)[:, None], size, axis=1)
    candidates[slot_numbers[None, :] < threshold[:, None]] = INFEASIBLE
    choice = np.argmin(candidates, axis=0).astype(np.int32)
    best = candidates[choice, slot_numbers]
    choice[~np.isfinite(best)] = -1
    return best, choice


def solve_chain(costs: ChainCosts, budget: int, slots: int = 500) -> ChainStrategy | None:
    """The fastest strategy of the chain whose peak is at most ``budget``, or None.

    Parameters
    ----------
    costs
        The chain's figures (:func:`solvers.registry.chain_costs` builds them).
    budget
        Bytes.
    slots
        Number of memory slots; the slot is ``ceil(budget / slots)`` bytes (1 byte when the
        budget is at most ``slots``, which makes the DP exact).

    Returns
    -------
    ChainStrategy or None when no strategy fits (at this discretization).
    """
    table = chain_table(costs, budget, slots)
    return None if table is None else table.strategy(budget)


@dataclass
class ChainTable:
    """The DP's tables: each sub-chain's best time at every slot of ``unit`` bytes up to
    ``size - 1`` slots, and the choice giving it. A slot's figures depend on the lower slots
    only, so the strategy of any budget up to ``(size - 1) * unit`` bytes is read back from
    them (:meth:`strategy`) as a DP of that budget with this slot would find it, with no DP of
    its own (``solvers.registry``'s raised targets read theirs so)."""

    costs: ChainCosts
    unit: int
    size: int
    sub_id: np.ndarray
    padded: np.ndarray
    choices: dict[int, np.ndarray]
    options: list[list[tuple]]
    out: list[int]

    def covers(self, budget: int) -> bool:
        return 0 <= budget // self.unit < self.size

    def strategy(self, budget: int) -> ChainStrategy | None:
        """The fastest strategy whose peak is at most ``budget`` (at this table's slot; within
        :meth:`covers`), or None."""
        assert self.covers(budget), f"budget {budget} B beyond the table's {self.size - 1} slots of {self.unit} B"
        return _reconstruct(self, budget // self.unit)


def chain_table(costs: ChainCosts, budget: int, slots: int = 500, reach: int | None = None) -> ChainTable | None:
    """The DP's tables with slots of ``ceil(budget / slots)`` bytes up to ``max(budget, reach)``
    bytes; None for an empty chain or a negative budget."""
    n = len(costs.blocks)
    if n == 0 or budget < 0:
        return None
    unit = max(1, math.ceil(budget / slots))
    size = max(budget, reach or 0) // unit + 1

    def c(x: int) -> int:
        return -(-int(x) // unit)

    blocks = costs.blocks
    out = [c(b.output_bytes) for b in blocks]
    grad = [c(b.output_grad_bytes) for b in blocks]
    no_grad = [c(b.no_grad_peak) for b in blocks]
    options = [
        [(c(o.forward_peak), c(o.backward_peak), c(o.saved), o.forward_time + o.backward_time) for o in b.options]
        for b in blocks
    ]
    loss_slots = c(costs.loss_overhead + blocks[-1].output_grad_bytes)
    option_arrays = [np.array(block_options, dtype=np.float64).reshape(-1, 4) for block_options in options]

    # ids of sub-chains (s, t): equal when the sequences of classes are equal (and t = n or not)
    keys = [b.class_key if b.class_key is not None else ("block", i) for i, b in enumerate(blocks)]
    prefix: dict[tuple, int] = {}
    sub_id = np.full((n, n), -1, dtype=np.int64)
    sub_chains: dict[tuple, int] = {}
    for s in range(n):
        previous = -1
        for t in range(s, n):
            previous = prefix.setdefault((previous, keys[t]), len(prefix))
            sub_id[s, t] = sub_chains.setdefault((previous, t == n - 1), len(sub_chains))

    # each sub-chain's best time by slot after ``size`` infeasible slots, one row per sub-chain
    # id (a shift of it is a slice: out[m] = row[size + m - by])
    padded = np.empty((len(sub_chains), 2 * size))
    padded[:, :size] = INFEASIBLE
    slot_numbers = np.arange(size)
    choices: dict[int, np.ndarray] = {}
    n_options = [len(b.options) for b in blocks]
    no_grad_time = np.array([b.no_grad_time for b in blocks])
    no_grad_cumulative = np.concatenate([[0.0], np.cumsum(no_grad_time)])
    out_array = np.array(out, dtype=np.int64)
    # the peak of running block k without grad after block s (its input x_{k-1} alive): for k = s
    # the input is outside (``no_grad_first``)
    no_grad_first = np.array(no_grad, dtype=np.int64)
    no_grad_after = np.concatenate([[0], out_array[:-1]]) + no_grad_first

    for length in range(1, n + 1):
        for s in range(0, n - length + 1):
            t = s + length - 1
            key = int(sub_id[s, t])
            if key in choices:  # (a sub-chain of the same classes, solved)
                continue
            last = t == n - 1
            d_t = 0 if last else grad[t]
            k_t = out[n - 1] if last else 0  # the user keeps the model's outputs
            best, choice = _best_option(option_arrays[s], s < t, last, d_t, k_t, loss_slots, costs.loss_time,
                                        padded[int(sub_id[s + 1, t])] if s < t else None, size)
            # or the blocks s..split-1 without grad first, every split at once (the first of
            # equal times kept: an option before the splits, a split before later ones); the
            # splits that fit: those whose forward without grad peaks under the slots
            if s < t:
                peaks = np.maximum.accumulate(np.concatenate([no_grad_first[s:s + 1], no_grad_after[s + 1:t]]))
                fitting = int(np.searchsorted(d_t + peaks >= size, True))
            else:
                fitting = 0
            if fitting:
                splits = np.arange(s + 1, s + 1 + fitting)
                shifts = np.minimum(out_array[splits - 1], size)
                after = padded[sub_id[splits, t][:, None], (size - shifts)[:, None] + slot_numbers[None, :]]
                shift = min(k_t, size)
                before = padded[sub_id[s, splits - 1], size - shift: 2 * size - shift]
                candidates = after + before + (no_grad_cumulative[splits] - no_grad_cumulative[s])[:, None]
                candidates[slot_numbers[None, :] < (d_t + peaks[:fitting])[:, None]] = INFEASIBLE
                rows = np.concatenate([best[None, :], candidates])
                winner = np.argmin(rows, axis=0)
                best = rows[winner, slot_numbers]
                split_won = winner > 0
                choice[split_won] = n_options[s] + (winner[split_won] - 1)
            padded[key, size:] = best
            choices[key] = choice

    return ChainTable(costs, unit, size, sub_id, padded, choices, options, out)


def _reconstruct(table: ChainTable, budget_slot: int) -> ChainStrategy | None:
    """The strategy of ``table`` at ``budget_slot`` (iterative: a stack of ("solve", s, t, m)
    and ("emit", action)); None where no strategy fits."""
    costs, sub_id, padded, choices, options, out = (table.costs, table.sub_id, table.padded, table.choices,
                                                     table.options, table.out)
    n, size = len(costs.blocks), table.size
    n_options = [len(b.options) for b in costs.blocks]
    top = padded[int(sub_id[0, n - 1])][size:]
    if not np.isfinite(top[budget_slot]):
        return None
    actions: list[ChainAction] = []
    stack: list[tuple] = [("solve", 0, n - 1, budget_slot)]
    while stack:
        item = stack.pop()
        if item[0] == "emit":
            actions.append(item[1])
            continue
        _, s, t, m = item
        key = int(sub_id[s, t])
        picked = int(choices[key][m])
        assert picked >= 0 and np.isfinite(padded[key][size + m]), "DP reconstruction reached an infeasible state"
        last = t == n - 1
        if picked < n_options[s]:
            saved = options[s][picked][2]
            stack.append(("emit", ChainAction("backward", s, picked)))
            if s < t:
                stack.append(("solve", s + 1, t, m - saved))
            elif last:
                stack.append(("emit", ChainAction("loss")))
            stack.append(("emit", ChainAction("forward", s, picked)))
        else:
            split = s + 1 + picked - n_options[s]
            k_t = out[n - 1] if last else 0  # the user keeps the model's outputs
            stack.append(("solve", s, split - 1, m - k_t))
            stack.append(("emit", ChainAction("forget_output", split - 1)))
            stack.append(("solve", split, t, m - out[split - 1]))
            for k in range(split - 1, s - 1, -1):
                stack.append(("emit", ChainAction("no_grad", k, forget_input=k > s)))
    time_s = float(top[budget_slot])
    return ChainStrategy(
        actions=actions,
        time_s=strategy_time(costs, actions),
        peak_bytes=strategy_peak(costs, actions),
        slot_bytes=table.unit,
        notes=[f"dp time {time_s!r}"],
    )
