"""rk-Rotor: exhaustive search on tiny chains, Rotor's recurrence, and prediction == simulation."""

import functools
import random

import pytest

from solvers.options import ClassOptions, autograd_option, no_grad_forward, option_from_computes
from solvers.registry import ChainPlanner, RotorSolver, no_recompute_schedule
from solvers.rotor_dp import ChainAction, chain_table, solve_chain, strategy_peak, strategy_time
from solvers.simulate import simulate
from solvers.toy_graphs import chain_of, linear_graph, random_chain, residual_graph


class TwoOptions(ChainPlanner):
    """Autograd, plus a second option: every backward recomputes the whole forward."""

    def class_options(self, chain, index):
        graph = chain.classes[index]
        forwards = [c.name for c in graph.forward_nodes()]
        backwards = [c.name for c in graph.backward_nodes()]
        # forward without keeping anything but the output, recompute all before the backward
        lean = option_from_computes(graph, forwards + ["loss"] + forwards[:-1] + backwards[:1]
                                    + forwards[:-1] + backwards[1:]) if len(backwards) > 1 else None
        options = [autograd_option(graph)] + ([lean] if lean else [])
        return ClassOptions(graph=graph, options=options, no_grad=no_grad_forward(graph))


def all_strategies(n, n_options):
    """Every strategy of Rotor's space with the options (lists of ChainActions)."""

    @functools.lru_cache(maxsize=None)
    def sub(s, t):
        results = []
        last = t == n - 1
        for o in range(n_options[s]):
            if s < t:
                for rest in sub(s + 1, t):
                    results.append((ChainAction("forward", s, o),) + rest + (ChainAction("backward", s, o),))
            else:
                middle = (ChainAction("loss"),) if last else ()
                results.append((ChainAction("forward", s, o),) + middle + (ChainAction("backward", s, o),))
        for split in range(s + 1, t + 1):
            fn = tuple(ChainAction("no_grad", k, forget_input=k > s) for k in range(s, split))
            for right in sub(split, t):
                for left in sub(s, split - 1):
                    results.append(fn + right + (ChainAction("forget_output", split - 1),) + left)
        return tuple(results)

    return sub(0, n - 1)


def exhaustive(planner, chain, budget):
    costs, per_block = planner.chain_costs(chain)
    best = None
    graph = chain.whole_graph()
    for actions in all_strategies(len(chain.blocks), [len(b.options) for b in costs.blocks]):
        schedule = planner.instantiate(chain, per_block, list(actions))
        result = simulate(graph, schedule)
        assert result.peak_bytes == strategy_peak(costs, list(actions))
        assert result.time_s == pytest.approx(strategy_time(costs, list(actions)))
        if result.peak_bytes <= budget and (best is None or result.time_s < best - 1e-12):
            best = result.time_s
    return best


@pytest.mark.parametrize("seed", range(8))
def test_dp_equals_exhaustive_search(seed):
    rng = random.Random(seed)
    chain = random_chain(rng, rng.randint(1, 4), n_classes=2, nodes_per_block=3)
    planner = TwoOptions(name="two")
    costs, _ = planner.chain_costs(chain)
    top = simulate(chain.whole_graph(), no_recompute_schedule(chain)).peak_bytes
    for budget in range(top // 3, top + 2, max(1, top // 15)):
        expected = exhaustive(planner, chain, budget)
        strategy = solve_chain(costs, budget, slots=10**6)  # one byte per slot: exact
        if expected is None:
            assert strategy is None, budget
            continue
        assert strategy is not None, budget
        assert strategy.time_s == pytest.approx(expected), budget
        assert strategy.peak_bytes <= budget


@pytest.mark.parametrize("blocks", [1, 2, 3])
def test_dp_equals_exhaustive_search_with_shared_gradients(blocks):
    """Residual blocks: an add passes one gradient to both inputs (one storage, several data
    nodes); the chain figures still add up to the whole graph's simulation."""
    chain = chain_of([residual_graph()], [0] * blocks)
    planner = TwoOptions(name="two")
    costs, _ = planner.chain_costs(chain)
    top = simulate(chain.whole_graph(), no_recompute_schedule(chain)).peak_bytes
    for budget in range(top // 3, top + 2, max(1, top // 15)):
        expected = exhaustive(planner, chain, budget)
        strategy = solve_chain(costs, budget, slots=10**6)
        assert (strategy is None) == (expected is None), budget
        if strategy is not None:
            assert strategy.time_s == pytest.approx(expected), budget


def rotor_reference(costs, budget):
    """Rotor's recurrence with one option per block, written as a plain recursion in bytes."""
    blocks = costs.blocks
    n = len(blocks)
    a = [b.output_bytes for b in blocks]
    g = [b.output_grad_bytes for b in blocks]

    @functools.lru_cache(maxsize=None)
    def opt(s, t, m):
        last = t == n - 1
        d = 0 if last else g[t]
        k = a[-1] if last else 0  # the outputs stay to the end (their gradients are freed after use)
        o = blocks[s].options[0]
        best = float("inf")
        if s == t:
            need = max(o.forward_peak, o.saved + costs.loss_overhead + g[-1], o.backward_peak) if last else max(
                d + o.forward_peak, o.backward_peak)
            if need <= m:
                best = o.forward_time + o.backward_time + (costs.loss_time if last else 0)
        elif max(d + o.forward_peak, k + o.backward_peak) <= m:
            best = o.forward_time + o.backward_time + opt(s + 1, t, m - o.saved)
        fn_peak, fn_time = 0, 0.0
        for split in range(s + 1, t + 1):
            j = split - 1
            fn_peak = max(fn_peak, (a[j - 1] if j > s else 0) + blocks[j].no_grad_peak)
            fn_time += blocks[j].no_grad_time
            if d + fn_peak <= m and m - a[j] >= 0 and m - k >= 0:
                best = min(best, fn_time + opt(split, t, m - a[j]) + opt(s, split - 1, m - k))
        return best

    return opt(0, n - 1, budget)


@pytest.mark.parametrize("seed", range(10))
def test_single_option_dp_reproduces_rotor_recurrence(seed):
    rng = random.Random(100 + seed)
    chain = random_chain(rng, rng.randint(2, 7), n_classes=3, nodes_per_block=rng.randint(1, 4))
    planner = RotorSolver()
    costs, _ = planner.chain_costs(chain)
    top = simulate(chain.whole_graph(), no_recompute_schedule(chain)).peak_bytes
    for budget in range(top // 4, top + 2, max(1, top // 20)):
        expected = rotor_reference(costs, budget)
        strategy = solve_chain(costs, budget, slots=10**6)
        if expected == float("inf"):
            assert strategy is None
        else:
            assert strategy is not None and strategy.time_s == pytest.approx(expected)


@pytest.mark.parametrize("seed", range(12))
def test_prediction_equals_simulation_with_discretization(seed):
    rng = random.Random(200 + seed)
    chain = random_chain(rng, rng.randint(1, 9), n_classes=3, nodes_per_block=rng.randint(1, 5))
    planner = TwoOptions(name="two", slots=rng.choice([7, 50, 500]))
    top = simulate(chain.whole_graph(), no_recompute_schedule(chain)).peak_bytes
    for budget in (top // 2, 2 * top // 3, top, 2 * top):
        plan = planner.solve(chain, budget)  # raises if the DP's peak differs from the simulator's
        if plan.feasible:
            result = simulate(chain.whole_graph(), plan.schedule)
            assert plan.predicted_peak == result.peak_bytes <= budget
            assert plan.predicted_time == pytest.approx(result.time_s)
            assert plan.baseline_time <= plan.predicted_time + 1e-9
        else:
            assert plan.min_budget > budget and plan.schedule.ops == []


@pytest.mark.parametrize("seed", range(6))
def test_a_table_reaching_further_gives_each_budget_the_strategy_of_its_own_dp(seed):
    """The DP's tables made for one budget and reaching twice as far (``chain_table``, what the
    registry's raised targets read) give every budget up to there the strategy of a DP of its
    own at the same slot (one byte here: slots of 10**9), and the first budget's strategy the
    same as a DP made for it alone (any slot)."""
    rng = random.Random(seed)
    chain = random_chain(rng, rng.randint(2, 7), n_classes=rng.randint(1, 3), nodes_per_block=rng.randint(2, 4))
    costs, _ = TwoOptions(name="two").chain_costs(chain)
    top = simulate(chain.whole_graph(), no_recompute_schedule(chain)).peak_bytes

    def figures(strategy):
        return None if strategy is None else (strategy.actions, strategy.time_s, strategy.peak_bytes)

    compared = 0
    for start in (top // 4, top // 2, 3 * top // 4):
        exact = chain_table(costs, start, slots=10**9, reach=2 * start)
        assert exact.unit == 1 and exact.covers(2 * start) and not exact.covers(2 * start + 1)
        for budget in range(start, 2 * start + 1, max(1, start // 7)):
            assert figures(exact.strategy(budget)) == figures(solve_chain(costs, budget, slots=10**9))
            compared += 1
        coarse = chain_table(costs, start, slots=40, reach=2 * start)
        assert figures(coarse.strategy(start)) == figures(solve_chain(costs, start, slots=40))
    assert compared >= 18


def test_memory_is_relative_to_the_budget():
    """A chain of 2 MiB and the same chain scaled to 20 GiB get the same strategy."""
    small = chain_of([linear_graph(3, size_bytes=1 << 19, phantoms_bytes=1 << 18)], [0] * 5)
    large = chain_of([linear_graph(3, size_bytes=10 << 30, phantoms_bytes=5 << 30)], [0] * 5)
    scale = (10 << 30) // (1 << 19)
    planner = RotorSolver()
    small_costs, _ = planner.chain_costs(small)
    large_costs, _ = RotorSolver().chain_costs(large)
    top = simulate(small.whole_graph(), no_recompute_schedule(small)).peak_bytes
    for fraction in (0.5, 0.7, 0.9):
        a = solve_chain(small_costs, int(top * fraction))
        b = solve_chain(large_costs, int(top * fraction) * scale)
        assert (a is None) == (b is None)
        if a:
            assert a.actions == b.actions


def test_long_chain_of_identical_blocks_is_iterative_and_fast():
    chain = chain_of([linear_graph(2)], [0] * 256)
    planner = RotorSolver()
    top = simulate(chain.whole_graph(), no_recompute_schedule(chain)).peak_bytes
    plan = planner.solve(chain, top // 8)
    assert plan.feasible and plan.predicted_peak <= top // 8
    assert plan.predicted_time > plan.baseline_time
