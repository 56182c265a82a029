"""The CUDA backend: Triton kernels for operands and errors (`kernels`, `backward_kernels`), bit for bit the reference
in Triton's interpreter (tests/test_cuda_kernels.py), and products on int8 codes: the forward and an int8 input
gradient through ``torch._int_mm``, an int8 weight gradient through a Triton GEMM with per-block scales. Shapes an int8
GEMM cannot take run the float product instead, counted in ``fallbacks`` (`Backend.code_product`). Off unless
``HF_CPT_CUDA_KERNELS=1`` until the same tests have passed on a GPU (bench/gpu_check.sh sets it).
"""

from __future__ import annotations

import torch

from ...numerics.backward_products import requantized_bits
from ...numerics.error_kernels import noise_seed, symmetric_levels
from ...numerics.errors import ErrorQuantization
from ...numerics.fake_quant import levels_on, quantization_scale
from ..base import Backend, Codes, int8_gemm_takes
from .backward_kernels import block_scaled_matmul, row_codes, token_block_codes
from .kernels import KERNEL_DTYPES, operand_codes, restore_values


def _kernels_read(t: torch.Tensor) -> bool:  # a float dtype the Triton kernels take, and at least one element
    return t.dtype in KERNEL_DTYPES and t.numel() > 0


def _row_grids(t: torch.Tensor, bits: torch.Tensor, seed: torch.Tensor | None, values: bool = False):
    """`row_codes` of ``t``'s rows (along its last dimension) at ``bits``."""
    return row_codes(t.reshape(-1, t.shape[-1]).contiguous(), levels_on(bits, t.device, torch.float32), seed, values)


class CUDABackend(Backend):
    """Operands' codes and values, values rebuilt from codes, per-token errors' codes: one Triton pass each; products
    on int8 codes (the forward by default, the backward's with the int8 options); else the reference."""

    name = "cuda"
    packs_saved_codes = True  # activation memory is what a GPU runs out of

    def products_on_codes(self, setting: bool | str) -> bool:
        return True if setting == "auto" else setting

    def takes_int8_gemm(self, rows: int, reduced: int, columns: int, device: torch.device) -> bool:
        return int8_gemm_takes(rows, reduced, columns)  # the GPU's limits, also for CPU tensors in the interpreter

    def operand(self, x: torch.Tensor, minimum: torch.Tensor, maximum: torch.Tensor, bits: torch.Tensor,
                values: bool = True) -> tuple[torch.Tensor | None, Codes]:
        levels = levels_on(bits, x.device, torch.float32)  # the reference's grid for float32 / half inputs
        low, high = minimum.to(torch.float32), maximum.to(torch.float32)
        scale = quantization_scale(low, high, levels)
        fast = operand_codes(x, low, scale, levels, values)
        if fast is None:
            return super().operand(x, minimum, maximum, bits, values)
        codes, fake_quantized = fast
        return fake_quantized, (codes, scale, low)

    def restore(self, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        fast = restore_values(codes, minimum, scale, dtype)
        return fast if fast is not None else super().restore(codes, scale, minimum, dtype)

    def error(self, grad: torch.Tensor, bits: torch.Tensor, scheme: ErrorQuantization, feature_dim: int,
              fused: bool = True) -> torch.Tensor:
        per_token = scheme.granularity == "token" and feature_dim % grad.dim() == grad.dim() - 1
        if not (fused and per_token and scheme.range == "minmax" and scheme.rounding == "stochastic"
                and _kernels_read(grad)):
            return super().error(grad, bits, scheme, feature_dim, fused)
        return _row_grids(grad, bits, noise_seed(grad.device), True)[4].view(grad.shape)  # codes, values: one pass

    def error_codes(self, grad: torch.Tensor, bits: torch.Tensor, scheme: ErrorQuantization) -> Codes | None:
        if scheme.range != "minmax" or scheme.granularity != "token" or not _kernels_read(grad):
            return super().error_codes(grad, bits, scheme)
        seed = noise_seed(grad.device) if scheme.rounding == "stochastic" else None  # as the reference draws it
        return _row_grids(grad, bits, seed)[:3]

    def token_operand(self, x: torch.Tensor, dim: int, bits: torch.Tensor, values: bool):
        if dim % x.dim() != x.dim() - 1 or not _kernels_read(x):
            return None
        codes, scale, minimum, maximum, out = _row_grids(x, bits, None, values)
        shape = (*x.shape[:-1], 1)
        x_range = (minimum.view(shape).to(x.dtype), maximum.view(shape).to(x.dtype))
        quantized = (out.view(x.shape) if values else None), (codes.view(x.shape), scale.view(shape),
                                                              minimum.view(shape))
        return x_range, quantized

    def int8_weight_gradient(self, error: torch.Tensor, x: torch.Tensor, error_bits: torch.Tensor) -> torch.Tensor:
        seed = noise_seed(error.device)
        error_top = levels_on(error_bits, error.device, torch.float32, symmetric_levels)
        error_codes, error_scales = token_block_codes(error.contiguous(), error_top, seed)
        input_top = levels_on(requantized_bits(x.device), x.device, torch.float32, symmetric_levels)
        input_codes, input_scales = token_block_codes(x.contiguous(), input_top, None)
        return block_scaled_matmul(error_codes, error_scales, input_codes, input_scales)
