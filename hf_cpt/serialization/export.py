"""What a CPT export writes: which weights become codes, the packed and portable state dicts.

`packed_state_dict` / `portable_state_dict` turn a CPT model into the tensors of a checkpoint and the
``quantization_config`` fields that describe them; `hf_cpt.serialization.save` writes them with
``save_pretrained`` and `hf_cpt.serialization.loader` reads them back. Weights that trained in FP32 are kept
exact unless ``float_weight_bits`` asks to round them (then `measure_rounding` says what it changed).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..config import CPTConfig
from ..convert import quant_layers
from ..nn.attention import find_attention_quantizer
from ..nn.base import QuantLayerMixin
from ..nn.layers import Conv1D, weight_channel_dim
from ..numerics.fake_quant import dequantize_codes, quantize_codes
from ..numerics.packing import pack_codes
from ..utils import json_safe
from ..version import __version__
from .format import (
    ACT_MAX,
    ACT_MIN,
    MAX_EXPORT_BITS,
    PACKED,
    QUANT_METHODS,
    REQUIRES_HF_CPT,
    SCALE,
    ZERO_POINT,
    CheckpointFields,
    check_export_bits,
    check_float_weight_bits,
    float_storage_bits,
    is_cpt_tensor,
    tensor_digest,
)
from .validation import check_values

logger = logging.getLogger(__name__)

_FLOAT_PACKABLE: tuple[type, ...] = (nn.Embedding, nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d) + (
    (Conv1D,) if Conv1D is not None else ()
)


@dataclass
class ExportPlan:
    """Which tensors of a model an export rewrites."""

    bits: int
    quantized: dict[str, QuantLayerMixin] = field(default_factory=dict)  # CPT layers
    float_packed: dict[str, nn.Module] = field(default_factory=dict)  # FP32-trained weights stored as codes
    float_bits: dict[str, int] = field(default_factory=dict)  # their storage bits
    shared: dict[str, str] = field(default_factory=dict)  # module -> module whose weight it shares
    guard: str | None = None


def _check_model(model: nn.Module) -> None:
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"hf_cpt checkpoints are transformers checkpoints: expected a PreTrainedModel, got {type(model).__name__}. "
            "For a plain nn.Module, save its state_dict (FP32 masters) instead; for a peft model, merge the "
            "adapters first (merge_and_unload) or save with save_format='fp32'."
        )
    if not any(True for _ in quant_layers(model)):
        raise ValueError(
            f"{type(model).__name__} has no CPT layers: convert it with hf_cpt.quantize_model (or train it with "
            "CPTTrainer) before exporting a CPT checkpoint."
        )


def _same_weight_quantization(layer: QuantLayerMixin, owner: QuantLayerMixin | None) -> bool:
    return (
        owner is not None
        and not layer.quantizes_inputs
        and not owner.quantizes_inputs
        and layer.weight_channel_dim == owner.weight_channel_dim
        and layer.rotation is None
        and owner.rotation is None
    )


def plan_export(model: nn.Module, bits: int, float_weight_bits: int | str | None = None) -> ExportPlan:
    """Decide which module weights become codes (and at which bits), which are shared, and the guard tensor."""
    float_weight_bits = check_float_weight_bits(float_weight_bits)
    plan = ExportPlan(bits=bits)
    owner_of: dict[int, str] = {}
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is None:
            continue
        owner = owner_of.setdefault(id(weight), name)
        if isinstance(module, QuantLayerMixin):
            if owner != name:
                if not _same_weight_quantization(module, plan.quantized.get(owner)):
                    raise NotImplementedError(
                        f"CPT layer {name!r} shares its weight with {owner!r} but quantizes it differently; packed "
                        "export of such tied weights is not supported (use save_format='fp32')."
                    )
                plan.shared[name] = owner  # a head tied to a quantized embedding: the same codes, stored once
                continue
            plan.quantized[name] = module
        elif isinstance(module, _FLOAT_PACKABLE) and float_weight_bits is not None:
            if owner != name:
                plan.shared[name] = owner
            elif weight.dim() >= 2 and weight.is_floating_point() and weight.numel() > 0:
                plan.float_packed[name] = module
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, module in plan.float_packed.items():
        embedding = id(module.weight) in embedding_weights
        plan.float_bits[name] = float_storage_bits(bits, float_weight_bits, embedding)
    for name, owner in list(plan.shared.items()):
        if owner in plan.quantized and not isinstance(model.get_submodule(name), QuantLayerMixin):
            raise NotImplementedError(
                f"{name!r} (full precision) shares its weight with CPT layer {owner!r}; convert both with "
                "CPTConfig(quantize_embeddings=True), or export with save_format='fp32'."
            )
        if owner not in plan.float_packed and owner not in plan.quantized:
            del plan.shared[name]
    for name in plan.quantized:
        if name not in plan.shared.values():
            plan.guard = name
            break
    return plan


def _model_settings(model: nn.Module, cpt_config: CPTConfig | None) -> dict[str, Any]:
    """The `CheckpointFields` both export formats take from the model: its layers' schemes, attention, errors."""
    precision = next(layer for _, layer in quant_layers(model)).cpt_precision
    attention = find_attention_quantizer(model)
    return {
        "quantized_attention": attention.granularity if attention is not None and attention.quantize else None,
        # the loaded model runs attention through the same function, wrapping the same kernel
        "attention_routing": attention.replaced_implementation if attention is not None else None,
        "attention_bits": attention.fixed_bits if attention is not None and attention.quantize else None,
        "layer_schemes": {
            name: [layer.cpt_granularity, layer.cpt_rotation_seed]
            for name, layer in quant_layers(model)
            if layer.cpt_granularity != "tensor" or layer.cpt_rotation_seed is not None
        },
        "activation_momentum": precision.activation_momentum,
        "activation_ema_init": precision.activation_ema_init,
        "error_granularity": precision.errors.granularity,
        "error_rounding": precision.errors.rounding,
        "error_products": precision.errors.products,
        "error_range": precision.errors.range,
        "input_gradient_product": precision.errors.input_product,
        "weight_gradient_product": precision.errors.weight_product,
        "weight_range": precision.weight_range,
        "cpt_config": json_safe(cpt_config.to_dict()) if cpt_config is not None else None,
        "hf_cpt_version": __version__,
    }


def _warn_unset_activation_ranges(plan: ExportPlan) -> None:
    unset = [
        name
        for name, layer in plan.quantized.items()
        if layer.cpt_granularity == "tensor" and float(layer.act_min) == 0.0 and float(layer.act_max) == 0.0
    ]
    if unset:
        logger.warning(
            "hf_cpt: %d CPT layer(s) have the activation range [0, 0] (never trained in CPT mode?), e.g. %s; "
            "the exported model quantizes their inputs over that range, as the in-memory model does in eval.",
            len(unset),
            unset[0],
        )


def packed_state_dict(
    model: nn.Module,
    bits: int,
    float_weight_bits: int | str | None = None,
    cpt_config: CPTConfig | None = None,
    measure_inputs: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], CheckpointFields]:
    """The packed state dict of a CPT model at ``bits`` and the `CheckpointFields` describing it.

    ``float_weight_bits=None`` (default) keeps the weights that trained in FP32 exact. Otherwise they are
    rounded, and `measure_rounding` on ``measure_inputs`` (default: the model's dummy inputs) records what
    that changed in ``fields.rounding_effect``, with a warning when predictions flip.
    """
    _check_model(model)
    check_export_bits("bits", bits)
    plan = plan_export(model, bits, float_weight_bits)
    _warn_unset_activation_ranges(plan)
    rounding_effect = measure_rounding(model, plan, measure_inputs) if plan.float_packed else None
    state_dict = dict(model.state_dict())
    for name in list(plan.quantized) + list(plan.float_packed) + list(plan.shared):
        state_dict.pop(f"{name}.weight", None)
    for name, module in list(plan.quantized.items()) + list(plan.float_packed.items()):
        if name in plan.quantized:
            # the codes the layer computes with: of Q(W R) in the rotated basis, or those it was loaded with
            codes, scale, zero_point = module.weight_codes(bits)
            module_bits = bits
        else:
            module_bits = plan.float_bits[name]
            codes, scale, zero_point = quantize_codes(module.weight, module_bits, weight_channel_dim(module))
        state_dict[f"{name}.{PACKED}"] = pack_codes(codes, module_bits).cpu()
        state_dict[f"{name}.{SCALE}"] = scale.cpu()
        state_dict[f"{name}.{ZERO_POINT}"] = zero_point.cpu()
        if name in plan.quantized:
            state_dict[f"{name}.{ACT_MIN}"] = module.act_min.detach().float().cpu().clone()
            state_dict[f"{name}.{ACT_MAX}"] = module.act_max.detach().float().cpu().clone()
            for buffer in module.rotation_buffer_names():  # the very rotation the layer computed with
                state_dict[f"{name}.{buffer}"] = module.get_buffer(buffer).detach().float().cpu().clone()
    check_values(state_dict, "the export's")
    state_dict[f"{plan.guard}.weight"] = torch.zeros(0, dtype=torch.uint8)
    state_dict[REQUIRES_HF_CPT] = torch.zeros(0, dtype=torch.uint8)
    fields = CheckpointFields(bits=bits, quantized_modules=list(plan.quantized), checkpoint_format="packed",
        float_weight_bits=float_weight_bits, float_packed_modules=dict(plan.float_bits),
        shared_weights=dict(plan.shared), guard_tensor=f"{plan.guard}.weight", rounding_effect=rounding_effect,
        digest=tensor_digest({key: value for key, value in state_dict.items() if is_cpt_tensor(key)}),
        **_model_settings(model, cpt_config))
    return state_dict, fields


def _default_inputs(model: nn.Module) -> dict[str, torch.Tensor]:
    """Valid random inputs: 8 sequences of 32 token ids, or 8 images, drawn with a fixed seed."""
    generator = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and vocab > 0:
        ids = torch.randint(0, vocab, (8, 32), generator=generator)
        return {"input_ids": ids.to(device)}
    channels = getattr(config, "num_channels", None) or 3
    size = getattr(config, "image_size", None) or 224
    size = size if isinstance(size, int) else size[0]
    return {"pixel_values": torch.randn(8, channels, size, size, generator=generator).to(device)}


def _main_output(outputs: Any) -> torch.Tensor:
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = outputs.get("logits") if hasattr(outputs, "get") else None
    return logits if logits is not None else outputs[0]


def measure_inputs_of(model: nn.Module, inputs: dict[str, torch.Tensor] | None) -> tuple[str, dict[str, torch.Tensor]]:
    """(where the inputs an export is measured on come from, the inputs): ``inputs``, else random valid ones."""
    if inputs is not None:
        return "evaluation batch", dict(inputs)
    return "random valid inputs", _default_inputs(model)


@contextlib.contextmanager
def evaluated_at(model: nn.Module, bits: int) -> Iterator[nn.Module]:
    """``model`` in eval mode at ``bits``; its mode and eval precision restored afterwards."""
    was_training = model.training
    try:
        with next(layer for _, layer in quant_layers(model)).cpt_precision.evaluating_at(bits):
            yield model.eval()
    finally:
        model.train(was_training)


def output_change(before: Any, after: Any, source: str) -> dict[str, Any]:
    """How far ``after`` (a model output) is from ``before``: the max relative change of the main output
    (``max |new - old| / max |old|``), the share of predictions (argmax of the last dimension) that flip, the loss
    change when both have a loss, and where the inputs came from."""
    old, new = _main_output(before).float(), _main_output(after).float()
    effect = {"inputs": source, "examples": int(old.shape[0]),
        "max_relative_output_change": float((new - old).abs().max() / old.abs().max().clamp_min(1e-12)),
        "flipped_predictions": float((old.argmax(-1) != new.argmax(-1)).float().mean())}
    loss_before, loss_after = getattr(before, "loss", None), getattr(after, "loss", None)
    if loss_before is not None and loss_after is not None:
        effect["loss_change"] = float(loss_after - loss_before)
    return effect


@torch.no_grad()
def measure_rounding(
    model: nn.Module, plan: ExportPlan, inputs: dict[str, torch.Tensor] | None = None
) -> dict[str, Any]:
    """What rounding the FP32-trained weights of ``plan`` changes in the model's output at ``plan.bits``.

    Compares the in-memory model evaluated at the export bits with the same model after the rounding, on
    ``inputs`` (a batch of evaluation data; default: fixed random valid inputs): `output_change`.
    """
    source, inputs = measure_inputs_of(model, inputs)
    originals = {name: module.weight.detach().clone() for name, module in plan.float_packed.items()}
    try:
        with evaluated_at(model, plan.bits):
            before = model(**inputs)
            for name, module in plan.float_packed.items():
                bits = plan.float_bits[name]
                dim = weight_channel_dim(module)
                codes, scale, zero_point = quantize_codes(module.weight, bits, dim)
                module.weight.copy_(dequantize_codes(codes, scale, zero_point, module.weight.shape, dim))
            after = model(**inputs)
    finally:
        for name, module in plan.float_packed.items():
            module.weight.copy_(originals[name])
    effect = output_change(before, after, source)
    effect["rounded_modules"] = dict(plan.float_bits)
    if effect["flipped_predictions"] > 0:
        logger.warning(
            "hf_cpt: rounding the weights trained in FP32 (float_weight_bits) flips %.1f%% of the predictions on "
            "the %s (max relative output change %.3g); the checkpoint does not reproduce the trained model. Export "
            "with float_weight_bits=None (the default) for an exact checkpoint.",
            100 * effect["flipped_predictions"], source, effect["max_relative_output_change"],
        )
    return effect


def portable_state_dict(
    model: nn.Module, bits: int, cpt_config: CPTConfig | None = None
) -> tuple[dict[str, torch.Tensor], CheckpointFields]:
    """Float state dict with every CPT layer's weight snapped to its ``bits`` grid (plain keys)."""
    _check_model(model)
    check_export_bits("bits", bits)
    plan = plan_export(model, bits, float_weight_bits=None)
    _warn_unset_activation_ranges(plan)
    state_dict = dict(model.state_dict())
    ranges = {}
    for name, layer in plan.quantized.items():
        snapped = layer.quantized_weight(bits)
        state_dict[f"{name}.weight"] = snapped.to(layer.weight.dtype)
        ranges[name] = [float(layer.act_min), float(layer.act_max)]
    check_values(state_dict, "the export's")
    fields = CheckpointFields(bits=bits, quantized_modules=list(plan.quantized), checkpoint_format="portable",
        float_weight_bits=None, activation_ranges=ranges, **_model_settings(model, cpt_config))
    return state_dict, fields



def resolve_export_bits(model: nn.Module, bits: int | None, cpt_config: CPTConfig | None) -> int:
    """``bits`` if given, else the run's ``bits_max``, else the precision the model evaluates at."""
    if bits is None and cpt_config is not None and cpt_config.schedule != "fp32":
        if cpt_config.bits_max > MAX_EXPORT_BITS:
            raise ValueError(
                f"CPTConfig.bits_max={cpt_config.bits_max} is above the {MAX_EXPORT_BITS} bits a CPT checkpoint "
                f"stores: pass bits=<1..{MAX_EXPORT_BITS}> to export the model at that precision, or save the FP32 "
                "master weights (save_format='fp32')."
            )
        bits = cpt_config.bits_max
    if bits is None:
        stored = getattr(getattr(model, "config", None), "quantization_config", None)
        stored_bits = stored.get("bits") if isinstance(stored, dict) else getattr(stored, "bits", None)
        if getattr(stored, "quant_method", None) in QUANT_METHODS or (
            isinstance(stored, dict) and stored.get("quant_method") in QUANT_METHODS
        ):
            bits = stored_bits
    if bits is None:
        layers = [layer for _, layer in quant_layers(model)]
        precision = layers[0].cpt_precision if layers else None
        if precision is not None and precision.eval_enabled and not precision.eval_follows_training:
            bits = int(precision.eval_bits.item())
    if bits is None:
        raise ValueError("Cannot tell the export precision: pass bits=... (or cpt_config=CPTConfig(...)).")
    return bits  # checked where the state dict is built
