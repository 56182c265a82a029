"""`Tally`: a count kept by forward passes, eager or compiled, that never makes ``torch.compile`` recompile.

Adding to a Python integer inside a traced graph makes dynamo guard on its value, so every later call recompiles
(until dynamo silently falls back to eager). While dynamo traces, a `Tally` adds to a 0-d tensor instead (no
guard); in eager mode to a Python integer. Used by the cost meter and the attention function's MAC counts.
"""

from __future__ import annotations

import torch


class Tally:
    """A count: `add` in forward passes, `drain` to read it and start again from zero."""

    def __init__(self) -> None:
        self._eager = 0
        self._traced = torch.zeros((), dtype=torch.int64)  # added to by compiled graphs

    def add(self, count: int) -> None:
        if torch.compiler.is_compiling():
            self._traced.add_(count)
        else:
            self._eager += count

    @property
    def count(self) -> int:
        """The count since the last drain."""
        return self._eager + int(self._traced)

    def drain(self) -> int:
        """The count since the last drain; resets it."""
        total = self.count
        self._eager = 0
        self._traced.zero_()
        return total
