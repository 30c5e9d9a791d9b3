"""Rockmate: train PyTorch models that do not fit in memory, exactly.

    from rockmate import Rockmate
    rk = Rockmate(model, sample, "300MiB")   # same outputs and gradients, activations <= budget
    loss = loss_fn(rk(*sample), target)
    loss.backward()

    step = Rockmate(WithLoss(model, loss_fn), (*sample, target), "300MiB")   # the loss planned too
    step(*sample, target).backward()

See :class:`rockmate.api.Rockmate` and ``DESIGN.md``.
"""

from .api import BuildOptions, Rockmate, min_budget
from .budget import budget_fraction, format_bytes, parse_budget
from .errors import CaptureError, InfeasibleBudget, UnsupportedOperation
from .with_loss import WithLoss

__all__ = [
    "Rockmate",
    "min_budget",
    "WithLoss",
    "BuildOptions",
    "InfeasibleBudget",
    "CaptureError",
    "UnsupportedOperation",
    "parse_budget",
    "budget_fraction",
    "format_bytes",
]
