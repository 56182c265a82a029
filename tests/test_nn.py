import copy
import io

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.pytorch_utils import Conv1D

from hf_cpt import CPTConfig, find_precision_state, quantize_model, set_eval_precision, set_precision
from hf_cpt.nn.layers import QuantConv1D, QuantConv2d, QuantLinear
from hf_cpt.numerics.errors import quantize_error_eager

# The CPT paper's scheme (per-tensor running ranges, no rotation): bit-exact to the published quantizer.
PAPER = CPTConfig(quant_scheme="paper")


def reference_quantize(x, minimum, maximum, bits):
    scale = torch.clamp((maximum - minimum) / (2**bits - 1), min=1e-8)
    return scale * torch.round(torch.clamp((x - minimum) / scale, 0, 2**bits - 1)) + minimum


def per_channel_reference(weight, bits, channel_dim=0):
    moved = weight.movedim(channel_dim, 0)
    flat = moved.reshape(moved.shape[0], -1)
    shape = [-1] + [1] * (moved.dim() - 1)
    minimum, maximum = flat.min(1).values.view(shape), flat.max(1).values.view(shape)
    return reference_quantize(moved, minimum, maximum, bits).movedim(0, channel_dim)


LAYERS = [
    (lambda: nn.Linear(12, 7), lambda: torch.randn(5, 3, 12), QuantLinear),
    (lambda: nn.Conv2d(3, 6, 3, padding=1), lambda: torch.randn(4, 3, 8, 8), QuantConv2d),
    (lambda: Conv1D(7, 12), lambda: torch.randn(5, 3, 12), QuantConv1D),
]


def _wrap(layer: nn.Module) -> nn.Sequential:
    return nn.Sequential(layer)


@pytest.mark.parametrize("make_layer, make_input, quant_class", LAYERS)
def test_bits_none_is_exactly_the_original_layer(make_layer, make_input, quant_class):
    torch.manual_seed(0)
    original = _wrap(make_layer())
    quantized = copy.deepcopy(original)
    quantize_model(quantized, CPTConfig())
    assert isinstance(quantized[0], quant_class)
    set_precision(quantized, None, None)
    x = make_input()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = original(xa), quantized(xb)
    upstream = torch.randn_like(ya)
    ya.backward(upstream)
    yb.backward(upstream)
    assert torch.equal(ya, yb)
    assert torch.equal(xa.grad, xb.grad)
    for pa, pb in zip(original.parameters(), quantized.parameters()):
        assert torch.equal(pa.grad, pb.grad)


@pytest.mark.parametrize("make_layer, make_input, quant_class", LAYERS)
def test_forward_uses_quantized_input_and_weight(make_layer, make_input, quant_class):
    torch.manual_seed(1)
    model = _wrap(make_layer())
    reference_layer = copy.deepcopy(model[0])
    # the float product, bit for bit (the product on integer codes: tests/test_integer_matmul.py)
    quantize_model(model, CPTConfig(quant_scheme="paper", integer_matmul=False))
    set_precision(model, 4, None)
    x = make_input()
    got = model(x)
    qx = reference_quantize(x, x.min(), x.max(), 4)
    with torch.no_grad():
        reference_layer.weight.copy_(per_channel_reference(reference_layer.weight, 4, model[0].weight_channel_dim))
    assert torch.equal(got, reference_layer(qx))


def test_backward_quantizes_the_error_once_and_uses_it_for_both_gradients():
    torch.manual_seed(2)
    model = _wrap(nn.Linear(16, 8, bias=False))
    quantize_model(model, CPTConfig(quant_scheme="paper", fused_error_quantizer=False))
    set_precision(model, 5, 4)
    x = torch.randn(6, 16, requires_grad=True)
    upstream = torch.randn(6, 8)
    torch.manual_seed(123)
    model(x).backward(upstream)
    torch.manual_seed(123)
    q_error = quantize_error_eager(upstream, torch.tensor(4.0))
    qx = reference_quantize(x.detach(), x.min(), x.max(), 5)
    qw = per_channel_reference(model[0].weight.detach(), 5)
    assert q_error.unique().numel() <= 16
    torch.testing.assert_close(x.grad, q_error @ qw, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model[0].weight.grad, q_error.T @ qx, rtol=1e-6, atol=1e-6)


def test_activation_ema_and_eval_mode_range():
    torch.manual_seed(3)
    model = _wrap(nn.Linear(4, 3))
    quantize_model(model, PAPER)
    layer = model[0]
    set_precision(model, 8, 8)
    set_eval_precision(model, 6)
    batches = [torch.randn(10, 4) * (i + 1) for i in range(3)]
    expected_min, expected_max = torch.tensor(0.0), torch.tensor(0.0)
    for batch in batches:
        model(batch).sum().backward()
        expected_min = expected_min * 0.9 + batch.min() * 0.1
        expected_max = expected_max * 0.9 + batch.max() * 0.1
    torch.testing.assert_close(layer.act_min, expected_min)
    torch.testing.assert_close(layer.act_max, expected_max)
    model.eval()
    x = torch.randn(5, 4) * 3
    with torch.no_grad():
        got = model(x)
        qx = reference_quantize(x, layer.act_min, layer.act_max, 6)
        qw = per_channel_reference(layer.weight, 6)
        assert torch.equal(got, nn.functional.linear(qx, qw, layer.bias))
    before = layer.act_min.clone()
    model(torch.randn(5, 4) * 100)
    assert torch.equal(layer.act_min, before)  # eval never updates the running range


def test_eval_without_a_tracked_range_uses_the_batch_range():
    """An FP32-trained (or just converted) model evaluated at low bits must not collapse to one value."""
    torch.manual_seed(4)
    model = _wrap(nn.Conv2d(3, 8, 3))
    quantize_model(model, PAPER)
    layer = model[0]
    model.train()
    set_precision(model, None, None)  # an FP32 run: the range is never tracked
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    assert float(layer.act_min) == float(layer.act_max) == 0.0
    model.eval()
    set_eval_precision(model, 8)
    x = torch.randn(4, 3, 8, 8) * 2
    with torch.no_grad():
        got = model(x)
        qx = reference_quantize(x, x.min(), x.max(), 8)
        expected = nn.functional.conv2d(qx, per_channel_reference(layer.weight, 8), layer.bias)
        assert torch.equal(got, expected)
        full = nn.functional.conv2d(x, layer.weight, layer.bias)
        assert float((got - full).abs().max() / full.abs().max()) < 0.02


def test_first_batch_ema_init_option():
    model = _wrap(nn.Linear(4, 3))
    quantize_model(model, CPTConfig(quant_scheme="paper", activation_ema_init="first_batch"))
    set_precision(model, 8, None)
    x = torch.randn(10, 4)
    model(x)
    assert model[0].act_min == x.min() and model[0].act_max == x.max()


def test_bits_live_in_one_shared_state():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 2))
    quantize_model(model, CPTConfig(include_modules=["3"]))
    states = {id(layer.cpt_precision) for layer in model if isinstance(layer, QuantLinear)}
    assert len(states) == 1
    set_precision(model, 5, 8)
    assert model[0].cpt_precision.current == (5, 8)
    assert model[2].cpt_precision.bits is model[0].cpt_precision.bits


def test_bits_reach_another_device_once_per_change_of_value():
    """On an accelerator the layers read a per-device copy of the bit-width, refreshed in place when the CPU source
    changes (not one blocking copy per product); on the CPU they read the source itself. (The meta device stands in
    for a GPU here; tests/test_cuda.py checks the values on a real one.)"""
    from hf_cpt.nn import PrecisionState

    state, meta = PrecisionState(), torch.device("meta")
    state.set(6, 8)
    assert state.on_device(state.bits, torch.device("cpu")) is state.bits and state.on_device(None, meta) is None
    copy_ = state.on_device(state.bits, meta)
    assert copy_.device == meta and state.on_device(state.bits, meta) is copy_
    version = copy_._version
    assert state.on_device(state.bits, meta)._version == version  # unchanged source: no new copy
    state.set(5, 8)
    assert state.on_device(state.bits, meta) is copy_ and copy_._version > version  # refreshed in place
    assert state.on_device(state.grad_bits, meta) is not copy_
    with torch.inference_mode():  # an evaluation reads the eval bits' copy first; training then updates it in place
        assert not state.on_device(state.eval_bits, meta).is_inference()
    state.set_eval(4)
    assert state.on_device(state.eval_bits, meta).device == meta


class _OperationNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_a_training_step_derives_the_top_codes_only_when_the_bits_change():
    """The top code 2^b - 1 of the forward and of the errors is computed once per bit-width, not at every product
    (on a GPU each is a kernel launch per layer): a second step at the same bits computes none."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.Linear(32, 4))
    quantize_model(model, CPTConfig(include_modules=["3"], fused_error_quantizer=False, integer_matmul=False))
    x = torch.randn(6, 32)

    def step_operations() -> list[str]:
        with _OperationNames() as names:
            model(x).square().sum().backward()
        return names.names

    set_precision(model, 6, 8)
    assert "exp2" in step_operations()
    assert "exp2" not in step_operations()
    set_precision(model, 5, 8)  # both bit-widths set anew: each top code once, whatever the number of layers
    assert step_operations().count("exp2") == 2


def test_the_backward_quantizes_errors_at_the_bits_its_forward_ran_with():
    """Error bits changed between a forward and its backward do not reach that backward (no copy of the bits per
    product keeps them: `PrecisionState.error_bits` hands out a tensor that is never modified)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    quantize_model(model, CPTConfig(fused_error_quantizer=False, error_rounding="nearest"))
    x = torch.randn(8, 16)

    def gradients(grad_bits_at_backward: int) -> list[torch.Tensor]:
        model.zero_grad()
        set_precision(model, 8, 2)
        loss = model(x).square().sum()
        set_precision(model, 8, grad_bits_at_backward)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    at_two, changed = gradients(2), gradients(8)
    assert all(torch.equal(a, b) for a, b in zip(at_two, changed))
    set_precision(model, 8, 8)
    model.zero_grad()
    model(x).square().sum().backward()
    assert not torch.equal(model[0].weight.grad, at_two[0])  # 8-bit errors do give other gradients


def test_error_bits_are_one_unmodified_tensor_per_value_also_in_a_copied_state():
    from hf_cpt.nn import PrecisionState

    state, cpu = PrecisionState(), torch.device("cpu")
    state.set(8, 6)
    first = state.error_bits(cpu)
    assert first is not state.grad_bits and state.error_bits(cpu) is first and first.item() == 6
    state.set(8, 5)
    assert state.error_bits(cpu).item() == 5 and first.item() == 6  # a new tensor; the old one keeps its value
    clone = copy.deepcopy(state)  # a copied model's state: its own bits, whatever their version counters read
    for grad_bits in (2, 3, 4, 7):
        clone.set(8, grad_bits)
        assert clone.error_bits(cpu).item() == grad_bits
    assert state.error_bits(cpu).item() == 5


@pytest.mark.parametrize("int8_dot", [True, False])
def test_changing_bits_does_not_retrace_a_compiled_model(int8_dot):
    """On either kind of CPU (products on int8 codes, or float products: both forced here, whatever this CPU has)."""
    import torch._dynamo

    from .helpers import cpu_backend

    torch._dynamo.reset()
    compiled_graphs = []

    def counting_backend(graph_module, example_inputs):
        compiled_graphs.append(graph_module)
        return graph_module.forward

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with cpu_backend(int8_dot):
        quantize_model(model, CPTConfig(include_modules=["2"], fused_error_quantizer=False))
        assert find_precision_state(model).integer_products(torch.device("cpu")) is int8_dot  # "auto"
        compiled = torch.compile(model, backend=counting_backend)
        x = torch.randn(4, 8)
        for bits in (3, 4, 5, 6, 7, 8, 3, 8):
            set_precision(model, bits, 8)
            compiled(x).sum().backward()
        assert len(compiled_graphs) == 1
        # The compiled model really uses the new bits: 1-bit and 8-bit outputs differ.
        with torch.no_grad():
            set_precision(model, 1, 8)
            low = compiled(x)
            set_precision(model, 8, 8)
            high = compiled(x)
    assert not torch.equal(low, high)


def test_quantized_embeddings_per_row_with_a_tied_head_and_no_macs():
    from transformers import GPT2LMHeadModel

    from hf_cpt.cost import CostMeter
    from hf_cpt.nn.layers import QuantEmbedding

    from .helpers import tiny_gpt2_config

    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config())
    # integer products on any CPU (auto: only where it has int8 dot products): the GELUs recompute their inputs
    report = quantize_model(model, CPTConfig(quantize_embeddings=True, integer_matmul=True))
    wte, head = model.transformer.wte, model.lm_head
    assert isinstance(wte, QuantEmbedding) and isinstance(head, QuantLinear) and head.weight is wte.weight
    assert report.schemes["lm_head"].startswith("weights only") and "lm_head" not in report.kept
    ids = torch.randint(0, 128, (2, 6))
    set_precision(model, 4, 8)
    model.train()
    expected_rows = per_channel_reference(wte.weight.detach(), 4, 0)
    assert torch.equal(wte(ids), expected_rows[ids])  # the table quantized per row; the indices untouched
    x = torch.randn(2, 6, 32)
    assert torch.equal(head(x), x @ expected_rows.T)  # the tied head: same rows, full-precision input
    meter = CostMeter(model, static_bits=8, static_grad_bits=8)
    model(ids).logits.sum().backward()
    assert wte.weight.grad is not None and torch.isfinite(wte.weight.grad).all()  # straight-through
    meter.end_step(4, 8)
    blocks = sum(6 * 2 * layer.weight.numel() for name, layer in model.named_modules()
                 if isinstance(layer, QuantConv1D))
    head_macs = 2 * 6 * head.weight.numel()
    config = model.config
    attention_macs = config.n_layer * 2 * (2 * 6 * 6 * config.n_embd)  # Q·Kᵀ and P·V, in full precision
    full = 3 * 32 * 32
    from hf_cpt.numerics.bitops import bitops_per_mac

    recomputed = 2 * 6 * config.n_embd * 4 * config.n_embd * config.n_layer  # each block's c_fc, for its GELU
    assert wte.cpt_precision.recomputed_macs == recomputed
    assert meter.totals.bitops == (blocks * bitops_per_mac(4, 8) + recomputed * 4 * 4
                                   + (head_macs + attention_macs) * full + meter.totals.rotation_bitops)
    set_precision(model, None, None)
    assert torch.equal(wte(ids), torch.nn.functional.embedding(ids, wte.weight))  # bits None: the original


@pytest.mark.parametrize("scheme", ["paper", "rotated-per-token"])
def test_training_saves_uint8_codes_and_the_backward_is_the_float_one_bit_for_bit(scheme):
    """The backward rebuilds each quantized operand from its codes: same gradients as saving the float copy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 6))
    # the float product on both sides (codes save the same operands either way; with uint8 codes the forward could run
    # on them, a product tested in tests/test_integer_matmul.py)
    quantize_model(model, CPTConfig(include_modules=["2"], quant_scheme=scheme, fused_error_quantizer=False,
                                    integer_matmul=False))
    model.train()
    x = torch.randn(5, 7, 12, requires_grad=True)  # so that both products of both layers are needed
    grads = {}
    for compact in (True, False):
        set_precision(model, 6, 8)
        model[0].cpt_precision.compact_codes = compact
        saved: list[torch.Tensor] = []

        def keep(t, saved=saved):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out = model(x)
        torch.manual_seed(1)  # the same stochastic rounding of the errors
        out.pow(2).sum().backward()
        grads[compact] = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        float_inputs = [t for t in saved if t.dtype == torch.float32 and t.shape == (5, 7, 24)]
        codes = [t for t in saved if t.dtype == torch.uint8]
        if compact:  # both layers' inputs and weights are saved as codes; no float copy of a quantized input
            assert {tuple(t.shape) for t in codes} == {(5, 7, 12), (24, 12), (5, 7, 24), (6, 24)}
            assert not any(t.shape == (5, 7, 12) for t in saved if t.dtype == torch.float32)
        else:
            assert not codes and float_inputs
    for compact_grad, float_grad in zip(grads[True], grads[False]):
        assert torch.equal(compact_grad, float_grad)


def _reference_codes_value(t, dim):
    """Per-row (``dim``) 8-bit quantize-dequantize in float32, written out."""
    lo, hi = t.amin(dim, keepdim=True), t.amax(dim, keepdim=True)
    scale = torch.clamp((hi - lo) / 255, min=1e-8)
    return torch.round(torch.clamp((t - lo) / scale, 0, 255)) * scale + lo


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("tokens", [3, 64])  # fewer values in the input than in the weight, and more
def test_rotated_layer_gradients_match_a_dense_reference(kind, tokens):
    """A rotated layer computes with Q(x R) and Q(W R); its gradients are the straight-through ones of W and x:
    dW = (E^T Q(x R)) R^T and dx = (E Q(W R)) R^T, whichever way the layer orders the products."""
    torch.manual_seed(0)
    layer = nn.Linear(384, 16) if kind == "linear" else Conv1D(16, 384)
    model = nn.Sequential(layer)
    quantize_model(model, CPTConfig(quant_scheme="rotated-per-token", fused_error_quantizer=False))
    set_precision(model, 8, None)  # full-precision errors: a deterministic backward
    q = model[0]
    dense = q.rotation.matrix()
    x = torch.randn(tokens, 384, requires_grad=True)
    upstream = torch.randn(tokens, 16)
    model(x).backward(upstream)
    weight = q.weight.detach() if kind == "linear" else q.weight.detach().t()  # (out, in)
    qx = _reference_codes_value(q.rotation.apply(x.detach()), -1)
    qw = _reference_codes_value(q.rotation.apply(weight), -1)
    grad_w = (upstream.t() @ qx) @ dense.t()
    grad_x = (upstream @ qw) @ dense.t()
    got_w = q.weight.grad if kind == "linear" else q.weight.grad.t()
    assert torch.allclose(got_w, grad_w, atol=1e-4, rtol=1e-4)
    assert torch.allclose(x.grad, grad_x, atol=1e-4, rtol=1e-4)


def test_rotated_layer_keeps_codes_and_ranges_only():
    """The default scheme rotates the input and weight: the rotation's backward keeps nothing per token."""
    layer = nn.Sequential(nn.Linear(384, 96))  # 384 = 12 x 32: a Paley factor on its own axis
    quantize_model(layer, CPTConfig(fused_error_quantizer=False))
    set_precision(layer, 8, 8)
    assert layer[0].rotation is not None
    tokens = 40
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(torch.randn(tokens, 384, requires_grad=True)).sum().backward()
    large_floats = [tuple(t.shape) for t in saved if t.is_floating_point() and t.numel() > max(tokens, 96)]
    assert not large_floats
    assert {tuple(t.shape) for t in saved if t.dtype == torch.uint8} == {(tokens, 384), (96, 384)}


@pytest.mark.parametrize("kind", ["linear", "conv2d"])
def test_training_keeps_only_what_the_needed_gradients_read(kind):
    """A frozen weight (peft's base layers) needs no saved input; an input without grad needs no saved weight."""
    torch.manual_seed(0)
    if kind == "linear":
        layer, shape, weight_shape = nn.Sequential(nn.Linear(12, 24)), (5, 12), (24, 12)
    else:
        layer, shape, weight_shape = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1)), (2, 3, 9, 9), (8, 3, 3, 3)
    quantize_model(layer, CPTConfig(include_modules=["0"], fused_error_quantizer=False))
    set_precision(layer, 8, 8)
    layer.train()

    def saved_shapes(x):
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            out = layer(x)
        torch.manual_seed(1)  # the same stochastic rounding of the errors in every call
        out.sum().backward()
        return shapes

    x = torch.randn(shape, requires_grad=True)
    saved_shapes(x)  # the weight trains: the input is kept, the input gradient is the reference
    reference = x.grad.clone()
    layer[0].weight.requires_grad_(False)
    x.grad = None
    shapes = saved_shapes(x)
    assert weight_shape in shapes and shape not in shapes
    assert torch.equal(x.grad, reference)  # computed from the input's shape alone
    layer[0].weight.grad = None
    layer[0].weight.requires_grad_(True)
    shapes = saved_shapes(torch.randn(shape))
    assert shape in shapes and weight_shape not in shapes and layer[0].weight.grad is not None


PRODUCERS = {"relu": torch.relu, "relu_": torch.relu_, "sigmoid": torch.sigmoid, "tanh": torch.tanh}


@pytest.mark.parametrize("producer", sorted(PRODUCERS))
@pytest.mark.parametrize("kind, integer", [("linear", False), ("linear", True), ("conv2d", "auto")])
def test_an_input_its_producer_keeps_is_kept_once_and_gives_the_gradients_of_its_codes(producer, kind, integer):
    """A layer fed a ReLU's output (kept by the ReLU for its own backward) keeps a reference to that tensor, not a
    second copy as codes, and quantizes it again in backward: the gradients of the codes path, bit for bit (float
    products and products on codes)."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(12, 24) if kind == "linear" else nn.Conv2d(3, 8, 3, padding=1))
    quantize_model(layer, CPTConfig(include_modules=["0"], quant_scheme="paper", integer_matmul=integer))
    set_precision(layer, 5, 8)
    layer.train()
    source = torch.randn((6, 12) if kind == "linear" else (2, 3, 8, 8), requires_grad=True)

    def run(edit):
        for tensor in (source, *layer.parameters()):
            tensor.grad = None
        x = edit(PRODUCERS[producer](source * 3.0))  # a non-leaf: the in-place ReLU applies
        out = layer(x)
        kept = out.grad_fn.saved_tensors
        torch.manual_seed(1)  # the same stochastic rounding of the errors
        out.square().sum().backward()
        codes = [t for t in kept if t.dtype == torch.uint8 and t.shape == x.shape]
        return x, kept, codes, [t.grad.clone() for t in (source, *layer.parameters())]

    x, kept, codes, gradients = run(lambda t: t)
    assert codes == [] and any(t.data_ptr() == x.data_ptr() and t.dtype == x.dtype for t in kept)
    _, _, reference_codes, reference = run(lambda t: t.clone())  # a clone keeps nothing: the layer keeps codes
    assert len(reference_codes) == 1
    for got, expected in zip(gradients, reference):
        assert torch.equal(got, expected)


def test_a_timm_resnet_keeps_its_relu_outputs_once_and_trains_as_with_codes(monkeypatch):
    """timm's ResNet-18 (in-place ReLUs): every conv but the stem and the one after the max-pool
    reads a ReLU's output, and the step's gradients are those of the codes path, bit for bit."""
    timm = pytest.importorskip("timm")
    import hf_cpt.nn.products as products

    torch.manual_seed(0)
    base = timm.create_model("resnet18", num_classes=10)
    models = [copy.deepcopy(base) for _ in range(2)]
    for model in models:
        quantize_model(model, CPTConfig())
        set_precision(model, 6, 8)
        model.train()
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 7])
    decisions = []
    keeps = products.kept_by_producer
    monkeypatch.setattr(products, "kept_by_producer", lambda t: decisions.append(keeps(t)) or decisions[-1])
    torch.manual_seed(1)
    nn.functional.cross_entropy(models[0](x), y).backward()
    assert len(decisions) == 20 and sum(decisions) == 18
    monkeypatch.setattr(products, "kept_by_producer", lambda t: False)
    torch.manual_seed(1)
    nn.functional.cross_entropy(models[1](x), y).backward()
    for got, expected in zip(models[0].parameters(), models[1].parameters()):
        assert (got.grad is None) == (expected.grad is None)
        assert got.grad is None or torch.equal(got.grad, expected.grad)


def test_an_input_whose_producer_freed_its_copy_is_kept_as_codes():
    """A backward through the ReLU ran already (its saved output is freed): the forward runs and keeps its own codes
    (a second backward through the ReLU fails in the ReLU, as without the layer)."""
    layer = nn.Sequential(nn.Linear(12, 24))
    quantize_model(layer, CPTConfig(include_modules=["0"]))
    set_precision(layer, 8, 8)
    layer.train()
    x = torch.relu(torch.randn(6, 12, requires_grad=True) * 2.0)
    x.sum().backward()
    out = layer(x)
    assert [t.shape for t in out.grad_fn.saved_tensors if t.dtype == torch.uint8] == [(6, 12), (24, 12)]


def test_an_input_its_producer_keeps_is_kept_as_codes_under_saved_tensor_hooks():
    """Offloading or checkpointing hooks see what the layer saves: there the ReLU's tensor is not ``x``."""
    layer = nn.Sequential(nn.Linear(12, 24))
    quantize_model(layer, CPTConfig(include_modules=["0"]))
    set_precision(layer, 8, 8)
    layer.train()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(torch.relu(torch.randn(6, 12, requires_grad=True)))
    assert [t.shape for t in saved if t.dtype == torch.uint8] == [(6, 12), (24, 12)]


@pytest.mark.parametrize("products", ["both", "input"])
@pytest.mark.parametrize("conv", [dict(stride=2, padding=1), dict(padding=2, dilation=2, groups=2)])
def test_conv2d_backward_forms_both_gradients_in_one_call_where_they_share_an_error(products, conv, monkeypatch):
    """One convolution backward for both gradients where they take the same error (as autograd's own Conv2d): the
    same gradients bit for bit as one call per gradient; an error per product keeps two calls."""
    torch.manual_seed(0)
    model = _wrap(nn.Conv2d(4, 6, 3, **conv))
    quantize_model(model, CPTConfig(include_modules=["0"], error_products=products, fused_error_quantizer=False))
    set_precision(model, 6, 8)
    x = torch.randn(3, 4, 11, 11)

    def gradients():
        model.zero_grad(set_to_none=True)
        source = x.clone().requires_grad_()
        torch.manual_seed(1)  # the same stochastic rounding of the errors in every call
        with _OperationNames() as operations:
            model(source).square().sum().backward()
        return source.grad, model[0].weight.grad, operations.names.count("convolution_backward")

    grad_x, grad_weight, calls = gradients()
    monkeypatch.setattr(QuantConv2d, "both_gradients", lambda self, error, x, weight: None)
    separate_x, separate_weight, separate_calls = gradients()
    assert torch.equal(grad_x, separate_x) and torch.equal(grad_weight, separate_weight)
    assert separate_calls == 2 and calls == (1 if products == "both" else 2)


class _Siblings(nn.Module):
    """Three projections of one input (an attention's query, key and value) and a layer reading another input."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(384, 16), nn.Linear(384, 16), nn.Linear(384, 16)
        self.out = nn.Linear(16, 384)

    def forward(self, h: torch.Tensor, clone: bool = False) -> torch.Tensor:
        inputs = [h.clone() for _ in range(3)] if clone else [h] * 3  # clones: three inputs, nothing shared
        mixed = self.q(inputs[0]) * self.k(inputs[1]) + self.v(inputs[2])
        return self.out(mixed)


@pytest.mark.parametrize("scheme", ["rotated-per-token", "per-token"])
def test_sibling_layers_quantize_a_shared_input_once_with_the_same_results(scheme):
    """Layers that read one input rotate and quantize it once: the same outputs and weight gradients bit for bit,
    the same input gradient up to float summation order, and one copy of its codes kept for backward."""
    torch.manual_seed(0)
    model = _Siblings()
    quantize_model(model, CPTConfig(quant_scheme=scheme, fused_error_quantizer=False))
    set_precision(model, 6, 8)
    model.train()
    results = {}
    source = torch.randn(2, 9, 384, requires_grad=True)
    for clone in (True, False):
        source.grad = None
        h = source * 2  # a non-leaf input, as inside a model
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
            out = model(h, clone)
        torch.manual_seed(1)  # the same stochastic rounding of the errors
        out.pow(2).sum().backward()
        codes = {t.untyped_storage().data_ptr() for t in saved if t.dtype == torch.uint8 and t.shape == h.shape}
        results[clone] = out.detach(), [p.grad.clone() for p in model.parameters()], source.grad.clone(), len(codes)
        model.zero_grad()
    (out_a, grads_a, grad_a, codes_a), (out_b, grads_b, grad_b, codes_b) = results[True], results[False]
    assert torch.equal(out_a, out_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    assert (grad_a - grad_b).abs().max() <= 1e-5 * grad_b.abs().max()  # summed before or after rotating back
    assert (codes_a, codes_b) == (3, 1)


def test_a_shared_input_is_recomputed_after_an_edit_or_a_new_bit_width_and_released_with_its_input():
    torch.manual_seed(0)
    model = _Siblings()
    quantize_model(model, CPTConfig(fused_error_quantizer=False))
    shared = model.q.cpt_precision.shared_inputs
    set_precision(model, 4, 8)
    model.eval()
    set_eval_precision(model, 4)
    h = torch.randn(3, 384)
    with torch.no_grad():
        first = model.q(h)
        h.mul_(3)  # an in-place edit: the held quantization is stale
        assert torch.equal(model.q(h), model.q(h.clone()))
        assert not torch.equal(model.q(h), first)
        set_eval_precision(model, 8)  # another bit-width
        assert torch.equal(model.k(h), model.k(h.clone()))
        model.v(h)
    assert shared._entry is not None
    del h
    assert shared._entry is None  # freed with its input


def test_a_model_with_a_held_shared_input_copies_and_pickles(tmp_path):
    torch.manual_seed(0)
    model = _Siblings()
    quantize_model(model, CPTConfig(fused_error_quantizer=False))
    set_precision(model, 8, 8)
    h = torch.randn(2, 384)
    model.q(h)  # an input held for the siblings
    assert model.q.cpt_precision.shared_inputs._entry is not None
    twin = copy.deepcopy(model)
    assert twin.q.cpt_precision.shared_inputs._entry is None
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert torch.equal(loaded(h), model(h))


def test_one_leaf_input_trained_on_twice_is_not_shared_across_backward_passes():
    torch.manual_seed(0)
    model = _Siblings()
    quantize_model(model, CPTConfig(fused_error_quantizer=False))
    set_precision(model, 8, 8)
    h = torch.randn(2, 384, requires_grad=True)
    for _ in range(2):  # a second backward through a held rotation of the first graph would fail
        model(h).sum().backward()
    assert h.grad is not None


def test_a_llama_shares_its_attention_and_gated_mlp_inputs_and_trains_as_without_sharing():
    """Real sibling layers: q/k/v and gate/up of a Llama-style model. Two training steps with sharing give the
    losses of the same steps with every input computed per layer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    losses, reuses = {}, {}
    for share in (True, False):
        torch.manual_seed(0)
        model = LlamaForCausalLM(copy.deepcopy(config))  # quantize_model sets the config's attention function
        # float products (with codes for the activations, gate and up share codes from the third step: test_recompute)
        quantize_model(model, CPTConfig(fused_error_quantizer=False, integer_matmul=False))
        set_precision(model, 6, 8)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        state = model.model.layers[0].self_attn.q_proj.cpt_precision.shared_inputs
        if not share:
            state.get = lambda *args: None
        losses[share] = []
        for _ in range(2):
            torch.manual_seed(1)  # the same stochastic rounding of the errors
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[share].append(loss.item())
        reuses[share] = state.reuses
    assert reuses == {True: 2 * 2 * 3, False: 0}  # 2 steps x 2 layers x (k, v, up)
    assert losses[True][0] == losses[False][0]  # the same forward, bit for bit
    assert losses[True][1] == pytest.approx(losses[False][1], rel=1e-5)  # gradients summed in another order


def _reuse_pair(make_layer, make_input, seed=0, integer_matmul="auto"):
    """Two copies of a rotated per-token layer (the default scheme), one reusing its weight codes."""
    torch.manual_seed(seed)
    plain = _wrap(make_layer())
    quantize_model(plain, CPTConfig(integer_matmul=integer_matmul))
    reusing = copy.deepcopy(plain)
    for model in (plain, reusing):
        set_precision(model, 5, 8)
    reusing[0].cpt_precision.reused_weights.epoch = 0
    return plain, reusing, make_input()


def _forward_backward(model, x):
    x = x.clone().requires_grad_()
    output = model(x)
    output.backward(torch.ones_like(output))
    return output.detach(), x.grad, model[0].weight.grad.clone()


@pytest.mark.parametrize("integer_matmul", [False, True])  # the float product, and the product on codes
@pytest.mark.parametrize("make_layer, make_input", [(lambda: nn.Linear(12, 7), lambda: torch.randn(5, 3, 12)),
                                                    (lambda: Conv1D(7, 12), lambda: torch.randn(5, 3, 12))])
def test_weight_codes_are_reused_within_an_epoch_with_the_same_values(make_layer, make_input, integer_matmul,
                                                                       monkeypatch):
    plain, reusing, x = _reuse_pair(make_layer, make_input, integer_matmul=integer_matmul)
    layer = reusing[0]
    rotated_weights = []
    apply = type(layer.rotation).apply
    monkeypatch.setattr(type(layer.rotation), "apply", lambda self, t, *args, **kwargs: (
        rotated_weights.append(t.data_ptr() == layer.weight.data_ptr()) or apply(self, t, *args, **kwargs)))
    for _ in range(3):  # gradient accumulation: the same weight, bits and epoch
        expected, got = _forward_backward(plain, x), _forward_backward(reusing, x)
        for a, b in zip(expected, got):
            assert torch.equal(a, b)
    assert sum(rotated_weights) == 1 and layer.cpt_precision.reused_weights.reuses == 2
    layer.eval()  # eval at the training bits: its own entry, then reused
    plain.eval()
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(plain(x), reusing(x))
    assert sum(rotated_weights) == 2 and layer.cpt_precision.reused_weights.reuses == 3


def test_a_steps_last_forward_takes_the_weight_codes_over_and_keeps_none():
    plain, reusing, x = _reuse_pair(lambda: nn.Linear(12, 7), lambda: torch.randn(5, 3, 12))
    reused = reusing[0].cpt_precision.reused_weights
    reused.begin_step(3)
    for left in (3, 2, 1):  # the first two micro-batches keep the codes, the last one hands them to its backward
        expected, got = _forward_backward(plain, x), _forward_backward(reusing, x)
        assert all(torch.equal(a, b) for a, b in zip(expected, got))
        assert len(reused._entries) == (1 if left > 1 else 0) and reused.last_forward == (left == 1)
        if left > 1:
            reused.end_micro_batch()
    assert reused.reuses == 2
    reused.end_step()  # before the optimizer step, and after it (an evaluation's forwards share codes again)
    assert not reused.last_forward
    reused.begin_step(1)  # a step of one micro-batch keeps nothing
    _forward_backward(reusing, x)
    assert not reused._entries and reused.reuses == 2
    reused.epoch = None  # the end of training: a later epoch set by hand keeps codes again
    assert not reused.last_forward


def test_reused_weight_codes_follow_the_weight_the_bits_and_the_epoch():
    plain, reusing, x = _reuse_pair(lambda: nn.Linear(12, 7), lambda: torch.randn(5, 3, 12))
    precision = reusing[0].cpt_precision

    def same():
        return torch.equal(plain(x), reusing(x))

    assert same()
    for model in (plain, reusing):  # an optimizer step: the weight's version changes
        with torch.no_grad():
            model[0].weight.mul_(1.5)
    assert same() and precision.reused_weights.reuses == 0
    for model in (plain, reusing):  # new bits
        set_precision(model, 3, 8)
    assert same() and precision.reused_weights.reuses == 0
    for model in (plain, reusing):  # new values behind an unchanged version (as FSDP's all-gather writes them)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(model[0].weight):
            model[0].weight.add_(0.25)
    assert not same()  # the same epoch: the codes of the old values (why the Trainer advances it at every step)
    precision.reused_weights.epoch += 1
    assert same()


def test_weight_codes_are_not_reused_without_an_epoch_or_above_8_bits():
    plain, reusing, x = _reuse_pair(lambda: nn.Linear(12, 7), lambda: torch.randn(5, 3, 12))
    precision = reusing[0].cpt_precision
    set_precision(reusing, 10, 8)
    reusing(x), reusing(x)
    assert precision.reused_weights.reuses == 0
    set_precision(reusing, 5, 8)
    precision.reused_weights.epoch = None
    reusing(x), reusing(x)
    assert precision.reused_weights.reuses == 0 and not precision.reused_weights._entries


def test_a_model_with_reused_weight_codes_pickles_and_its_copy_keeps_none():
    _, reusing, x = _reuse_pair(lambda: nn.Linear(12, 7), lambda: torch.randn(5, 3, 12))
    _forward_backward(reusing, x)
    assert reusing[0].cpt_precision.reused_weights._entries  # the codes are kept (with a weak reference)
    buffer = io.BytesIO()
    torch.save(reusing, buffer)
    buffer.seek(0)
    copied = torch.load(buffer, weights_only=False)
    assert copied[0].cpt_precision.reused_weights.epoch is None and not copied[0].cpt_precision.reused_weights._entries
    assert torch.equal(copied(x), reusing(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme", ["auto", "paper", "per-token", "rotated"])
@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_a_model_whose_weights_are_half_precision_trains_and_evaluates_under_every_scheme(family, scheme, dtype):
    """Weights in bf16 / fp16 (no autocast): a training step, then evaluation forwards in the weights' dtype, close to
    the same model in float32 (a rotation and restored codes compute in float32 and are cast back)."""
    from transformers import BertForSequenceClassification, GPT2LMHeadModel

    from .helpers import tiny_bert_config, tiny_gpt2_config

    torch.manual_seed(0)
    full = (BertForSequenceClassification(tiny_bert_config()) if family == "bert"
            else GPT2LMHeadModel(tiny_gpt2_config()))
    half = copy.deepcopy(full).to(dtype)
    ids = torch.randint(5, 128, (2, 10))
    outputs = []
    for model in (full, half):
        quantize_model(model, CPTConfig(quant_scheme=scheme))
        set_precision(model, 8, 8)
        model.train()
        model(input_ids=ids).logits.float().sum().backward()
        model.eval()
        with torch.no_grad():
            outputs.append(model(input_ids=ids).logits)
    assert outputs[1].dtype == dtype and torch.isfinite(outputs[1]).all()
    assert float((outputs[1].float() - outputs[0]).abs().max() / outputs[0].abs().max()) < 0.1
