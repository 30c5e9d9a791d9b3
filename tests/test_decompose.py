"""rkgb.decompose: the captured graphs are those of ``run_decompositions``'s retrace, node for node.

Each model is captured twice, lowered in place (:mod:`rkgb.decompose`) and by the retrace
(``rkgb.capture.LOWER_FUNCTIONAL_GRAPHS = False``); the two graphs must have the same nodes in the
same order: operations, arguments, names, fake values (shapes, strides, dtypes, requires_grad and
which storages alias), stack traces, module paths, the functions that made them and their
provenance (``from_node``), and the same inputs, parameters, buffers and outputs. The one
difference by design: an operation of a region run without grad has the region's own line as
its stack trace, where the retrace's is a line of its generated code.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from torch import nn
from torch.utils import _pytree as pytree

import rkgb.capture as capture_module
from random_models import make, programs
from rkgb.capture import _origins, capture, storage_identity
from rkgb.errors import CaptureError, UnsupportedOperation
from zoo import ZOO


def _canonical(captured) -> tuple:
    index: dict[torch.fx.Node, int] = {}
    storages: dict[object, int] = {}
    rows = []

    def described(value):
        if isinstance(value, torch.Tensor):
            storage = storage_identity(value)
            group = storages.setdefault(storage, len(storages)) if storage is not None else None
            return (tuple(value.shape), tuple(value.stride()), value.dtype, value.device, value.requires_grad,
                    group, value.storage_offset())
        return repr(value)

    for position, node in enumerate(captured.graph.nodes):
        index[node] = position
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: ("node", index[n]))
        trace = node.meta.get("stack_trace")
        region = "<eval_with_key>" in str(trace) or any(o.startswith("wrap_with_set_grad_enabled")
                                                         for o in _origins(node))
        rows.append((node.op, str(node.target), node.name, repr(args), repr(kwargs),
                     repr(pytree.tree_map(described, node.meta.get("val"))), "region" if region else trace,
                     repr(node.meta.get("nn_module_stack")), repr(node.meta.get("torch_fn")),
                     tuple(sorted(_origins(node)))))
    return (rows, captured.parameters, captured.buffers, list(captured.constants), captured.inputs,
            captured.user_outputs, captured.buffer_mutations, captured.constant_paths)


# (torch's fake tensors cache an operation's output layout: the first fake ``aten.copy`` of a
# view in a process gives its result the view's storage offset, as the real kernel does, a
# cached one offset 0 (RWKV's and T5's writes into a ``select``). Whichever capture runs first
# gets the first call's: a difference of order, not of the lowering; the graphs compared here
# come out the same either way, and RWKV and T5 do too after a first capture of either kind.)
def _both(model, sample):
    lowered = capture(model, sample)
    capture_module.LOWER_FUNCTIONAL_GRAPHS = False
    try:
        retraced = capture(model, sample)
    finally:
        capture_module.LOWER_FUNCTIONAL_GRAPHS = True
    return lowered, retraced


def _assert_same(lowered, retraced) -> None:
    ours, theirs = _canonical(lowered), _canonical(retraced)
    for position, (mine, their) in enumerate(zip(ours[0], theirs[0])):
        if "region" in (mine[6], their[6]):  # (a detach of a region's result copies its trace)
            mine, their = mine[:6] + mine[7:], their[:6] + their[7:]
        elif mine[0] == "call_function" and not (mine[6] or mine[9] or their[6] or their[9]):
            # (a view that functionalization makes again for an output comes from no operation:
            # the retrace leaves on it the module stack and torch_fn it was at, ``OrderedDict()``
            # and its last operation's; here it has none)
            mine, their = mine[:7] + mine[9:], their[:7] + their[9:]
        assert mine == their, f"node {position} differs"
    assert len(ours[0]) == len(theirs[0])
    assert ours[1:] == theirs[1:]


class _Everything(nn.Module):
    """The operations the lowering rewrites, each way they go: ``reshape`` as a view and as a copy,
    ``contiguous`` and ``to`` that are no-ops or copies, ``flatten``, dropout drawn and of
    probability 0, a region without grad, a constant made by ``torch.tensor``, a tied parameter,
    a buffer and a constant of one module with a buffer of its submodule (their order), a view
    of a parameter (its value requires no grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Module()
        self.inner.register_buffer("scale", torch.full((8,), 0.5))
        self.register_buffer("offset", torch.zeros(8))
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.second.weight = self.first.weight
        self.pad = torch.ones(8)  # a plain tensor attribute: a constant

    def forward(self, x):
        y = self.first(x).reshape(4, 2, 8)  # a view
        z = y.transpose(0, 1).reshape(8, 8)  # a copy
        with torch.no_grad():
            w = (self.inner.scale * 2).exp()
        z = z.contiguous() + z.transpose(0, 1).contiguous()
        z = F.dropout(z, 0.2, training=True) + F.dropout(z, 0.0, training=True)
        z = z.to(torch.float32) + z.to(torch.float64).to(torch.float32)
        mask = torch.tensor(-1.0)
        z = torch.where(z > 0, z, mask) * w + self.offset + self.pad + self.first.weight.t()[0]
        return self.second(z).flatten(), z.view(2, 4, 8).flatten(1)


def test_a_module_of_every_rewritten_operation_is_lowered_as_the_retrace_lowers_it():
    torch.manual_seed(0)
    model = _Everything().train()
    lowered, retraced = _both(model, (torch.randn(8, 8),))
    assert lowered.retraced is None, lowered.retraced
    assert retraced.retraced == "lowering off"
    _assert_same(lowered, retraced)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_the_zoo_is_lowered_as_the_retrace_lowers_it(name):
    model, sample = ZOO[name].build()
    lowered, retraced = _both(model.train(), sample)
    _assert_same(lowered, retraced)
    if name in ("resnet", "unet"):  # (BatchNorm's running statistics, buffers written in place)
        assert "in place" in lowered.retraced, lowered.retraced
    else:
        assert lowered.retraced is None, lowered.retraced


def test_in_place_writes_into_the_graphs_own_tensors_are_functionalized_as_the_retrace_does():
    class Writes(nn.Module):
        def forward(self, x):
            y = x * 2
            y.add_(1)
            row = y[0]  # (a view of a tensor written after: made again from its new value)
            y[1:].mul_(3)
            z = torch.zeros_like(y)
            z.copy_(y)
            z.relu_()
            with torch.no_grad():
                scale = (x * 0).add_(2)
            return y + row.sum() + z * scale

    lowered, retraced = _both(Writes(), (torch.randn(3, 4, requires_grad=True),))
    assert lowered.retraced is None, lowered.retraced
    _assert_same(lowered, retraced)


def test_a_returned_view_of_a_written_tensor_is_made_again_from_no_operation_as_in_the_retrace():
    """``out.mul_(x); v = out.view(...)`` returned, ``out`` read after: functionalization makes
    the view again for the output, from no operation (no provenance, no stack trace), which is
    how ``rkgb.capture.place_regenerated_views`` finds it and moves it back to its place."""
    from test_fuzz import written

    model, x = make(written([("inplace_mul", [0, 0]), ("identity_view", [1]), ("mean_scale", [1])], [2, 3],
                            batch=3, seq=6, dim=8, input_requires_grad=True))
    lowered, retraced = _both(model, (x,))
    assert lowered.retraced is None, lowered.retraced
    _assert_same(lowered, retraced)
    view = next(node for node in lowered.graph.nodes if node.name == "view_1")
    assert view.next.name == "mean"  # (moved back before the product's reads)


class _WritesBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(3))

    def forward(self, x):
        self.steps[0:1].add_(1)  # (through a view)
        return x * self.steps


class _Statistics(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(3))
        self.register_buffer("var", torch.ones(3))

    def forward(self, x):  # (no counter written before, as BatchNorm's: the kernel's own writes)
        return nn.functional.batch_norm(x, self.mean, self.var, training=True)


@pytest.mark.parametrize("model, reason", [
    (_WritesBuffer(), "b_steps, an input, is written in place by add_"),
    (nn.BatchNorm1d(3), "b_num_batches_tracked, an input, is written in place by add_"),
    (_Statistics(), "batch_norm writes its running statistics (buffers) in place"),
])
def test_a_write_into_a_buffer_leaves_the_graph_to_the_retrace(model, reason):
    """(The retrace makes a written buffer's new value an output; a written input Rockmate refuses.)"""
    lowered, retraced = _both(model.train(), (torch.randn(4, 3),))
    assert lowered.retraced == reason, lowered.retraced
    _assert_same(lowered, retraced)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "bart"])
def test_transformers_models_are_lowered_as_the_retrace_lowers_them(name):
    pytest.importorskip("transformers")
    import test_transformers

    from rockmate.api import _flat_call

    model, call = test_transformers.MODELS[name]()
    _, flat, sample = _flat_call(model.train(), call, None, None)
    lowered, retraced = _both(flat, sample)
    assert lowered.retraced is None, lowered.retraced  # (llama: a region without grad; bart: writes in place)
    _assert_same(lowered, retraced)


def test_a_symbolic_value_leaves_the_graph_to_the_retrace_untouched():
    class Item(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            return h * h.sum().item()

    # (found before any operation is called again: a new unbacked symbol would be pending in
    # the shape environment, and the retrace after would fail on it)
    captured = capture(Item(), (torch.randn(2, 4),))
    assert captured.retraced == "item is a symbolic value"
    assert any(node.target is torch.ops.aten.item.default for node in captured.graph.nodes)


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(program=programs())
def test_random_programs_are_lowered_as_the_retrace_lowers_them(program):
    """The fuzzer's programs (tests/random_models.py: views, in-place writes, dropout, batch
    norms, custom Functions...), captured both ways: the same graphs, where lowered in place and
    where retraced."""
    model, x = make(program)
    try:
        lowered, retraced = _both(model, (x,))
    except (CaptureError, UnsupportedOperation):
        return  # (refused both ways alike: the retrace is what refuses)
    _assert_same(lowered, retraced)
