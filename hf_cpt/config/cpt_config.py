"""`CPTConfig`: every setting of a Cyclic Precision Training run, validated up front.

The top level holds a user's choices (bits, schedule, cycles, delayed start, eval precision, which modules are
quantized, the fidelity check); the method's numerics options live in nested parts (``activations``, ``errors``,
``schedule_options``, ``range_test``), engine switches in ``runtime`` (never saved). Each field is declared once, in
the typed part it belongs to (`hf_cpt.config.parts`), which checks it. Flat keyword arguments are routed to their part
(``CPTConfig(error_granularity="token")`` sets ``config.errors.granularity``), and `to_dict` / `from_dict` use those
flat names, the format checkpoints and cost reports have always used. Named recipes: `CPTConfig.from_recipe`.
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from typing import Any

from ..numerics.errors import ErrorQuantization
from ..runtime import RuntimeSettings
from ..utils import ConfigError, callable_name, plain_numbers
from .parts import (
    PART_FIELDS,
    ActivationConfig,
    EvaluationConfig,
    ModuleSelection,
    RangeTestConfig,
    ScheduleConfig,
    WeightConfig,
)

logger = logging.getLogger(__name__)

# The ScheduleConfig fields that are method details rather than a user's choice: nested in ``schedule_options``.
SCHEDULE_OPTIONS = ("rounding", "delay_precision", "grad_schedule", "grad_bits_min")
# Where a run's default differs from a part's own: a bare ErrorQuantization() is the CPT paper's per-tensor
# min/max scheme (usable with quantize_error as is); a CPTConfig resolves the ranges and grids per layer and for
# the attention products (docs/backward.md).
RUN_ERRORS = ErrorQuantization(granularity="auto", range="auto")
# Engine switches that no longer exist (the CPU allocator layer, two float-op optimisations, ReLU masks): old
# configs and checkpoints that name them still load, with a deprecation note; their values are ignored.
REMOVED_SETTINGS = ("dropout_masks", "hand_back_buffers", "errors_in_place", "output_mappings",
                    "embedding_row_gradients", "relu_masks")
# Numerics options that no longer exist, with the one value that still means what it meant (never measured to help;
# any other value is an error rather than a silently different run).
REMOVED_OPTIONS = {"error_rotation": "none"}

# CPTConfig's top level: the user's choices, from the views that validate them.
TOP_LEVEL = (
    [(ScheduleConfig, name) for name in PART_FIELDS[ScheduleConfig] if name not in SCHEDULE_OPTIONS]
    + [(EvaluationConfig, "eval_bits"), (ModuleSelection, None), (EvaluationConfig, "fidelity_threshold")]
)


def _schedule_options_class() -> type:
    hints = typing.get_type_hints(ScheduleConfig)
    fields = {f.name: f for f in dataclasses.fields(ScheduleConfig)}
    specs = [(name, hints[name], dataclasses.field(default=fields[name].default, metadata=fields[name].metadata))
             for name in SCHEDULE_OPTIONS]
    return dataclasses.make_dataclass("ScheduleOptions", specs, frozen=True, namespace={
        "__module__": __name__,  # where it is importable by name: a pickled config finds its class
        "__doc__": "Schedule details: rounding of the smooth schedule, the delayed start's precision, the error "
                   "bits' own schedule (validated with the rest of the schedule by `CPTConfig`)."})


ScheduleOptions = _schedule_options_class()
PART_FIELDS[ScheduleOptions] = {name: name for name in SCHEDULE_OPTIONS}

# The nested parts: (field name, class, the default a CPTConfig starts from, its help).
NESTED_PARTS = (
    ("schedule_options", ScheduleOptions, ScheduleOptions(), "Rounding, delayed start precision, error schedule."),
    ("activations", ActivationConfig, ActivationConfig(), "How layer inputs are quantized (`ActivationConfig`)."),
    ("weights", WeightConfig, WeightConfig(), "How weights' ranges are chosen (`WeightConfig`)."),
    ("errors", ErrorQuantization, RUN_ERRORS, "How errors are quantized (`ErrorQuantization`)."),
    ("range_test", RangeTestConfig, RangeTestConfig(), "The precision range test (`RangeTestConfig`)."),
    ("runtime", RuntimeSettings, RuntimeSettings(), "Engine switches (`RuntimeSettings`), never saved."),
)
PART_CLASSES = {name: cls for name, cls, _, _ in NESTED_PARTS}
DEFAULT_PARTS = {name: default for name, _, default, _ in NESTED_PARTS}
# flat name -> (part field, the part's own name) for every nested setting
ROUTED = {flat: (part, own) for part, cls, _, _ in NESTED_PARTS for own, flat in PART_FIELDS[cls].items()}


def _top_level_specs() -> list[tuple[str, Any, dataclasses.Field]]:
    specs = []
    for part, only in TOP_LEVEL:
        hints = typing.get_type_hints(part)
        for own in dataclasses.fields(part):
            if only is None or own.name == only:
                specs.append((own.name, hints[own.name], dataclasses.field(default=own.default, metadata=own.metadata)))
    for name, cls, default, help_text in NESTED_PARTS:
        specs.append((name, cls, dataclasses.field(default=default, metadata={"help": help_text},
                                                   repr=name != "runtime", compare=name != "runtime")))
    return specs


class CPTConfigMethods:
    """What `CPTConfig` does with its fields."""

    def __post_init__(self) -> None:
        plain_numbers(self)
        self.validate()

    def validate(self) -> None:
        """Raise `ValueError` naming the first invalid field: each part checks its own fields, then the checks
        that span parts."""
        for name, cls in PART_CLASSES.items():
            value = self.__dict__[name]
            if isinstance(value, dict):  # a part given as a dict (a JSON file)
                value = self._routed_part(name, value)
                object.__setattr__(self, name, value)
            elif not isinstance(value, cls):
                raise ConfigError("CPTConfig", name, f"must be a {cls.__name__}, got {type(value).__name__}.")
        modules = self._view(ModuleSelection)
        for name in ("target_modules", "include_modules", "exclude_modules"):  # a string becomes a one-pattern list
            object.__setattr__(self, name, getattr(modules, name))
        self._view(ScheduleConfig)
        self._view(EvaluationConfig)
        if self.bits_min == "auto":
            try:
                self.range_test.check_max_bits(self.bits_max)
            except ConfigError as error:
                raise ConfigError("CPTConfig", "prt_start_bits", f"({self.range_test.start_bits}) must not exceed "
                                  f"CPTConfig.bits_max ({self.bits_max}).") from error
        self._check_error_grid()

    def _routed_part(self, name: str, values: dict[str, Any]) -> Any:
        cls = PART_CLASSES[name]
        try:
            return cls(**values)
        except TypeError as error:
            raise ConfigError("CPTConfig", name, f"got an unknown setting ({error}).") from None
        except ConfigError as error:
            raise error.renamed("CPTConfig", PART_FIELDS[cls].get(error.field, error.field)) from None

    def _check_error_grid(self) -> None:
        # A zero-centred grid at 1 bit has no level but zero: every error would vanish.
        error_range = self.errors.range
        zero_centred = error_range == "symmetric" or (error_range == "auto" and self.quantize_attention)
        options = self.schedule_options
        lowest, field = ((options.grad_bits_min, "grad_bits_min") if options.grad_schedule is not None
                         else (self.grad_bits, "grad_bits"))
        if zero_centred and lowest is not None and lowest < 2:
            where = "every error" if error_range == "symmetric" else "the attention products' errors"
            raise ConfigError("CPTConfig", "error_range",
                              f"({error_range!r}) puts {where} on the zero-centred grid, which needs at least "
                              f"2 bits ({field} is {lowest}); set error_range='minmax' or more error bits.")

    def _view(self, part: type) -> Any:
        """A part built from the top-level fields and ``schedule_options`` (validated)."""
        names = PART_FIELDS[part]
        try:
            return part(**{own: getattr(self, flat) for own, flat in names.items()})
        except ConfigError as error:
            raise error.renamed("CPTConfig", names.get(error.field, error.field)) from None

    # -- flat names of nested settings: read (and set) through their part --
    def __getattr__(self, name: str) -> Any:
        route = ROUTED.get(name)
        if route is None or route[0] not in self.__dict__:
            raise AttributeError(f"'CPTConfig' object has no attribute {name!r}")
        return getattr(self.__dict__[route[0]], route[1])

    def __setattr__(self, name: str, value: Any) -> None:
        route = ROUTED.get(name)
        if route is not None:
            part, own = route
            name, value = part, dataclasses.replace(self.__dict__[part], **{own: value})
        object.__setattr__(self, name, value)

    @property
    def schedule_config(self) -> ScheduleConfig:
        """The run's schedule settings (`ScheduleConfig`), which build its `PrecisionSchedule`."""
        return self._view(ScheduleConfig)

    @property
    def modules(self) -> ModuleSelection:
        return self._view(ModuleSelection)

    @property
    def evaluation(self) -> EvaluationConfig:
        return self._view(EvaluationConfig)

    @classmethod
    def from_recipe(cls, name: str, **overrides: Any) -> CPTConfig:
        """A named recipe (docs/method.md, "Recipes"), with ``overrides`` on top: ``"paper"`` (the CPT paper's exact
        scheme), ``"finetune"`` (the defaults for pretrained transformers), ``"from-scratch"``."""
        from .recipes import RECIPES

        if name not in RECIPES:
            raise ValueError(f"Unknown CPTConfig recipe {name!r}; choose one of {sorted(RECIPES)}.")
        return cls(**{**RECIPES[name], **overrides})

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
        """The settings as a JSON-safe flat dict (the runtime part left out); a callable schedule is written as its
        name (not restorable)."""
        values = {}
        for f in dataclasses.fields(self):
            if f.name == "runtime":
                continue
            if f.name in PART_CLASSES:
                part = getattr(self, f.name)
                values.update({flat: getattr(part, own) for own, flat in PART_FIELDS[type(part)].items()})
            else:
                value = getattr(self, f.name)
                values[f.name] = list(value) if isinstance(value, list) else value
        for name in ("schedule", "grad_schedule"):
            if callable(values[name]):
                values[name] = f"<callable {callable_name(values[name])}>"
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> CPTConfig:
        """A config from `to_dict`'s flat names (or nested parts as dicts); unknown names are an error."""
        return cls(**values)


def _route(values: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments with flat names of nested settings gathered into their parts; removed settings dropped with a
    deprecation note; unknown names are an error."""
    known = {f.name for f in dataclasses.fields(CPTConfig)}
    for name, kept in REMOVED_OPTIONS.items():
        if name in values and values.pop(name) != kept:
            raise ConfigError("CPTConfig", name, f"was removed; only {kept!r} (what every run now does) is accepted.")
    removed = sorted(set(values) & set(REMOVED_SETTINGS))
    if removed:
        logger.warning("hf_cpt: CPTConfig settings %s were removed (engine switches; for CPU memory use jemalloc "
                       "or tcmalloc, docs/compatibility.md) and are ignored.", removed)
    unknown = sorted(set(values) - known - set(ROUTED) - set(REMOVED_SETTINGS))
    if unknown:
        raise ValueError(f"Unknown CPTConfig field(s): {unknown}.")
    top = {name: value for name, value in values.items() if name in known}
    routed: dict[str, dict[str, Any]] = {}
    for flat, value in values.items():
        if flat in ROUTED and flat not in known:
            part, own = ROUTED[flat]
            routed.setdefault(part, {})[own] = value
    for part, changes in routed.items():
        base = top.get(part, DEFAULT_PARTS[part])
        if isinstance(base, dict):
            top[part] = {**base, **changes}
        else:
            top[part] = _replaced(part, base, changes)
    return top


def _replaced(part: str, base: Any, changes: dict[str, Any]) -> Any:
    try:
        return dataclasses.replace(base, **changes)
    except ConfigError as error:
        raise error.renamed("CPTConfig", PART_FIELDS[type(base)].get(error.field, error.field)) from None



CPTConfig = dataclasses.make_dataclass(
    "CPTConfig",
    _top_level_specs(),
    bases=(CPTConfigMethods,),
    namespace={
        "__module__": __name__,
        "__doc__": """Settings of a CPT run (docs/method.md §1-§5, docs/configuration.md).

    The forward bit-width of weights and input activations follows ``schedule`` between ``bits_min`` and
    ``bits_max``; errors are quantized at ``grad_bits`` (``errors`` says how). ``schedule="static"`` trains at
    ``bits_max`` throughout and ``schedule="fp32"`` in full precision, so baselines go through the same code
    path. Flat names of nested settings are accepted as keyword arguments (`flat_settings` lists them all).
    """,
    },
)
_generated_init = CPTConfig.__init__


def _init(self, *args: Any, **kwargs: Any) -> None:
    _generated_init(self, *args, **_route(kwargs))


_init.__doc__ = _generated_init.__doc__
CPTConfig.__init__ = _init


def flat_settings() -> list[tuple[str, Any, Any, str]]:
    """(flat name, type, default, help) of every setting, top level and nested (the recipes' ``--cpt_*`` flags)."""
    settings, hints = [], typing.get_type_hints(CPTConfig)
    for f in dataclasses.fields(CPTConfig):
        if f.name not in PART_CLASSES:
            settings.append((f.name, hints[f.name], f.default, f.metadata["help"]))
            continue
        cls, default = PART_CLASSES[f.name], f.default
        part_hints = typing.get_type_hints(cls)
        for own in dataclasses.fields(cls):
            if own.name in PART_FIELDS[cls]:
                settings.append((PART_FIELDS[cls][own.name], part_hints[own.name], getattr(default, own.name),
                                 own.metadata["help"]))
    return settings
