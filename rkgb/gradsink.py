"""The gradient sink of a node's leaf, shared by inspection and execution.

Each simplified node is an autograd island whose outputs are leaves (Rockmate, ICML 2023,
section 5). Gradients reaching a leaf are collected by a :class:`GradSink` exactly as eager
PyTorch's ``InputBuffer`` would collect them for the node's backward: same tensors, same memory
layouts, same summation order. The inspection (:mod:`rkgb.inspect`) and the executor
(:mod:`exec.runtime`) use this one class, so that the memory the inspection measures is the
memory the executor uses.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import get_gradient_edge

__all__ = ["GradSink"]


class GradSink:
    """Collects the gradient of a leaf as eager's ``InputBuffer`` would.

    A pre-hook on the leaf's ``AccumulateGrad`` node: the first contribution is stored as is
    (a copy only when it is a slice of a bigger storage), the second is added out of place
    (``old + grad``: a new tensor the sink owns), later ones in place into that tensor; and
    ``AccumulateGrad`` does nothing. The node's backward then receives exactly the gradient
    that eager PyTorch would pass to it, in the same memory layout (a bias gradient's
    reduction rounds identically), sharing storage where eager's share it (an ``add``'s
    backward passes its incoming gradient itself to both its inputs). The copy of a slice
    (cat's backward) keeps the sink from holding the whole bigger gradient after the plan
    forgets it.
    """

    __slots__ = ("leaf", "owned", "node", "calls")

    def __init__(self, leaf: torch.Tensor) -> None:
        self.leaf = leaf
        self.owned = False
        self.calls = 0  # contributions received (for the inspection)
        grad_fn = leaf.view_as(leaf).grad_fn
        self.node = grad_fn.next_functions[0][0] if grad_fn is not None else get_gradient_edge(leaf).node
        self.node.register_prehook(self)

    def __call__(self, grad_outputs):
        grad = grad_outputs[0]
        if grad is not None:
            self.calls += 1
            old = self.leaf.grad
            if old is None:
                if grad.untyped_storage().nbytes() > grad.numel() * grad.element_size():
                    grad = grad.clone()
                self.leaf.grad = grad
                self.owned = False
            elif self.owned:
                old.add_(grad)
            else:
                self.leaf.grad = old + grad
                self.owned = True
        return (None,)
