import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from hf_cpt import CPTConfig, quantize_model, set_precision
from hf_cpt.cost import CostMeter, layer_macs
from hf_cpt.numerics.bitops import bitops_per_mac, relative_cost, rotation_bitops_per_value
from hf_cpt.schedules.schedule import PrecisionSchedule


def test_bitops_formula():
    assert bitops_per_mac(8, 8) == 8 * 8 + 8 * 8 + 8 * 8
    assert bitops_per_mac(3, 8) == 9 + 24 + 24
    assert bitops_per_mac(None, None) == 3 * 32 * 32
    assert bitops_per_mac(None, 8) == 32 * 32 + 2 * 8 * 32
    assert relative_cost(None, None) == 1.0


@pytest.mark.parametrize(
    "bits_min, bits_max, grad_bits, published_saving",
    [(3, 8, 8, 0.367), (3, 6, 6, 0.300), (4, 8, 8, 0.301), (4, 6, 6, 0.207), (5, 8, 8, 0.232)],
)
def test_cpt_schedule_reproduces_the_published_savings(bits_min, bits_max, grad_bits, published_saving):
    schedule = PrecisionSchedule("cpt", bits_min, bits_max, total_steps=64000, num_cycles=32)
    spent = sum(bitops_per_mac(schedule(t), grad_bits) for t in range(64000))
    static = 64000 * bitops_per_mac(bits_max, grad_bits)
    assert 1 - spent / static == pytest.approx(published_saving, abs=0.0015)


def test_macs_from_real_shapes():
    linear = nn.Linear(12, 5)
    assert layer_macs(linear, linear(torch.randn(3, 7, 12))) == 3 * 7 * 12 * 5
    conv = nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2)
    out = conv(torch.randn(2, 4, 9, 9))
    assert layer_macs(conv, out) == out.numel() * (4 // 2) * 9
    conv1d = Conv1D(5, 12)
    assert layer_macs(conv1d, conv1d(torch.randn(3, 7, 12))) == 3 * 7 * 12 * 5


def test_meter_prices_quantized_and_fp32_layers_per_step():
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 4))
    quantize_model(model, CPTConfig(exclude_modules=["2"], quant_scheme="paper"))
    meter = CostMeter(model, static_bits=8, static_grad_bits=8, scale=2)
    for batch, bits in ((6, 3), (9, 8)):
        set_precision(model, bits, 8)
        model(torch.randn(batch, 10)).sum().backward()
        meter.end_step(bits, 8)
    with torch.no_grad():
        model(torch.randn(100, 10))  # not training: not counted
    q_macs = [6 * 10 * 20 * 2, 9 * 10 * 20 * 2]
    f_macs = [6 * 20 * 4 * 2, 9 * 20 * 4 * 2]
    totals = meter.totals
    assert totals.bitops == q_macs[0] * bitops_per_mac(3, 8) + q_macs[1] * bitops_per_mac(8, 8) + sum(f_macs) * 3072
    assert totals.static_bitops == sum(q_macs) * bitops_per_mac(8, 8) + sum(f_macs) * 3072
    assert totals.fp32_bitops == (sum(q_macs) + sum(f_macs)) * 3072
    assert totals.steps == 2 and totals.steps_at_bits == {3: 1, 8: 1}
    report = totals.to_dict()
    assert report["cost_vs_static"] < 1 and report["steps_at_bits"] == {"3": 1, "8": 1}
    meter.remove()
    model(torch.randn(2, 10)).sum().backward()
    meter.end_step(8, 8)
    assert meter.totals.steps_at_bits[8] == 2 and meter.totals.fp32_bitops == totals.fp32_bitops


def test_rotation_is_priced_forward_and_backward_and_reported_apart():
    model = nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 4))
    quantize_model(model, CPTConfig(exclude_modules=["2"], quant_scheme="rotated-per-token"))
    rotation = model[0].rotation
    assert rotation is not None and rotation.features == 12
    adds, mults = rotation.operations_per_value
    per_value = rotation_bitops_per_value(rotation)
    assert per_value == 2 * (adds * 32 + mults * 32 * 32) and per_value > 0
    meter = CostMeter(model, static_bits=8, static_grad_bits=8)
    set_precision(model, 4, 8)
    model(torch.randn(6, 12)).sum().backward()
    meter.end_step(4, 8)
    rotated_values = 6 * 12 + 12 * 20  # the input and the weight
    expected_rotation = rotated_values * per_value
    q_macs, f_macs = 6 * 12 * 20, 6 * 20 * 4
    totals = meter.totals
    assert totals.rotation_bitops == expected_rotation
    assert totals.bitops == q_macs * bitops_per_mac(4, 8) + f_macs * 3072 + expected_rotation
    assert totals.static_bitops == q_macs * bitops_per_mac(8, 8) + f_macs * 3072 + expected_rotation
    set_precision(model, None, None)  # a full-precision step rotates nothing
    model(torch.randn(6, 12)).sum().backward()
    meter.end_step(None, None)
    assert meter.totals.rotation_bitops == expected_rotation
    assert totals.to_dict()["rotation_gbitops"] == expected_rotation / 1e9
    # the share of MACs that ran in full precision: the FP32 head, then the whole FP32 step
    share = (f_macs * 2 + q_macs) / (2 * (q_macs + f_macs))
    assert totals.to_dict()["full_precision_mac_share"] == pytest.approx(share)


class _TwoReaders(nn.Module):
    """Two layers reading one input (an attention's query and key) and a third reading another input."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.out = nn.Linear(12, 20), nn.Linear(12, 20), nn.Linear(20, 12)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.q(h) * self.k(h))


def test_an_input_rotated_once_for_sibling_layers_is_priced_once():
    model = _TwoReaders()
    quantize_model(model, CPTConfig(quant_scheme="rotated-per-token"))
    prices = {name: rotation_bitops_per_value(getattr(model, name).rotation) for name in ("q", "out")}
    set_precision(model, 4, 8)
    model(torch.randn(6, 12)).sum()  # shared inputs served before the meter exists are not its concern
    meter = CostMeter(model, static_bits=8, static_grad_bits=8)
    before = model.q.cpt_precision.shared_inputs.reuses
    source = torch.randn(6, 12, requires_grad=True)
    model(source * 1).sum().backward()  # a non-leaf input, as inside a model: q rotates it, k reuses it
    meter.end_step(4, 8)
    assert model.q.cpt_precision.shared_inputs.reuses == before + 1
    expected = (6 * 12 + 2 * 12 * 20) * prices["q"] + (6 * 20 + 20 * 12) * prices["out"]
    assert meter.totals.rotation_bitops == expected


def test_a_product_left_with_the_full_precision_error_is_priced_at_32_bit_errors():
    assert bitops_per_mac(8, 8, "both") == bitops_per_mac(8, 8) == 3 * 64
    assert bitops_per_mac(8, 8, "input") == 64 + 8 * 8 + 32 * 8  # the weight gradient: FP32 error x 8-bit input
    assert bitops_per_mac(4, 8, "weight") == 16 + 32 * 4 + 8 * 4  # the input gradient: FP32 error x 4-bit weight
    assert bitops_per_mac(None, None, "input") == bitops_per_mac(None, None)


def _metered_step(hidden, **errors):
    """A two-layer model (the head in FP32) metered over one step at 4-bit forward, 8-bit errors."""
    model = nn.Sequential(nn.Linear(10, hidden), nn.ReLU(), nn.Linear(hidden, 4))
    quantize_model(model, CPTConfig(exclude_modules=["2"], quant_scheme="paper", **errors))
    meter = CostMeter(model, static_bits=8, static_grad_bits=8)
    set_precision(model, 4, 8)
    model(torch.randn(6, 10)).sum().backward()
    meter.end_step(4, 8)
    return model, meter


@pytest.mark.parametrize("products", ["input", "weight"])
def test_meter_prices_each_product_at_the_bits_it_ran(products):
    _, meter = _metered_step(20, error_products=products)
    q_macs, f_macs = 6 * 10 * 20, 6 * 20 * 4
    expected = {"input": 16 + 8 * 4 + 32 * 4, "weight": 16 + 32 * 4 + 8 * 4}[products]
    assert meter.totals.bitops == q_macs * expected + f_macs * 3072
    assert meter.totals.static_bitops == q_macs * bitops_per_mac(8, 8, products) + f_macs * 3072
