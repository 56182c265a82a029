"""The CPT quantization method of transformers: ``from_pretrained`` loads CPT checkpoints (docs/checkpoints.md).

Before the weights load (meta device) the listed layers become CPT layers, the checkpoint's tensors checked first (a
missing or mis-shaped tensor is a ``ValueError`` naming it); after, ``codes * scale + zero_point`` becomes each layer's
FP32 master weight, the layers freeze to the stored codes and evaluate at the exported bits with the stored ranges.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Any

import torch
from torch import nn
from transformers.quantizers.auto import register_quantization_config, register_quantizer
from transformers.quantizers.base import HfQuantizer

from ..convert import dequantize_model
from ..nn.attention import install_attention
from ..nn.base import NONFINITE_INPUTS, QuantLayerMixin
from ..nn.layers import QUANT_EMBEDDING_CLASSES, QUANT_LAYER_CLASSES, convert_layer, weight_channel_dim
from ..nn.precision import PrecisionState
from ..numerics.fake_quant import dequantize_codes
from ..numerics.packing import packed_row_bytes, unpack_codes
from .export import packed_state_dict, portable_state_dict
from .format import ACT_MAX, ACT_MIN, PACKED, QUANT_METHODS, REQUIRES_HF_CPT, SCALE, ZERO_POINT, tensor_digest
from .quantization_config import CPTQuantizationConfig
from .validation import check_values, named_module, read_tensor_headers, safetensors_files, validate_checkpoint

logger = logging.getLogger(__name__)


class CPTHfQuantizer(HfQuantizer):
    """Rebuilds CPT layers from a ``quant_method="cpt"`` checkpoint (see the module docstring)."""

    requires_calibration = True  # only pre-quantized CPT checkpoints: activation ranges come from training
    required_packages = None
    requires_parameters_quantization = False

    def __init__(self, quantization_config: CPTQuantizationConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self.modules_to_not_convert: list[str] = []

    # -- environment ------------------------------------------------------------------------
    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("hf_cpt: CPT checkpoints cannot be loaded with disk offloading (device_map has 'disk').")

    def update_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        if dtype is not None and dtype != torch.float32:
            logger.warning(
                "hf_cpt: CPT checkpoints rebuild FP32 master weights (codes x scale + zero point); loading in "
                "float32 instead of %s. Cast the model afterwards if you need another dtype.",
                dtype,
            )
        return torch.float32

    def update_torch_dtype(self, dtype: torch.dtype | None) -> torch.dtype:  # transformers 4.x name
        return self.update_dtype(dtype)

    # -- before loading: rebuild the layers on the meta model --------------------------------
    def _process_model_before_weight_loading(self, model: nn.Module, checkpoint_files=None, **kwargs: Any):
        config = self.quantization_config
        files = safetensors_files(model, checkpoint_files)
        if files:
            validate_checkpoint(model, config, read_tensor_headers(files), f" ({os.path.dirname(files[0])})")
        else:
            logger.warning(
                "hf_cpt: could not find the checkpoint's safetensors files; tensors are checked after loading."
            )
        with torch.device("cpu"):
            precision = self._new_precision()
        for name in config.cpt_layer_names():
            module = named_module(model, name, "quantized_modules")
            if isinstance(module, QuantLayerMixin):
                continue
            if type(module) not in QUANT_LAYER_CLASSES and type(module) not in QUANT_EMBEDDING_CLASSES:
                known = sorted(c.__name__ for c in list(QUANT_LAYER_CLASSES) + list(QUANT_EMBEDDING_CLASSES))
                raise ValueError(
                    f"quantization_config.quantized_modules names {name!r}, a {type(module).__name__}: not a layer "
                    f"hf_cpt can quantize ({known})."
                )
            convert_layer(module, precision, *config.layer_scheme(name))
        if not config.packed:
            return model
        ignore_missing = set(getattr(model, "_keys_to_ignore_on_load_missing", None) or ())
        guard = config.guard_module()
        for name, bits in config.packed_modules().items():
            module = model.get_submodule(name)
            weight = module.weight
            channels = weight.shape[weight_channel_dim(module)]
            values = weight.numel() // max(channels, 1)
            device = weight.device
            module.register_buffer(PACKED,
                torch.empty(channels, packed_row_bytes(values, bits), dtype=torch.uint8, device=device))
            module.register_buffer(SCALE, torch.empty(channels, dtype=torch.float32, device=device))
            module.register_buffer(ZERO_POINT, torch.empty(channels, dtype=torch.float32, device=device))
            module.__dict__["_cpt_weight_shape"] = tuple(weight.shape)
            if isinstance(module, QuantLayerMixin):
                module._non_persistent_buffers_set.discard(ACT_MIN)
                module._non_persistent_buffers_set.discard(ACT_MAX)
                if config.stores_rotations:  # filled from the file: the very rotation the layer trained with
                    module._non_persistent_buffers_set.difference_update(module.rotation_buffer_names())
            if name == guard:
                # The file's `<guard>.weight` is an empty uint8 tensor: the plain-transformers tripwire.
                module._parameters.pop("weight")
                module.register_buffer("weight", torch.empty(0, dtype=torch.uint8, device=device))
            else:
                ignore_missing.add("^" + re.escape(f"{name}.weight") + "$")
        for name in config.shared_weights:
            ignore_missing.add("^" + re.escape(f"{name}.weight") + "$")
        # Tied weights whose source is stored packed: transformers would report the pair as absent from
        # the checkpoint; they are untied while loading and tied again after unpacking.
        tied = getattr(model, "all_tied_weights_keys", None)
        packed_weights = {f"{name}.weight" for name in list(config.packed_modules()) + list(config.shared_weights)}
        self._untied = {}
        if isinstance(tied, dict):
            for target, source in list(tied.items()):
                if target in packed_weights or source in packed_weights:
                    self._untied[target] = tied.pop(target)
        model._keys_to_ignore_on_load_missing = ignore_missing
        self._ignore_missing = ignore_missing
        unexpected = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
        # the marker is advice for plain transformers; matched as a suffix (some models prefix file keys)
        model._keys_to_ignore_on_load_unexpected = unexpected | {re.escape(REQUIRES_HF_CPT) + "$"}
        return model

    def update_missing_keys(self, model, missing_keys: list[str], prefix: str) -> list[str]:  # transformers 4.x
        patterns = [re.compile(p) for p in getattr(self, "_ignore_missing", ())]
        return [key for key in missing_keys if not any(p.search(key) for p in patterns)]

    # -- after loading: FP32 masters from the codes ---------------------------------------------
    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any):
        config = self.quantization_config
        precision = self._new_precision()
        layers = {name: model.get_submodule(name) for name in config.cpt_layer_names()}
        for name, layer in layers.items():
            layer.__dict__["cpt_precision"] = precision
            if NONFINITE_INPUTS in layer._buffers:  # a buffer the loader materializes with no values
                layer._buffers[NONFINITE_INPUTS].zero_()
            if config.stores_rotations and name in config.quantized_modules:
                for buffer in layer.rotation_buffer_names():
                    if layer.get_buffer(buffer).device.type == "meta":
                        raise ValueError(f"hf_cpt: tensor '{name}.{buffer}' was not loaded from the checkpoint.")
                    layer._non_persistent_buffers_set.add(buffer)
            else:  # format 1-2 or portable: rebuilt from the seed (the loader leaves absent buffers unset)
                layer.build_rotation()
        for name, layer in layers.items():
            if name not in config.quantized_modules:  # tied to a quantized embedding: weights only, no range
                for key in (ACT_MIN, ACT_MAX):
                    layer.register_buffer(key, torch.zeros((), device=layer.weight.device), persistent=False)
        if config.packed:
            self._unpack(model, config)
        else:
            for name, layer in layers.items():
                if name not in config.quantized_modules:
                    continue
                low, high = config.activation_ranges[name]
                device = layer.weight.device
                layer.register_buffer(ACT_MIN, torch.tensor(float(low), device=device), persistent=False)
                layer.register_buffer(ACT_MAX, torch.tensor(float(high), device=device), persistent=False)
        check_values(dict(model.state_dict()))
        for layer in layers.values():
            layer.__dict__["_act_range_initialized"] = True
        precision.set(None, None)
        precision.set_eval(config.bits)
        if config.quantized_attention is not None or config.attention_routing is not None:
            # the trained model's attention function, wrapping the same kernel: the same arithmetic
            install_attention(model, precision, config.quantized_attention is not None,
                              config.quantized_attention or "tensor", replaced_implementation=config.attention_routing,
                              fixed_bits=config.attention_bits)
        return model

    @staticmethod
    def _check_stored_tensors(model: nn.Module, config: CPTQuantizationConfig) -> None:
        """The stored CPT tensors, as loaded: values a trained layer can hold, and the bytes the save wrote."""
        tensors = {}
        for name in config.packed_modules():
            module = model.get_submodule(name)
            keys = [PACKED, SCALE, ZERO_POINT]
            if name in config.quantized_modules:
                rotated = config.stores_rotations and config.layer_scheme(name)[1] is not None
                keys += [ACT_MIN, ACT_MAX] + (module.rotation_buffer_names() if rotated else [])
            tensors.update({f"{name}.{key}": module.get_buffer(key) for key in keys})
        if any(tensor.device.type == "meta" for tensor in tensors.values()):
            return  # not loaded: named below
        check_values(tensors)
        if config.format_version >= 5 and config.digest is not None and tensor_digest(tensors) != config.digest:
            raise ValueError("hf_cpt: the checkpoint's CPT tensors do not match quantization_config.digest: bytes "
                             "changed after the save (a damaged download or disk, or an edited file). Download or "
                             "export it again.")

    def _unpack(self, model: nn.Module, config: CPTQuantizationConfig) -> None:
        self._check_stored_tensors(model, config)
        guard = config.guard_module()
        for name, bits in config.packed_modules().items():
            module = model.get_submodule(name)
            tensors = {key: module._buffers.pop(key) for key in (PACKED, SCALE, ZERO_POINT)}
            for key, tensor in tensors.items():
                if tensor is None or tensor.device.type == "meta":
                    raise ValueError(f"hf_cpt: tensor '{name}.{key}' was not loaded from the checkpoint.")
            shape = module.__dict__.pop("_cpt_weight_shape")
            channel_dim = weight_channel_dim(module)
            values = int(torch.Size(shape).numel()) // max(shape[channel_dim], 1)
            codes = unpack_codes(tensors[PACKED], bits, values)
            if codes.numel() and int(codes.max()) > 2**bits - 1:
                field = "bits" if name in config.quantized_modules else f"float_packed_modules[{name!r}]"
                raise ValueError(
                    f"hf_cpt: tensor '{name}.{PACKED}' holds codes up to {int(codes.max())}, more than {bits} bits "
                    f"allow: quantization_config.{field} does not match the file."
                )
            weight = dequantize_codes(codes, tensors[SCALE], tensors[ZERO_POINT], torch.Size(shape), channel_dim)
            if isinstance(module, QuantLayerMixin):
                # codes hold Q(W R) in the rotated basis; the FP32 master (for further training) is that weight
                # rotated back; the layer computes with the codes themselves (frozen below)
                weight = module.rotate_weight(weight, inverse=True)
            current = module._parameters.get("weight")
            if name == guard or current is None or current.device.type == "meta" or tuple(current.shape) != shape:
                module._buffers.pop("weight", None)
                module._parameters.pop("weight", None)
                module.weight = nn.Parameter(weight, requires_grad=True)
            else:
                with torch.no_grad():
                    current.data = weight.to(current.device)
            if isinstance(module, QuantLayerMixin):
                for key in (ACT_MIN, ACT_MAX):
                    if module._buffers[key].device.type == "meta":
                        raise ValueError(f"hf_cpt: tensor '{name}.{key}' was not loaded from the checkpoint.")
                    module._non_persistent_buffers_set.add(key)
                device = module.weight.device
                module.freeze_weight(codes.to(device), tensors[SCALE].to(device), tensors[ZERO_POINT].to(device), bits)
        for name, source in config.shared_weights.items():
            target = model.get_submodule(name)
            owner = model.get_submodule(source)
            weight = owner.weight
            if target._parameters.get("weight") is not weight:
                target._parameters["weight"] = weight
            frozen = owner.frozen_codes(config.bits) if isinstance(owner, QuantLayerMixin) else None
            if isinstance(target, QuantLayerMixin) and frozen is not None:  # a tied head: the owner's codes
                target.freeze_weight(*frozen, config.bits)
        untied = getattr(self, "_untied", {})
        if untied:
            model.all_tied_weights_keys.update(untied)
            for target, source in untied.items():
                parent, _, attribute = target.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attribute, model.get_parameter(source))

    def _new_precision(self) -> PrecisionState:
        return PrecisionState.from_settings(self.quantization_config)

    # -- saving and training -------------------------------------------------------------------
    def is_serializable(self, safe_serialization=None, **kwargs: Any) -> bool:
        return True

    def get_state_dict_and_metadata(self, model: nn.Module, *args: Any, **kwargs: Any):
        """``model.save_pretrained`` of a loaded CPT model writes the same format again, from the current weights."""
        config = self.quantization_config
        run_config = config.run_config()
        if config.packed:
            state_dict, fields = packed_state_dict(model, config.bits, config.float_weight_bits, run_config)
        else:
            state_dict, fields = portable_state_dict(model, config.bits, run_config)
        fields.cpt_config = config.cpt_config
        config.__dict__.update(dataclasses.asdict(fields))
        return state_dict, {}

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_qat_trainable(self) -> bool:
        return True

    @property
    def is_compileable(self) -> bool:
        return True

    def _dequantize(self, model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
        dequantize_model(model)
        if isinstance(dtype, str):  # transformers passes config.dtype, which may be a name
            dtype = getattr(torch, dtype, None)
        if isinstance(dtype, torch.dtype) and dtype != torch.float32:
            model.to(dtype)
        return model


def _register() -> None:
    """Register the CPT methods (`QUANT_METHODS`) with transformers (idempotent: a second import replaces the
    entries)."""
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

    for name in QUANT_METHODS:
        if AUTO_QUANTIZATION_CONFIG_MAPPING.get(name) is not None:
            AUTO_QUANTIZATION_CONFIG_MAPPING[name] = CPTQuantizationConfig
            AUTO_QUANTIZER_MAPPING[name] = CPTHfQuantizer
        else:
            register_quantization_config(name)(CPTQuantizationConfig)
            register_quantizer(name)(CPTHfQuantizer)


_register()
