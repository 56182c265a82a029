"""Embedding tables whose gradient is added row by row to the one already made for them (docs/method.md §2,
"Embedding row gradients").

An embedding's backward forms a dense gradient the size of its table, zero but for the rows the batch looked up.
Where the table's gradient already has another part, autograd then adds the two out of place: a second table-sized
tensor. That happens at the end of every backward of a language model whose output layer shares the table (GPT-2's
tied head, whose product's gradient arrives first), and in every micro-batch after the first under gradient
accumulation (the ``.grad`` of the earlier ones). There `EmbeddingAddingRows` hands autograd only the looked-up
rows, as a coalesced sparse gradient, which autograd adds in place to the dense part: the rows are summed by the
embedding's own backward kernel over the batch's distinct ids, the same sums in the same order, so the table's
gradient is the same bit for bit. Where no other part is there (an untied table's first micro-batch), a sparse
gradient would become ``.grad`` itself, which optimizers refuse: the dense gradient is formed as before.

The tied head tells the table when its gradient is in: a forward hook on any module whose weight is the table's
marks the embedding's pass once the gradient reaches that module's output, before the head's product hands autograd
its part. CPU float training only, outside traced graphs and double backward; elsewhere the embedding runs as it was.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..utils import model_embeddings


class _Pass:
    """One training forward of an embedding: whether its table's gradient has a dense part from a tied head."""

    __slots__ = ("head_gradient",)

    def __init__(self) -> None:
        self.head_gradient = False


def runs_here(module: nn.Embedding) -> bool:
    """Whether a lookup can hand its gradient over as rows: CPU training with grad enabled, a plain float table (no
    tensor subclass, no ``max_norm`` renormalization, no frequency scaling, not sparse already), not traced."""
    weight = module.weight
    return (module.training and torch.is_grad_enabled() and weight.requires_grad and weight.device.type == "cpu"
            and type(weight) in (nn.Parameter, torch.Tensor) and weight.is_floating_point()
            and module.max_norm is None and not module.scale_grad_by_freq and not module.sparse
            and not torch.compiler.is_compiling())


class _LookupAddingRows(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)`` whose weight gradient is the looked-up rows where the table's
    gradient already has a dense part (`_other_part_present`), else the dense table aten's embedding backward forms."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx, lookup_pass):
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx, ctx.lookup_pass = weight, padding_idx, lookup_pass
        return nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[1]:
            return None, None, None, None
        (ids,) = ctx.saved_tensors
        weight, padding_idx = ctx.weight, -1 if ctx.padding_idx is None else ctx.padding_idx
        if _other_part_present(ctx.lookup_pass, weight, grad):
            table_grad = rows_gradient(grad, ids, weight.shape[0], padding_idx)
        else:
            table_grad = torch.ops.aten.embedding_dense_backward(grad, ids, weight.shape[0], padding_idx, False)
        return None, table_grad, None, None


def _other_part_present(lookup_pass: _Pass, weight: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether autograd will add this gradient to a dense one: a tied head's product's in this backward, or an
    earlier micro-batch's ``.grad`` (in place, outside double backward)."""
    if torch.is_grad_enabled():  # double backward: keep aten's differentiable path
        return False
    if lookup_pass.head_gradient:
        return True
    held = weight.grad
    return (held is not None and held.layout == torch.strided and held.dtype == grad.dtype
            and held.device == grad.device)


def rows_gradient(grad: torch.Tensor, ids: torch.Tensor, num_weights: int, padding_idx: int) -> torch.Tensor:
    """The embedding's weight gradient as a coalesced sparse tensor of the rows ``ids`` looked up: aten's dense
    backward run over the batch's distinct ids (sorted) instead of the whole table, so each row is the same sum."""
    distinct, compact = torch.unique(ids, sorted=True, return_inverse=True)
    compact_padding = -1
    if padding_idx >= 0:
        at = torch.searchsorted(distinct, torch.tensor(padding_idx, dtype=distinct.dtype))
        if int(at) < distinct.numel() and int(distinct[at]) == padding_idx:
            compact_padding = int(at)
    rows = torch.ops.aten.embedding_dense_backward(grad, compact, distinct.numel(), compact_padding, False)
    return torch.sparse_coo_tensor(distinct.long().unsqueeze(0), rows, (num_weights, rows.shape[-1]),
                                   is_coalesced=True, check_invariants=False)


class EmbeddingAddingRows(nn.Embedding):
    """``nn.Embedding`` whose CPU training lookups hand autograd only the looked-up rows where its gradient is added
    to another (`_LookupAddingRows`); the same outputs and gradients bit for bit."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not runs_here(self):
            self.__dict__["_cpt_pass"] = None  # nothing for a head that runs after this lookup to mark
            return super().forward(ids)
        lookup_pass = self.__dict__["_cpt_pass"] = _Pass()
        return _LookupAddingRows.apply(ids, self.weight, self.padding_idx, lookup_pass)


def _mark_head_gradient(head: nn.Module, args, output) -> None:
    """Forward hook of a module that may share an embedding's table: once the gradient reaches its output, that
    embedding's current pass will find the head's part of the table's gradient in autograd's buffer."""
    if not isinstance(output, torch.Tensor) or not output.requires_grad or torch.compiler.is_compiling():
        return  # (a traced graph's lookups run as they were: nothing to mark)
    for embedding in head.__dict__.get("_cpt_tied_embeddings", ()):
        lookup_pass = embedding.__dict__.get("_cpt_pass")
        if lookup_pass is not None and getattr(head, "weight", None) is embedding.weight:
            output.register_hook(functools.partial(_head_gradient_arrived, lookup_pass))


def _head_gradient_arrived(lookup_pass: _Pass, grad: torch.Tensor) -> None:
    lookup_pass.head_gradient = True


def convert_embedding(module: nn.Module, model: nn.Module) -> bool:
    """Make an ``nn.Embedding`` (the class itself) an `EmbeddingAddingRows` in place, and hook the modules of
    ``model`` that share its weight (and, for the model's input embeddings, its output embeddings, which transformers
    may tie later); False for any other module."""
    if type(module) is not nn.Embedding:
        return False
    module.__class__ = EmbeddingAddingRows
    heads = [m for m in model.modules() if m is not module and getattr(m, "weight", None) is module.weight]
    head = model_embeddings(model, "output") if model_embeddings(model, "input") is module else None
    if head is not None and all(head is not m for m in heads):
        heads.append(head)
    for head in heads:
        tied = head.__dict__.setdefault("_cpt_tied_embeddings", [])
        if not tied:
            head.register_forward_hook(_mark_head_gradient)
        tied.append(module)
    return True


def restore_embedding(module: nn.Module, model: nn.Module) -> None:
    """Undo `convert_embedding` on ``module`` (a no-op for any other module), removing the heads' hooks."""
    if type(module) is not EmbeddingAddingRows:
        return
    module.__class__ = nn.Embedding
    module.__dict__.pop("_cpt_pass", None)
    for head in model.modules():
        tied = head.__dict__.get("_cpt_tied_embeddings")
        if tied is None or all(m is not module for m in tied):
            continue
        tied[:] = [m for m in tied if m is not module]
        if not tied:
            del head.__dict__["_cpt_tied_embeddings"]
            for key, hook in list(head._forward_hooks.items()):
                if hook is _mark_head_gradient:
                    del head._forward_hooks[key]
