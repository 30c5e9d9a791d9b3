"""A cache of class options, keyed by the content of the class's CD-graph and the settings.

Solving a class's option grid (rk-Checkmate ILPs) is the slow part of planning; the options
depend only on the CD-graph and the grid settings. The cache makes re-planning the same model
(another budget, another solver run, a restarted script with ``directory`` set) instantaneous.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections import OrderedDict
from typing import Callable

from rkgb.cdgraph import CDGraph

__all__ = ["OptionCache", "default_cache"]


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
        content = repr((graph.compute_nodes, graph.data_nodes, graph.input_data, graph.input_grads,
                        graph.output_data, graph.output_grads, settings))
        return hashlib.sha256(content.encode()).hexdigest()

    def get_or_compute(self, graph: CDGraph, settings: tuple, compute: Callable[[], object]):
        key = self.key(graph, settings)
        if key in self._entries:
            self._entries.move_to_end(key)
            self.hits += 1
            return self._entries[key]
        path = os.path.join(self.directory, f"{key}.pkl") if self.directory else None
        if path and os.path.exists(path):
            with open(path, "rb") as handle:
                value = pickle.load(handle)
            self.hits += 1
        else:
            self.misses += 1
            value = compute()
            if path:
                os.makedirs(self.directory, exist_ok=True)
                with open(path + ".tmp", "wb") as handle:
                    pickle.dump(value, handle)
                os.replace(path + ".tmp", path)
        self._entries[key] = value
        if len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return value


default_cache = OptionCache(directory=os.environ.get("ROCKMATE_CACHE_DIR") or None)
