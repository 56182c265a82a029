"""`hf_cpt.nn.pool_indices`: a max-pool that keeps only its indices, and hands its input to the ReLU before it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hf_cpt import CPTConfig, dequantize_model, quantize_model, set_precision
from hf_cpt.nn.pool_indices import MaxPool2dKeepingIndices
from hf_cpt.nn.relu_masks import kept_output_of

WINDOWS = [  # (kernel_size, stride, padding, dilation, ceil_mode): a ResNet stem's, and odd ones
    (3, 2, 1, 1, False), (2, None, 0, 1, True), (3, 1, 1, 2, False), ((3, 2), (2, 1), (1, 0), 1, True),
]


@pytest.mark.parametrize("window", WINDOWS)
def test_the_gradient_is_max_pool2ds_bit_for_bit_from_the_indices_alone(window):
    """Ties (a ReLU's zeros), overlapping windows, padding, dilation, ceil mode: the same output and input gradient
    as ``F.max_pool2d``'s, while the node keeps no tensor but the indices."""
    kernel, stride, padding, dilation, ceil_mode = window
    torch.manual_seed(0)
    source = torch.randn(2, 5, 13, 11).relu()
    pool = nn.MaxPool2d(kernel, stride, padding, dilation, ceil_mode=ceil_mode)
    ours = copy.deepcopy(pool)
    ours.__class__ = MaxPool2dKeepingIndices
    ours.__dict__["cpt_precision"] = None
    grads = []
    for module in (pool, ours):
        x = source.clone().requires_grad_()
        output = module(x)
        grads.append((output, torch.autograd.grad(output, x, torch.randn(output.shape,
                                                                          generator=torch.Generator().manual_seed(1)),
                                                  retain_graph=True)[0]))
        if module is ours:
            assert output.grad_fn.name() == "_MaxPool2dKeepingIndicesBackward"
            (kept,) = output.grad_fn.saved_tensors
            assert kept.dtype == torch.int64 and kept.shape == output.shape  # the indices, not the input
    (want, want_grad), (got, got_grad) = grads
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)


def _stem() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1),
                         nn.Conv2d(8, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 8 * 8, 4))


def _trained_step(model: nn.Module, x: torch.Tensor) -> tuple[object, dict]:
    """(what the stem's ReLU keeps before the backward, the gradients of one step)."""
    model.zero_grad(set_to_none=True)
    relu_out = []
    hook = model[2].register_forward_hook(lambda m, i, o: relu_out.append(o))
    torch.manual_seed(1)  # the same stochastic rounding of the errors
    loss = model(x).square().sum()
    hook.remove()
    kept = kept_output_of(relu_out[0].grad_fn)
    kept = None if kept is None else (kept.output, kept.zeroed)
    loss.backward()
    return kept, {name: p.grad.clone() for name, p in model.named_parameters()}


def test_a_stems_relu_keeps_a_mask_before_the_pool_and_the_model_trains_bit_for_bit():
    """conv, norm, ReLU, max-pool (a ResNet's stem): with ``relu_masks`` the pool keeps its indices and the ReLU a
    mask, not its float output; the gradients are those of the model without masks, bit for bit; `dequantize_model`
    restores the pool."""
    x = torch.randn(4, 3, 16, 16)
    sides = {}
    for masks in (True, False):
        model = _stem()
        report = quantize_model(model, CPTConfig(quant_scheme="paper", relu_masks=masks))
        set_precision(model, 6, 8)
        sides[masks] = (model, report, *_trained_step(model, x))
    model, report, (output, mask), gradients = sides[True]
    assert report.max_pools == ["3"] and "max-pools that keep only their indices" in str(report)
    assert type(model[3]) is MaxPool2dKeepingIndices and output is None and mask is not None
    plain_model, plain_report, plain_kept, expected = sides[False]
    assert plain_report.max_pools == [] and type(plain_model[3]) is nn.MaxPool2d
    assert plain_kept is None  # without masks the ReLU is autograd's, which keeps its output
    assert gradients.keys() == expected.keys() and all(torch.equal(gradients[k], expected[k]) for k in expected)
    dequantize_model(model)
    assert type(model[3]) is nn.MaxPool2d and "cpt_precision" not in model[3].__dict__


def test_the_pool_runs_as_it_was_where_it_cannot_keep_indices_alone():
    """Channels-last input, no gradients, a 3-D (unbatched) input: ``F.max_pool2d``'s own node or none; a pool that
    returns its indices is not converted."""
    model = _stem()
    model.append(nn.MaxPool2d(2, return_indices=True))
    quantize_model(model, CPTConfig(quant_scheme="paper"))
    pool = model[3]
    assert type(pool) is MaxPool2dKeepingIndices and type(model[-1]) is nn.MaxPool2d
    source = torch.randn(2, 8, 8, 8, requires_grad=True)
    ours = "_MaxPool2dKeepingIndicesBackward"
    assert pool(source.contiguous(memory_format=torch.channels_last)).grad_fn.name() != ours
    assert pool(source[0]).grad_fn.name() != ours
    with torch.no_grad():
        assert pool(source).grad_fn is None
    assert pool(source).grad_fn.name() == ours
