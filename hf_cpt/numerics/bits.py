"""Bit-width bounds and the one bit-width check every module uses."""

from __future__ import annotations

import numbers
from typing import Any

MIN_BITS = 1
MAX_BITS = 32


def check_bits(name: str, value: Any, low: int = MIN_BITS, high: int = MAX_BITS) -> int:
    """Validate a bit-width, naming ``name`` in the error."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in {low}..{high}, got {value!r}.")
    return int(value)
