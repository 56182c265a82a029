"""The ``cpt`` quantization method of ``transformers``: load CPT checkpoints with ``from_pretrained``.

After ``import hf_cpt``, `CPTQuantizationConfig` and `CPTHfQuantizer` are registered under ``quant_method="cpt"``
as soon as transformers loads its quantizer registry (`hf_cpt.registration`).
A checkpoint written by `hf_cpt.save_quantized` (packed) or `hf_cpt.export_portable` then loads with
any ``AutoModelFor....from_pretrained(path)``:

1. before the weights load (model on the meta device), the listed layers become CPT layers
   (`hf_cpt.layers.convert_layer`) and get buffers named like the packed tensors; the checkpoint's
   tensor names, shapes and dtypes are checked first, and a missing or mis-shaped tensor raises a
   ``ValueError`` naming it;
2. after loading, ``codes * scale + zero_point`` becomes each layer's FP32 ``weight`` (the master
   weight, trainable), the packed buffers are dropped, and the model evaluates at the exported bits
   with the stored activation ranges (and quantized attention products, when the run had them); its
   state dict then has the plain keys again.

Written for transformers 5.x (tested with 5.23) and 4.57+: ``is_serializable`` takes an optional
argument, ``is_trainable`` / ``is_qat_trainable`` are properties, and both weight-loading hooks are
defined (abstract in 4.x).
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

import torch
from torch import nn
from transformers.quantizers.auto import register_quantization_config, register_quantizer
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .attention import install_attention
from .config import EMA_INITS, CPTConfig
from .export import packed_state_dict, portable_state_dict
from .layers import (
    ACTIVATION_GRANULARITIES,
    QUANT_EMBEDDING_CLASSES,
    QUANT_LAYER_CLASSES,
    PrecisionState,
    QuantLayerMixin,
    convert_layer,
    input_features,
    rotation_buffers,
)
from .packing import (
    ACT_MAX,
    ACT_MIN,
    CHECKPOINT_FORMATS,
    FORMAT_VERSION,
    PACKED,
    QUANT_METHOD,
    REQUIRES_HF_CPT,
    SCALE,
    SUPPORTED_FORMAT_VERSIONS,
    ZERO_POINT,
    check_bits,
    packed_row_bytes,
    unpack_codes,
    weight_channel_dim,
)
from .quantizer import (
    ERROR_GRANULARITY_CHOICES,
    ERROR_PRODUCTS,
    ERROR_ROTATIONS,
    ERROR_ROUNDINGS,
    ErrorQuantization,
    dequantize_codes,
)
from .surgery import dequantize_model
from .version import __version__

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.uint8: "U8", torch.float32: "F32"}


class CPTQuantizationConfig(QuantizationConfigMixin):
    """``quantization_config`` of a CPT checkpoint (``quant_method: "cpt"`` in ``config.json``).

    Written by `hf_cpt.save_quantized` / `hf_cpt.export_portable`; not meant to be passed to
    ``from_pretrained`` by hand (a CPT checkpoint needs trained activation ranges, so there is no
    quantize-on-load). Every field is validated on construction, and an error names the field.

    Fields: ``format_version`` (1 or 2), ``checkpoint_format`` ("packed" or "portable"), ``bits`` (1..8,
    the precision of weights and activations), ``quantized_modules`` (the CPT layers),
    ``float_weight_bits`` (the export option) / ``float_packed_modules`` (``{module: bits}`` of the
    FP32-trained weights stored as codes),
    ``shared_weights`` (tied weights, ``{module: module_it_shares_with}``), ``guard_tensor``,
    ``activation_ranges`` (portable only), the activation-quantizer settings
    (``activation_momentum``, ``activation_ema_init``, ``fused_error_quantizer``, ``error_granularity``,
    ``error_rounding``, ``error_products``, ``error_rotation``: what further training of the loaded model uses)
    and, for the record,
    the run's ``cpt_config`` and ``hf_cpt_version``. Format 2 adds ``layer_schemes``
    (``{layer: [granularity, rotation seed or null]}`` for per-token, rotated and weight-only layers;
    absent layers are per tensor without rotation, as in format 1) and, for a lossy export,
    ``rounding_effect`` (what rounding the FP32-trained weights changed, measured at export), and
    ``quantized_attention`` (the granularity of the attention products when the run quantized them:
    the loaded model computes them the same way; null: full-precision attention).
    """

    def __init__(
        self,
        bits: int = 8,
        quantized_modules: list[str] | None = None,
        format_version: int = FORMAT_VERSION,
        checkpoint_format: str = "packed",
        float_weight_bits: Any = "auto",
        float_packed_modules: dict[str, int] | None = None,
        shared_weights: dict[str, str] | None = None,
        guard_tensor: str | None = None,
        activation_ranges: dict[str, list[float]] | None = None,
        activation_momentum: float = 0.9,
        activation_ema_init: str = "zeros",
        fused_error_quantizer: bool = True,
        error_granularity: str = "tensor",
        error_rounding: str = "stochastic",
        error_products: str = "both",
        error_rotation: str = "none",
        cpt_config: dict[str, Any] | None = None,
        hf_cpt_version: str | None = None,
        layer_schemes: dict[str, list] | None = None,
        rounding_effect: dict[str, Any] | None = None,
        quantized_attention: str | None = None,
        attention_routing: str | None = None,
        quant_method: str = QUANT_METHOD,
        **kwargs: Any,
    ) -> None:
        self.quant_method = quant_method
        self.format_version = format_version
        self.checkpoint_format = checkpoint_format
        self.bits = bits
        self.quantized_modules = quantized_modules if quantized_modules is not None else []
        self.float_weight_bits = float_weight_bits
        self.float_packed_modules = float_packed_modules if float_packed_modules is not None else {}
        self.shared_weights = dict(shared_weights or {})
        self.guard_tensor = guard_tensor
        self.activation_ranges = activation_ranges
        self.activation_momentum = activation_momentum
        self.activation_ema_init = activation_ema_init
        self.fused_error_quantizer = fused_error_quantizer
        self.error_granularity = error_granularity  # how a loaded model quantizes errors if trained further
        self.error_rounding = error_rounding
        self.error_products = error_products
        self.error_rotation = error_rotation
        self.cpt_config = cpt_config
        self.hf_cpt_version = hf_cpt_version
        # {layer: [activation granularity, rotation seed or None]}; absent (format 1): per tensor, no rotation
        self.layer_schemes = dict(layer_schemes or {})
        # What rounding the FP32-trained weights at export changed (float_weight_bits set): see export.measure_rounding
        self.rounding_effect = rounding_effect
        # Granularity of the quantized attention products ("tensor" / "token"), None: full-precision attention
        self.quantized_attention = quantized_attention
        # The implementation the trained model's "cpt" attention function wrapped ("sdpa" / "eager"); None: the
        # model ran its own attention. The loaded model is routed the same way (format 3).
        self.attention_routing = attention_routing
        if kwargs:
            logger.info("hf_cpt: ignoring unknown quantization_config fields %s", sorted(kwargs))
        self.post_init()

    def post_init(self) -> None:
        """Validate every field; the error names the field."""
        if self.quant_method != QUANT_METHOD:
            raise ValueError(f"quantization_config.quant_method must be {QUANT_METHOD!r}, got {self.quant_method!r}.")
        if self.format_version not in SUPPORTED_FORMAT_VERSIONS:
            raise ValueError(
                f"quantization_config.format_version={self.format_version!r} is not supported by hf_cpt {__version__} "
                f"(it reads format version(s) {list(SUPPORTED_FORMAT_VERSIONS)}); upgrade hf-cpt to load this "
                "checkpoint."
            )
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"quantization_config.checkpoint_format must be one of {list(CHECKPOINT_FORMATS)}, "
                f"got {self.checkpoint_format!r}."
            )
        check_bits("quantization_config.bits", self.bits)
        if self.float_weight_bits != "auto":
            check_bits("quantization_config.float_weight_bits", self.float_weight_bits, allow_none=True)
        if not isinstance(self.quantized_modules, list) or not all(isinstance(n, str) for n in self.quantized_modules):
            raise ValueError(
                f"quantization_config.quantized_modules must be a list of module names, got {self.quantized_modules!r}."
            )
        if not isinstance(self.float_packed_modules, dict):
            raise ValueError(
                "quantization_config.float_packed_modules must map module names to bits, "
                f"got {self.float_packed_modules!r}."
            )
        for name, bits in self.float_packed_modules.items():
            check_bits(f"quantization_config.float_packed_modules[{name!r}]", bits)
        if not self.quantized_modules:
            raise ValueError("quantization_config.quantized_modules is empty: no CPT layer to rebuild.")
        if self.checkpoint_format == "packed":
            if not isinstance(self.guard_tensor, str):
                raise ValueError(
                    "quantization_config.guard_tensor must name a tensor of a packed checkpoint, "
                    f"got {self.guard_tensor!r}."
                )
        else:
            ranges = self.activation_ranges
            if not isinstance(ranges, dict):
                raise ValueError(
                    f"quantization_config.activation_ranges must map layer names to [min, max], got {ranges!r}."
                )
            for name in self.quantized_modules:
                value = ranges.get(name)
                pair = isinstance(value, (list, tuple)) and len(value) == 2
                if not (pair and all(isinstance(v, (int, float)) for v in value)):
                    raise ValueError(
                        f"quantization_config.activation_ranges[{name!r}] must be [min, max], got {value!r}."
                    )
        if not isinstance(self.activation_momentum, (int, float)) or not 0.0 <= self.activation_momentum < 1.0:
            raise ValueError(
                f"quantization_config.activation_momentum must be in [0, 1), got {self.activation_momentum!r}."
            )
        for name, scheme in self.layer_schemes.items():
            ok = isinstance(scheme, (list, tuple)) and len(scheme) == 2 and scheme[0] in ACTIVATION_GRANULARITIES
            ok = ok and (scheme[1] is None or (isinstance(scheme[1], int) and not isinstance(scheme[1], bool)))
            if not ok or (name not in self.quantized_modules and name not in self.shared_weights):
                raise ValueError(
                    f"quantization_config.layer_schemes[{name!r}] must be [granularity in "
                    f"{list(ACTIVATION_GRANULARITIES)}, rotation seed or null] for a quantized module, got {scheme!r}."
                )
        if self.attention_routing is not None and not isinstance(self.attention_routing, str):
            raise ValueError(
                f"quantization_config.attention_routing must be null or an attention implementation name, "
                f"got {self.attention_routing!r}."
            )
        for field, choices in (("quantized_attention", (None, *ACTIVATION_GRANULARITIES)),
                               ("error_granularity", ERROR_GRANULARITY_CHOICES), ("error_rounding", ERROR_ROUNDINGS),
                               ("error_products", ERROR_PRODUCTS), ("error_rotation", ERROR_ROTATIONS),
                               ("activation_ema_init", EMA_INITS)):
            if getattr(self, field) not in choices:
                raise ValueError(f"quantization_config.{field} must be one of {list(choices)}, "
                                 f"got {getattr(self, field)!r}.")

    @property
    def errors(self) -> ErrorQuantization:
        """How the loaded model quantizes errors if trained further (absent in older files: the paper's)."""
        return ErrorQuantization(self.error_granularity, self.error_rounding, self.fused_error_quantizer,
                                 self.error_products, self.error_rotation)

    def to_dict(self) -> dict[str, Any]:
        return {key: json.loads(json.dumps(value)) for key, value in self.__dict__.items()}

    @property
    def packed(self) -> bool:
        return self.checkpoint_format == "packed"

    def packed_modules(self) -> dict[str, int]:
        """Every module whose weight is stored as codes, with its bits."""
        modules = {name: self.bits for name in self.quantized_modules} if self.packed else {}
        modules.update(self.float_packed_modules)
        return modules

    @property
    def stores_rotations(self) -> bool:
        """Format 3 packed files hold each rotated layer's rotation tensors; older ones rebuild them from the seed."""
        return self.packed and self.format_version >= 3

    def guard_module(self) -> str | None:
        return self.guard_tensor.rsplit(".", 1)[0] if self.packed and self.guard_tensor else None

    def cpt_layer_names(self) -> list[str]:
        """The CPT layers to rebuild: the quantized modules and the CPT layers tied to one of them."""
        return self.quantized_modules + [n for n in self.shared_weights if n in self.layer_schemes]

    def layer_scheme(self, name: str) -> tuple[str, int | None]:
        """(activation granularity, rotation seed or None) of a quantized module."""
        granularity, seed = self.layer_schemes.get(name, ("tensor", None))
        return granularity, seed

    def run_config(self) -> CPTConfig | None:
        """The `CPTConfig` of the run that produced the checkpoint, when it was recorded."""
        if not self.cpt_config:
            return None
        try:
            return CPTConfig.from_dict(self.cpt_config)
        except (TypeError, ValueError) as error:
            logger.warning("hf_cpt: the recorded cpt_config is not usable here (%s).", error)
            return None


# ----------------------------------------------------------------------------- checkpoint checks


def _safetensors_files(model: nn.Module, checkpoint_files: list[str] | None) -> list[str]:
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


def _module(model: nn.Module, name: str, field: str) -> nn.Module:
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
        module = _module(model, name, field)
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
            weight = _module(model, name, "quantized_modules").weight
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


def validate_checkpoint(
    model: nn.Module, config: CPTQuantizationConfig, tensors: dict[str, tuple[str, tuple[int, ...]]], where: str = ""
) -> None:
    """Raise ``ValueError`` naming every missing, mis-shaped or mistyped tensor of a CPT checkpoint."""
    tensors = as_model_keys(model, tensors)
    problems = []
    for key, (dtype, shape) in expected_tensors(model, config).items():
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
    if problems:
        shown = "\n  - ".join(problems[:10]) + (f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise ValueError(f"hf_cpt: invalid CPT checkpoint{where}:\n  - {shown}")


# ----------------------------------------------------------------------------- the quantizer


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
        files = _safetensors_files(model, checkpoint_files)
        if files:
            validate_checkpoint(model, config, read_tensor_headers(files), f" ({os.path.dirname(files[0])})")
        else:
            logger.warning(
                "hf_cpt: could not find the checkpoint's safetensors files; tensors are checked after loading."
            )
        with torch.device("cpu"):
            precision = self._new_precision()
        for name in config.cpt_layer_names():
            module = _module(model, name, "quantized_modules")
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
            module.register_buffer(
                PACKED, torch.empty(channels, packed_row_bytes(values, bits), dtype=torch.uint8, device=device)
            )
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
        for layer in layers.values():
            layer.__dict__["_act_range_initialized"] = True
        precision.set(None, None)
        precision.set_eval(config.bits)
        if config.quantized_attention is not None or config.attention_routing is not None:
            # the trained model's attention function, wrapping the same kernel: the same arithmetic
            install_attention(model, precision, config.quantized_attention is not None,
                              config.quantized_attention or "tensor", replaced_implementation=config.attention_routing)
        return model

    def _unpack(self, model: nn.Module, config: CPTQuantizationConfig) -> None:
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
        fields["cpt_config"] = config.cpt_config
        for key, value in fields.items():
            setattr(config, key, value)
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
    """Register the ``cpt`` method with transformers (idempotent: a second import replaces the entry)."""
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD) is not None:
        AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD] = CPTQuantizationConfig
        AUTO_QUANTIZER_MAPPING[QUANT_METHOD] = CPTHfQuantizer
        return
    register_quantization_config(QUANT_METHOD)(CPTQuantizationConfig)
    register_quantizer(QUANT_METHOD)(CPTHfQuantizer)


_register()
