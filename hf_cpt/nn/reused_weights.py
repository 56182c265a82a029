"""One quantized copy of each weight per optimizer step (docs/method.md §3, "One quantized weight per optimizer step").

A weight changes only at optimizer steps, so the micro-batches of one step and the batches of one evaluation compute
with the codes the first forward rounded it to. `ReusedWeights` holds them for one epoch, which the Trainer
integration advances (`begin_step`, `end_step`); outside the Trainer nothing is kept. A step's last forward hands each
entry over to the backward that reads it, so no code outlives the backward's peak. Knows nothing of quantization.
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
        self._forwards_left = 0  # forwards still to run in this epoch's optimizer step (0: not in a step)
        self.reuses = 0  # forwards served from here so far (the cost meter skips their weight rotation)

    @property
    def epoch(self) -> int | None:
        """None: every forward quantizes its weight. A new value (None included) drops every entry."""
        return self._epoch

    @epoch.setter
    def epoch(self, value: int | None) -> None:
        if value != self._epoch:
            self._entries.clear()
            self._forwards_left = 0  # until `begin_step` says how many forwards the new epoch has
        self._epoch = value

    def begin_step(self, micro_batches: int) -> None:
        """An optimizer step of ``micro_batches`` forward and backward passes begins: a new epoch, which its
        micro-batches share and whose last forward hands the codes over to its backward."""
        self.epoch = (self._epoch or 0) + 1
        self._forwards_left = micro_batches

    def end_micro_batch(self) -> None:
        """A micro-batch of the step is done (not its last)."""
        self._forwards_left -= 1

    @property
    def last_forward(self) -> bool:
        """Whether the forward now running is its step's last (no later one would reuse the codes): `get` drops the
        entry it returns and `put` keeps nothing."""
        return self._forwards_left == 1

    def end_step(self) -> None:
        """The step's micro-batches are done, or its optimizer step has changed the weights: a new epoch, whose
        forwards (an evaluation's) share the codes."""
        self.epoch = (self._epoch or 0) + 1

    def get(self, layer: Any, key: tuple[Any, ...]) -> tuple[torch.Tensor, ...] | None:
        """The codes ``layer`` kept under ``key`` in this epoch; a stale entry is dropped (before the layer quantizes
        its weight anew, so the two copies never coexist), and so is the one the last forward takes."""
        entry = self._entries.get(id(layer))
        if entry is None:
            return None
        current = entry[0] == key and entry[1]() is layer.weight
        if not current or self.last_forward:
            del self._entries[id(layer)]
        if not current:
            return None
        self.reuses += 1
        return entry[2]

    def put(self, layer: Any, key: tuple[Any, ...], codes: tuple[torch.Tensor, ...]) -> None:
        """Keep ``layer``'s codes for the epoch's later forwards (none in its last)."""
        if not self.last_forward:
            self._entries[id(layer)] = (key, weakref.ref(layer.weight), codes)

    def drop(self, layer: Any) -> None:
        self._entries.pop(id(layer), None)

    def __getstate__(self) -> dict:  # a copied or pickled model starts empty (a weakref cannot be pickled)
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()
