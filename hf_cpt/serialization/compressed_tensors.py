"""A compressed-tensors export, which transformers loads natively without hf_cpt (docs/clients.md): a CPT ``nn.Linear``
the format holds keeps its int8 codes (a float zero point puts CPT's minimum on the grid) and its input quantization;
what the format cannot hold runs in float with the trained weights, measured and named (``export_effect``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from typing import Any

import torch
from torch import nn

from ..config import CPTConfig
from ..convert import quant_layers
from ..nn.base import QuantLayerMixin
from .export import (
    _check_model,
    _model_settings,
    evaluated_at,
    measure_inputs_of,
    output_change,
    plan_export,
    resolve_export_bits,
)
from .format import CheckpointFields, check_export_bits
from .save import _finish_export, plain_model, staged_save, write_settings_file

FORMAT = "int-quantized"
EXACT_FLOAT = "weight-only, not an nn.Linear or tied: float, the same values"  # computes what the trained layer did
logger = logging.getLogger(__name__)
_INPUTS = {"token": {"strategy": "token", "dynamic": True}, "tensor": {"strategy": "tensor", "dynamic": False}}


def _arguments(bits: int, **extra: Any) -> dict[str, Any]:
    return {"num_bits": bits, "type": "int", "symmetric": False, "zp_dtype": "torch.float32", **extra}


def _float_reason(layer: QuantLayerMixin, shared: bool, input_rank: int | None) -> str | None:
    """Why a CPT layer runs in float in this format (None: it keeps its codes there)."""
    if not layer.quantizes_inputs:
        return None if isinstance(layer, nn.Linear) and not shared else EXACT_FLOAT
    if layer.rotation is not None:
        return "rotated inputs (transformers applies no compressed-tensors transforms): float, inputs not quantized"
    if not isinstance(layer, nn.Linear):
        return f"{type(layer).__name__} is not an nn.Linear: float, inputs not quantized"
    if shared:
        return "shares its weight with another module: float, inputs not quantized"
    if layer.cpt_granularity == "token" and input_rank not in (None, 3):  # the format's tokens: dims 0 and 1
        return f"{input_rank}-D inputs, which the format does not quantize per token: float, inputs not quantized"
    return None


def _watch_inputs(layers: dict[str, nn.Module], record: Any) -> list:
    """Forward pre-hooks that call ``record(name, input)`` and leave the inputs as they are."""
    def watcher(name: str) -> Any:
        def hook(_: nn.Module, args: tuple) -> None:
            record(name, args[0])
        return hook
    return [layer.register_forward_pre_hook(watcher(name)) for name, layer in layers.items()]


@torch.no_grad()
def _trained_forward(model: nn.Module, bits: int, inputs: dict[str, torch.Tensor]) -> tuple[Any, dict]:
    """(``model``'s output at ``bits`` in eval mode, the input each CPT layer saw, whose rank the export needs)."""
    seen: dict[str, torch.Tensor] = {}
    hooks = _watch_inputs(dict(quant_layers(model)), seen.setdefault)
    try:
        with evaluated_at(model, bits):
            return model(**inputs), seen
    finally:
        for hook in hooks:
            hook.remove()


def compressed_tensors_state_dict(
    model: nn.Module, bits: int, cpt_config: CPTConfig | None = None, ranks: dict[str, int] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any], CheckpointFields]:
    """(state dict, the format's ``quantization_config``, `CheckpointFields`) of ``model`` at ``bits``; ``ranks``: the
    rank of each CPT layer's input (per-token layers keep their codes only with 3-D inputs)."""
    _check_model(model)
    check_export_bits("bits", bits)
    plan = plan_export(model, bits, float_weight_bits=None)
    ranks = ranks or {}
    with torch.device("meta"):  # the keys a plain model of this class loads
        plain_keys = set(type(model)(model.config).state_dict())
    state_dict = {key: value for key, value in model.state_dict().items() if key in plain_keys}
    shared = set(plan.shared) | set(plan.shared.values())
    groups: dict[str, list[str]] = {}
    float_layers: dict[str, list[str]] = {}  # why -> the CPT layers
    half = 2 ** (bits - 1)
    for name, layer in plan.quantized.items():
        reason = _float_reason(layer, name in shared, ranks.get(name))
        if reason is not None:
            state_dict[f"{name}.weight"] = layer.quantized_weight(bits).to(layer.weight.dtype)
            if reason != EXACT_FLOAT:
                float_layers.setdefault(reason, []).append(name)
            continue
        codes, scale, minimum = layer.weight_codes(bits)
        state_dict[f"{name}.weight"] = (codes.to(torch.int16) - half).to(torch.int8).reshape(layer.weight.shape).cpu()
        state_dict[f"{name}.weight_scale"] = scale.float().reshape(-1, 1).cpu()
        state_dict[f"{name}.weight_zero_point"] = (-(minimum.float() / scale.float()) - half).reshape(-1, 1).cpu()
        if layer.cpt_granularity == "tensor":  # the running range, on the format's grid
            low, high = layer.act_min.detach().float(), layer.act_max.detach().float()
            input_scale = ((high - low) / (2**bits - 1)).clamp_min(1e-8)
            state_dict[f"{name}.input_scale"] = input_scale.reshape(1).cpu()
            state_dict[f"{name}.input_zero_point"] = (-(low / input_scale) - half).reshape(1).cpu()
        groups.setdefault(layer.cpt_granularity, []).append(name)
    settings = _model_settings(model, cpt_config)
    if settings["quantized_attention"] is not None:
        float_layers["not quantized in this format"] = ["attention products"]
    quantization_config = {
        "quant_method": "compressed-tensors", "format": FORMAT, "quantization_status": "compressed", "ignore": [],
        "config_groups": {
            f"group_{i}": {"targets": names, "weights": _arguments(bits, strategy="channel"), "format": FORMAT,
                           "input_activations": _arguments(bits, **_INPUTS[kind]) if kind in _INPUTS else None}
            for i, (kind, names) in enumerate(groups.items())
        },
    }
    fields = CheckpointFields(bits=bits, quantized_modules=list(plan.quantized), checkpoint_format="compressed-tensors",
        float_weight_bits=None,
        activation_ranges={n: [float(m.act_min), float(m.act_max)] for n, m in plan.quantized.items()},
        export_effect={"float_layers": float_layers}, **settings)
    return {key: value.contiguous() for key, value in state_dict.items()}, quantization_config, fields


@torch.no_grad()
def measure_export(model: nn.Module, save_directory: str, bits: int, before: Any, seen: dict[str, torch.Tensor],
                   inputs: dict[str, torch.Tensor], source: str) -> dict[str, Any]:
    """Load the export back; compare it with the trained model at ``bits``: the output, and each layer on its input."""
    parameter = next(model.parameters())
    loaded = type(model).from_pretrained(save_directory, dtype=parameter.dtype).to(parameter.device).eval()
    effect = output_change(before, loaded(**inputs), source)  # the first forward also decompresses the weights
    with evaluated_at(model, bits):
        pairs = {name: (model.get_submodule(name)(x).float(), loaded.get_submodule(name)(x).float())
                 for name, x in seen.items()}
    effect["layers"] = {name: float((new - old).abs().max() / old.abs().max().clamp_min(1e-12))
                        for name, (old, new) in pairs.items()}
    return effect


def check_compressed_tensors() -> None:
    """Raise, naming the package, where compressed-tensors (the reader the export loads itself back with) is absent."""
    if importlib.util.find_spec("compressed_tensors") is None:
        raise ImportError("A compressed-tensors export needs the compressed-tensors package, as every reader of the "
                          "format does: pip install compressed-tensors (or hf-cpt[clients]).")


def write_compressed_tensors(model: nn.Module, save_directory: str, bits: int, cpt_config: CPTConfig | None = None,
                             measure_inputs: dict[str, Any] | None = None, **save_kwargs: Any) -> CheckpointFields:
    """Write the weights, ``config.json`` and ``cpt_config.json`` of the export; measure it (`measure_export`)."""
    check_compressed_tensors()
    source, inputs = measure_inputs_of(model, measure_inputs)
    before, seen = _trained_forward(model, bits, inputs)
    ranks = {name: x.dim() for name, x in seen.items()}
    state_dict, quantization_config, fields = compressed_tensors_state_dict(model, bits, cpt_config, ranks)
    with plain_model(model):
        model.save_pretrained(save_directory, state_dict=state_dict, **save_kwargs)
    config_file = os.path.join(save_directory, "config.json")  # in a staging folder (`staged_save`)
    with open(config_file) as f:
        config = json.load(f)
    with open(config_file, "w") as f:
        json.dump({**config, "quantization_config": quantization_config}, f, indent=2)
    fields.export_effect.update(measure_export(model, save_directory, bits, before, seen, inputs, source))
    float_layers = fields.export_effect["float_layers"]
    if float_layers:
        reason, names = next(iter(float_layers.items()))
        logger.warning(
            "hf_cpt: the compressed-tensors export runs %d CPT layer(s) in float (e.g. %s: %s); the loaded model's "
            "output differs from the trained one's by %.3g (max relative, on %s); cpt_config.json lists them.",
            sum(map(len, float_layers.values())), names[0], reason,
            fields.export_effect["max_relative_output_change"], fields.export_effect["inputs"],
        )
    write_settings_file(save_directory, fields)
    return fields


def export_compressed_tensors(
    model: nn.Module,
    save_directory: str | os.PathLike,
    bits: int | None = None,
    *,
    cpt_config: CPTConfig | None = None,
    measure_inputs: dict[str, Any] | None = None,
    processing_class: Any = None,
    model_card: bool = True,
    card_info: dict[str, Any] | None = None,
    **save_kwargs: Any,
) -> str:
    """Write a compressed-tensors checkpoint of ``model`` at ``bits`` (default: ``cpt_config.bits_max``), loaded back
    and measured against ``model`` on ``measure_inputs`` (default: random valid inputs); other arguments as
    `save_quantized`.
    """
    check_compressed_tensors()
    save_directory = os.fspath(save_directory)
    bits = resolve_export_bits(model, bits, cpt_config)
    with staged_save(save_directory) as staging:
        fields = write_compressed_tensors(model, staging, bits, cpt_config, measure_inputs, **save_kwargs)
        _finish_export(model, staging, fields, cpt_config, processing_class, model_card, card_info)
    return save_directory
