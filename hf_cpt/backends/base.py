"""`Backend`: the operations a device's kernels provide, with the reference formulas as their definition."""

from __future__ import annotations

import torch

from ..numerics import backward_products, error_kernels
from ..numerics.errors import ErrorQuantization, quantize_error
from ..numerics.fake_quant import fake_quantize_compact, quantize_compact, restore_compact
from ..numerics.integer_matmul import code_matmul

Codes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (uint8 codes, scale, minimum)
# torch._int_mm on CUDA: more than 16 rows, the reduced and output sizes multiples of 8
INT_MM_ROWS, INT_MM_MULTIPLE = 16, 8


def int8_gemm_takes(rows: int, reduced: int, columns: int) -> bool:
    """Whether a GPU's int8 GEMM (``torch._int_mm``) takes a ``[rows, reduced] @ [reduced, columns]`` product."""
    return rows > INT_MM_ROWS and reduced % INT_MM_MULTIPLE == 0 and columns % INT_MM_MULTIPLE == 0


class Backend:
    """The operations of CPT's numerics on one kind of device, each computed with the torch formulas here; a
    subclass overrides those its kernels compute (bit for bit the same codes and values; products on codes up to
    float rounding, their integer sums exact)."""

    name = "reference"
    native = False  # whether the package's C kernels may serve (CPU tensors only)
    fallbacks = 0  # products on codes a GPU's int8 GEMM could not take, run in float (`code_product`)
    # whether codes saved for the backward at 4 bits or fewer are packed two a byte (eager forwards; a pass each way)
    packs_saved_codes = False

    def products_on_codes(self, setting: bool | str) -> bool:
        """Whether training products run on integer codes here under ``RuntimeSettings.integer_matmul`` (True, False
        or "auto"): never by default, a device keeping its float kernels until a backend of its own has
        kernels measured faster."""
        return False

    def int8_gemm(self) -> bool:
        """Whether products on codes run as int8 GEMMs (else a float32 GEMM of the centred codes, exact where its
        sums are proven to be, or float64)."""
        return True

    def operand(self, x: torch.Tensor, minimum: torch.Tensor, maximum: torch.Tensor, bits: torch.Tensor,
                values: bool = True) -> tuple[torch.Tensor | None, Codes]:
        """(the fake-quantized ``x`` if ``values``, else None; its codes, scale and minimum) over the given range."""
        if values:
            return fake_quantize_compact(x, minimum, maximum, bits, native=self.native)
        return None, quantize_compact(x, minimum, maximum, bits, native=self.native)

    def token_operand(self, x: torch.Tensor, dim: int, bits: torch.Tensor, values: bool
                      ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor | None, Codes]] | None:
        """(``x``'s per-token range over ``dim`` as `token_range` gives it, `operand`'s result over that range) in one
        pass where this device has a kernel for it; None: the caller takes the range, then the operand."""
        return None

    def restore(self, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        """The fake-quantized values of `operand`'s codes, bit for bit."""
        return restore_compact(codes, scale, minimum, dtype, native=self.native)

    def error(self, grad: torch.Tensor, bits: torch.Tensor, scheme: ErrorQuantization, feature_dim: int,
              fused: bool = True) -> torch.Tensor:
        """The error quantized at ``bits`` with ``scheme`` (``fused``: by one kernel where this device has one)."""
        return quantize_error(grad, bits, scheme, feature_dim, fused)

    def takes_int8_gemm(self, rows: int, reduced: int, columns: int, device: torch.device) -> bool:
        """Whether this device's int8 GEMM takes a ``[rows, reduced] @ [reduced, columns]`` product: any on a CPU."""
        return device.type == "cpu" or int8_gemm_takes(rows, reduced, columns)

    def code_product(self, a: Codes, b: Codes, bits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``restore(a) @ restore(b) + bias`` in float32, from the codes (`hf_cpt.numerics.integer_matmul`); on a GPU,
        shapes its int8 GEMM cannot take (`takes_int8_gemm`) as a float product of the restored values, counted in
        ``fallbacks``."""
        if not self.takes_int8_gemm(a[0].shape[0], *b[0].shape, a[0].device):
            self.fallbacks += 1
            out = self.restore(*a, torch.float32) @ self.restore(*b, torch.float32)
            return out if bias is None else out + bias.float()
        return code_matmul(*a, *b, bits, bias, int8=self.int8_gemm(), native=self.native)

    def error_codes(self, grad: torch.Tensor, bits: torch.Tensor, scheme: ErrorQuantization) -> Codes | None:
        """The quantized error's (codes, scale, minimum) as rows over its last dimension
        (`backward_products.error_codes`), for the min/max grid; None for the zero-centred one (products in float)."""
        if scheme.range != "minmax":
            return None
        seed = error_kernels.noise_seed(grad.device) if scheme.rounding == "stochastic" else None
        return backward_products.error_codes(grad.reshape(-1, grad.shape[-1]), bits, scheme.granularity == "token",
                                             seed)

    def int8_input_gradient(self, error: Codes, weight: torch.Tensor) -> torch.Tensor:
        """``E W`` ``[T, in]`` in float32 from the error's codes (rows ``[T, out]``) and an ``[out, in]`` weight
        re-quantized per input channel at 8 bits: one int8 product on codes."""
        bits = backward_products.requantized_bits(weight.device)
        rows, low, high = backward_products.input_channel_range(weight)
        _, (codes, scale, minimum) = self.operand(rows, low, high, bits, values=False)
        return self.code_product(error, (codes.t(), scale.reshape(1, -1), minimum.reshape(1, -1)), bits, None)

    def int8_weight_gradient(self, error: torch.Tensor, x: torch.Tensor, error_bits: torch.Tensor) -> torch.Tensor:
        """``Eᵀ X`` ``[out, in]`` in float32 of a full-precision error ``[T, out]`` and an input ``[T, in]``, both
        quantized in blocks of tokens (`backward_products.weight_gradient`)."""
        return backward_products.weight_gradient(error, x, error_bits, error_kernels.noise_seed(error.device))
