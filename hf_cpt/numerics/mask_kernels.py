"""An error zeroed where a mask is set (docs/method.md §2, "ReLU masks").

`masked` makes each element of an error ``+0.0`` where its mask is True and keeps its bits elsewhere (NaN,
infinities and signed zeros included), bit for bit what a ReLU's backward gives with the mask ``output <= 0``. On
CPU the native kernel (``mask_kernels.c``, built once per machine by `hf_cpt.numerics.native`) does it in one pass,
ANDing the element's bits with the mask byte minus one widened to its width; ``masked_fill`` gives the same bits in
several times as long, and torch's ``bitwise_and`` would first copy the mask to the error's width.

The mask may be kept with one bit per element instead of a byte (`pack_nonpositive`, read by `masked_bits`; a
dropout's bool mask packed by `pack_flags`, read by `dropout_backward_bits`): an eighth of a bool mask's memory, made
and read in one pass each by the same kernels' library; the torch formulas unpack it where the kernel does not serve.

This module knows nothing about layers.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import code_kernels, native

# Below this many elements torch's formula is as fast (the call itself costs a few microseconds), as for codes.
NATIVE_MIN_NUMEL = code_kernels.NATIVE_MIN_NUMEL


@functools.cache
def _library():
    return native.bind("mask_kernels", {
        "hf_cpt_masked": ([ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int], ctypes.c_int),
        "hf_cpt_pack_nonpositive": ([ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_int], ctypes.c_int),
        "hf_cpt_masked_bits": ([ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int], ctypes.c_int),
        "hf_cpt_pack_flags": ([ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_int], ctypes.c_int),
        "hf_cpt_dropout_bits_backward": ([ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_float, ctypes.c_int],
                                         ctypes.c_int)})


def masked(error: torch.Tensor, zeroed: torch.Tensor) -> torch.Tensor:
    """``error`` where the bool tensor ``zeroed`` (of ``error``'s shape) is False, ``+0.0`` where it is True, bit for
    bit, in a new tensor."""
    if (error.element_size() in (2, 4, 8) and native.takes(error, NATIVE_MIN_NUMEL) and zeroed.is_contiguous()
            and zeroed.dtype == torch.bool and zeroed.shape == error.shape and _library() is not None):
        out = torch.empty_like(error, memory_format=torch.contiguous_format)
        if _library().hf_cpt_masked(error.data_ptr(), zeroed.data_ptr(), out.data_ptr(), error.numel(),
                                    error.element_size(), native.threads()) >= 0:
            return out
    return error.masked_fill(zeroed, 0)


def _packed(t: torch.Tensor, dtype: torch.dtype, kernel: str) -> torch.Tensor | None:
    """The bits the native ``kernel`` packs from ``t`` (of ``dtype``, contiguous, on the CPU), or None where it does
    not serve."""
    if t.dtype != dtype or not native.takes(t, NATIVE_MIN_NUMEL) or _library() is None:
        return None
    bits = torch.empty((t.numel() + 7) // 8, dtype=torch.uint8)
    if getattr(_library(), kernel)(t.data_ptr(), bits.data_ptr(), t.numel(), native.threads()) < 0:
        return None
    return bits


def pack_nonpositive(output: torch.Tensor) -> torch.Tensor | None:
    """The bits of ``output <= 0``, one per element in memory order (bit ``k``, least significant first, of byte
    ``j`` for element ``8j + k``), as a uint8 tensor of ``(numel + 7) // 8`` bytes, for a contiguous float32 CPU
    ``output``; None where the native kernel does not serve it (the caller keeps a bool mask)."""
    return _packed(output, torch.float32, "hf_cpt_pack_nonpositive")


def pack_flags(mask: torch.Tensor) -> torch.Tensor | None:
    """A contiguous bool CPU ``mask`` packed as `pack_nonpositive` packs, one bit per element; None where the native
    kernel does not serve it (the caller keeps the bool mask)."""
    return _packed(mask, torch.bool, "hf_cpt_pack_flags")


def _check_holds(bits: torch.Tensor, numel: int) -> None:
    """Raise unless ``bits`` is a packed mask of ``numel`` elements (one bit each, whole bytes)."""
    if bits.numel() != (numel + 7) // 8:
        raise ValueError(f"a packed mask of {bits.numel()} bytes does not hold {numel} elements")


def unpack(bits: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The bool mask of ``shape`` (contiguous) packed into ``bits`` (`pack_nonpositive`, `pack_flags`): torch's
    formula."""
    numel = shape.numel()
    _check_holds(bits, numel)
    places = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return (bits.unsqueeze(-1).bitwise_right_shift(places).bitwise_and_(1)).view(-1)[:numel].view(shape).bool()


def masked_bits(error: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """`masked` with the mask packed by `pack_nonpositive` (for an ``error`` of the packed tensor's shape, read in
    that tensor's memory order), bit for bit, in a new tensor."""
    _check_holds(bits, error.numel())
    if error.element_size() in (2, 4, 8) and native.takes(error, NATIVE_MIN_NUMEL) and _library() is not None:
        out = torch.empty_like(error, memory_format=torch.contiguous_format)
        if _library().hf_cpt_masked_bits(error.data_ptr(), bits.data_ptr(), out.data_ptr(), error.numel(),
                                         error.element_size(), native.threads()) >= 0:
            return out
    return error.masked_fill(unpack(bits, error.shape), 0)


def dropout_backward_bits(grad: torch.Tensor, bits: torch.Tensor, scale: float) -> torch.Tensor:
    """``torch.ops.aten.native_dropout_backward(grad, mask, scale)`` for the bool mask `pack_flags` packed into
    ``bits``, bit for bit, in a new tensor: natively for a contiguous float32 CPU ``grad``, else by unpacking."""
    _check_holds(bits, grad.numel())
    if grad.dtype == torch.float32 and native.takes(grad, NATIVE_MIN_NUMEL) and _library() is not None:
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        if _library().hf_cpt_dropout_bits_backward(grad.data_ptr(), bits.data_ptr(), out.data_ptr(), grad.numel(),
                                                   scale, native.threads()) >= 0:
            return out
    return torch.ops.aten.native_dropout_backward(grad, unpack(bits, grad.shape), scale)
