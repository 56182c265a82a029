"""Small tensors derived from another tensor, computed once per value of it (docs/method.md §2, "Operations per step").

A layer's top code ``2^b - 1`` follows from the bit-width tensor, a rotation's transposed factors from the rotation:
`derived` keeps them beside their source until it changes in place (its version counter moves) or is freed, sparing
a GPU a few launches per layer and step. Traced code, fake and inference tensors and subclasses compute anew.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

# source tensor -> {key: (the source's version when computed, value)}; an entry goes with its source.
_DERIVED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _tracing_with_fake_tensors() -> bool:
    # Under a fake-tensor mode (non-strict export, shape propagation) compute would return a fake tensor: never kept.
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def derived(source: torch.Tensor, key: Hashable, compute: Callable[[], Any]) -> Any:
    """``compute()``, kept with ``source`` under ``key`` while ``source`` keeps its value.

    ``compute`` must depend on nothing but ``source``'s value and ``key``, and return new tensors (never ``source``
    or a view of it, which would keep ``source`` alive for good). It runs outside inference mode and without grad,
    so what it returns serves training and evaluation alike; callers must not modify it.
    """
    if torch.compiler.is_dynamo_compiling() or torch.compiler.is_exporting():  # first: the trace keeps no branch
        return compute()
    if type(source) is not torch.Tensor or source.is_inference() or _tracing_with_fake_tensors():
        return compute()
    entries = _DERIVED.get(source)
    if entries is None:
        entries = _DERIVED[source] = {}
    version = source._version
    entry = entries.get(key)
    if entry is not None and entry[0] == version:
        return entry[1]
    with torch.inference_mode(False), torch.no_grad():
        value = compute()
    entries[key] = (version, value)
    return value
