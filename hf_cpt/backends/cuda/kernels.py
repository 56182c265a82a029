"""Triton kernels of the CUDA backend: an operand's codes and fake-quantized values in one pass, bit for bit the
reference (`hf_cpt.numerics.fake_quant`): ``round(clamp((x - m) / s, 0, L))`` in float32, half to even, correctly
rounded division, ``codes * s + m`` without fused multiply-add; the bits read on the device. Knows nothing of layers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernels read and write (others: reference)
ROUNDING = 12582912.0  # 1.5 * 2^23: (y + R) - R rounds a float32 |y| < 2^22 to an integer, half to even


@triton.jit
def _store_values(values_ptr, offsets, codes, scale, minimum, mask):
    values = codes * scale
    values = values + minimum  # a product, then a sum, as the reference (fusion is off at launch)
    if values_ptr.dtype.element_ty == tl.bfloat16:  # round to nearest even by hand (the interpreter truncates)
        bits = values.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        values = bits.to(tl.float32, bitcast=True)
    tl.store(values_ptr + offsets, values.to(values_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _codes_kernel(x_ptr, minimum_ptr, scale_ptr, levels_ptr, codes_ptr, values_ptr, numel, row_size,
                  PER_ROW: tl.constexpr, VALUES: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    row = offsets // row_size if PER_ROW else offsets * 0
    minimum = tl.load(minimum_ptr + row, mask=mask, other=0.0)
    scale = tl.load(scale_ptr + row, mask=mask, other=1.0)
    steps = tl.div_rn(x - minimum, scale)
    steps = tl.minimum(tl.maximum(steps, 0.0), tl.load(levels_ptr))
    codes = (steps + ROUNDING) - ROUNDING
    tl.store(codes_ptr + offsets, codes.to(tl.uint8), mask=mask)
    if VALUES:
        _store_values(values_ptr, offsets, codes, scale, minimum, mask)


@triton.jit
def _restore_kernel(codes_ptr, minimum_ptr, scale_ptr, values_ptr, numel, row_size, PER_ROW: tl.constexpr,
                    BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    row = offsets // row_size if PER_ROW else offsets * 0
    codes = tl.load(codes_ptr + offsets, mask=mask, other=0).to(tl.float32)
    minimum = tl.load(minimum_ptr + row, mask=mask, other=0.0)
    scale = tl.load(scale_ptr + row, mask=mask, other=1.0)
    _store_values(values_ptr, offsets, codes, scale, minimum, mask)


def _rows_layout(t: torch.Tensor, minimum: torch.Tensor, scale: torch.Tensor) -> bool | None:
    """Whether the range is one per leading row of ``t`` (``[..., 1]``, True) or one for all (False); None: neither."""
    if minimum.dtype != torch.float32 or scale.dtype != torch.float32 or t.numel() == 0 or not t.is_contiguous():
        return None
    if minimum.numel() == 1 and scale.numel() == 1:
        return False
    rows = (*t.shape[:-1], 1)
    return True if t.dim() and minimum.shape == rows and scale.shape == rows else None


@torch.library.custom_op("hf_cpt::restore_values", mutates_args=())
def _restore_op(codes: torch.Tensor, minimum: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                per_row: bool) -> torch.Tensor:
    values = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    _restore_kernel[(triton.cdiv(codes.numel(), BLOCK),)](
        codes, minimum, scale, values, codes.numel(), max(codes.shape[-1], 1) if codes.dim() else 1,
        PER_ROW=per_row, BLOCK=BLOCK, enable_fp_fusion=False)
    return values


@_restore_op.register_fake
def _(codes, minimum, scale, dtype, per_row):
    return codes.new_empty(codes.shape, dtype=dtype)


@torch.library.custom_op("hf_cpt::operand_codes", mutates_args=())
def _codes_op(x: torch.Tensor, minimum: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor, values: bool,
              per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    out = torch.empty_like(x) if values else x.new_empty(0)
    _codes_kernel[(triton.cdiv(x.numel(), BLOCK),)](
        x, minimum, scale, levels, codes, out if values else codes, x.numel(),
        max(x.shape[-1], 1) if x.dim() else 1, PER_ROW=per_row, VALUES=values, BLOCK=BLOCK,
        enable_fp_fusion=False)
    return codes, out


@_codes_op.register_fake
def _(x, minimum, scale, levels, values, per_row):
    return x.new_empty(x.shape, dtype=torch.uint8), (torch.empty_like(x) if values else x.new_empty(0))


def restore_values(codes: torch.Tensor, minimum: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor | None:
    """``codes * scale + minimum`` in float32, then ``dtype`` (float32 / bf16 / fp16), in one pass (the custom op
    ``hf_cpt::restore_values``); None for any other layout."""
    per_row = _rows_layout(codes, minimum, scale)
    if per_row is None or codes.dtype != torch.uint8 or dtype not in KERNEL_DTYPES:
        return None
    return _restore_op(codes, minimum.contiguous(), scale.contiguous(), dtype, per_row)


def operand_codes(x: torch.Tensor, minimum: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor,
                  values: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(uint8 codes, the fake-quantized values in ``x``'s dtype or None) of a contiguous float32 / bf16 / fp16
    ``x`` whose ``minimum`` and ``scale`` (float32) are one value or one per leading row (``x.shape[:-1]``), in one
    pass (the custom op ``hf_cpt::operand_codes``); None for any other layout (the reference formula serves it)."""
    per_row = _rows_layout(x, minimum, scale)
    if per_row is None or x.dtype not in KERNEL_DTYPES:
        return None
    codes, out = _codes_op(x, minimum.contiguous(), scale.contiguous(), levels.to(torch.float32), values, per_row)
    return codes, (out if values else None)
