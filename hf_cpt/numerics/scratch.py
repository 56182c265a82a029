"""Reused CPU buffers for the short-lived operands of a quantized layer's products (docs/method.md §2, "Reused
buffers").

A layer's backward rebuilds its input and weight from their codes and quantizes its error, a forward that
multiplies floats forms its fake-quantized operands, and a rotated layer's training forward rotates its weight (and,
for a product on codes, its input) before quantizing it: tensors that one product or one quantization reads and
drops. Allocated anew in
every layer, each is a fresh block that the kernel writing it faults in page by page, and that glibc, once freed,
leaves as a hole in the heap between the gradients kept around it. One buffer per role, reused by every layer, is
resident already and leaves no hole. The forward's and the backward's operands share their role's buffer: a thread
runs one product at a time.

A buffer serves one use at a time: whoever takes one reads it before the next ``take`` of the same role and never
returns it or keeps it. Per thread (autograd runs one backward per device thread); CPU only (an accelerator's
caching allocator hands out reserved memory without faults). The buffers stay until `release` (the Trainer
integration calls it when training ends): freeing them after every backward pass and mapping them anew made a
CIFAR ResNet-20 step 6-10% slower (two runs); `hand_back_later` hands some of one role's pages back instead,
keeping its mapping (the layers do so for the error, which only the backward takes). They hold the largest input,
weight, rotated weight and error of the quantized layers (what each bench model's hold: docs/benchmarks.md,
peak-phases table). This module knows nothing about quantization.
"""

from __future__ import annotations

import math
import mmap
import threading
from collections.abc import Callable

import torch

_local = threading.local()


def take(role: str, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor of ``shape`` and ``dtype``: the calling thread's buffer for ``role``,
    grown (never shrunk) to fit."""
    buffers: dict = _local.__dict__.setdefault("buffers", {})
    mappings: dict = _local.__dict__.setdefault("mappings", {})
    numel, key = math.prod(shape), (role, dtype)
    flat = buffers.get(key)
    if flat is None or flat.numel() < numel:
        buffers.pop(key, None)  # the smaller buffer goes before the larger one is made
        mappings.pop(key, None)
        with torch.inference_mode(False):  # a normal tensor, even when first taken under inference mode
            buffers[key], mappings[key] = _mapped(numel, dtype)
        flat = buffers[key]
    return flat[:numel].view(shape)


def _mapped(numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap]:
    """(a tensor in memory mapped for it alone, its mapping): outside the allocator's heap, where a long-lived block
    would sit between the short-lived ones and keep the heap from closing the holes they leave."""
    size = max(numel * torch.empty((), dtype=dtype).element_size(), 1)
    # Private where the platform has the flag: a forked child (a DataLoader worker) must not share the pages.
    private = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_PRIVATE") else {}
    mapping = mmap.mmap(-1, size, **private)
    return torch.frombuffer(mapping, dtype=dtype, count=numel), mapping


def hand_back_later(role: str, keep_bytes: int = 0) -> Callable[[], None]:
    """A function that hands the pages of the calling thread's buffers for ``role`` back to the system, all but the
    first ``keep_bytes``, whichever thread calls it: the buffers stay (the same memory, read as zeros until written
    again), those pages leave the resident set until a `take` writes them again. For a role that is largest where
    memory is low (a CNN's first-layer errors, last in the backward) and would otherwise stay resident through the
    next forward's peak."""
    state = _local.__dict__
    start = -(-keep_bytes // mmap.PAGESIZE) * mmap.PAGESIZE  # page-aligned

    def hand_back() -> None:
        for (kind, _), mapping in list(state.get("mappings", {}).items()):
            if kind == role and start < len(mapping) and hasattr(mmap, "MADV_DONTNEED"):
                mapping.madvise(mmap.MADV_DONTNEED, start, len(mapping) - start)

    return hand_back


def held_bytes() -> int:
    """Bytes the calling thread's buffers hold."""
    return sum(t.numel() * t.element_size() for t in _local.__dict__.get("buffers", {}).values())


def release() -> None:
    """Free the calling thread's buffers (the next `take` makes them anew)."""
    _local.__dict__.pop("buffers", None)
    _local.__dict__.pop("mappings", None)
