"""A cache of class options, keyed by the content of the class's CD-graph and the settings.

Solving a class's option grid (rk-Checkmate ILPs) is the slow part of planning; the options
depend only on the CD-graph and the grid settings. The cache makes re-planning the same model
(another budget, another solver run, a restarted script) instantaneous: in memory, and on disk
by default under the user's cache directory (``$ROCKMATE_CACHE_DIR``, else
``$XDG_CACHE_HOME/rockmate``, else ``~/.cache/rockmate``; ``ROCKMATE_CACHE_DIR=off`` turns the
disk off).

The key is the CD-graph's content without the operations' measured times (timings vary from
one build to the next; memory, which the options' validity rests on, is keyed exactly), the
grid settings and :data:`OPTIONS_FORMAT`, which changes whenever the options computed for a
graph would. Each entry keeps the times it was solved with, and is used only where the new
times are alike (:func:`similar_times`: each operation's share of the block's time within 4x,
operations under 5% aside): options solved for a GPU's timings are not reused on a
CPU, while a second build on the same machine re-solves nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import threading
from collections import OrderedDict
from typing import Callable

from rkgb.cdgraph import CDGraph
from rkgb.disk_cache import read_pickle, write_pickle

__all__ = ["OptionCache", "default_cache", "default_directory", "OPTIONS_FORMAT"]

# bump when the options of a given CD-graph change (the ILP, the grid, the repair, the fields)
OPTIONS_FORMAT = 5


def similar_times(old: tuple[float, ...], new: tuple[float, ...], factor: float = 4.0) -> bool:
    """Whether options solved with the times ``old`` serve a graph with the times ``new``: each
    operation's share of the block's time within ``factor`` of its old share, but those under
    5% of the block both times. Shares, not seconds: a machine that is busier during one build
    scales every time alike, which changes no plan; another device's relative costs (a GPU's
    matmuls against its elementwise ops) move the heavy operations' shares by far more.
    (Measured on this CPU: a rebuild moves operations of tens of microseconds by up to 2.3x.)"""
    if len(old) != len(new):
        return False
    total_old, total_new = sum(old), sum(new)
    if not math.isfinite(total_old + total_new) or min(total_old, total_new) <= 0:
        return total_old == total_new
    for a, b in zip(old, new):
        a, b = a / total_old, b / total_new
        if max(a, b) <= 0.05:
            continue
        if min(a, b) <= 0 or max(a, b) / min(a, b) > factor:
            return False
    return True


def default_directory() -> str | None:
    """The disk cache's directory from the environment (None: ``ROCKMATE_CACHE_DIR=off``)."""
    chosen = os.environ.get("ROCKMATE_CACHE_DIR")
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "off", "0", "none") else chosen
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rockmate")


# the caches' memory, read and written by the classes' grids in threads (one lock for all: a
# cache is pickled and copied with the solver that holds it)
_LOCK = threading.Lock()


class OptionCache:
    """Least-recently-used in memory (``capacity`` entries), and on disk under ``directory``
    when given (one pickle per entry; written by this library, read back only from there)."""

    def __init__(self, capacity: int = 256, directory: str | None = None) -> None:
        self.capacity = capacity
        self.directory = directory
        self._entries: OrderedDict[str, object] = OrderedDict()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(graph: CDGraph, settings: tuple) -> str:
        computes = [dataclasses.replace(node, time_s=0.0) for node in graph.compute_nodes]
        content = repr((OPTIONS_FORMAT, computes, graph.data_nodes, graph.input_data, graph.input_grads,
                        graph.output_data, graph.output_grads, settings))
        return hashlib.sha256(content.encode()).hexdigest()

    def get_or_compute(self, graph: CDGraph, settings: tuple, compute: Callable[[], object],
                       kind: type | None = None):
        """The value for ``graph`` and ``settings``: from memory or disk where the timings are
        alike (and, with ``kind``, the stored value is one: a file of another content is solved
        again and rewritten), else ``compute()``, stored."""
        key = self.key(graph, settings)
        times = tuple(node.time_s for node in graph.compute_nodes)
        with _LOCK:  # (classes are solved in threads: solvers.registry.RockmateSolver)
            entry = self._entries.get(key)
            if entry is not None and similar_times(entry[0], times):
                self._entries.move_to_end(key)
                self.hits += 1
                return entry[1]
        path = os.path.join(self.directory, f"{key}.pkl") if self.directory else None
        entry = self._read(path) if path and os.path.exists(path) else None
        if entry is not None and kind is not None and not isinstance(entry[1], kind):
            entry = None
        hit = entry is not None and similar_times(entry[0], times)
        if not hit:
            entry = (times, compute())
            if path:
                write_pickle(path, entry)
        with _LOCK:
            self.hits += int(hit)
            self.misses += int(not hit)
            self._entries[key] = entry
            self._entries.move_to_end(key)
            if len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return entry[1]


    @staticmethod
    def _read(path: str):
        """An entry from disk, or None where it cannot be read or is not one."""
        entry = read_pickle(path)
        valid = isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], tuple)
        return entry if valid else None


default_cache = OptionCache(directory=default_directory())
