"""`CPTConfig`: every setting of a Cyclic Precision Training run, validated up front."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Union

MIN_BITS = 1
MAX_BITS = 32

ROUNDING_MODES = ("nearest", "ceil")
EVAL_PRECISIONS = ("max", "current", "fp32")
EMA_INITS = ("zeros", "first_batch")


@dataclass
class CPTConfig:
    """Settings of a CPT run (REFERENCE §1-§3).

    The forward bit-width of weights and input activations follows ``schedule`` between
    ``bits_min`` and ``bits_max``; errors are quantized at ``grad_bits`` with stochastic rounding.
    ``schedule="static"`` trains at ``bits_max`` throughout and ``schedule="fp32"`` trains in full
    precision, so baselines go through the same code path.
    """

    bits_min: Union[int, str] = field(
        default=3, metadata={"help": "Lower bound of the forward precision (bits)."}
    )
    bits_max: int = field(default=8, metadata={"help": "Upper bound of the forward precision (bits)."})
    grad_bits: int = field(
        default=8, metadata={"help": "Precision of the output error in the backward pass (bits)."}
    )
    schedule: str = field(
        default="cpt",
        metadata={"help": "Precision schedule: 'cpt' (cyclic cosine), 'static' (bits_max), 'fp32', ..."},
    )
    num_cycles: int = field(default=32, metadata={"help": "Number of precision cycles over the run."})
    rounding: str = field(
        default="nearest",
        metadata={"help": "How the smooth schedule becomes bits: 'nearest' (CPT code) or 'ceil' (CPT paper)."},
    )
    eval_bits: Union[int, str] = field(
        default="max",
        metadata={"help": "Evaluation precision: 'max' (bits_max), 'current' (schedule), 'fp32' or a bit-width."},
    )
    target_modules: Optional[list[str]] = field(
        default=None,
        metadata={"help": "Only quantize layers whose name matches one of these patterns (default: all)."},
    )
    include_modules: Optional[list[str]] = field(
        default=None,
        metadata={"help": "Quantize these layers even if kept in FP32 by default (e.g. the output head)."},
    )
    exclude_modules: Optional[list[str]] = field(
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
        from .schedules import available_schedules

        if self.schedule not in available_schedules():
            raise ValueError(
                f"CPTConfig.schedule={self.schedule!r} is unknown; choose one of {sorted(available_schedules())}."
            )
        if not isinstance(self.num_cycles, int) or isinstance(self.num_cycles, bool) or self.num_cycles < 1:
            raise ValueError(f"CPTConfig.num_cycles must be an integer >= 1, got {self.num_cycles!r}.")
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
        if self.activation_ema_init not in EMA_INITS:
            raise ValueError(
                f"CPTConfig.activation_ema_init must be one of {EMA_INITS}, got {self.activation_ema_init!r}."
            )

    def check_total_steps(self, total_steps: int) -> None:
        """Raise if the run is too short for the requested number of cycles."""
        if total_steps < 1:
            raise ValueError(f"A CPT run needs at least one optimizer step, got total_steps={total_steps}.")
        if self.schedule not in ("static", "fp32") and total_steps < self.num_cycles:
            raise ValueError(
                f"CPTConfig.num_cycles={self.num_cycles} gives cycles shorter than one step for a run of "
                f"{total_steps} optimizer steps; use at most {total_steps} cycles."
            )

    @property
    def eval_precision(self) -> Optional[int]:
        """Bits used in eval mode, None for full precision ('current' is resolved by the caller)."""
        if self.eval_bits == "fp32" or self.schedule == "fp32":
            return None
        if self.eval_bits in ("max", "current"):
            return self.bits_max
        return int(self.eval_bits)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "CPTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"Unknown CPTConfig field(s): {unknown}.")
        return cls(**values)


def _check_bits(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not MIN_BITS <= value <= MAX_BITS:
        raise ValueError(f"CPTConfig.{name} must be an integer in {MIN_BITS}..{MAX_BITS}, got {value!r}.")
