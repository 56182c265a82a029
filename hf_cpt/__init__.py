"""hf_cpt: Cyclic Precision Training for the Hugging Face ecosystem.

Every public name loads its module on first use (as transformers does), so ``import hf_cpt`` imports neither
torch nor transformers; the ``cpt`` quantization method registers itself with transformers when transformers
loads its quantizer registry (`hf_cpt.registration`), so ``from_pretrained`` finds it.
"""

from __future__ import annotations

import importlib

from .registration import register_with_transformers
from .version import __version__

# the module that defines them -> public names
_MODULES = {
    "integrations.callback": ["CPTCallback"],
    "integrations.trainer": ["CPTTrainer", "ExportSettings"],
    "config": ["CPTConfig", "ActivationConfig", "EvaluationConfig", "ModuleSelection", "RangeTestConfig",
        "ScheduleConfig", "ScheduleOptions", "WeightConfig"],
    "runtime": ["RuntimeSettings"],
    "numerics.errors": ["ErrorQuantization", "quantize_error"],
    "serialization.format": ["CheckpointFields"],
    "serialization.loader": ["CPTHfQuantizer"],
    "serialization.quantization_config": ["CPTQuantizationConfig"],
    "cost": ["CostMeter"],
    "numerics.bitops": ["bitops_per_mac", "relative_cost"],
    "serialization.compressed_tensors": ["export_compressed_tensors"],
    "serialization.save": ["export_portable", "save_quantized"],
    "diagnostics.fidelity": ["output_fidelity"],
    "nn": ["PrecisionState", "QuantConv2d", "QuantLayerMixin", "QuantLinear", "register_quant_layer"],
    "serialization.model_card": ["plot_schedule"],
    "diagnostics.range_test": ["PrecisionRangeResult", "precision_range_test"],
    "numerics.fake_quant": ["fake_quantize"],
    "schedules": ["PrecisionSchedule", "ScheduleShape", "available_schedules", "cost_group", "get_schedule",
        "register_schedule"],
    "convert": ["QuantizationReport", "dequantize_model", "find_precision_state", "quantize_model", "quantize_adapters",
        "set_eval_precision", "set_precision"],
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}

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
