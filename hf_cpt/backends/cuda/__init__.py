"""The CUDA backend: Triton kernels (`hf_cpt.backends.cuda.kernels`), bit for bit the reference in Triton's interpreter
(tests/test_cuda_kernels.py); the reference for the rest (issue 73). Off unless ``HF_CPT_CUDA_KERNELS=1`` until the same
test has passed on a GPU (bench/gpu_check.sh sets it).
"""

from __future__ import annotations

import torch

from ...numerics.fake_quant import levels_on, quantization_scale
from ..base import Backend, Codes
from .kernels import operand_codes, restore_values

ENABLE_VARIABLE = "HF_CPT_CUDA_KERNELS"


class CUDABackend(Backend):
    """An operand's codes and values, and values rebuilt from codes, in one Triton pass each; else the reference."""

    name = "cuda"

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
