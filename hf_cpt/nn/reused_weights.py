"""One quantized copy of each weight per optimizer step (docs/method.md §3, "One quantized weight per optimizer step").

A weight changes only at optimizer steps, so the micro-batches of one step (gradient accumulation) and the batches
of one evaluation can compute with the codes the first forward rounded it to. `ReusedWeights` holds them, one entry
per layer, for one epoch, which the Trainer integration advances at every step's start, before its optimizer step
and at its end (a new epoch drops every entry); with no epoch (outside the Trainer) nothing is kept. This module
knows nothing about quantization.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


class ReusedWeights:
    """The codes each layer's weight was quantized to in this epoch, keyed by what they depend on (the caller's
    key) and by the weight tensor itself."""

    def __init__(self) -> None:
        self._epoch: int | None = None
        self._entries: dict[int, tuple[tuple[Any, ...], weakref.ref, tuple[torch.Tensor, ...]]] = {}
        self.reuses = 0  # forwards served from here so far (the cost meter skips their weight rotation)

    @property
    def epoch(self) -> int | None:
        """None: every forward quantizes its weight. A new value (None included) drops every entry."""
        return self._epoch

    @epoch.setter
    def epoch(self, value: int | None) -> None:
        if value != self._epoch:
            self._entries.clear()
        self._epoch = value

    def get(self, layer: Any, key: tuple[Any, ...]) -> tuple[torch.Tensor, ...] | None:
        """The codes ``layer`` kept under ``key`` in this epoch; a stale entry is dropped (before the layer quantizes
        its weight anew, so the two copies never coexist)."""
        entry = self._entries.get(id(layer))
        if entry is None:
            return None
        if entry[0] != key or entry[1]() is not layer.weight:
            del self._entries[id(layer)]
            return None
        self.reuses += 1
        return entry[2]

    def put(self, layer: Any, key: tuple[Any, ...], codes: tuple[torch.Tensor, ...]) -> None:
        self._entries[id(layer)] = (key, weakref.ref(layer.weight), codes)

    def drop(self, layer: Any) -> None:
        self._entries.pop(id(layer), None)

    def __getstate__(self) -> dict:  # a copied or pickled model starts empty (a weakref cannot be pickled)
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()
