"""Fake quantization of weights and activations (docs/method.md §2): asymmetric min/max uniform quantization (a
weight's range optionally clipped, `weight_ranges`).

``Q(x) = s * round(clamp((x - m) / s, 0, 2^b - 1)) + m`` with ``s = max((M - m) / (2^b - 1), 1e-8)``, round half to
even, bit-exact with that formula; the forward quantizers pass gradients straight through. On CPU the codes come
from one native pass where it serves (`hf_cpt.numerics.code_kernels`), the same values bit for bit. Bits are 0-d
tensors so that a changing bit-width never makes ``torch.compile`` re-trace. Errors: `hf_cpt.numerics.errors`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .code_kernels import quantize_codes_native, ranges_native, restore_codes_native
from .derived import derived

MIN_SCALE = 1e-8
# How a weight's per-channel range is chosen (`weight_ranges`; CPTConfig.weight_range): the CPT paper's min/max, or
# clipped to the ratio of CLIP_RATIOS (1 down to 0.55) with the least squared error at the current bits.
WEIGHT_RANGES = ("minmax", "mse")
CLIP_RATIOS = tuple(round(1.0 - 0.05 * k, 2) for k in range(10))


def num_levels(bits: torch.Tensor) -> torch.Tensor:
    """Largest integer code, ``2^b - 1``, exact for integer ``b`` up to 24."""
    return torch.exp2(bits) - 1


def levels_on(
    bits: torch.Tensor, device: torch.device, dtype: torch.dtype,
    levels: Callable[[torch.Tensor], torch.Tensor] = num_levels,
) -> torch.Tensor:
    """``levels(bits)`` (default `num_levels`) on ``device`` in ``dtype``, computed once per value of ``bits``
    (`hf_cpt.numerics.derived`): a caller's bits may live on the CPU, and the same bits serve every layer."""
    return derived(bits, ("levels", levels, device, dtype), lambda: levels(bits).to(device, dtype))


def quantization_scale(minimum: torch.Tensor, maximum: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    return ((maximum - minimum) / levels).clamp_min(MIN_SCALE)


def _compute_dtype(x: torch.Tensor) -> torch.Tensor:
    # Half-precision inputs are quantized in float32: bf16 cannot even hold 8-bit codes exactly.
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _grid(
    x: torch.Tensor, minimum: torch.Tensor, maximum: torch.Tensor, bits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(source in the compute dtype, minimum, scale, top code) of quantizing ``x`` over ``[minimum, maximum]``."""
    source = _compute_dtype(x)
    levels = levels_on(bits, source.device, source.dtype)
    minimum, maximum = minimum.to(source.dtype), maximum.to(source.dtype)
    return source, minimum, quantization_scale(minimum, maximum, levels), levels


def quantization_codes(
    x: torch.Tensor, minimum: torch.Tensor, maximum: torch.Tensor, bits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scale, minimum) of ``x`` over ``[minimum, maximum]``: codes are integral floats in the compute
    dtype (float32 for half inputs), and ``codes * scale + minimum`` is the fake-quantized value."""
    source, minimum, scale, levels = _grid(x, minimum, maximum, bits)
    return _codes(source, minimum, scale, levels), scale, minimum


def _codes(source: torch.Tensor, minimum: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    # clamp_min_ + clamp_max_: the same values as clamp_(min, max), but clamp with two tensor bounds
    # takes a slow unvectorized path on CPU (about 10x slower).
    return (source - minimum).div_(scale).clamp_min_(0.0).clamp_max_(levels).round_()


def fake_quantize(
    x: torch.Tensor, minimum: torch.Tensor, maximum: torch.Tensor, bits: torch.Tensor
) -> torch.Tensor:
    """Deterministic quantize-dequantize of ``x`` over ``[minimum, maximum]`` (broadcastable)."""
    codes, scale, minimum = quantization_codes(x, minimum, maximum, bits)
    return codes.mul_(scale).add_(minimum).to(x.dtype)


def fake_quantize_compact(
    x: torch.Tensor, minimum: torch.Tensor, maximum: torch.Tensor, bits: torch.Tensor, native: bool = True
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`fake_quantize`, and the same values kept compact: (uint8 codes, scale, minimum), for at most 8 bits.

    ``restore_compact(*compact, x.dtype)`` gives back the fake-quantized tensor bit for bit (the same
    ``codes * scale + minimum`` in the same dtype): what a layer's backward saves instead of a float copy.
    On CPU the codes and values come from one native pass where it serves the call (`code_kernels`).
    """
    source, minimum, scale, levels = _grid(x, minimum, maximum, bits)
    fast = quantize_codes_native(source, minimum, scale, levels, values=True) if native else None
    if fast is not None:
        codes, values = fast
        return values.to(x.dtype), (codes, scale, minimum)
    codes = _codes(source, minimum, scale, levels)
    compact = (codes.to(torch.uint8), scale, minimum)
    return codes.mul_(scale).add_(minimum).to(x.dtype), compact


def quantize_compact(
    x: torch.Tensor, minimum: torch.Tensor, maximum: torch.Tensor, bits: torch.Tensor, native: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fake_quantize_compact`'s (uint8 codes, scale, minimum) alone, for at most 8 bits: for a product computed on
    the codes, which never needs the fake-quantized floats."""
    source, minimum, scale, levels = _grid(x, minimum, maximum, bits)
    fast = quantize_codes_native(source, minimum, scale, levels, values=False) if native else None
    if fast is not None:
        return fast[0], scale, minimum
    return _codes(source, minimum, scale, levels).to(torch.uint8), scale, minimum


def restore_compact(
    codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype, native: bool = True
) -> torch.Tensor:
    """The fake-quantized tensor from `fake_quantize_compact`'s codes, scale and minimum (``native``: by the C
    kernel where it serves, bit for bit the same)."""
    fast = restore_codes_native(codes, scale, minimum) if native else None
    if fast is not None:
        return fast.to(dtype)
    return codes.to(scale.dtype).mul_(scale).add_(minimum).to(dtype)


def channel_ranges(weight: torch.Tensor, channel_dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel min and max of a weight, shaped to broadcast against it."""
    weight = weight.detach()
    channel_dim %= max(weight.dim(), 1)
    dims = tuple(d for d in range(weight.dim()) if d != channel_dim)
    if not dims:  # a 1-D tensor: every element is its own channel (and dim=() would reduce all)
        return weight, weight
    if channel_dim in (0, weight.dim() - 1):  # one pass on CPU where the native kernel serves it
        last = channel_dim == weight.dim() - 1
        native = ranges_native(weight, weight.dim() - 1 if last else 1, per_column=last)
        if native is not None:
            shape = [1] * weight.dim()
            shape[channel_dim] = weight.shape[channel_dim]
            return native[0].view(shape), native[1].view(shape)
    # amin + amax rather than aminmax(dim=...), which is an order of magnitude slower on CPU.
    return weight.amin(dim=dims, keepdim=True), weight.amax(dim=dims, keepdim=True)


def weight_ranges(
    weight: torch.Tensor, bits: torch.Tensor, channel_dim: int = 0, method: str = "minmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each output channel's range at ``bits`` by ``method``: "minmax", the paper's (`channel_ranges`); "mse", the
    clipped ``[a * min, a * max]`` for the ratio ``a`` of `CLIP_RATIOS` of least squared error (the first on a tie:
    a channel the full range serves best keeps it). In float32, as `quantize_codes`, so that training and exports
    choose the same range; no host synchronization."""
    minimum, maximum = channel_ranges(weight, channel_dim)
    if method == "minmax" or weight.dim() < 2:  # a 1-D tensor's channels are single values: nothing to clip
        return minimum, maximum
    source, minimum, maximum = weight.detach().float(), minimum.float(), maximum.float()
    dims = tuple(d for d in range(weight.dim()) if d != channel_dim % weight.dim())
    best = [torch.full_like(minimum, float("inf")), minimum, maximum]  # (squared error, range) of each channel
    for ratio in CLIP_RATIOS:
        low, high = minimum * ratio, maximum * ratio
        error = fake_quantize(source, low, high, bits).sub_(source).square_().sum(dim=dims, keepdim=True)
        better = error < best[0]
        best = [torch.where(better, candidate, kept) for candidate, kept in zip((error, low, high), best)]
    return best[1], best[2]


def tensor_range(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor min and max."""
    minimum, maximum = torch.aminmax(x.detach())
    return minimum, maximum


def token_range(x: torch.Tensor, feature_dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (per-row) min and max over the feature dimension, shaped to broadcast against ``x``."""
    x = x.detach()
    if x.dim() and feature_dim % x.dim() == x.dim() - 1:  # one pass on CPU where the native kernel serves it
        native = ranges_native(x, x.dim() - 1, per_column=False)
        if native is not None:
            shape = (*x.shape[:-1], 1)
            return native[0].view(shape), native[1].view(shape)
    return x.amin(dim=feature_dim, keepdim=True), x.amax(dim=feature_dim, keepdim=True)


class _FakeQuantizeSTE(torch.autograd.Function):
    """Forward: deterministic fake quantization. Backward: the gradient passes unchanged."""

    @staticmethod
    def forward(ctx, x, minimum, maximum, bits):
        return fake_quantize(x, minimum, maximum, bits)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None, None, None


def quantize_ste(x: torch.Tensor, minimum: torch.Tensor, maximum: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Fake quantization with a straight-through gradient."""
    return _FakeQuantizeSTE.apply(x, minimum, maximum, bits)


def quantize_weight(
    weight: torch.Tensor, bits: torch.Tensor, channel_dim: int = 0, method: str = "minmax"
) -> torch.Tensor:
    """Per-output-channel weight quantization (straight-through gradient) over `weight_ranges` by ``method``."""
    return quantize_ste(weight, *weight_ranges(weight, bits, channel_dim, method), bits)


def quantize_codes(
    weight: torch.Tensor, bits: int | torch.Tensor, channel_dim: int = 0, method: str = "minmax"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Integer codes of a weight at ``bits``, per output channel, with its scale and zero point.

    The arithmetic of `fake_quantize` over `weight_ranges` (by ``method``), so that
    ``dequantize_codes(*quantize_codes(w, b, d), w.shape, d)`` equals the fake-quantized weight bit for bit.
    Returns codes (uint8, ``[C, K]`` with ``C = w.shape[channel_dim]``), scale and zero point (float32, ``[C]``).
    """
    source = weight.detach().float()
    bits = bits if isinstance(bits, torch.Tensor) else torch.tensor(float(bits))
    codes, scale, minimum = quantization_codes(source, *weight_ranges(source, bits, channel_dim, method), bits)
    channels = weight.shape[channel_dim]
    codes = codes.movedim(channel_dim, 0).reshape(channels, -1).to(torch.uint8)
    return codes, scale.reshape(channels), minimum.reshape(channels)


def dequantize_codes(
    codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, shape: torch.Size, channel_dim: int = 0
) -> torch.Tensor:
    """``codes * scale + zero_point`` in float32, laid out back into ``shape``."""
    values = codes.to(torch.float32).mul_(scale.float().unsqueeze(1)).add_(zero_point.float().unsqueeze(1))
    moved = [shape[channel_dim]] + [s for d, s in enumerate(shape) if d != channel_dim]
    return values.reshape(moved).movedim(0, channel_dim).contiguous()
