"""A rotated input's per-token codes in one pass (hf_cpt/numerics/rotated_codes.py, rotation_kernels.c): the range,
scale, codes and values of rotating, then quantizing step by step, bit for bit, and a layer that trains the same
with it as without it."""

import pytest
import torch
from torch import nn

from hf_cpt import CPTConfig, quantize_model, set_precision
from hf_cpt.nn import products
from hf_cpt.numerics import native
from hf_cpt.numerics.fake_quant import fake_quantize_compact, token_range
from hf_cpt.numerics.rotated_codes import rotated_token_codes
from hf_cpt.numerics.rotation import get_rotation


@pytest.fixture(autouse=True)
def _native_kernel():
    from hf_cpt.numerics import rotated_codes

    if rotated_codes._library() is None:
        pytest.skip("no C compiler on this machine")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN where the other is NaN."""
    return a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _step_by_step(x, rotation, bits):
    rotated = rotation.apply(x)
    x_range = token_range(rotated)
    values, compact = fake_quantize_compact(rotated, *x_range, bits)
    return x_range, values, compact


# Paley 12 x 32 (ViT-S), Paley 12 x 64 (BERT-base), Paley 12 x 128, Sylvester 512, dense 9 x 64
@pytest.mark.parametrize("features", [384, 768, 1536, 512, 576])
@pytest.mark.parametrize("bits", [3, 8])
def test_one_pass_gives_the_step_by_step_ranges_codes_and_values(features, bits, monkeypatch):
    """Outlier-heavy tokens, a constant token (the degenerate range: the smallest scale, no NaN) and a token holding
    a NaN (NaN range, as torch's amin / amax give): the same tensors bit for bit, at 1 and 2 threads, with values or
    codes alone."""
    rotation, b = get_rotation(features), torch.tensor(float(bits))
    x = torch.randn(3, 40, features) * torch.logspace(-3, 2, features)
    x[0, 0] = 0.25
    x[1, 3, 7] = float("nan")
    (low, high), values, (codes, scale, minimum) = _step_by_step(x, rotation, b)
    assert torch.isfinite(scale[0, 0]) and scale[0, 0] > 0 and scale[1, 3].isnan()
    for threads in ("1", "2"):
        monkeypatch.setenv(native.THREADS_VARIABLE, threads)
        (one_low, one_high), (one_values, (one_codes, one_scale, one_minimum)) = rotated_token_codes(
            x, -1, rotation, b, values=True)
        for ours, theirs in ((one_low, low), (one_high, high), (one_scale, scale), (one_minimum, minimum),
                             (one_values, values), (one_codes, codes)):
            assert _same(ours, theirs)
        _, (no_values, (codes_alone, _, _)) = rotated_token_codes(x, 2, rotation, b, values=False)
        assert no_values is None and torch.equal(codes_alone, codes)


def test_calls_the_kernel_does_not_serve_say_so():
    """Another axis, bf16, a gradient asked of the input, a small tensor, a Sylvester part under 16 (96 = 12 x 8):
    None, and the caller goes step by step."""
    rotation, bits = get_rotation(768), torch.tensor(8.0)
    x = torch.randn(64, 768)
    assert rotated_token_codes(x, -1, rotation, bits, values=True) is not None
    assert rotated_token_codes(x.t().contiguous(), 0, rotation, bits, values=True) is None
    assert rotated_token_codes(x.bfloat16(), -1, rotation.to("cpu", torch.bfloat16), bits, values=True) is None
    assert rotated_token_codes(x.requires_grad_(), -1, rotation, bits, values=True) is None
    assert rotated_token_codes(torch.randn(4, 768), -1, rotation, bits, values=True) is None
    assert rotated_token_codes(torch.randn(512, 96), -1, get_rotation(96), bits, values=True) is None


@pytest.mark.parametrize("integer_matmul", [False, True])
def test_a_rotated_layer_trains_the_same_with_the_one_pass(integer_matmul, monkeypatch):
    """A rotated per-token Linear at ViT-S's width, float products and products on codes: the forward's output and
    every gradient are the same bit for bit whether its input's codes come from the one pass or step by step."""
    served = []

    def one_pass_or_none(one_pass: bool):
        fused = products.rotated_token_codes

        def call(*args, **kwargs):
            result = fused(*args, **kwargs) if one_pass else None
            served.append(result is not None)
            return result
        return call

    def run(one_pass: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(384, 384), nn.GELU(), nn.Linear(384, 384))
        quantize_model(model, CPTConfig(quant_scheme="rotated-per-token", integer_matmul=integer_matmul))
        set_precision(model, 5, 8)
        model.train()
        x = torch.randn(4, 100, 384, requires_grad=True)
        with monkeypatch.context() as patch:
            patch.setattr(products, "rotated_token_codes", one_pass_or_none(one_pass))
            output = model(x * 1.0)  # an activation, not a leaf: layers share its quantized copy
            output.square().mean().backward()
        return [output.detach(), x.grad, *(p.grad for p in model.parameters())]

    one_pass, step_by_step = run(True), run(False)
    assert served == [True, True, False, False]  # both layers took the one pass, then none in the second run
    assert all(torch.equal(a, b) for a, b in zip(one_pass, step_by_step))
