"""An error passed through a one-byte mask (docs/method.md §2, "ReLU masks").

`masked` keeps each element of an error where its mask byte is ``-1`` (all bits set) and makes it ``+0.0`` where it
is ``0``: the bitwise AND of the element's bits with the byte widened to its width, bit for bit what a ReLU's
backward gives. On CPU the native kernel (``mask_kernels.c``, built once per machine by `hf_cpt.numerics.native`)
does it in one pass; torch's ``bitwise_and`` gives the same bits but first copies the mask to the error's width, a
full-size temporary in every call.

This module knows nothing about layers.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import code_kernels, native

# Bit patterns of each element width: the mask byte widens to them (int8 -1 to all bits set).
SAME_WIDTH_INTEGER = {2: torch.int16, 4: torch.int32, 8: torch.int64}

# Below this many elements torch's formula is as fast (the call itself costs a few microseconds), as for codes.
NATIVE_MIN_NUMEL = code_kernels.NATIVE_MIN_NUMEL


@functools.cache
def _library():
    return native.bind("mask_kernels", {
        "hf_cpt_masked": ([ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int], ctypes.c_int)})


def mask_zeroing(zeroed: torch.Tensor) -> torch.Tensor:
    """The int8 mask that zeroes an error where the bool tensor ``zeroed`` is True: ``0`` there, ``-1`` elsewhere,
    made in ``zeroed``'s memory."""
    return zeroed.view(torch.int8).sub_(1)


def masked(error: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``error`` where ``mask`` (int8, ``0`` or ``-1``, of ``error``'s shape) is ``-1``, ``+0.0`` elsewhere, bit for
    bit, in a new tensor."""
    bits = SAME_WIDTH_INTEGER[error.element_size()]
    if (native.takes(error, NATIVE_MIN_NUMEL) and mask.is_contiguous() and mask.shape == error.shape
            and _library() is not None):
        out = torch.empty_like(error, memory_format=torch.contiguous_format)
        failed = _library().hf_cpt_masked(error.data_ptr(), mask.data_ptr(), out.data_ptr(), error.numel(),
                                          error.element_size(), native.threads()) < 0
        if not failed:
            return out
    return torch.bitwise_and(error.view(bits), mask).view(error.dtype)
