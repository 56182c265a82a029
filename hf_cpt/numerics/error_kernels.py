"""The fused error quantizers: stochastic rounding of an error tensor in one kernel (docs/method.md §2).

One formula per (ranges, grid), with counter-based noise from a hash of (element index, seed): the plain formula
inside a compiled model, a ``torch.compile`` kernel on an accelerator, a native C kernel on CPU (``error_kernels.c``,
which spares a CPU run the compiler stack's stall and memory); the same values bit for bit on every path.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from collections.abc import Callable

import torch

from . import native
from .fake_quant import MIN_SCALE, _compute_dtype, num_levels, quantization_scale, tensor_range, token_range

logger = logging.getLogger(__name__)


def symmetric_levels(bits: torch.Tensor) -> torch.Tensor:
    """Largest code magnitude on the zero-centred grid, ``2^(b-1) - 1``: codes ``-L..L``, a signed b-bit integer."""
    return torch.exp2(bits - 1) - 1


def grid(
    source: torch.Tensor, levels: torch.Tensor, per_row: bool, zero_centred: bool, dim: int = -1
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(offset, scale, top code) of the grid of each row over ``dim`` (or of the whole tensor).

    min/max grid: offset ``m``, scale ``(M - m) / L``, codes ``0..L``; zero-centred grid: no offset, scale
    ``max|e| / L``, codes ``-L..L`` (CPTConfig refuses it below 2 bits, where L = 0; the floor of one level keeps a
    direct call at 1 bit finite). Scales are clamped, so a row of zeros has no degenerate range.
    """
    top = top_code(levels.to(source.dtype), zero_centred)
    if zero_centred:
        magnitude = source.detach().abs()
        absmax = magnitude.amax(dim=dim, keepdim=True) if per_row else magnitude.amax()
        return None, (absmax / top).clamp_min(MIN_SCALE), top
    minimum, maximum = token_range(source, dim) if per_row else tensor_range(source)
    return minimum, quantization_scale(minimum, maximum, top), top


def top_code(levels: torch.Tensor, zero_centred: bool) -> torch.Tensor:
    """The grid's top code: ``levels``, floored at one level on the zero-centred grid (see `grid`)."""
    return levels.clamp_min(1.0) if zero_centred else levels


def symmetric_round(
    source: torch.Tensor, scale: torch.Tensor, top: torch.Tensor, noise: torch.Tensor | None
) -> torch.Tensor:
    """``clamp(round(x / s + u), -L, L) * s``: zero is a level, so a zero stays zero and a value far below one
    step rounds to zero or its neighbour, not across an offset grid."""
    scaled = source / scale if noise is None else source / scale + noise
    return torch.minimum(torch.maximum(torch.round(scaled), -top), top) * scale


def noise_seed(device: torch.device) -> torch.Tensor:
    """A seed of the hashed noise, drawn from the global RNG on ``device`` (no host copy on an accelerator)."""
    return torch.randint(0, 2**31 - 1, (), device=device, dtype=torch.int32)


def hashed_uniform_noise(numel: int, seed: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Uniform noise in [-1/2, 1/2) from a 32-bit integer hash of (element index, seed) (the "lowbias32" hash).

    A counter-based source: no RNG state to advance, so a compiler can fuse it into the kernel that consumes
    it, and the C kernel computes the same values. int32 products wrap; shifts are masked to act as logical shifts.
    """
    # In place on one fresh tensor: the same values as the out-of-place formula, fewer full-size allocations
    # when it runs eagerly.
    h = torch.arange(numel, device=device, dtype=torch.int32).bitwise_xor_(seed)
    h.bitwise_xor_((h >> 16).bitwise_and_(0xFFFF))
    h.mul_(0x7FEB352D)
    h.bitwise_xor_((h >> 15).bitwise_and_(0x1FFFF))
    h.mul_(-0x7B935975)  # 0x846CA68B as a signed int32
    h.bitwise_xor_((h >> 16).bitwise_and_(0xFFFF))
    return h.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF).to(torch.float32).mul_(1.0 / (1 << 24)).sub_(0.5)


def hashed_stochastic_quantize(
    grad: torch.Tensor, levels: torch.Tensor, seed: torch.Tensor, per_row: bool, zero_centred: bool
) -> torch.Tensor:
    """The fused kernels' formula: per row over the last dimension, or per tensor (``grad`` flat), on the min/max
    or the zero-centred grid, with hashed noise; ``levels`` is the top code (2^b - 1, or 2^(b-1) - 1 centred),
    computed before the kernel: with ``exp2`` inside a compiled graph the generated loop calls it per vector."""
    source = _compute_dtype(grad)
    offset, scale, top = grid(source, levels, per_row, zero_centred)
    noise = hashed_uniform_noise(source.numel(), seed, source.device).view(source.shape)
    if zero_centred:
        return symmetric_round(source, scale, top, noise).to(grad.dtype)
    codes = torch.round(torch.minimum(((source - offset) / scale + noise).clamp_min(0.0), top))
    return (codes * scale + offset).to(grad.dtype)


def quantize_error_hashed(grad: torch.Tensor, bits: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """Per-tensor stochastic quantization on the min/max grid with hashed noise (the formula, run eagerly)."""
    return hashed_stochastic_quantize(grad.reshape(-1), num_levels(bits), seed, False, False).view(grad.shape)


# Per (granularity, grid): its formula, and the top code it takes from the bits.
KERNEL_SOURCES: dict[tuple[str, str], tuple[Callable, Callable]] = {
    (granularity, grid_name): (
        functools.partial(hashed_stochastic_quantize, per_row=granularity == "token",
                          zero_centred=grid_name == "symmetric"),
        symmetric_levels if grid_name == "symmetric" else num_levels,
    )
    for granularity in ("tensor", "token") for grid_name in ("minmax", "symmetric")
}


def kernel_name(granularity: str, grid_name: str) -> str:
    return granularity if grid_name == "minmax" else f"{granularity}/{grid_name}"


def _native_kernel(granularity: str, grid_name: str) -> Callable | None:
    """The C kernel (`error_kernels.c`) behind the formula's signature, or None where it cannot be built: the noise,
    clamp and rounding in one pass, and each row's grid in the same pass (one range per tensor: computed here)."""
    library = native.load("error_kernels")
    if library is None:
        return None
    entry = library.hf_cpt_quantize_errors
    entry.restype = ctypes.c_int
    entry.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int32, ctypes.c_int,
                                                                       ctypes.c_int]
    per_row, zero_centred = granularity == "token", grid_name == "symmetric"

    def run(grad: torch.Tensor, levels: torch.Tensor, seed: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
        """With ``overwrite`` (``grad`` is the caller's to overwrite), and wherever ``grad`` is first converted to a
        float32 contiguous copy (which nothing else holds), the result is written over the values it is made from: each
        element is read before it is written, and a row's grid before its row (a tensor's, before the pass)."""
        source = _compute_dtype(grad).contiguous()
        if overwrite or source.data_ptr() != grad.data_ptr():
            out = source
        else:
            out = torch.empty_like(source)
        columns = source.shape[-1] if per_row else source.numel()
        if per_row:  # each row's grid computed in the kernel, in the same pass that quantizes it
            offset = scale = None
            top = top_code(levels.to(source.dtype), zero_centred)
        else:
            offset, scale, top = grid(source, levels, per_row, zero_centred)
            offset = scale if offset is None else offset
        entry(source.data_ptr(), out.data_ptr(), None if offset is None else offset.data_ptr(),
              None if scale is None else scale.data_ptr(), source.numel() // columns, columns, float(top),
              int(seed), int(zero_centred), native.threads())
        return out.to(grad.dtype)

    return run


_native_kernels: dict[str, Callable | None] = {}
_compiled_kernels: dict[str, Callable] = {}
_warmed_compiled_kernels: set[str] = set()
_fused_disabled_reason: str | None = None
_prefer_compiled = False


@contextlib.contextmanager
def compiled_kernels_on_cpu():
    """Inside this block CPU tensors take the ``torch.compile`` kernel instead of the C one (same values: for
    side-by-side timing, bench/overhead.py ``--compare-kernels``)."""
    global _prefer_compiled
    previous, _prefer_compiled = _prefer_compiled, True
    try:
        yield
    finally:
        _prefer_compiled = previous


@contextlib.contextmanager
def _quiet_cuda_probe(kernel: str):
    """The first call of a compiled kernel compiles it; on a machine without a GPU, torch's C++ toolchain probe
    then warns that no CUDA runtime exists, which is no concern of a CPU run: silenced for that call only."""
    if kernel in _warmed_compiled_kernels or torch.cuda.is_available():
        yield
        return
    probe = logging.getLogger("torch.utils.cpp_extension")
    level = probe.level
    probe.setLevel(logging.ERROR)
    try:
        yield
    finally:
        probe.setLevel(level)
        _warmed_compiled_kernels.add(kernel)


def _compiled_kernel(granularity: str, grid_name: str) -> Callable:
    """The ``torch.compile`` kernel (compiled on first use, in the calling thread: compiling in a background
    thread while the same kernel ran eagerly made the start of a CPU run slower)."""
    name = kernel_name(granularity, grid_name)
    if name not in _compiled_kernels:
        compiled = torch.compile(KERNEL_SOURCES[granularity, grid_name][0], dynamic=True)

        def run(grad: torch.Tensor, levels: torch.Tensor, seed: torch.Tensor, overwrite=None) -> torch.Tensor:
            """(``overwrite`` is the C kernel's: a compiled kernel makes its own result.)"""
            with _quiet_cuda_probe(name):
                return compiled(grad, levels, seed)

        _compiled_kernels[name] = run
    return _compiled_kernels[name]


def fused_kernel(device: torch.device, granularity: str, grid_name: str = "minmax") -> Callable | None:
    """The fused stochastic quantizer for tensors on ``device``: ``kernel(grad, levels, seed)`` with ``grad`` as
    (rows, features) for per-row ranges, flat for one range. On CPU the native kernel where it builds, else the
    compiled one; None once a fused kernel has failed (`disable_fused`), leaving the caller's eager path."""
    if _fused_disabled_reason is not None:
        return None
    if device.type == "cpu" and not _prefer_compiled:
        name = kernel_name(granularity, grid_name)
        if name not in _native_kernels:
            _native_kernels[name] = _native_kernel(granularity, grid_name)
        if _native_kernels[name] is not None:
            return _native_kernels[name]
    return _compiled_kernel(granularity, grid_name)


def disable_fused(reason: str) -> None:
    """Stop using the fused kernels (one failed: a compiler missing or failing), with one warning."""
    global _fused_disabled_reason
    _fused_disabled_reason = reason
    logger.warning(
        "hf_cpt: the fused error quantizer is unavailable (%s); using the eager one. "
        "Set CPTConfig(fused_error_quantizer=False) to silence this.",
        reason.splitlines()[0],
    )
