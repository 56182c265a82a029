"""Output fidelity: how much of a model's output survives quantization at a given precision.

Measured as the mean cosine similarity, over tokens (or samples), between the model's last hidden
states (or its output tensor) in full precision and at ``bits``, on one batch, in eval mode with
per-tensor inputs quantized over the batch's own range (so it works before any running range exists).
A pretrained transformer quantized per tensor at 4 bits scores near 0 (docs/pretrained.md).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..convert import find_precision_state


def _output_tensor(model: nn.Module, batch: Any) -> torch.Tensor:
    if isinstance(batch, Mapping):
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "label")}
        try:
            accepts_hidden = "output_hidden_states" in inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            accepts_hidden = False
        if accepts_hidden:
            inputs["output_hidden_states"] = True
        outputs = model(**inputs)
    elif isinstance(batch, (tuple, list)):
        outputs = model(batch[0])
    else:
        outputs = model(batch)
    hidden = outputs.get("hidden_states") if isinstance(outputs, Mapping) else None
    if hidden:
        return hidden[-1]
    if isinstance(outputs, Mapping):
        for key in ("logits", "last_hidden_state"):
            if outputs.get(key) is not None:
                return outputs[key]
        return next(v for v in outputs.values() if isinstance(v, torch.Tensor))
    if isinstance(outputs, (tuple, list)):
        return outputs[0]
    return outputs


def cosine_fidelity(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """Mean cosine similarity of the rows (last dimension) of two outputs."""
    reference = reference.detach().float().reshape(-1, reference.shape[-1])
    candidate = candidate.detach().float().reshape(-1, candidate.shape[-1])
    return float(torch.nn.functional.cosine_similarity(reference, candidate, dim=-1, eps=1e-12).mean())


@torch.no_grad()
def output_fidelity(model: nn.Module, batch: Any, bits: list[int] | int) -> dict[int, float]:
    """``{bits: cosine similarity to full precision}`` of a CPT-quantized model's output on ``batch``.

    ``batch`` is what the model takes: a dict of tensors (labels are dropped), a tuple whose first item
    is the input, or a tensor. The model's training mode and precision settings are left as they were.
    """
    bit_list = [bits] if isinstance(bits, int) else list(bits)
    precision = find_precision_state(model)
    was_training = model.training
    model.eval()
    try:
        with precision.evaluating_at(None):
            reference = _output_tensor(model, batch)
        result = {}
        for b in bit_list:
            with precision.evaluating_at(b, batch_ranges=True):
                result[b] = cosine_fidelity(reference, _output_tensor(model, batch))
    finally:
        model.train(was_training)
    return result
