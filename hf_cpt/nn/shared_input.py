"""Sibling layers that read one input (an attention's query, key and value projections, a gated MLP's gate and up
projections) rotate and quantize it once (docs/method.md §3, "Shared inputs").

With per-token ranges, what a layer does to its input depends only on the input, the rotation, and the bits. The
first layer to see an input keeps its rotated copy, ranges and quantized value here and the next ones reuse them: the
same values feed every product, the backward keeps one copy of the codes, and the siblings' input gradients are
rotated back once. One entry per model, dropped when the input is freed. Knows nothing of the Trainer.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class SharedInput:
    """One input as the layers compute with it: rotated (autograd-tracked; None when not rotated: the input
    itself, never held here; for products on codes, a stand-in with no values, `Rotation.stand_in`), its per-token
    range, and the quantized operand with what the backward keeps (``(value, saved)`` of
    `hf_cpt.nn.products.quantized_operand`)."""

    rotated: torch.Tensor | None
    x_range: tuple[torch.Tensor, torch.Tensor]
    quantized: tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]


class SharedInputs:
    """The last input a model's per-token quantized layers saw, keyed by the input tensor itself (and its
    version, so an in-place edit misses) and by everything else its quantization depends on."""

    def __init__(self) -> None:
        self._source: weakref.ref | None = None
        self._key: tuple[Any, ...] | None = None
        self._entry: SharedInput | None = None
        self.reuses = 0  # inputs served from here so far (the cost meter counts their rotation once)

    def get(self, x: torch.Tensor, key: tuple[Any, ...]) -> SharedInput | None:
        """The entry of ``x`` computed under ``key``, None when another input or setting is held."""
        if self._entry is None or self._source is None or self._source() is not x or self._key != (x._version, *key):
            return None
        self.reuses += 1
        return self._entry

    def put(self, x: torch.Tensor, key: tuple[Any, ...], entry: SharedInput) -> None:
        """Hold ``entry`` for ``x`` until the next input, or until ``x`` is freed."""
        self._source = weakref.ref(x, self._release)
        self._key, self._entry = (x._version, *key), entry

    def __getstate__(self) -> dict:  # a copied or pickled model starts empty (a weakref cannot be pickled)
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def clear(self) -> None:
        self._source = self._key = self._entry = None

    def _release(self, source: weakref.ref) -> None:
        if source is self._source:
            self.clear()
