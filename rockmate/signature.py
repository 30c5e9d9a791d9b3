"""Calling a model as its users do: positional and keyword inputs, any output structure.

The pipeline works on a module of positional tensors returning a tuple of tensors. A model
called ``model(input_ids=..., attention_mask=..., labels=...)`` that returns a dict or a
``ModelOutput`` is adapted by :class:`FlatModel`: its inputs are the tensors of the
sample's ``(args, kwargs)`` flattened with ``torch.utils._pytree`` (the same flattening as
``torch.export``), the other leaves (ints, floats, strings, None, booleans) fixed at their
sample values, and its outputs the tensors of the model's output flattened the same way.
:class:`CallSignature` checks each call against the sample (a different structure or a
different non-tensor value is an error, never a silent re-use of the sample's value) and
rebuilds the output structure, so that ``out["logits"]`` or ``out.loss`` work as with the
model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["CallSignature", "FlatModel", "split_sample"]


def split_sample(sample: Any = None, args: Any = None, kwargs: dict | None = None) -> tuple[tuple, dict]:
    """``(args, kwargs)`` from the ways a sample can be given: a tensor, a tuple or list of
    positional inputs, a dict of keyword inputs, or ``args=``/``kwargs=`` for both."""
    if sample is not None and (args is not None or kwargs is not None):
        raise TypeError("give the sample either as `sample` or as `args=`/`kwargs=`, not both")
    if sample is None and args is None and kwargs is None:
        raise TypeError("Rockmate needs a sample input: Rockmate(model, sample, budget) or "
                        "Rockmate(model, args=(...), kwargs={...}, budget=...)")
    if sample is not None:
        if isinstance(sample, dict):
            return (), dict(sample)
        if isinstance(sample, (tuple, list)):
            return tuple(sample), {}
        return (sample,), {}
    if args is not None and not isinstance(args, (tuple, list)):
        args = (args,)
    return tuple(args or ()), dict(kwargs or {})


def _describe(path) -> str:
    """``positional argument 0``, ``keyword argument 'mask'``, with any nesting after it."""
    if len(path) < 2:
        return "the input"
    head, key, rest = path[0], path[1], "".join(str(k) for k in path[2:])
    if getattr(head, "idx", 0) == 0:
        return f"positional argument {key.idx}{rest}"
    return f"keyword argument {key.key!r}{rest}"


def _shape_of_call(args: tuple, kwargs: dict) -> str:
    return f"{len(args)} positional argument(s) and the keywords {sorted(kwargs)}"


def loss_entry_index(paths: list[tuple], leaves: list) -> int | None:
    """The index of the model's own loss among the output's leaves (at their pytree ``paths``):
    the entry ``loss`` of the returned dict or ``ModelOutput`` (transformers' models called with
    labels), a scalar of a floating dtype; None where there is none."""
    for index, (path, leaf) in enumerate(zip(paths, leaves)):
        if len(path) == 1 and isinstance(leaf, torch.Tensor) and leaf.dim() == 0 and leaf.is_floating_point() \
                and getattr(path[0], "key", getattr(path[0], "name", None)) == "loss":
            return index
    return None


@dataclass
class CallSignature:
    """The structure of the sample's call and of the model's output.

    ``in_spec``: the pytree spec of ``(args, kwargs)``; ``leaves``: the sample's leaves, with
    ``tensor_positions`` the indices of the tensors among them (the compiled module's inputs)
    and the others constants that each call must repeat; ``paths``: each leaf's key path, for
    messages. ``out_spec``: the spec of the model's output, set while the model is captured.
    """

    in_spec: pytree.TreeSpec
    leaves: list[Any]
    paths: list[str]
    tensor_positions: list[int]
    out_spec: pytree.TreeSpec | None = None
    # the index among the output's leaves of the model's own loss (``loss`` of a dict or a
    # ``ModelOutput``: a scalar of a floating dtype), set with ``out_spec``; None: none returned
    loss_index: int | None = None

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> "CallSignature":
        flat, spec = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
        leaves = [leaf for _, leaf in flat]
        paths = [_describe(path) for path, _ in flat]
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        return cls(spec, leaves, paths, positions)

    @property
    def is_plain(self) -> bool:
        """True when the model is already called with positional tensors only."""
        return len(self.tensor_positions) == len(self.leaves) and \
            self.in_spec == pytree.tree_flatten((tuple(self.leaves), {}))[1]

    def tensors(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The tensors of a call, in the sample's order; raises ``TypeError`` where the call's
        structure or a non-tensor argument differs from the sample's."""
        flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if spec != self.in_spec:
            sample_args, sample_kwargs = self.sample_call()
            raise TypeError(
                f"Rockmate was built for calls with {_shape_of_call(sample_args, sample_kwargs)} "
                f"(as the sample) and received {_shape_of_call(args, kwargs)}, or a different nesting; "
                f"build Rockmate again with a sample of this call")
        tensors = []
        for index, (leaf, expected) in enumerate(zip(flat, self.leaves)):
            if isinstance(expected, torch.Tensor):
                if not isinstance(leaf, torch.Tensor):
                    raise TypeError(f"{self.paths[index]}: a tensor in the sample, {type(leaf).__name__} here")
                tensors.append(leaf)
            elif isinstance(leaf, torch.Tensor) or leaf != expected:
                raise ValueError(
                    f"{self.paths[index]} is {leaf!r} here and was {expected!r} in the sample: the plan "
                    f"is specific to the sample's non-tensor arguments; build Rockmate again with this value")
        return tensors

    def sample_call(self) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of the sample."""
        return pytree.tree_unflatten(list(self.leaves), self.in_spec)

    def call_with(self, tensors) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of the model from the flat tensors (constants at sample values)."""
        leaves = list(self.leaves)
        for position, tensor in zip(self.tensor_positions, tensors):
            leaves[position] = tensor
        return pytree.tree_unflatten(leaves, self.in_spec)

    def flatten_output(self, output) -> tuple[torch.Tensor, ...]:
        flat, spec = pytree.tree_flatten_with_path(output)
        leaves = [leaf for _, leaf in flat]
        if any(not isinstance(leaf, torch.Tensor) for leaf in leaves):
            kinds = sorted({type(leaf).__name__ for leaf in leaves if not isinstance(leaf, torch.Tensor)})
            hint = ""
            if any(kind.endswith("Cache") for kind in kinds):  # transformers' key/value caches
                hint = ("; a key/value cache holds every layer's keys and values and training does not "
                        "use it: call the model with use_cache=False (in the sample and in the calls)")
            raise TypeError(f"the model returns non-tensor values ({', '.join(kinds)}) among its outputs; "
                            f"Rockmate supports tensors in any nesting of tuples, lists, dicts and ModelOutputs"
                            f"{hint}")
        self.out_spec = spec
        self.loss_index = loss_entry_index([path for path, _ in flat], leaves)
        return tuple(leaves)

    def unflatten_output(self, outputs):
        return pytree.tree_unflatten(list(outputs), self.out_spec)


class FlatModel(nn.Module):
    """``model`` as a module of the sample's tensors returning a flat tuple of tensors (see the
    module docstring). The model is the submodule ``model``: its parameters and buffers are
    the ones trained."""

    def __init__(self, model: nn.Module, signature: CallSignature) -> None:
        super().__init__()
        self.model = model
        self.signature = signature

    @property
    def wrapped(self) -> nn.Module:
        """The user's model (what error messages name)."""
        return self.model

    def forward(self, *tensors: torch.Tensor):
        args, kwargs = self.signature.call_with(tensors)
        return self.signature.flatten_output(self.model(*args, **kwargs))
