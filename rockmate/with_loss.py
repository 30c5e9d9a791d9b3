"""A model and its loss as one module: a budget that bounds the whole training step.

``Rockmate(model, sample, budget)`` plans the model; a loss computed outside it
(``loss_fn(rk(x), y).backward()``) is the user's own memory, which the plan does not see: an MSE
saves the difference of the outputs and the target, a tensor of the outputs' size, until its
backward (README, Known limits). Planned together, the loss is one more operation of the graph:
its saved tensors and temporaries are counted, recomputed like any other where that pays, and
the budget bounds the step as the allocator sees it, loss included (``DESIGN.md``: "when the
model returns its loss (or model and loss are planned together)"). ::

    from rockmate import Rockmate, WithLoss

    step = Rockmate(WithLoss(model, F.mse_loss), (x, y), "300MiB")
    step(x, y).backward()        # loss_fn(model(x), y), gradients in model.parameters()
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

__all__ = ["WithLoss"]


class WithLoss(nn.Module):
    """``WithLoss(model, loss_fn)(*inputs, target, **kwargs)`` is
    ``loss_fn(model(*inputs, **kwargs), target)``: the target is the last positional argument.

    ``model``'s parameters are this module's (``model.parameters()`` receive the gradients;
    ``model.state_dict()`` is the plain model's checkpoint, this module's has their names under
    ``model.``). ``loss_fn`` is any function of the model's output and the target that returns
    the loss: ``F.cross_entropy``, ``nn.MSELoss()`` (a module: registered as ``loss_fn``), a
    lambda that reshapes first. Build ``Rockmate`` on it with a sample that ends with a
    target, and call it as it was built: ``Rockmate(WithLoss(model, loss_fn), (x, y), budget)``.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"WithLoss(model, loss_fn): model must be an nn.Module, got {type(model).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"WithLoss(model, loss_fn): loss_fn must be callable, got {type(loss_fn).__name__}")
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not args:
            raise TypeError("WithLoss(model, loss_fn)(*inputs, target): the target is the last positional "
                            "argument, and none was given")
        *inputs, target = args
        return self.loss_fn(self.model(*inputs, **kwargs), target)
