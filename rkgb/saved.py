"""Saved tensors of autograd islands: references to node data, or phantoms.

When a simplified node ``x`` runs with grad (an *autograd island*), autograd saves tensors in
``x``'s ``grad_fn`` for the backward. With :func:`torch.autograd.graph.saved_tensors_hooks`,
every saved tensor goes through :meth:`SavedTensors.pack`:

- a tensor sharing its storage with the current data of a node (``x`` itself, as ``relu``
  saves its result, or an input of ``x``, or a view of either) is stored as a
  :class:`DataReference`: the node's name and the view's geometry. It holds no memory, and
  :meth:`unpack` rebuilds it from that node's *current* data, so forgetting and recomputing a
  node's data never leaves a stale copy behind in someone's ``grad_fn``;
- a tensor of a global (parameter, buffer, model input) is kept as is: always alive, free;
- any other tensor is a *phantom* of ``x`` (Rockmate, ICML 2023, section 3): memory that only
  ``x``'s backward needs, freed by :meth:`free_phantoms`, or, in a backward, as soon as the
  autograd node that saved it has run (eager's engine frees each node's saved tensors then).

The graph builder measures phantoms with this class and the executor runs with it, so both
agree on what a node keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .memory import storage_bytes

__all__ = ["DataReference", "Packed", "PhantomFreedError", "SavedTensors", "storage_key"]


def storage_key(tensor: torch.Tensor) -> int:
    """An identity of the tensor's storage (its data pointer); 0 for an empty storage."""
    return tensor.untyped_storage().data_ptr()


@dataclass
class DataReference:
    """A saved tensor that is a view of output ``index`` of node ``node``."""

    node: str
    index: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


class Packed:
    """What autograd keeps for one saved tensor of the island of ``island``.

    Exactly one of ``tensor`` (a phantom, or a global) and ``reference`` is set; a phantom's
    ``tensor`` becomes None when the phantoms of its island are freed.
    """

    __slots__ = ("island", "tensor", "reference")

    def __init__(self, island: str, tensor: torch.Tensor | None, reference: DataReference | None) -> None:
        self.island = island
        self.tensor = tensor
        self.reference = reference


class PhantomFreedError(RuntimeError):
    pass


class SavedTensors:
    """The registry of node data and of the phantoms of each island (one per training step)."""

    def __init__(self) -> None:
        self._owner: dict[int, tuple[str, int]] = {}  # storage key -> (node, output index)
        self._data: dict[str, Sequence[torch.Tensor]] = {}  # node -> its current outputs
        self._keys: dict[str, list[int]] = {}  # node -> the storage keys registered for it
        self._globals: set[int] = set()
        self._phantoms: dict[str, list[Packed]] = {}
        self._references: dict[str, set[str]] = {}
        self._island: str | None = None
        # a backward that frees the graph as it goes (not ``retain_graph``) takes each phantom
        # out of the registry when its autograd node unpacks it, so that the engine frees it
        # once that node has run, as eager's does; the inspection's timings keep the graph
        self.consume = True

    # -- data ------------------------------------------------------------------------------
    def register_globals(self, tensors) -> None:
        """Parameters, buffers and inputs: saved as themselves, never counted."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                self._globals.add(storage_key(tensor))

    def register_data(self, node: str, outputs: Sequence[torch.Tensor]) -> None:
        """``outputs`` are now the current data of ``node`` (after a computation)."""
        self.unregister_data(node)
        self._data[node] = outputs
        keys = []
        for index, tensor in enumerate(outputs):
            if tensor.numel():
                keys.append(storage_key(tensor))
                self._owner[keys[-1]] = (node, index)
        self._keys[node] = keys

    def unregister_data(self, node: str) -> None:
        """The data of ``node`` is forgotten: its storages may be reused by the allocator.

        The keys are those registered, not those of the tensors now: the executor recomputes
        a node into the same leaf objects (``leaf.data = new``), so that the leaves hold the
        new storages by then while the old ones, freed, may come back as another tensor's."""
        self._data.pop(node, None)
        for key in self._keys.pop(node, ()):
            if self._owner.get(key, (None,))[0] == node:
                del self._owner[key]

    # -- islands ---------------------------------------------------------------------------
    def island(self, node: str) -> "_Island":
        """``with saved.island(node):`` runs the forward of ``node`` with grad: saved tensors
        are packed for ``node``."""
        return _Island(self, node)

    def pack(self, tensor: torch.Tensor):
        key = storage_key(tensor)
        if not tensor.numel() or key in self._globals:
            return tensor
        owner = self._owner.get(key)
        if owner is not None:
            self._references[self._island].add(owner[0])
            return Packed(self._island, None, self._reference(owner, tensor))
        packed = Packed(self._island, tensor, None)
        self._phantoms[self._island].append(packed)
        return packed

    @staticmethod
    def _reference(owner: tuple[str, int], tensor: torch.Tensor) -> DataReference:
        return DataReference(
            owner[0], owner[1], tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), tensor.dtype
        )

    def unpack(self, packed):
        if not isinstance(packed, Packed):
            return packed
        reference = packed.reference
        if reference is not None:
            outputs = self._data.get(reference.node)
            if outputs is None:
                raise PhantomFreedError(
                    f"the backward of {packed.island!r} needs the data of {reference.node!r}, "
                    "which is not alive: the schedule is invalid"
                )
            base = outputs[reference.index].detach()
            if base.dtype != reference.dtype:
                # a view of the data as another dtype (``torch.view_as_complex`` of a float
                # tensor, as Meta's Llama applies its rotary embedding): its geometry counts in
                # its own elements, so it is rebuilt over the storage with its own dtype
                view = torch.empty(0, dtype=reference.dtype, device=base.device)
                return view.set_(base.untyped_storage(), reference.offset, reference.size, reference.stride)
            return base.as_strided(reference.size, reference.stride, reference.offset)
        tensor = packed.tensor
        if tensor is None:
            raise PhantomFreedError(
                f"the backward of {packed.island!r} needs its phantoms, which were freed: the "
                "schedule is invalid"
            )
        if self.consume:
            packed.tensor = None  # the autograd node that unpacks it holds it alone, until it has run
        return tensor

    def finish_island(self, node: str, outputs: Sequence[torch.Tensor]) -> None:
        """Saved tensors that alias ``node``'s own outputs become references to its data."""
        phantoms = self._phantoms.get(node)
        if not phantoms:
            return
        keys = {storage_key(t): i for i, t in enumerate(outputs) if t.numel()}
        kept = []
        for packed in phantoms:
            index = keys.get(storage_key(packed.tensor))
            if index is None:
                kept.append(packed)
            else:
                packed.reference = self._reference((node, index), packed.tensor)
                packed.tensor = None
                self._references[node].add(node)
        self._phantoms[node] = kept

    # -- phantoms --------------------------------------------------------------------------
    def free_phantoms(self, node: str) -> None:
        for phantom in self._phantoms.pop(node, []):
            phantom.tensor = None

    def phantom_packs(self, node: str) -> list[Packed]:
        """The packed phantoms of ``node`` not freed yet."""
        return [p for p in self._phantoms.get(node, []) if p.tensor is not None]

    def phantom_tensors(self, node: str) -> list[torch.Tensor]:
        return [p.tensor for p in self._phantoms.get(node, []) if p.tensor is not None]

    def phantom_bytes(self, node: str) -> int:
        """Bytes held by the phantoms of ``node`` (each storage counted once)."""
        storages = {}
        for tensor in self.phantom_tensors(node):
            storages[storage_key(tensor)] = storage_bytes(tensor)
        return sum(storages.values())

    def references_of(self, node: str) -> set[str]:
        """Nodes whose data the saved tensors of ``node``'s island refer to."""
        return set(self._references.get(node, set()))


class _Island:
    """The context of one island (:meth:`SavedTensors.island`): a class, not a generator, as
    the executor enters one per node and step (1.2 us instead of 2.1 us)."""

    __slots__ = ("saved", "node", "hooks")

    def __init__(self, saved: SavedTensors, node: str) -> None:
        self.saved = saved
        self.node = node
        # made per island: kept on the registry, the hooks (bound methods) would make a
        # reference cycle that keeps the step's registered data alive until a garbage collection
        self.hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack)

    def __enter__(self) -> None:
        saved, node = self.saved, self.node
        saved._island = node
        saved._phantoms[node] = []
        saved._references[node] = set()
        self.hooks.__enter__()

    def __exit__(self, *exc_info) -> None:
        self.hooks.__exit__(*exc_info)
        self.saved._island = None
