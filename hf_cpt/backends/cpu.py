"""The CPU backend: the package's C kernels (`hf_cpt.numerics.native`), and products on int8 codes where the CPU
has int8 dot products (AVX-512 VNNI, AVX-VNNI, AMX); without them an int8 GEMM is far slower than a float32 one,
and products on codes go through the float32 GEMM, exact where a bound proves it (docs/method.md §2).

``HF_CPT_INT8_DOT`` (``1`` / ``0``) overrides what the CPU reports, so that either path runs on any machine.
"""

from __future__ import annotations

import functools
import os

import torch

from .base import Backend

INT8_DOT_VARIABLE = "HF_CPT_INT8_DOT"
# CPU flags (/proc/cpuinfo) of int8 dot-product instructions
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


@functools.cache
def cpu_reports_int8_dot() -> bool:
    """Whether this CPU reports int8 dot-product instructions (Linux: /proc/cpuinfo; elsewhere False)."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line for line in info if line.startswith("flags")), "").split()
    except OSError:
        return False
    return any(flag in flags for flag in INT8_DOT_FLAGS)


def int8_dot_products() -> bool:
    """Whether products on codes take the int8 path here: ``$HF_CPT_INT8_DOT`` if set (``1``/``0``), else what the
    CPU reports. Read at each call (outside compiled code: `CPUBackend` reads it when a model is set up)."""
    forced = os.environ.get(INT8_DOT_VARIABLE)
    if forced is not None:
        if forced not in ("0", "1"):
            raise ValueError(f"{INT8_DOT_VARIABLE} must be 0 or 1, got {forced!r}")
        return forced == "1"
    return hasattr(torch, "_int_mm") and cpu_reports_int8_dot()


class CPUBackend(Backend):
    """C kernels for codes, values, errors and the scaling of products on codes; int8 GEMMs where the CPU has int8
    dot products, else the float32 GEMM of the centred codes."""

    name = "cpu"
    native = True

    def __init__(self, int8_dot: bool | None = None) -> None:
        # read once, here: a compiled graph must not trace the CPU's flags or the environment
        self.int8_dot = int8_dot_products() if int8_dot is None else int8_dot

    def products_on_codes(self, setting: bool | str) -> bool:
        """The setting as it is; "auto": True with int8 dot products, else False (a product on codes goes through the
        float32 GEMM there, and recomputing activations costs a second GEMM per MLP and step)."""
        return self.int8_dot if setting == "auto" else setting

    def int8_gemm(self) -> bool:
        return self.int8_dot
