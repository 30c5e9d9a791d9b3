"""Errors of the graph builder, phrased in the user's terms (module path, op, source line)."""

from __future__ import annotations

import os

__all__ = ["RkgbError", "CaptureError", "UnsupportedOperation"]


class RkgbError(Exception):
    """Base class of the graph builder's errors."""


class CaptureError(RkgbError):
    """torch.export could not capture the model."""


class UnsupportedOperation(RkgbError):
    """An operation of the captured graph cannot be placed in the simplified graph."""


# the file of rockmate.WithLoss (rockmate/with_loss.py, beside this package), as stack traces name it
_WITH_LOSS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rockmate", "with_loss.py")


def describe_fx_node(node) -> str:
    """``"aten.item (in module 'encoder.layers.0.attn', at model.py:42)"`` for an fx node."""
    target = getattr(node.target, "__name__", str(node.target))
    overload = getattr(node.target, "_overloadpacket", None)
    if overload is not None:
        target = f"aten.{overload.__name__}"
    where = []
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path = list(stack.values())[-1][0]
        where.append(f"in module {path!r}" if path else "in the model's own forward")
    trace = node.meta.get("stack_trace")
    if trace:
        lines = [line.strip() for line in trace.strip().splitlines() if line.strip().startswith("File")]
        # the innermost frame of the user's code, not of torch's own modules (nn.Dropout's forward)
        # nor of rockmate.WithLoss's forward, which calls the user's model
        user = [line for line in lines if f"{os.sep}torch{os.sep}" not in line and _WITH_LOSS not in line]
        if lines:
            where.append(f"at {(user or lines)[-1]}")
    return target + (f" ({', '.join(where)})" if where else "")
