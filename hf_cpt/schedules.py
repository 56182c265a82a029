"""Precision schedules: the bit-width of every optimizer step (REFERENCE §3).

A schedule is a *shape*, ``level(z, k, lo, hi) -> S`` giving the smooth precision at position ``z``
of cycle ``k``, plus a rule for the cycle length. ``PrecisionSchedule`` rounds it into bits. This table is the one place
the project defines what a schedule name means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

LevelFn = Callable[[float, int, float, float], float]  # (z, k, lo, hi) -> smooth bits
CycleLengthFn = Callable[[int, int], float]


def cpt_cycle_length(total_steps: int, num_cycles: int) -> float:
    """CPT paper: ``T = total_steps / N``."""
    return total_steps / num_cycles


def followup_cycle_length(total_steps: int, num_cycles: int) -> float:
    """Follow-up study's code: ``T = int(total / n) + 1``."""
    return int(total_steps / num_cycles) + 1


# Growth and decay profiles, written as in REFERENCE §3 so that rounding ties match it exactly.
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


ProfileFn = Callable[[float, float, float], float]


def repeated(growth: ProfileFn) -> LevelFn:
    """Every cycle rises from bits_min to bits_max."""
    return lambda z, k, lo, hi: growth(z, lo, hi)


def triangular(decay: ProfileFn, growth: ProfileFn) -> LevelFn:
    """Even cycles decay from bits_max to bits_min, odd cycles grow back (starts at bits_max)."""
    return lambda z, k, lo, hi: decay(z, lo, hi) if k % 2 == 0 else growth(z, lo, hi)


@dataclass(frozen=True)
class ScheduleShape:
    """A named schedule: its level over a cycle and how long a cycle is."""

    level: Optional[LevelFn]  # None: full precision throughout
    cycle_length: CycleLengthFn = cpt_cycle_length
    description: str = ""


_SCHEDULES: dict[str, ScheduleShape] = {}


def register_schedule(name: str, shape: ScheduleShape, *, overwrite: bool = False) -> None:
    """Make ``shape`` available to ``CPTConfig(schedule=name)``."""
    if name in _SCHEDULES and not overwrite:
        raise ValueError(f"A schedule named {name!r} is already registered.")
    _SCHEDULES[name] = shape


def available_schedules() -> dict[str, ScheduleShape]:
    return dict(_SCHEDULES)


register_schedule(
    "cpt",
    ScheduleShape(repeated(cosine_growth), cpt_cycle_length, "CPT paper: cosine rise from min to max in every cycle"),
)
register_schedule("static", ScheduleShape(lambda z, k, lo, hi: hi, cpt_cycle_length, "bits_max throughout"))
register_schedule("fp32", ScheduleShape(None, cpt_cycle_length, "full precision throughout"))

_FOLLOW_UP = {
    "CR": repeated(cosine_growth),
    "CT": triangular(cosine_decay, cosine_growth),
    "LR": repeated(linear_growth),
    "LT": triangular(linear_decay, linear_growth),
    "ER": repeated(exponential_growth),
    "ET-V": triangular(exponential_decay_vertical, exponential_growth),
    "ET-H": triangular(exponential_decay_horizontal, exponential_growth),
    "RR": repeated(rex_growth),
    "RT-V": triangular(rex_decay_vertical, rex_growth),
    "RT-H": triangular(rex_decay_horizontal, rex_growth),
}
for _name, _level in _FOLLOW_UP.items():
    register_schedule(_name, ScheduleShape(_level, followup_cycle_length, "follow-up study (Wolfe & Kyrillidis)"))


class PrecisionSchedule:
    """The bits of each optimizer step of one run: ``schedule(step) -> int`` (None = full precision)."""

    def __init__(
        self,
        name: str,
        bits_min: int,
        bits_max: int,
        total_steps: int,
        num_cycles: int = 32,
        rounding: str = "nearest",
    ) -> None:
        if name not in _SCHEDULES:
            raise ValueError(f"Unknown schedule {name!r}; choose one of {sorted(_SCHEDULES)}.")
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}.")
        self.name = name
        self.shape = _SCHEDULES[name]
        self.bits_min = bits_min
        self.bits_max = bits_max
        self.total_steps = total_steps
        self.num_cycles = num_cycles
        self.rounding = rounding
        self.cycle_length = self.shape.cycle_length(total_steps, num_cycles)
        if self.shape.level is not None and self.cycle_length < 1:
            raise ValueError(
                f"num_cycles={num_cycles} gives cycles shorter than one step over {total_steps} steps."
            )

    def smooth(self, step: int) -> Optional[float]:
        """The unrounded precision ``S(t)``."""
        if self.shape.level is None:
            return None
        cycle_index = math.floor(step / self.cycle_length)
        z = (step % self.cycle_length) / self.cycle_length
        return self.shape.level(z, cycle_index, self.bits_min, self.bits_max)

    def __call__(self, step: int) -> Optional[int]:
        value = self.smooth(step)
        if value is None:
            return None
        if self.rounding == "ceil":
            bits = math.ceil(value - 1e-9)
        else:
            bits = round(value)  # half to even, as np.rint in the CPT code
        return min(max(bits, self.bits_min), self.bits_max)

    def __repr__(self) -> str:
        return (
            f"PrecisionSchedule({self.name!r}, bits {self.bits_min}-{self.bits_max}, "
            f"{self.total_steps} steps, {self.num_cycles} cycles)"
        )


def schedule_from_config(config, total_steps: int) -> PrecisionSchedule:
    """The forward-bits schedule a `CPTConfig` asks for over ``total_steps`` optimizer steps."""
    config.check_total_steps(total_steps)
    return PrecisionSchedule(
        config.schedule, config.bits_min, config.bits_max, total_steps, config.num_cycles, config.rounding
    )
