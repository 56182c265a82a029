"""GELU with its output and its input's gradient in mappings of their own (``CPTConfig.output_mappings``;
docs/method.md §2, "Handed-on blocks").

In a transformer's MLP the GELU's output is the largest tensor a quantized forward makes and frees within the pass
(the next layer keeps its codes), and its input's gradient the largest its backward hands on. A converted GELU
(`hf_cpt.nn.recompute`) whose forward is ``F.gelu`` writes both into `hf_cpt.numerics.scratch.handed_on` blocks in
CPU training: the kernels autograd runs (``gelu``, ``gelu_backward``), so the same values bit for bit.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..numerics import scratch


def runs_here(x: torch.Tensor) -> bool:
    """Whether a GELU of ``x`` runs here: a contiguous float CPU tensor of a handed-on block's size or more
    (`scratch.HANDED_ON_MAPPING_BYTES`) that needs its gradient, grad mode on, not traced, outside autocast (whose
    casts a kernel writing into a given tensor skips)."""
    return (x.device.type == "cpu" and x.is_floating_point() and x.requires_grad and x.is_contiguous()
            and x.numel() * x.element_size() >= scratch.HANDED_ON_MAPPING_BYTES
            and torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling())


def gelu_approximation(module: nn.Module) -> str | None:
    """The ``approximate`` argument of the ``F.gelu`` call that is ``module``'s whole forward (``nn.GELU``,
    transformers' ``GELUActivation`` and ``GELUTanh``), else None (its own formula: runs as it was)."""
    if isinstance(module, nn.GELU):
        return module.approximate
    act = getattr(module, "act", None)
    if act is F.gelu:
        return "none"
    if (isinstance(act, functools.partial) and act.func is F.gelu and not act.args
            and set(act.keywords) == {"approximate"}):
        return act.keywords["approximate"]
    return None


class _GeluHandedOn(torch.autograd.Function):
    """``F.gelu(x, approximate=...)``, its output and its input's gradient in handed-on blocks."""

    @staticmethod
    def forward(ctx, x, approximate, owner):
        output = scratch.handed_on(x.shape, x.dtype, owner)
        torch._C._nn.gelu(x, approximate=approximate, out=output)
        ctx.approximate = approximate
        ctx.save_for_backward(x)
        return output

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        grad_x = scratch.handed_on(x.shape, x.dtype)
        torch.ops.aten.gelu_backward.grad_input(grad, x, approximate=ctx.approximate, grad_input=grad_x)
        return grad_x, None, None


def gelu(x: torch.Tensor, approximate: str, owner: object = None) -> torch.Tensor:
    """``F.gelu(x, approximate=approximate)`` with its output and its input's gradient in handed-on blocks (the
    output's for ``owner``, the module calling it: `scratch.handed_on`)."""
    return _GeluHandedOn.apply(x, approximate, owner)
