"""`CPTConfig`, every setting of a CPT run, composed of small typed parts (`hf_cpt.config.parts`)."""

from .cpt_config import CPTConfig, ScheduleOptions, flat_settings
from .parts import (
    AUTO_MAX_CYCLES,
    AUTO_STEPS_PER_CYCLE,
    EMA_INITS,
    EVAL_PRECISIONS,
    QUANT_SCHEMES,
    ActivationConfig,
    EvaluationConfig,
    ModuleSelection,
    RangeTestConfig,
    ScheduleConfig,
    WeightConfig,
    auto_cycles,
)

__all__ = ["AUTO_MAX_CYCLES", "AUTO_STEPS_PER_CYCLE", "EMA_INITS", "EVAL_PRECISIONS", "QUANT_SCHEMES",
    "ActivationConfig", "CPTConfig", "EvaluationConfig", "ModuleSelection", "RangeTestConfig", "ScheduleConfig",
    "ScheduleOptions", "WeightConfig", "auto_cycles", "flat_settings"]
