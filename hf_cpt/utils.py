"""Small helpers every layer of the package may use: names of callables, JSON-safe values."""

from __future__ import annotations

import math
from typing import Any


def callable_name(fn: Any) -> str:
    """A readable name for a function or callable object (its qualified name where it has one)."""
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def json_safe(value: Any) -> Any:
    """``value`` with anything JSON cannot hold made JSON-friendly: NaN and infinities become null, tuples
    lists, dict keys strings, and other objects (a callable schedule) their name."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None  # strict JSON has no NaN or infinity
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return callable_name(value) if callable(value) else repr(value)
