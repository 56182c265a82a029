"""The CPT checkpoint format: its constants and `CheckpointFields`, the one typed schema of ``quantization_config``.

Export builds a `CheckpointFields`, `CPTQuantizationConfig` (the transformers-facing config) holds and validates
one, and the loader and the model card read its typed fields. Layout details: ``docs/checkpoints.md``.
This module knows nothing about models, layers or transformers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import EMA_INITS
from ..nn.base import ACTIVATION_GRANULARITIES
from ..numerics.backward_products import PRODUCTS
from ..numerics.bits import bits_problem, check_bits
from ..numerics.errors import (
    ERROR_GRANULARITY_CHOICES,
    ERROR_PRODUCTS,
    ERROR_RANGE_CHOICES,
    ERROR_ROUNDINGS,
    ErrorQuantization,
)
from ..numerics.fake_quant import WEIGHT_RANGES
from ..version import __version__

# The quant_method written. A reader without hf_cpt (transformers, lm-eval, a serving engine) names it in the first line
# it prints ("Unknown quantization type, got ..."), before any load report: so it says what is needed. Files written
# before 2026-12-04 hold "cpt"; both are registered.
QUANT_METHOD = "cpt: needs hf-cpt (pip install hf-cpt), then import hf_cpt"
QUANT_METHODS = (QUANT_METHOD, "cpt")
# 2: layer_schemes (per-token / rotated layers). 3: packed files also hold each rotated layer's rotation
# tensors, the attention routing of the trained model (`attention_routing`) and the `REQUIRES_HF_CPT` marker.
# 4: `attention_bits` (attention products at a fixed bit-width), which an older reader would ignore.
# 5: `digest`, the SHA-256 of the CPT tensors, checked at load.
FORMAT_VERSION = 5
SUPPORTED_FORMAT_VERSIONS = (1, 2, 3, 4, 5)
CHECKPOINT_FORMATS = ("packed", "portable", "compressed-tensors")
MIN_EXPORT_BITS = 1
MAX_EXPORT_BITS = 8

PACKED = "weight_packed"
SCALE = "weight_scale"
ZERO_POINT = "weight_zero_point"
ACT_MIN = "act_min"
ACT_MAX = "act_max"
ROTATION_PREFIX = "rotation_"  # a rotated layer's stored rotation: rotation_signs, rotation_factor_<i>


def is_cpt_tensor(key: str) -> bool:
    """Whether a checkpoint key names a tensor of CPT's own (codes, scale, zero point, range, rotation)."""
    last = key.rsplit(".", 1)[-1]
    return last in (PACKED, SCALE, ZERO_POINT, ACT_MIN, ACT_MAX) or last.startswith(ROTATION_PREFIX)


def tensor_digest(tensors: dict[str, Any]) -> str:
    """SHA-256 over the names and bytes of ``tensors`` (CPU tensors), in name order."""
    digest = hashlib.sha256()
    for key in sorted(tensors):
        digest.update(key.encode())
        digest.update(tensors[key].detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# An empty tensor whose name is the advice a plain transformers load (without `import hf_cpt`) prints in its
# load report, beside the guard tensor's size mismatch that stops it.
REQUIRES_HF_CPT = "THIS_CHECKPOINT_NEEDS_hf_cpt: install hf-cpt, then import hf_cpt before from_pretrained"


def check_export_bits(name: str, value: Any, allow_none: bool = False) -> int | None:
    """Validate an export bit-width (1..8), naming the field in the error."""
    if value is None and allow_none:
        return None
    return check_bits(name, value, MIN_EXPORT_BITS, MAX_EXPORT_BITS)


def check_float_weight_bits(value: Any) -> int | str | None:
    """``"auto"``, ``None`` (exact float) or an export bit-width."""
    if value == "auto" or value is None:
        return value
    return check_export_bits("float_weight_bits", value)


def float_storage_bits(bits: int, float_weight_bits: int | str | None, embedding: bool) -> int | None:
    """Storage bits of one FP32-trained weight (None: exact float).

    ``"auto"``: embedding tables (and weights tied to them) take the finest codes in the bytes per value
    of the CPT layers, 8 bits above 4-bit exports and 4 bits (two per byte) at 4 bits or fewer; other
    weights (the kept output head, excluded layers) take 8 bits.
    """
    float_weight_bits = check_float_weight_bits(float_weight_bits)
    if float_weight_bits == "auto":
        return (4 if bits <= 4 else 8) if embedding else 8
    return float_weight_bits


@dataclass
class CheckpointFields:
    """The ``quantization_config`` of a CPT checkpoint (``quant_method: "cpt"``); every field validated on
    construction, and an error names the field (``quantization_config.<field>``)."""

    bits: int  # precision of the stored weights and activations, 1..8
    quantized_modules: list[str]  # the CPT layers
    format_version: int = FORMAT_VERSION
    checkpoint_format: str = "packed"  # or "portable" (float weights on the grid), or "compressed-tensors"
    float_weight_bits: Any = "auto"  # the export option for weights that trained in FP32
    float_packed_modules: dict[str, int] = field(default_factory=dict)  # FP32-trained weights stored as codes
    shared_weights: dict[str, str] = field(default_factory=dict)  # tied weights: {module: module it shares with}
    guard_tensor: str | None = None  # packed only: the tensor that stops a load without hf_cpt
    activation_ranges: dict[str, list[float]] | None = None  # not packed: {layer: [min, max]}
    # What further training of the loaded model uses:
    activation_momentum: float = 0.9
    activation_ema_init: str = "zeros"
    error_granularity: str = "tensor"
    error_rounding: str = "stochastic"
    error_products: str = "both"
    error_range: str = "minmax"  # absent in files written before the option: the grid they trained with
    input_gradient_product: str = "float"  # the backward GEMMs (absent in older files: the float ones they ran)
    weight_gradient_product: str = "float"
    weight_range: str = "minmax"  # how the weights' ranges are chosen (absent in older files: the min/max they used)
    # For the record:
    cpt_config: dict[str, Any] | None = None  # the run's CPTConfig
    hf_cpt_version: str | None = None
    # Format 2: {layer: [activation granularity, rotation seed or null]}; absent layers are per tensor, unrotated.
    layer_schemes: dict[str, list] = field(default_factory=dict)
    rounding_effect: dict[str, Any] | None = None  # a lossy export: what rounding the FP32-trained weights changed
    export_effect: dict[str, Any] | None = None  # compressed-tensors: layers it runs in float, measured change
    quantized_attention: str | None = None  # granularity of the attention products; null: full precision
    # Format 3: the implementation the trained model's "cpt" attention function wrapped ("sdpa" / "eager");
    # null: the model ran its own attention. The loaded model is routed the same way.
    attention_routing: str | None = None
    # The fixed bit-width of quantized attention products (CPTConfig.attention_bits); null: the model's bits.
    attention_bits: int | None = None
    digest: str | None = None  # format 5, packed: `tensor_digest` of its CPT tensors (a flipped byte stops the load)
    quant_method: str = QUANT_METHOD

    def __post_init__(self) -> None:
        self.quantized_modules = list(self.quantized_modules) if isinstance(self.quantized_modules, (list, tuple)) \
            else self.quantized_modules
        self.shared_weights = dict(self.shared_weights or {})
        self.float_packed_modules = {} if self.float_packed_modules is None else self.float_packed_modules
        self.layer_schemes = dict(self.layer_schemes or {})
        self._check_identity()
        self._check_modules()
        self._check_settings()

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def to_dict(self) -> dict[str, Any]:
        """The fields as ``config.json`` holds them (JSON types only)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @property
    def errors(self) -> ErrorQuantization:
        """How the loaded model quantizes errors if trained further (absent in older files: the paper's)."""
        return ErrorQuantization(self.error_granularity, self.error_rounding, self.error_products, self.error_range,
                                 self.input_gradient_product, self.weight_gradient_product)

    @property
    def packed(self) -> bool:
        return self.checkpoint_format == "packed"

    def _check_identity(self) -> None:
        if self.quant_method not in QUANT_METHODS:
            raise ValueError(f"quantization_config.quant_method must be one of {list(QUANT_METHODS)}, got "
                             f"{self.quant_method!r}.")
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
        check_export_bits("quantization_config.bits", self.bits)
        if self.float_weight_bits != "auto":
            check_export_bits("quantization_config.float_weight_bits", self.float_weight_bits, allow_none=True)

    def _check_modules(self) -> None:
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
            check_export_bits(f"quantization_config.float_packed_modules[{name!r}]", bits)
        if not self.quantized_modules:
            raise ValueError("quantization_config.quantized_modules is empty: no CPT layer to rebuild.")
        if self.packed:
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
        for name, scheme in self.layer_schemes.items():
            ok = isinstance(scheme, (list, tuple)) and len(scheme) == 2 and scheme[0] in ACTIVATION_GRANULARITIES
            ok = ok and (scheme[1] is None or (isinstance(scheme[1], int) and not isinstance(scheme[1], bool)))
            if not ok or (name not in self.quantized_modules and name not in self.shared_weights):
                raise ValueError(
                    f"quantization_config.layer_schemes[{name!r}] must be [granularity in "
                    f"{list(ACTIVATION_GRANULARITIES)}, rotation seed or null] for a quantized module, got {scheme!r}."
                )

    def _check_settings(self) -> None:
        if not isinstance(self.activation_momentum, (int, float)) or not 0.0 <= self.activation_momentum < 1.0:
            raise ValueError(
                f"quantization_config.activation_momentum must be in [0, 1), got {self.activation_momentum!r}."
            )
        if self.attention_routing is not None and not isinstance(self.attention_routing, str):
            raise ValueError(
                f"quantization_config.attention_routing must be null or an attention implementation name, "
                f"got {self.attention_routing!r}."
            )
        if self.attention_bits is not None:
            problem = bits_problem(self.attention_bits)
            if problem is None and self.quantized_attention is None:
                problem = f"needs quantized_attention (got {self.attention_bits!r} without it)."
            if problem is not None:
                raise ValueError(f"quantization_config.attention_bits {problem}")
        for name, choices in (("quantized_attention", (None, *ACTIVATION_GRANULARITIES)),
                              ("error_granularity", ERROR_GRANULARITY_CHOICES), ("error_rounding", ERROR_ROUNDINGS),
                              ("error_products", ERROR_PRODUCTS),
                              ("error_range", ERROR_RANGE_CHOICES), ("input_gradient_product", PRODUCTS),
                              ("weight_gradient_product", PRODUCTS), ("weight_range", WEIGHT_RANGES),
                              ("activation_ema_init", EMA_INITS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"quantization_config.{name} must be one of {list(choices)}, "
                                 f"got {getattr(self, name)!r}.")
