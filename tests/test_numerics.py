import pytest
import torch

from hf_cpt.numerics.error_kernels import quantize_error_hashed
from hf_cpt.numerics.errors import ErrorQuantization, quantize_error, quantize_error_eager
from hf_cpt.numerics.fake_quant import channel_ranges, fake_quantize, quantize_ste, quantize_weight


def reference_quantize(x, minimum, maximum, bits):
    """docs/method.md §2, written literally."""
    scale = torch.clamp((maximum - minimum) / (2**bits - 1), min=1e-8)
    return scale * torch.round(torch.clamp((x - minimum) / scale, 0, 2**bits - 1)) + minimum


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16])
def test_per_tensor_quantization_is_bit_exact(bits):
    torch.manual_seed(bits)
    x = torch.randn(64, 33) * 3 + 0.7
    minimum, maximum = x.min(), x.max()
    got = fake_quantize(x, minimum, maximum, torch.tensor(float(bits)))
    assert torch.equal(got, reference_quantize(x, minimum, maximum, bits))


@pytest.mark.parametrize("shape, channel_dim", [((48, 20), 0), ((8, 4, 3, 3), 0), ((20, 48), 1)])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_per_channel_weight_quantization_is_bit_exact(shape, channel_dim, bits):
    torch.manual_seed(0)
    weight = torch.randn(shape)
    got = quantize_weight(weight, torch.tensor(float(bits)), channel_dim)
    moved = weight.movedim(channel_dim, 0).reshape(weight.shape[channel_dim], -1)
    for c in range(weight.shape[channel_dim]):
        row = weight.select(channel_dim, c)
        expected = reference_quantize(row, moved[c].min(), moved[c].max(), bits)
        assert torch.equal(got.select(channel_dim, c), expected)
        assert got.select(channel_dim, c).unique().numel() <= 2**bits


def test_ranges_are_per_output_channel():
    weight = torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.25, -0.75]])
    minimum, maximum = channel_ranges(weight, 0)
    assert minimum.flatten().tolist() == [-2.0, -0.75] and maximum.flatten().tolist() == [3.0, 0.5]
    minimum, maximum = channel_ranges(weight, 1)
    assert minimum.shape == (1, 3) and maximum.flatten().tolist() == [1.0, 0.25, 3.0]


def test_round_half_to_even_on_exact_ties():
    # range [0, 3] at 2 bits: scale 1, so 0.5 -> 0, 1.5 -> 2, 2.5 -> 2
    x = torch.tensor([0.0, 0.5, 1.5, 2.5, 3.0])
    got = fake_quantize(x, torch.tensor(0.0), torch.tensor(3.0), torch.tensor(2.0))
    assert got.tolist() == [0.0, 0.0, 2.0, 2.0, 3.0]


def test_straight_through_gradient():
    x = torch.randn(10, 7, requires_grad=True)
    upstream = torch.randn(10, 7)
    quantize_ste(x, x.min().detach(), x.max().detach(), torch.tensor(3.0)).backward(upstream)
    assert torch.equal(x.grad, upstream)


def test_degenerate_range_gives_no_nan():
    constant = torch.full((4, 5), 1.25)
    out = fake_quantize(constant, constant.min(), constant.max(), torch.tensor(4.0))
    assert torch.equal(out, constant)
    zeros = torch.zeros(300, 300)
    for fused in (False, True):
        assert torch.equal(quantize_error(zeros, torch.tensor(8.0), ErrorQuantization(), fused=fused), zeros)
    assert quantize_error(torch.zeros(0), torch.tensor(8.0)).numel() == 0


def _biased_probe(value: float, n: int) -> torch.Tensor:
    """A tensor whose range is exactly [0, 1], filled with `value` elsewhere."""
    x = torch.full((n,), value)
    x[0], x[1] = 0.0, 1.0
    return x


@pytest.mark.parametrize("quantize", ["eager", "hashed"])
def test_stochastic_error_rounding_is_unbiased(quantize):
    torch.manual_seed(0)
    bits = torch.tensor(2.0)  # grid {0, 1/3, 2/3, 1}: 0.3 is far from every level
    n = 400_000
    for value in (0.3, 0.55, 0.9):
        x = _biased_probe(value, n)
        if quantize == "eager":
            q = quantize_error_eager(x, bits)
        else:
            q = quantize_error_hashed(x, bits, torch.tensor(1234, dtype=torch.int32))
        levels = torch.tensor([0.0, 1 / 3, 2 / 3, 1.0])
        assert torch.isclose(q[2:, None], levels[None], atol=1e-6).any(dim=1).all()  # on the grid
        standard_error = (1 / 3) * 0.5 / n**0.5
        assert abs(q[2:].mean().item() - value) < 5 * standard_error


@pytest.mark.slow
def test_fused_error_quantizer_is_unbiased_and_on_grid():
    torch.manual_seed(0)
    x = _biased_probe(0.3, 1 << 18)
    q = quantize_error(x, torch.tensor(2.0), ErrorQuantization(), fused=True)
    assert q.shape == x.shape and q.dtype == x.dtype
    assert abs(q[2:].mean().item() - 0.3) < 5 * (1 / 6) / (1 << 18) ** 0.5
    assert torch.isclose(q[2:, None], torch.tensor([0.0, 1 / 3, 2 / 3, 1.0])[None], atol=1e-6).any(1).all()
    second = quantize_error(x, torch.tensor(2.0), ErrorQuantization(), fused=True)
    assert not torch.equal(q, second)  # fresh noise each call


@pytest.mark.slow
@pytest.mark.parametrize("granularity", ["token", "tensor"])
def test_fused_zero_centred_quantizer_keeps_zeros_and_is_unbiased(granularity):
    from hf_cpt.numerics import error_kernels

    torch.manual_seed(0)
    grad = torch.zeros(1024, 256)
    grad[:, :8] = torch.rand(1024, 8)  # a sparse row: 8 values in [0, 1), the rest exactly zero
    grad[:, 0] = 1.0
    scheme = ErrorQuantization(granularity, range="symmetric")
    draws = torch.stack([quantize_error(grad, torch.tensor(3.0), scheme) for _ in range(64)])
    assert error_kernels.kernel_name(granularity, "symmetric") in error_kernels._native_kernels  # the fused path ran
    assert torch.equal(draws[:, :, 8:], torch.zeros_like(draws[:, :, 8:]))
    assert torch.isclose(draws[..., None], torch.tensor([-1.0, -2 / 3, -1 / 3, 0.0, 1 / 3, 2 / 3, 1.0]),
                         atol=1e-6).any(-1).all()  # the 3-bit zero-centred grid, step 1 / 3
    assert abs(float(draws[:, :, 1:8].mean() - grad[:, 1:8].mean())) < 5 * (1 / 6) / (64 * 1024 * 7) ** 0.5


def test_half_precision_inputs_are_quantized_in_float32():
    x = torch.randn(32, 16).to(torch.bfloat16)
    out = fake_quantize(x, x.min(), x.max(), torch.tensor(8.0))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    g = quantize_error_eager(x, torch.tensor(8.0))
    assert g.dtype == torch.bfloat16 and torch.isfinite(g.float()).all()


# ----------------------------------------------------------------------------- per-row (per-token) errors


def reference_per_row(grad, bits, stochastic_noise=None):
    """One range per row (last dimension), docs/method.md §3, written literally row by row in float32."""
    source = grad.float()
    rows = source.reshape(-1, source.shape[-1])
    noise = None if stochastic_noise is None else stochastic_noise.reshape(rows.shape)
    out = torch.empty_like(rows)
    levels = 2**bits - 1
    for i, row in enumerate(rows):
        low, high = row.min(), row.max()
        scale = torch.clamp((high - low) / levels, min=1e-8)
        shifted = (row - low) / scale + (0 if noise is None else noise[i])
        out[i] = torch.round(torch.clamp(shifted, 0, levels)) * scale + low
    return out.reshape(source.shape).to(grad.dtype)


def _error_with_padding(dtype):
    torch.manual_seed(0)
    grad = torch.randn(3, 7, 16) * torch.logspace(-4, 0, 7).view(1, 7, 1)  # magnitudes over 4 decades
    grad[:, 5:] = 0.0  # padding tokens: zero rows
    grad[1] = 0.0  # a whole sequence the loss never reached
    return grad.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [3, 4, 5, 6, 7, 8])
def test_per_row_error_with_nearest_rounding_matches_the_reference(bits, dtype):
    grad = _error_with_padding(dtype)
    got = quantize_error(grad, torch.tensor(float(bits)), ErrorQuantization("token", "nearest"))
    assert got.dtype == dtype and torch.isfinite(got.float()).all()
    assert torch.equal(got, reference_per_row(grad, bits))
    assert torch.equal(got[:, 5:], torch.zeros_like(got[:, 5:])) and torch.equal(got[1], torch.zeros_like(got[1]))
    # small tokens keep their own grid: every row has levels, where one range per tensor leaves them at a step
    per_tensor = quantize_error(grad, torch.tensor(float(bits)), ErrorQuantization("tensor", "nearest"))
    small = grad[0, 0].float()
    assert float((got[0, 0].float() - small).abs().max()) < float((per_tensor[0, 0].float() - small).abs().max())


@pytest.mark.parametrize("bits", [3, 8])
def test_per_row_stochastic_rounding_is_the_reference_with_its_noise_and_unbiased(bits):
    grad = _error_with_padding(torch.float32)
    noise = torch.empty(grad.shape).uniform_(-0.5, 0.5)
    torch.manual_seed(7)
    got = quantize_error(grad, torch.tensor(float(bits)), ErrorQuantization("token"))
    torch.manual_seed(7)
    expected = reference_per_row(grad, bits, torch.empty(grad.shape).uniform_(-0.5, 0.5))
    assert torch.equal(got, expected) and not torch.equal(got, reference_per_row(grad, bits, noise))
    per_row = ErrorQuantization("token")
    draws = torch.stack([quantize_error(grad, torch.tensor(float(bits)), per_row) for _ in range(4000)])
    mean = draws.mean(0)
    step = (grad.amax(-1, keepdim=True) - grad.amin(-1, keepdim=True)) / (2**bits - 1)
    # unbiased: the mean of 4000 draws lies within 5 standard errors (step / 2 / sqrt(4000)) of the error
    assert bool(((mean - grad).abs() <= 5 * step / 2 / 4000**0.5 + 1e-12).all())
    assert torch.equal(draws[:, :, 5:], torch.zeros_like(draws[:, :, 5:]))  # zero rows stay exactly zero


# ----------------------------------------------------------------------------- the zero-centred error grid


def reference_symmetric(grad, bits, per_row, noise=None):
    """The zero-centred grid, docs/method.md §2, written literally range by range in float32: step
    max|e| / (2^(b-1) - 1), codes clamped to +-(2^(b-1) - 1)."""
    source = grad.float()
    groups = source.reshape(-1, source.shape[-1]) if per_row else source.reshape(1, -1)
    noise = None if noise is None else noise.reshape(groups.shape)
    half = 2 ** (bits - 1) - 1
    out = torch.empty_like(groups)
    for i, group in enumerate(groups):
        scale = torch.clamp(group.abs().max() / half, min=1e-8)
        scaled = group / scale + (0 if noise is None else noise[i])
        out[i] = torch.clamp(torch.round(scaled), -half, half) * scale
    return out.reshape(source.shape).to(grad.dtype)


def _sparse_error(dtype):
    """An attention score error's shape: a few large values per row, the rest zero or tiny, padding rows zero."""
    grad = _error_with_padding(torch.float32)
    grad[..., 4:] *= 1e-4
    grad[..., 10:] = 0.0
    return grad.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("granularity", ["token", "tensor"])
def test_zero_centred_errors_with_nearest_rounding_match_the_reference_and_keep_zeros(bits, dtype, granularity):
    grad = _sparse_error(dtype)
    got = quantize_error(grad, torch.tensor(float(bits)), ErrorQuantization(granularity, "nearest", range="symmetric"))
    assert got.dtype == dtype and torch.isfinite(got.float()).all()
    assert torch.equal(got, reference_symmetric(grad, bits, granularity == "token"))
    zeros = grad == 0
    assert bool(zeros.any()) and torch.equal(got[zeros], torch.zeros_like(got[zeros]))
    groups = got.float().reshape(-1, grad.shape[-1]) if granularity == "token" else got.float().reshape(1, -1)
    assert max(group.unique().numel() for group in groups) <= 2**bits - 1  # a signed b-bit code per range
    # the min/max grid puts the zeros of a nonzero row between two levels: nearest rounding moves them all
    minmax = quantize_error(grad, torch.tensor(float(bits)), ErrorQuantization(granularity, "nearest"))
    assert bool((minmax[zeros & (grad.abs().sum(-1, keepdim=True) > 0)] != 0).any())


@pytest.mark.parametrize("bits", [3, 8])
@pytest.mark.parametrize("granularity", ["token", "tensor"])
def test_zero_centred_stochastic_rounding_is_the_reference_with_its_noise_unbiased_and_less_noisy(bits, granularity):
    grad = _sparse_error(torch.float32)
    scheme = ErrorQuantization(granularity, range="symmetric")
    torch.manual_seed(7)
    got = quantize_error(grad, torch.tensor(float(bits)), scheme)
    torch.manual_seed(7)
    expected = reference_symmetric(grad, bits, granularity == "token", torch.empty(grad.shape).uniform_(-0.5, 0.5))
    assert torch.equal(got, expected)
    draws = torch.stack([quantize_error(grad, torch.tensor(float(bits)), scheme) for _ in range(4000)])
    magnitude = grad.abs().amax(-1, keepdim=True) if granularity == "token" else grad.abs().amax()
    step = magnitude / (2 ** (bits - 1) - 1)
    assert bool(((draws.mean(0) - grad).abs() <= 5 * step / 2 / 4000**0.5 + 1e-12).all())  # unbiased
    assert torch.equal(draws[:, grad == 0], torch.zeros_like(draws[:, grad == 0]))  # zeros stay exactly zero
    # the point of the grid: on a sparse error its noise is far below the min/max grid's
    minmax = ErrorQuantization(granularity)
    minmax_noise = torch.stack([quantize_error(grad, torch.tensor(float(bits)), minmax) - grad for _ in range(200)])
    assert float((draws[:200] - grad).pow(2).mean()) < 0.5 * float(minmax_noise.pow(2).mean())


def test_zero_centred_grid_at_one_bit_stays_finite_and_is_refused_by_the_config():
    from hf_cpt import CPTConfig

    got = quantize_error(torch.randn(8, 16), torch.tensor(1.0), ErrorQuantization("token", range="symmetric"))
    assert torch.isfinite(got).all()
    with pytest.raises(ValueError, match=r"CPTConfig.error_range .*needs at least 2 bits \(grad_bits is 1\)"):
        CPTConfig(grad_bits=1, quantize_attention=True)
    with pytest.raises(ValueError, match=r"CPTConfig.error_range .*\(grad_bits_min is 1\)"):
        CPTConfig(error_range="symmetric", grad_schedule="cpt", grad_bits_min=1)
    assert CPTConfig(grad_bits=1).error_range == "auto"  # no attention: every error on the min/max grid


def test_auto_error_grid_is_zero_centred_for_the_attention_products_only():
    auto = ErrorQuantization("auto", range="auto")
    assert auto.for_activations("token").range == "minmax" and auto.for_activations("tensor").range == "minmax"
    attention = auto.for_attention()
    assert (attention.range, attention.products) == ("symmetric", "both")
    assert ErrorQuantization(range="minmax", products="input").for_attention().range == "minmax"
    with pytest.raises(ValueError, match="resolve 'auto'"):
        quantize_error(torch.randn(4, 4), torch.tensor(8.0), ErrorQuantization("token", range="auto"))


def test_layer_backward_uses_the_per_row_error_for_both_products():
    from hf_cpt import CPTConfig, quantize_model, set_precision

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(16, 8))
    quantize_model(layer, CPTConfig(include_modules=["0"], quant_scheme="paper", error_granularity="token",
                                    error_rounding="nearest"))
    set_precision(layer, 8, 6)
    layer.train()
    x = torch.randn(4, 5, 16, requires_grad=True)
    error = torch.randn(4, 5, 8) * torch.logspace(-3, 0, 5).view(1, 5, 1)
    layer(x).backward(error)
    quantized_error = reference_per_row(error, 6)
    weight = quantize_weight(layer[0].weight.detach(), torch.tensor(8.0))
    torch.testing.assert_close(x.grad, quantized_error @ weight, rtol=1e-5, atol=1e-7)
    x_q = fake_quantize(x.detach(), x.min(), x.max(), torch.tensor(8.0))
    expected_weight_grad = quantized_error.reshape(-1, 8).t() @ x_q.reshape(-1, 16)
    torch.testing.assert_close(layer[0].weight.grad, expected_weight_grad, rtol=1e-5, atol=1e-6)


def test_auto_error_ranges_follow_each_layers_activations():
    """error_granularity='auto' (the default): per row in a per-token layer, per tensor in a Conv2d (whose
    activations the auto scheme quantizes per tensor)."""
    from hf_cpt import CPTConfig, quantize_model, set_precision

    torch.manual_seed(0)
    linear = torch.nn.Sequential(torch.nn.Linear(16, 8))
    quantize_model(linear, CPTConfig(include_modules=["0"], quant_scheme="per-token", error_rounding="nearest"))
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1))
    quantize_model(conv, CPTConfig(include_modules=["0"], error_rounding="nearest"))
    for model in (linear, conv):
        set_precision(model, 8, 6)
        model.train()

    x = torch.randn(4, 5, 16, requires_grad=True)
    error = torch.randn(4, 5, 8) * torch.logspace(-3, 0, 5).view(1, 5, 1)
    linear(x).backward(error)
    weight = quantize_weight(linear[0].weight.detach(), torch.tensor(8.0))
    torch.testing.assert_close(x.grad, reference_per_row(error, 6) @ weight, rtol=1e-5, atol=1e-7)

    image = torch.randn(2, 3, 6, 6, requires_grad=True)
    error = torch.randn(2, 4, 6, 6) * torch.logspace(-3, 0, 6).view(1, 1, 6, 1)
    conv(image).backward(error)
    per_tensor = reference_quantize(error, error.min(), error.max(), 6)
    weight = quantize_weight(conv[0].weight.detach(), torch.tensor(8.0))
    expected = torch.nn.grad.conv2d_input(image.shape, weight, per_tensor, padding=1)
    torch.testing.assert_close(image.grad, expected, rtol=1e-5, atol=1e-6)


def test_quantizing_with_unresolved_auto_ranges_is_refused():
    with pytest.raises(ValueError, match="resolve 'auto' with ErrorQuantization.for_activations"):
        quantize_error(torch.randn(4, 4), torch.tensor(8.0), ErrorQuantization("auto"))


def test_error_settings_are_validated_with_the_field_named():
    from hf_cpt import CPTConfig

    with pytest.raises(ValueError, match="CPTConfig.error_granularity must be one of"):
        CPTConfig(error_granularity="channel")
    with pytest.raises(ValueError, match="CPTConfig.error_rounding must be one of"):
        CPTConfig(error_rounding="floor")


def test_new_error_settings_are_validated_with_the_field_named():
    from hf_cpt import CPTConfig

    with pytest.raises(ValueError, match="CPTConfig.error_products must be one of"):
        CPTConfig(error_products="bias")
    with pytest.raises(ValueError, match="CPTConfig.error_rotation was removed; only 'none'"):
        CPTConfig(error_rotation="tokens")
    assert CPTConfig(error_rotation="none") == CPTConfig()  # what an old config holds, and what every run does
    with pytest.raises(ValueError, match="CPTConfig.error_range must be one of"):
        CPTConfig(error_range="absmax")


# ----------------------------------------------------------------------------- which products take the quantized error


def _paper_layer(kind):
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    if kind == "linear":
        return torch.nn.Linear(16, 8), torch.randn(4, 5, 16), (4, 5, 8)
    if kind == "conv1d":
        return Conv1D(8, 16), torch.randn(4, 5, 16), (4, 5, 8)
    if kind == "conv2d":
        return torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.randn(2, 3, 9, 9), (2, 8, 5, 5)
    return torch.nn.Conv2d(3, 8, 3, padding=1, padding_mode="reflect"), torch.randn(2, 3, 9, 9), (2, 8, 9, 9)


def _plain_forward(kind, x, weight, bias):
    import torch.nn.functional as F

    if kind == "linear":
        return F.linear(x, weight, bias)
    if kind == "conv1d":
        return x @ weight + bias
    if kind == "conv2d":
        return F.conv2d(x, weight, bias, stride=2, padding=1)
    return F.conv2d(F.pad(x, (1, 1, 1, 1), mode="reflect"), weight, bias)


@pytest.mark.parametrize("products", ["input", "weight", "both"])
@pytest.mark.parametrize("kind", ["linear", "conv1d", "conv2d", "conv2d-reflect"])
def test_each_backward_product_takes_the_error_it_was_given(kind, products):
    """Input gradient from Q(e) or e, weight and bias gradients from Q(e) or e, against plain autograd."""
    from hf_cpt import CPTConfig, quantize_model, set_precision

    layer, x, out_shape = _paper_layer(kind)
    model = torch.nn.Sequential(layer)
    quantize_model(model, CPTConfig(include_modules=["0"], quant_scheme="paper", error_granularity="token",
                                    error_rounding="nearest", error_products=products))
    set_precision(model, 8, 4)
    model.train()
    x = x.requires_grad_()
    feature_dim = 1 if kind.startswith("conv2d") else -1
    error = torch.randn(out_shape) * torch.logspace(-3, 0, out_shape[-1]).view(*([1] * (len(out_shape) - 1)), -1)
    model(x).backward(error)

    quantized = reference_per_row(error.movedim(feature_dim, -1), 4).movedim(-1, feature_dim)
    input_error = quantized if products in ("input", "both") else error
    weight_error = quantized if products in ("weight", "both") else error
    x_q = fake_quantize(x.detach(), x.min(), x.max(), torch.tensor(8.0)).requires_grad_()
    w_q = quantize_weight(layer.weight.detach(), torch.tensor(8.0), layer.weight_channel_dim).requires_grad_()
    bias = layer.bias.detach().clone().requires_grad_()
    (grad_x,) = torch.autograd.grad(_plain_forward(kind, x_q, w_q, bias), x_q, input_error)
    grad_w, grad_b = torch.autograd.grad(_plain_forward(kind, x_q, w_q, bias), (w_q, bias), weight_error)
    torch.testing.assert_close(x.grad, grad_x, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.weight.grad, grad_w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.bias.grad, grad_b, rtol=1e-5, atol=1e-5)
    if products != "both":  # the two errors really differ, so the check above could fail
        assert not torch.allclose(input_error, weight_error)


def test_split_products_under_bf16_autocast_give_full_precision_gradients():
    from hf_cpt import CPTConfig, quantize_model, set_precision

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8))
    quantize_model(model, CPTConfig(include_modules=["0"], error_granularity="token", error_products="input"))
    set_precision(model, 8, 8)
    model.train()
    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    out.float().pow(2).sum().backward()
    assert out.dtype == torch.bfloat16
    assert x.grad.dtype == torch.float32 and model[0].weight.grad.dtype == torch.float32
    assert model[0].bias.grad.dtype == torch.float32 and torch.isfinite(model[0].weight.grad).all()


@pytest.mark.slow
def test_fused_per_row_error_quantizer_is_unbiased_on_each_rows_grid():
    torch.manual_seed(0)
    grad = torch.randn(64, 32, 48) * torch.logspace(-4, 0, 32).view(1, 32, 1)  # 98,304 values: the fused path
    grad[:, 30:] = 0.0
    scheme = ErrorQuantization("token")
    q = quantize_error(grad, torch.tensor(3.0), scheme)
    low, high = grad.amin(-1, keepdim=True), grad.amax(-1, keepdim=True)
    step = ((high - low) / 7).clamp_min(1e-8)
    codes = (q - low) / step
    assert torch.allclose(codes, codes.round(), atol=1e-3) and codes.min() >= -1e-3 and codes.max() <= 7 + 1e-3
    assert torch.equal(q[:, 30:], torch.zeros_like(q[:, 30:]))
    draws = torch.stack([quantize_error(grad, torch.tensor(3.0), scheme) for _ in range(200)])
    assert not torch.equal(draws[0], draws[1])
    assert bool(((draws.mean(0) - grad).abs() <= 5 * step / 2 / 200**0.5 + 1e-9).all())


