"""Every solver by name: plans within budget, predicted == simulated, infeasible budgets."""

import random
import time

import pytest

from solvers import SOLVERS, CheckmateSolver, RockmateSolver, get_solver, min_budget, simulate, solve
from solvers.bounds import operation_floor
from solvers.checkmate_ilp import highs_available
from solvers.registry import no_recompute_schedule
from solvers.toy_graphs import chain_of, diamond_graph, linear_graph, random_chain

FAST = {"rockmate": {"peak_steps": 3, "save_steps": 3, "time_limit_s": 5}}


@pytest.fixture(scope="module")
def chains():
    rng = random.Random(7)
    return [
        chain_of([linear_graph(2)], [0, 0, 0]),
        chain_of([diamond_graph()], [0, 0]),
        random_chain(rng, 4, n_classes=2, nodes_per_block=3),
    ]


@pytest.mark.parametrize("name", sorted(SOLVERS))
def test_every_plan_is_within_budget_and_predicted_by_the_simulator(name, chains):
    for chain in chains:
        solver = get_solver(name, **FAST.get(name, {}))
        lowest = solver.min_budget(chain)
        top = simulate(chain.whole_graph(), no_recompute_schedule(chain)).peak_bytes
        assert lowest <= top
        for budget in sorted({lowest, (lowest + top) // 2, top, 2 * top}):
            plan = solver.solve(chain, budget)
            assert plan.feasible, (name, budget, lowest)
            assert plan.solver == name and plan.budget == budget
            result = simulate(chain.whole_graph(), plan.schedule)
            assert plan.predicted_peak == result.peak_bytes <= budget
            assert plan.predicted_time == pytest.approx(result.time_s)
            assert plan.baseline_time == pytest.approx(sum(c.time_s for c in chain.whole_graph().compute_nodes))


@pytest.mark.parametrize("name", sorted(SOLVERS))
def test_infeasible_budget_returns_a_plan_with_the_minimum(name, chains):
    chain = chains[0]
    lowest = min_budget(chain, name, **FAST.get(name, {}))
    plan = solve(chain, lowest - 1, name, **FAST.get(name, {}))
    assert not plan.feasible and plan.min_budget == lowest and plan.schedule.ops == []
    plan = solve(chain, 0, name, **FAST.get(name, {}))
    assert not plan.feasible and plan.min_budget == lowest


def test_rockmate_is_no_worse_than_rotor_and_close_to_checkmate(chains):
    for chain in chains[:2]:
        rockmate = RockmateSolver(peak_steps=6, save_steps=6)
        checkmate = CheckmateSolver()
        rotor = get_solver("rotor")
        assert rockmate.min_budget(chain) <= rotor.min_budget(chain)
        assert checkmate.min_budget(chain) <= rockmate.min_budget(chain)
        top = simulate(chain.whole_graph(), no_recompute_schedule(chain)).peak_bytes
        for budget in (rotor.min_budget(chain), top):
            a, b = rockmate.solve(chain, budget), rotor.solve(chain, budget)
            c = checkmate.solve(chain, budget)
            assert a.predicted_time <= b.predicted_time + 1e-9
            assert c.predicted_time <= a.predicted_time + 1e-9


@pytest.mark.parametrize("name", sorted(SOLVERS))
def test_no_solver_goes_below_the_operation_floor(name, chains):
    for chain in chains:
        floor = operation_floor(chain.whole_graph())
        assert floor.bytes > 0 and floor.node
        assert get_solver(name, **FAST.get(name, {})).min_budget(chain) >= floor.bytes, (name, floor)


def test_checkmate_stopped_by_its_time_limit_keeps_a_schedule_that_fits(chains, monkeypatch):
    """A budgeted solve that finds nothing in time falls back to the lowest-peak schedule: a
    feasible plan flagged as time-limited when it fits, never "infeasible" with a minimum under
    the budget."""
    from solvers.checkmate_ilp import ILPSolution, RkCheckmateILP

    real_solve = RkCheckmateILP.solve

    def stopped_unless_peak(self, peak_bytes, save_bytes=None, *, objective="time", **kwargs):
        if objective == "time":
            return ILPSolution(False, status="Not Solved", time_limit_hit=True)
        return real_solve(self, peak_bytes, save_bytes, objective=objective, **kwargs)

    monkeypatch.setattr(RkCheckmateILP, "solve", stopped_unless_peak)
    chain = chains[1]
    solver = CheckmateSolver()
    lowest = solver.min_budget(chain)
    plan = solver.solve(chain, lowest + 1)
    assert plan.feasible and plan.time_limit_hit and plan.predicted_peak == lowest <= plan.budget
    assert simulate(chain.whole_graph(), plan.schedule).peak_bytes == lowest
    plan = solver.solve(chain, lowest - 1)
    assert not plan.feasible and plan.time_limit_hit and plan.min_budget == lowest


@pytest.mark.parametrize("name", ["rockmate", "rotor"])
def test_the_no_recomputation_peak_is_always_a_feasible_budget(name, chains):
    """The DP rounds memory up to its slots; with coarse slots it misses the schedule that fits
    the no-recomputation peak exactly, and the planner falls back to that schedule."""
    for chain in chains:
        top = simulate(chain.whole_graph(), no_recompute_schedule(chain)).peak_bytes
        solver = get_solver(name, slots=3, **FAST.get(name, {}))
        assert solver.min_budget(chain) <= top
        plan = solver.solve(chain, top)
        assert plan.feasible and plan.predicted_peak <= top
        assert simulate(chain.whole_graph(), plan.schedule).peak_bytes == plan.predicted_peak


@pytest.mark.parametrize("backend", ["cbc", "highs"])
def test_checkmate_started_from_another_plan_is_no_worse(chains, backend):
    """Rockmate's plan as Checkmate's first incumbent: the result is within the budget and no
    slower (what bench_solvers' quality table uses to measure how far Rockmate is from it)."""
    if backend == "highs" and not highs_available():
        pytest.skip("highspy is not installed")
    for chain in chains:
        top = simulate(chain.whole_graph(), no_recompute_schedule(chain)).peak_bytes
        rockmate = RockmateSolver(peak_steps=4, save_steps=4, cache=None)
        budget = (rockmate.min_budget(chain) + top) // 2
        a = rockmate.solve(chain, budget)
        c = CheckmateSolver(ilp_solver=backend).solve(chain, budget, start_schedule=a.schedule)
        assert c.feasible and c.predicted_peak <= budget
        assert c.predicted_time <= a.predicted_time + 1e-12


def test_unknown_solver_name_says_the_allowed_names(chains):
    with pytest.raises(ValueError, match="solver must be one of"):
        solve(chains[0], 100, "magic")


def test_rockmate_option_grid_reports_its_work(chains):
    solver = RockmateSolver(peak_steps=4, save_steps=4)
    solver.solve(chains[1], 10**6)
    report = next(iter(solver.reports.values()))
    assert report.pairs == report.solved + report.reused + report.pruned_infeasible
    assert report.total_s > 0


def test_a_class_too_big_for_the_ilp_gets_rotors_options():
    """Above ``max_ilp_computes`` a class is planned as Rotor plans it (keep everything, or
    recompute the whole block), said in the plan's notes; the plan is exact and within budget
    as any (T5's merged class of 245 computes spent minutes in its ILP's first solves)."""
    from exactness import check_training
    from rkgb.build import build
    from solvers import registry
    from zoo import ZOO

    model, sample = ZOO["gpt"].build()
    report = check_training(model, sample, 0.8, "rockmate", steps=2, max_ilp_computes=5, at_minimum=True)
    assert any(note.startswith("Rotor's options for class") for note in report.compiled.plan.notes)
    chain = build(model, sample, cost_model="flops").model_chain
    small = registry.min_budget(chain, "rockmate", max_ilp_computes=5, peak_steps=3, save_steps=3)
    assert small == registry.min_budget(chain, "rotor")


def test_classes_solved_side_by_side_give_the_options_of_one_after_another(monkeypatch):
    """RockmateSolver runs two classes' grids at a time, their ILP solves sharing ``workers``
    solver slots: never more solves at once than that, and each class's options are those of
    its grid solved alone."""
    import threading

    from solvers.block_options import solve_class_options
    from solvers.checkmate_ilp import RkCheckmateILP

    rng = random.Random(11)
    chain = random_chain(rng, 6, n_classes=4, nodes_per_block=4)
    assert len({b.class_index for b in chain.blocks}) >= 3
    running, most, lock = [0], [0], threading.Lock()
    threads = set()
    real_solve = RkCheckmateILP.solve

    def counted(self, *args, **kwargs):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            time.sleep(0.02)  # (solves long enough to overlap: without the shared slots, up to 4 at once)
            return real_solve(self, *args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(RkCheckmateILP, "solve", counted)
    real_class_options = RockmateSolver.class_options

    def class_options(self, *args, **kwargs):
        threads.add(threading.current_thread().name)
        return real_class_options(self, *args, **kwargs)

    monkeypatch.setattr(RockmateSolver, "class_options", class_options)
    solver = RockmateSolver(peak_steps=4, save_steps=4, workers=2, cache=None)
    solver.solve(chain, 10**9)
    assert most[0] == 2
    assert threads and all(name.startswith("rockmate-class") for name in threads)  # (grids side by side)
    for index in sorted({b.class_index for b in chain.blocks}):
        alone = solve_class_options(chain.classes[index], peak_steps=4, save_steps=4, time_limit_s=solver.time_limit_s,
                                    forward_recompute=solver.forward_recompute, lazy_recompute=solver.lazy_recompute,
                                    gap=solver.gap, workers=1, grid_time_limit_s=solver.grid_time_limit_s,
                                    whole_runs=solver.whole_runs)
        side_by_side = solver._options_of(chain, index)
        assert [o.key() for o in side_by_side.options] == [o.key() for o in alone.options]
        assert solver.option_seconds[f"options of class {index} ({len(chain.classes[index].compute_nodes)} computes)"] >= 0
    assert solver.option_seconds["options"] > 0


def test_a_plan_is_never_slower_than_the_plan_of_a_lower_budget(monkeypatch):
    """The solvers plan within the budget less all the first-run memory (generator states of the
    dropouts) as if alive from the start; counted from each allocation's first run, the plan's
    peak is lower, and a plan of a higher target may fit the budget: ``solve`` raises the target
    into that slack (``RAISED_TARGETS``). On the zoo's GPT (17 budgets from its minimum to its
    no-recompute peak), no budget's plan is slower than another budget's plan that fits it;
    without the raise, 15 of the 17 were."""
    import solvers.registry as registry
    from rkgb.build import build
    from zoo import ZOO

    model, sample = ZOO["gpt"].build()
    chain = build(model, sample, cost_model="flops").model_chain
    assert chain.first_run_reserve() > 0

    def sweep():
        solver = get_solver("rockmate", cache=None, peak_steps=4, save_steps=4)
        low, top = min_budget(chain, solver), registry.no_recompute_peak(chain)
        budgets = [int(low + (top - low) * i / 16) for i in range(17)]
        plans = [solve(chain, budget, solver) for budget in budgets]
        assert all(p.feasible and p.predicted_peak <= b for p, b in zip(plans, budgets))
        return sum(p.predicted_time > min(q.predicted_time for q in plans if q.predicted_peak <= b) * (1 + 1e-9)
                   for p, b in zip(plans, budgets))

    assert sweep() == 0
    monkeypatch.setattr(registry, "RAISED_TARGETS", 0)
    assert sweep() >= 10
