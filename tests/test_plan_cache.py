"""The plan cache on disk, and where planning time goes (``Plan.timings``)."""

from __future__ import annotations

import dataclasses
import functools
import marshal
import pickle

import pytest
import torch

from rkgb.build import build
from rockmate import Rockmate
from solvers import registry
from solvers.option_cache import OptionCache
from solvers.plan_cache import plan_key
from zoo import ZOO

GRID = dict(peak_steps=3, save_steps=3)


@functools.lru_cache(maxsize=1)
def _chain():
    """The chain of a 2-layer GPT (built once: the tests only read it)."""
    model, sample = ZOO["gpt"].build(n_layer=2)
    return build(model, sample, cost_model="flops").model_chain


def test_a_second_build_reads_its_plan_and_another_budget_every_option_from_disk(tmp_path, monkeypatch):
    """The same chain and budget again (a new process: nothing in memory): the plan is read from
    disk (``solvers.plan_cache``), no DP, no option read; the same schedule and figures. Another
    budget: every option read from disk, none solved. A cached plan that no longer fits (a chain
    whose figures moved) is planned again."""
    chain = _chain()
    budget = registry.min_budget(chain, "rockmate", cache=OptionCache(), **GRID) * 3 // 2
    first = OptionCache(directory=str(tmp_path))
    plan = registry.solve(chain, budget, "rockmate", cache=first, **GRID)
    assert first.misses == len({b.class_index for b in chain.blocks}) and list(tmp_path.glob("plan-*.pkl"))
    dps = []  # the DPs made: their tables (chain_table) or a strategy directly (solve_chain)
    for name in ("solve_chain", "chain_table"):
        monkeypatch.setattr(registry, name, lambda *args, real=getattr(registry, name), **kwargs:
                            dps.append(args) or real(*args, **kwargs))
    again = OptionCache(directory=str(tmp_path))  # as in a new process: nothing in memory
    replanned = registry.solve(_chain(), budget, "rockmate", cache=again, **GRID)
    assert again.misses == again.hits == 0 and not dps and "plan cache" in replanned.timings
    assert replanned.schedule == plan.schedule and replanned.predicted_peak == plan.predicted_peak <= budget
    assert replanned.predicted_time == plan.predicted_time and replanned.notes == plan.notes
    other = registry.solve(_chain(), budget + 4096, "rockmate", cache=again, **GRID)
    assert again.misses == 0 and again.hits == first.misses and dps and other.feasible
    # the plan file of the first budget, given a schedule whose peak is above it: planned again
    path = tmp_path / f"plan-{plan_key(chain, budget, registry.RockmateSolver(**GRID).settings())}.pkl"
    times, fields = pickle.loads(path.read_bytes())
    top = registry.solve(chain, 10**12, "none")
    path.write_bytes(pickle.dumps((times, {**fields, "ops": list(top.schedule.ops)})))
    dps.clear()
    third = registry.solve(_chain(), budget, "rockmate", cache=OptionCache(directory=str(tmp_path)), **GRID)
    assert dps and third.schedule == plan.schedule and "plan cache" not in third.timings


def test_timing_noise_reuses_options_and_other_timings_do_not(tmp_path):
    graph = _chain().classes[1]

    def with_times(scale_of):
        return dataclasses.replace(graph, compute_nodes=[dataclasses.replace(c, time_s=c.time_s * scale_of(i))
                                                         for i, c in enumerate(graph.compute_nodes)])

    settings = (3, 3)
    noisy = with_times(lambda i: 1.3 if i % 2 else 0.8)  # a rebuild on the same machine
    largest = max(range(len(graph.compute_nodes)), key=lambda i: graph.compute_nodes[i].time_s)
    slower = with_times(lambda i: 100.0 if i == largest else 1.0)  # another device's relative costs
    busier = with_times(lambda i: 3.0)  # a build while the machine is busier: the same shares
    bigger = dataclasses.replace(graph, compute_nodes=[dataclasses.replace(c, overhead_bytes=c.overhead_bytes + 4)
                                                       for c in graph.compute_nodes])
    assert OptionCache.key(graph, settings) == OptionCache.key(noisy, settings) == OptionCache.key(slower, settings)
    assert OptionCache.key(graph, settings) != OptionCache.key(bigger, settings)
    assert OptionCache.key(graph, settings) != OptionCache.key(graph, (3, 4))
    cache = OptionCache(directory=str(tmp_path))
    solved = []
    for g in (graph, noisy, busier, slower):
        cache.get_or_compute(g, settings, lambda: solved.append(1) or len(solved))
    assert len(solved) == 2 and cache.hits == 2 and cache.misses == 2


def test_an_unreadable_entry_is_solved_again(tmp_path):
    chain = _chain()
    cache = OptionCache(directory=str(tmp_path))
    registry.min_budget(chain, "rockmate", cache=cache, **GRID)
    for entry in tmp_path.glob("*.pkl"):
        entry.write_bytes(b"not a pickle")
    again = OptionCache(directory=str(tmp_path))
    expected = registry.min_budget(chain, "rockmate", cache=again, **GRID)
    assert again.misses == cache.misses
    # the corrupt files were rewritten: a third build reads every option from disk
    third = OptionCache(directory=str(tmp_path))
    assert registry.min_budget(chain, "rockmate", cache=third, **GRID) == expected
    assert third.misses == 0 and third.hits == cache.misses


def test_an_entry_of_another_format_is_not_read(tmp_path, monkeypatch):
    """A library whose options changed (``OPTIONS_FORMAT`` bumped) finds a cache directory
    written by the old one: the keys differ, so the old entry is never read; the class is solved
    again and both entries stay on disk."""
    from solvers import option_cache

    graph, settings = _chain().classes[1], (3, 3)
    old_key = OptionCache.key(graph, settings)
    OptionCache(directory=str(tmp_path)).get_or_compute(graph, settings, lambda: "old options")
    monkeypatch.setattr(option_cache, "OPTIONS_FORMAT", option_cache.OPTIONS_FORMAT + 1)
    assert OptionCache.key(graph, settings) != old_key
    new = OptionCache(directory=str(tmp_path))
    assert new.get_or_compute(graph, settings, lambda: "new options") == "new options"
    assert new.misses == 1 and new.hits == 0
    assert sorted(p.stem for p in tmp_path.glob("*.pkl")) == sorted([old_key, OptionCache.key(graph, settings)])


@pytest.mark.parametrize("content", [{"options": 1}, ["times", "options"], ((0.5,), "options", "extra"),
                                     ("times", "options"), ((1.0, 2.0), "options")],
                         ids=["dict", "list", "three_fields", "times_not_a_tuple", "times_of_another_graph"])
def test_a_pickle_of_the_wrong_content_is_solved_again(tmp_path, content):
    """An entry's file holds a well-formed pickle that is not an entry (or an entry of another
    graph's operations): the class is solved again, the file rewritten, and the next cache
    reads it."""
    import pickle

    graph, settings = _chain().classes[1], (3, 3)
    (tmp_path / f"{OptionCache.key(graph, settings)}.pkl").write_bytes(pickle.dumps(content))
    cache = OptionCache(directory=str(tmp_path))
    assert cache.get_or_compute(graph, settings, lambda: "options") == "options"
    assert cache.misses == 1
    again = OptionCache(directory=str(tmp_path))
    assert again.get_or_compute(graph, settings, lambda: "solved again") == "options"
    assert again.hits == 1 and again.misses == 0


def test_an_entry_of_the_right_shape_but_not_options_is_solved_again(tmp_path):
    """An entry file with this graph's timings but a value that is not a class's options (a
    hand-made or foreign file): the planner solves the class again instead of failing on it."""
    import pickle

    chain = _chain()
    cache = OptionCache(directory=str(tmp_path))
    expected = registry.min_budget(chain, "rockmate", cache=cache, **GRID)
    for path in tmp_path.glob("*.pkl"):
        times, _ = pickle.loads(path.read_bytes())
        path.write_bytes(pickle.dumps((times, "not options")))
    again = OptionCache(directory=str(tmp_path))
    assert registry.min_budget(chain, "rockmate", cache=again, **GRID) == expected
    assert again.hits == 0 and again.misses == cache.misses


@pytest.mark.parametrize("backend, check, package", [("highs", "highs_available", "pip install highspy"),
                                                     ("cpsat", "ortools_available", "pip install ortools")])
def test_a_missing_ilp_backend_is_an_import_error_naming_the_package(monkeypatch, backend, check, package):
    """The user asks for an ILP backend whose package is not installed
    (``Rockmate(..., ilp_solver="highs")`` without highspy): an ImportError naming the pip
    package, not a fallback (a backend that is installed but fails falls back, above)."""
    from solvers import checkmate_ilp

    import rockmate.api

    monkeypatch.setattr(checkmate_ilp, check, lambda *args: False)
    # said before the model is captured and measured (not after a long build)
    monkeypatch.setattr(rockmate.api, "_build_graphs", lambda *args: pytest.fail("the model was built first"))
    model, sample = ZOO["mlp"].build()
    with pytest.raises(ImportError, match=f"^ilp_solver='{backend}' needs .*: {package}$"):
        Rockmate(model, sample, "1GB", cost_model="flops", ilp_solver=backend, cache=OptionCache(), **GRID)


def test_plan_timings_say_where_planning_time_went():
    model, sample = ZOO["gpt"].build()
    rk = Rockmate(model, sample, "60%", cost_model="flops", **GRID)
    timings = rk.plan.timings
    for phase in ("capture", "inspect", "dp"):
        assert phase in timings and timings[phase] >= 0
    assert any(key.startswith("options of class") for key in timings)


def test_a_budget_that_the_plan_without_recomputation_fits_solves_no_grid():
    """Every operation runs at least once: where recomputing nothing fits the budget, that plan
    is the fastest there is, and it is planned without the classes' option grids."""
    model, sample = ZOO["gpt"].build()
    for budget in ("100%", "1GB"):
        rk = Rockmate(model, sample, budget, cost_model="flops", **GRID)
        assert not any(key.startswith("options of class") for key in rk.plan.timings)
        assert "the plan without recomputation fits the budget" in rk.plan.notes
        assert rk.plan.predicted_peak <= rk.plan.budget
        assert rk.plan.predicted_time == pytest.approx(rk.plan.baseline_time, rel=1e-12)
        assert list(rk.plan.schedule.ops) == list(registry.no_recompute_schedule(rk.graphs.model_chain).ops)


@pytest.mark.parametrize("backend", ["cbc", "highs"])
def test_a_failing_ilp_backend_falls_back_to_another(monkeypatch, backend):
    """CBC's executable crashing (a PulpSolverError inside pulp), or HiGHS failing in process (a
    RuntimeError), never reaches the user: the ILP is solved again by the other backend and the
    plan is the same."""
    import pulp

    from solvers.checkmate_ilp import highs_available
    from solvers.highs_model import HighsModel

    if not highs_available():
        pytest.skip("highspy is not installed")
    chain = _chain()
    budget = registry.min_budget(chain, "rockmate", cache=OptionCache(), ilp_solver=backend, **GRID) * 3 // 2
    expected = registry.solve(chain, budget, "rockmate", cache=OptionCache(), ilp_solver=backend, **GRID)
    calls = {"failed": 0, "fallback": 0}
    if backend == "cbc":
        original, owner, name = pulp.PULP_CBC_CMD.actualSolve, pulp.PULP_CBC_CMD, "actualSolve"
        other, other_name = HighsModel, "solve"
        error = pulp.PulpSolverError("Pulp: Error while trying to execute cbc (simulated)")
    else:
        original, owner, name = HighsModel.solve, HighsModel, "solve"
        other, other_name = pulp.PULP_CBC_CMD, "actualSolve"
        error = RuntimeError("HiGHS failed (simulated)")
    fallback = getattr(other, other_name)

    def crashing(self, *args, **kwargs):
        if calls["failed"] < 3:
            calls["failed"] += 1
            raise error
        return original(self, *args, **kwargs)

    def counted(self, *args, **kwargs):
        calls["fallback"] += 1
        return fallback(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, crashing)
    monkeypatch.setattr(other, other_name, counted)
    plan = registry.solve(chain, budget, "rockmate", cache=OptionCache(), ilp_solver=backend, **GRID)
    assert calls["failed"] == 3 and calls["fallback"] == 3 and plan.feasible
    assert plan.predicted_peak <= budget
    assert abs(plan.predicted_time - expected.predicted_time) <= 0.02 * expected.predicted_time


def test_an_interrupted_solve_leaves_the_cache_valid(tmp_path, monkeypatch):
    """Ctrl-C during planning (in an ILP solve, or while an entry is written) reaches the user
    as KeyboardInterrupt; nothing partial stays on disk, and the next build plans as if the
    interrupted one had never run."""
    import pickle

    from solvers.checkmate_ilp import RkCheckmateILP

    chain = _chain()
    original = RkCheckmateILP.solve
    calls = {"n": 0}

    def interrupted(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(RkCheckmateILP, "solve", interrupted)
    try:
        registry.min_budget(chain, "rockmate", cache=OptionCache(directory=str(tmp_path)), **GRID)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the interrupt did not reach the caller")
    monkeypatch.setattr(RkCheckmateILP, "solve", original)
    assert not list(tmp_path.glob("*.tmp"))
    dumps = pickle.dump

    def interrupted_dump(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pickle, "dump", interrupted_dump)
    try:
        registry.min_budget(chain, "rockmate", cache=OptionCache(directory=str(tmp_path)), **GRID)
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(pickle, "dump", dumps)
    assert not list(tmp_path.glob("*.tmp"))
    fresh = OptionCache(directory=str(tmp_path))
    expected = registry.min_budget(chain, "rockmate", cache=OptionCache(), **GRID)
    assert registry.min_budget(chain, "rockmate", cache=fresh, **GRID) == expected


def test_a_second_build_reads_its_measures_from_disk(tmp_path, monkeypatch):
    """The inspection's cache (``rkgb.disk_cache.MeasureCache``, beside the plan cache): a
    second build of the same model and input measures nothing (nor runs the fake passes of
    the gradient layouts) and plans the same; another
    input shape, or another ``requires_grad`` of the input, is measured again."""
    from rkgb.disk_cache import MeasureCache
    from rockmate import api

    monkeypatch.setenv("ROCKMATE_CACHE_DIR", str(tmp_path))
    caches = []
    monkeypatch.setattr(api, "_measure_cache", lambda: caches.append(MeasureCache(str(tmp_path / "measures")))
                        or caches[-1])
    model, sample = ZOO["gpt"].build(n_layer=2)
    first = Rockmate(model, sample, 10**12, cost_model="measured", peak_steps=3, save_steps=3)
    again = Rockmate(model, sample, 10**12, cost_model="measured", peak_steps=3, save_steps=3)
    # (two entries: the gradient layouts and the measures)
    assert (caches[0].misses, caches[1].hits, caches[1].misses) == (2, 2, 0)
    assert again.graphs.measures == first.graphs.measures
    assert again.graphs.measures_from_cache and not first.graphs.measures_from_cache
    assert any("read from the disk cache" in note for note in again.plan.notes)
    assert again.plan.schedule == first.plan.schedule and again.plan.predicted_peak == first.plan.predicted_peak
    (tokens,) = sample
    Rockmate(model, (tokens[:, :8],), 10**12, cost_model="measured", solver="none")
    mlp, (x,) = ZOO["mlp"].build()
    Rockmate(mlp, (x,), 10**12, cost_model="measured", solver="none")
    Rockmate(mlp, (x.clone().requires_grad_(),), 10**12, cost_model="measured", solver="none")
    Rockmate(mlp, (x,), 10**12, cost_model="measured", solver="none")
    assert [cache.misses for cache in caches[2:]] == [2, 2, 2, 0]
    assert len(list((tmp_path / "measures").glob("*.pkl"))) == 8


def test_a_second_build_reads_its_generated_code_compiled(tmp_path, monkeypatch):
    """The generated code's bytecode (``exec.code_cache``, beside the plans): a second build of
    the same model and budget compiles nothing, from memory in the same process and from disk in
    a new one, and trains as eager does (bitwise, within the budget); a partial file, or one that
    holds another source's code, is compiled again."""
    from exec import code_cache
    from exactness import check_training

    monkeypatch.setenv("ROCKMATE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(code_cache, "_MEMORY", type(code_cache._MEMORY)())
    monkeypatch.setattr(code_cache, "SOURCES", type(code_cache.SOURCES)())
    model, sample = ZOO["gpt"].build(n_layer=2)
    codes = [check_training(model, sample, 0.6, steps=2, **GRID).compiled.code]
    (path,) = tmp_path.glob("code-*.marshal")
    assert dict(code_cache.SOURCES) == {"compiled": 1}
    codes.append(check_training(model, sample, 0.6, steps=2, **GRID).compiled.code)
    code_cache._MEMORY.clear()  # as in a new process
    third = check_training(model, sample, 0.6, steps=2, **GRID).compiled.compiled
    codes.append(third.code)
    assert dict(code_cache.SOURCES) == {"compiled": 1, "memory": 1, "disk": 1} and len(set(codes)) == 1
    (runner,) = third._runners.values()
    assert runner.code.filename == f"<rockmate-generated-{path.stem[5:21]}>"
    written = path.read_bytes()
    other = marshal.dumps(("0" * 64, compile("x = 1", runner.code.filename, "exec")))
    for content in (written[:len(written) // 2], other):
        code_cache._MEMORY.clear()
        path.write_bytes(content)
        assert check_training(model, sample, 0.6, steps=2, **GRID).compiled.code == codes[0]
    # rewritten: the same key and code (compared as values: marshal's bytes depend on refcounts)
    assert dict(code_cache.SOURCES) == {"compiled": 3, "memory": 1, "disk": 1}
    assert marshal.loads(path.read_bytes()) == marshal.loads(written)


def test_the_code_cache_keeps_the_last_used_files_on_disk(tmp_path, monkeypatch):
    """``exec.code_cache`` keeps the ``DISK_ENTRIES`` code files last used (each is as big as
    its source); one read from disk counts as used."""
    import os

    from exec import code_cache

    monkeypatch.setenv("ROCKMATE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(code_cache, "_MEMORY", type(code_cache._MEMORY)())
    monkeypatch.setattr(code_cache, "DISK_ENTRIES", 2)
    files = {}
    for i, source in enumerate(["x = 1\n", "x = 2\n"]):
        code_cache.compiled_source(source)
        (files[source],) = set(tmp_path.glob("code-*.marshal")) - set(files.values())
        os.utime(files[source], (1000 + i, 1000 + i))  # (written in this order, a second apart)
    code_cache._MEMORY.clear()
    code, _ = code_cache.compiled_source("x = 1\n")  # read back: the last used now
    namespace = {}
    exec(code, namespace)
    assert namespace["x"] == 1
    code_cache.compiled_source("x = 3\n")
    kept = set(tmp_path.glob("code-*.marshal"))
    assert len(kept) == 2 and files["x = 1\n"] in kept and files["x = 2\n"] not in kept
