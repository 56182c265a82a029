"""Quantization codes in one pass on CPU (docs/method.md §2, "Codes in one pass").

The native kernel (``code_kernels.c``, built once per machine by `hf_cpt.numerics.native`) reads an operand once and
writes its uint8 codes (and, when asked, its fake-quantized values) with the torch formula's float32 arithmetic in
the same order: the same codes and values bit for bit. It serves float32, contiguous CPU tensors outside a compiled
graph with one range per tensor, per leading or per trailing index; anything else keeps the torch formula (these
functions return None). Also: per-row min and max (`ranges_native`), a product on codes' float32 result from its
sums (`code_product_native`) and the operands of the float32 GEMM on codes (`centred_codes_native`).
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from . import native

# Below this many elements the torch formula is as fast (the call itself costs a few microseconds).
NATIVE_MIN_NUMEL = 1 << 14


@functools.cache
def _library():
    pointers, sizes = [ctypes.c_void_p] * 5, [ctypes.c_int64] * 4
    return native.bind("code_kernels", {
        "hf_cpt_quantize_codes": (pointers + sizes + [ctypes.c_float, ctypes.c_int], ctypes.c_int),
        "hf_cpt_restore_codes": ([ctypes.c_void_p] * 4 + sizes + [ctypes.c_int], ctypes.c_int),
        "hf_cpt_code_product": ([ctypes.c_void_p] * 8 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 2, ctypes.c_int),
        "hf_cpt_ranges": ([ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 2, ctypes.c_int),
        "hf_cpt_centred_codes": ([ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_int32] + [ctypes.c_int] * 2,
                                 ctypes.c_int),
    })


def _layout(shape: torch.Size, range_shape: torch.Size) -> tuple[int, int, int, int] | None:
    """(rows, columns, row stride, column stride) of the range against a tensor of ``shape`` seen as rows x columns,
    or None when the range is laid out otherwise (e.g. per channel of a channels-first activation)."""
    if len(range_shape) > len(shape):
        return None
    range_shape = (1,) * (len(shape) - len(range_shape)) + tuple(range_shape)
    if all(r == 1 for r in range_shape):
        return 1, math.prod(shape), 0, 0
    for split in range(1, len(shape)):
        if range_shape[:split] == tuple(shape[:split]) and all(r == 1 for r in range_shape[split:]):
            return math.prod(shape[:split]), math.prod(shape[split:]), 1, 0  # one value per leading index
        if all(r == 1 for r in range_shape[:split]) and range_shape[split:] == tuple(shape[split:]):
            return math.prod(shape[:split]), math.prod(shape[split:]), 0, 1  # one value per trailing index
    return None


def _native_layout(t: torch.Tensor, scale: torch.Tensor) -> tuple[int, int, int, int] | None:
    """`_layout` where the native kernel serves ``t`` (`native.takes` it, with a float32 CPU scale), else None."""
    if not native.takes(t, NATIVE_MIN_NUMEL) or scale.device.type != "cpu" or scale.dtype != torch.float32:
        return None
    layout = _layout(t.shape, scale.shape)
    return None if layout is None or _library() is None else layout


def _range_operands(t: torch.Tensor, minimum: torch.Tensor, scale: torch.Tensor) -> tuple | None:
    """(minimum and scale as contiguous tensors of one shape, then the kernels' range arguments: their pointers,
    the strides, rows and columns of `_layout`), or None where the native kernel does not serve ``t``. The caller
    holds the tensors while the kernel runs (the pointers do not keep them alive)."""
    layout = _native_layout(t, scale)
    if layout is None:
        return None
    rows, columns, row_stride, column_stride = layout
    minimum, scale = minimum.expand(scale.shape).contiguous(), scale.contiguous()
    return minimum, scale, (minimum.data_ptr(), scale.data_ptr(), row_stride, column_stride, rows, columns)


def quantize_codes_native(
    x: torch.Tensor, minimum: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor, values: bool,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(uint8 codes ``round(clamp((x - m) / s, 0, L))``, the values ``codes * s + m`` if ``values``) of a float32 ``x``
    over ``minimum`` and ``scale`` (broadcastable, ``scale`` of the broadcast shape), or None where the native
    kernel does not serve this call."""
    if x.dtype != torch.float32 or (torch.is_grad_enabled() and x.requires_grad):
        return None
    operands = _range_operands(x, minimum, scale)
    if operands is None:
        return None
    minimum, scale, ranges = operands
    codes = torch.empty(x.shape, dtype=torch.uint8)
    out = torch.empty(x.shape) if values else None
    _library().hf_cpt_quantize_codes(x.data_ptr(), codes.data_ptr(), None if out is None else out.data_ptr(),
                                     *ranges, float(levels), native.threads())
    return codes, out


def restore_codes_native(
    codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor
) -> torch.Tensor | None:
    """``codes * scale + minimum`` in float32 (``scale`` of the broadcast shape of both ranges); None where the
    native kernel does not serve this call."""
    operands = _range_operands(codes, minimum, scale) if codes.dtype == torch.uint8 else None
    if operands is None:
        return None
    minimum, scale, ranges = operands
    values = torch.empty(codes.shape)
    _library().hf_cpt_restore_codes(codes.data_ptr(), values.data_ptr(), *ranges, native.threads())
    return values


def code_product_native(
    products: torch.Tensor, row_scale: torch.Tensor, row_sum: torch.Tensor, row_zero: torch.Tensor,
    column_scale: torch.Tensor, column_zero: torch.Tensor, column_term: torch.Tensor, bias: torch.Tensor | None,
) -> torch.Tensor | None:
    """The float32 ``products * s_a s_b + (u z_b + z_a w) + bias`` of a product on codes
    (`hf_cpt.numerics.integer_matmul.code_matmul`), written over ``products`` ``[M, N]`` in one pass: its int32
    sums, or float32 holding the same integers exactly; the row terms broadcast to ``[M]``, the column terms and
    ``bias`` to ``[N]``. None where the kernel does not serve the call."""
    if (not native.takes(products, NATIVE_MIN_NUMEL) or products.dtype not in (torch.int32, torch.float32)
            or products.dim() != 2 or _library() is None):
        return None
    rows, columns = products.shape
    row_terms = [t.float().expand(rows, 1).reshape(rows).contiguous() for t in (row_scale, row_sum, row_zero)]
    column_terms = [t.float().expand(1, columns).reshape(columns).contiguous()
                    for t in (column_scale, column_zero, column_term)]
    bias = None if bias is None else bias.float().contiguous()
    _library().hf_cpt_code_product(products.data_ptr(), *(t.data_ptr() for t in row_terms + column_terms),
                                   None if bias is None else bias.data_ptr(), rows, columns,
                                   int(products.dtype == torch.float32), native.threads())
    return products.view(torch.float32)


def ranges_native(x: torch.Tensor, split: int, per_column: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(min, max), flat, of each row of ``x`` seen as ``(prod(shape[:split]), prod(shape[split:]))``, or of each
    column with ``per_column``, in one pass (torch's amin and amax take one each; a NaN gives NaN, as theirs do);
    None where the kernel does not serve the call."""
    if not native.takes(x, NATIVE_MIN_NUMEL) or x.dtype != torch.float32 or _library() is None:
        return None
    rows, columns = math.prod(x.shape[:split]), math.prod(x.shape[split:])
    size = columns if per_column else rows
    minimum, maximum = torch.empty(size), torch.empty(size)
    _library().hf_cpt_ranges(x.data_ptr(), minimum.data_ptr(), maximum.data_ptr(), rows, columns, int(per_column),
                             native.threads())
    return minimum, maximum


def centred_codes_native(codes: torch.Tensor, middle: int, per_column: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(``codes - middle`` as float32; the int32 sums and sums of squares of each row,
    or of each column with ``per_column``) of a 2-D uint8 tensor, in one pass, all exact; None where the kernel does
    not serve the call."""
    if (not native.takes(codes, NATIVE_MIN_NUMEL) or codes.dtype != torch.uint8 or codes.dim() != 2
            or _library() is None):
        return None
    rows, columns = codes.shape
    size = columns if per_column else rows
    values = torch.empty(rows, columns)
    sums, squares = torch.empty(size, dtype=torch.int32), torch.empty(size, dtype=torch.int32)
    _library().hf_cpt_centred_codes(codes.data_ptr(), values.data_ptr(), sums.data_ptr(), squares.data_ptr(), rows,
                                    columns, middle, int(per_column), native.threads())
    return values, sums, squares
