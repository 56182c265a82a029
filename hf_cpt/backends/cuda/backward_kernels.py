"""Triton kernels of the CUDA backend's per-token grids and backward: a row's range and codes in one program (an
operand's, nearest; an error's, with the fused error kernels' hashed noise), operands quantized per channel in blocks
of tokens, and the weight gradient as an int8 GEMM whose scales apply per block of tokens
(`hf_cpt.numerics.backward_products`), each a ``torch.library`` custom op with a fake implementation
(``hf_cpt::row_codes``, ...: `torch.compile` and CUDA graphs take them). Float steps as the
reference's: correctly rounded division, no fused multiply-add (off at launch), half-to-even rounding. Knows nothing
of layers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...numerics.backward_products import TOKEN_BLOCK
from ...numerics.fake_quant import MIN_SCALE
from .kernels import ROUNDING, _store_values

ROW_BLOCK = 1024  # features per step of the per-row kernel
CHANNEL_BLOCK = 64  # channels per program of the blocked kernels


@triton.jit
def _hashed_noise(index, seed):
    """Uniform noise in [-1/2, 1/2) of (element index, seed): the "lowbias32" hash of the CPU kernels, on uint32."""
    h = (index ^ seed).to(tl.uint32, bitcast=True)
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    h = h * 0x846CA68B
    h = h ^ (h >> 16)
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0) - 0.5


@triton.jit
def _row_codes_kernel(x_ptr, levels_ptr, seed_ptr, codes_ptr, scale_ptr, minimum_ptr, maximum_ptr, values_ptr,
                      columns, STOCHASTIC: tl.constexpr, VALUES: tl.constexpr, BLOCK: tl.constexpr):
    """One row's min/max grid and codes in one program (the row read twice, from cache the second time): an operand's
    per-token codes (nearest) or an error's (stochastic, the hashed noise); the values too with ``VALUES``."""
    row = tl.program_id(0)
    base = row.to(tl.int64) * columns
    low = tl.full((), float("inf"), tl.float32)
    high = tl.full((), float("-inf"), tl.float32)
    for start in range(0, columns, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < columns
        x = tl.load(x_ptr + base + offsets, mask=mask, other=0.0).to(tl.float32)
        low = tl.minimum(low, tl.min(tl.where(mask, x, float("inf")), 0))
        high = tl.maximum(high, tl.max(tl.where(mask, x, float("-inf")), 0))
    levels = tl.load(levels_ptr)
    scale = tl.maximum(tl.div_rn(high - low, levels), MIN_SCALE)
    seed = tl.load(seed_ptr)
    for start in range(0, columns, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < columns
        x = tl.load(x_ptr + base + offsets, mask=mask, other=0.0).to(tl.float32)
        steps = tl.div_rn(x - low, scale)
        if STOCHASTIC:
            steps = steps + _hashed_noise((base + offsets).to(tl.int32), seed)
        steps = tl.minimum(tl.maximum(steps, 0.0), levels)
        codes = (steps + ROUNDING) - ROUNDING
        tl.store(codes_ptr + base + offsets, codes.to(tl.uint8), mask=mask)
        if VALUES:
            _store_values(values_ptr, base + offsets, codes, scale, low, mask)
    tl.store(scale_ptr + row, scale)
    tl.store(minimum_ptr + row, low)
    tl.store(maximum_ptr + row, high)


@triton.jit
def _token_block_kernel(x_ptr, top_ptr, seed_ptr, codes_ptr, scale_ptr, rows, columns, STOCHASTIC: tl.constexpr,
                        BLOCK_ROWS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr):
    block, column_block = tl.program_id(0), tl.program_id(1)
    row = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    column = column_block * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)
    mask = (row[:, None] < rows) & (column[None, :] < columns)
    index = row[:, None].to(tl.int64) * columns + column[None, :]
    x = tl.load(x_ptr + index, mask=mask, other=0.0).to(tl.float32)
    top = tl.load(top_ptr)
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), 0), top), MIN_SCALE)
    scaled = tl.div_rn(x, scale[None, :])
    if STOCHASTIC:
        scaled = scaled + _hashed_noise(index.to(tl.int32), tl.load(seed_ptr))
    codes = tl.minimum(tl.maximum((scaled + ROUNDING) - ROUNDING, -top), top)
    tl.store(codes_ptr + index, codes.to(tl.int8), mask=mask)
    tl.store(scale_ptr + block * columns + column, scale, mask=column < columns)


@triton.jit
def _block_scaled_dot_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, out_ptr, tokens, m, n,
                             BLOCK_TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[i, j] = sum over token blocks k of a_scale[k, i] b_scale[k, j] sum_{t in k} a[t, i] b[t, j] (int32 sums)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for block in range(0, tl.cdiv(tokens, BLOCK_TOKENS)):
        t = block * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
        a = tl.load(a_ptr + t[:, None].to(tl.int64) * m + rows[None, :],
                    mask=(t[:, None] < tokens) & (rows[None, :] < m), other=0)
        b = tl.load(b_ptr + t[:, None].to(tl.int64) * n + columns[None, :],
                    mask=(t[:, None] < tokens) & (columns[None, :] < n), other=0)
        sums = tl.dot(tl.trans(a), b, out_dtype=tl.int32)
        a_scale = tl.load(a_scale_ptr + block * m + rows, mask=rows < m, other=0.0)
        b_scale = tl.load(b_scale_ptr + block * n + columns, mask=columns < n, other=0.0)
        accumulator += sums.to(tl.float32) * (a_scale[:, None] * b_scale[None, :])
    tl.store(out_ptr + rows[:, None].to(tl.int64) * n + columns[None, :], accumulator,
             mask=(rows[:, None] < m) & (columns[None, :] < n))


@torch.library.custom_op("hf_cpt::row_codes", mutates_args=())
def _row_codes_op(x: torch.Tensor, levels: torch.Tensor, seed: torch.Tensor, stochastic: bool, values: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, columns = x.shape
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scale, minimum, maximum = (torch.empty(rows, 1, dtype=torch.float32, device=x.device) for _ in range(3))
    out = torch.empty_like(x) if values else x.new_empty(0)
    _row_codes_kernel[(rows,)](x, levels, seed, codes, scale, minimum, maximum, out if values else codes, columns,
                               STOCHASTIC=stochastic, VALUES=values,
                               BLOCK=min(ROW_BLOCK, triton.next_power_of_2(max(columns, 16))), enable_fp_fusion=False)
    return codes, scale, minimum, maximum, out


@_row_codes_op.register_fake
def _(x, levels, seed, stochastic, values):
    scale = x.new_empty(x.shape[0], 1, dtype=torch.float32)
    return (x.new_empty(x.shape, dtype=torch.uint8), scale, torch.empty_like(scale), torch.empty_like(scale),
            torch.empty_like(x) if values else x.new_empty(0))


@torch.library.custom_op("hf_cpt::token_block_codes", mutates_args=())
def _token_block_op(matrix: torch.Tensor, top: torch.Tensor, seed: torch.Tensor, stochastic: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    rows, columns = matrix.shape
    codes = torch.empty(matrix.shape, dtype=torch.int8, device=matrix.device)
    scales = torch.empty(triton.cdiv(rows, TOKEN_BLOCK), columns, dtype=torch.float32, device=matrix.device)
    grid = (scales.shape[0], triton.cdiv(columns, CHANNEL_BLOCK))
    _token_block_kernel[grid](matrix, top, seed, codes, scales, rows, columns, STOCHASTIC=stochastic,
                              BLOCK_ROWS=TOKEN_BLOCK, BLOCK_COLUMNS=CHANNEL_BLOCK, enable_fp_fusion=False)
    return codes, scales


@_token_block_op.register_fake
def _(matrix, top, seed, stochastic):
    blocks = (matrix.shape[0] + TOKEN_BLOCK - 1) // TOKEN_BLOCK
    return matrix.new_empty(matrix.shape, dtype=torch.int8), matrix.new_empty(blocks, matrix.shape[1],
                                                                               dtype=torch.float32)


@torch.library.custom_op("hf_cpt::block_scaled_matmul", mutates_args=())
def _block_scaled_op(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor
                     ) -> torch.Tensor:
    tokens, m = a.shape
    n = b.shape[1]
    out = torch.empty(m, n, dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(m, CHANNEL_BLOCK), triton.cdiv(n, CHANNEL_BLOCK))
    _block_scaled_dot_kernel[grid](a, a_scales, b, b_scales, out, tokens, m, n, BLOCK_TOKENS=TOKEN_BLOCK,
                                   BLOCK_M=CHANNEL_BLOCK, BLOCK_N=CHANNEL_BLOCK, enable_fp_fusion=False)
    return out


@_block_scaled_op.register_fake
def _(a, a_scales, b, b_scales):
    return a.new_empty(a.shape[1], b.shape[1], dtype=torch.float32)


def _seed(seed: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    return seed if seed is not None else torch.zeros((), dtype=torch.int32, device=device)


def row_codes(x: torch.Tensor, levels: torch.Tensor, seed: torch.Tensor | None, values: bool = False
              ) -> tuple[torch.Tensor, ...]:
    """(uint8 codes, scale ``[T, 1]``, minimum ``[T, 1]``, maximum ``[T, 1]``, the values in ``x``'s dtype or an empty
    tensor) of a contiguous ``[T, N]`` matrix on each row's min/max grid with ``levels`` (float32) top code:
    stochastic rounding with the hashed noise of ``seed`` (an error's), nearest without (an operand's)."""
    return _row_codes_op(x, levels, _seed(seed, x.device), seed is not None, values)


def token_block_codes(matrix: torch.Tensor, top: torch.Tensor, seed: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes ``[T, N]``, scales ``[ceil(T / TOKEN_BLOCK), N]``) of a contiguous ``[T, N]`` matrix quantized per
    channel in blocks of `TOKEN_BLOCK` rows on the zero-centred grid with top code ``top`` (float32)."""
    return _token_block_op(matrix, top, _seed(seed, matrix.device), seed is not None)


def block_scaled_matmul(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor
                        ) -> torch.Tensor:
    """``aᵀ b`` ``[M, N]`` in float32 of int8 ``a`` ``[T, M]`` and ``b`` ``[T, N]`` with one scale per block of
    `TOKEN_BLOCK` tokens and channel (``[blocks, M]``, ``[blocks, N]``): the int32 sum of each block, scaled."""
    return _block_scaled_op(a, a_scales, b, b_scales)
