"""The backward products of a quantized matrix product on int8 (docs/method.md §2, "Backward products on int8").

Each backward GEMM of a quantized Linear runs either on the rebuilt operands in a float GEMM of the error's dtype
("float": the CPT paper's numerics) or with every operand on an int8 grid whose scales factor out of the sums
("int8", `ErrorQuantization.input_product` / ``weight_product``), what an int8 tensor core can run exactly:

- input gradient ``E W``: the weight's per-output-channel scale sits on the summed index, so the weight is
  re-quantized per input channel at 8 bits over its min/max (nearest); the error's codes (min/max grid, per token or
  per tensor) enter as they are. An int8 product on codes (`hf_cpt.numerics.integer_matmul`) computes it.
- weight gradient ``Eᵀ X``: the per-token scales sit on the summed index, so the full-precision error (at the error
  bits, stochastic rounding with the hashed noise of the fused error kernels) and the input (8 bits, nearest) are
  quantized per channel in blocks of `TOKEN_BLOCK` tokens on the zero-centred grid; the scales apply per block.

`weight_gradient` defines the weight gradient's option in float (values on those grids, a float32 GEMM, equal to
the blocked int8 GEMM's result up to float rounding); a backend computes the same on int8 codes
(`hf_cpt.backends.cuda`). Knows nothing of layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .derived import derived
from .error_kernels import hashed_uniform_noise, symmetric_levels, symmetric_round
from .fake_quant import MIN_SCALE, levels_on, quantization_scale, tensor_range, token_range

PRODUCTS = ("float", "int8")
TOKEN_BLOCK = 128  # tokens per block of the weight gradient's scales: one K step of an int8 GEMM tile
REQUANTIZED_BITS = 8  # the bits of a re-quantized operand (the weight per input channel, the input in blocks)
REQUANTIZED = torch.tensor(float(REQUANTIZED_BITS))


def requantized_bits(device: torch.device) -> torch.Tensor:
    """`REQUANTIZED_BITS` as a tensor on ``device``: copied there once, not in every backward (a host copy each)."""
    return derived(REQUANTIZED, ("on", device), lambda: REQUANTIZED.to(device))


def error_codes(grad: torch.Tensor, bits: torch.Tensor, per_row: bool, seed: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uint8 codes, scale, minimum) of a ``[T, N]`` error on the min/max grid at ``bits``, per row or per tensor:
    the fused error kernels' formula (stochastic rounding with the hashed noise of ``seed``; nearest without), whose
    values ``codes * scale + minimum`` are the quantized error bit for bit."""
    source = grad.float()
    minimum, maximum = token_range(source, -1) if per_row else tensor_range(source)
    levels = levels_on(bits, source.device, torch.float32)
    scale = quantization_scale(minimum, maximum, levels)
    steps = (source - minimum) / scale
    if seed is not None:
        steps = steps + hashed_uniform_noise(source.numel(), seed, source.device).view(source.shape)
    return torch.round(torch.minimum(steps.clamp_min(0.0), levels)).to(torch.uint8), scale, minimum


def input_channel_range(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the ``[out, in]`` weight as ``[in, out]`` rows, the min and max of each, ``[in, 1]``): the grid of the weight
    re-quantized per input channel at `REQUANTIZED_BITS`."""
    rows = weight.t().float().contiguous()
    return rows, rows.amin(1, keepdim=True), rows.amax(1, keepdim=True)


def token_block_scales(source: torch.Tensor, bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``max|x| / L`` of each channel in each block of `TOKEN_BLOCK` rows ``[blocks, 1, N]``, the top code ``L``) of
    a float32 ``[T, N]`` matrix on the zero-centred grid (``L = 2^(b-1) - 1``); a block of zeros gets the floor."""
    rows, columns = source.shape
    padded = F.pad(source.abs(), (0, 0, 0, (-rows) % TOKEN_BLOCK)).view(-1, TOKEN_BLOCK, columns)
    top = levels_on(bits, source.device, torch.float32, symmetric_levels)
    return (padded.amax(1, keepdim=True) / top).clamp_min(MIN_SCALE), top


def token_blocks(matrix: torch.Tensor, bits: torch.Tensor, seed: torch.Tensor | None = None) -> torch.Tensor:
    """A ``[T, N]`` matrix quantized per channel in blocks of `TOKEN_BLOCK` rows on the zero-centred grid at ``bits``,
    in float32: stochastic rounding with the hashed noise of element ``t * N + n`` and ``seed``, nearest without."""
    source = matrix.float()
    rows, columns = source.shape
    scale, top = token_block_scales(source, bits)
    scale = scale.expand(-1, TOKEN_BLOCK, -1).reshape(-1, columns)[:rows]
    noise = None if seed is None else hashed_uniform_noise(source.numel(), seed, source.device).view(rows, columns)
    return symmetric_round(source, scale, top, noise)


def weight_gradient(error: torch.Tensor, x: torch.Tensor, error_bits: torch.Tensor, seed: torch.Tensor
                    ) -> torch.Tensor:
    """``Eᵀ X`` ``[out, in]`` of the full-precision error ``[T, out]`` and the input ``[T, in]``, each quantized per
    channel in blocks of tokens (the error at ``error_bits``, stochastic), in float32."""
    return token_blocks(error, error_bits, seed).t().matmul(token_blocks(x, requantized_bits(x.device)))
