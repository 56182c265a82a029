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
    "CPTCallback": "trainer",
    "CPTTrainer": "trainer",
    "CPTConfig": "config",
    "CPTHfQuantizer": "hf_quantizer",
    "CPTQuantizationConfig": "hf_quantizer",
    "CostMeter": "cost",
    "bitops_per_mac": "cost",
    "relative_cost": "cost",
    "export_portable": "checkpoint",
    "save_quantized": "checkpoint",
    "output_fidelity": "fidelity",
    "PrecisionState": "layers",
    "QuantConv2d": "layers",
    "QuantLayerMixin": "layers",
    "QuantLinear": "layers",
    "register_quant_layer": "layers",
    "plot_schedule": "model_card",
    "PrecisionRangeResult": "prt",
    "precision_range_test": "prt",
    "fake_quantize": "quantizer",
    "quantize_error": "quantizer",
    "PrecisionSchedule": "schedules",
    "ScheduleShape": "schedules",
    "available_schedules": "schedules",
    "cost_group": "schedules",
    "get_schedule": "schedules",
    "register_schedule": "schedules",
    "QuantizationReport": "surgery",
    "dequantize_model": "surgery",
    "find_precision_state": "surgery",
    "quantize_model": "surgery",
    "set_eval_precision": "surgery",
    "set_precision": "surgery",
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
