"""Custom ``torch.autograd.Function``s captured as one operation that applies the Function itself.

torch.export traces a Function's ``forward`` into the graph and drops its ``backward``: the
graph's gradients would be autograd's derivatives of the forward's operations, not the
Function's own (a gradient reversal layer or a straight-through estimator would train with
wrong gradients; BLOOM's tanh-GELU, whose backward is its own formula, with gradients 1 ulp off
in every layer). While Rockmate captures a model (:class:`CustomFunctions`), each Function
applied to tensors that require grad is recorded as one call of the operator
``rockmate::function_call(int function, Tensor[] args) -> Tensor[]`` instead. The operator is
CompositeImplicitAutograd: export keeps it as one node (as it keeps ``aten.linear``), and
running it, in the executor's island or in the inspection, applies the Function itself, so
that autograd records the Function's own backward node: the gradients are eager's, bitwise, and
a recomputation runs the Function's forward again.

Supported: positional arguments that are tensors or constants (numbers, booleans, strings,
None, dtypes), results that are a tensor or a tuple of tensors, none a view of an argument nor
an argument written in place, and tensors kept for the backward through ``save_for_backward``
(the memory model sees those, through the saved-tensor hooks, not tensors kept as ``ctx``
attributes). Others are refused with the Function's name and source line. The operation counts
as random (its operator's ``nondeterministic_seeded`` tag): a recomputation replays the
generator's state, in case the Function's forward draws. Reentrant ``torch.utils.checkpoint`` calls its function directly,
with grad: its backward is that function's own derivative.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass

import torch

__all__ = ["CustomFunctions", "AppliedFunction", "FunctionCallError", "applied_function", "function_identity"]

# Function.apply before any capture patches it (the operator applies the Function through it)
_ORIGINAL_APPLY = torch.autograd.function.Function.__dict__["apply"].__func__

_CONSTANT_TYPES = (bool, int, float, str, type(None), torch.dtype, torch.device)


@dataclass
class AppliedFunction:
    """One ``apply`` call site's Function and its arguments: ``template`` gives each positional
    argument as ``("tensor", index into the operator's tensors)`` or ``("constant", value)``;
    ``where``: its source line; ``single``: the Function returns one tensor, not a tuple (known
    once the operator has run, on the traced values)."""

    function: type
    template: tuple
    where: str
    single: bool | None = None

    @property
    def name(self) -> str:
        return f"{self.function.__module__}.{self.function.__qualname__}"


_APPLIED: list[AppliedFunction] = []


def applied_function(index: int) -> AppliedFunction:
    """The call site that ``rockmate::function_call(index, ...)`` applies."""
    return _APPLIED[index]


def _index_of(function: type, template: tuple, where: str) -> int:
    """The index of ``function`` applied with the constants of ``template``: one per pair in a
    process, so that the layers that apply the same Function alike have equal graphs (one
    class of identical blocks)."""
    for index, applied in enumerate(_APPLIED):
        if applied.function is function and applied.template == template:
            return index
    _APPLIED.append(AppliedFunction(function, template, where))
    return len(_APPLIED) - 1


def function_identity(index: int) -> str:
    """What ``rockmate::function_call(index, ...)`` stands for, the same in every process (the
    index is not): the Function's name, its constant arguments and a digest of its forward's and
    backward's code, for the keys of the disk caches."""
    applied = _APPLIED[index]
    code = b"".join(getattr(applied.function, name).__code__.co_code for name in ("forward", "backward")
                    if hasattr(getattr(applied.function, name), "__code__"))
    return f"{applied.name}{applied.template!r}:{hashlib.sha256(code).hexdigest()[:16]}"


class FunctionCallError(RuntimeError):
    """A Function whose call the operator cannot stand for (raised inside export)."""


# how many Function applies are running through the capture's apply or the operator (a
# Function's forward run otherwise, while capturing, had its apply bound before: see
# CustomFunctions._watch_forwards)
_APPLYING = [0]


def _function_call(function: int, args: list[torch.Tensor]) -> list[torch.Tensor]:
    applied = _APPLIED[function]
    arguments = [args[value] if kind == "tensor" else value for kind, value in applied.template]
    versions = [arg._version for arg in args]
    _APPLYING[0] += 1
    try:
        result = _ORIGINAL_APPLY(applied.function, *arguments)
    finally:
        _APPLYING[0] -= 1
    applied.single = isinstance(result, torch.Tensor)
    results = [result] if applied.single else result
    if not isinstance(results, (tuple, list)) or not all(isinstance(r, torch.Tensor) for r in results):
        raise FunctionCallError(f"{applied.name}{applied.where} returns {type(result).__name__}, not a tensor "
                                "or a tuple of tensors: Rockmate cannot apply it as one operation")
    inputs = {id(arg) for arg in args}
    if any(r._base is not None or id(r) in inputs for r in results) or \
            any(arg._version != version for arg, version in zip(args, versions)):
        raise FunctionCallError(f"{applied.name}{applied.where} returns a view of an argument or writes into "
                                "one: Rockmate cannot apply it as one operation")
    kept = _tensors_on_ctx(results)
    if kept:
        raise FunctionCallError(f"{applied.name}{applied.where} keeps tensors on ctx ({', '.join(kept)}) rather "
                                "than through ctx.save_for_backward: the memory model cannot see (nor free) them; "
                                "save them with ctx.save_for_backward")
    return list(results)


def _tensors_on_ctx(results) -> list[str]:
    """The attributes of the Function's ctx (its backward node) that hold tensors."""
    node = next((r.grad_fn for r in results if r.grad_fn is not None), None)
    if node is None or not hasattr(node, "__dict__"):
        return []
    held = []
    for name, value in vars(node).items():
        values = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(v, torch.Tensor) for v in values):
            held.append(name)
    return held


_LIBRARY = torch.library.Library("rockmate", "FRAGMENT")
# random: a Function's forward may draw, so that a recomputation replays the generator's state
# (rkgb.simplify reads the tag, as a dropout's)
_LIBRARY.define("function_call(int function, Tensor[] args) -> Tensor[]", tags=(torch.Tag.nondeterministic_seeded,))
_LIBRARY.impl("function_call", _function_call, "CompositeImplicitAutograd")


def _checkpoint_function() -> type:
    from torch.utils.checkpoint import CheckpointFunction

    return CheckpointFunction


# reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``,
# transformers' gradient checkpointing): its forward runs the function without grad and its
# backward runs it again with grad and the same random state, so its gradients are the
# function's own derivative; while capturing, the function is called directly, with grad (its
# forward's no-grad region would otherwise be detached: rkgb.capture.detach_no_grad_results).
# Where no tensor argument requires grad, eager's results require none either (PyTorch warns
# that the gradients will be None: the parameters inside get none): applied as it is, no-grad
_CHECKPOINT = _checkpoint_function()


# the module of the Functions that torch.library makes for custom operators' autograd
# (``register_autograd``): export keeps the operator itself, whose autograd kernel runs again
# when the plan calls it
_CUSTOM_OP_AUTOGRAD = "torch._library.autograd"


def _custom_operator(cls, args: tuple, kwargs: dict):
    """A custom operator's autograd Function (torch.library), applied as it is: export keeps the
    operator as one node. Refused where its context keeps tensors outside ``save_for_backward``
    (transformers 5's MoE ``grouped_mm_fallback`` keeps its offsets so): the plan may let go of
    them before the backward reads them (the experts' gradients were zeros)."""
    result = _ORIGINAL_APPLY(cls, *args, **kwargs)
    kept = _tensors_on_ctx([result] if isinstance(result, torch.Tensor) else result)
    if kept:
        name = cls.__name__.removeprefix("GeneratedBackwardFor_")
        hint = (" transformers' mixture-of-experts layers (Mixtral, Qwen2-MoE...) run without it with "
                "experts_implementation=\"batched_mm\" in their config.") if "grouped_mm" in name else ""
        raise FunctionCallError(
            f"the custom operator {name}{_caller_of_apply()} keeps tensors on its autograd context "
            f"({', '.join(kept)}) rather than through ctx.save_for_backward: the memory model cannot see "
            f"(nor keep) them; save them with ctx.save_for_backward in its setup_context.{hint}")
    return result


class CustomFunctions:
    """While the model is captured (a context manager), each custom Function applied with grad
    (grad mode on, a tensor argument that requires it) becomes a ``rockmate::function_call``;
    ``refused`` lists those it cannot stand for (arguments other than tensors and constants, a
    custom operator keeping tensors on its context, an apply bound before the capture out of its
    reach), which :func:`rkgb.capture.capture` reports. ``model``: its modules' attributes that
    hold a Function's apply get the capture's while it runs."""

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        self.refused: list[str] = []
        self.model = model
        self._rebound: list[tuple[dict, str, object]] = []
        self._watched: list[tuple[type, object]] = []

    def _rebind_stored_applies(self) -> None:
        """``self.fn = MyFunction.apply`` in a module's ``__init__`` keeps the apply bound before
        the capture patched it, which would trace the Function's forward without its backward
        (silently wrong gradients): while capturing, such attributes hold the patched apply."""
        for module in self.model.modules() if self.model is not None else ():
            for name, value in list(vars(module).items()):
                owner = getattr(value, "__self__", None)
                if getattr(value, "__func__", None) is _ORIGINAL_APPLY and isinstance(owner, type) \
                        and issubclass(owner, torch.autograd.Function):
                    self._rebound.append((vars(module), name, value))
                    vars(module)[name] = owner.apply

    def _watch_forwards(self) -> None:
        """Wrap the forward of every Function class defined outside torch, to see one run
        without this capture's apply: an apply bound before the capture and kept elsewhere than
        a module attribute (``reverse = GradReverse.apply`` at a module's top level), whose
        Function export would trace without its backward (silently wrong gradients): refused."""
        classes, stack = [], list(torch.autograd.Function.__subclasses__())
        while stack:
            cls = stack.pop()
            stack.extend(cls.__subclasses__())
            if cls.__module__.split(".")[0] != "torch" and isinstance(vars(cls).get("forward"), staticmethod):
                classes.append(cls)
        refused = self.refused
        for cls in classes:
            original = vars(cls)["forward"]

            def forward(*args, _forward=original.__func__, _cls=cls, **kwargs):
                if not _APPLYING[0] and any(isinstance(value, torch.Tensor) and value.requires_grad
                                            for value in (*args, *kwargs.values())):
                    where = _caller_of_apply()
                    note = (f"{_cls.__module__}.{_cls.__qualname__}{where} (its apply was bound before "
                            f"Rockmate captured the model, e.g. `name = {_cls.__name__}.apply` at a "
                            f"module's top level: call {_cls.__name__}.apply(...) where it is used)")
                    if note not in refused:
                        refused.append(note)
                return _forward(*args, **kwargs)

            self._watched.append((cls, original))
            cls.forward = staticmethod(forward)

    def __enter__(self):
        self._patched = torch.autograd.function.Function.__dict__["apply"]
        refused = self.refused

        def apply(cls, *args, **kwargs):
            _APPLYING[0] += 1
            try:
                return applied(cls, *args, **kwargs)
            finally:
                _APPLYING[0] -= 1

        def applied(cls, *args, **kwargs):
            if cls is _CHECKPOINT and torch.is_grad_enabled() and not kwargs and any(
                    isinstance(value, torch.Tensor) and value.requires_grad for value in args[2:]):
                function, _, *inputs = args  # (run_function, preserve_rng_state, *args)
                return function(*inputs)
            if not torch.is_grad_enabled() or not any(
                    isinstance(value, torch.Tensor) and value.requires_grad for value in (*args, *kwargs.values())):
                return _ORIGINAL_APPLY(cls, *args, **kwargs)
            if cls.__module__ == _CUSTOM_OP_AUTOGRAD:
                return _custom_operator(cls, args, kwargs)
            where = _caller_of_apply()
            template, tensors = [], []
            for value in args:
                if isinstance(value, torch.Tensor):
                    template.append(("tensor", len(tensors)))
                    tensors.append(value)
                elif isinstance(value, _CONSTANT_TYPES):
                    template.append(("constant", value))
                else:
                    template = None
                    break
            if template is None or kwargs:
                refused.append(f"{cls.__module__}.{cls.__qualname__}{where} (an argument neither a tensor nor a "
                               "constant)")
                return _ORIGINAL_APPLY(cls, *args, **kwargs)
            index = _index_of(cls, tuple(template), where)
            results = torch.ops.rockmate.function_call(index, tensors)
            return results[0] if _APPLIED[index].single else tuple(results)

        torch.autograd.function.Function.apply = classmethod(apply)
        self._rebind_stored_applies()
        self._watch_forwards()
        return self

    def __exit__(self, *exc) -> None:
        torch.autograd.function.Function.apply = self._patched
        for cls, original in self._watched:
            cls.forward = original
        self._watched.clear()
        for attributes, name, value in self._rebound:
            attributes[name] = value
        self._rebound.clear()


def _caller_of_apply() -> str:
    """`` (at file:line)`` of the innermost frame outside torch that called ``Function.apply``."""
    frame = sys._getframe(2)
    while frame is not None and (f"{os.sep}torch{os.sep}" in frame.f_code.co_filename
                                 or os.path.dirname(frame.f_code.co_filename) == os.path.dirname(__file__)):
        frame = frame.f_back  # torch's frames and this package's (the capture's TorchFunctionMode)
    return "" if frame is None else f" (at {frame.f_code.co_filename}:{frame.f_lineno})"
