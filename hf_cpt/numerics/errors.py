"""Quantization of errors, the output gradients of the backward pass (docs/method.md §2).

Errors use stochastic rounding (uniform noise in [-1/2, 1/2) added before the clamp), which is
unbiased inside the range, over one range per error tensor as in the CPT paper, or one range per
row (token) with ``granularity="token"``; on the min/max grid (the paper) or a zero-centred one
(``range="symmetric"``); optionally in a rotated basis, and with nearest rounding.
`ErrorQuantization` says which, and for which backward products. Large tensors go through one
compiled kernel with counter-based (hashed) noise.

This module knows nothing about layers, schedules or the Trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..utils import check_choice, setting
from .error_rotation import ERROR_ROTATIONS, rotate_error
from .fake_quant import (
    MIN_SCALE,
    _compute_dtype,
    fake_quantize,
    num_levels,
    quantization_scale,
    tensor_range,
    token_range,
)

logger = logging.getLogger(__name__)

# Below this many elements the eager error quantizer is as fast as the compiled one.
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
    """How errors (output gradients) are quantized: ranges, rounding, rotation, which products use them."""

    granularity: str = setting(
        "tensor",
        "Ranges of the quantized errors (output gradients): 'tensor' (one per error tensor, the CPT paper), "
        "'token' (one per row: each token's own range over the output features, per pixel for Conv2d; keeps "
        "tokens whose error is small from falling below one quantization step) or 'auto' (CPTConfig's default: "
        "per row in layers with per-token activations, per tensor in the others, e.g. Conv2d and every layer "
        "under quant_scheme='paper'; docs/backward.md)."
    )
    rounding: str = setting(
        "stochastic",
        "Rounding of the quantized errors: 'stochastic' (unbiased, the CPT paper) or 'nearest'."
    )
    fused: bool = setting(
        True,
        "Quantize errors with one compiled kernel and counter-based noise (falls back to eager)."
    )
    products: str = setting(
        "both",
        "Backward products that use the quantized error: 'both' (the CPT paper), 'input' (the input gradient; the "
        "weight gradient from the full-precision error, as SwitchBack does, priced at 32-bit errors) or 'weight'."
    )
    rotation: str = setting(
        "none",
        "Orthogonal rotation of the error before quantizing (and back): 'none', 'features' (across the output "
        "features) or 'tokens' (across tokens, in Hadamard blocks of 64, as HALO does)."
    )
    range: str = setting(
        "minmax",
        "Grid of the quantized errors: 'minmax' (the range's min to max, the CPT paper), 'symmetric' (-max|e| to "
        "max|e| with zero on the grid: values near zero stay near zero, which keeps a sparse error such as the "
        "attention scores' from turning into noise) or 'auto' (CPTConfig's default: symmetric for the attention "
        "products' errors, minmax for the layers'; docs/backward.md)."
    )

    def __post_init__(self) -> None:
        for name, choices in (("granularity", ERROR_GRANULARITY_CHOICES), ("rounding", ERROR_ROUNDINGS),
                              ("products", ERROR_PRODUCTS), ("rotation", ERROR_ROTATIONS),
                              ("range", ERROR_RANGE_CHOICES)):
            check_choice("ErrorQuantization", name, getattr(self, name), choices)

    def for_activations(self, activation_granularity: str) -> ErrorQuantization:
        """These settings for a layer whose activations are quantized with ``activation_granularity``: granularity
        "auto" becomes per row ("token") for per-token activations and per tensor otherwise (docs/backward.md:
        per-row errors bring a fine-tuned transformer near FP32; on a CNN trained from scratch they made no
        consistent difference, so its layers keep the paper's per-tensor errors)."""
        return _resolve_errors(self, activation_granularity)

    def for_attention(self) -> ErrorQuantization:
        """These settings for the attention products (two activations, no weight): the errors of both products,
        unrotated; range "auto" becomes the zero-centred grid (the score gradient is zero almost everywhere in a
        row, and a min/max grid puts those zeros between two levels: docs/backward.md)."""
        return dataclasses.replace(self, products="both", rotation="none",
                                   range="symmetric" if self.range == "auto" else self.range)

    @property
    def quantizes_input_gradient(self) -> bool:
        return self.products in ("both", "input")

    @property
    def quantizes_weight_gradient(self) -> bool:
        return self.products in ("both", "weight")


PAPER_ERRORS = ErrorQuantization()  # the CPT paper: one range per tensor, stochastic rounding


@functools.lru_cache(maxsize=64)
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
    levels = num_levels(bits).to(x.dtype)
    scale = quantization_scale(minimum, maximum, levels)
    codes = (x - minimum).div_(scale).add_(noise).clamp_min_(0.0).clamp_max_(levels).round_()
    return codes.mul_(scale).add_(minimum)


def symmetric_levels(bits: torch.Tensor) -> torch.Tensor:
    """Largest code magnitude on the zero-centred grid, ``2^(b-1) - 1``: codes ``-L..L``, a signed b-bit integer."""
    return torch.exp2(bits - 1) - 1


def _symmetric_round(
    source: torch.Tensor, absmax: torch.Tensor, half: torch.Tensor, noise: torch.Tensor | None
) -> torch.Tensor:
    # The zero-centred grid: step max|e| / L, codes clamped to [-L, L]; zero is a level, so a zero stays zero and a
    # value far below one step rounds to zero or its neighbour, not across an offset grid. (CPTConfig refuses it
    # below 2 bits, where L = 0; the floor of one level keeps a direct call at 1 bit finite.)
    half = half.clamp_min(1.0)
    scale = (absmax / half).clamp_min(MIN_SCALE)
    scaled = source / scale if noise is None else source / scale + noise
    return torch.minimum(torch.maximum(torch.round(scaled), -half), half) * scale


def quantize_error_symmetric(
    grad: torch.Tensor, bits: torch.Tensor, per_row: bool, feature_dim: int = -1, stochastic: bool = True
) -> torch.Tensor:
    """Quantization on the zero-centred grid (`ErrorQuantization.range="symmetric"`), one ``max|e|`` per tensor
    or per row over ``feature_dim``; stochastic rounding draws from the global RNG (the eager path)."""
    source = _compute_dtype(grad)
    magnitude = source.detach().abs()
    absmax = magnitude.amax(dim=feature_dim, keepdim=True) if per_row else magnitude.amax()
    noise = torch.empty_like(source).uniform_(-0.5, 0.5) if stochastic else None
    half = symmetric_levels(bits.to(source.device)).to(source.dtype)
    return _symmetric_round(source, absmax, half, noise).to(grad.dtype)


def quantize_error_eager(grad: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Per-tensor stochastic quantization, noise from the global RNG as in the CPT code."""
    source = _compute_dtype(grad)
    minimum, maximum = tensor_range(source)
    noise = torch.empty_like(source).uniform_(-0.5, 0.5)
    return _stochastic_quantize(source, minimum, maximum, bits, noise).to(grad.dtype)


def hashed_uniform_noise(numel: int, seed: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Uniform noise in [-1/2, 1/2) from a 32-bit integer hash of (element index, seed).

    A counter-based source: no RNG state to advance, so a compiler can fuse it into the kernel
    that consumes it. int32 products wrap; shifts are masked to act as logical shifts.
    """
    # In place on one fresh tensor: the same values as the out-of-place formula, fewer full-size allocations
    # when it runs eagerly.
    h = torch.arange(numel, device=device, dtype=torch.int32).bitwise_xor_(seed)
    h.bitwise_xor_((h >> 16).bitwise_and_(0xFFFF))
    h.mul_(0x7FEB352D)
    h.bitwise_xor_((h >> 15).bitwise_and_(0x1FFFF))
    h.mul_(-0x7B935975)  # 0x846CA68B as a signed int32 (the "lowbias32" hash)
    h.bitwise_xor_((h >> 16).bitwise_and_(0xFFFF))
    return h.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF).to(torch.float32).mul_(1.0 / (1 << 24)).sub_(0.5)


def quantize_error_hashed(grad: torch.Tensor, bits: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """Per-tensor stochastic quantization with hashed noise; meant to run compiled."""
    return _quantize_error_hashed_levels(grad, num_levels(bits), seed)


def _hashed_stochastic_round(
    source: torch.Tensor, minimum: torch.Tensor, maximum: torch.Tensor, levels: torch.Tensor, seed: torch.Tensor
) -> torch.Tensor:
    # The compiled kernels' shared formula: stochastic rounding over [minimum, maximum] with hashed noise.
    noise = hashed_uniform_noise(source.numel(), seed, source.device).view(source.shape)
    levels = levels.to(source.dtype)
    scale = quantization_scale(minimum, maximum, levels)
    codes = torch.round(torch.minimum(((source - minimum) / scale + noise).clamp_min(0.0), levels))
    return codes * scale + minimum


def _quantize_error_hashed_levels(grad: torch.Tensor, levels: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    # Takes 2^b - 1 precomputed: with exp2 in the graph, the generated loop calls exp2 per vector.
    flat = _compute_dtype(grad).reshape(-1)
    minimum, maximum = torch.aminmax(flat)
    return _hashed_stochastic_round(flat, minimum, maximum, levels, seed).view(grad.shape).to(grad.dtype)


def _quantize_error_rows_hashed_levels(grad: torch.Tensor, levels: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    # Per row over the last dimension: the per-row twin of the per-tensor kernel above.
    source = _compute_dtype(grad)
    minimum, maximum = source.amin(dim=-1, keepdim=True), source.amax(dim=-1, keepdim=True)
    return _hashed_stochastic_round(source, minimum, maximum, levels, seed).to(grad.dtype)


def _quantize_error_symmetric_hashed(grad: torch.Tensor, half: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    # The zero-centred twins of the two kernels above: one max|e| per tensor (flat input) or per row.
    flat = _compute_dtype(grad).reshape(-1)
    noise = hashed_uniform_noise(flat.numel(), seed, flat.device)
    return _symmetric_round(flat, flat.abs().amax(), half.to(flat.dtype), noise).view(grad.shape).to(grad.dtype)


def _quantize_error_rows_symmetric_hashed(grad: torch.Tensor, half: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    source = _compute_dtype(grad)
    noise = hashed_uniform_noise(source.numel(), seed, source.device).view(source.shape)
    absmax = source.abs().amax(dim=-1, keepdim=True)
    return _symmetric_round(source, absmax, half.to(source.dtype), noise).to(grad.dtype)


# Each stochastic kernel by (granularity, range): its formula and the level count it takes from the bits.
_KERNEL_SOURCES: dict[tuple[str, str], tuple[Callable, Callable]] = {
    ("tensor", "minmax"): (_quantize_error_hashed_levels, num_levels),
    ("token", "minmax"): (_quantize_error_rows_hashed_levels, num_levels),
    ("tensor", "symmetric"): (_quantize_error_symmetric_hashed, symmetric_levels),
    ("token", "symmetric"): (_quantize_error_rows_symmetric_hashed, symmetric_levels),
}


def _kernel_name(granularity: str, grid: str) -> str:
    return granularity if grid == "minmax" else f"{granularity}/{grid}"


_warmed_error_kernels: set[str] = set()
_fused_disabled_reason: str | None = None


@contextlib.contextmanager
def _quiet_cuda_probe(kernel: str):
    """The first call of a compiled kernel compiles it; on a machine without a GPU, torch's C++ toolchain probe
    then warns that no CUDA runtime exists, which is no concern of a CPU run: silenced for that call only."""
    if kernel in _warmed_error_kernels or torch.cuda.is_available():
        yield
        return
    probe = logging.getLogger("torch.utils.cpp_extension")
    level = probe.level
    probe.setLevel(logging.ERROR)
    try:
        yield
    finally:
        probe.setLevel(level)
        _warmed_error_kernels.add(kernel)


_compiled_error_kernels: dict[str, Callable] = {}


def _fused_error_kernel(granularity: str, grid: str = "minmax") -> Callable | None:
    """The compiled stochastic error quantizer for ``granularity`` and ``grid`` (compiled on first use, in the
    calling thread: compiling in a background thread while the same kernel ran eagerly made the start of a CPU run
    slower, see docs/benchmarks.md), None once compilation has failed."""
    if _fused_disabled_reason is not None:
        return None
    name = _kernel_name(granularity, grid)
    if name not in _compiled_error_kernels:
        _compiled_error_kernels[name] = torch.compile(_KERNEL_SOURCES[granularity, grid][0], dynamic=True)
    return _compiled_error_kernels[name]


def _disable_fused(reason: str) -> None:
    global _fused_disabled_reason
    _fused_disabled_reason = reason
    logger.warning(
        "hf_cpt: the compiled error quantizer is unavailable (%s); using the eager one. "
        "Set CPTConfig(fused_error_quantizer=False) to silence this.",
        reason.splitlines()[0],
    )


def quantize_error_per_row(grad: torch.Tensor, bits: torch.Tensor, feature_dim: int = -1) -> torch.Tensor:
    """Per-row stochastic quantization (each token's own min / max over ``feature_dim``), noise from the
    global RNG: the eager twin of the per-row kernel.

    A row of zeros (padding, a token the loss never reached) stays exactly zero; no range is degenerate
    into a division by zero (the scale is clamped as everywhere).
    """
    source = _compute_dtype(grad)
    minimum, maximum = token_range(source, feature_dim)
    noise = torch.empty_like(source).uniform_(-0.5, 0.5)
    return _stochastic_quantize(source, minimum, maximum, bits.to(source.device), noise).to(grad.dtype)


def quantize_error(
    grad: torch.Tensor, bits: torch.Tensor, scheme: ErrorQuantization = PAPER_ERRORS, feature_dim: int = -1
) -> torch.Tensor:
    """Quantization of an error tensor at ``bits`` with ``scheme`` (docs/method.md §2).

    Ranges per tensor (the CPT paper) or per row over ``feature_dim``, on the min/max or the zero-centred grid;
    stochastic or nearest rounding;
    optionally in a rotated basis (`rotate_error`) and rotated back. Stochastic rounding with
    ``scheme.fused`` runs one compiled kernel (range, hashed noise, rounding) for large tensors and falls
    back to the eager path, with one warning, if compilation is unavailable.
    """
    if scheme.granularity not in ERROR_GRANULARITIES or scheme.range not in ERROR_RANGES:
        raise ValueError(f"error granularity and range must be one of {ERROR_GRANULARITIES} and {ERROR_RANGES} when "
                         f"quantizing, got {scheme.granularity!r} and {scheme.range!r} (resolve 'auto' with "
                         "ErrorQuantization.for_activations or for_attention)")
    if grad.numel() == 0:
        return grad
    if scheme.rotation == "none":
        return _quantize_error_unrotated(grad, bits, scheme, feature_dim)
    rotated, rotated_dim, back = rotate_error(grad, scheme.rotation, feature_dim)
    return back(_quantize_error_unrotated(rotated, bits, scheme, rotated_dim))


def _quantize_error_unrotated(
    grad: torch.Tensor, bits: torch.Tensor, scheme: ErrorQuantization, feature_dim: int
) -> torch.Tensor:
    per_row, symmetric = scheme.granularity == "token", scheme.range == "symmetric"
    if scheme.rounding == "nearest":
        if symmetric:
            return quantize_error_symmetric(grad, bits, per_row, feature_dim, stochastic=False)
        source = _compute_dtype(grad)
        minimum, maximum = token_range(source, feature_dim) if per_row else tensor_range(source)
        return fake_quantize(source, minimum, maximum, bits.to(source.device)).to(grad.dtype)
    # Inside a compiled graph the compiler fuses the plain formula; outside, the compiled kernel runs it.
    # (Not torch.compiler.is_compiling(): a process-wide flag, also set while another thread compiles.)
    in_graph = torch.compiler.is_dynamo_compiling() or torch.compiler.is_exporting()
    kernel, levels_of = None, _KERNEL_SOURCES[scheme.granularity, scheme.range][1]
    if in_graph:
        kernel = _KERNEL_SOURCES[scheme.granularity, scheme.range][0]
    elif scheme.fused and grad.numel() >= FUSED_MIN_NUMEL:
        kernel = _fused_error_kernel(scheme.granularity, scheme.range)
    if kernel is not None:
        seed = torch.randint(0, 2**31 - 1, (), device=grad.device, dtype=torch.int32)
        levels = levels_of(bits.to(grad.device))
        try:
            with (contextlib.nullcontext() if in_graph
                  else _quiet_cuda_probe(_kernel_name(scheme.granularity, scheme.range))):
                if per_row:  # as (rows, features): one compiled graph serves every rank and layout
                    rows = grad.movedim(feature_dim, -1)
                    flat = kernel(rows.reshape(-1, rows.shape[-1]), levels, seed)
                    return flat.view(rows.shape).movedim(-1, feature_dim)
                # Flat input: one compiled graph serves tensors of every rank.
                return kernel(grad.contiguous().view(-1), levels, seed).view(grad.shape)
        except Exception as error:  # compiler missing or failing: keep training, eagerly
            if in_graph:
                raise
            _disable_fused(f"{type(error).__name__}: {error}")
    if symmetric:
        return quantize_error_symmetric(grad, bits, per_row, feature_dim)
    if per_row:
        return quantize_error_per_row(grad, bits, feature_dim)
    return quantize_error_eager(grad, bits)


class _QuantizeErrorOnBackward(torch.autograd.Function):
    """Identity in forward; quantizes the gradient flowing back through it."""

    @staticmethod
    def forward(ctx, x, bits, scheme, feature_dim):
        ctx.bits = bits.detach().clone()
        ctx.scheme, ctx.feature_dim = scheme, feature_dim
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_output):
        return quantize_error(grad_output, ctx.bits, ctx.scheme, ctx.feature_dim), None, None, None


def quantize_error_on_backward(
    output: torch.Tensor, bits: torch.Tensor, scheme: ErrorQuantization = PAPER_ERRORS, feature_dim: int = -1
) -> torch.Tensor:
    """Mark ``output`` so that the error arriving at it is quantized once at ``bits`` (see `quantize_error`).

    Placed on a layer's output, the quantized error then drives both the input and weight gradient;
    ``feature_dim`` is the output's feature dimension (rows are taken across it with ``granularity="token"``).
    """
    return _QuantizeErrorOnBackward.apply(output, bits, scheme, feature_dim)
