"""Bit-width bounds and the one bit-width check every module uses."""

from __future__ import annotations

import numbers
from typing import Any

MIN_BITS = 1
MAX_BITS = 32


def bits_problem(value: Any, low: int = MIN_BITS, high: int = MAX_BITS) -> str | None:
    """What is wrong with ``value`` as a bit-width (None: nothing)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not low <= value <= high:
        return f"must be an integer in {low}..{high}, got {value!r}."
    return None


def check_bits(name: str, value: Any, low: int = MIN_BITS, high: int = MAX_BITS) -> int:
    """Validate a bit-width, naming ``name`` in the error."""
    problem = bits_problem(value, low, high)
    if problem is not None:
        raise ValueError(f"{name} {problem}")
    return int(value)
