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
caching allocator hands out reserved memory without faults). The mappings stay until `release` (the Trainer
integration calls it when training ends); between passes `hand_back` returns their pages to the system where
transparent huge pages back them, so that a fault maps 2 MiB (`mark_idle` and `hand_back_if_idle`: when a backward
is done with them, and at the optimizer step after it). What writing them again then costs depends on the
machine: on this project's virtual machine, little more than writing resident pages one day and many times more the
next (docs/benchmarks.md, after the hand-back table), so callers may decline to hand back. They hold the largest
input, weight, rotated weight and error of the quantized layers, and the float32 operands of a product on codes
without int8 dot products (what each bench model's hold: docs/benchmarks.md, peak-phases table).

`kept` serves the other kind of CPU tensor a layer makes: one kept across a pass (its input's codes, kept for its
backward), given a mapping of its own, where a run asks for it, once large enough, and unmapped when freed
(docs/method.md §2, "Kept codes"). `handed_on` serves a third kind: a block a layer makes and hands on (its
output, its input's gradient), given a mapping of its own once large enough, which waits for the next block of its
size once freed, or a block of the heap where its owner's blocks outlive the pass (docs/method.md §2, "Handed-on
blocks").
This module knows nothing about quantization.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import threading
import weakref
from pathlib import Path

import torch

_local = threading.local()


def take(role: str, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor of ``shape`` and ``dtype``: the calling thread's buffer for ``role``,
    grown (never shrunk) to fit."""
    buffers: dict = _local.__dict__.setdefault("buffers", {})
    mappings: dict = _local.__dict__.setdefault("mappings", {})
    _written(role)
    numel, key = math.prod(shape), (role, dtype)
    flat = buffers.get(key)
    if flat is None or flat.numel() < numel:
        buffers.pop(key, None)  # the smaller buffer goes before the larger one is made
        mappings.pop(key, None)
        with torch.inference_mode(False):  # a normal tensor, even when first taken under inference mode
            buffers[key], mappings[key] = _mapped(numel, dtype)
        flat = buffers[key]
    return flat[:numel].view(shape)


def _mapped(numel: int, dtype: torch.dtype, huge: bool = True) -> tuple[torch.Tensor, mmap.mmap]:
    """(a tensor in memory mapped for it alone, its mapping): outside the allocator's heap, where a long-lived block
    would sit between the short-lived ones and keep the heap from closing the holes they leave. With ``huge``, backed
    by transparent huge pages where the kernel has them."""
    size = max(numel * torch.empty((), dtype=dtype).element_size(), 1)
    # Private where the platform has the flag: a forked child (a DataLoader worker) must not share the pages.
    private = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_PRIVATE") else {}
    mapping = mmap.mmap(-1, size, **private)
    if huge and huge_pages():
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without them
            pass
    return torch.frombuffer(mapping, dtype=dtype, count=numel), mapping


# A kept tensor of at least ``$HF_CPT_OWN_MAPPING_BYTES`` bytes gets a mapping of its own (`kept`; read at each
# call). Unset or 0, none does: in the bench's model steps the mappings lowered two models' peaks and cost most of
# them up to about a tenth of their time (docs/benchmarks.md, the own-mappings table), so a run opts in, e.g. with
# `SUGGESTED_OWN_MAPPING_BYTES`, the size measured there.
OWN_MAPPING_VARIABLE = "HF_CPT_OWN_MAPPING_BYTES"
SUGGESTED_OWN_MAPPING_BYTES = 256 * 1024


def own_mapping_bytes() -> int:
    """The size from which `kept` maps a tensor of its own: ``$HF_CPT_OWN_MAPPING_BYTES`` (unset or 0: never)."""
    value = os.environ.get(OWN_MAPPING_VARIABLE, "").strip()
    if not value:
        return 0
    try:
        size = int(value)
    except ValueError:
        raise ValueError(f"${OWN_MAPPING_VARIABLE} must be a number of bytes (0: no own mappings), "
                         f"got {value!r}") from None
    if size < 0:
        raise ValueError(f"${OWN_MAPPING_VARIABLE} must be 0 or more bytes, got {size}")
    return size


def kept(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor for memory kept across a pass: of at least `own_mapping_bytes` (where
    set), in a mapping of its own that goes back to the system when the tensor is freed; else from torch's allocator.
    glibc serves blocks below its mmap threshold (raised by the first large frees to up to 32 MiB) from its heap,
    where a kept block made between float activations can split the holes they leave when freed, which the next
    activations of their size then cannot reuse: the heap grows while the memory in use does not
    (docs/benchmarks.md, the own-mappings table). Where the system refuses a mapping, torch's allocator serves.
    Faulted in 4 KiB at a time: a fresh mapping with huge pages took three times as long to write on this project's
    virtual machine, and unlike the reused buffers these are fresh in every step."""
    numel = math.prod(shape)
    threshold = own_mapping_bytes()
    if threshold == 0 or numel * dtype.itemsize < threshold:
        return torch.empty(shape, dtype=dtype)
    try:
        return _mapped(numel, dtype, huge=False)[0].view(shape)  # the tensor holds its mapping: unmapped with it
    except OSError:  # out of mappings (vm.max_map_count) or of address space
        return torch.empty(shape, dtype=dtype)


# A block a layer hands on of at least this many bytes gets a mapping of its own (`handed_on`); at most this many
# freed ones of each size, of the sizes last freed, wait, resident, for the next block of their size (shapes that
# change from batch to batch leave no more than that many behind).
HANDED_ON_MAPPING_BYTES = 1 << 20
IDLE_BLOCKS_PER_SIZE = 1
IDLE_SIZES = 16


class _Blocks:
    """The mappings of handed-on blocks that no tensor holds, by size, waiting for the next block of their size:
    a freed block's pages stay resident for it, where a fresh mapping faults each page in again (on this project's
    virtual machine about as long as writing the page ten times). Process-wide: a block may be freed on any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: dict[int, list[mmap.mmap]] = {}
        self.types: dict[int, type] = {}

    def take(self, size: int) -> ctypes.Array:
        """A block of ``size`` bytes over an idle mapping of that size, else a new one; the mapping goes back to
        `idle` (or to the system beyond `IDLE_BLOCKS_PER_SIZE`) when the block is freed."""
        with self.lock:
            waiting = self.idle.get(size)
            mapping = waiting.pop() if waiting else None
        if mapping is None:
            private = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_PRIVATE") else {}
            mapping = mmap.mmap(-1, size, **private)
        block = self.block_type(size).from_address(_address(mapping))  # no buffer export: it may close under it
        block.mapping = mapping
        return block

    def block_type(self, size: int) -> type:
        """The array type of blocks of ``size`` bytes, whose instances return their memory when freed (`_freed`)."""
        with self.lock:
            block_type = self.types.get(size)
            if block_type is None:
                if len(self.types) >= 4 * IDLE_SIZES:  # shapes that change from batch to batch: a live block
                    self.types.clear()  # keeps its own type
                block_type = self.types[size] = type("HandedOnBlock", (ctypes.c_char * size,), {
                    "__del__": _freed, "mapping": None, "heap": None, "site": None})
        return block_type

    def give_back(self, mapping: mmap.mmap) -> None:
        closing = [mapping]
        with self.lock:
            waiting = self.idle.pop(len(mapping), [])
            if len(waiting) < IDLE_BLOCKS_PER_SIZE:
                waiting.append(mapping)
                closing.pop()
            self.idle[len(mapping)] = waiting  # the size last freed goes last
            while len(self.idle) > IDLE_SIZES:  # the size freed longest ago goes back
                closing += self.idle.pop(next(iter(self.idle)))
        for each in closing:
            each.close()

    def release(self) -> None:
        """Return every idle mapping to the system."""
        with self.lock:
            idle, self.idle = self.idle, {}
        for mapping in (m for waiting in idle.values() for m in waiting):
            mapping.close()

    def idle_bytes(self) -> int:
        with self.lock:
            return sum(len(m) for waiting in self.idle.values() for m in waiting)


class _Site:
    """What `handed_on` learned of one owner's blocks: whether the last one it made in a forward was still held
    when a backward ran (the owner's output kept for the backward, by an attention or an activation)."""

    __slots__ = ("outlives_pass",)

    def __init__(self) -> None:
        self.outlives_pass = False


_sites: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _heap_block(size: int) -> ctypes.Array | None:
    """A block of ``size`` bytes from the C heap, where torch's CPU allocator takes its own (64-byte aligned, as
    it aligns them), returned to it when freed; None where the C library has no ``posix_memalign``."""
    libc, address = _libc(), ctypes.c_void_p()
    if libc is None or libc.posix_memalign(ctypes.byref(address), 64, size) != 0:
        return None
    block = _blocks.block_type(size).from_address(address.value)
    block.heap = address.value
    return block


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library's allocator, with its signatures; None where the process has no ``posix_memalign``."""
    try:
        libc = ctypes.CDLL(None)
        libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
    except (OSError, TypeError, AttributeError):  # Windows: no process-wide C symbols
        return None
    libc.posix_memalign.restype = ctypes.c_int
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
    return libc


def _freed(block) -> None:
    """A handed-on block's ``__del__``: note in its owner's site whether a backward is running (the block outlived
    the forward that made it), then return its memory (its mapping to `_blocks`, else to the heap)."""
    if block.site is not None:
        block.site.outlives_pass = torch._C._current_graph_task_id() != -1
    if block.mapping is not None:
        _blocks.give_back(block.mapping)
    elif block.heap is not None:
        _libc().free(block.heap)


def _address(mapping: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # its export of the mapping


_blocks = _Blocks()


def handed_on(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, owner: object = None) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor for a block a layer makes and hands on (its output, its input's
    gradient): of at least `HANDED_ON_MAPPING_BYTES`, in a mapping of its own, kept idle for the next block of its
    size when the tensor is freed (`IDLE_BLOCKS_PER_SIZE`) until `release_idle_blocks`, else returned to the system;
    smaller ones, or where the system refuses a mapping, from torch's allocator. Under glibc's default a quantized
    forward frees the float inputs its layers keep as codes, and the blocks made after them split the holes they
    leave, which stay resident (docs/method.md §2, "Handed-on blocks"). Not a view: an autograd function may return
    it and a caller edit it in place.

    ``owner`` (the module making it in a forward) lets the block's lifetime decide: where the owner's last block
    from a forward was still held when a backward ran (kept for it, by an attention or an activation), the block
    comes from the heap instead. It lives through the pass either way, so a mapping of its own saves no hole; fresh
    in every step, it would fault its pages in again, and it would leave the heap's holes of its size empty."""
    numel = math.prod(shape)
    size = numel * dtype.itemsize
    if size < HANDED_ON_MAPPING_BYTES:
        return torch.empty(shape, dtype=dtype)
    site = None
    if owner is not None and torch._C._current_graph_task_id() == -1:  # made in a forward
        site = _sites.get(owner)
        if site is None:
            site = _sites[owner] = _Site()
    try:
        block = _heap_block(size) if site is not None and site.outlives_pass else None
        block = _blocks.take(size) if block is None else block
    except OSError:  # out of mappings (vm.max_map_count) or of address space
        return torch.empty(shape, dtype=dtype)
    block.site = site
    flat = torch.frombuffer(block, dtype=dtype, count=numel)  # its storage holds the block until freed
    return torch.empty(0, dtype=dtype).set_(flat.untyped_storage(), 0, shape)


def release_idle_blocks() -> None:
    """Return the idle handed-on blocks' mappings to the system (at an optimizer step's start, where a model's step
    may peak, and at the end of training)."""
    _blocks.release()


def idle_block_bytes() -> int:
    """Bytes of the handed-on blocks' mappings that no tensor holds."""
    return _blocks.idle_bytes()


def _written(*roles: str) -> None:
    """Mark ``roles`` (every role when none is given) as written over on this thread: `generation` changes."""
    state = _local.__dict__
    state["counter"] = counter = state.get("counter", 0) + 1
    generations: dict = state.setdefault("generations", {})
    for role in roles or list(generations):
        generations[role] = counter


def generation(role: str) -> int:
    """A number that changes whenever the calling thread's buffers for ``role`` may have been written over (taken,
    handed back or released): for a caller that keeps values in a buffer across other work and must know whether
    they are still there."""
    return _local.__dict__.get("generations", {}).get(role, -1)


@functools.cache
def huge_pages() -> bool:
    """Whether the kernel backs a mapping with transparent huge pages when asked to (Linux with THP set to "always"
    or "madvise")."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


def hand_back() -> None:
    """Hand the pages of the calling thread's buffers back to the system, where huge pages back them: the buffers
    stay (the same memory, read as zeros until written again), their pages leave the resident set until a `take`
    writes them again. For buffers idle until the next pass (an optimizer step between a backward and the next
    forward). Without huge pages, nothing: writing them again 4 KiB fault by fault made a single layer's training
    step 10-20% slower (docs/method.md §2, "Reused buffers")."""
    _local.__dict__.pop("idle", None)
    if not huge_pages():
        return
    _written()
    for mapping in _local.__dict__.get("mappings", {}).values():
        mapping.madvise(mmap.MADV_DONTNEED)


def mark_idle() -> None:
    """Note that the calling thread's buffers are idle until the next pass (its backward is past its last user):
    `hand_back_if_idle` then hands them back."""
    _local.__dict__["idle"] = True


def hand_back_if_idle() -> bool:
    """`hand_back` if `mark_idle` was called on this thread since its buffers were last handed back; whether it
    was. For the start of a phase that may peak without them (an optimizer step), so that a loop with no such
    phase (a layer's forward and backward timed alone) never writes them again page by page."""
    if not _local.__dict__.get("idle"):
        return False
    hand_back()
    return True


def holds(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in one of the calling thread's buffers."""
    address = t.data_ptr()
    return any(b.data_ptr() <= address < b.data_ptr() + b.numel() * b.element_size()
               for b in _local.__dict__.get("buffers", {}).values())


def held_bytes() -> int:
    """Bytes the calling thread's buffers hold."""
    return sum(t.numel() * t.element_size() for t in _local.__dict__.get("buffers", {}).values())


def release() -> None:
    """Free the calling thread's buffers (the next `take` makes them anew) and the idle handed-on blocks."""
    release_idle_blocks()
    _local.__dict__.pop("buffers", None)
    _local.__dict__.pop("mappings", None)
    _local.__dict__.pop("generations", None)
    _local.__dict__.pop("idle", None)
