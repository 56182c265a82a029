"""An error zeroed where a bool mask is set (docs/method.md §2, "ReLU masks").

`masked` makes each element of an error ``+0.0`` where its mask is True and keeps its bits elsewhere (NaN,
infinities and signed zeros included), bit for bit what a ReLU's backward gives with the mask ``output <= 0``. On
CPU the native kernel (``mask_kernels.c``, built once per machine by `hf_cpt.numerics.native`) does it in one pass,
ANDing the element's bits with the mask byte minus one widened to its width; ``masked_fill`` gives the same bits in
several times as long, and torch's ``bitwise_and`` would first copy the mask to the error's width.

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
        "hf_cpt_masked": ([ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int], ctypes.c_int)})


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
