"""Clipped weight ranges (`weight_range="mse"`, docs/method.md §2): each channel's range is the clipped one of
least squared error, by the definition written out here; never worse than min/max; a layer trains on it, and its
exports and checkpoints compute with it (the fresh-process reloads: tests/test_serialization_fresh_process.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from hf_cpt import CPTConfig, CPTTrainer, quantize_model, set_eval_precision, set_precision
from hf_cpt.numerics.fake_quant import (
    CLIP_RATIOS,
    channel_ranges,
    dequantize_codes,
    fake_quantize,
    quantize_codes,
    weight_ranges,
)


def _by_definition(weight: torch.Tensor, bits: int, channel_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel by channel and ratio by ratio, in float32: the first ratio of least squared error."""
    moved = weight.detach().float().movedim(channel_dim, 0).reshape(weight.shape[channel_dim], -1)
    lows, highs = [], []
    for channel in moved:
        low, high = channel.min(), channel.max()
        errors = [float((fake_quantize(channel, low * r, high * r, torch.tensor(float(bits))) - channel).square().sum())
                  for r in CLIP_RATIOS]
        best = CLIP_RATIOS[errors.index(min(errors))]
        lows.append(low * best)
        highs.append(high * best)
    shape = [1] * weight.dim()
    shape[channel_dim] = -1
    return torch.stack(lows).view(shape), torch.stack(highs).view(shape)


def _squared_errors(weight, ranges, bits, channel_dim):
    dims = tuple(d for d in range(weight.dim()) if d != channel_dim)
    source = weight.float()
    return (fake_quantize(source, *ranges, torch.tensor(float(bits))) - source).square().sum(dim=dims)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, channel_dim", [((24, 40), 0), ((24, 40), 1), ((16, 4, 3, 3), 0)])  # Conv1D: 1
@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
def test_the_ranges_are_the_clipped_ones_of_least_squared_error(bits, shape, channel_dim, dtype):
    torch.manual_seed(bits)
    weight = (torch.randn(shape) * 0.05).to(dtype)
    weight.view(-1)[5] *= 12  # an outlier: the channel the clip is for
    got = weight_ranges(weight, torch.tensor(float(bits)), channel_dim, "mse")
    expected = _by_definition(weight, bits, channel_dim)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    minmax = channel_ranges(weight, channel_dim)
    clipped_errors = _squared_errors(weight, got, bits, channel_dim)
    assert (clipped_errors <= _squared_errors(weight, minmax, bits, channel_dim)).all()  # never worse, by channel
    # the same choice from quantize_codes (what exports store) as from the training forward's ranges
    codes, scale, zero_point = quantize_codes(weight, bits, channel_dim, "mse")
    assert torch.equal(zero_point, got[0].flatten())
    if bits <= 4:  # a clip pays where levels are few
        assert (got[1].float() < minmax[1].float()).any()


def test_clipping_cuts_the_4_bit_error_of_gaussian_weights_and_keeps_the_8_bit_range():
    """What docs/method.md says of the option: about a third less squared error at 4 bits, the full range at 8."""
    torch.manual_seed(0)
    weight = torch.randn(384, 1536) * 0.05
    four = _squared_errors(weight, weight_ranges(weight, torch.tensor(4.0), 0, "mse"), 4, 0).sum()
    assert four / _squared_errors(weight, channel_ranges(weight, 0), 4, 0).sum() < 0.75
    eight = weight_ranges(weight, torch.tensor(8.0), 0, "mse")
    assert all(torch.equal(a, b) for a, b in zip(eight, channel_ranges(weight, 0)))


def test_degenerate_channels_keep_their_min_max_and_give_no_nan():
    weight = torch.randn(4, 16)
    weight[0] = 0.0
    weight[1] = 0.7
    for bits in (2, 4, 8):
        low, high = weight_ranges(weight, torch.tensor(float(bits)), 0, "mse")
        assert torch.equal(low[:2], weight[:2, :1]) and torch.equal(high[:2], weight[:2, :1])
        assert torch.isfinite(fake_quantize(weight, low, high, torch.tensor(float(bits)))).all()
    one_dimensional = torch.randn(8)  # each value its own channel: nothing to clip
    assert torch.equal(weight_ranges(one_dimensional, torch.tensor(4.0), 0, "mse")[0], one_dimensional)


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_a_layer_trains_and_evaluates_on_the_clipped_weight(kind):
    """The training forward computes with the clipped weight (within float rounding of its definition), which
    differs from the min/max one; eval at fixed bits and the layer's own codes agree with it."""
    torch.manual_seed(0)
    x = torch.randn(2, 10, 32)

    def output(weight_range: str, training: bool) -> tuple[torch.Tensor, nn.Module]:
        torch.manual_seed(1)
        layer = nn.Linear(32, 16) if kind == "linear" else Conv1D(16, 32)
        with torch.no_grad():
            layer.weight.view(-1)[7] *= 10  # an outlier in one channel
        quantize_model(layer, CPTConfig(quant_scheme="per-token", weight_range=weight_range))
        set_precision(layer, 4, 8)
        layer.train(training)
        if not training:
            set_eval_precision(layer, 4)
        return layer(x), layer

    clipped, layer = output("mse", training=True)
    dim = layer.weight_channel_dim
    weight = fake_quantize(layer.weight.detach(), *_by_definition(layer.weight, 4, dim), torch.tensor(4.0))
    quantized_x = fake_quantize(x, x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), torch.tensor(4.0))
    expected = quantized_x @ (weight.t() if kind == "linear" else weight) + layer.bias
    assert torch.allclose(clipped, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(output("minmax", training=True)[0], expected, rtol=1e-3, atol=1e-3)
    evaluated, layer = output("mse", training=False)
    assert torch.allclose(evaluated, expected, rtol=1e-5, atol=1e-5)
    stored = dequantize_codes(*layer.weight_codes(4), layer.weight.shape, dim)
    assert torch.equal(stored, layer.quantized_weight(4, rotated=True)) and torch.equal(stored, weight)


def test_a_model_quantized_with_another_weight_range_is_refused_by_the_trainer(tmp_path):
    from transformers import TrainingArguments

    model = nn.Sequential(nn.Linear(8, 8))
    quantize_model(model, CPTConfig(weight_range="mse"))
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match="weight_range"):
        CPTTrainer(model=model, args=args, cpt_config=CPTConfig())
