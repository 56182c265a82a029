"""Integer codes of a packed CPT checkpoint: the format's constants, per-channel codes, nibble packing.

``weight = codes * scale + zero_point`` per output channel, with the arithmetic of
`hf_cpt.quantizer.fake_quantize`, so that unpacking reproduces the weight a CPT layer computes with.
Layout details: ``docs/checkpoints.md``. This module knows nothing about models or transformers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .bits import check_bits as check_any_bits
from .layers import QuantLayerMixin

try:
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover - transformers is a dependency
    Conv1D = None

QUANT_METHOD = "cpt"
# 2: layer_schemes (per-token / rotated layers). 3: packed files also hold each rotated layer's rotation
# tensors, the attention routing of the trained model (`attention_routing`) and the `REQUIRES_HF_CPT` marker.
FORMAT_VERSION = 3
SUPPORTED_FORMAT_VERSIONS = (1, 2, 3)
CHECKPOINT_FORMATS = ("packed", "portable")
MIN_EXPORT_BITS = 1
MAX_EXPORT_BITS = 8

PACKED = "weight_packed"
SCALE = "weight_scale"
ZERO_POINT = "weight_zero_point"
ACT_MIN = "act_min"
ACT_MAX = "act_max"
# An empty tensor whose name is the advice a plain transformers load (without `import hf_cpt`) prints in its
# load report, beside the guard tensor's size mismatch that stops it.
REQUIRES_HF_CPT = "THIS_CHECKPOINT_NEEDS_hf_cpt: install hf-cpt, then import hf_cpt before from_pretrained"


def check_bits(name: str, value: Any, allow_none: bool = False) -> int | None:
    """Validate an export bit-width (1..8), naming the field in the error."""
    if value is None and allow_none:
        return None
    return check_any_bits(name, value, MIN_EXPORT_BITS, MAX_EXPORT_BITS)


def check_float_weight_bits(value: Any) -> int | str | None:
    """``"auto"``, ``None`` (exact float) or an export bit-width."""
    if value == "auto" or value is None:
        return value
    return check_bits("float_weight_bits", value)


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


def weight_channel_dim(module: nn.Module) -> int:
    """The weight dimension that indexes output channels (rows of an embedding)."""
    if isinstance(module, QuantLayerMixin):
        return module.weight_channel_dim
    if Conv1D is not None and isinstance(module, Conv1D):
        return 1
    return 0


def packed_row_bytes(values_per_row: int, bits: int) -> int:
    """Bytes per output channel: one value per byte above 4 bits, two per byte at 4 bits or fewer."""
    return (values_per_row + 1) // 2 if bits <= 4 else values_per_row


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``[C, K]`` uint8 codes: unchanged above 4 bits, else value ``2j`` in the low nibble of byte ``j``."""
    if bits > 4:
        return codes.contiguous()
    if codes.shape[1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_codes(packed: torch.Tensor, bits: int, values_per_row: int) -> torch.Tensor:
    """Inverse of `pack_codes`: ``[C, K]`` uint8 codes."""
    if bits > 4:
        return packed
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)[:, :values_per_row]
