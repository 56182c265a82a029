"""The backward products of a quantized matrix product on int8 (docs/backward.md, "Backward products on int8").

Each backward GEMM of a quantized Linear runs either on the rebuilt operands in a float GEMM of the error's dtype
("float": the CPT paper's numerics) or with every operand on an int8 grid whose scales factor out of the sums
("int8", `ErrorQuantization.input_product` / ``weight_product``), what an int8 tensor core can run exactly:

- input gradient ``E W``: the weight's per-output-channel scale sits on the summed index, so the weight is
  re-quantized per input channel at 8 bits over its min/max (nearest); the error keeps its per-token codes.
- weight gradient ``Eᵀ X``: the per-token scales sit on the summed index, so the full-precision error (at the error
  bits, stochastic rounding with the hashed noise of the fused error kernels) and the input (8 bits, nearest) are
  quantized per channel in blocks of `TOKEN_BLOCK` tokens on the zero-centred grid; the scales apply per block.

The functions here define the options: values on those grids, a float32 GEMM, equal to the int8 GEMM's result up to
float rounding. A backend computes the same on int8 codes (`hf_cpt.backends.cuda`). Knows nothing of layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .error_kernels import hashed_uniform_noise, symmetric_levels, symmetric_round
from .fake_quant import MIN_SCALE, fake_quantize

PRODUCTS = ("float", "int8")
TOKEN_BLOCK = 128  # tokens per block of the weight gradient's scales: one K step of an int8 GEMM tile
REQUANTIZED_BITS = 8  # the bits of a re-quantized operand (the weight per input channel, the input in blocks)
_REQUANTIZED = torch.tensor(float(REQUANTIZED_BITS))


def noise_seed(device: torch.device) -> torch.Tensor:
    """A seed of the hashed noise, drawn from the global RNG as the fused error kernels draw theirs."""
    return torch.randint(0, 2**31 - 1, (), device=device, dtype=torch.int32)


def per_input_channel(weight: torch.Tensor) -> torch.Tensor:
    """The ``[out, in]`` weight re-quantized per input channel (column) at 8 bits over its min/max, nearest, in
    float32."""
    source = weight.float()
    minimum, maximum = source.amin(0, keepdim=True), source.amax(0, keepdim=True)
    return fake_quantize(source, minimum, maximum, _REQUANTIZED.to(source.device))


def token_block_scales(source: torch.Tensor, bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``max|x| / L`` of each channel in each block of `TOKEN_BLOCK` rows ``[blocks, 1, N]``, the top code ``L``) of
    a float32 ``[T, N]`` matrix on the zero-centred grid (``L = 2^(b-1) - 1``); a block of zeros gets the floor."""
    rows, columns = source.shape
    padded = F.pad(source.abs(), (0, 0, 0, (-rows) % TOKEN_BLOCK)).view(-1, TOKEN_BLOCK, columns)
    top = symmetric_levels(bits.to(source.device, torch.float32))
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


def input_gradient(error: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``E W`` of the quantized error ``[T, out]`` and the ``[out, in]`` weight re-quantized per input channel, in
    float32."""
    return error.float().matmul(per_input_channel(weight))


def weight_gradient(error: torch.Tensor, x: torch.Tensor, error_bits: torch.Tensor, seed: torch.Tensor
                    ) -> torch.Tensor:
    """``Eᵀ X`` ``[out, in]`` of the full-precision error ``[T, out]`` and the input ``[T, in]``, each quantized per
    channel in blocks of tokens (the error at ``error_bits``, stochastic), in float32."""
    return token_blocks(error, error_bits, seed).t().matmul(token_blocks(x, _REQUANTIZED.to(x.device)))
