"""Small helpers every layer of the package may use: names of callables, JSON-safe values, compile-safe caches."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable
from typing import Any

import torch


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


class ConfigError(ValueError):
    """An invalid setting, naming its owner and field (``"CPTConfig.bits_min must be ..."``).

    A typed part of `hf_cpt.CPTConfig` raises it with its own name; `CPTConfig` re-raises it under the flat field
    the user set (`renamed`), so one check serves both.
    """

    def __init__(self, owner: str, field: str, problem: str) -> None:
        self.owner, self.field, self.problem = owner, field, problem
        super().__init__(f"{owner}.{field}{'' if problem.startswith('=') else ' '}{problem}")

    def renamed(self, owner: str, field: str) -> ConfigError:
        return ConfigError(owner, field, self.problem)


def check_choice(owner: str, field: str, value: Any, choices: tuple) -> None:
    """Raise `ConfigError` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ConfigError(owner, field, f"must be one of {choices}, got {value!r}.")


def plain_numbers(settings: Any) -> None:
    """Turn the integral and real numbers of other types in a frozen dataclass's fields (``numpy.int64(4)``, as
    arrays hand them out) into Python ints and floats, in place: validated like any int, written to JSON alike."""
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        if isinstance(value, bool) or type(value) in (int, float) or not isinstance(value, numbers.Real):
            continue
        plain = int(value) if isinstance(value, numbers.Integral) else float(value)
        object.__setattr__(settings, field.name, plain)


def is_int(value: Any) -> bool:
    """An integer that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def setting(default: Any, help: str) -> Any:
    """A settings field: its default and the help text that `hf_cpt.CPTConfig` and the recipes' ``--cpt_*`` flags
    show (declared once, in the typed part the setting belongs to)."""
    return dataclasses.field(default=default, metadata={"help": help})


def model_embeddings(model: Any, which: str) -> Any:
    """A transformers model's ``"input"`` or ``"output"`` embeddings module (``get_input_embeddings`` /
    ``get_output_embeddings``), or None where the model has none or does not say."""
    getter = getattr(model, f"get_{which}_embeddings", None)
    if not callable(getter):
        return None
    try:
        module = getter()
    except (NotImplementedError, AttributeError):
        return None
    return module if isinstance(module, torch.nn.Module) else None


def cached_outside_compile(maxsize: int) -> Callable[[Callable], Callable]:
    """`functools.lru_cache` for eager calls of a pure function; code that torch.compile traces calls the function
    itself (dynamo does not trace through a cache, warns that it ignores it, and bakes the result into the graph)."""
    def decorate(fn: Callable) -> Callable:
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        return functools.wraps(fn)(lambda *args: fn(*args) if torch.compiler.is_compiling() else cached(*args))
    return decorate
