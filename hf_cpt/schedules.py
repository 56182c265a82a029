"""Precision schedules: the bit-width of every optimizer step (docs/method.md §5).

A schedule is a *shape*, ``level(z, k, lo, hi) -> S`` giving the smooth precision at position ``z``
of cycle ``k``, plus a rule for the cycle length. ``PrecisionSchedule`` rounds it into bits. This
table is the one place the project defines what a schedule name means.

Names registered here:

- ``cpt``: the CPT paper's Eq. 1, a cosine rise from bits_min to bits_max in every cycle,
  ``T = total_steps / N``.
- ``cpt-triangular`` and ``cpt-cosine-anneal``: the two other cyclic patterns of the CPT paper's
  ablation (its Table 6), also with ``T = total_steps / N``. The paper gives no formula for them;
  see `triangular_wave` and `cosine_anneal` for how they are read here.
- ``CR``, ``CT``, ``LR``, ``LT``, ``ER``, ``ET-V``, ``ET-H``, ``RR``, ``RT-V``, ``RT-H``: the ten
  schedules of the follow-up study (Wolfe & Kyrillidis), with its code's ``T = int(total / n) + 1``.
- ``progressive``: a linear ramp from bits_min to bits_max over the first half of training, then
  held at bits_max (the progressive schedule of the CPT paper's Sec. 3.1, after Fu et al. 2020).
- ``static`` (bits_max throughout) and ``fp32`` (full precision throughout): the baselines.

Any schedule takes a delayed start (``delay``: the first fraction of training held at bits_max or in
full precision; the schedule then runs its cycles over the remaining steps), and a user can pass
any callable from step to bits, or register a new shape by name.

Everything a schedule costs is computed exactly from its bits at every step with
`hf_cpt.cost.bitops_per_mac` (docs/method.md §7).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .bits import MAX_BITS, MIN_BITS, check_bits
from .cost import FULL_PRECISION_BITS, bitops_per_mac

# How the smooth schedule becomes bits: round half to even (the CPT code) or up (the CPT paper).
ROUNDING_MODES = ("nearest", "ceil")
# The precision of a delayed start: bits_max or full precision.
DELAY_PRECISIONS = ("max", "fp32")

LevelFn = Callable[[float, int, float, float], float]  # (z, k, lo, hi) -> smooth bits
CycleLengthFn = Callable[[int, int], float]
StepFn = Callable[[int], float | None]  # step -> bits (or smooth bits), None = full precision
GradBits = int | Callable[[int], int | None] | None

COST_GROUPS = ("small", "medium", "large")
# Cost groups, by where the mean bits of a run fall between the bounds:
# f = (mean_bits - bits_min) / (bits_max - bits_min); small if f < 1/3, large if f > 2/3.
# For 3-8 bits and 8 cycles this gives the follow-up study's grouping (RR, RT-H at f ~ 0.16;
# CR, CT, LR, LT, ET-V, RT-V at f ~ 0.50; ER, ET-H at f ~ 0.77).
SMALL_COST_BELOW = 1 / 3
LARGE_COST_ABOVE = 2 / 3


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
    return ScheduleShape(
        lambda z, k, lo, hi: linear_growth(z, lo, hi) if k == 0 else hi,
        lambda total_steps, num_cycles: total_steps * ramp_fraction,
        f"linear ramp bits_min -> bits_max over the first {ramp_fraction:.0%} of training, then held",
        cyclic=False,
    )


@dataclass(frozen=True)
class ScheduleShape:
    """A named schedule: its level over a cycle and how long a cycle is.

    ``level(z, k, lo, hi)`` gives the smooth bits at position ``z`` in ``[0, 1)`` of cycle ``k``;
    ``level=None`` is full precision throughout. ``step_fn`` (instead of ``level``) is a plain
    function of the step, for schedules that ignore the bounds. ``cyclic=False`` marks shapes whose
    length does not depend on ``num_cycles`` (no check that cycles are at least one step long).
    """

    level: LevelFn | None  # None: full precision throughout (unless step_fn is set)
    cycle_length: CycleLengthFn = cpt_cycle_length
    description: str = ""
    cyclic: bool = True
    step_fn: StepFn | None = None


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
            shape = ScheduleShape(shape, cpt_cycle_length, f"user level function {_callable_name(shape)}")
        elif arity == 1:
            shape = ScheduleShape(None, cpt_cycle_length, f"user step function {_callable_name(shape)}", False, shape)
        else:
            raise ValueError(
                f"register_schedule({name!r}, ...): a callable must take (step) or (z, k, bits_min, bits_max); "
                f"{_callable_name(shape)} takes {arity if arity is not None else 'a variable number of'} arguments."
            )
    _SCHEDULES[name] = shape


def unregister_schedule(name: str) -> None:
    """Remove a registered schedule (for tests and interactive use)."""
    if name not in _SCHEDULES:
        raise ValueError(f"No schedule named {name!r} is registered.")
    del _SCHEDULES[name]


def available_schedules() -> dict[str, ScheduleShape]:
    return dict(_SCHEDULES)


register_schedule(
    "cpt",
    ScheduleShape(repeated(cosine_growth), cpt_cycle_length, "CPT paper: cosine rise from min to max in every cycle"),
)
register_schedule(
    "cpt-triangular",
    ScheduleShape(
        repeated(triangular_wave), cpt_cycle_length, "CPT paper ablation: linear rise to max and back in every cycle"
    ),
)
register_schedule(
    "cpt-cosine-anneal",
    ScheduleShape(
        repeated(cosine_anneal), cpt_cycle_length, "CPT paper ablation: SGDR-style cosine from max down to min"
    ),
)
register_schedule("progressive", progressive_shape(0.5))
register_schedule(
    "static", ScheduleShape(lambda z, k, lo, hi: hi, cpt_cycle_length, "bits_max throughout", cyclic=False)
)
register_schedule("fp32", ScheduleShape(None, cpt_cycle_length, "full precision throughout", cyclic=False))

_FOLLOW_UP = {
    "CR": (repeated(cosine_growth), "cosine, repeated"),
    "CT": (triangular(cosine_decay, cosine_growth), "cosine, triangular"),
    "LR": (repeated(linear_growth), "linear, repeated"),
    "LT": (triangular(linear_decay, linear_growth), "linear, triangular"),
    "ER": (repeated(exponential_growth), "exponential, repeated"),
    "ET-V": (triangular(exponential_decay_vertical, exponential_growth), "exponential, triangular, vertical flip"),
    "ET-H": (triangular(exponential_decay_horizontal, exponential_growth), "exponential, triangular, horizontal flip"),
    "RR": (repeated(rex_growth), "REX, repeated"),
    "RT-V": (triangular(rex_decay_vertical, rex_growth), "REX, triangular, vertical flip"),
    "RT-H": (triangular(rex_decay_horizontal, rex_growth), "REX, triangular, horizontal flip"),
}
FOLLOW_UP_SCHEDULES = tuple(_FOLLOW_UP)
CPT_PAPER_SCHEDULES = ("cpt", "cpt-triangular", "cpt-cosine-anneal")
for _name, (_level, _what) in _FOLLOW_UP.items():
    register_schedule(_name, ScheduleShape(_level, followup_cycle_length, f"follow-up study: {_what}"))


def _callable_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


class PrecisionSchedule:
    """The bits of each optimizer step of one run: ``schedule(step) -> int`` (None = full precision).

    ``name`` is a registered schedule name or a callable ``step -> bits`` (integer bits, or smooth
    bits that are rounded like the named schedules; None for a full-precision step). ``delay`` holds
    the first ``delay`` fraction of the run at ``delay_precision`` ('max': bits_max, 'fp32': full
    precision); the schedule then runs its cycles over the remaining steps, so every cycle is whole.

    Costs are exact sums over the run's steps of `hf_cpt.cost.bitops_per_mac`; full-precision steps
    count at 32 bits, forward and backward.
    """

    def __init__(
        self,
        name: str | StepFn,
        bits_min: int,
        bits_max: int,
        total_steps: int,
        num_cycles: int = 32,
        rounding: str = "nearest",
        *,
        delay: float = 0.0,
        delay_precision: str = "max",
    ) -> None:
        if callable(name) and not isinstance(name, str):
            self.shape = ScheduleShape(None, cpt_cycle_length, f"user function {_callable_name(name)}", False, name)
            self.name = _callable_name(name)
        elif isinstance(name, str) and name in _SCHEDULES:
            self.shape = _SCHEDULES[name]
            self.name = name
        else:
            raise ValueError(f"Unknown schedule {name!r}; choose one of {sorted(_SCHEDULES)} or pass a callable.")
        check_bits("bits_min", bits_min)
        check_bits("bits_max", bits_max)
        if bits_min > bits_max:
            raise ValueError(f"bits_min ({bits_min}) must not exceed bits_max ({bits_max}).")
        if not isinstance(total_steps, numbers.Integral) or isinstance(total_steps, bool) or total_steps < 1:
            raise ValueError(f"total_steps must be an integer >= 1, got {total_steps!r}.")
        if not isinstance(num_cycles, numbers.Integral) or isinstance(num_cycles, bool) or num_cycles < 1:
            raise ValueError(f"num_cycles must be an integer >= 1, got {num_cycles!r}.")
        if rounding not in ROUNDING_MODES:
            raise ValueError(f"rounding must be one of {ROUNDING_MODES}, got {rounding!r}.")
        if not isinstance(delay, numbers.Real) or isinstance(delay, bool) or not 0 <= delay < 1:
            raise ValueError(f"delay must be a fraction of training in [0, 1), got {delay!r}.")
        if delay_precision not in DELAY_PRECISIONS:
            raise ValueError(f"delay_precision must be one of {DELAY_PRECISIONS}, got {delay_precision!r}.")
        self.bits_min = int(bits_min)
        self.bits_max = int(bits_max)
        self.total_steps = int(total_steps)
        self.num_cycles = int(num_cycles)
        self.rounding = rounding
        self.delay = float(delay)
        self.delay_precision = delay_precision
        self.delay_steps = int(self.delay * self.total_steps)
        self.schedule_steps = self.total_steps - self.delay_steps  # steps the shape runs over
        if self.schedule_steps < 1:
            raise ValueError(f"delay={delay} leaves no step of the {total_steps}-step run to the schedule.")
        self.cycle_length = self.shape.cycle_length(self.schedule_steps, self.num_cycles)
        if self.shape.level is not None and self.shape.cyclic and self.cycle_length < 1:
            raise ValueError(
                f"num_cycles={num_cycles} gives cycles shorter than one step over {self.schedule_steps} steps."
            )
        self._bits_cache: tuple | None = None

    # -- bits of one step --------------------------------------------------------------------
    def smooth(self, step: int) -> float | None:
        """The unrounded precision ``S(t)`` (None: full precision)."""
        _check_step(step)
        return self._smooth(step)

    def __call__(self, step: int) -> int | None:
        _check_step(step)
        return self._bits(step)

    def _smooth(self, step: int) -> float | None:
        if step < self.delay_steps:
            return None if self.delay_precision == "fp32" else float(self.bits_max)
        t = step - self.delay_steps
        if self.shape.step_fn is not None:
            value = self.shape.step_fn(t)
            if value is None:
                return None
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(
                    f"Schedule {self.name!r} returned {value!r} at step {step}; it must return bits (a number) or None."
                )
            return float(value)
        if self.shape.level is None:
            return None
        cycle_index = math.floor(t / self.cycle_length)
        z = (t % self.cycle_length) / self.cycle_length
        return self.shape.level(z, cycle_index, self.bits_min, self.bits_max)

    def _bits(self, step: int) -> int | None:
        value = self._smooth(step)
        if value is None:
            return None
        if self.rounding == "ceil":
            bits = math.ceil(value - 1e-9)
        else:
            bits = round(value)  # half to even, as np.rint in the CPT code
        if self.shape.step_fn is None:
            return min(max(bits, self.bits_min), self.bits_max)
        if not MIN_BITS <= bits <= MAX_BITS:
            raise ValueError(
                f"Schedule {self.name!r} gives {bits} bits at step {step}; bits must be in {MIN_BITS}..{MAX_BITS} "
                "(or None for full precision)."
            )
        return bits

    # -- the whole run -----------------------------------------------------------------------
    def bits_per_step(self) -> tuple:
        """The bits of every step of the run, ``(schedule(0), ..., schedule(total_steps - 1))``."""
        if self._bits_cache is None:
            self._bits_cache = tuple(map(self._bits, range(self.total_steps)))
        return self._bits_cache

    def steps_at_bits(self) -> dict:
        """How many steps the run spends at each precision (None: full precision), low to high."""
        counts = Counter(self.bits_per_step())
        return dict(sorted(counts.items(), key=lambda kv: MAX_BITS + 1 if kv[0] is None else kv[0]))

    def mean_bits(self) -> float:
        """Mean forward bits over the run (full-precision steps count as 32)."""
        bits = self.bits_per_step()
        return sum(FULL_PRECISION_BITS if b is None else b for b in bits) / len(bits)

    def bitops_per_mac(self, grad_bits: GradBits = 8) -> float:
        """Bit products per forward MAC summed over the run (forward + both backward GEMMs)."""
        total = 0
        if callable(grad_bits):
            for step, bits in enumerate(self.bits_per_step()):
                total += bitops_per_mac(*training_precision(bits, grad_bits, step))
            return total
        _check_grad_bits(grad_bits)
        for bits, count in Counter(self.bits_per_step()).items():
            total += count * bitops_per_mac(*training_precision(bits, grad_bits, 0))
        return total

    def relative_cost(self, grad_bits: GradBits = 8) -> float:
        """Training cost relative to FP32 training of the same steps (docs/method.md §7)."""
        return self.bitops_per_mac(grad_bits) / (self.total_steps * bitops_per_mac(None, None))

    def static_grad_bits(self, grad_bits: GradBits = 8) -> int | None:
        """The error bits of the static counterpart: fixed ``grad_bits``, or a grad schedule's maximum."""
        if not callable(grad_bits):
            _check_grad_bits(grad_bits)
            return grad_bits
        if isinstance(grad_bits, PrecisionSchedule):
            return grad_bits.bits_max
        values = [grad_bits(step) for step in range(self.total_steps)]
        return None if any(v is None for v in values) else max(values)

    def cost_vs_static(self, grad_bits: GradBits = 8) -> float:
        """Training cost relative to static ``bits_max`` forward bits (and the static grad bits)."""
        static = bitops_per_mac(self.bits_max, self.static_grad_bits(grad_bits)) * self.total_steps
        return self.bitops_per_mac(grad_bits) / static

    @property
    def cost_group(self) -> str:
        """'small', 'medium' or 'large' by mean bits between the bounds (see `SMALL_COST_BELOW`)."""
        return cost_group(self.mean_bits(), self.bits_min, self.bits_max)

    def summary(self, grad_bits: GradBits = 8) -> dict[str, Any]:
        """Mean bits, costs and group of the run, as the CLI prints them."""
        return {
            "schedule": self.name,
            "bits_min": self.bits_min,
            "bits_max": self.bits_max,
            "total_steps": self.total_steps,
            "num_cycles": self.num_cycles,
            "delay": self.delay,
            "mean_bits": self.mean_bits(),
            "cost_vs_static": self.cost_vs_static(grad_bits),
            "cost_vs_fp32": self.relative_cost(grad_bits),
            "cost_group": self.cost_group,
            "steps_at_bits": {("fp32" if k is None else str(k)): v for k, v in self.steps_at_bits().items()},
        }

    def __repr__(self) -> str:
        delay = f", delay {self.delay:g} at {self.delay_precision}" if self.delay else ""
        return (
            f"PrecisionSchedule({self.name!r}, bits {self.bits_min}-{self.bits_max}, "
            f"{self.total_steps} steps, {self.num_cycles} cycles{delay})"
        )


def _check_step(step: Any) -> None:
    if not isinstance(step, numbers.Integral) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}.")


def _check_grad_bits(grad_bits: Any) -> None:
    if grad_bits is not None:
        check_bits("grad_bits", grad_bits)


def cost_group(mean_bits: float, bits_min: int, bits_max: int) -> str:
    """The follow-up study's cost group of a run with these mean bits between these bounds.

    ``f = (mean_bits - bits_min) / (bits_max - bits_min)``: 'small' if ``f < 1/3``, 'large' if
    ``f > 2/3`` (or if the bounds are equal), else 'medium'.
    """
    if bits_max <= bits_min:
        return "large"
    fraction = (mean_bits - bits_min) / (bits_max - bits_min)
    if fraction < SMALL_COST_BELOW:
        return "small"
    if fraction > LARGE_COST_ABOVE:
        return "large"
    return "medium"


def training_precision(bits: int | None, grad_bits: GradBits, step: int) -> tuple[int | None, int | None]:
    """(forward bits, error bits) of one step: full-precision steps are full precision both ways."""
    if bits is None:
        return None, None
    if callable(grad_bits):
        value = grad_bits(step)
        _check_grad_bits(value)
        return bits, value
    return bits, grad_bits


def get_schedule(
    name: str | StepFn,
    bits_min: int = 3,
    bits_max: int = 8,
    total_steps: int = 64000,
    num_cycles: int = 32,
    *,
    rounding: str = "nearest",
    delay: float = 0.0,
    delay_precision: str = "max",
) -> PrecisionSchedule:
    """A schedule by name (or a callable ``step -> bits``) over a run of ``total_steps`` steps.

    >>> s = get_schedule("RR", 3, 8, total_steps=64000, num_cycles=8)
    >>> s(0), round(s.mean_bits(), 2), s.cost_group
    (3, 3.8, 'small')
    """
    return PrecisionSchedule(
        name, bits_min, bits_max, total_steps, num_cycles, rounding, delay=delay, delay_precision=delay_precision
    )


def schedule_from_config(config, total_steps: int, bits_min: int | None = None) -> PrecisionSchedule:
    """The forward-bits schedule a `CPTConfig` asks for over ``total_steps`` optimizer steps.

    ``bits_min`` overrides the config's (for ``bits_min="auto"``, the precision range test's choice).
    """
    config.check_total_steps(total_steps)
    bits_min = config.bits_min if bits_min is None else bits_min
    if bits_min == "auto":
        raise ValueError("CPTConfig.bits_min='auto' must be resolved by the precision range test first.")
    return PrecisionSchedule(
        config.schedule,
        bits_min,
        config.bits_max,
        total_steps,
        config.cycles_for(total_steps),
        config.rounding,
        delay=config.delay,
        delay_precision=config.delay_precision,
    )


def grad_schedule_from_config(config, total_steps: int) -> PrecisionSchedule | None:
    """The error-bits schedule of a `CPTConfig` (None: fixed ``grad_bits``, the default).

    During a delayed start the error bits are held at ``grad_bits``.
    """
    if config.grad_schedule is None:
        return None
    return PrecisionSchedule(
        config.grad_schedule,
        config.grad_bits_min,
        config.grad_bits,
        total_steps,
        config.cycles_for(total_steps),
        config.rounding,
        delay=config.delay,
        delay_precision="max",
    )
