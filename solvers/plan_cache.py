"""Whole plans on disk: a second build of the same model at the same budget solves nothing.

The option cache (:mod:`solvers.option_cache`) keeps each class's option grid; the DP over the
chain and its raised targets (:func:`solvers.registry._raised`) still ran at every build, 0.7 s
of a second Llama-24 build (d=768; 0.3 s at 12 layers). This cache keeps the plan's schedule
under the chain's content without its measured times, the budget, the solver's settings
(:meth:`solvers.registry.RockmateSolver.settings`) and :data:`PLAN_FORMAT`, in the option cache's
directory (one pickle per plan, ``plan-<key>.pkl``; disk only: the grids' memory cache serves
re-plans within a process). A plan is read back only where every class's times are alike
(:func:`solvers.option_cache.similar_times`, as for options) and where its schedule, simulated
on the new chain (its figures the new chain's own), fits the budget: the caller checks that.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

from rkgb.cdgraph import ModelChain
from rkgb.disk_cache import read_pickle, write_pickle
from solvers.option_cache import similar_times

__all__ = ["PLAN_FORMAT", "PlanCache", "plan_key", "chain_times"]

# bump when the plan of a given chain, budget and settings changes (the DP, the raise, the grids)
PLAN_FORMAT = 2  # 2: the raised targets read from one DP table


def _without_times(chain: ModelChain) -> ModelChain:
    classes = [dataclasses.replace(graph, compute_nodes=[dataclasses.replace(node, time_s=0.0)
                                                         for node in graph.compute_nodes])
               for graph in chain.classes]
    return dataclasses.replace(chain, classes=classes)


def plan_key(chain: ModelChain, budget: int, settings: tuple) -> str:
    """The key of the plan of ``chain`` within ``budget`` by a solver of ``settings``: the
    chain's content (classes, blocks, held and first-run memory, outputs) without its times."""
    content = repr((PLAN_FORMAT, _without_times(chain), int(budget), settings))
    return hashlib.sha256(content.encode()).hexdigest()


def chain_times(chain: ModelChain) -> tuple[tuple[float, ...], ...]:
    """Each class's compute times, in order."""
    return tuple(tuple(node.time_s for node in graph.compute_nodes) for graph in chain.classes)


class PlanCache:
    """Plans by key in ``directory`` (written by this library, read back only from there)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.hits = 0
        self.misses = 0

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, f"plan-{key}.pkl")

    def get(self, key: str, times: tuple[tuple[float, ...], ...]) -> dict | None:
        """The stored plan's fields (``ops``, ``notes``, ``time_limit_hit``) where its classes'
        times are alike to ``times``; None (a miss) otherwise."""
        path = self._path(key)
        entry = read_pickle(path) if os.path.exists(path) else None
        valid = isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], dict) \
            and isinstance(entry[0], tuple) and len(entry[0]) == len(times)
        if valid and all(similar_times(old, new) for old, new in zip(entry[0], times)):
            self.hits += 1
            return entry[1]
        self.misses += 1
        return None

    def put(self, key: str, times: tuple[tuple[float, ...], ...], fields: dict) -> None:
        write_pickle(self._path(key), (times, fields))
