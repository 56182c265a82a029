"""A compressed-tensors export: the quantized format transformers loads natively (with the ``compressed-tensors``
package), for readers that never import hf_cpt (docs/clients.md).

A CPT ``nn.Linear`` whose scheme the format holds keeps its trained int8 codes per output channel, with a float zero
point that puts CPT's channel minimum on the format's grid, and its input quantization (per token, or over the stored
running range); it computes what the trained layer computes, to float rounding. What the format cannot hold runs in
float with the trained weights, and the export measures and names it (``export_effect``).
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
from ..nn.base import QuantLayerMixin
from .export import _check_model, _default_inputs, _model_settings, output_change, plan_export, resolve_export_bits
from .format import CheckpointFields, check_export_bits
from .save import _finish_export, plain_model, staged_save, write_settings_file

FORMAT = "int-quantized"
logger = logging.getLogger(__name__)
_INPUTS = {"token": {"strategy": "token", "dynamic": True}, "tensor": {"strategy": "tensor", "dynamic": False}}


def _arguments(bits: int, **extra: Any) -> dict[str, Any]:
    return {"num_bits": bits, "type": "int", "symmetric": False, "zp_dtype": "torch.float32", **extra}


def _float_reason(layer: QuantLayerMixin, shared: bool, input_rank: int | None) -> str | None:
    """Why a CPT layer runs in float in this format (None: it keeps its codes there); weight-only layers are exact."""
    if not layer.quantizes_inputs:
        return None if isinstance(layer, nn.Linear) and not shared else ""
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
def _input_ranks(model: nn.Module, layers: dict[str, nn.Module], inputs: dict[str, torch.Tensor]) -> dict[str, int]:
    """The rank of each layer's input on ``inputs`` (the format's per-token ranges are per (dim 0, dim 1) index)."""
    ranks: dict[str, int] = {}
    hooks = _watch_inputs(layers, lambda name, x: ranks.setdefault(name, x.dim()))
    was_training = model.training
    try:
        model.eval()(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    return ranks


def compressed_tensors_state_dict(
    model: nn.Module, bits: int, cpt_config: CPTConfig | None = None, inputs: dict[str, torch.Tensor] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any], CheckpointFields]:
    """(state dict, the format's ``quantization_config``, `CheckpointFields`) of ``model`` at ``bits``; ``inputs``
    (default: random valid inputs) show the rank of each layer's input."""
    _check_model(model)
    check_export_bits("bits", bits)
    plan = plan_export(model, bits, float_weight_bits=None)
    ranks = _input_ranks(model, plan.quantized, inputs if inputs is not None else _default_inputs(model))
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
            if reason:
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
def measure_export(
    model: nn.Module, save_directory: str, fields: CheckpointFields, inputs: dict[str, torch.Tensor] | None = None
) -> dict[str, Any]:
    """Load the export back (transformers + compressed-tensors) and compare it with ``model`` evaluated at the
    export bits: the whole output, and each CPT layer on the input it sees in the trained model."""
    source = "evaluation batch" if inputs is not None else "random valid inputs"
    inputs = dict(inputs) if inputs is not None else _default_inputs(model)
    parameter = next(model.parameters())
    loaded = type(model).from_pretrained(save_directory, dtype=parameter.dtype).to(parameter.device).eval()
    layers = {name: model.get_submodule(name) for name in fields.quantized_modules}
    seen: dict[str, torch.Tensor] = {}
    hooks = _watch_inputs(layers, seen.setdefault)
    was_training = model.training
    model.eval()
    try:
        after = loaded(**inputs)  # the first forward also decompresses the loaded weights
        with next(iter(layers.values())).cpt_precision.evaluating_at(fields.bits):
            before = model(**inputs)
            by_layer = {name: (layer(seen[name]), loaded.get_submodule(name)(seen[name]))
                        for name, layer in layers.items() if name in seen}
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    effect = output_change(before, after, source)
    effect["layers"] = {name: float((new.float() - old.float()).abs().max() / old.float().abs().max().clamp_min(1e-12))
                        for name, (old, new) in by_layer.items()}
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
    state_dict, quantization_config, fields = compressed_tensors_state_dict(model, bits, cpt_config, measure_inputs)
    with plain_model(model):
        model.save_pretrained(save_directory, state_dict=state_dict, **save_kwargs)
    config_file = os.path.join(save_directory, "config.json")  # in a staging folder (`staged_save`)
    with open(config_file) as f:
        config = json.load(f)
    with open(config_file, "w") as f:
        json.dump({**config, "quantization_config": quantization_config}, f, indent=2)
    fields.export_effect.update(measure_export(model, save_directory, fields, measure_inputs))
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
    """Write a compressed-tensors checkpoint of ``model`` at ``bits`` (default: ``cpt_config.bits_max``) that
    transformers loads with the ``compressed-tensors`` package and no hf_cpt. The export is loaded back and
    compared with ``model`` at ``bits`` on ``measure_inputs`` (default: random valid inputs): the figures, with the
    layers the format runs in float, go into ``cpt_config.json`` and the model card (``export_effect``), and a
    warning names those layers. Other arguments as `save_quantized`."""
    check_compressed_tensors()
    save_directory = os.fspath(save_directory)
    bits = resolve_export_bits(model, bits, cpt_config)
    with staged_save(save_directory) as staging:
        fields = write_compressed_tensors(model, staging, bits, cpt_config, measure_inputs, **save_kwargs)
        _finish_export(model, staging, fields, cpt_config, processing_class, model_card, card_info)
    return save_directory
