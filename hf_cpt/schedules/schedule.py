"""`PrecisionSchedule`: the bits of every optimizer step of one run, and what the run costs (docs/method.md §5, §7)."""

from __future__ import annotations

import math
import numbers
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..numerics.bitops import FULL_PRECISION_BITS, bitops_per_mac
from ..numerics.bits import MAX_BITS, MIN_BITS, check_bits
from ..utils import callable_name
from .shapes import DELAY_PRECISIONS, ROUNDING_MODES, ScheduleShape, StepFn, available_schedules, cpt_cycle_length

GradBits = int | Callable[[int], int | None] | None

# Cost groups, by where the mean bits of a run fall between the bounds:
# f = (mean_bits - bits_min) / (bits_max - bits_min); small if f < 1/3, large if f > 2/3.
# For 3-8 bits and 8 cycles this gives the follow-up study's grouping (RR, RT-H at f ~ 0.16;
# CR, CT, LR, LT, ET-V, RT-V at f ~ 0.50; ER, ET-H at f ~ 0.77).
SMALL_COST_BELOW = 1 / 3
LARGE_COST_ABOVE = 2 / 3

def steps_after_delay(total_steps: int, delay: float) -> int:
    """The optimizer steps a schedule runs its cycles over: those after the delayed start."""
    return total_steps - int(delay * total_steps)


class PrecisionSchedule:
    """The bits of each optimizer step of one run: ``schedule(step) -> int`` (None = full precision).

    ``name`` is a registered schedule name or a callable ``step -> bits`` (integer or smooth bits, rounded like the
    named schedules; None for a full-precision step). ``delay`` holds the first ``delay`` fraction of the run at
    ``delay_precision`` ('max' or 'fp32'); the cycles then run over the remaining steps. Costs are exact sums over the
    run's steps of `hf_cpt.numerics.bitops.bitops_per_mac`, full-precision steps at 32 bits.
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
            self.shape = ScheduleShape(None, cpt_cycle_length, f"user function {callable_name(name)}", False, name)
            self.name = callable_name(name)
        elif isinstance(name, str) and name in available_schedules():
            self.shape = available_schedules()[name]
            self.name = name
        else:
            raise ValueError(
                f"Unknown schedule {name!r}; choose one of {sorted(available_schedules())} or pass a callable."
            )
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
        self.schedule_steps = steps_after_delay(self.total_steps, self.delay)  # steps the shape runs over
        self.delay_steps = self.total_steps - self.schedule_steps
        if self.schedule_steps < 1:
            raise ValueError(f"delay={delay} leaves no step of the {total_steps}-step run to the schedule.")
        if self.shape.level is not None and self.shape.cyclic and self.schedule_steps < self.num_cycles:
            after_delay = " after the delay" if self.delay_steps else ""
            raise ValueError(
                f"num_cycles={num_cycles} gives cycles shorter than one step for a run of {self.schedule_steps} "
                f"optimizer steps{after_delay}; use at most {self.schedule_steps} cycles or num_cycles='auto'."
            )
        self.cycle_length = self.shape.cycle_length(self.schedule_steps, self.num_cycles)
        self._bits_cache: tuple | None = None
        self._counts: Counter | None = None

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
        """How many steps the run spends at each precision (None: full precision), low to high. A shape that
        declares its ``turns`` is counted in time proportional to the cycles; any other step by step."""
        if self._counts is None:
            self._counts = self._count_steps()
        return dict(sorted(self._counts.items(), key=lambda kv: MAX_BITS + 1 if kv[0] is None else kv[0]))

    def _count_steps(self) -> Counter:
        counts = Counter({self._bits(0): self.delay_steps} if self.delay_steps else {})
        if self.shape.turns is None or self.shape.step_fn is not None:
            counts.update(map(self._bits, range(self.delay_steps, self.total_steps)))
            return counts
        # Monotone pieces, between cycle starts and turns; a step next to a float-computed boundary counts alone.
        cuts, cycle = {0, self.schedule_steps}, 0
        while cycle * self.cycle_length < self.schedule_steps:
            for z in (0.0, *self.shape.turns):
                edge = math.ceil((cycle + z) * self.cycle_length)
                cuts.update(t for t in (edge - 1, edge + 1) if 0 < t < self.schedule_steps)
            cycle += 1
        pieces = [(a + self.delay_steps, b + self.delay_steps) for a, b in zip(sorted(cuts), sorted(cuts)[1:])]
        while pieces:  # bisection: a monotone piece whose ends agree is one precision throughout
            start, end = pieces.pop()
            first, last = self._bits(start), self._bits(end - 1)
            if first == last:
                counts[first] += end - start
            elif end - start <= 4:
                counts.update(map(self._bits, range(start, end)))
            else:
                pieces += [(start, (start + end) // 2), ((start + end) // 2, end)]
        return counts

    def mean_bits(self) -> float:
        """Mean forward bits over the run (full-precision steps count as 32)."""
        counts = self.steps_at_bits()
        return sum((FULL_PRECISION_BITS if b is None else b) * n for b, n in counts.items()) / self.total_steps

    def bitops_per_mac(self, grad_bits: GradBits = 8) -> float:
        """Bit products per forward MAC summed over the run (forward + both backward GEMMs)."""
        total = 0
        if callable(grad_bits):
            for step, bits in enumerate(self.bits_per_step()):
                total += bitops_per_mac(*training_precision(bits, grad_bits, step))
            return total
        _check_grad_bits(grad_bits)
        for bits, count in self.steps_at_bits().items():
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
        return {"schedule": self.name, "bits_min": self.bits_min, "bits_max": self.bits_max,
            "total_steps": self.total_steps, "num_cycles": self.num_cycles, "delay": self.delay,
            "mean_bits": self.mean_bits(), "cost_vs_static": self.cost_vs_static(grad_bits),
            "cost_vs_fp32": self.relative_cost(grad_bits), "cost_group": self.cost_group,
            "steps_at_bits": {("fp32" if k is None else str(k)): v for k, v in self.steps_at_bits().items()}}

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
    return PrecisionSchedule(name, bits_min, bits_max, total_steps, num_cycles, rounding, delay=delay,
        delay_precision=delay_precision)
