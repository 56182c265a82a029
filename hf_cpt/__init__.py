"""hf_cpt: Cyclic Precision Training for the Hugging Face ecosystem."""

from .checkpoint import export_portable, save_quantized
from .config import CPTConfig
from .cost import CostMeter, bitops_per_mac, relative_cost
from .fidelity import output_fidelity
from .hf_quantizer import CPTHfQuantizer, CPTQuantizationConfig  # registers quant_method "cpt" with transformers
from .layers import PrecisionState, QuantConv2d, QuantLayerMixin, QuantLinear, register_quant_layer
from .model_card import plot_schedule
from .prt import PrecisionRangeResult, precision_range_test
from .quantizer import fake_quantize, quantize_error
from .schedules import (
    PrecisionSchedule,
    ScheduleShape,
    available_schedules,
    cost_group,
    get_schedule,
    register_schedule,
)
from .surgery import (
    QuantizationReport,
    dequantize_model,
    find_precision_state,
    quantize_model,
    set_eval_precision,
    set_precision,
)
from .version import __version__

# The Trainer integration imports transformers' Trainer (seconds); it loads on first use of these names.
_LAZY = {"CPTCallback": "trainer", "CPTTrainer": "trainer"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__all__ = [
    "__version__",
    "CPTCallback",
    "CPTConfig",
    "CPTHfQuantizer",
    "CPTQuantizationConfig",
    "CPTTrainer",
    "CostMeter",
    "PrecisionRangeResult",
    "PrecisionSchedule",
    "PrecisionState",
    "QuantConv2d",
    "QuantLayerMixin",
    "QuantLinear",
    "QuantizationReport",
    "ScheduleShape",
    "available_schedules",
    "bitops_per_mac",
    "cost_group",
    "dequantize_model",
    "export_portable",
    "fake_quantize",
    "find_precision_state",
    "get_schedule",
    "output_fidelity",
    "plot_schedule",
    "precision_range_test",
    "quantize_error",
    "quantize_model",
    "register_quant_layer",
    "register_schedule",
    "relative_cost",
    "save_quantized",
    "set_eval_precision",
    "set_precision",
]
