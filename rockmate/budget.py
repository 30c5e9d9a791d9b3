"""Read a memory budget given as bytes, as a string such as ``"300MiB"`` or ``"1.5GB"``, or as a
fraction of the peak without recomputation (``0.5`` or ``"50%"``, as PyTorch's
``activation_memory_budget``)."""

from __future__ import annotations

import math

import re

__all__ = ["parse_budget", "budget_fraction", "format_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_ACCEPTED = ("an integer number of bytes, a string like '300MiB', '1.5GB', '2GiB', '512kB' or '1e9', or a "
             "fraction of the peak without recomputation (0.5 or '50%')")
_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")


def budget_fraction(budget) -> float | None:
    """The fraction of the peak without recomputation that ``budget`` asks for: a float in
    (0, 1] (PyTorch's ``activation_memory_budget`` convention: 1.0 recomputes nothing) or a
    string ``"50%"``; None for a budget in bytes. A fraction needs the model's peak, which
    :class:`rockmate.Rockmate` knows once its graphs are built.

    Raises:
        ValueError: a percentage that is not in (0, 100].
    """
    if isinstance(budget, float) and 0 < budget <= 1:
        return budget
    if isinstance(budget, str):
        match = _PERCENT.match(budget)
        if match is not None:
            percent = float(match.group(1))
            if not 0 < percent <= 100:
                raise ValueError(f"a budget in percent must be in (0, 100]; got {budget!r}")
            return percent / 100
    return None


def parse_budget(budget) -> int:
    """The budget in bytes (a fraction is a ValueError here: see :func:`budget_fraction`).

    Raises:
        ValueError: the budget cannot be read, or is not positive; the message names the
            accepted forms.
    """
    if isinstance(budget, bool):
        raise ValueError(f"budget must be {_ACCEPTED}; got {budget!r}")
    if budget_fraction(budget) is not None:
        raise ValueError(f"the budget {budget!r} is a fraction of a model's peak without recomputation, not a "
                         "number of bytes: Rockmate(model, sample, budget) reads it against the model's peak")
    if isinstance(budget, int):
        value = budget
    elif isinstance(budget, float):
        if not math.isfinite(budget):
            raise ValueError(f"budget must be a finite number of bytes; got {budget!r}: use {_ACCEPTED}")
        value = int(budget)
    elif isinstance(budget, str):
        match = _PATTERN.match(budget)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"cannot read the budget {budget!r}: use {_ACCEPTED}")
        number = float(match.group(1))
        if not math.isfinite(number):
            raise ValueError(f"budget must be a finite number of bytes; got {budget!r}: use {_ACCEPTED}")
        value = int(number * _UNITS[unit])
    else:
        raise ValueError(f"budget must be {_ACCEPTED}; got a {type(budget).__name__}")
    if value <= 0:
        raise ValueError(f"budget must be positive; got {budget!r}")
    return value


def format_bytes(size: int) -> str:
    """``1536`` -> ``"1.50 KiB"``."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"
