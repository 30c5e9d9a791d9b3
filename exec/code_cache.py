"""The generated code's compiled form, kept under its source: a second build compiles nothing.

Compiling the generated source is the largest single cost of making the module once the plan
is known: the 24-layer Llama of GPT-2 small's width (d=768) generates 24.8k lines, 1.1 MB,
which ``compile`` turns into bytecode in 0.15 s; ``marshal.loads`` reads that bytecode back in
2 ms. A second build of the same model (:mod:`solvers.plan_cache`: its plan read from disk)
generates the same source, so its code object is read instead of compiled: from this process's
memory (the last few, :data:`MEMORY_ENTRIES`), else from the disk cache's directory
(``code-<digest>.marshal``, beside the plans; :func:`solvers.option_cache.default_directory`,
off with ``ROCKMATE_CACHE_DIR=off``), where the last :data:`DISK_ENTRIES` used are kept: a
file is as big as the source (each budget of a model has code of its own).

The key is the source itself (its SHA-256) and the interpreter's bytecode format
(``importlib.util.MAGIC_NUMBER``): the code object read is the one ``compile`` would make of
that source. The file name the code carries (its tracebacks' and ``linecache``'s) is named
after the digest, so that the same source has the same name in every build.
"""

from __future__ import annotations

import hashlib
import importlib.util
import marshal
import os
import threading
import types
from collections import Counter, OrderedDict

from rkgb.disk_cache import write_atomically
from solvers.option_cache import default_directory

__all__ = ["DISK_ENTRIES", "MEMORY_ENTRIES", "SOURCES", "compiled_source"]

MEMORY_ENTRIES = 8  # code objects kept in memory (the 24-layer Llama's: 1.5 MB marshaled)
DISK_ENTRIES = 32  # code files kept on disk, the least recently used removed beyond

# where each source's code came from in this process: "memory", "disk" or "compiled"
SOURCES: Counter[str] = Counter()

_MEMORY: OrderedDict[str, types.CodeType] = OrderedDict()
_LOCK = threading.Lock()


def _digest(source: str) -> str:
    digest = hashlib.sha256(importlib.util.MAGIC_NUMBER)
    digest.update(source.encode())
    return digest.hexdigest()


def _filename(key: str) -> str:
    return f"<rockmate-generated-{key[:16]}>"


def _read(path: str, key: str) -> types.CodeType | None:
    """The code object of ``key`` marshaled at ``path``, or None where the file is partial or
    holds another key's (compiled again and rewritten, never an error)."""
    try:
        with open(path, "rb") as handle:
            entry = marshal.loads(handle.read())
    except (OSError, EOFError, ValueError, TypeError):
        return None
    valid = isinstance(entry, tuple) and len(entry) == 2 and entry[0] == key and isinstance(entry[1], types.CodeType)
    return entry[1] if valid else None


def _touch(path: str) -> None:
    """Mark ``path`` used now (the files kept are the last used: :func:`_keep_recent`)."""
    try:
        os.utime(path)
    except OSError:
        pass


def _keep_recent(directory: str) -> None:
    """Remove the code files of ``directory`` beyond the :data:`DISK_ENTRIES` last used."""
    try:
        with os.scandir(directory) as entries:
            files = [(entry.stat().st_mtime, entry.path) for entry in entries
                     if entry.name.startswith("code-") and entry.name.endswith(".marshal")]
    except OSError:
        return
    for _, path in sorted(files, reverse=True)[DISK_ENTRIES:]:
        try:
            os.remove(path)
        except OSError:
            pass


def compiled_source(source: str) -> tuple[types.CodeType, str]:
    """``compile(source, filename, "exec")`` and its ``filename`` (``<rockmate-generated-<digest>>``): from
    memory or the disk cache where that source was compiled before, else compiled and kept."""
    key = _digest(source)
    filename = _filename(key)
    with _LOCK:
        code = _MEMORY.get(key)
        if code is not None:
            _MEMORY.move_to_end(key)
            SOURCES["memory"] += 1
            return code, filename
    directory = default_directory()
    path = None if directory is None else os.path.join(directory, f"code-{key}.marshal")
    code = None if path is None or not os.path.exists(path) else _read(path, key)
    SOURCES["compiled" if code is None else "disk"] += 1
    if code is None:
        code = compile(source, filename, "exec")
        if path is not None:
            write_atomically(path, lambda handle: handle.write(marshal.dumps((key, code))))
            _keep_recent(directory)
    elif path is not None:
        _touch(path)
    with _LOCK:
        _MEMORY[key] = code
        while len(_MEMORY) > MEMORY_ENTRIES:
            _MEMORY.popitem(last=False)
    return code, filename
