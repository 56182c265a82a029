"""Rotation (hf_cpt.rotation) and the activation schemes of the layers, against independent references."""

import copy
import math

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from hf_cpt import CPTConfig, quantize_model, set_precision
from hf_cpt.numerics import native
from hf_cpt.numerics import rotation as rotation_module
from hf_cpt.numerics.rotation import factor_sizes, get_rotation, paley_hadamard, sylvester_hadamard

SIZES = [8, 12, 32, 100, 384, 768, 1536, 3072, 7]


def reference_quantize(x, minimum, maximum, bits):
    scale = torch.clamp((maximum - minimum) / (2**bits - 1), min=1e-8)
    return scale * torch.round(torch.clamp((x - minimum) / scale, 0, 2**bits - 1)) + minimum


@pytest.mark.parametrize("order", [4, 8, 12, 20, 24, 32, 44, 48])
def test_hadamard_constructions(order):
    matrix = paley_hadamard(order) if order & (order - 1) else sylvester_hadamard(order)
    assert set(matrix.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(matrix @ matrix.T, order * torch.eye(order, dtype=matrix.dtype))


def kronecker_reference(rotation):
    """``diag(s) (F_1 ⊗ F_2 ⊗ ...)`` built densely, independently of how `Rotation.apply` orders its products."""
    dense = torch.ones(1, 1, dtype=rotation.signs.dtype)
    for factor in rotation.factors:
        dense = torch.kron(dense, factor.contiguous())
    return rotation.signs[:, None] * dense


@pytest.mark.parametrize("features", SIZES)
def test_rotation_is_orthogonal_and_matches_its_dense_matrix(features):
    rotation = get_rotation(features, dtype=torch.float64)
    dense = rotation.matrix()
    assert torch.allclose(dense, kronecker_reference(rotation), atol=1e-12)
    assert torch.allclose(dense @ dense.T, torch.eye(features, dtype=torch.float64), atol=1e-12)
    x = torch.randn(3, 5, features, dtype=torch.float64)
    assert torch.allclose(rotation.apply(x), x @ dense, atol=1e-12)
    assert torch.allclose(rotation.apply(x, transpose=True), x @ dense.T, atol=1e-12)
    assert torch.allclose(rotation.apply(rotation.apply(x), transpose=True), x, atol=1e-12)
    # along another dimension: each column vector is rotated
    y = torch.randn(features, 4, dtype=torch.float64)
    assert torch.allclose(rotation.apply(y, dim=0), dense.T @ y, atol=1e-12)


@pytest.mark.parametrize("features", [384, 768, 3072, 100])
def test_rotation_gradient_is_the_transposed_rotation(features):
    rotation = get_rotation(features, dtype=torch.float64)
    dense = kronecker_reference(rotation)
    x = torch.randn(6, features, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(6, features, dtype=torch.float64)
    for transpose, matrix in ((False, dense), (True, dense.T)):
        (grad,) = torch.autograd.grad(rotation.apply(x, transpose=transpose), x, upstream)
        assert torch.allclose(grad, upstream @ matrix.T, atol=1e-12)
    # along dim 0 (a Conv1D weight's input features), in float32 with a bf16 upstream gradient (autocast)
    y = torch.randn(features, 5, requires_grad=True)
    rotation32 = get_rotation(features)
    (grad,) = torch.autograd.grad(rotation32.apply(y, dim=0), y, torch.ones(features, 5, dtype=torch.bfloat16))
    expected = dense.float() @ torch.ones(features, 5)
    assert grad.dtype == torch.float32 and torch.allclose(grad, expected, atol=0.05, rtol=0.02)


def test_a_rotation_in_another_dtype_is_made_once_and_equals_the_direct_conversion():
    """bf16 activations under autocast ask for the rotation in bf16 at every product: one copy, kept (`derived`)."""
    rotation = get_rotation(384)
    assert rotation.to("cpu", torch.float32) is rotation
    half = rotation.to("cpu", torch.bfloat16)
    assert rotation.to(torch.device("cpu"), torch.bfloat16) is half and half is not rotation
    assert torch.equal(half.signs, rotation.signs.bfloat16())
    assert all(torch.equal(a, b.bfloat16()) for a, b in zip(half.factors, rotation.factors))
    x = torch.randn(4, 384, dtype=torch.bfloat16)
    assert torch.allclose(half.apply(x).float(), rotation.apply(x.float()), atol=0.05, rtol=0.02)


def test_rotation_spreads_an_outlier_and_is_deterministic():
    rotation = get_rotation(384, seed=3)
    spike = torch.zeros(384)
    spike[17] = 100.0
    rotated = rotation.apply(spike)
    assert torch.allclose(rotated.abs(), torch.full((384,), 100.0 / 384**0.5), atol=1e-4)  # a full Hadamard
    assert [kind for kind, _ in factor_sizes(384)] == ["paley", "sylvester"]  # 12 x 32, not a dense factor
    rotation_module._float64_rotation.cache_clear()  # rebuilt from (features, seed) alone, as after a reload
    again = get_rotation(384, seed=3)
    assert torch.equal(again.matrix(), rotation.matrix())
    assert not torch.equal(get_rotation(384, seed=4).matrix(), rotation.matrix())


def _layers():
    return [
        (lambda: nn.Linear(384, 7), lambda: torch.randn(2, 5, 384), "linear"),
        (lambda: nn.Linear(100, 6), lambda: torch.randn(4, 100), "linear"),
        (lambda: Conv1D(7, 1536), lambda: torch.randn(2, 3, 1536), "conv1d"),
        (lambda: nn.Conv2d(12, 5, 3, padding=1), lambda: torch.randn(2, 12, 6, 6), "conv2d"),
    ]


def _reference_forward(layer, x, bits, granularity, rotated=None):
    """Independent reference: explicit min/max, plain float layers; ``rotated``: the rotated (x, w), if any."""
    w = layer.weight.detach().double()
    x = x.double()
    quantize = reference_quantize
    if rotated is not None:  # float32, quantized in float32 as the layer does, then compared in float64
        x, w = rotated

        def quantize(t, lo, hi, bits):
            return reference_quantize(t, lo, hi, bits).double()
    if isinstance(layer, Conv1D):
        lo = x.amin(-1, keepdim=True) if granularity == "token" else x.min()
        hi = x.amax(-1, keepdim=True) if granularity == "token" else x.max()
        qx = quantize(x, lo, hi, bits)
        qw = quantize(w, w.amin(0, keepdim=True), w.amax(0, keepdim=True), bits)
        return qx @ qw + layer.bias.double()
    if isinstance(layer, nn.Conv2d):
        lo = x.amin(1, keepdim=True) if granularity == "token" else x.min()
        hi = x.amax(1, keepdim=True) if granularity == "token" else x.max()
        qx = quantize(x, lo, hi, bits)
        flat = w.reshape(w.shape[0], -1)
        qw = quantize(w, flat.min(1).values.view(-1, 1, 1, 1), flat.max(1).values.view(-1, 1, 1, 1), bits)
        return nn.functional.conv2d(qx, qw, layer.bias.double(), padding=1)
    lo = x.amin(-1, keepdim=True) if granularity == "token" else x.min()
    hi = x.amax(-1, keepdim=True) if granularity == "token" else x.max()
    qx = quantize(x, lo, hi, bits)
    qw = quantize(w, w.amin(1, keepdim=True), w.amax(1, keepdim=True), bits)
    return qx @ qw.T + layer.bias.double()


@pytest.mark.parametrize("scheme", ["per-token", "rotated", "rotated-per-token"])
@pytest.mark.parametrize("make_layer, make_input, kind", _layers())
@pytest.mark.parametrize("bits", [3, 4, 8])
def test_schemes_match_an_independent_reference(scheme, make_layer, make_input, kind, bits):
    torch.manual_seed(0)
    model = nn.Sequential(make_layer())
    quantize_model(model, CPTConfig(quant_scheme=scheme))
    layer = model[0]
    assert layer.cpt_granularity == ("token" if "per-token" in scheme else "tensor")
    assert (layer.rotation is not None) == scheme.startswith("rotated")
    x = make_input()
    rotated = None
    if layer.rotation is not None:
        # The rotation against a dense float64 matrix built independently (float tolerance) ...
        r = get_rotation(layer.rotation.features, dtype=torch.float64).matrix()
        w = layer.weight.detach().double()
        if isinstance(layer, Conv1D):
            dense_x, dense_w = x.double() @ r, r.T @ w
        elif isinstance(layer, nn.Conv2d):
            dense_x, dense_w = (torch.einsum("nchw,cd->ndhw", x.double(), r),
                                torch.einsum("ochw,cd->odhw", w, r))
        else:
            dense_x, dense_w = x.double() @ r, w @ r
        ours_x = layer.rotation.apply(x, layer.input_feature_dim)
        ours_w = layer.rotate_weight(layer.weight.detach())
        for ours, dense in ((ours_x, dense_x), (ours_w, dense_w)):
            assert (ours.double() - dense).abs().max() <= 1e-5 * dense.abs().max()
        # ... then the quantization of those float32 rotated tensors in float32, exactly (a float64 rotation or
        # quantization could move a value across a rounding boundary: float rounding, not a property of the scheme).
        rotated = (ours_x, ours_w)
    set_precision(model, bits, None)
    got = model(x).double()
    expected = _reference_forward(layer, x, bits, layer.cpt_granularity, rotated)
    scale = expected.abs().max()
    assert ((got - expected).abs() <= 1e-5 * scale).all()
    # eval mode: per-token and rotated layers quantize the same way (per-token needs no running range); training's
    # product may run on the integer codes (integer_matmul), which rounds differently from eval's float product
    if "per-token" in scheme:
        model.eval()
        set_precision(model, bits, None)
        from hf_cpt import set_eval_precision

        set_eval_precision(model, bits)
        assert ((model(x).double() - got).abs() <= 1e-5 * scale).all()


@pytest.mark.parametrize("make_layer, make_input, kind", _layers())
def test_rotation_is_exact_at_full_precision(make_layer, make_input, kind):
    torch.manual_seed(0)
    layer = make_layer()
    x = make_input()
    reference = layer(x)
    model = nn.Sequential(copy.deepcopy(layer))
    quantize_model(model, CPTConfig(quant_scheme="rotated"))
    rotated = model[0]
    # bits None: the original layer, bit for bit (no rotation applied)
    assert torch.equal(model(x), reference)
    # the rotated product x R (W R)^T equals x W^T within float tolerance
    xr = rotated.rotation.apply(x, rotated.input_feature_dim)
    wr = rotated.rotate_weight(rotated.weight)
    assert torch.allclose(rotated.compute(xr, wr), reference, atol=1e-4, rtol=1e-4)
    assert torch.allclose(rotated.rotate_weight(wr, inverse=True), rotated.weight, atol=1e-5)


def test_constant_rows_do_not_produce_nan():
    model = nn.Sequential(nn.Linear(32, 4))
    quantize_model(model, CPTConfig(quant_scheme="rotated-per-token"))
    set_precision(model, 3, 8)
    x = torch.zeros(3, 32, requires_grad=True)
    out = model(x)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()


def test_grouped_conv_is_not_rotated_and_the_report_says_why():
    model = nn.Sequential(nn.Conv2d(8, 8, 3, groups=8), nn.Linear(6, 3))
    report = quantize_model(model, CPTConfig(quant_scheme="rotated-per-token"))
    assert model[0].rotation is None and "groups=8" in report.not_rotated["0"]
    assert report.schemes == {"0": "per-token", "1": "rotated-per-token"}
    assert "not rotated 0" in str(report)


def test_auto_scheme_rotates_transformer_layers_and_keeps_the_paper_scheme_for_convolutions():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(16, 8), nn.Linear(8, 2))
    report = quantize_model(model, CPTConfig(exclude_modules=["3"]))
    assert report.schemes == {"0": "paper", "2": "rotated-per-token"}


def test_rotation_has_data_under_a_meta_device_context():
    """transformers builds models under ``torch.device("meta")`` before loading weights (the fresh-process
    load failed there with 'Cannot copy out of meta tensor')."""
    rotation_module._float64_rotation.cache_clear()  # nothing built before: the context applies to every factory
    with torch.device("meta"):
        rotation = get_rotation(384, seed=3)
        layer = nn.Linear(384, 8)
    assert rotation.signs.device.type == "cpu" and all(f.device.type == "cpu" for f in rotation.factors)
    assert torch.equal(rotation.matrix(), get_rotation(384, seed=3).matrix())
    with pytest.raises(ValueError, match="not 'meta'"):
        get_rotation(384, seed=3, device="meta")

    from hf_cpt.nn.base import rotation_buffers
    from hf_cpt.nn.layers import convert_layer
    from hf_cpt.nn.precision import PrecisionState

    convert_layer(layer, PrecisionState(), "token", rotation_seed=3)  # a meta layer: placeholders to be loaded
    shapes = {name: tuple(layer.get_buffer(name).shape) for name in layer.rotation_buffer_names()}
    assert shapes == rotation_buffers(384) == {"rotation_signs": (384,), "rotation_factor_0": (12, 12),
                                               "rotation_factor_1": (32, 32)}
    assert layer.rotation_signs.device.type == "meta"


@pytest.mark.parametrize("features", [768, 1536, 3072])  # Sylvester parts of 64, 128 and 256
def test_a_resplit_rotation_is_the_same_matrix_and_compiles_into_one_graph(features):
    import torch._dynamo

    rotation = get_rotation(features, dtype=torch.float64)
    # step sizes, innermost first: (along the last axis, along another); 768 keeps its merged 64-block last
    expected = {768: ([64, 12], [8, 8, 12]), 1536: ([16, 8, 12], [16, 8, 12]), 3072: ([16, 16, 12], [16, 16, 12])}
    for last_axis, sizes in zip((True, False), expected[features]):
        steps = rotation_module._axis_steps(rotation.factors, rotation.kinds, False, last_axis)
        assert [step.shape[0] for step in steps] == sizes
    x = torch.randn(4, features, dtype=torch.float64)
    dense = kronecker_reference(rotation)
    assert torch.allclose(rotation.apply(x), x @ dense, atol=1e-12)
    assert torch.allclose(rotation.apply(x.T.contiguous(), dim=0), dense.T @ x.T, atol=1e-12)  # a Conv1D weight
    torch._dynamo.reset()
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    rotation32 = get_rotation(features)
    x32 = torch.randn(4, features)
    compiled = torch.compile(lambda t: rotation32.apply(t, transpose=True), backend=counting_backend)
    assert torch.equal(compiled(x32), rotation32.apply(x32, transpose=True)) and len(graphs) == 1


def _native_served(x, rotation, transpose=False):
    return rotation_module._rotate_native(x, transpose, rotation.signs, rotation.factors, rotation.kinds)


# Paley 12 x 64, Sylvester 1024, dense 9 x 64, Paley 12 x 256
@pytest.mark.parametrize("features", [768, 1024, 576, 3072])
def test_native_rotation_matches_the_dense_matrix_at_every_thread_count(features, monkeypatch):
    """The C kernel (last axis, float32 CPU): within float32 rounding of ``x R`` and ``x R^T`` in float64, and the
    same values bit for bit at 1, 2 and 3 threads."""
    if rotation_module._native_library() is None:
        pytest.skip("no C compiler on this machine")
    rotation = get_rotation(features)
    dense = kronecker_reference(get_rotation(features, dtype=torch.float64))
    x = torch.randn(2, 300, features) * torch.logspace(-3, 2, features)  # an outlier-heavy spread of magnitudes
    for transpose, matrix in ((False, dense), (True, dense.T)):
        results = []
        for count in (1, 2, 3):
            monkeypatch.setenv(native.THREADS_VARIABLE, str(count))
            results.append(_native_served(x, rotation, transpose))
        assert results[0] is not None and all(torch.equal(r, results[0]) for r in results)
        expected = x.double() @ matrix
        error = (results[0].double() - expected).abs().max() / expected.abs().max()
        assert error < 1e-6
        assert torch.equal(rotation.apply(x, transpose=transpose), results[0])  # what the layers call


def _kernel_order_reference(x, rotation, transpose):
    """``x R`` (``x R^T``) in float32 with the C kernel's operations in its order: the signs (first, or last for the
    transpose), butterflies of distance 1, 2, 4, ... as (a + b, a - b), then each output block of the leading factor
    as 0 + c * t for each input block in turn, times 1 / sqrt(P)."""
    lead = None if rotation.kinds[0] == "sylvester" else rotation.factors[0]
    n = 1 if lead is None else lead.shape[0]
    rows, power = x.numel() // rotation.features, rotation.features // n
    t = (x if transpose else x * rotation.signs).reshape(rows, n, power)
    distance = 1
    while distance < power:
        pairs = t.reshape(rows, n, power // (2 * distance), 2, distance)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        t = torch.stack((a + b, a - b), -2).reshape(rows, n, power)
        distance *= 2
    norm = torch.tensor(1 / math.sqrt(power), dtype=torch.float32)
    if lead is not None:
        coefficients = lead.t() if transpose else lead  # [in, out]
        outputs = []
        for out in range(n):
            total = torch.zeros(rows, power)
            for block in range(n):
                total = total + coefficients[block, out] * t[:, block]
            outputs.append(total)
        t = torch.stack(outputs, 1)
    y = (t * norm).reshape(x.shape)
    return y * rotation.signs if transpose else y


# Paley 12 x 32, Paley 12 x 256, Sylvester 512, dense 7 x 16 (a leading factor not a multiple of four)
@pytest.mark.parametrize("features", [384, 3072, 512, 112])
def test_native_rotation_makes_the_values_of_its_operations_in_order(features):
    """The C kernel's values bit for bit, whatever vector width the CPU gives it (docs/method.md §3, "Rotation")."""
    if rotation_module._native_library() is None:
        pytest.skip("no C compiler on this machine")
    rotation = get_rotation(features)
    x = torch.randn(max(64, (1 << 15) // features + 1), features)
    for transpose in (False, True):
        assert torch.equal(_native_served(x, rotation, transpose), _kernel_order_reference(x, rotation, transpose))


# Paley 12 x 64, Sylvester 1024, dense 9 x 64, Paley 12 x 256; 100 columns: three whole blocks and a part
@pytest.mark.parametrize("features", [768, 1024, 576, 3072])
def test_native_rotation_of_a_matrix_first_axis_is_the_row_kernel_on_its_transpose(features, monkeypatch):
    """A GPT-2 Conv1D's weight, (input features, outputs), rotates over its first axis: the C kernel rotates its
    columns a block at a time with the row kernel's operations in its order, so each column is bit for bit the row
    kernel's rotation of that column, at every thread count, and within float32 rounding of ``R^T W``."""
    if rotation_module._native_library() is None:
        pytest.skip("no C compiler on this machine")
    rotation = get_rotation(features)
    dense = kronecker_reference(get_rotation(features, dtype=torch.float64))
    weight = torch.randn(features, 100) * torch.logspace(-3, 2, features)[:, None]
    for transpose in (False, True):
        rows = _native_served(weight.t().contiguous(), rotation, transpose).t()
        for count in (1, 2, 3):
            monkeypatch.setenv(native.THREADS_VARIABLE, str(count))
            columns = rotation_module._rotate_native(weight, transpose, rotation.signs, rotation.factors,
                                                     rotation.kinds, dim=0)
            assert columns is not None and torch.equal(columns, rows)
        assert torch.equal(rotation.apply(weight, 0, transpose=transpose), rows)  # what the layers call
        expected = (dense if transpose else dense.T) @ weight.double()
        assert ((rows.double() - expected).abs().max() / expected.abs().max()) < 1e-6


def test_calls_the_native_rotation_does_not_serve_keep_the_products():
    """bf16, a transposed view, a Sylvester part under 16 (96 = 12 x 8) and a small tensor take the factor-by-factor
    products; so does a rotation along a middle axis, still the same matrix."""
    rotation = get_rotation(768)
    big = torch.randn(64, 768)
    assert _native_served(big.bfloat16(), rotation.to(torch.device("cpu"), torch.bfloat16)) is None
    assert _native_served(torch.randn(768, 64).t(), rotation) is None
    assert _native_served(torch.randn(4, 768), rotation) is None
    small = get_rotation(96)
    assert _native_served(torch.randn(1024, 96), small) is None
    middle = torch.randn(2, 768, 64)
    assert rotation_module.native_layout(middle.transpose(0, 1).contiguous(), rotation.signs, rotation.factors,
                                         rotation.kinds, dim=0) is None  # a first axis of a matrix only
    dense = kronecker_reference(get_rotation(768, dtype=torch.float64))
    assert torch.allclose(rotation.apply(middle, dim=1).double(), dense.T @ middle.double(), atol=1e-5)


@pytest.mark.parametrize("features,dim", [(768, -1), (1024, -1), (768, 0), (96, -1), (768, 1)])
@pytest.mark.parametrize("transpose", [False, True])
def test_a_rotation_in_place_equals_the_fresh_one(features, dim, transpose):
    """``in_place``: where the C kernel serves (the last axis or a matrix's first, 32K values or more) the result is
    written over the input, bit for bit the fresh rotation's, with a leading factor (768 = 12 x 64) or without (1024);
    elsewhere (a middle axis, 96 features) a new tensor, the input untouched; a tensor that needs its gradient is
    refused."""
    rotation = get_rotation(features)
    shape = {-1: (300, features), 0: (features, 512), 1: (2, features, 256)}[dim]
    x = torch.randn(*shape) * torch.logspace(-3, 2, shape[-1])
    expected, owned = rotation.apply(x, dim, transpose), x.clone()
    result = rotation.apply(owned, dim, transpose, in_place=True)
    assert torch.equal(result, expected)
    native_served = dim in (-1, 0) and features != 96 and rotation_module._native_library() is not None
    assert (result.data_ptr() == owned.data_ptr()) == native_served
    assert torch.equal(owned, expected if native_served else x)
    with pytest.raises(ValueError, match="x.detach"):
        rotation.apply(x.requires_grad_(), dim, transpose, in_place=True)


def test_a_stand_in_forms_no_values_and_has_the_rotation_gradient():
    """`Rotation.stand_in`: the shape and dtype of ``x R`` over one NaN element (a read by mistake shows), with the
    gradient `apply` gives, bit for bit; without a gradient to track, the same kind of tensor, no graph."""
    rotation = get_rotation(384)
    x = torch.randn(3, 7, 384)
    tracked, reference = x.clone().requires_grad_(), x.clone().requires_grad_()
    stand_in = rotation.stand_in(tracked)
    assert stand_in.shape == x.shape and stand_in.dtype == x.dtype
    assert stand_in.untyped_storage().nbytes() == x.element_size() and torch.isnan(stand_in).all()
    grad = torch.randn(3, 7, 384)
    stand_in.backward(grad)
    rotation.apply(reference).backward(grad)
    assert torch.equal(tracked.grad, reference.grad)
    untracked = rotation.stand_in(x)
    assert untracked.grad_fn is None and untracked.untyped_storage().nbytes() == x.element_size()
    with pytest.raises(ValueError, match="384 features"):
        rotation.stand_in(torch.randn(3, 100))
