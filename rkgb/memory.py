"""Allocation tracking: the bytes of tensor storages that PyTorch ops allocate, on CPU and CUDA.

The budget of Rockmate bounds the peak of the bytes allocated after the forward starts (see
``DESIGN.md``, "Memory: what the budget bounds"). This module measures that figure:

- :class:`AllocationTracker` is a ``TorchDispatchMode`` that sees every ATen op dispatched
  while it is active, including the ops that the autograd engine runs during ``backward``
  (gradient formulas, gradient accumulation), and counts the bytes of each new storage until
  that storage dies. It works on any device, CPU included, and never reads the process RSS.
- :func:`measure_peak` runs a function and returns its peak: with the CUDA allocator's
  statistics when the tensors are on CUDA, with an :class:`AllocationTracker` otherwise.
- :func:`measure_allocator_peak` is the CPU allocator's own figure (through the profiler), which
  also sees the buffers that kernels allocate internally; the tracker does not (on CPU,
  convolutions allocate im2col buffers of several times their output: a tiny ResNet step
  reads 157000 bytes with the tracker and 202312 with the allocator).
- :func:`storage_key` is the identity of a tensor's storage, to tell whether two tensors
  share memory (e.g. to find autograd's saved tensors that alias nothing: "phantoms").
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "AllocationEvent",
    "AllocationTracker",
    "AllocatorEvent",
    "allocator_events",
    "allocator_events_and_ranges",
    "measure_allocator_peak",
    "measure_peak",
    "storage_key",
]


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def storage_key(tensor: torch.Tensor) -> int:
    """Return a hashable identity of the storage under ``tensor``: its data pointer.

    Two tensors with the same key share memory (one is a view, an alias or an in-place result
    of the other). Storages of zero bytes all have the key 0, which is harmless when the key is
    used to compare memory: they hold none.

    Examples
    --------
    >>> a = torch.zeros(4)
    >>> storage_key(a[1:]) == storage_key(a) != storage_key(a.clone())
    True
    """
    return tensor.untyped_storage().data_ptr()


@dataclass(frozen=True)
class AllocationEvent:
    """One change of the tracked bytes, recorded when ``AllocationTracker(record_events=True)``.

    ``op`` is the name of the ATen op that allocated (or resized) the storage; a free carries
    the name of the op that allocated the storage, with ``freed=True`` and a negative
    ``delta_bytes``. ``current_bytes`` is the tracked total just after the event.
    """

    op: str
    storage_key: int
    delta_bytes: int
    current_bytes: int
    freed: bool = False


class AllocationTracker(TorchDispatchMode):
    """Count the bytes of the tensor storages allocated by ATen ops while it is active.

    Use it as a context manager::

        with AllocationTracker() as tracker:
            loss = model(x).sum()
            loss.backward()
        tracker.peak_bytes      # most bytes alive at once, above the start
        tracker.current_bytes   # bytes allocated inside and still alive

    Every op dispatched while the tracker is active goes through :meth:`__torch_dispatch__`,
    which runs the op and then looks at the storages of its outputs. A storage that none of the
    op's inputs had and that the tracker does not know yet is new: its ``nbytes()`` are added to
    :attr:`current_bytes`, and a ``weakref.finalize`` on the storage subtracts them when the
    storage dies, wherever that happens (a ``del``, the end of a frame, or the autograd engine
    releasing a saved tensor during ``backward``). Views, ``detach``, in-place ops and ``out=``
    ops return storages of their inputs, so they allocate nothing; when such an op grows a
    storage (``resize_``, an ``out=`` tensor too small), the growth is counted. Storages that
    existed before the tracker started are never counted, so the figures are relative to the
    start. Frees keep being counted after the ``with`` block ends (so :attr:`current_bytes`
    stays the bytes of tracked storages still alive); allocations are seen only inside it. A
    tracker can be entered again; it continues its counts.

    The figures are exact ``nbytes()`` of storages; the CUDA caching allocator rounds blocks up
    (to 512 bytes), so ``torch.cuda.max_memory_allocated`` reads slightly more.

    Parameters
    ----------
    record_events:
        When true, :attr:`events` lists every change of the tracked bytes, in order
        (:class:`AllocationEvent`), to see which op allocated what.

    Attributes
    ----------
    current_bytes:
        Bytes of the storages allocated while tracking that are still alive.
    peak_bytes:
        The largest ``current_bytes`` seen since the start or the last :meth:`reset_peak`.
    events:
        The list of :class:`AllocationEvent`, or None when not recording.

    Known blind spots
    -----------------
    Dispatch-mode tracking sees only the storages that come out of dispatched ops:

    - Memory that a kernel allocates internally and frees before it returns (im2col columns
      of CPU convolutions, oneDNN/cuDNN workspaces, ``.contiguous()`` copies made inside a
      kernel, the buffers of a kernel's sub-ops, which run below the dispatch mode) is
      invisible. The peak reported is therefore a lower bound of the allocator's peak; on
      CPU, :func:`measure_allocator_peak` gives the allocator's figure. On a training step of
      the tiny models of the test zoo the two agree exactly, except with convolutions (ResNet
      157000 vs 202312 bytes, U-Net 314632 vs 340168) and by 16 bytes on the GPT.
    - ``UntypedStorage.resize_`` called directly (not ``Tensor.resize_``) is not an op: a
      storage shrunk or grown that way keeps its recorded size until it dies.
    - Tensors made outside dispatch are not seen until an op returns them: ``torch.tensor``,
      ``torch.as_tensor`` and ``torch.from_numpy`` go through ``aten.lift_fresh``, where their
      storage is counted if it is resizable (a torch allocation, not borrowed numpy memory).
    - Only strided tensors with real memory are tracked: sparse, nested, meta and fake
      tensors are ignored.
    - Ops run by another thread than the one that entered the tracker are not seen, except
      those of the autograd engine, which inherits the dispatch mode.

    Examples
    --------
    >>> with AllocationTracker() as tracker:
    ...     a = torch.randn(1000)
    ...     b = a * 2
    ...     del a
    ...     c = b + 1
    >>> tracker.peak_bytes, tracker.current_bytes
    (8000, 8000)
    """

    def __init__(self, *, record_events: bool = False) -> None:
        super().__init__()
        self.current_bytes: int = 0
        self.peak_bytes: int = 0
        self.events: list[AllocationEvent] | None = [] if record_events else None
        # Keyed by the address of the C++ StorageImpl, which stays the same when the storage is
        # resized (its data pointer does not). A record leaves the table when its storage dies.
        self._live: dict[int, _StorageRecord] = {}
        # Frees may come from autograd threads (CUDA backward), or from a garbage collection that
        # runs while the lock is held (hence reentrant).
        self._lock = threading.RLock()

    def reset_peak(self) -> None:
        """Start a new peak from the bytes alive now: ``peak_bytes = current_bytes``."""
        with self._lock:
            self.peak_bytes = self.current_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {id_: (storage, storage.nbytes()) for id_, storage in _storages_of((args, kwargs))}
        out = func(*args, **kwargs)
        op = str(func)
        with self._lock:
            for id_, (storage, nbytes_before) in inputs.items():
                grown = storage.nbytes() - nbytes_before
                if grown:
                    self._on_resize(op, id_, storage, grown)
            if func in _LIFT_OPS:
                for id_, (storage, _) in inputs.items():
                    if id_ not in self._live and storage.resizable():
                        self._on_new(op, id_, storage, storage.nbytes())
            for id_, storage in _storages_of(out):
                if id_ not in inputs and id_ not in self._live:
                    self._on_new(op, id_, storage, storage.nbytes())
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return out

    # ----------------------------------------------------------------------------------------
    # Implementation
    # ----------------------------------------------------------------------------------------

    def _on_new(self, op: str, id_: int, storage: torch.UntypedStorage, nbytes: int) -> None:
        if nbytes == 0:
            # Nothing to count; if an op grows it later, _on_resize registers it then.
            return
        record = _StorageRecord(op=op, key=storage.data_ptr(), counted_bytes=nbytes)
        finalizer = weakref.finalize(storage, self._on_free, id_, record)
        finalizer.atexit = False
        self._live[id_] = record
        self._add(op, record.key, nbytes, freed=False)

    def _on_resize(self, op: str, id_: int, storage: torch.UntypedStorage, grown: int) -> None:
        record = self._live.get(id_)
        if record is None:
            # A storage from before the start (or an empty one) grew: count the growth only.
            if grown > 0:
                self._on_new(op, id_, storage, grown)
            return
        delta = max(grown, -record.counted_bytes)
        record.counted_bytes += delta
        record.key = storage.data_ptr()
        self._add(op, record.key, delta, freed=False)

    def _on_free(self, id_: int, record: _StorageRecord) -> None:
        with self._lock:
            if self._live.get(id_) is record:
                del self._live[id_]
            self._add(record.op, record.key, -record.counted_bytes, freed=True)

    def _add(self, op: str, key: int, delta: int, *, freed: bool) -> None:
        self.current_bytes += delta
        if self.events is not None:
            self.events.append(AllocationEvent(op, key, delta, self.current_bytes, freed))


def measure_peak(
    fn: Callable[..., Any], *args: Any, device: torch.device | str | None = None
) -> int:
    """Run ``fn(*args)`` and return the peak of the bytes allocated above those at the start.

    On CUDA (``device``, or else the device of the first CUDA tensor in ``args``), the figure is
    ``torch.cuda.max_memory_allocated`` after ``torch.cuda.reset_peak_memory_stats``, minus
    ``torch.cuda.memory_allocated`` at the start: it includes the kernels' workspaces and the
    allocator's rounding. Elsewhere it is the :attr:`AllocationTracker.peak_bytes` of a tracker
    around the call (see its blind spots). The value ``fn`` returns counts while it is alive,
    then is dropped.

    Parameters
    ----------
    fn:
        The function to measure.
    *args:
        Its positional arguments (tensors, or structures of tensors).
    device:
        Where the memory is allocated; pass it when ``fn`` uses CUDA tensors that are not in
        ``args`` (e.g. a closure over a model on CUDA).

    Returns
    -------
    int
        Bytes.

    Examples
    --------
    >>> measure_peak(lambda x: (x * 2) + 1, torch.zeros(1000))
    8000
    """
    device = torch.device(device) if device is not None else _device_of(args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start_bytes = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn(*args)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start_bytes
    with AllocationTracker() as tracker:
        fn(*args)
    return tracker.peak_bytes


# c10's CUDA caching allocator rounds every block up to a multiple of this (kMinBlockSize)
CUDA_BLOCK_BYTES = 512


def allocated_bytes(nbytes: int, device: torch.device | str) -> int:
    """The bytes the allocator takes for a storage of ``nbytes`` on ``device``, as its peak
    counts them: on CUDA, ``nbytes`` rounded up to 512 bytes (``max_memory_allocated`` counts
    blocks); on the CPU, ``nbytes``."""
    if nbytes and torch.device(device).type == "cuda":
        return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
    return nbytes


def storage_bytes(tensor: torch.Tensor) -> int:
    """The allocator's bytes for ``tensor``'s storage (:func:`allocated_bytes`); real or fake."""
    return allocated_bytes(tensor.untyped_storage().nbytes(), tensor.device)


def tensor_bytes(value) -> int:
    """The allocator's bytes for a new tensor like ``value`` (its elements, rounded as
    :func:`allocated_bytes`); 0 for anything else."""
    if not isinstance(value, torch.Tensor):
        return 0
    return allocated_bytes(value.numel() * value.element_size(), value.device)


@dataclass(frozen=True)
class AllocatorEvent:
    """One allocation (``delta_bytes > 0``) or free reported by the allocator.

    ``time_ns`` orders the events; ``current_bytes`` is the total allocated since the start of
    the recording just after the event (frees of blocks allocated before the start are not
    reported by the CPU allocator, so it never goes below zero).
    """

    time_ns: int
    delta_bytes: int
    current_bytes: int


def allocator_events(fn: Callable[..., Any], *args: Any) -> list[AllocatorEvent]:
    """Run ``fn(*args)`` on the CPU and return the CPU allocator's allocation events, in order.

    The figures come from the allocator itself (``torch.profiler.profile(profile_memory=True)``,
    its allocation events): every allocation and free of the process's CPU allocator, the
    buffers that kernels allocate and free inside themselves included (convolution im2col
    columns, oneDNN scratchpads), which :class:`AllocationTracker` does not see. Only blocks
    allocated during the call count: the free of a block allocated before it (which the
    allocator reports when an earlier profiling session saw its allocation) is left out, so
    the figures are the memory allocated since the call started. Kineto's own log lines are
    silenced (``KINETO_LOG_LEVEL=6`` unless set).
    """
    return allocator_events_and_ranges(fn, *args)[0]


def allocator_events_and_ranges(fn: Callable[..., Any], *args: Any, prefix: str = "\0",
                                device_type: str = "cpu") -> tuple[
        list[AllocatorEvent], dict[str, tuple[int, int]]]:
    """:func:`allocator_events`, and the (start, end) times of the profiler ranges
    (``torch.profiler.record_function``) whose names start with ``prefix``, by name.
    ``device_type="cuda"`` gives the CUDA caching allocator's events instead (its blocks, each
    rounded up to 512 bytes, as ``torch.cuda.max_memory_allocated`` counts them)."""
    import os

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*args)
    ranges = {e.name(): (e.start_ns(), e.end_ns()) for e in prof.profiler.kineto_results.events()
              if e.name().startswith(prefix)}
    allocation = torch._C._profiler._EventType.Allocation
    raw: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == allocation and event.typed[1].device.type == device_type:
            raw.append((event.start_time_ns, event.typed[1].alloc_size, event.typed[1].ptr))
    events, current, live = [], 0, set()
    for time_ns, delta, ptr in sorted(raw, key=lambda triple: triple[0]):
        if delta > 0:
            live.add(ptr)
        elif ptr in live:
            live.discard(ptr)
        else:
            continue  # allocated before the call
        current += delta
        events.append(AllocatorEvent(time_ns, delta, current))
    return events, ranges


def measure_allocator_peak(
    fn: Callable[..., Any], *args: Any, device: torch.device | str | None = None
) -> int:
    """Run ``fn(*args)`` and return the allocator's peak above the start, workspaces included.

    This is the figure the budget promises (``DESIGN.md``): on CPU the peak of the CPU
    allocator's own reports (:func:`allocator_events`), which see the buffers that kernels
    allocate internally (convolution columns) where :func:`measure_peak` does not; on CUDA,
    ``torch.cuda.max_memory_allocated`` (:func:`measure_peak`).

    Parameters and return value as :func:`measure_peak`.
    """
    device = torch.device(device) if device is not None else _device_of(args)
    if device.type == "cuda":
        return measure_peak(fn, *args, device=device)
    return max((event.current_bytes for event in allocator_events(fn, *args)), default=0)


# --------------------------------------------------------------------------------------------
# Utilities
# --------------------------------------------------------------------------------------------

# Ops through which torch.tensor / as_tensor / from_numpy hand the dispatch a tensor whose
# storage was made outside it.
_LIFT_OPS = frozenset({torch.ops.aten.lift_fresh.default})


@dataclass
class _StorageRecord:
    op: str  # the op that allocated the storage
    key: int  # its data pointer (changes when an op resizes the storage)
    counted_bytes: int  # what the tracker added for it, subtracted when it dies


def _storages_of(tree: Any) -> list[tuple[int, torch.UntypedStorage]]:
    """The distinct storages with real memory in a structure of tensors and storages."""
    found: dict[int, torch.UntypedStorage] = {}
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor):
            if leaf.layout != torch.strided or leaf.is_meta or leaf.is_nested:
                continue
            storage = leaf.untyped_storage()
        elif isinstance(leaf, torch.UntypedStorage):
            storage = leaf
        else:
            continue
        if storage.device.type != "meta":
            found.setdefault(storage._cdata, storage)
    return list(found.items())


def _device_of(args: Any) -> torch.device:
    """The first CUDA device among the tensors of ``args``; the CPU when there is none."""
    for leaf in tree_flatten(args)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
            return leaf.device
    return torch.device("cpu")
