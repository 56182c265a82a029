"""The backward products on int8 grids (`input_gradient_product` / `weight_gradient_product`, docs/method.md §2): each
layer's gradients equal the options' definitions (hf_cpt.numerics.backward_products) on the layer's own operands,
for a Linear, GPT-2's Conv1D and a rotated Linear; the cost meter prices them at what they ran; the default is the
CPT paper's float products, untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from hf_cpt import CPTConfig, quantize_model, set_precision
from hf_cpt.cost import CostMeter
from hf_cpt.numerics import backward_products, error_kernels
from hf_cpt.numerics.bitops import bitops_per_mac
from hf_cpt.numerics.fake_quant import fake_quantize, token_range

BITS, ERROR_BITS = 4, 8
SEED = torch.tensor(1234, dtype=torch.int32)


def _gradients(layer: nn.Module, x: torch.Tensor, error: torch.Tensor, monkeypatch, **options):
    """(input gradient, weight gradient) of ``layer`` quantized at 4/8 bits, fed ``x``, for an output error."""
    monkeypatch.setattr(error_kernels, "noise_seed", lambda device: SEED.to(device))
    quantize_model(layer, CPTConfig(quant_scheme=options.pop("scheme", "per-token"), **options))
    set_precision(layer, BITS, ERROR_BITS)
    layer.train()
    x = x.clone().requires_grad_()
    layer(x).backward(error)
    return x.grad, layer.weight.grad


def _expected(weight_out_in: torch.Tensor, x: torch.Tensor, error: torch.Tensor):
    """The options' definitions on the forward's operands: the per-token error codes times the weight re-quantized per
    input channel; the error and input in blocks of tokens."""
    rows = error.reshape(-1, error.shape[-1])
    codes, scale, minimum = backward_products.error_codes(rows, torch.tensor(8.0), True, SEED)
    weight = fake_quantize(weight_out_in, weight_out_in.amin(1, keepdim=True), weight_out_in.amax(1, keepdim=True),
                           torch.tensor(float(BITS)))
    requantized = fake_quantize(weight, weight.amin(0, keepdim=True), weight.amax(0, keepdim=True), torch.tensor(8.0))
    input_gradient = (codes.float() * scale + minimum) @ requantized
    quantized_x = fake_quantize(x, *token_range(x), torch.tensor(float(BITS))).reshape(-1, x.shape[-1])
    weight_gradient = backward_products.weight_gradient(rows, quantized_x, torch.tensor(8.0), SEED)
    return input_gradient.view(*x.shape[:-1], -1), weight_gradient


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_int8_gradients_equal_the_options_definitions_on_the_layers_operands(kind, monkeypatch):
    torch.manual_seed(0)
    x, error = torch.randn(3, 100, 48), torch.randn(3, 100, 24) * 1e-2  # 300 tokens: a short last block of 128

    def layer() -> nn.Module:
        torch.manual_seed(1)
        return nn.Linear(48, 24) if kind == "linear" else Conv1D(24, 48)

    int8 = _gradients(layer(), x, error, monkeypatch, input_gradient_product="int8", weight_gradient_product="int8")
    plain = _gradients(layer(), x, error, monkeypatch)
    weight = layer().weight.detach()
    input_gradient, weight_gradient = _expected(weight if kind == "linear" else weight.t(), x, error)
    weight_gradient = weight_gradient if kind == "linear" else weight_gradient.t()
    assert _relative(int8[0], input_gradient) < 1e-5 and _relative(int8[1], weight_gradient) < 1e-5
    # the float products (the CPT paper's) are other numbers: the options change what is computed
    assert _relative(plain[0], input_gradient) > 1e-3 and _relative(plain[1], weight_gradient) > 1e-3


def test_a_rotated_layer_takes_its_int8_weight_gradient_on_the_rotated_operands_and_rotates_it_back(monkeypatch):
    torch.manual_seed(0)
    x, error = torch.randn(2, 70, 64), torch.randn(2, 70, 32) * 1e-2
    torch.manual_seed(1)
    layer = nn.Linear(64, 32)
    _, weight_gradient = _gradients(layer, x, error, monkeypatch, scheme="rotated-per-token",
                                    weight_gradient_product="int8")
    rotation = layer.rotation
    rotated_x = rotation.apply(x, -1)
    quantized = fake_quantize(rotated_x, *token_range(rotated_x), torch.tensor(float(BITS))).reshape(-1, 64)
    expected = backward_products.weight_gradient(error.reshape(-1, 32), quantized, torch.tensor(8.0), SEED)
    assert _relative(weight_gradient, rotation.apply(expected, 1, transpose=True)) < 1e-5


def test_the_error_codes_rebuild_the_fused_error_kernels_values():
    from hf_cpt.numerics.error_kernels import hashed_stochastic_quantize
    from hf_cpt.numerics.fake_quant import num_levels

    grad = torch.randn(50, 30) * 1e-3
    grad[3] = 0.0  # an all-zero row: its codes rebuild zeros, no NaN
    for bits in (3, 8):
        b = torch.tensor(float(bits))
        codes, scale, minimum = backward_products.error_codes(grad, b, True, SEED)
        assert torch.equal(codes.float() * scale + minimum, hashed_stochastic_quantize(grad, num_levels(b), SEED,
                                                                                       True, False))
        assert torch.equal(codes[3].float() * scale[3] + minimum[3], torch.zeros(30))


def test_token_blocks_have_one_scale_per_block_and_channel_and_round_stochastically_without_bias():
    torch.manual_seed(0)
    x = torch.randn(256, 4)
    x[:128, 0] *= 100.0  # a large first block of channel 0 does not coarsen its second block
    blocks = backward_products.token_blocks(x, torch.tensor(8.0))
    step = (blocks - x).abs()
    assert step[128:, 0].max() <= x[128:, 0].abs().max() / 127 / 2 + 1e-7
    assert step[:128, 0].max() > 10 * step[128:, 0].max()
    draws = torch.stack([backward_products.token_blocks(x, torch.tensor(3.0), torch.tensor(s, dtype=torch.int32))
                         for s in range(400)])
    nearest = backward_products.token_blocks(x, torch.tensor(3.0))
    assert (draws.mean(0) - x).abs().mean() < 0.2 * (nearest - x).abs().mean()  # unbiased on average


def test_the_cost_meter_prices_int8_products_at_their_8_bit_operands():
    assert bitops_per_mac(4, 8, "both", (True, True)) == 16 + 8 * 8 + 8 * 8
    assert bitops_per_mac(4, 8, "both", (True, False)) == 16 + 8 * 8 + 8 * 4
    assert bitops_per_mac(8, 8, "both", (True, True)) == bitops_per_mac(8, 8)
    assert bitops_per_mac(None, None, "both", (True, True)) == bitops_per_mac(None, None)
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 4))
    quantize_model(model, CPTConfig(exclude_modules=["2"], quant_scheme="paper", weight_gradient_product="int8"))
    meter = CostMeter(model, static_bits=8, static_grad_bits=8)
    set_precision(model, 4, 8)
    model(torch.randn(6, 10)).sum().backward()
    meter.end_step(4, 8)
    assert meter.totals.bitops == 6 * 10 * 20 * (16 + 8 * 4 + 8 * 8) + 6 * 20 * 4 * 3072


def test_the_options_are_checked_and_saved_with_the_config():
    config = CPTConfig(input_gradient_product="int8")
    assert config.errors.input_product == "int8" and config.errors.weight_product == "float"
    assert CPTConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="weight_gradient_product"):
        CPTConfig(weight_gradient_product="bf16")


def test_a_saved_model_trains_further_with_the_int8_products_it_trained_with(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    from hf_cpt import find_precision_state, save_quantized

    model = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                     intermediate_size=64, vocab_size=50))
    quantize_model(model, CPTConfig(weight_gradient_product="int8"))
    save_quantized(model, tmp_path, 8, model_card=False)
    loaded = BertForSequenceClassification.from_pretrained(tmp_path)
    errors = find_precision_state(loaded).errors
    assert (errors.input_product, errors.weight_product) == ("float", "int8")
