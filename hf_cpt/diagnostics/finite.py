"""Non-finite values in a training run: the inputs a running range skipped, weights that went NaN or inf."""

from __future__ import annotations

import torch
from torch import nn

from ..convert import quant_layers
from ..nn.base import NONFINITE_INPUTS

# Trained parameters this small (biases, norms) are read at every step for NaN or inf; a non-finite loss makes every
# parameter's gradient NaN, so they show it without a pass over the large weights.
WATCHED_NUMEL = 1 << 16


def step_health(model: nn.Module, weights: bool = True) -> tuple[dict[str, int], str | None]:
    """({layer: training forwards whose NaN or inf input its running range skipped} since the last call, the first
    trained parameter holding NaN or inf or None) in one host read; ``weights``: read the small trained parameters too.
    """
    layers = [(name, layer) for name, layer in quant_layers(model)  # per-token layers keep no running range
              if NONFINITE_INPUTS in layer._buffers and layer.cpt_granularity != "token"]
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad and p.is_floating_point()]
    watched = []
    if weights:
        watched = [p.detach() for _, p in trained if p.numel() <= WATCHED_NUMEL] or [p.detach() for _, p in trained]
    if not layers and not watched:
        return {}, None
    device = layers[0][1]._buffers[NONFINITE_INPUTS].device if layers else watched[0].device
    flags = [layer._buffers[NONFINITE_INPUTS].to(device).reshape(1) for _, layer in layers]
    if watched:
        flags.append((~torch.stack(torch._foreach_norm(watched)).isfinite().all()).to(device, torch.int64).reshape(1))
    read = torch.cat(flags).tolist()  # the one host read
    counts = dict(zip((name for name, _ in layers), read[:len(layers)]))
    if any(counts.values()):
        for _, layer in layers:
            layer._buffers[NONFINITE_INPUTS].zero_()
    bad = None
    if watched and read[-1]:
        bad = next((name for name, p in trained if not bool(p.detach().isfinite().all())), None)
    return {name: int(count) for name, count in counts.items() if count}, bad


def nonfinite_inputs(model: nn.Module) -> dict[str, int]:
    """`step_health`'s counts of skipped non-finite inputs alone (and reset)."""
    return step_health(model, weights=False)[0]
