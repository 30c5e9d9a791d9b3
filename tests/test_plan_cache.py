"""The plan cache on disk, and where planning time goes (``Plan.timings``)."""

from __future__ import annotations

import dataclasses

import torch

from rkgb.build import build
from rockmate import Rockmate
from solvers import registry
from solvers.option_cache import OptionCache
from zoo import ZOO

GRID = dict(peak_steps=3, save_steps=3)


def _chain():
    model, sample = ZOO["gpt"].build(n_layer=2)
    return build(model, sample, cost_model="flops").model_chain


def test_a_second_build_reads_every_option_from_disk(tmp_path):
    chain = _chain()
    budget = registry.min_budget(chain, "rockmate", cache=OptionCache(), **GRID) * 3 // 2
    first = OptionCache(directory=str(tmp_path))
    plan = registry.solve(chain, budget, "rockmate", cache=first, **GRID)
    assert first.misses == len({b.class_index for b in chain.blocks}) and list(tmp_path.glob("*.pkl"))
    again = OptionCache(directory=str(tmp_path))  # as in a new process: nothing in memory
    replanned = registry.solve(_chain(), budget, "rockmate", cache=again, **GRID)
    assert again.misses == 0 and again.hits == first.misses
    assert replanned.schedule == plan.schedule and replanned.predicted_peak == plan.predicted_peak


def test_the_key_tolerates_timing_noise_and_nothing_else(tmp_path):
    graph = _chain().classes[1]
    noisy = dataclasses.replace(graph, compute_nodes=[dataclasses.replace(c, time_s=c.time_s * 1.001)
                                                      for c in graph.compute_nodes])
    bigger = dataclasses.replace(graph, compute_nodes=[dataclasses.replace(c, overhead_bytes=c.overhead_bytes + 4)
                                                       for c in graph.compute_nodes])
    settings = (3, 3)
    assert OptionCache.key(graph, settings) == OptionCache.key(noisy, settings)
    assert OptionCache.key(graph, settings) != OptionCache.key(bigger, settings)
    assert OptionCache.key(graph, settings) != OptionCache.key(graph, (3, 4))


def test_an_unreadable_entry_is_solved_again(tmp_path):
    chain = _chain()
    cache = OptionCache(directory=str(tmp_path))
    registry.min_budget(chain, "rockmate", cache=cache, **GRID)
    for entry in tmp_path.glob("*.pkl"):
        entry.write_bytes(b"not a pickle")
    again = OptionCache(directory=str(tmp_path))
    registry.min_budget(chain, "rockmate", cache=again, **GRID)
    assert again.misses == cache.misses


def test_plan_timings_say_where_planning_time_went():
    model, sample = ZOO["mlp"].build()
    rk = Rockmate(model, sample, "1GB", cost_model="flops", **GRID)
    timings = rk.plan.timings
    for phase in ("capture", "inspect", "dp"):
        assert phase in timings and timings[phase] >= 0
    assert any(key.startswith("options of class") for key in timings)
