"""Read a memory budget given as bytes or as a string such as ``"300MiB"`` or ``"1.5GB"``."""

from __future__ import annotations

import math

import re

__all__ = ["parse_budget", "format_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_ACCEPTED = "an integer number of bytes, or a string like '300MiB', '1.5GB', '2GiB', '512kB' or '1e9'"


def parse_budget(budget) -> int:
    """The budget in bytes.

    Raises:
        ValueError: the budget cannot be read, or is not positive; the message names the
            accepted forms.
    """
    if isinstance(budget, bool):
        raise ValueError(f"budget must be {_ACCEPTED}; got {budget!r}")
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
