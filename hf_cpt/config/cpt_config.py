"""`CPTConfig`: every setting of a Cyclic Precision Training run, validated up front."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..numerics.bits import check_bits
from ..numerics.errors import (
    ERROR_GRANULARITY_CHOICES,
    ERROR_PRODUCTS,
    ERROR_ROTATIONS,
    ERROR_ROUNDINGS,
    ErrorQuantization,
)
from ..schedules.shapes import DELAY_PRECISIONS, ROUNDING_MODES, available_schedules
from ..utils import callable_name

logger = logging.getLogger(__name__)

# num_cycles="auto": one cycle per AUTO_STEPS_PER_CYCLE optimizer steps, at least 1 and at most AUTO_MAX_CYCLES.
AUTO_STEPS_PER_CYCLE = 100
AUTO_MAX_CYCLES = 32


def auto_cycles(schedule_steps: int) -> int:
    """``num_cycles="auto"``: one cycle per `AUTO_STEPS_PER_CYCLE` steps of the schedule, 1 to `AUTO_MAX_CYCLES`."""
    return min(AUTO_MAX_CYCLES, max(1, schedule_steps // AUTO_STEPS_PER_CYCLE))


EVAL_PRECISIONS = ("max", "current", "fp32")
EMA_INITS = ("zeros", "first_batch")
PRT_METRICS = ("loss", "accuracy")
# How activations are quantized (docs/method.md, "Pretrained transformers"): the CPT paper's per-tensor
# running range, per-token ranges, either after a fixed rotation of the input features, or "auto".
QUANT_SCHEMES = ("auto", "paper", "per-token", "rotated", "rotated-per-token")


@dataclass
class CPTConfig:
    """Settings of a CPT run (docs/method.md §1-§5).

    The forward bit-width of weights and input activations follows ``schedule`` between
    ``bits_min`` and ``bits_max``; errors are quantized at ``grad_bits`` with stochastic rounding.
    ``schedule="static"`` trains at ``bits_max`` throughout and ``schedule="fp32"`` trains in full
    precision, so baselines go through the same code path.
    """

    bits_min: int | str = field(
        default=4,
        metadata={
            "help": "Lower bound of the forward precision (bits), or 'auto' (the precision range test). 4 by "
            "default: the lowest at which every model of docs/pretrained.md passes the fidelity check (cosine "
            ">= 0.8); the CPT paper's from-scratch runs use 3."
        },
    )
    bits_max: int = field(default=8, metadata={"help": "Upper bound of the forward precision (bits)."})
    grad_bits: int = field(
        default=8, metadata={"help": "Precision of the output error in the backward pass (bits)."}
    )
    schedule: str | Callable[[int], int | None] = field(
        default="cpt",
        metadata={
            "help": "Precision schedule: a registered name ('cpt', 'cpt-triangular', 'cpt-cosine-anneal', 'CR', "
            "'CT', 'LR', 'LT', 'ER', 'ET-V', 'ET-H', 'RR', 'RT-V', 'RT-H', 'progressive', 'static', 'fp32'; "
            "see `python -m hf_cpt schedules`) or a callable step -> bits."
        },
    )
    num_cycles: int | str = field(
        default="auto",
        metadata={
            "help": "Number of precision cycles over the run, or 'auto': one per 100 optimizer steps of the "
            "schedule, from 1 to 32 (the CPT paper's 32 cycles over 64,000 steps; 2 for a 250-step fine-tune)."
        },
    )
    rounding: str = field(
        default="nearest",
        metadata={"help": "How the smooth schedule becomes bits: 'nearest' (CPT code) or 'ceil' (CPT paper)."},
    )
    eval_bits: int | str = field(
        default="max",
        metadata={"help": "Evaluation precision: 'max' (bits_max), 'current' (schedule), 'fp32' or a bit-width."},
    )
    target_modules: list[str] | None = field(
        default=None,
        metadata={"help": "Only quantize layers whose name matches one of these patterns (default: all)."},
    )
    include_modules: list[str] | None = field(
        default=None,
        metadata={"help": "Quantize these layers even if kept in FP32 by default (e.g. the output head)."},
    )
    exclude_modules: list[str] | None = field(
        default=None, metadata={"help": "Keep layers whose name matches one of these patterns in FP32."}
    )
    quantize_adapters: bool = field(
        default=False, metadata={"help": "Also quantize peft adapter layers (lora_A/lora_B)."}
    )
    activation_momentum: float = field(
        default=0.9, metadata={"help": "Momentum of the running activation min/max used in eval mode."}
    )
    activation_ema_init: str = field(
        default="zeros",
        metadata={"help": "Start of the running activation range: 'zeros' (CPT code) or 'first_batch'."},
    )
    delay: float = field(
        default=0.0,
        metadata={
            "help": "Delayed start: fraction of training (0 <= delay < 1) held at delay_precision before the "
            "schedule runs its cycles over the remaining steps (protects the critical early period)."
        },
    )
    delay_precision: str = field(
        default="max",
        metadata={"help": "Precision of the delayed start: 'max' (bits_max) or 'fp32' (full precision)."},
    )
    grad_schedule: str | Callable[[int], int | None] | None = field(
        default=None,
        metadata={
            "help": "Schedule of the error bits between grad_bits_min and grad_bits (a name or a callable); "
            "None (default): fixed grad_bits."
        },
    )
    grad_bits_min: int | None = field(
        default=None, metadata={"help": "Lower bound of the error bits when grad_schedule is set (bits)."}
    )
    prt_start_bits: int = field(
        default=2, metadata={"help": "Precision range test (bits_min='auto'): the precision it starts from (bits)."}
    )
    prt_steps_per_precision: int = field(
        default=20, metadata={"help": "Precision range test: training iterations at each precision."}
    )
    prt_threshold: float | None = field(
        default=None,
        metadata={
            "help": "Precision range test: improvement that marks bits_min (accuracy: absolute, loss: relative "
            "decrease); default 0.05 for accuracy, 0.1 for loss."
        },
    )
    prt_metric: str = field(
        default="loss",
        metadata={"help": "Precision range test metric: 'loss' (any model) or 'accuracy' (classification logits)."},
    )
    prt_window: int | None = field(
        default=None,
        metadata={"help": "Precision range test: iterations averaged per precision (default: a quarter of them)."},
    )
    prt_restore_weights: bool = field(
        default=True,
        metadata={
            "help": "Precision range test: restore weights, optimizer and RNG after each precision (True) or keep "
            "training through it as in the CPT paper (False)."
        },
    )
    quantize_embeddings: bool = field(
        default=False,
        metadata={
            "help": "Also quantize nn.Embedding tables (per row, at the schedule's bits; indices are not quantized) "
            "and an output head tied to them (weights only), so that small exact checkpoints come from training."
        },
    )
    quantize_attention: bool = field(
        default=False,
        metadata={
            "help": "Also quantize the two attention products (Q and K before Q·Kᵀ, probabilities and V before P·V, "
            "their errors on the backward pass), through transformers' attention interface; per token when the "
            "scheme is per-token. Needs a model that dispatches attention through AttentionInterface."
        },
    )
    quant_scheme: str = field(
        default="auto",
        metadata={
            "help": "Activation quantization: 'auto' (default: 'rotated-per-token' for Linear / GPT-2 Conv1D "
            "layers, 'paper' for Conv2d), 'paper' (the CPT paper's per-tensor running min/max, bit-exact), "
            "'per-token' (each token's own range), 'rotated' (per tensor after a Hadamard rotation of the input "
            "features) or 'rotated-per-token'. Pretrained transformers need 'rotated-per-token' below 6 bits."
        },
    )
    rotation_seed: int = field(
        default=0, metadata={"help": "Seed of the random signs of the Hadamard rotation (rotated schemes)."}
    )
    fidelity_threshold: float | None = field(
        default=0.8,
        metadata={
            "help": "At the start of training, warn when the model's output at bits_min on the first batch has a "
            "cosine similarity to full precision below this (None: no check)."
        },
    )
    error_granularity: str = field(
        default="auto",
        metadata={
            "help": "Ranges of the quantized errors (output gradients): 'tensor' (one per error tensor, the CPT "
            "paper), 'token' (one per row: each token's own range over the output features, per pixel for "
            "Conv2d; keeps tokens whose error is small from falling below one quantization step) or 'auto' "
            "(the default: per row in layers with per-token activations, per tensor in the others, e.g. Conv2d "
            "and every layer under quant_scheme='paper'; docs/backward.md)."
        },
    )
    error_rounding: str = field(
        default="stochastic",
        metadata={"help": "Rounding of the quantized errors: 'stochastic' (unbiased, the CPT paper) or 'nearest'."},
    )
    error_products: str = field(
        default="both",
        metadata={
            "help": "Backward products that use the quantized error: 'both' (the CPT paper), 'input' (the input "
            "gradient; the weight gradient from the full-precision error, as SwitchBack does, priced at 32-bit "
            "errors) or 'weight'."
        },
    )
    error_rotation: str = field(
        default="none",
        metadata={
            "help": "Orthogonal rotation of the error before quantizing (and back): 'none', 'features' (across the "
            "output features) or 'tokens' (across tokens, in Hadamard blocks of 64, as HALO does)."
        },
    )
    fused_error_quantizer: bool = field(
        default=True,
        metadata={
            "help": "Quantize errors with one compiled kernel and counter-based noise (falls back to eager)."
        },
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `ValueError` naming the first invalid field."""
        if not (isinstance(self.bits_min, str) and self.bits_min == "auto"):
            _check_bits("bits_min", self.bits_min)
        _check_bits("bits_max", self.bits_max)
        _check_bits("grad_bits", self.grad_bits)
        if isinstance(self.bits_min, int) and self.bits_min > self.bits_max:
            raise ValueError(
                f"CPTConfig.bits_min ({self.bits_min}) must not exceed CPTConfig.bits_max ({self.bits_max})."
            )
        _check_schedule("schedule", self.schedule)
        if self.bits_min == "auto" and callable(self.schedule):
            raise ValueError(
                "CPTConfig.bits_min='auto' needs a named schedule: a callable schedule does not use bits_min."
            )
        if (
            not isinstance(self.delay, (int, float))
            or isinstance(self.delay, bool)
            or not 0.0 <= self.delay < 1.0
        ):
            raise ValueError(f"CPTConfig.delay must be a fraction of training in [0, 1), got {self.delay!r}.")
        if self.delay_precision not in DELAY_PRECISIONS:
            raise ValueError(
                f"CPTConfig.delay_precision must be one of {DELAY_PRECISIONS}, got {self.delay_precision!r}."
            )
        if self.grad_schedule is not None:
            _check_schedule("grad_schedule", self.grad_schedule)
            if self.grad_bits_min is None:
                raise ValueError("CPTConfig.grad_bits_min is required when CPTConfig.grad_schedule is set.")
        if self.grad_bits_min is not None:
            _check_bits("grad_bits_min", self.grad_bits_min)
            if self.grad_bits_min > self.grad_bits:
                raise ValueError(
                    f"CPTConfig.grad_bits_min ({self.grad_bits_min}) must not exceed CPTConfig.grad_bits "
                    f"({self.grad_bits})."
                )
        _check_bits("prt_start_bits", self.prt_start_bits)
        if self.bits_min == "auto" and self.prt_start_bits > self.bits_max:
            raise ValueError(
                f"CPTConfig.prt_start_bits ({self.prt_start_bits}) must not exceed CPTConfig.bits_max "
                f"({self.bits_max})."
            )
        if (
            not isinstance(self.prt_steps_per_precision, int)
            or isinstance(self.prt_steps_per_precision, bool)
            or self.prt_steps_per_precision < 1
        ):
            raise ValueError(
                f"CPTConfig.prt_steps_per_precision must be an integer >= 1, got {self.prt_steps_per_precision!r}."
            )
        if self.prt_threshold is not None and (
            not isinstance(self.prt_threshold, (int, float))
            or isinstance(self.prt_threshold, bool)
            or not self.prt_threshold > 0
        ):
            raise ValueError(f"CPTConfig.prt_threshold must be a number > 0, got {self.prt_threshold!r}.")
        if self.prt_metric not in PRT_METRICS:
            raise ValueError(f"CPTConfig.prt_metric must be one of {PRT_METRICS}, got {self.prt_metric!r}.")
        if self.prt_window is not None and (
            not isinstance(self.prt_window, int)
            or isinstance(self.prt_window, bool)
            or not 1 <= self.prt_window <= self.prt_steps_per_precision
        ):
            raise ValueError(
                f"CPTConfig.prt_window must be an integer in 1..prt_steps_per_precision "
                f"({self.prt_steps_per_precision}), got {self.prt_window!r}."
            )
        if self.num_cycles != "auto" and (
            not isinstance(self.num_cycles, int) or isinstance(self.num_cycles, bool) or self.num_cycles < 1
        ):
            raise ValueError(f"CPTConfig.num_cycles must be an integer >= 1 or 'auto', got {self.num_cycles!r}.")
        if self.rounding not in ROUNDING_MODES:
            raise ValueError(f"CPTConfig.rounding must be one of {ROUNDING_MODES}, got {self.rounding!r}.")
        if isinstance(self.eval_bits, str):
            if self.eval_bits not in EVAL_PRECISIONS:
                raise ValueError(
                    f"CPTConfig.eval_bits must be a bit-width or one of {EVAL_PRECISIONS}, got {self.eval_bits!r}."
                )
        else:
            _check_bits("eval_bits", self.eval_bits)
        for name in ("target_modules", "include_modules", "exclude_modules"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, [value])
            elif value is not None and not all(isinstance(p, str) for p in value):
                raise ValueError(f"CPTConfig.{name} must be a list of module-name patterns, got {value!r}.")
        if not 0.0 <= self.activation_momentum < 1.0:
            raise ValueError(
                f"CPTConfig.activation_momentum must be in [0, 1), got {self.activation_momentum!r}."
            )
        if self.quant_scheme not in QUANT_SCHEMES:
            raise ValueError(f"CPTConfig.quant_scheme must be one of {QUANT_SCHEMES}, got {self.quant_scheme!r}.")
        if not isinstance(self.rotation_seed, int) or isinstance(self.rotation_seed, bool) or self.rotation_seed < 0:
            raise ValueError(f"CPTConfig.rotation_seed must be an integer >= 0, got {self.rotation_seed!r}.")
        if self.fidelity_threshold is not None and (
            not isinstance(self.fidelity_threshold, (int, float))
            or isinstance(self.fidelity_threshold, bool)
            or not -1.0 <= self.fidelity_threshold <= 1.0
        ):
            raise ValueError(
                f"CPTConfig.fidelity_threshold must be a cosine similarity in [-1, 1] or None, "
                f"got {self.fidelity_threshold!r}."
            )
        for name, choices in (("error_granularity", ERROR_GRANULARITY_CHOICES),
                              ("error_rounding", ERROR_ROUNDINGS),
                              ("error_products", ERROR_PRODUCTS), ("error_rotation", ERROR_ROTATIONS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"CPTConfig.{name} must be one of {choices}, got {getattr(self, name)!r}.")
        if self.activation_ema_init not in EMA_INITS:
            raise ValueError(
                f"CPTConfig.activation_ema_init must be one of {EMA_INITS}, got {self.activation_ema_init!r}."
            )

    @property
    def errors(self) -> ErrorQuantization:
        """How errors are quantized (``error_granularity='auto'`` is resolved per layer, by
        `ErrorQuantization.for_activations`)."""
        return ErrorQuantization(self.error_granularity, self.error_rounding, self.fused_error_quantizer,
                                 self.error_products, self.error_rotation)

    def _schedule_steps(self, total_steps: int) -> int:
        return total_steps - int(self.delay * total_steps)

    def cycles_for(self, total_steps: int) -> int:
        """The number of cycles over a run of ``total_steps`` optimizer steps (resolves ``num_cycles='auto'``)."""
        if self.num_cycles != "auto":
            return self.num_cycles
        return auto_cycles(self._schedule_steps(total_steps))

    def check_total_steps(self, total_steps: int) -> None:
        """Raise if the run is too short for the requested number of cycles; warn if its cycles are too short
        to visit every bit-width between ``bits_min`` and ``bits_max``."""
        if total_steps < 1:
            raise ValueError(f"A CPT run needs at least one optimizer step, got total_steps={total_steps}.")
        schedule_steps = self._schedule_steps(total_steps)
        if schedule_steps < 1:
            raise ValueError(
                f"CPTConfig.delay={self.delay} leaves no step of the {total_steps}-step run to the schedule."
            )
        shape = available_schedules().get(self.schedule) if isinstance(self.schedule, str) else None
        if shape is None or not shape.cyclic or shape.level is None:
            return
        cycles = self.cycles_for(total_steps)
        after_delay = " after the delay" if self.delay else ""
        if schedule_steps < cycles:
            raise ValueError(
                f"CPTConfig.num_cycles={cycles} gives cycles shorter than one step for a run of "
                f"{schedule_steps} optimizer steps{after_delay}; use at most {schedule_steps} cycles "
                f"or num_cycles='auto'."
            )
        levels = self.bits_max - self.bits_min + 1 if isinstance(self.bits_min, int) else None
        if levels is not None and schedule_steps / cycles < levels:
            logger.warning(
                "hf_cpt: CPTConfig.num_cycles=%d gives cycles of %.1f steps in a run of %d optimizer steps%s, "
                "fewer than the %d bit-widths from bits_min=%d to bits_max=%d each cycle should visit; "
                "num_cycles='auto' gives %d.",
                cycles, schedule_steps / cycles, schedule_steps, after_delay, levels, self.bits_min, self.bits_max,
                auto_cycles(schedule_steps),
            )

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


def _check_bits(name: str, value: Any) -> None:
    check_bits(f"CPTConfig.{name}", value)


def _check_schedule(name: str, value: Any) -> None:
    if callable(value) and not isinstance(value, str):
        return
    if not isinstance(value, str) or value not in available_schedules():
        raise ValueError(
            f"CPTConfig.{name}={value!r} is unknown; choose one of {sorted(available_schedules())}, "
            "or pass a callable step -> bits."
        )
