"""Pickles on disk for the caches of planning: atomic writes, reads that never raise.

Used by the inspection's cache (:class:`MeasureCache`: a second build of the same model on the
same machine measures nothing) and by the solvers' option cache (``solvers.option_cache``).
Files are written by this library and read back only from its own cache directory.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import threading
from pathlib import Path
from typing import BinaryIO, Callable

__all__ = ["read_pickle", "write_pickle", "write_atomically", "MeasureCache", "source_digest"]


def read_pickle(path: str):
    """The object pickled at ``path``, or None where it cannot be read (a partial or foreign
    file is computed again and rewritten, never an error)."""
    try:
        with open(path, "rb") as handle:
            return pickle.load(handle)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError, TypeError, ValueError):
        return None


def write_pickle(path: str, value) -> None:
    """Write ``value`` atomically (:func:`write_atomically`)."""
    write_atomically(path, lambda handle: pickle.dump(value, handle))


def write_atomically(path: str, write: Callable[[BinaryIO], object]) -> None:
    """Make the file ``path`` of what ``write`` writes into the handle it is given, atomically: a
    read-only or full disk leaves nothing written (the cache then lives in memory only), and an
    interrupt (Ctrl-C) while writing leaves no partial file."""
    temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(temporary, "wb") as handle:
            write(handle)
        os.replace(temporary, path)
    except OSError:
        pass
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


_SOURCE_DIGEST: list[str] = []


def source_digest() -> str:
    """A digest of the graph builder's own source files: measures cached by another version
    of the code (a release, or an edit) are never reused."""
    if not _SOURCE_DIGEST:
        digest = hashlib.sha256()
        for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
        _SOURCE_DIGEST.append(digest.hexdigest())
    return _SOURCE_DIGEST[0]


class MeasureCache:
    """The inspection's measures on disk, one pickle per key (``rkgb.build.measures_key``: the
    captured graph with every tensor's shape, dtype, strides and ``requires_grad``, the chain of
    blocks, the gradient layouts, the device, torch's version, the cost model and this code's
    digest). Inspecting a big model takes seconds (GPT-2 small: 10 s on a CPU core) and its
    timings vary between builds; a second build on the same machine reuses the first's."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.hits = 0
        self.misses = 0

    def get_or_compute(self, key: str, compute: Callable[[], list]) -> list:
        """The measures under ``key`` (a list), else ``compute()``'s, written for the next build."""
        path = os.path.join(self.directory, f"{key}.pkl")
        value = read_pickle(path) if os.path.exists(path) else None
        if isinstance(value, list):
            self.hits += 1
            return value
        self.misses += 1
        value = compute()
        write_pickle(path, value)
        return value
