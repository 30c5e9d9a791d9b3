"""Tests of rkgb.memory: literal byte counts of allocations, frees, views, autograd."""

from __future__ import annotations

import gc

import numpy
import pytest
import torch

from rkgb.memory import AllocationTracker, measure_allocator_peak, measure_peak, storage_key

F32 = 4  # bytes per float32
F64 = 8
I64 = 8


def test_one_tensor_is_its_bytes_and_goes_back_to_zero():
    with AllocationTracker() as tracker:
        a = torch.randn(1000)
        assert tracker.current_bytes == 4000
        del a
        assert tracker.current_bytes == 0
    assert tracker.peak_bytes == 4000


def test_peak_of_a_short_sequence():
    with AllocationTracker() as tracker:
        a = torch.randn(1000)
        b = a * 2
        del a
        c = b + 1
    assert tracker.peak_bytes == 8000
    assert tracker.current_bytes == 8000
    del b, c
    assert tracker.current_bytes == 0  # frees after the block still count


def test_storages_from_before_the_start_are_not_counted():
    x = torch.randn(1000)
    with AllocationTracker() as tracker:
        x.add_(1)
        y = x.view(10, 100)
        z = x.detach()
        del x
    assert tracker.peak_bytes == tracker.current_bytes == 0
    del y, z
    assert tracker.current_bytes == 0


def test_views_detach_and_inplace_allocate_nothing():
    with AllocationTracker() as tracker:
        a = torch.zeros(1000)
        views = [a[10:], a.view(10, 100).t(), a.unsqueeze(0), a.detach(), a.as_strided((10,), (2,))]
        views += list(torch.split(a, 100))
        a.mul_(2).add_(1)
        torch.relu_(a)
    assert tracker.peak_bytes == tracker.current_bytes == 4000
    del a
    assert tracker.current_bytes == 4000  # the views keep the storage alive
    del views
    assert tracker.current_bytes == 0


def test_factory_ops():
    with AllocationTracker() as tracker:
        tensors = [
            torch.empty(250, dtype=torch.float64),  # 2000
            torch.zeros(10, 10),  # 400
            torch.ones(3, dtype=torch.int64),  # 24
            torch.arange(5),  # int64: 40
            torch.full((2, 2), 7.0),  # 16
            torch.tensor([1.0, 2.0, 3.0]),  # made outside dispatch, seen at lift_fresh: 12
        ]
    assert tracker.current_bytes == 2000 + 400 + 24 + 40 + 16 + 12
    del tensors
    assert tracker.current_bytes == 0


def test_borrowed_numpy_memory_is_not_counted():
    array = numpy.ones(100, dtype=numpy.float32)
    with AllocationTracker() as tracker:
        t = torch.from_numpy(array)
        u = t * 1
    assert tracker.current_bytes == 400
    del t, u


def test_ops_returning_tuples():
    x = torch.randn(1000)
    with AllocationTracker() as tracker:
        values, indices = torch.sort(x)  # 1000 float32 + 1000 int64
        assert tracker.current_bytes == 1000 * F32 + 1000 * I64
        del values
        assert tracker.current_bytes == 1000 * I64
        del indices
        maxima, argmaxima = x.view(10, 100).max(dim=1)  # 10 float32 + 10 int64
    assert tracker.current_bytes == 10 * F32 + 10 * I64
    assert tracker.peak_bytes == 12000
    del maxima, argmaxima


def test_out_variants_count_only_growth():
    x = torch.randn(1000)
    preexisting_full = torch.empty(1000)
    preexisting_empty = torch.empty(0)
    with AllocationTracker() as tracker:
        torch.add(x, 1, out=preexisting_full)  # writes into memory from before: nothing
        assert tracker.current_bytes == 0
        torch.add(x, 1, out=preexisting_empty)  # grows a storage from before: 4000
        assert tracker.current_bytes == 4000
        fresh = torch.empty(0)
        torch.mul(x, 2, out=fresh)  # grows a storage made inside: 4000
        assert tracker.current_bytes == 8000
    del preexisting_empty
    assert tracker.current_bytes == 4000
    del fresh
    assert tracker.current_bytes == 0


def test_resize_of_a_tensor():
    with AllocationTracker() as tracker:
        t = torch.empty(10)
        assert tracker.current_bytes == 40
        t.resize_(1000)
        assert tracker.current_bytes == 4000
        t.resize_(10)  # a CPU storage never shrinks: still 4000 bytes
        assert tracker.current_bytes == t.untyped_storage().nbytes() == 4000
    del t
    assert tracker.current_bytes == 0


def test_frees_inside_autograd_and_gradient_accumulation():
    x = torch.randn(1000, requires_grad=True)
    with AllocationTracker() as tracker:
        e = x.exp()  # 4000, saved by ExpBackward
        s = e.sum()  # 4
        del e
        assert tracker.current_bytes == 4004  # the saved tensor keeps e alive
        s.backward()
        # backward: ones_like(s) 4, grad of exp = grad * result 4000 (kept as x.grad), then
        # the graph frees the saved result and the ones.
        assert tracker.peak_bytes == 4004 + 4 + 4000
        assert tracker.current_bytes == 4 + 4000
        del s
        assert tracker.current_bytes == 4000
        x.grad = None
        assert tracker.current_bytes == 0


def test_reset_peak():
    with AllocationTracker() as tracker:
        a = torch.randn(1000)
        b = a + 1
        del b
        assert tracker.peak_bytes == 8000
        tracker.reset_peak()
        assert tracker.peak_bytes == 4000
        c = a[:500] * 1
    assert tracker.peak_bytes == 6000
    del a, c


def test_nested_trackers_both_see_the_ops():
    with AllocationTracker() as outer:
        a = torch.randn(100)
        with AllocationTracker() as inner:
            b = a * 2
        assert inner.peak_bytes == 400
    assert outer.peak_bytes == 800
    del a, b
    assert outer.current_bytes == inner.current_bytes == 0


def test_events_name_the_ops():
    with AllocationTracker(record_events=True) as tracker:
        a = torch.zeros(10)
        b = a + 1
        del a
    assert [(e.op, e.delta_bytes, e.current_bytes, e.freed) for e in tracker.events] == [
        ("aten.zeros.default", 40, 40, False),
        ("aten.add.Tensor", 40, 80, False),
        ("aten.zeros.default", -40, 40, True),
    ]
    assert tracker.events[1].storage_key == storage_key(b)


def test_reference_cycles_are_freed_by_the_collector():
    class Holder:
        pass

    with AllocationTracker() as tracker:
        holder = Holder()
        holder.self = holder
        holder.tensor = torch.zeros(1000)
        del holder
        assert tracker.current_bytes == 4000
        gc.collect()
        assert tracker.current_bytes == 0


def _tiny_mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.randn(4, 8)


def _train_step(model: torch.nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()


def test_mlp_forward_backward_peak_by_hand():
    """Batch B=4, sizes 8 -> 16 -> 4, float32; parameters exist before, not their grads.

    First step (no .grad yet). Forward: h1 = addmm (B*16*4 = 256), r1 = relu(h1) (256, saved),
    h1 freed, out = addmm (B*4*4 = 64), loss = sum (4), out freed. Backward: ones (4); the
    gradient of out is an expanded view of it. Layer 2: dW2 = mm (16*4*4 = 256, becomes .grad),
    dr1 = mm (256), db2 = sum (16, becomes .grad); relu: dh1 = threshold_backward (256), then
    dr1 and r1 freed; layer 1: dW1 = mm (8*16*4 = 512), db1 = sum (64). Peak right then:
    loss 4 + ones 4 + dW2 256 + db2 16 + dh1 256 + dW1 512 + db1 64 = 1112.

    Second step (the .grad exist, gradients are added in place and the new ones freed): at
    the peak are alive loss 4, ones 4, dh1 256, dW1 512, db1 64 = 840.
    """
    model, x = _tiny_mlp()
    with AllocationTracker() as tracker:
        loss = model(x).sum()
        assert tracker.peak_bytes == 256 + 256
        assert tracker.current_bytes == 256 + 4  # r1 saved, the loss
        loss.backward()
    assert tracker.peak_bytes == 4 + 4 + 256 + 16 + 256 + 512 + 64 == 1112
    del loss
    assert tracker.current_bytes == sum(p.numel() * F32 for p in model.parameters())  # the grads
    assert measure_peak(_train_step, model, x) == 4 + 4 + 256 + 512 + 64 == 840


def test_mlp_peak_agrees_with_the_allocator():
    """The profiler's allocator events are an independent count of the same figure here."""
    model, x = _tiny_mlp()
    assert measure_allocator_peak(_train_step, model, x) == 1112  # first step: no .grad before
    model.zero_grad(set_to_none=True)
    assert measure_peak(_train_step, model, x) == 1112
    # Later steps: the .grad exist.
    assert measure_allocator_peak(_train_step, model, x) == 840
    assert measure_peak(_train_step, model, x) == 840


def test_convolution_workspace_is_a_blind_spot_of_the_tracker():
    """On CPU, a convolution allocates im2col columns inside its kernel: the allocator sees
    them, the tracker does not (here 16384 bytes of output, 49152 at the allocator's peak)."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(8, 8, 3, padding=1, bias=False)
    x = torch.randn(2, 8, 16, 16)
    output_bytes = 2 * 8 * 16 * 16 * F32
    assert measure_peak(conv, x) == output_bytes == 16384
    assert measure_allocator_peak(conv, x) > output_bytes


def test_measure_peak_on_cpu():
    assert measure_peak(lambda a: (a * 2) + 1, torch.zeros(1000)) == 8000
    assert measure_peak(lambda: torch.zeros(10, dtype=torch.float64)) == 10 * F64


def test_storage_key():
    a = torch.zeros(4, 4)
    assert storage_key(a[1:]) == storage_key(a.t()) == storage_key(a.detach()) == storage_key(a)
    assert storage_key(a.clone()) != storage_key(a)
    assert storage_key(a.contiguous()) == storage_key(a)
    assert storage_key(a.t().contiguous()) != storage_key(a)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_figures():
    x = torch.zeros(1 << 18, device="cuda")  # 1 MiB, allocated before
    assert measure_peak(lambda a: a * 2, x) == 1 << 20
    with AllocationTracker() as tracker:
        y = x * 2
        del y
    assert tracker.peak_bytes == 1 << 20 and tracker.current_bytes == 0


def test_sizes_as_the_cuda_caching_allocator_takes_them():
    """On CUDA every block is rounded up to 512 bytes (c10's kMinBlockSize), also for fake
    tensors of the capture; on the CPU the bytes are the storage's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from rkgb.memory import allocated_bytes, storage_bytes, tensor_bytes

    assert [allocated_bytes(n, "cuda") for n in (0, 1, 512, 513, 3 * 1024 * 1024 + 1)] == \
        [0, 512, 512, 1024, 3 * 1024 * 1024 + 512]
    assert [allocated_bytes(n, "cpu") for n in (0, 1, 513)] == [0, 1, 513]
    assert storage_bytes(torch.zeros(3)) == tensor_bytes(torch.zeros(3)) == 12
    with FakeTensorMode():
        fake = torch.empty(3, device="cuda")
        assert storage_bytes(fake) == tensor_bytes(fake) == 512
        assert tensor_bytes(torch.empty(129, device="cuda")) == 1024
    assert tensor_bytes(3.0) == 0
