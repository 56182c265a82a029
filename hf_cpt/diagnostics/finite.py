"""Non-finite values in a training run: the inputs a running range skipped, weights that went NaN or inf."""

from __future__ import annotations

import torch
from torch import nn

from ..convert import quant_layers
from ..nn.base import NONFINITE_INPUTS


def nonfinite_inputs(model: nn.Module) -> dict[str, int]:
    """{layer: training forwards whose input held a NaN or inf (its running range skipped them)} since the last call."""
    layers = [(name, layer) for name, layer in quant_layers(model)  # per-token layers keep no running range
              if NONFINITE_INPUTS in layer._buffers and layer.cpt_granularity != "token"]
    if not layers:
        return {}
    device = layers[0][1]._buffers[NONFINITE_INPUTS].device
    counts = torch.stack([layer._buffers[NONFINITE_INPUTS].to(device) for _, layer in layers])
    if not bool(counts.any()):  # one host read a step, on the device the counts live on
        return {}
    for _, layer in layers:
        layer._buffers[NONFINITE_INPUTS].zero_()
    return {name: int(count) for (name, _), count in zip(layers, counts.tolist()) if count}


def check_finite_weights(model: nn.Module, step: int) -> None:
    """Raise naming the first trained parameter that holds a NaN or inf after optimizer step ``step`` (one host read):
    the Trainer would go on, its logged loss filtered to a number, with every weight lost."""
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad and p.is_floating_point()]
    if not trained or bool(torch.stack(torch._foreach_norm([p.detach() for _, p in trained])).isfinite().all()):
        return
    name = next(name for name, p in trained if not bool(p.detach().isfinite().all()))
    raise FloatingPointError(f"hf_cpt: after optimizer step {step} the trained parameter {name!r} holds NaN or inf: "
                             "the loss or its gradients were not finite (the Trainer's logged loss hides it). Stop, "
                             "lower the learning rate or clip gradients, and resume from the last checkpoint.")
