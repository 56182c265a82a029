"""`Tally`: a count kept by forward passes, eager or compiled, that never makes ``torch.compile`` recompile.

Adding to a Python integer attribute inside a graph that dynamo traces makes dynamo guard on that integer's value:
the next call, which finds it larger, fails the guard and compiles the graph again, until dynamo's limit of
recompilations, after which it runs the frame eagerly without saying so. A loop that counts the MACs of every
forward (the cost meter, the attention function) would recompile at every call that does not follow a reset: every
micro-batch of an accumulated step, every step of a loop outside the Trainer. While dynamo traces, a `Tally` adds
to a 0-d tensor instead, an operation of the graph whose value is no guard; in eager mode it adds to a Python
integer, at no cost. This module knows nothing about quantization.
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
