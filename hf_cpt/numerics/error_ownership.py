"""Whether the error (output gradient) autograd hands a backward is held by nothing else, so that the backward may
quantize it in place instead of into a second error-sized tensor (docs/method.md §2, "Errors quantized in place").
This module knows nothing about quantization.

Autograd itself reuses a gradient in place when only one reference to it remains (accumulating two gradients of one
tensor, or a parameter's first gradient). A backward sees three counts of what holds its error: the Python
references to the tensor (a hook or a user's list that kept it), the references to its C++ tensor (a gradient the
caller of ``backward()`` passed and still holds) and to its memory (a view or a detached alias of it). Their values
for an error held by nothing else depend on how the Python and PyTorch versions call a backward, so they are
measured once, on a probe function's backward called the same way, and an error counts as held alone only where all
three equal the probe's. Anything else holding it raises one of them.
"""

from __future__ import annotations

import sys
import threading

import torch

_calibration_lock = threading.Lock()
_calibrated = False
_baseline: tuple[int, int, int] | None = None  # None once calibrated: this PyTorch cannot tell
_calibrating_thread: int | None = None  # the thread whose backward is the probe's
_probe_counts: tuple[int, int, int] | None = None
_NEVER = object()  # what no counts equal


def error_held_alone(error: torch.Tensor) -> bool:
    """Whether nothing but the calling backward holds ``error``, the gradient it was handed: to be called first in a
    custom function's backward, before the error is named again (each name is one more reference). False for an
    error that requires grad (a double backward), a view, a tensor off the CPU, and inside a traced graph."""
    if (error.device.type != "cpu" or error.requires_grad or error._base is not None
            or torch.compiler.is_dynamo_compiling()):
        return False
    counts = _counts(error)
    if _calibrating_thread == threading.get_ident():  # the probe's backward: what an error held alone shows
        global _probe_counts
        _probe_counts = counts
        return False
    return counts == _measured_baseline()


def _counts(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(Python references, C++ tensor references, references to its memory) of ``t``, this call's own included;
    None on a PyTorch without these counts."""
    try:
        return sys.getrefcount(t), t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)
    except (AttributeError, RuntimeError):
        return None


class _Probe(torch.autograd.Function):
    """Identity whose backward measures the counts of an error that nothing else holds."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, error):
        error_held_alone(error)
        return error


def _measured_baseline() -> tuple[int, int, int] | object:
    """The probe's counts, measured on first use (a backward of its own, nested in the caller's if need be); where
    they cannot be measured, a value no counts equal."""
    global _calibrated, _baseline, _calibrating_thread
    if not _calibrated:
        with _calibration_lock:
            if not _calibrated:
                _calibrating_thread = threading.get_ident()
                try:
                    with torch.enable_grad():
                        x = torch.zeros(8, requires_grad=True)
                        (_Probe.apply(x) * 2).sum().backward()
                finally:
                    _calibrating_thread = None
                _baseline, _calibrated = _probe_counts, True
    return _NEVER if _baseline is None else _baseline
