"""The Python values of the model's modules that a captured graph holds as constants.

torch.export runs the forward in Python and bakes every Python value it reads into the graph: a
temperature ``self.t`` (``x / self.t``), a dropout's ``p``, a flag. A user who changes one after
building (an annealed temperature, a dropout schedule) would train silently on the build's
value. :class:`ModuleAttributes` records the simple attributes of every module (numbers,
strings, booleans, None, tuples and lists of them; not ``training``, which ``eval()`` switches,
nor private ones), so that :class:`rockmate.Rockmate` can tell a change and plan again for the
new values, as ``torch.compile`` recompiles when a guard fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

__all__ = ["ModuleAttributes"]

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


_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


@dataclass
class ModuleAttributes:
    """The simple public attributes of a model's modules: (module path, name) -> value; and
    the modules themselves (``every``: path -> module), to tell hooks registered later."""

    values: dict[tuple[str, str], object]
    modules: dict[str, nn.Module]
    every: dict[str, nn.Module]

    @classmethod
    def of(cls, model: nn.Module) -> "ModuleAttributes":
        values: dict[tuple[str, str], object] = {}
        modules: dict[str, nn.Module] = {}
        every = dict(model.named_modules(remove_duplicate=True))
        for path, module in every.items():
            for name, value in vars(module).items():
                if not name.startswith("_") and name != "training" and _is_simple(value):
                    values[(path, name)] = _frozen(value)
                    modules[path] = module
        return cls(values, modules, every)

    def hooked(self) -> tuple[str, str] | None:
        """A module of the model with forward or backward hooks (registered after the capture,
        which refuses them) and the kind: (path, kind), or None."""
        for path, module in self.every.items():
            for kind in _HOOKS:
                if getattr(module, kind, None):
                    return path, kind[1:].replace("_", " ")
        return None

    def changed(self) -> list[tuple[str, object, object]]:
        """The recorded attributes whose values differ now: (dotted path, recorded, now)."""
        missing = object()
        changes = []
        for (path, name), value in self.values.items():
            now = vars(self.modules[path]).get(name, missing)
            if now is missing or not _same(value, _frozen(now)):
                changes.append((f"{path}.{name}" if path else name, value, None if now is missing else now))
        return changes

    def key(self) -> tuple:
        """The current values, hashable (a plan's key among the plans for other values)."""
        missing = object()
        return tuple(repr(vars(self.modules[path]).get(name, missing)) for path, name in self.values)


def _frozen(value):
    """A copy that later changes of a list in place do not reach."""
    if isinstance(value, list):
        return [_frozen(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_frozen(item) for item in value)
    return value
