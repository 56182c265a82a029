"""Backends: which kernels compute CPT's numerics on a device (docs/architecture.md, "Backends").

The layers (`hf_cpt.nn`) ask `backend_for(device)` for an operand's codes (`Backend.operand`), the values rebuilt
from them (`Backend.restore`), an error's quantization (`Backend.error`), a product on codes
(`Backend.code_product`) and whether products on codes are the fast path there (`Backend.products_on_codes`); no
device or instruction-set check sits in `hf_cpt.nn`.

- ``reference`` (`hf_cpt.backends.reference`): the torch formulas that define the numerics; every device without a
  backend of its own runs it, and tests compare every fast path with it.
- ``cpu`` (`hf_cpt.backends.cpu`): the native C kernels, products on int8 codes where the CPU has int8 dot products.

A new backend (a ``cuda`` one with Triton kernels) is a `Backend` subclass in a folder of its own, registered for
its device type with `register_backend`: nothing outside that folder changes.
"""

from __future__ import annotations

import torch

from .base import Backend
from .cpu import CPUBackend
from .reference import ReferenceBackend

REFERENCE = ReferenceBackend()
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
    return _BACKENDS.get(device_type, REFERENCE)


__all__ = ["Backend", "CPUBackend", "ReferenceBackend", "backend_for", "register_backend"]
