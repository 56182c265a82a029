"""The typed parts of a `CPTConfig`, each validating its own fields (in the manner of torchao's QAT configs).

A part names its own fields in errors (``ScheduleConfig.bits_min must be ...``); `CPTConfig` builds its parts
from its flat fields and re-raises an error under the flat name the user set (``CPTConfig.bits_min``). The
error part is `hf_cpt.numerics.errors.ErrorQuantization`, which the layers read directly.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..numerics.bits import bits_problem
from ..numerics.errors import ErrorQuantization
from ..numerics.fake_quant import WEIGHT_RANGES
from ..runtime import RuntimeSettings
from ..schedules import (
    DELAY_PRECISIONS,
    ROUNDING_MODES,
    PrecisionSchedule,
    available_schedules,
    check_schedule_name,
    steps_after_delay,
)
from ..utils import ConfigError, check_choice, is_int, is_number, plain_numbers, setting

logger = logging.getLogger(__name__)

# num_cycles="auto": one cycle per AUTO_STEPS_PER_CYCLE optimizer steps, at least 1 and at most AUTO_MAX_CYCLES.
AUTO_STEPS_PER_CYCLE = 100
AUTO_MAX_CYCLES = 32
EVAL_PRECISIONS = ("max", "current", "fp32")
EMA_INITS = ("zeros", "first_batch")
NONFINITE_INPUT_ACTIONS = ("raise", "skip")
# How activations are quantized (docs/method.md, "Pretrained transformers"): the CPT paper's per-tensor
# running range, per-token ranges, either after a fixed rotation of the input features, or "auto".
QUANT_SCHEMES = ("auto", "paper", "per-token", "rotated", "rotated-per-token")
RANGE_TEST_METRICS = ("loss", "accuracy")
DEFAULT_RANGE_TEST_THRESHOLDS = {"accuracy": 0.05, "loss": 0.1}  # absolute for accuracy, relative for the loss


def auto_cycles(schedule_steps: int) -> int:
    """``num_cycles="auto"``: one cycle per `AUTO_STEPS_PER_CYCLE` steps of the schedule, 1 to `AUTO_MAX_CYCLES`."""
    return min(AUTO_MAX_CYCLES, max(1, schedule_steps // AUTO_STEPS_PER_CYCLE))


def _bits(owner: str, name: str, value: Any) -> None:
    problem = bits_problem(value)
    if problem is not None:
        raise ConfigError(owner, name, problem)


@dataclass(frozen=True)
class ScheduleConfig:
    """Forward and error precision over the run: bounds, schedule, cycles, delayed start."""

    bits_min: int | str = setting(
        4,
        "Lower bound of the forward precision (bits), or 'auto' (the precision range test). 4 by default: the "
        "lowest at which every model of docs/pretrained.md passes the fidelity check (cosine >= 0.8); the CPT "
        "paper's from-scratch runs use 3."
    )
    bits_max: int = setting(8, "Upper bound of the forward precision (bits).")
    grad_bits: int = setting(8, "Precision of the output error in the backward pass (bits).")
    schedule: str | Callable[[int], int | None] = setting(
        "cpt",
        "Precision schedule: a registered name (the CPT paper's 'cpt' by default; `python -m hf_cpt schedules` "
        "lists them all, docs/schedules.md explains them) or a callable step -> bits."
    )
    num_cycles: int | str = setting(
        "auto",
        "Number of precision cycles over the run, or 'auto': one per 100 optimizer steps of the schedule, from 1 "
        "to 32 (the CPT paper's 32 cycles over 64,000 steps; 2 for a 250-step fine-tune)."
    )
    rounding: str = setting("nearest", "Smooth schedule to bits: 'nearest' (CPT code) or 'ceil' (CPT paper).")
    delay: float = setting(
        0.0,
        "Delayed start: fraction of training (0 <= delay < 1) held at delay_precision before the schedule runs "
        "its cycles over the remaining steps (protects the critical early period)."
    )
    delay_precision: str = setting("max", "Precision of the delayed start: 'max' (bits_max) or 'fp32' (unquantized).")
    grad_schedule: str | Callable[[int], int | None] | None = setting(
        None,
        "Schedule of the error bits between grad_bits_min and grad_bits (a name or a callable); None (default): "
        "fixed grad_bits."
    )
    grad_bits_min: int | None = setting(None, "Lower bound of the error bits when grad_schedule is set (bits).")

    def __post_init__(self) -> None:
        plain_numbers(self)
        owner = type(self).__name__
        if self.bits_min != "auto":
            _bits(owner, "bits_min", self.bits_min)
        _bits(owner, "bits_max", self.bits_max)
        _bits(owner, "grad_bits", self.grad_bits)
        if is_int(self.bits_min) and self.bits_min > self.bits_max:
            raise ConfigError(owner, "bits_min", f"({self.bits_min}) must not exceed bits_max ({self.bits_max}).")
        check_schedule_name(owner, "schedule", self.schedule)
        if self.bits_min == "auto" and callable(self.schedule):
            raise ConfigError(owner, "bits_min", "='auto' needs a named schedule: a callable does not use bits_min.")
        if not is_number(self.delay) or not 0.0 <= self.delay < 1.0:
            raise ConfigError(owner, "delay", f"must be a fraction of training in [0, 1), got {self.delay!r}.")
        check_choice(owner, "delay_precision", self.delay_precision, DELAY_PRECISIONS)
        check_choice(owner, "rounding", self.rounding, ROUNDING_MODES)
        if self.num_cycles != "auto" and (not is_int(self.num_cycles) or self.num_cycles < 1):
            raise ConfigError(owner, "num_cycles", f"must be an integer >= 1 or 'auto', got {self.num_cycles!r}.")
        if self.grad_schedule is not None:
            check_schedule_name(owner, "grad_schedule", self.grad_schedule)
            if self.grad_bits_min is None:
                raise ConfigError(owner, "grad_bits_min", "is required when grad_schedule is set.")
        if self.grad_bits_min is not None:
            _bits(owner, "grad_bits_min", self.grad_bits_min)
            if self.grad_bits_min > self.grad_bits:
                raise ConfigError(owner, "grad_bits_min",
                                  f"({self.grad_bits_min}) must not exceed grad_bits ({self.grad_bits}).")

    def cycles_for(self, total_steps: int) -> int:
        """The number of cycles over a run of ``total_steps`` optimizer steps (resolves ``num_cycles='auto'``)."""
        if self.num_cycles != "auto":
            return self.num_cycles
        return auto_cycles(steps_after_delay(total_steps, self.delay))

    def forward_schedule(self, total_steps: int, bits_min: int | None = None) -> PrecisionSchedule:
        """The forward-bits schedule over ``total_steps`` optimizer steps; ``bits_min`` overrides the bound (the
        precision range test's choice for ``bits_min="auto"``). The schedule validates the run length; a
        warning says when cycles are too short to visit every bit-width between the bounds."""
        bits_min = self.bits_min if bits_min is None else bits_min
        if bits_min == "auto":
            raise ValueError("CPTConfig.bits_min='auto' must be resolved by the precision range test first.")
        if not is_int(total_steps) or total_steps < 1:
            raise ValueError(f"A CPT run needs at least one optimizer step, got total_steps={total_steps}.")
        schedule = PrecisionSchedule(self.schedule, bits_min, self.bits_max, total_steps, self.cycles_for(total_steps),
                                     self.rounding, delay=self.delay, delay_precision=self.delay_precision)
        self._warn_short_cycles(schedule)
        return schedule

    def error_schedule(self, total_steps: int) -> PrecisionSchedule | None:
        """The error-bits schedule (None: fixed ``grad_bits``); held at ``grad_bits`` during a delayed start."""
        if self.grad_schedule is None:
            return None
        return PrecisionSchedule(self.grad_schedule, self.grad_bits_min, self.grad_bits, total_steps,
                                 self.cycles_for(total_steps), self.rounding, delay=self.delay, delay_precision="max")

    def _warn_short_cycles(self, schedule: PrecisionSchedule) -> None:
        shape = available_schedules().get(self.schedule) if isinstance(self.schedule, str) else None
        if shape is None or not shape.cyclic or shape.level is None:
            return
        levels = schedule.bits_max - schedule.bits_min + 1
        steps, cycles = schedule.schedule_steps, schedule.num_cycles
        if steps / cycles < levels:
            after_delay = " after the delay" if self.delay else ""
            logger.warning(
                "hf_cpt: CPTConfig.num_cycles=%d gives cycles of %.1f steps in a run of %d optimizer steps%s, "
                "fewer than the %d bit-widths from bits_min=%d to bits_max=%d each cycle should visit; "
                "num_cycles='auto' gives %d.",
                cycles, steps / cycles, steps, after_delay, levels, schedule.bits_min, schedule.bits_max,
                auto_cycles(steps),
            )


@dataclass(frozen=True)
class ActivationConfig:
    """How layer inputs are quantized: the scheme, its rotation, the running range used in eval mode."""

    quant_scheme: str = setting(
        "auto",
        "Activation quantization: 'auto' (default: 'rotated-per-token' for Linear / GPT-2 Conv1D layers, 'paper' "
        "for Conv2d), 'paper' (the CPT paper's per-tensor running min/max, bit-exact), 'per-token' (each token's "
        "own range), 'rotated' (per tensor after a Hadamard rotation of the input features) or "
        "'rotated-per-token'. Pretrained transformers need 'rotated-per-token' below 6 bits."
    )
    rotation_seed: int = setting(0, "Seed of the random signs of the Hadamard rotation (rotated schemes).")
    momentum: float = setting(0.9, "Momentum of the running activation min/max used in eval mode.")
    ema_init: str = setting("zeros", "Start of the running activation range: 'zeros' (CPT code) or 'first_batch'.")
    nonfinite_inputs: str = setting(
        "raise", "A NaN or inf in a layer's training input never enters its running range: 'raise' (default: a data "
        "bug) stops the Trainer run at that step naming the layers; 'skip' counts them (logged, one warning).")

    def __post_init__(self) -> None:
        plain_numbers(self)
        owner = type(self).__name__
        check_choice(owner, "quant_scheme", self.quant_scheme, QUANT_SCHEMES)
        if not is_int(self.rotation_seed) or self.rotation_seed < 0:
            raise ConfigError(owner, "rotation_seed", f"must be an integer >= 0, got {self.rotation_seed!r}.")
        if not is_number(self.momentum) or not 0.0 <= self.momentum < 1.0:
            raise ConfigError(owner, "momentum", f"must be in [0, 1), got {self.momentum!r}.")
        check_choice(owner, "ema_init", self.ema_init, EMA_INITS)
        check_choice(owner, "nonfinite_inputs", self.nonfinite_inputs, NONFINITE_INPUT_ACTIONS)


@dataclass(frozen=True)
class WeightConfig:
    """How a weight's per-output-channel quantization range is chosen (`hf_cpt.numerics.fake_quant.weight_ranges`)."""

    range: str = setting(
        "minmax",
        "Each output channel's weight range: 'minmax' (the CPT paper's, bit-exact) or 'mse' (clipped to the ratio, "
        "1 down to 0.55, of least squared error at the current bits; exports and loaded models keep it).")

    def __post_init__(self) -> None:
        check_choice(type(self).__name__, "range", self.range, WEIGHT_RANGES)


@dataclass(frozen=True)
class ModuleSelection:
    """Which modules become CPT layers: patterns, opt-ins for embeddings, attention and adapters."""

    target_modules: list[str] | None = setting(
        None, "Only quantize layers whose name matches one of these patterns (default: all).")
    include_modules: list[str] | None = setting(
        None, "Quantize these layers even if kept in FP32 by default (e.g. the output head).")
    exclude_modules: list[str] | None = setting(None, "Keep layers whose name matches one of these patterns in FP32.")
    quantize_adapters: bool = setting(False, "Also quantize peft adapter layers (lora_A/lora_B).")
    quantize_embeddings: bool = setting(
        False,
        "Also quantize nn.Embedding tables (per row, at the schedule's bits; indices are not quantized) and an "
        "output head tied to them (weights only), so that small exact checkpoints come from training."
    )
    quantize_attention: bool = setting(
        False,
        "Also quantize the two attention products (Q and K before Q·Kᵀ, probabilities and V before P·V, their "
        "errors on the backward pass), through transformers' attention interface; per token when the scheme is "
        "per-token. Needs a model that dispatches attention through AttentionInterface."
    )
    attention_bits: int | None = setting(
        None,
        "With quantize_attention: the bit-width of the attention products. None follows the schedule (the layers' "
        "bits); an integer (e.g. 8) holds them there while the layers cycle (accuracy and cost measured in "
        "docs/backward.md). Full-precision steps stay full precision."
    )
    attention_errors: bool = setting(
        True,
        "With quantize_attention: quantize the attention products' errors in the backward pass at the error bits "
        "(True), or keep them in full precision (False: those two backward products are priced at 32-bit errors). "
        "Which half of the attention's accuracy cost each causes: docs/backward.md."
    )

    def __post_init__(self) -> None:
        plain_numbers(self)
        owner = type(self).__name__
        if self.attention_bits is not None:
            _bits(owner, "attention_bits", self.attention_bits)
            if not self.quantize_attention:
                raise ConfigError(owner, "attention_bits", f"({self.attention_bits}) needs quantize_attention=True "
                                  "(the attention products are full precision otherwise).")
        if not self.attention_errors and not self.quantize_attention:
            raise ConfigError(owner, "attention_errors", "=False needs quantize_attention=True (without it the "
                              "attention products and their errors are full precision already).")
        for name in ("target_modules", "include_modules", "exclude_modules"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, [value])
            elif value is not None:
                if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value):
                    raise ConfigError(owner, name, f"must be a list of module-name patterns, got {value!r}.")
                object.__setattr__(self, name, list(value))
            for pattern in getattr(self, name) or ():
                try:
                    re.compile(pattern)
                except re.error as error:
                    raise ConfigError(owner, name, f"pattern {pattern!r} is no regular expression ({error}); a pattern "
                                      "is a module's name, a dotted suffix of it or a regular expression (a glob's "
                                      "'*' is '.*').") from None


@dataclass(frozen=True)
class RangeTestConfig:
    """The precision range test (``bits_min="auto"``, docs/method.md §6)."""

    start_bits: int = setting(2, "Precision range test (bits_min='auto'): the precision it starts from (bits).")
    steps_per_precision: int = setting(20, "Precision range test: training iterations at each precision.")
    threshold: float | None = setting(
        None,
        "Precision range test: improvement that marks bits_min (accuracy: absolute, loss: relative decrease); "
        "default 0.05 for accuracy, 0.1 for loss."
    )
    metric: str = setting("loss",
        "Precision range test metric: 'loss' (any model) or 'accuracy' (classification logits).")
    window: int | None = setting(None,
        "Precision range test: iterations averaged per precision (default: a quarter of them).")
    restore_weights: bool = setting(
        True,
        "Precision range test: restore weights, optimizer and RNG after each precision (True) or keep training "
        "through it as in the CPT paper (False)."
    )

    def __post_init__(self) -> None:
        plain_numbers(self)
        owner = type(self).__name__
        _bits(owner, "start_bits", self.start_bits)
        if not is_int(self.steps_per_precision) or self.steps_per_precision < 1:
            raise ConfigError(owner, "steps_per_precision",
                              f"must be an integer >= 1, got {self.steps_per_precision!r}.")
        if self.threshold is not None and (not is_number(self.threshold) or not self.threshold > 0):
            raise ConfigError(owner, "threshold", f"must be a number > 0, got {self.threshold!r}.")
        check_choice(owner, "metric", self.metric, RANGE_TEST_METRICS)
        if self.window is not None and (not is_int(self.window) or not 1 <= self.window <= self.steps_per_precision):
            raise ConfigError(owner, "window", f"must be an integer in 1..steps_per_precision "
                                               f"({self.steps_per_precision}), got {self.window!r}.")

    @property
    def resolved_threshold(self) -> float:
        return float(self.threshold if self.threshold is not None else DEFAULT_RANGE_TEST_THRESHOLDS[self.metric])

    @property
    def resolved_window(self) -> int:
        return self.window if self.window is not None else max(1, self.steps_per_precision // 4)

    def check_max_bits(self, max_bits: int) -> None:
        if self.start_bits > max_bits:
            raise ConfigError(type(self).__name__, "start_bits",
                              f"({self.start_bits}) must not exceed the highest precision tested ({max_bits}).")


@dataclass(frozen=True)
class EvaluationConfig:
    """The precision of eval mode and the fidelity check at the start of training."""

    eval_bits: int | str = setting("max",
        "Evaluation precision: 'max' (bits_max), 'current' (schedule), 'fp32' or a bit-width.")
    fidelity_threshold: float | None = setting(
        0.8,
        "At the start of training, warn when the model's output at bits_min on the first batch has a cosine "
        "similarity to full precision below this (None: no check)."
    )

    def __post_init__(self) -> None:
        plain_numbers(self)
        owner = type(self).__name__
        if isinstance(self.eval_bits, str):
            check_choice(owner, "eval_bits", self.eval_bits, EVAL_PRECISIONS)
        else:
            _bits(owner, "eval_bits", self.eval_bits)
        if self.fidelity_threshold is not None and (
            not is_number(self.fidelity_threshold) or not -1.0 <= self.fidelity_threshold <= 1.0
        ):
            raise ConfigError(owner, "fidelity_threshold",
                              f"must be a cosine similarity in [-1, 1] or None, got {self.fidelity_threshold!r}.")


# Each part (the error part is `ErrorQuantization`), and its fields' flat names in CPTConfig.
PART_FIELDS: dict[type, dict[str, str]] = {}


def _register(part: type, renames: dict[str, str] | None = None) -> None:
    renames = renames or {}
    PART_FIELDS[part] = {name: renames.get(name, name) for name in part.__dataclass_fields__}


_register(ScheduleConfig)
_register(ActivationConfig, {"momentum": "activation_momentum", "ema_init": "activation_ema_init"})
_register(WeightConfig, {"range": "weight_range"})
_register(ModuleSelection)
_register(RangeTestConfig, {"start_bits": "prt_start_bits", "steps_per_precision": "prt_steps_per_precision",
                            "threshold": "prt_threshold", "metric": "prt_metric", "window": "prt_window",
                            "restore_weights": "prt_restore_weights"})
_register(EvaluationConfig)
_register(RuntimeSettings)
_register(ErrorQuantization, {"granularity": "error_granularity", "rounding": "error_rounding",
                              "products": "error_products", "range": "error_range",
                              "input_product": "input_gradient_product", "weight_product": "weight_gradient_product"})
