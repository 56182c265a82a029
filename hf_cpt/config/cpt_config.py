"""`CPTConfig`: every setting of a Cyclic Precision Training run, validated up front.

Flat fields, so that ``CPTConfig(bits_min=4)``, ``HfArgumentParser`` and the recipes' ``--cpt_*`` flags work; the
config is composed of typed parts (`hf_cpt.config.parts`), which hold each check and the logic of their concern.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..numerics.errors import ErrorQuantization
from ..utils import ConfigError, callable_name
from .parts import PART_FIELDS, ActivationConfig, EvaluationConfig, ModuleSelection, RangeTestConfig, ScheduleConfig


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
            "help": "Precision schedule: a registered name (the CPT paper's 'cpt' by default; `python -m hf_cpt "
            "schedules` lists them all, docs/schedules.md explains them) or a callable step -> bits."
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
        """Raise `ValueError` naming the first invalid field: each part checks its own fields, then the checks
        that span parts."""
        for part in PART_FIELDS:
            self._part(part)
        self.modules  # noqa: B018 - normalizes the module patterns (a string becomes a one-pattern list)
        for name in ("target_modules", "include_modules", "exclude_modules"):
            value = getattr(self.modules, name)
            setattr(self, name, list(value) if value is not None else None)
        if self.bits_min == "auto":
            try:
                self.range_test.check_max_bits(self.bits_max)
            except ConfigError as error:
                raise ConfigError("CPTConfig", "prt_start_bits", f"({self.prt_start_bits}) must not exceed "
                                  f"CPTConfig.bits_max ({self.bits_max}).") from error

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

    @property
    def schedule_config(self) -> ScheduleConfig:
        """Bounds, schedule, cycles and delayed start; it builds the run's schedules (`forward_schedule`)."""
        return self._part(ScheduleConfig)

    @property
    def activations(self) -> ActivationConfig:
        return self._part(ActivationConfig)

    @property
    def errors(self) -> ErrorQuantization:
        """How errors are quantized (``error_granularity='auto'`` is resolved per layer, by
        `ErrorQuantization.for_activations`)."""
        return self._part(ErrorQuantization)

    @property
    def modules(self) -> ModuleSelection:
        return self._part(ModuleSelection)

    @property
    def range_test(self) -> RangeTestConfig:
        return self._part(RangeTestConfig)

    @property
    def evaluation(self) -> EvaluationConfig:
        return self._part(EvaluationConfig)

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
