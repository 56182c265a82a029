"""Dropout that keeps a packed mask for its backward on the CPU (docs/method.md §2, "Dropout masks").

On the CPU, ``F.dropout`` (and the dropout inside SDPA's math path, which CPU training with dropout runs) multiplies
by a float32 tensor of ``0`` and ``1 / (1 - p)`` and keeps that tensor for its backward: four bytes per value. On an
accelerator PyTorch calls ``torch.native_dropout`` instead, which keeps a bool mask. Once the quantized layers keep
one-byte codes, the float masks are the largest thing a transformer's training step keeps on the CPU (the kept-memory
table of docs/benchmarks.md). `quantize_model` (``CPTConfig.dropout_masks``) converts ``nn.Dropout`` modules to
`DropoutKeepingBoolMask`, and the ``"cpt"`` attention function runs full-precision SDPA through
`sdpa_keeping_bool_mask`: ``native_dropout`` on the CPU too. It draws the same random numbers as ``F.dropout`` and
scales by the same float, so outputs, gradients and the random stream are the same bit for bit (the tests compare
them); only the kept mask shrinks, to a bit a value where the native kernel packs it (`pack_flags`: a float32 CPU
tensor of at least `NATIVE_MIN_NUMEL` values), else a byte. Elsewhere (accelerators, eval, no grad, in place, other
dtypes than float32, a traced graph) the dropout runs as it was.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..numerics import scratch
from ..numerics.mask_kernels import dropout_backward_bits, pack_flags


def runs_here(x: torch.Tensor, p: float, training: bool) -> bool:
    """Whether a dropout of ``x`` keeps a bool mask this way: float32 CPU training with grad enabled, ``0 < p < 1``,
    not traced. (In bfloat16 ``F.dropout`` keeps its mask, rounded to two bytes, and its gradient rounds the scale
    its own way.)"""
    return (training and 0.0 < p < 1.0 and x.device.type == "cpu" and x.dtype == torch.float32
            and torch.is_grad_enabled() and not torch.compiler.is_compiling())


class _DropoutKeepingBits(torch.autograd.Function):
    """``torch.native_dropout(x, p, True)[0]`` keeping its mask for backward one bit a value where the native kernel
    packs it (`pack_flags`), else as the bool tensor; the gradient is ``native_dropout_backward``'s bit for bit. With
    ``output_mappings``, a contiguous input's output goes into a mapping of its own (`scratch.handed_on`): the steps
    of ``native_dropout``'s CPU kernel (a bool mask drawn by ``bernoulli_``, the input times it, times the scale),
    written out, so the same values and random numbers."""

    @staticmethod
    def forward(ctx, x, p, output_mappings=False, owner=None):
        if output_mappings and x.is_contiguous():
            mask = torch.empty_like(x, dtype=torch.bool).bernoulli_(1.0 - p)
            output = scratch.handed_on(x.shape, x.dtype, owner)
            torch.mul(x, mask, out=output).mul_(1.0 / (1.0 - p))
        else:
            output, mask = torch.native_dropout(x, p, True)
        bits = pack_flags(mask)
        ctx.scale = 1.0 / (1.0 - p)  # the scale native_dropout's own backward multiplies by
        ctx.save_for_backward(mask if bits is None else bits)
        return output

    @staticmethod
    def backward(ctx, grad):
        (kept,) = ctx.saved_tensors
        if kept.dtype == torch.bool:
            return torch.ops.aten.native_dropout_backward(grad, kept, ctx.scale), None, None, None
        return dropout_backward_bits(grad, kept, ctx.scale), None, None, None


def dropout(x: torch.Tensor, p: float, training: bool, output_mappings: bool = False, owner: object = None
            ) -> torch.Tensor:
    """``F.dropout(x, p, training)``, bit for bit, keeping a packed (or bool) mask for backward where `runs_here`
    (its output a handed-on block for ``owner``, the module calling it, with ``output_mappings``,
    `_DropoutKeepingBits`)."""
    if runs_here(x, p, training):
        return _DropoutKeepingBits.apply(x, p, output_mappings, owner)
    return nn.functional.dropout(x, p=p, training=training)


class DropoutKeepingBoolMask(nn.Dropout):
    """``nn.Dropout`` whose CPU training forward keeps a bool mask for backward (`dropout`); in place, as it was."""

    output_mappings = False  # set on a converted module by ``CPTConfig.output_mappings``

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inplace:
            return super().forward(x)
        return dropout(x, self.p, self.training, self.output_mappings, owner=self)


def convert_dropout(module: nn.Module, output_mappings: bool = False) -> bool:
    """Make an ``nn.Dropout`` (the class itself, not a subclass) a `DropoutKeepingBoolMask`, in place, its CPU
    training output in a mapping of its own with ``output_mappings``; False for any other module."""
    if type(module) is not nn.Dropout:
        return False
    module.__class__ = DropoutKeepingBoolMask
    if output_mappings:
        module.output_mappings = True
    return True


def restore_dropout(module: nn.Module) -> None:
    """Undo `convert_dropout`."""
    if type(module) is DropoutKeepingBoolMask:
        module.__dict__.pop("output_mappings", None)
        module.__class__ = nn.Dropout


class sdpa_keeping_bool_mask(TorchFunctionMode):  # noqa: N801 - used as a context manager, like torch's own modes
    """Within it, ``F.scaled_dot_product_attention`` on float32 CPU tensors with dropout in training runs SDPA's
    math path written out (`_math_attention`), with ``native_dropout``: SDPA's outputs and gradients bit for bit, a
    bool mask kept instead of a float one (the dropout's output in a mapping of its own with ``output_mappings``).
    Any other call runs as it was."""

    def __init__(self, output_mappings: bool = False, owner: object = None):
        super().__init__()
        self.output_mappings, self.owner = output_mappings, owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is nn.functional.scaled_dot_product_attention:
            call = _math_call(*args, **kwargs)
            if call is not None:
                return _math_attention(**call, output_mappings=self.output_mappings, owner=self.owner)
        return func(*args, **kwargs)


def _math_call(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
               **others):
    """The arguments of `_math_attention` for an SDPA call it reproduces, else None."""
    tensors = (query, key, value) + (() if attn_mask is None else (attn_mask,))
    if (others or not runs_here(query, dropout_p, True) or not hasattr(torch, "_safe_softmax")
            or any(t.is_nested or t.device.type != "cpu" for t in tensors)
            or key.dtype != torch.float32 or value.dtype != torch.float32
            or (attn_mask is not None and attn_mask.dtype not in (torch.bool, torch.float32))
            or (is_causal and attn_mask is not None) or (scale is not None and not scale > 0)
            or not query.dim() == key.dim() == value.dim() == 4):
        return None
    heads, kv_heads = (query.shape[-3], key.shape[-3])
    if kv_heads != heads and not (enable_gqa and heads % kv_heads == 0):
        return None
    return {"query": query, "key": key, "value": value, "attn_mask": attn_mask, "dropout_p": dropout_p,
            "is_causal": is_causal, "scale": scale}


def _math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, output_mappings=False, owner=None):
    """SDPA's math path: ``dropout(softmax(q·√s (k·√s)ᵀ + mask)) v``, each operand scaled by the square root of the
    scale, fully masked rows giving zeros, grouped key/value heads repeated; the dropout through ``native_dropout``."""
    root_scale = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(query.shape[-1]))
    if is_causal:
        attn_mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill_(attn_mask.logical_not(), -math.inf)
    repeats = query.shape[-3] // key.shape[-3]
    if repeats > 1:
        key, value = key.repeat_interleave(repeats, -3), value.repeat_interleave(repeats, -3)
    scores = torch.matmul(query * root_scale, key.transpose(-2, -1) * root_scale)
    if attn_mask is not None:
        scores = scores + attn_mask
    weights = _DropoutKeepingBits.apply(torch._safe_softmax(scores, -1), dropout_p, output_mappings, owner)
    return torch.matmul(weights, value)
