"""Backends: which kernels compute CPT's numerics on a device (docs/architecture.md, "Backends").

The layers ask `backend_for(device)` for an operand's codes, the values rebuilt from them, an error's quantization, a
product on codes and whether such products are the fast path there; no device or instruction-set check sits in
`hf_cpt.nn`. ``reference``: the torch formulas that define the numerics, run on every device without a backend of its
own, and what tests compare every fast path with. ``cpu``: the native C kernels, with products on int8 codes where
the CPU has int8 dot products. A new backend is a `Backend` subclass in a folder of its own, registered with
`register_backend`.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from .base import Backend
from .cpu import CPUBackend
from .reference import ReferenceBackend

REFERENCE = ReferenceBackend()
# "1" turns the CUDA backend's kernels on (off until its tests have passed on a GPU: bench/gpu_check.sh sets it)
CUDA_KERNELS_VARIABLE = "HF_CPT_CUDA_KERNELS"
_BACKENDS: dict[str, Backend] = {"cpu": CPUBackend()}


def register_backend(device_type: str, backend: Backend | None) -> Backend | None:
    """Make ``backend`` serve tensors on ``device_type`` (None: the reference again); returns the one it replaced."""
    previous = _BACKENDS.pop(device_type, None)
    if backend is not None:
        _BACKENDS[device_type] = backend
    return previous


def backend_for(device: torch.device | str) -> Backend:
    """The backend that serves tensors on ``device``."""
    device_type = device if isinstance(device, str) else device.type
    if device_type == "cuda" and "cuda" not in _BACKENDS:  # chosen at first use: Triton is imported only then
        _BACKENDS["cuda"] = _cuda_backend()
    return _BACKENDS.get(device_type, REFERENCE)


def _cuda_backend() -> Backend:
    if os.environ.get(CUDA_KERNELS_VARIABLE) != "1" or importlib.util.find_spec("triton") is None:
        return REFERENCE
    from .cuda import CUDABackend

    return CUDABackend()


__all__ = ["Backend", "CPUBackend", "ReferenceBackend", "backend_for", "register_backend"]
