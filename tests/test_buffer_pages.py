"""The reused buffers' pages go back once a pass's quantized backwards are done (hf_cpt/nn/buffer_pages.py)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from hf_cpt import CPTConfig, quantize_model, set_precision
from hf_cpt.numerics import scratch


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_DONTNEED reads back zeros on Linux")
def test_the_buffers_go_back_after_the_last_quantized_backward_learnt_from_the_pass_before(monkeypatch):
    """First pass: at its end (no guess yet). From the second on: as soon as the layer that ran last in the pass
    before is done, before the full-precision layer in front of the quantized ones gets its gradient (an LM's
    embeddings), and again at the pass's end. Handed-back buffers read as zeros: their pages are gone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, padding=1))
    quantize_model(model, CPTConfig(exclude_modules=["0"]))
    assert type(model[0]) is nn.Conv2d and type(model[1]) is not nn.Conv2d
    set_precision(model, 6, 8)
    events = []
    later = scratch.hand_back_later

    def recording(role=None, keep_bytes=0):
        hand_back = later(role, keep_bytes)
        return lambda: events.append(("handed back", role, keep_bytes)) or hand_back()

    def full_precision_backward(grad):
        buffers = scratch._local.__dict__.get("buffers", {})
        events.append(("full-precision backward", all(not b.any() for b in buffers.values())))

    monkeypatch.setattr(scratch, "hand_back_later", recording)
    scratch.release()
    for _ in range(3):
        first = model[0](torch.randn(4, 3, 32, 32))
        first.register_hook(full_precision_backward)
        model[1:](first).square().sum().backward()
    assert scratch.held_bytes() > 0  # the mappings stay
    back = ("handed back", None, 0)
    assert events == [("full-precision backward", False), back] + [back, ("full-precision backward", True), back] * 2
    scratch.release()


def test_a_pass_without_the_guessed_layer_hands_back_at_its_end(monkeypatch):
    """A pass whose graph lacks the layer that ran last before (here: only the second layer is trained through)
    still hands the buffers back, at its end."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    quantize_model(model, CPTConfig())
    set_precision(model, 6, 8)
    calls = []
    later = scratch.hand_back_later
    monkeypatch.setattr(scratch, "hand_back_later", lambda *a: calls.append(a) or later(*a))
    x = torch.randn(2, 64, 256)
    model(x.requires_grad_()).sum().backward()  # both layers: the first runs last
    calls.clear()
    model[2](model[1](model[0](x)).detach()).sum().backward()  # the first layer is not in this graph
    assert len(calls) == 1  # queued at the pass's start, run at its end; no early hand-back
    scratch.release()
