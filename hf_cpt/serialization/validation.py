"""Checks of a checkpoint against the model it loads into, before any weight is read: every tensor the
``quantization_config`` promises is there, with the shape and dtype the model's layers need; an error names it."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from ..nn import (
    QUANT_EMBEDDING_CLASSES,
    QUANT_LAYER_CLASSES,
    QuantLayerMixin,
    input_features,
    rotation_buffers,
    weight_channel_dim,
)
from ..numerics.packing import packed_row_bytes
from .format import ACT_MAX, ACT_MIN, PACKED, ROTATION_PREFIX, SCALE, ZERO_POINT, is_cpt_tensor
from .quantization_config import CPTQuantizationConfig


def safetensors_files(model: nn.Module, checkpoint_files: list[str] | None) -> list[str]:
    """The checkpoint's safetensors files: given by transformers 5.x, else found from ``name_or_path`` (4.x)."""
    if checkpoint_files:
        return [f for f in checkpoint_files if str(f).endswith(".safetensors")]
    path = getattr(model.config, "_name_or_path", None) or getattr(model.config, "name_or_path", None)
    if not path:
        return []
    names = ["model.safetensors.index.json", "model.safetensors"]
    for name in names:
        if os.path.isdir(path):
            candidate = os.path.join(path, name)
            candidate = candidate if os.path.isfile(candidate) else None
        else:
            try:
                from transformers.utils import cached_file

                candidate = cached_file(path, name, _raise_exceptions_for_missing_entries=False)
            except Exception:  # pragma: no cover - offline or no such repo
                candidate = None
        if candidate is None:
            continue
        if candidate.endswith(".json"):
            with open(candidate, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return [os.path.join(os.path.dirname(candidate), shard) for shard in shards]
        return [candidate]
    return []


def read_tensor_headers(files: list[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` of every tensor in some safetensors files, read from their headers only."""
    from safetensors import safe_open

    tensors = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():
                tensor_slice = handle.get_slice(key)
                tensors[key] = (tensor_slice.get_dtype(), tuple(tensor_slice.get_shape()))
    return tensors


def named_module(model: nn.Module, name: str, field: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise ValueError(
            f"quantization_config.{field} names module {name!r}, which {type(model).__name__} does not have; "
            "the checkpoint does not belong to this model class or config."
        ) from None


def expected_tensors(model: nn.Module, config: CPTQuantizationConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensors a checkpoint described by ``config`` must hold for ``model``, with dtype and shape."""
    expected: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, bits in config.packed_modules().items():
        field = "quantized_modules" if name in config.quantized_modules else "float_packed_modules"
        module = named_module(model, name, field)
        weight = module._parameters.get("weight")
        if weight is None:
            raise ValueError(f"quantization_config.{field} names {name!r}, which has no weight parameter.")
        channels = weight.shape[weight_channel_dim_for(module, name, config)]
        values = weight.numel() // max(channels, 1)
        expected[f"{name}.{PACKED}"] = ("U8", (channels, packed_row_bytes(values, bits)))
        expected[f"{name}.{SCALE}"] = ("F32", (channels,))
        expected[f"{name}.{ZERO_POINT}"] = ("F32", (channels,))
        if name in config.quantized_modules:
            expected[f"{name}.{ACT_MIN}"] = ("F32", ())
            expected[f"{name}.{ACT_MAX}"] = ("F32", ())
    if config.stores_rotations:
        for name in config.quantized_modules:
            _, seed = config.layer_scheme(name)
            if seed is not None:
                for buffer, shape in rotation_buffers(input_features(model.get_submodule(name))).items():
                    expected[f"{name}.{buffer}"] = ("F32", shape)
    if config.packed:
        expected[config.guard_tensor] = ("U8", (0,))
    else:
        for name in config.quantized_modules:
            weight = named_module(model, name, "quantized_modules").weight
            expected[f"{name}.weight"] = (None, tuple(weight.shape))
    return expected


def weight_channel_dim_for(module: nn.Module, name: str, config: CPTQuantizationConfig) -> int:
    """Output-channel dimension of a module's weight, as the export used it (before or after conversion)."""
    if name in config.quantized_modules and not isinstance(module, QuantLayerMixin):
        quant_class = QUANT_LAYER_CLASSES.get(type(module)) or QUANT_EMBEDDING_CLASSES.get(type(module))
        return quant_class.weight_channel_dim if quant_class is not None else 0
    return weight_channel_dim(module)


def as_model_keys(model: nn.Module, tensors: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's tensor names as the model's state-dict keys, renamed as transformers renames them on load.

    Models may name keys differently in the file and in memory. transformers 5.x applies the model's weight
    renamings (``conversion_mapping``; ViT's modules are ``vit.layers.N...`` in memory and
    ``vit.encoder.layer.N...`` in files), 4.x the ``_fix_state_dict_key_on_load`` hook
    (``TimmWrapperPreTrainedModel`` adds back the ``timm_model.`` prefix the file drops).
    """
    fix = getattr(model, "_fix_state_dict_key_on_load", None)
    if callable(fix):
        return {fix(key)[0]: value for key, value in tensors.items()}
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # pragma: no cover - transformers without weight renamings
        return tensors
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    if not renamings and not converters:
        return tensors
    return {rename_source_key(key, renamings, converters)[0]: value for key, value in tensors.items()}


def check_values(tensors: dict[str, torch.Tensor], what: str = "the checkpoint's") -> None:
    """Refuse what no trained model holds, naming the tensor: non-finite values, a scale that is not positive, a range
    whose minimum exceeds its maximum, rotation signs other than +-1, a rotation factor that is not orthogonal."""
    for key, tensor in tensors.items():
        if not tensor.is_floating_point():
            continue
        last, values = key.rsplit(".", 1)[-1], tensor.detach()
        problem = None
        if not bool(torch.isfinite(values).all()):
            problem = "holds NaN or inf"
        elif last == SCALE and bool((values <= 0).any()):
            problem = "holds a scale <= 0"
        elif last == ACT_MAX and f"{key[:-len(ACT_MAX)]}{ACT_MIN}" in tensors:
            problem = "is below the range's minimum" if bool((tensors[key[:-len(ACT_MAX)] + ACT_MIN] > values).any()) \
                else None
        elif last == f"{ROTATION_PREFIX}signs" and not bool((values.abs() == 1).all()):
            problem = "holds signs other than +1 and -1"
        elif last.startswith(f"{ROTATION_PREFIX}factor") and values.dim() == 2:
            gram = values.double() @ values.double().T
            scale = gram.diagonal().mean()
            if not bool(torch.allclose(gram, scale * torch.eye(len(gram), dtype=gram.dtype), atol=1e-4 * float(scale))):
                problem = "is not an orthogonal factor"
        if problem is not None:
            raise ValueError(f"hf_cpt: {what} tensor {key!r} {problem}: no trained model holds such values (a damaged "
                             "file, or a model whose weights went non-finite).")


def validate_checkpoint(
    model: nn.Module, config: CPTQuantizationConfig, tensors: dict[str, tuple[str, tuple[int, ...]]], where: str = ""
) -> None:
    """Raise ``ValueError`` naming every missing, mis-shaped or mistyped tensor of a CPT checkpoint."""
    tensors = as_model_keys(model, tensors)
    problems, expected = [], expected_tensors(model, config)
    for key, (dtype, shape) in expected.items():
        found = tensors.get(key)
        if found is None:
            problems.append(f"tensor {key!r} is missing (expected {dtype or 'float'} of shape {list(shape)})")
        elif tuple(found[1]) != shape:
            problems.append(f"tensor {key!r} has shape {list(found[1])}, expected {list(shape)}")
        elif dtype is not None and found[0] != dtype:
            problems.append(f"tensor {key!r} has dtype {found[0]}, expected {dtype}")
    if config.packed:
        guard = config.guard_module()
        for name in config.packed_modules():
            key = f"{name}.weight"
            if key in tensors and name != guard:
                problems.append(
                    f"tensor {key!r} is a plain weight, but quantization_config says {name!r} is stored packed "
                    f"({name}.{PACKED}); the file and config.json do not belong together"
                )
    problems += [f"tensor {key!r} is a CPT tensor that quantization_config does not describe (the file and config.json "
                 "do not belong together)" for key in tensors if is_cpt_tensor(key) and key not in expected]
    for name, source in config.shared_weights.items():
        named_module(model, name, "shared_weights")
        if source not in config.packed_modules():
            problems.append(f"quantization_config.shared_weights[{name!r}] = {source!r}, which is not stored packed")
    if problems:
        shown = "\n  - ".join(problems[:10]) + (f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise ValueError(f"hf_cpt: invalid CPT checkpoint{where}:\n  - {shown}")


# ----------------------------------------------------------------------------- the quantizer
