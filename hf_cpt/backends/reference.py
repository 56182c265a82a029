"""The reference backend: the torch formulas that define CPT's numerics, on any device (`hf_cpt.backends.base`)."""

from __future__ import annotations

from .base import Backend


class ReferenceBackend(Backend):
    """Every operation by its torch formula: int8 products on codes through ``torch._int_mm``, eager errors where no
    fused kernel is asked for, no native kernel."""
