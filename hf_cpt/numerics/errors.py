"""Quantization of errors, the output gradients of the backward pass (docs/method.md §2).

Stochastic rounding (uniform noise in [-1/2, 1/2) before the clamp, unbiased inside the range) over one range per
error tensor as in the CPT paper, or per row (``granularity="token"``); on the min/max grid or a zero-centred one
(``range="symmetric"``); or nearest rounding. `ErrorQuantization` says which, for which backward products. Large
tensors go through one fused kernel with hashed noise (`hf_cpt.numerics.error_kernels`). Knows nothing of layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..utils import cached_outside_compile, check_choice, setting
from . import error_kernels
from .backward_products import PRODUCTS
from .error_kernels import KERNEL_SOURCES, grid, noise_seed, symmetric_levels, symmetric_round
from .fake_quant import _compute_dtype, fake_quantize, levels_on, quantization_scale, tensor_range, token_range

# Below this many elements the eager error quantizer is as fast as the fused one.
FUSED_MIN_NUMEL = 1 << 16
# How errors are quantized (docs/method.md §2): one range per tensor (the CPT paper) or per row (token); "auto"
# follows each layer's activations (per row where they are per token, per tensor elsewhere).
ERROR_GRANULARITIES = ("tensor", "token")
ERROR_GRANULARITY_CHOICES = ("auto", *ERROR_GRANULARITIES)
ERROR_ROUNDINGS = ("stochastic", "nearest")
# The grid of the quantized errors: min/max (the CPT paper) or zero-centred, ±max|e| with zero on the grid; "auto"
# gives the attention products' errors the zero-centred grid and the layers' errors min/max (docs/method.md §2).
ERROR_RANGES = ("minmax", "symmetric")
ERROR_RANGE_CHOICES = ("auto", *ERROR_RANGES)
# Which backward products use the quantized error: both, the input gradient only (the weight gradient
# from the full-precision error, as SwitchBack does), or the weight gradient only.
ERROR_PRODUCTS = ("both", "input", "weight")


@dataclass(frozen=True)
class ErrorQuantization:
    """How errors (output gradients) are quantized: ranges, rounding, which products use them."""

    granularity: str = setting(
        "tensor",
        "Ranges of the quantized errors (output gradients): 'tensor' (one per error tensor, the CPT paper), "
        "'token' (one per row: each token's own range over the output features, per pixel for Conv2d; keeps "
        "tokens whose error is small from falling below one quantization step) or 'auto' (CPTConfig's default: "
        "per row in layers with per-token activations, per tensor in the others, e.g. Conv2d and every layer "
        "under quant_scheme='paper'; docs/backward.md)."
    )
    rounding: str = setting("stochastic",
        "Rounding of the quantized errors: 'stochastic' (unbiased, the CPT paper) or 'nearest'.")
    products: str = setting(
        "both",
        "Backward products that use the quantized error: 'both' (the CPT paper), 'input' (the input gradient; the "
        "weight gradient from the full-precision error, as SwitchBack does, priced at 32-bit errors) or 'weight'."
    )
    range: str = setting(
        "minmax",
        "Grid of the quantized errors: 'minmax' (the range's min to max, the CPT paper), 'symmetric' (-max|e| to "
        "max|e| with zero on the grid: values near zero stay near zero, which keeps a sparse error such as the "
        "attention scores' from turning into noise) or 'auto' (CPTConfig's default: symmetric for the attention "
        "products' errors, minmax for the layers'; docs/backward.md)."
    )

    input_product: str = setting(
        "float",
        "The input gradient's GEMM where its error is quantized: 'float' (the quantized error times the layer's "
        "weight in a GEMM of the error's dtype, the CPT paper) or 'int8' (the weight re-quantized per input channel "
        "at 8 bits, so that an int8 GEMM computes it exactly: the CUDA backend's fast path). Matrix products only "
        "(Linear, GPT-2's Conv1D); docs/method.md §2."
    )
    weight_product: str = setting(
        "float",
        "The weight gradient's GEMM where its error is quantized: 'float' (the CPT paper) or 'int8' (the error at "
        "the error bits, stochastic rounding, and the input at 8 bits, each quantized per channel in blocks of 128 "
        "tokens on the zero-centred grid, so that an int8 GEMM computes it with the scales applied per block). "
        "Matrix products only; docs/method.md §2."
    )

    def __post_init__(self) -> None:
        for name, choices in (("granularity", ERROR_GRANULARITY_CHOICES), ("rounding", ERROR_ROUNDINGS),
                              ("products", ERROR_PRODUCTS), ("range", ERROR_RANGE_CHOICES),
                              ("input_product", PRODUCTS), ("weight_product", PRODUCTS)):
            check_choice("ErrorQuantization", name, getattr(self, name), choices)

    def for_activations(self, activation_granularity: str) -> ErrorQuantization:
        """These settings for a layer whose activations are quantized with ``activation_granularity``: granularity
        "auto" becomes per row ("token") for per-token activations and per tensor otherwise (docs/backward.md:
        per-row errors bring a fine-tuned transformer near FP32; on a CNN trained from scratch they made no
        consistent difference, so its layers keep the paper's per-tensor errors)."""
        return _resolve_errors(self, activation_granularity)

    def for_attention(self) -> ErrorQuantization:
        """These settings for the attention products (two activations, no weight): the errors of both products;
        range "auto" becomes the zero-centred grid (the score gradient is zero almost everywhere in a
        row, and a min/max grid puts those zeros between two levels: docs/backward.md)."""
        return dataclasses.replace(self, products="both", range="symmetric" if self.range == "auto" else self.range)

    @property
    def quantizes_input_gradient(self) -> bool:
        return self.products in ("both", "input")

    @property
    def quantizes_weight_gradient(self) -> bool:
        return self.products in ("both", "weight")


PAPER_ERRORS = ErrorQuantization()  # the CPT paper: one range per tensor, stochastic rounding


@cached_outside_compile(maxsize=64)
def _resolve_errors(errors: ErrorQuantization, activation_granularity: str) -> ErrorQuantization:
    # Cached: every training forward of a layer asks, and the answer is fixed for the run.
    granularity = errors.granularity
    if granularity == "auto":
        granularity = "token" if activation_granularity == "token" else "tensor"
    grid = "minmax" if errors.range == "auto" else errors.range
    return dataclasses.replace(errors, granularity=granularity, range=grid)


def _stochastic_quantize(
    x: torch.Tensor, minimum: torch.Tensor, maximum: torch.Tensor, bits: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    levels = levels_on(bits, x.device, x.dtype)
    scale = quantization_scale(minimum, maximum, levels)
    codes = (x - minimum).div_(scale).add_(noise).clamp_min_(0.0).clamp_max_(levels).round_()
    return codes.mul_(scale).add_(minimum)


def quantize_error_symmetric(
    grad: torch.Tensor, bits: torch.Tensor, per_row: bool, feature_dim: int = -1, stochastic: bool = True
) -> torch.Tensor:
    """Quantization on the zero-centred grid (`ErrorQuantization.range="symmetric"`), one ``max|e|`` per tensor
    or per row over ``feature_dim``; stochastic rounding draws from the global RNG (the eager path)."""
    source = _compute_dtype(grad)
    _, scale, top = grid(source, levels_on(bits, source.device, bits.dtype, symmetric_levels), per_row, True,
                         feature_dim)
    noise = torch.empty_like(source).uniform_(-0.5, 0.5) if stochastic else None
    return symmetric_round(source, scale, top, noise).to(grad.dtype)


def quantize_error_eager(grad: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Per-tensor stochastic quantization, noise from the global RNG as in the CPT code."""
    source = _compute_dtype(grad)
    minimum, maximum = tensor_range(source)
    noise = torch.empty_like(source).uniform_(-0.5, 0.5)
    return _stochastic_quantize(source, minimum, maximum, bits, noise).to(grad.dtype)


def quantize_error_per_row(grad: torch.Tensor, bits: torch.Tensor, feature_dim: int = -1) -> torch.Tensor:
    """Per-row stochastic quantization (each token's own min / max over ``feature_dim``), noise from the
    global RNG: the eager twin of the per-row kernel.

    A row of zeros (padding, a token the loss never reached) stays exactly zero; no range is degenerate
    into a division by zero (the scale is clamped as everywhere).
    """
    source = _compute_dtype(grad)
    minimum, maximum = token_range(source, feature_dim)
    noise = torch.empty_like(source).uniform_(-0.5, 0.5)
    return _stochastic_quantize(source, minimum, maximum, bits, noise).to(grad.dtype)


def quantize_error(
    grad: torch.Tensor, bits: torch.Tensor, scheme: ErrorQuantization = PAPER_ERRORS, feature_dim: int = -1,
    fused: bool = True,
) -> torch.Tensor:
    """Quantization of an error tensor at ``bits`` with ``scheme`` (docs/method.md §2).

    Ranges per tensor (the CPT paper) or per row over ``feature_dim``, on the min/max or the zero-centred grid;
    stochastic or nearest rounding. Stochastic rounding with
    ``fused`` runs one fused kernel (hashed noise, clamp, rounding; `error_kernels.fused_kernel`) for large
    tensors and falls back to the eager path, with one warning, if no fused kernel can be built.
    """
    if scheme.granularity not in ERROR_GRANULARITIES or scheme.range not in ERROR_RANGES:
        raise ValueError(f"error granularity and range must be one of {ERROR_GRANULARITIES} and {ERROR_RANGES} when "
                         f"quantizing, got {scheme.granularity!r} and {scheme.range!r} (resolve 'auto' with "
                         "ErrorQuantization.for_activations or for_attention)")
    if grad.numel() == 0:
        return grad
    per_row, symmetric = scheme.granularity == "token", scheme.range == "symmetric"
    if scheme.rounding == "nearest":
        if symmetric:
            return quantize_error_symmetric(grad, bits, per_row, feature_dim, stochastic=False)
        source = _compute_dtype(grad)
        minimum, maximum = token_range(source, feature_dim) if per_row else tensor_range(source)
        return fake_quantize(source, minimum, maximum, bits).to(grad.dtype)
    # Inside a compiled graph the compiler fuses the plain formula; outside, a fused kernel runs it (the native one
    # on CPU, a compiled one elsewhere). (Not torch.compiler.is_compiling(): a process-wide flag, also set while
    # another thread compiles.)
    in_graph = torch.compiler.is_dynamo_compiling() or torch.compiler.is_exporting()
    kernel, levels_of = None, KERNEL_SOURCES[scheme.granularity, scheme.range][1]
    fused = fused and not in_graph and grad.numel() >= FUSED_MIN_NUMEL
    if in_graph:
        kernel = KERNEL_SOURCES[scheme.granularity, scheme.range][0]
    elif fused:
        kernel = error_kernels.fused_kernel(grad.device, scheme.granularity, scheme.range)
    if kernel is not None:
        seed = noise_seed(grad.device)
        levels = levels_on(bits, grad.device, bits.dtype, levels_of)
        try:
            # Per row as (rows, features), else flat: one kernel serves every rank and layout.
            rows = grad.movedim(feature_dim, -1) if per_row else grad
            source = rows.reshape(-1, rows.shape[-1]) if per_row else grad.contiguous().view(-1)
            # The C kernel writes over its input where that is a copy made here (the others make their own result).
            where = {"overwrite": True} if fused and source.data_ptr() != grad.data_ptr() else {}
            result = kernel(source, levels, seed, **where).view(rows.shape)
            return result.movedim(-1, feature_dim) if per_row else result
        except Exception as error:  # compiler missing or failing: keep training, eagerly
            if in_graph:
                raise
            error_kernels.disable_fused(f"{type(error).__name__}: {error}")
    if symmetric:
        return quantize_error_symmetric(grad, bits, per_row, feature_dim)
    if per_row:
        return quantize_error_per_row(grad, bits, feature_dim)
    return quantize_error_eager(grad, bits)


class _QuantizeErrorOnBackward(torch.autograd.Function):
    """Identity in forward; quantizes the gradient flowing back through it."""

    @staticmethod
    def forward(ctx, x, bits, scheme, feature_dim, fused):
        ctx.bits = bits.detach().clone()
        ctx.scheme, ctx.feature_dim, ctx.fused = scheme, feature_dim, fused
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_output):
        return quantize_error(grad_output, ctx.bits, ctx.scheme, ctx.feature_dim, ctx.fused), None, None, None, None


def quantize_error_on_backward(
    output: torch.Tensor, bits: torch.Tensor, scheme: ErrorQuantization = PAPER_ERRORS, feature_dim: int = -1,
    fused: bool = True,
) -> torch.Tensor:
    """Mark ``output`` so that the error arriving at it is quantized once at ``bits`` (see `quantize_error`).

    Placed on a layer's output, the quantized error then drives both the input and weight gradient;
    ``feature_dim`` is the output's feature dimension (rows are taken across it with ``granularity="token"``).
    """
    return _QuantizeErrorOnBackward.apply(output, bits, scheme, feature_dim, fused)
