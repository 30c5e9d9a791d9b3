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
identical blocks has only 2 x 256 distinct sub-chains).
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


def _shifted(padded: np.ndarray, by: int, size: int) -> np.ndarray:
    """``out[m] = values[m - by]`` (infeasible where ``m < by``) from ``padded``: ``size``
    infeasible slots then ``values``; a view (no array made per shift: the DP makes ~14000 of
    them on a 52-block chain)."""
    by = min(max(int(by), 0), size)
    return padded[size - by: 2 * size - by]


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
    n = len(costs.blocks)
    if n == 0 or budget < 0:
        return None
    unit = max(1, math.ceil(budget / slots))
    size = budget // unit + 1

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
    table: dict[tuple, int] = {}
    for s in range(n):
        previous = -1
        for t in range(s, n):
            previous = prefix.setdefault((previous, keys[t]), len(prefix))
            sub_id[s, t] = table.setdefault((previous, t == n - 1), len(table))

    # each sub-chain's best time by slot, after ``size`` infeasible slots (shifts are views of it)
    padded: dict[int, np.ndarray] = {}
    slot_numbers = np.arange(size)
    choices: dict[int, np.ndarray] = {}
    n_options = [len(b.options) for b in blocks]
    no_grad_time = np.array([b.no_grad_time for b in blocks])
    no_grad_cumulative = np.concatenate([[0.0], np.cumsum(no_grad_time)])

    for length in range(1, n + 1):
        for s in range(0, n - length + 1):
            t = s + length - 1
            key = int(sub_id[s, t])
            if key in padded:
                continue
            last = t == n - 1
            d_t = 0 if last else grad[t]
            k_t = out[n - 1] if last else 0  # the user keeps the model's outputs
            best, choice = _best_option(option_arrays[s], s < t, last, d_t, k_t, loss_slots, costs.loss_time,
                                        padded[int(sub_id[s + 1, t])] if s < t else None, size)
            # or the blocks s..split-1 without grad first, every split at once (the first of
            # equal times kept: an option before the splits, a split before later ones)
            splits, thresholds = [], []
            fn_peak = 0
            for split in range(s + 1, t + 1):
                k = split - 1  # block run without grad, its output is x_k
                fn_peak = max(fn_peak, (out[k - 1] if k > s else 0) + no_grad[k])
                if d_t + fn_peak >= size:
                    break
                splits.append(split)
                thresholds.append(d_t + fn_peak)
            if splits:
                candidates = (
                    np.stack([_shifted(padded[int(sub_id[split, t])], out[split - 1], size) for split in splits])
                    + np.stack([_shifted(padded[int(sub_id[s, split - 1])], k_t, size) for split in splits])
                    + (no_grad_cumulative[splits] - no_grad_cumulative[s])[:, None]
                )
                candidates[slot_numbers[None, :] < np.array(thresholds)[:, None]] = INFEASIBLE
                rows = np.concatenate([best[None, :], candidates])
                winner = np.argmin(rows, axis=0)
                best = rows[winner, slot_numbers]
                split_won = winner > 0
                choice[split_won] = n_options[s] + (winner[split_won] - 1)
            padded[key] = np.concatenate([np.full(size, INFEASIBLE), best])
            choices[key] = choice

    top = padded[int(sub_id[0, n - 1])][size:]
    budget_slot = size - 1
    if not np.isfinite(top[budget_slot]):
        return None

    # reconstruction, iterative: a stack of ("solve", s, t, m) and ("emit", action)
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
        slot_bytes=unit,
        notes=[f"dp time {time_s!r}"],
    )
