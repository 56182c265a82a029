"""hf_cpt: Cyclic Precision Training for the Hugging Face ecosystem.

Every public name loads its module on first use (as transformers does), so ``import hf_cpt`` imports neither
torch nor transformers; the ``cpt`` quantization method registers itself with transformers when transformers
loads its quantizer registry (`hf_cpt.registration`), so ``from_pretrained`` finds it.
"""

from __future__ import annotations

import importlib

from .registration import register_with_transformers
from .version import __version__

# public name -> the module that defines it
_EXPORTS = {
    "CPTCallback": "integrations.callback",
    "CPTTrainer": "integrations.trainer",
    "CPTConfig": "config",
    "ActivationConfig": "config",
    "EvaluationConfig": "config",
    "ModuleSelection": "config",
    "RangeTestConfig": "config",
    "ScheduleConfig": "config",
    "ScheduleOptions": "config",
    "RuntimeSettings": "runtime",
    "ErrorQuantization": "numerics.errors",
    "CheckpointFields": "serialization.format",
    "ExportSettings": "integrations.trainer",
    "CPTHfQuantizer": "serialization.loader",
    "CPTQuantizationConfig": "serialization.quantization_config",
    "CostMeter": "cost",
    "bitops_per_mac": "numerics.bitops",
    "relative_cost": "numerics.bitops",
    "export_compressed_tensors": "serialization.compressed_tensors",
    "export_portable": "serialization.save",
    "save_quantized": "serialization.save",
    "output_fidelity": "diagnostics.fidelity",
    "PrecisionState": "nn",
    "QuantConv2d": "nn",
    "QuantLayerMixin": "nn",
    "QuantLinear": "nn",
    "register_quant_layer": "nn",
    "plot_schedule": "serialization.model_card",
    "PrecisionRangeResult": "diagnostics.range_test",
    "precision_range_test": "diagnostics.range_test",
    "fake_quantize": "numerics.fake_quant",
    "quantize_error": "numerics.errors",
    "PrecisionSchedule": "schedules",
    "ScheduleShape": "schedules",
    "available_schedules": "schedules",
    "cost_group": "schedules",
    "get_schedule": "schedules",
    "register_schedule": "schedules",
    "QuantizationReport": "convert",
    "dequantize_model": "convert",
    "find_precision_state": "convert",
    "quantize_model": "convert",
    "quantize_adapters": "convert",
    "set_eval_precision": "convert",
    "set_precision": "convert",
}

__all__ = ["__version__", *sorted(_EXPORTS)]

register_with_transformers()


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
