"""hf_cpt: Cyclic Precision Training for the Hugging Face ecosystem."""

from .config import CPTConfig
from .cost import CostMeter, bitops_per_mac, relative_cost
from .layers import PrecisionState, QuantConv2d, QuantLayerMixin, QuantLinear, register_quant_layer
from .quantizer import fake_quantize, quantize_error
from .schedules import PrecisionSchedule, ScheduleShape, available_schedules, register_schedule
from .surgery import (
    QuantizationReport,
    dequantize_model,
    find_precision_state,
    quantize_model,
    set_eval_precision,
    set_precision,
)
from .trainer import CPTCallback, CPTTrainer

__version__ = "0.1.0"

__all__ = [
    "CPTCallback",
    "CPTConfig",
    "CPTTrainer",
    "CostMeter",
    "PrecisionSchedule",
    "PrecisionState",
    "QuantConv2d",
    "QuantLayerMixin",
    "QuantLinear",
    "QuantizationReport",
    "ScheduleShape",
    "available_schedules",
    "bitops_per_mac",
    "dequantize_model",
    "fake_quantize",
    "find_precision_state",
    "quantize_error",
    "quantize_model",
    "register_quant_layer",
    "register_schedule",
    "relative_cost",
    "set_eval_precision",
    "set_precision",
]
