"""A rotated input's per-token codes in one pass on CPU (docs/method.md §3, "Rotation with its codes").

The native kernel (``hf_cpt_rotate_codes`` in ``rotation_kernels.c``) rotates each row into a scratch row that stays
in cache, takes its min and max and writes its codes (and fake-quantized values) from there: the same values bit for
bit as rotating, ranging and quantizing step by step, with ``x R`` never written to memory. Knows nothing of layers.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import native
from .fake_quant import MIN_SCALE, levels_on
from .rotation import Rotation, native_layout

# (x's range as (min, max), each shaped to broadcast against x; (values or None, (uint8 codes, scale, minimum)))
RotatedCodes = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor | None, tuple[torch.Tensor, ...]]]


@functools.cache
def _library():
    return native.bind("rotation_kernels", {
        "hf_cpt_rotate_codes": ([ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_float] * 2
                                + [ctypes.c_void_p] * 5 + [ctypes.c_int], ctypes.c_int)})


def rotated_token_codes(x: torch.Tensor, dim: int, rotation: Rotation, bits: torch.Tensor, values: bool
                        ) -> RotatedCodes | None:
    """``x R`` over ``dim``, the last axis, quantized per token at ``bits`` (at most 8), without forming ``x R``:
    its range (`fake_quant.token_range` of ``x R``) and ``(values, (codes, scale, minimum))`` as
    `fake_quant.fake_quantize_compact` of ``x R`` over that range gives them (``values`` None unless asked), bit for
    bit. None where the kernel does not serve the call: another axis, a
    gradient asked of ``x``, or a tensor or rotation the rotation kernel does not take (`rotation.native_layout`)."""
    if x.dim() == 0 or dim % x.dim() != x.dim() - 1 or (torch.is_grad_enabled() and x.requires_grad):
        return None
    layout = native_layout(x, rotation.signs, rotation.factors, rotation.kinds)
    if layout is None or _library() is None:
        return None
    lead, lead_size, power = layout
    top = float(levels_on(bits, x.device, torch.float32))
    if top > 255:
        return None
    rows = x.numel() // rotation.features
    range_shape = (*x.shape[:-1], 1)
    minimum, maximum, scale = (torch.empty(range_shape) for _ in range(3))
    codes = torch.empty(x.shape, dtype=torch.uint8)
    value_tensor = torch.empty(x.shape) if values else None
    signs = rotation.signs.contiguous()
    threads = _library().hf_cpt_rotate_codes(
        x.data_ptr(), signs.data_ptr(), None if lead is None else lead.data_ptr(), lead_size, power, rows, top,
        MIN_SCALE, codes.data_ptr(), None if value_tensor is None else value_tensor.data_ptr(), minimum.data_ptr(),
        maximum.data_ptr(), scale.data_ptr(), native.threads())
    if threads < 0:  # out of memory for a scratch row
        return None
    return (minimum, maximum), (value_tensor, (codes, scale, minimum))
