"""The gradient sink of a node's leaf, shared by inspection and execution.

Each simplified node is an autograd island whose outputs are leaves (Rockmate, ICML 2023,
section 5). Gradients reaching a leaf are collected by a :class:`GradSink` exactly as eager
PyTorch's ``InputBuffer`` would collect them for the node's backward: same tensors, same memory
layouts, same summation order. The inspection (:mod:`rkgb.inspect`) and the executor
(:mod:`exec.runtime`) use this one class, so that the memory the inspection measures is the
memory the executor uses.

Storages are compared and counted without making their Python object
(``tensor.untyped_storage()``): torch keeps that object, and its reference to the storage, for
as long as the storage lives, and eager's engine adds a contribution into a gradient in place
(its ``InputBuffer`` steals it) only where the gradient's storage has no other reference. A
gradient that a sink had asked for its storage made every later sum into it, inside an
island's engine call, a new tensor (fuzz seed 207: ``v1 - v1`` after ``silu``, one gradient
more than eager at the peak).
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["GradSink", "GradientQueue", "ParameterSink", "accumulate", "gradient_node"]


class GradSink:
    """Collects the gradient of a leaf as eager's ``InputBuffer`` would.

    A pre-hook on the leaf's ``AccumulateGrad`` node: the first contribution is stored as is
    (a slice of a bigger gradient too: a view, as eager's), a later one is added in place into the
    gradient when the sink holds it alone, as eager's buffer steals it, out of place otherwise
    (``old + grad``: an alias of another gradient); ``AccumulateGrad`` does nothing. The node's backward then receives exactly the gradient
    that eager PyTorch would pass to it, in the same memory layout (a bias gradient's
    reduction rounds identically), sharing storage where eager's share it (an ``add``'s
    backward passes its incoming gradient itself to both its inputs). A slice (a ``cat``'s
    backward) stays a view: the next backward's kernels take another path on a strided
    gradient than on a contiguous copy (a ``silu``'s vectorized loop rounds otherwise), and the
    whole bigger gradient stays alive while the slice does, in eager and in the plan (an alias
    of it, or the storage's bytes where it crosses a block's boundary, ``rkgb.inspect``).

    With a :class:`GradientQueue`, a contribution waits in it until the backward that made it
    has let go of its own incoming gradient and saved tensors (:meth:`GradientQueue.flush`), as
    eager's engine adds a node's outputs into the next buffers only after releasing its inputs.
    For the inspection: ``keys``, when set (``rkgb.inspect._AliasRecorder``), records for each
    contribution which part of the incoming gradient it is an alias of; ``last_bytes`` is the last one's
    bytes (a slice of a bigger tensor holds all of it); ``first_shared``: the first contribution
    (the gradient) shares its storage with another tensor (a view's base), so that the next one
    is not added into it in place.
    """

    __slots__ = ("leaf", "node", "calls", "keys", "last_bytes", "first_shared", "first_owned", "__weakref__")

    def __init__(self, leaf: torch.Tensor, queue: "GradientQueue | None" = None) -> None:
        self.leaf = leaf
        self.calls = 0  # contributions received (for the inspection)
        self.keys = None  # the inspection's rkgb.inspect._AliasRecorder; None: not recording
        self.last_bytes = 0
        self.first_shared = False
        self.first_owned = False  # ... yet freed with it (a view of a result of its own size)
        # the sink keeps the leaf's AccumulateGrad alive (the leaf holds it weakly); the node's
        # hook refers back to the sink weakly: a strong reference would make a cycle through
        # C++ that only Python's garbage collector frees, so that every step's state (its
        # outputs' data and gradients) would outlive the step until the next collection
        self.node = gradient_node(leaf)
        sink = weakref.ref(self)
        self.node.register_prehook(lambda grad_outputs: _deliver(sink, queue, grad_outputs))

    def __call__(self, grad_outputs):
        grad = grad_outputs[0]
        if grad is not None:
            self.calls += 1
            recording = self.keys is not None
            if recording:  # (the inspection's figures: their storage's Python object is made)
                self.keys.record(grad)
                self.last_bytes = grad.untyped_storage().nbytes()
            old = self.leaf.grad
            # held by the leaf's .grad and by `old` alone: the gradient's only holder
            self.leaf.grad = accumulate(old, grad, old is not None and old._use_count() == 2)
            if old is None and recording:
                self.first_shared = not _addable_in_place(self.leaf.grad)
                self.first_owned = owns_its_storage(self.leaf.grad)
        return (None,)


class ParameterSink:
    """A parameter's ``.grad`` as the destination of a gradient computed apart (the sum of a view
    group, :meth:`GradientQueue.alias`'s ``through``), added as the parameter's
    ``AccumulateGrad`` adds: taken as it is (a copy in the parameter's layout where it is a view
    or strided otherwise) when ``.grad`` is None, added in place otherwise."""

    __slots__ = ("parameter", "__weakref__")

    def __init__(self, parameter: torch.Tensor) -> None:
        self.parameter = parameter

    def __call__(self, grad_outputs) -> None:
        grad = grad_outputs[0]
        if grad is None:
            return
        parameter = self.parameter
        with torch.no_grad():
            if parameter.grad is None:
                stealable = grad._base is None and grad.stride() == parameter.stride()
                parameter.grad = grad if stealable else grad.clone(memory_format=torch.preserve_format) \
                    if non_overlapping_and_dense(grad) else torch.empty_like(parameter).copy_(grad)
            else:
                parameter.grad.add_(grad)


def gradient_node(tensor: torch.Tensor):
    """The autograd node that receives ``tensor``'s gradient: its ``grad_fn``, or a leaf's
    ``AccumulateGrad`` (``torch.autograd.graph.get_gradient_edge(tensor).node``, without its
    context manager and edge tuple: half its time, and the executor asks it for every leaf of
    every step)."""
    node = tensor.grad_fn
    if node is not None:
        return node
    enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(True)
    try:
        return tensor.view_as(tensor).grad_fn.next_functions[0][0]
    finally:
        torch._C._set_grad_enabled(enabled)


def accumulate(old: torch.Tensor | None, grad: torch.Tensor, held_alone: bool) -> torch.Tensor:
    """Add ``grad`` to a gradient as eager's ``InputBuffer`` does; returns the new gradient.

    The first contribution is kept as it is (a slice of a bigger storage too, as eager's buffer
    keeps it). A later one is added in place when the gradient is a
    dense tensor that nothing else holds (``held_alone``: no other tensor, no view, the caller
    knowing its own references), as eager's buffer steals it; out of place (``old + grad``, a
    new tensor) otherwise. In place or not, the values are the same; the layout of the result,
    and so the rounding of a reduction over it (a bias's gradient), is eager's.
    """
    if old is None:
        return grad
    # (a contribution that is the gradient itself, or a view of it: an ``add``'s backward passes
    # its one incoming gradient to every input, and that may be what this sink already holds)
    same_storage = _storage_address(grad) == _storage_address(old)
    if held_alone and not same_storage and _addable_in_place(old):
        return old.add_(grad)
    return old + grad


def add_pieces(total: torch.Tensor | None, summed: set[int], grad: torch.Tensor, pieces: tuple) -> torch.Tensor:
    """Add the pieces of ``grad`` (a whole view's gradient from one island) that the island read
    into ``total`` (the group's sum so far, None at first), as eager's split node sums them:
    a piece's first contribution is taken as it is (copied), a later one added; the pieces
    read by no island stay zeros. ``summed``: the pieces with a contribution so far (updated).
    Returns the new sum (``grad`` itself for the first contribution; a copy where the sum is
    held elsewhere)."""
    dim, read = pieces
    if total is None:
        summed.update(index for index, _, _ in read)
        return grad  # its other pieces are zeros: taken over by copy when a contribution comes
    if not (total._use_count() == 1 and _addable_in_place(total)):
        total = total.clone()
    for index, start, length in read:
        piece, contribution = total.narrow(dim, start, length), grad.narrow(dim, start, length)
        if index in summed:
            piece.add_(contribution)
        else:
            piece.copy_(contribution)
            summed.add(index)
    return total


def _addable_in_place(gradient: torch.Tensor) -> bool:
    """Eager's buffer adds the next contribution into ``gradient`` in place only when no other
    tensor holds its storage and it is dense (not a slice of a bigger gradient)."""
    return _storage_held_alone(gradient) and non_overlapping_and_dense(gradient)


def _storage_held_alone(tensor: torch.Tensor) -> bool:
    """No other tensor (a view) holds the storage.

    Counted without making the storage's Python object (module docstring) where the count says
    so alone; a count of two is this tensor and either another holder or that object, made
    earlier (by the inspection): then the object is asked for (made, where it was not, on a
    storage shared anyway) and counted with."""
    count = _storage_use_count(tensor)
    if count <= 1:
        return True
    if count > 2:
        return False
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) == 2  # (3: it was not there)


# (a torch without it: the storage's Python object is made to read it)
_ADDRESS_OF_STORAGE = getattr(torch._C, "_storage_address", None)


def _storage_address(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage, read without making its Python object."""
    if _ADDRESS_OF_STORAGE is None:
        return tensor.untyped_storage()._cdata
    return _ADDRESS_OF_STORAGE(tensor)


def _storage_use_count(tensor: torch.Tensor) -> int:
    """The references to ``tensor``'s storage (its tensors, views, and its Python object where
    one was made), read without making that object (module docstring)."""
    return torch._C._storage_Use_Count(_storage_address(tensor))


def owns_its_storage(tensor: torch.Tensor) -> bool:
    """A dense tensor over all of its storage, which no other tensor holds but its own base (a
    gradient made in a bigger buffer's layout): what the engine frees when it drops the tensor."""
    holders = 2 + (tensor._base is not None)  # the tensor, the storage's wrapper, its base
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) <= holders \
        and tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes() \
        and non_overlapping_and_dense(tensor)


def non_overlapping_and_dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` covers its elements densely, without overlap (any order of strides):
    c10's ``compute_non_overlapping_and_dense``, the dimensions of at least 2 elements sorted by
    stride, each stride the product of the sizes before it (torch's own Python test took ~50 us,
    on every transposed gradient)."""
    if tensor.is_contiguous():  # (the common case, answered in C++)
        return True
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size >= 2):
        if stride != expected:
            return False
        expected *= size
    return True


def _deliver(sink: "weakref.ref[GradSink]", queue: "GradientQueue | None", grad_outputs):
    """The prehook of a sink's ``AccumulateGrad``: the sink takes the gradient (now, or when
    ``queue`` is flushed), the node accumulates nothing."""
    target = sink()
    grad = grad_outputs[0]
    if target is not None and grad is not None:
        if queue is None:
            target(grad_outputs)
            return (None,)
        queue.pending.append((None, target, grad, None, None))
    return (None,)


# the suffix of a split group inside a view's group (exec.codegen._group_argument)
PIECES = ".pieces"


_EMPTY: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _no_memory(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One scalar per dtype and device, which released aliases view (expanded to their shape):
    a new scalar per alias would be a few bytes per read per step that no plan counts."""
    key = (dtype, device)
    if key not in _EMPTY:
        _EMPTY[key] = torch.zeros((), dtype=dtype, device=device)
    return _EMPTY[key]


class GradientQueue:
    """The gradient contributions of one backward that wait for their sinks, and the aliases
    that give each read of a leaf its own contribution.

    Contributions wait (:class:`GradSink` with a queue) until the backward that made them has
    let go of its incoming gradient and saved tensors, and :meth:`flush` hands them over: eager's
    engine adds a node's outputs into the next buffers only after releasing its inputs.

    Eager PyTorch adds every contribution to a tensor's gradient into one buffer, in the order
    the engine produces them: autograd nodes in decreasing creation order, and the outputs of
    one node in argument order (``h * h + h``: ``(g_add + g_mul0) + g_mul1``). An island that
    reads a leaf twice (``mul(h, h)``) would let the engine sum its two contributions before the
    sink sees them (``g_add + (g_mul0 + g_mul1)``), which rounds differently. So each read gets
    an alias (:meth:`alias`) whose ``AccumulateGrad`` queues its contribution with the rank of
    the read, ``(-position of the line, argument index)``, and :meth:`flush` passes a sink's
    ranked contributions in rank order.

    :meth:`release`, called when the island's lines have run, lets go of the aliases' data: the
    island's graph keeps their ``AccumulateGrad`` nodes (and so the aliases), which must not keep
    the leaf's memory alive once the schedule forgets it; saved tensors refer to the leaf's data
    through :class:`rkgb.saved.SavedTensors`, never through an alias.
    """

    __slots__ = ("pending", "fresh", "kept", "groups", "delivered", "throughs")

    def __init__(self) -> None:
        # (rank or None, sink, contribution, group or None), in the order the engine made them
        self.pending: list[tuple] = []
        self.fresh: list[tuple[torch.Tensor, object]] = []  # aliases of the island being built
        self.kept: list[object] = []  # the AccumulateGrad nodes of aliases of globals, until then
        # (sink, group) -> the sum so far of the group's contributions (see alias)
        # (and, for a split's group, the pieces with a contribution so far: add_pieces)
        self.groups: dict[tuple[int, str], tuple[GradSink, torch.Tensor, set[int] | None]] = {}
        # groups whose place in the backward is passed: a later contribution (from the backward
        # of the island that makes the view after its own result) joins its sink at once, in
        # the order of the reads
        self.delivered: set[str] = set()
        # (sink, group) -> (the leaf, the views from it) of a group summed at the view's size
        self.throughs: dict[tuple[int, str], tuple[torch.Tensor, object]] = {}

    def alias(self, leaf: torch.Tensor, sink: GradSink, rank: tuple[int, int], is_global: bool = False,
              group: str | None = None, pieces: tuple | None = None, through=None,
              piece: int | None = None) -> torch.Tensor:
        """A leaf sharing ``leaf``'s data whose gradient goes to ``sink`` at :meth:`flush`.

        ``is_global``: ``leaf`` is a model input, alive through the step: saved tensors keep the
        alias itself, whose data :meth:`release` must leave alone. ``group``: the read is a view
        of a model input made in the reading island (where eager makes one view for all its
        readers): eager sums the view's gradient in its own buffer and passes the sum on when
        the view's backward runs, so the contributions of a group are summed apart, in the
        engine's order, and join the sink as one at :meth:`deliver` (or :meth:`close_groups`).
        ``pieces``: the group's view is a split, of which the island reads these pieces,
        ``(dim, ((index, start, length), ...))``: eager's split node sums each piece's
        contributions apart (its buffer has one slot per piece) and fills the pieces that got
        none with zeros; the island's gradient has zeros where it read no piece, which a sum
        would add (a -0.0 of another island's piece would become +0.0), so only the pieces read
        join the group's sum (:func:`add_pieces`). ``through``: the group's view is one whose
        backward sums (an ``expand``'s: :func:`rkgb.simplify.summing_view_chain`), a function
        making it from ``leaf``: the alias is the view itself, its contributions are summed at
        the view's size, and the view's backward runs once on the sum when it joins the sink
        (:meth:`_join`), as eager's (summing each island's reduced contribution rounds
        otherwise: Perceiver's ``latents.expand(batch, ...)``), or where the view is smaller
        than ``leaf`` (a slice: each island would make a leaf-sized gradient). ``piece``: with a
        ``through`` that is a split, the read is that piece alone: its contributions are summed
        in a group of their own (``"<group>[<piece>]"``, a slot of eager's split node), and
        the split's backward runs once on all its pieces' sums when the group is delivered."""
        if through is not None:
            self.throughs[(id(sink), group)] = (leaf, through)
            alias = through(leaf.detach())
            if piece is not None:
                alias, group = alias[piece], f"{group}[{piece}]"
            alias = alias.requires_grad_()
        else:
            alias = leaf.detach().requires_grad_()
        pending = self.pending
        # the hook refers to the sink weakly: the sink's own node refers to this queue, which
        # keeps the alias's node (``kept``), so a strong reference would make a cycle that holds
        # the leaf and its gradient after the step, until Python's garbage collector runs (the
        # user's input gradient was then a copy: autograd cannot take a tensor held elsewhere)
        sink_ref = weakref.ref(sink)

        def keep(grad_outputs):
            target = sink_ref()
            if grad_outputs[0] is not None and target is not None:
                pending.append((rank, target, grad_outputs[0], group, pieces))
            return (None,)

        node = gradient_node(alias)
        node.register_prehook(keep)
        if not is_global:
            self.fresh.append((alias, node))  # the node lives while the island's graph holds it
        else:
            self.kept.append(node)
        return alias

    def release(self) -> None:
        """The island's lines have run: its aliases keep their shapes but no memory."""
        for alias, _ in self.fresh:
            alias.data = _no_memory(alias.dtype, alias.device).expand(alias.shape)
        self.fresh.clear()
        self.kept.clear()

    def flush(self) -> None:
        """Hand the waiting contributions to their sinks: each sink's in the engine's order, or
        in the ranks' order for the reads of a leaf read more than once."""
        pending, self.pending[:] = list(self.pending), []
        self._hand_over(pending)

    def _hand_over(self, pending: list) -> None:
        """:meth:`flush` of the contributions ``pending``."""
        by_sink: dict[int, list] = {}
        for entry in pending:
            by_sink.setdefault(id(entry[1]), []).append(entry)
        for entries in by_sink.values():
            if all(entry[0] is not None for entry in entries):
                entries.sort(key=lambda entry: entry[0])
            for _, sink, grad, group, pieces in entries:
                if group is None or _split_group(group)[0] in self.delivered:
                    self._join(sink, group, grad)
                    continue
                key = (id(sink), group)
                held = self.groups.pop(key, None)
                if held is None:
                    total, summed = None, (set() if pieces is not None else None)
                else:
                    total, summed = held[1:]
                held = None
                if pieces is not None:
                    total = add_pieces(total, summed, grad, pieces)
                else:
                    # in place into the sum so far when nothing else holds it, as eager's buffer
                    total = accumulate(total, grad, total is not None and total._use_count() == 1)
                self.groups[key] = (sink, total, summed)
                del total

    def deliver(self, group: str) -> None:
        """The backward reaches the place of eager's view ``group`` (every node made after the
        view has run its backward): the group's sum joins its sink."""
        # its contributions still waiting (a merged island's engine call made them, with
        # others that wait for the next flush): eager's view backward runs on all of them
        def mine(name: str | None) -> bool:
            return name is not None and (name == group + PIECES or _split_group(name)[0] == group)

        waiting = [entry for entry in self.pending if mine(entry[3])]
        if waiting:
            self.pending[:] = [entry for entry in self.pending if not mine(entry[3])]
            self._hand_over(waiting)
            del waiting
        self.delivered.add(group)
        self.delivered.add(group + PIECES)
        self._fold_pieces(lambda name: name == group + PIECES)
        self._join_groups([key for key in self.groups if _split_group(key[1])[0] == group])

    def _join_groups(self, keys: list) -> None:
        """The groups of ``keys`` join their sinks, in order; the pieces of one split together
        (``alias``'s ``piece``), once, where the first of them is."""
        joined: set[tuple[int, str]] = set()
        for key in keys:
            group, piece = _split_group(key[1])
            if piece is None:
                # (the sum passed on alone: _join lets go of it before it joins, as eager's
                # engine frees a node's input buffer before adding its outputs into the next)
                sink = self.groups[key][0]
                self._join(sink, group, self.groups.pop(key)[1])
                continue
            if (key[0], group) in joined:
                continue
            joined.add((key[0], group))
            pieces = {}
            for other in [other for other in keys if other[0] == key[0] and _split_group(other[1])[0] == group]:
                sink, pieces[_split_group(other[1])[1]], _ = self.groups.pop(other)
            self._join(sink, group, pieces)
            del pieces

    def _join(self, sink, group: str | None, grad) -> None:
        """``grad`` (a group's sum, or a contribution) joins ``sink``; through the view's
        backward where the group is summed at the view's size (``alias``'s ``through``). For a
        split's pieces: ``grad`` is ``{piece: its sum}`` (or a contribution of one piece, whose
        group is ``"<group>[<piece>]"``), and the split's backward makes the pieces not there
        zeros, as eager's split node does."""
        if group is not None and not isinstance(grad, dict):
            name, piece = _split_group(group)
            if piece is not None:
                group, grad = name, {piece: grad}
        through = self.throughs.get((id(sink), group)) if group is not None else None
        if through is not None:
            leaf, view = through
            base = leaf.detach().requires_grad_()
            with torch.enable_grad():
                made = view(base)
            if isinstance(grad, dict):  # (emptied: the caller's dict holds the sums no more)
                read = sorted(grad)
                made, grad = [made[piece] for piece in read], [grad.pop(piece) for piece in read]
            # the group's sum is freed before the result joins the sink (the caller holds it no
            # more): eager's engine frees the view node's input buffer before adding its output
            # into the next buffer (a new sum there, where that buffer is not the input's alone)
            (grad,) = torch.autograd.grad(made, base, grad)
            del made, base
        sink((grad,))

    def _fold_pieces(self, which) -> None:
        """Add the sums of the split groups named by ``which`` (``"<view>.pieces"``) into their
        views' groups (or their sinks, where the view's group is passed), as one contribution
        after those already there: eager's split node passes its sum to the view's buffer."""
        for key in [key for key in self.groups if which(key[1])]:
            sink, total, _ = self.groups.pop(key)
            view = key[1][: -len(PIECES)]
            if view in self.delivered - {key[1]} and (id(sink), view) not in self.groups:
                sink((total,))
                continue
            held = self.groups.pop((id(sink), view), None)
            old = None if held is None else held[1]
            held = None
            total = accumulate(old, total, old is not None and old._use_count() == 2)
            old = None
            self.groups[(id(sink), view)] = (sink, total, None)
            del total

    def close_groups(self) -> None:
        """The backward ends: the groups not delivered yet (views made before every node that
        has a backward) join their sinks."""
        self._fold_pieces(lambda name: name.endswith(PIECES))
        self.delivered = set()
        self._join_groups(list(self.groups))
        self.throughs = {}


def _split_group(name: str | None) -> tuple[str | None, int | None]:
    """``(the split's group, the piece)`` for a piece's group name ``"<group>[<piece>]"``
    (:meth:`GradientQueue.alias`), ``(name, None)`` for any other."""
    if name is None or not name.endswith("]") or "[" not in name:
        return name, None
    group, piece = name[:-1].rsplit("[", 1)
    return group, int(piece)


class _Handoff(torch.autograd.Function):
    """A root for an island's backward that hands the incoming gradients over to the engine.

    ``torch.autograd.backward(outputs, grads)`` keeps ``grads`` in the graph's root until the
    call ends, where eager's engine frees each gradient once the node it reaches has used it:
    an island whose outputs are a result and views of it (``h``, ``h.chunk(2)``) held the three
    incoming gradients and their sum through the result's backward. This node reads the island's
    outputs (saving nothing) and returns an empty tensor; its backward returns the gradients set
    on it (``pending``) and drops them, so that the engine's buffers hold them alone, as eager's
    do (one sum, added in place, the same values)."""

    @staticmethod
    def forward(ctx, *outputs):
        ctx.pending = None
        return outputs[0].new_empty(0)

    @staticmethod
    def backward(ctx, _):
        grads, ctx.pending = ctx.pending, None
        return grads


def handoff(*outputs: torch.Tensor) -> torch.Tensor:
    """The root (:class:`_Handoff`) of the backward from ``outputs`` (island outputs)."""
    with torch.enable_grad():
        return _Handoff.apply(*outputs)


def handoff_backward(root: torch.Tensor, leaves: tuple[torch.Tensor, ...]) -> None:
    """Backward from the island outputs of ``root`` (:func:`handoff`) with the gradients that
    ``leaves`` (their detached leaves, in order) hold; the leaves' ``.grad`` are cleared first:
    the engine alone holds the gradients."""
    grads = tuple(leaf.grad for leaf in leaves)
    if all(grad is None for grad in grads):
        return
    for leaf in leaves:
        leaf.grad = None
    root.grad_fn.pending = grads
    del grads
    _ENGINE.run_backward((root,), (root.detach(),), False, False, (), True, True)


_ENGINE = torch.autograd.Variable._execution_engine
