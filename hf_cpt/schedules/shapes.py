"""Precision schedules: the bits of every optimizer step (docs/method.md §5), the one place a schedule name is defined.

A schedule is a *shape*, ``level(z, k, lo, hi) -> S`` (the smooth precision at position ``z`` of cycle ``k``), plus a
rule for the cycle length; `PrecisionSchedule` rounds it into bits. Registered here: ``cpt`` (the CPT paper's Eq. 1,
``T = total_steps / N``) and its ablation's ``cpt-triangular`` / ``cpt-cosine-anneal``; the ten schedules of the
follow-up study (Wolfe & Kyrillidis; ``T = int(total / n) + 1`` as in its code); ``progressive``; the baselines
``static`` and ``fp32``. Each shape's ``description`` says what it is. Any schedule takes a delayed start
(``delay``), a user can pass any callable from step to bits or register a new shape by name. Costs: docs/method.md §7.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

from ..utils import ConfigError, callable_name

# How the smooth schedule becomes bits: round half to even (the CPT code) or up (the CPT paper).
ROUNDING_MODES = ("nearest", "ceil")
# The precision of a delayed start: bits_max or full precision.
DELAY_PRECISIONS = ("max", "fp32")

LevelFn = Callable[[float, int, float, float], float]  # (z, k, lo, hi) -> smooth bits
CycleLengthFn = Callable[[int, int], float]
StepFn = Callable[[int], float | None]  # step -> bits (or smooth bits), None = full precision



def cpt_cycle_length(total_steps: int, num_cycles: int) -> float:
    """CPT paper: ``T = total_steps / N``."""
    return total_steps / num_cycles


def followup_cycle_length(total_steps: int, num_cycles: int) -> float:
    """Follow-up study's code: ``T = int(total / n) + 1``."""
    return int(total_steps / num_cycles) + 1


# Growth and decay profiles, written as in docs/method.md §5 so that rounding ties match it exactly.
def cosine_growth(z: float, lo: float, hi: float) -> float:
    return lo + (hi - lo) / 2 * (1 - math.cos(math.pi * z))


def cosine_decay(z: float, lo: float, hi: float) -> float:
    return hi - (hi - lo) / 2 * (1 - math.cos(math.pi * z))


def linear_growth(z: float, lo: float, hi: float) -> float:
    return lo + (hi - lo) * z


def linear_decay(z: float, lo: float, hi: float) -> float:
    return hi - (hi - lo) * z


def exponential_growth(z: float, lo: float, hi: float) -> float:
    return hi - (hi - lo) * math.exp(-4 * z)


def exponential_decay_vertical(z: float, lo: float, hi: float) -> float:
    return lo + (hi - lo) * math.exp(-4 * z)


def exponential_decay_horizontal(z: float, lo: float, hi: float) -> float:
    return hi - (hi - lo) * math.exp(-4 * (1 - z))


def _rex(u: float) -> float:
    return u / (0.1 + 0.9 * u)


def rex_growth(z: float, lo: float, hi: float) -> float:
    return hi - (hi - lo) * _rex(1 - z)


def rex_decay_vertical(z: float, lo: float, hi: float) -> float:
    return lo + (hi - lo) * _rex(1 - z)


def rex_decay_horizontal(z: float, lo: float, hi: float) -> float:
    return hi - (hi - lo) * _rex(z)


def triangular_wave(z: float, lo: float, hi: float) -> float:
    """CPT paper's "triangular" variant, after Smith (2017)'s triangular cyclical learning rate:
    a linear rise from bits_min to bits_max over the first half of each cycle, and back down."""
    return lo + (hi - lo) * (1 - abs(2 * z - 1))


def cosine_anneal(z: float, lo: float, hi: float) -> float:
    """CPT paper's "cosine annealing" variant, the SGDR learning-rate shape (Loshchilov & Hutter)
    applied to the bits: each cycle restarts at bits_max and anneals to bits_min,
    ``lo + D/2 (1 + cos(pi z))`` (the mirror image of CPT's own cycle)."""
    return lo + (hi - lo) / 2 * (1 + math.cos(math.pi * z))


ProfileFn = Callable[[float, float, float], float]


def repeated(growth: ProfileFn) -> LevelFn:
    """Every cycle rises from bits_min to bits_max."""
    return lambda z, k, lo, hi: growth(z, lo, hi)


def triangular(decay: ProfileFn, growth: ProfileFn) -> LevelFn:
    """Even cycles decay from bits_max to bits_min, odd cycles grow back (starts at bits_max)."""
    return lambda z, k, lo, hi: decay(z, lo, hi) if k % 2 == 0 else growth(z, lo, hi)


def progressive_shape(ramp_fraction: float = 0.5) -> ScheduleShape:
    """A linear ramp from bits_min to bits_max over the first ``ramp_fraction`` of training, then held.

    ``register_schedule("progressive-25", progressive_shape(0.25))`` makes a shorter ramp.
    """
    if not (isinstance(ramp_fraction, numbers.Real) and 0 < ramp_fraction <= 1):
        raise ValueError(f"ramp_fraction must be in (0, 1], got {ramp_fraction!r}.")
    return ScheduleShape(lambda z, k, lo, hi: linear_growth(z, lo, hi) if k == 0 else hi,
        lambda total_steps, num_cycles: total_steps * ramp_fraction,
        f"linear ramp bits_min -> bits_max over the first {ramp_fraction:.0%} of training, then held", cyclic=False,
        turns=())


@dataclass(frozen=True)
class ScheduleShape:
    """A named schedule: its level over a cycle and how long a cycle is.

    ``level(z, k, lo, hi)`` gives the smooth bits at position ``z`` in ``[0, 1)`` of cycle ``k``;
    ``level=None`` is full precision throughout. ``step_fn`` (instead of ``level``) is a plain
    function of the step, for schedules that ignore the bounds. ``cyclic=False`` marks shapes whose
    length does not depend on ``num_cycles`` (no check that cycles are at least one step long). ``turns``: the
    positions in a cycle where the level changes direction (``()``: monotone in every cycle); with them a run's
    steps at each precision are counted in time proportional to its cycles, without them step by step.
    """

    level: LevelFn | None  # None: full precision throughout (unless step_fn is set)
    cycle_length: CycleLengthFn = cpt_cycle_length
    description: str = ""
    cyclic: bool = True
    step_fn: StepFn | None = None
    turns: tuple[float, ...] | None = None


_SCHEDULES: dict[str, ScheduleShape] = {}


def _positional_arity(fn: Callable) -> int | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params):
        return None
    return sum(1 for p in params if p.kind in kinds and p.default is inspect.Parameter.empty)


def register_schedule(name: str, shape: ScheduleShape | Callable, *, overwrite: bool = False) -> None:
    """Make a schedule available by name (``CPTConfig(schedule=name)``, ``get_schedule(name, ...)``).

    ``shape`` is a `ScheduleShape`, a level function ``(z, k, lo, hi) -> smooth bits`` (cycles of
    ``total_steps / num_cycles`` steps), or a function of the step ``step -> bits`` (None: full
    precision), which then ignores the bounds.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_schedule: name must be a non-empty string, got {name!r}.")
    if name in _SCHEDULES and not overwrite:
        raise ValueError(f"A schedule named {name!r} is already registered (pass overwrite=True to replace it).")
    if not isinstance(shape, ScheduleShape):
        if not callable(shape):
            raise ValueError(
                f"register_schedule({name!r}, ...): expected a ScheduleShape or a callable, got {type(shape).__name__}."
            )
        arity = _positional_arity(shape)
        if arity == 4:
            shape = ScheduleShape(shape, cpt_cycle_length, f"user level function {callable_name(shape)}")
        elif arity == 1:
            shape = ScheduleShape(None, cpt_cycle_length, f"user step function {callable_name(shape)}", False, shape)
        else:
            raise ValueError(
                f"register_schedule({name!r}, ...): a callable must take (step) or (z, k, bits_min, bits_max); "
                f"{callable_name(shape)} takes {arity if arity is not None else 'a variable number of'} arguments."
            )
    _SCHEDULES[name] = shape


def unregister_schedule(name: str) -> None:
    """Remove a registered schedule (for tests and interactive use)."""
    if name not in _SCHEDULES:
        raise ValueError(f"No schedule named {name!r} is registered.")
    del _SCHEDULES[name]


def available_schedules() -> dict[str, ScheduleShape]:
    """Every registered schedule, by name."""
    return dict(_SCHEDULES)


def check_schedule_name(owner: str, field: str, value) -> None:
    """Raise `ConfigError` unless ``value`` is a registered schedule name or a callable ``step -> bits``."""
    if callable(value) and not isinstance(value, str):
        return
    if not isinstance(value, str) or value not in _SCHEDULES:
        raise ConfigError(owner, field, f"={value!r} is unknown; choose one of {sorted(_SCHEDULES)}, or pass a "
                                        "callable step -> bits.")


register_schedule("cpt", ScheduleShape(repeated(cosine_growth), cpt_cycle_length,
                                       "CPT paper: cosine rise from min to max in every cycle", turns=()))
register_schedule("cpt-triangular", ScheduleShape(repeated(triangular_wave), cpt_cycle_length,
                                                  "CPT paper ablation: linear rise to max and back in every cycle",
                                                  turns=(0.5,)))
register_schedule("cpt-cosine-anneal", ScheduleShape(repeated(cosine_anneal), cpt_cycle_length,
                                                     "CPT paper ablation: SGDR-style cosine from max down to min",
                                                     turns=()))
register_schedule("progressive", progressive_shape(0.5))
register_schedule("static",
    ScheduleShape(lambda z, k, lo, hi: hi, cpt_cycle_length, "bits_max throughout", cyclic=False, turns=()))
register_schedule("fp32", ScheduleShape(None, cpt_cycle_length, "full precision throughout", cyclic=False, turns=()))

_FOLLOW_UP = {"CR": (repeated(cosine_growth), "cosine, repeated"),
    "CT": (triangular(cosine_decay, cosine_growth), "cosine, triangular"),
    "LR": (repeated(linear_growth), "linear, repeated"),
    "LT": (triangular(linear_decay, linear_growth), "linear, triangular"),
    "ER": (repeated(exponential_growth), "exponential, repeated"),
    "ET-V": (triangular(exponential_decay_vertical, exponential_growth), "exponential, triangular, vertical flip"),
    "ET-H": (triangular(exponential_decay_horizontal, exponential_growth), "exponential, triangular, horizontal flip"),
    "RR": (repeated(rex_growth), "REX, repeated"),
    "RT-V": (triangular(rex_decay_vertical, rex_growth), "REX, triangular, vertical flip"),
    "RT-H": (triangular(rex_decay_horizontal, rex_growth), "REX, triangular, horizontal flip")}
FOLLOW_UP_SCHEDULES = tuple(_FOLLOW_UP)
for _name, (_level, _what) in _FOLLOW_UP.items():
    register_schedule(_name, ScheduleShape(_level, followup_cycle_length, f"follow-up study: {_what}", turns=()))

