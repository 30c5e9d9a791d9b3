"""What a captured graph holds of the model beyond its tensors' values, to tell when it is stale.

torch.export runs the forward in Python and bakes into the graph every Python value it reads (a
temperature ``self.t`` in ``x / self.t``, a dropout's ``p``, a flag), the modules it calls (a
layer replaced by another, ``model.act = nn.GELU()``) and the shapes of the parameters and
buffers (``resize_token_embeddings``). A user who changes one after building would train
silently on the build's graph (or past its memory plan). :class:`ModelState` records them: the
simple attributes of every module (numbers, strings, booleans, None, tuples and lists of them;
not private ones; ``training`` of the submodules, a BatchNorm frozen by ``.eval()``, but not of
the model itself, whose ``eval()`` runs the plain model), the modules by path, and the shapes;
:class:`rockmate.Rockmate` plans again for a changed model, as ``torch.compile`` recompiles
when a guard fails. It also tells module hooks registered after the build, which
the compiled module would never call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from rkgb.capture import MODULE_HOOKS, module_hooks

__all__ = ["ModelState"]

_SIMPLE = (int, float, bool, str, type(None))


def _is_simple(value, depth: int = 0) -> bool:
    if isinstance(value, _SIMPLE):
        return True
    if isinstance(value, (tuple, list)) and depth < 2 and len(value) <= 16:
        return all(_is_simple(item, depth + 1) for item in value)
    return False


def _same(a, b) -> bool:
    """Equal values of the same type (two NaNs are the same value)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@dataclass
class ModelState:
    """A model as its captured graph saw it: ``values``, (module path, name) -> the simple
    attributes' values; ``modules``, path -> module (every module, by identity); ``shapes``,
    the parameters' and buffers' paths -> shapes."""

    model: nn.Module
    values: dict[tuple[str, str], object]
    modules: dict[str, nn.Module]
    shapes: dict[str, tuple[int, ...]]

    @classmethod
    def of(cls, model: nn.Module, captured_in_train_mode: bool = False) -> "ModelState":
        """``captured_in_train_mode``: the graph was captured after ``model.train()`` (a model
        built in eval mode): every submodule's ``training`` recorded True."""
        values: dict[tuple[str, str], object] = {}
        modules = dict(model.named_modules(remove_duplicate=True))
        for path, module in modules.items():
            for name, value in vars(module).items():
                if not name.startswith("_") and (name != "training" or path) and _is_simple(value):
                    values[(path, name)] = True if name == "training" and captured_in_train_mode else _frozen(value)
        return cls(model, values, modules, _shapes(model))

    def hooked(self) -> tuple[str, str] | None:
        """A module of the model with forward or backward hooks (registered after the capture,
        which refuses them) and the kind: (path, kind), or None."""
        for path, attributes in self._module_attributes:
            for kind in MODULE_HOOKS:
                # (the dicts read directly: most are empty, and getattr on every module's four
                # kinds at each call cost ~20 us on a small model)
                if attributes.get(kind) and module_hooks(self.modules[path], kind):
                    return path, kind[1:].replace("_", " ")
        return None

    def __post_init__(self) -> None:
        # what :meth:`_as_built` compares at each call (the identities of what the build saw)
        self._child_counts = [(module._modules, len(module._modules)) for module in self.modules.values()]
        self._children = [(module._modules, name, child) for module in self.modules.values()
                          for name, child in module._modules.items()]
        self._attributes = [(vars(self.modules[path]), name, value) for (path, name), value in self.values.items()]
        # each module's attributes, where its hooks' dicts are (read at each call by hooked())
        self._module_attributes = [(path, vars(module)) for path, module in self.modules.items()]
        self._tensors = [(tensors, name, tensor, tuple(tensor.shape))
                         for module in self.modules.values()
                         for tensors in (module._parameters, module._buffers)
                         for name, tensor in tensors.items() if tensor is not None]

    def _as_built(self) -> bool:
        """Every module, attribute and tensor the one the build saw, of the same value and shape
        (a sufficient test, in one pass without walking the module tree: the compiled module's
        guard at each call; :meth:`changed` tells what differs where it fails)."""
        # (one flat loop over every module's children: a generator per module cost ~60 us a call
        # on a 12-layer model, this ~20 us)
        for children, count in self._child_counts:
            if len(children) != count:
                return False
        for children, name, child in self._children:
            if children.get(name) is not child:
                return False
        missing = object()
        for attributes, name, value in self._attributes:
            now = attributes.get(name, missing)
            if now is not value and not _same(value, _frozen(now)):
                return False
        for tensors, name, tensor, shape in self._tensors:
            if tensors.get(name) is not tensor or tensor.shape != shape:
                return False
        return True

    def changed(self) -> list[tuple[str, object, object]]:
        """What differs now from the build: (what, then, now) for each attribute with another
        value, each module replaced, added or removed, each parameter or buffer of another
        shape."""
        if self._as_built():
            return []
        changes: list[tuple[str, object, object]] = []
        now_modules = dict(self.model.named_modules(remove_duplicate=True))
        for path in self.modules.keys() | now_modules.keys():
            then, now = self.modules.get(path), now_modules.get(path)
            if then is not now:
                changes.append((f"module {path!r}", _kind(then), _kind(now)))
        if changes:
            return changes  # (attributes of modules that are not there any more: not compared)
        missing = object()
        for (path, name), value in self.values.items():
            now = vars(self.modules[path]).get(name, missing)
            if now is missing or not _same(value, _frozen(now)):
                changes.append((f"{path}.{name}" if path else name, value, None if now is missing else now))
        shapes = _shapes(self.model)
        for path in self.shapes.keys() | shapes.keys():
            if self.shapes.get(path) != shapes.get(path):
                changes.append((f"the shape of {path!r}", _listed(self.shapes.get(path)), _listed(shapes.get(path))))
        return changes

    def key(self) -> tuple:
        """The model as it is now, hashable: a plan's key among the plans for other states."""
        modules = tuple((path, id(module)) for path, module in self.model.named_modules(remove_duplicate=True))
        values = tuple(repr(vars(self.modules[path]).get(name)) for path, name in self.values)
        return modules, values, tuple(sorted(_shapes(self.model).items()))


def _shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    found = {path: tuple(p.shape) for path, p in model.named_parameters(remove_duplicate=False)}
    found.update({path: tuple(b.shape) for path, b in model.named_buffers(remove_duplicate=False)})
    return found


def _kind(module) -> str:
    return "nothing" if module is None else type(module).__name__


def _listed(shape):
    return None if shape is None else list(shape)


def _frozen(value):
    """A copy that later changes of a list in place do not reach."""
    if isinstance(value, list):
        return [_frozen(item) for item in value]
    if isinstance(value, tuple):
        items = tuple(_frozen(item) for item in value)
        # a tuple of values that cannot change is kept itself: the check at each call then finds
        # the attribute identical (a LayerNorm's normalized_shape: 25 of a 12-layer GPT's)
        return value if all(a is b for a, b in zip(items, value)) else items
    return value
