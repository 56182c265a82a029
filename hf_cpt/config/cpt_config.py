"""`CPTConfig`: every setting of a Cyclic Precision Training run, validated up front.

Flat fields, so that ``CPTConfig(bits_min=4)`` and the recipes' ``--cpt_*`` flags (made from the fields) work. Each
field is declared once, with its default and help text, in the typed part it belongs to (`hf_cpt.config.parts`,
and `ErrorQuantization` for the errors); `CPTConfig` is their union, and each part checks its own fields.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from ..numerics.errors import ErrorQuantization
from ..utils import ConfigError, callable_name
from .parts import PART_FIELDS, ActivationConfig, EvaluationConfig, ModuleSelection, RangeTestConfig, ScheduleConfig

# The parts in the order their fields appear in CPTConfig (and in the recipes' --help).
PARTS = (ScheduleConfig, ActivationConfig, ErrorQuantization, ModuleSelection, RangeTestConfig, EvaluationConfig)
# Where a run's default differs from a part's own: a bare ErrorQuantization() is the CPT paper's per-tensor
# min/max scheme (usable with quantize_error as is); a CPTConfig resolves the ranges and grids per layer and for
# the attention products (docs/backward.md).
RUN_DEFAULTS = {"error_granularity": "auto", "error_range": "auto"}


class _PartView:
    """A typed part of `CPTConfig`, read from its flat fields (validated) on every access."""

    def __init__(self, part: type) -> None:
        self.part = part

    def __get__(self, config: CPTConfigMethods | None, owner: type | None = None) -> Any:
        return self.part if config is None else config._part(self.part)


class CPTConfigMethods:
    """What `CPTConfig` does with its fields (the fields themselves come from the parts)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `ValueError` naming the first invalid field: each part checks its own fields, then the checks
        that span parts."""
        parts = {part: self._part(part) for part in PARTS}
        for name in ("target_modules", "include_modules", "exclude_modules"):  # a string becomes a one-pattern list
            setattr(self, name, getattr(parts[ModuleSelection], name))
        if self.bits_min == "auto":
            try:
                self.range_test.check_max_bits(self.bits_max)
            except ConfigError as error:
                raise ConfigError("CPTConfig", "prt_start_bits", f"({self.prt_start_bits}) must not exceed "
                                  f"CPTConfig.bits_max ({self.bits_max}).") from error
        self._check_error_grid()

    def _check_error_grid(self) -> None:
        # A zero-centred grid at 1 bit has no level but zero: every error would vanish.
        zero_centred = self.error_range == "symmetric" or (self.error_range == "auto" and self.quantize_attention)
        lowest, field = ((self.grad_bits_min, "grad_bits_min") if self.grad_schedule is not None
                         else (self.grad_bits, "grad_bits"))
        if zero_centred and lowest is not None and lowest < 2:
            where = "every error" if self.error_range == "symmetric" else "the attention products' errors"
            raise ConfigError("CPTConfig", "error_range",
                              f"({self.error_range!r}) puts {where} on the zero-centred grid, which needs at least "
                              f"2 bits ({field} is {lowest}); set error_range='minmax' or more error bits.")

    @classmethod
    def from_parts(cls, *parts: Any, **fields: Any) -> CPTConfig:
        """A config from typed parts (`ScheduleConfig`, `ActivationConfig`, `ErrorQuantization`, `ModuleSelection`,
        `RangeTestConfig`, `EvaluationConfig`) and flat fields for the rest."""
        for part in parts:
            names = PART_FIELDS.get(type(part))
            if names is None:
                raise TypeError(f"CPTConfig.from_parts: {type(part).__name__} is not a part of CPTConfig.")
            fields.update({flat: getattr(part, own) for own, flat in names.items()})
        return cls(**fields)

    def _part(self, part: type) -> Any:
        names = PART_FIELDS[part]
        try:
            return part(**{own: getattr(self, flat) for own, flat in names.items()})
        except ConfigError as error:
            raise error.renamed("CPTConfig", names.get(error.field, error.field)) from None

    # The typed parts, built from the flat fields on access (`hf_cpt.config.parts`). ``errors`` is how errors are
    # quantized (``error_granularity='auto'`` is resolved per layer by `ErrorQuantization.for_activations`);
    # ``schedule_config`` builds the run's schedules (`ScheduleConfig.forward_schedule`).
    schedule_config = _PartView(ScheduleConfig)
    activations = _PartView(ActivationConfig)
    errors = _PartView(ErrorQuantization)
    modules = _PartView(ModuleSelection)
    range_test = _PartView(RangeTestConfig)
    evaluation = _PartView(EvaluationConfig)

    def cycles_for(self, total_steps: int) -> int:
        """The number of cycles over a run of ``total_steps`` optimizer steps (resolves ``num_cycles='auto'``)."""
        return self.schedule_config.cycles_for(total_steps)

    def check_total_steps(self, total_steps: int) -> None:
        """Raise before training if the run cannot hold the schedule (too short for its cycles, no step after the
        delay); warn if its cycles are too short to visit every bit-width between ``bits_min`` and ``bits_max``."""
        bits_min = self.bits_max if self.bits_min == "auto" else None  # the run length does not depend on it
        self.schedule_config.forward_schedule(total_steps, bits_min=bits_min)

    @property
    def eval_precision(self) -> int | None:
        """Bits used in eval mode, None for full precision ('current' is resolved by the caller)."""
        if self.eval_bits == "fp32" or self.schedule == "fp32":
            return None
        if self.eval_bits in ("max", "current"):
            return self.bits_max
        return int(self.eval_bits)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-safe dict; a callable schedule is written as its name (not restorable)."""
        values = dataclasses.asdict(self)
        for name in ("schedule", "grad_schedule"):
            if callable(values[name]):
                values[name] = f"<callable {callable_name(values[name])}>"
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> CPTConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"Unknown CPTConfig field(s): {unknown}.")
        return cls(**values)


def _fields() -> list[tuple[str, Any, dataclasses.Field]]:
    specs = []
    for part in PARTS:
        hints = typing.get_type_hints(part)
        for own in dataclasses.fields(part):
            flat = PART_FIELDS[part][own.name]
            default = RUN_DEFAULTS.get(flat, own.default)
            specs.append((flat, hints[own.name], dataclasses.field(default=default, metadata=own.metadata)))
    return specs


CPTConfig = dataclasses.make_dataclass(
    "CPTConfig",
    _fields(),
    bases=(CPTConfigMethods,),
    namespace={
        "__module__": __name__,
        "__doc__": """Settings of a CPT run (docs/method.md §1-§5).

    The forward bit-width of weights and input activations follows ``schedule`` between ``bits_min`` and
    ``bits_max``; errors are quantized at ``grad_bits`` (`ErrorQuantization` says how). ``schedule="static"``
    trains at ``bits_max`` throughout and ``schedule="fp32"`` in full precision, so baselines go through the same
    code path. Every field's meaning: ``CPTConfig.__dataclass_fields__[name].metadata["help"]``, or the README.
    """,
    },
)
