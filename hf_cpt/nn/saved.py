"""What autograd keeps: the two checks a layer or an activation makes before keeping a reference to a tensor that
another node keeps, instead of a copy of its own (`hf_cpt.nn.products`, `hf_cpt.nn.relu_masks`)."""

from __future__ import annotations

import torch


def saved_as_is() -> bool:
    """Whether a tensor saved for backward now is kept as it is: no saved-tensor hooks run (offloading and
    checkpointing keep a copy, or nothing) and no graph is being traced."""
    hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return not torch.compiler.is_dynamo_compiling() and hooks is not None and hooks(False) is None


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` view the same values: one storage, offset, shape and strides."""
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() == b.storage_offset() and a.shape == b.shape and a.stride() == b.stride())
