"""The native codes kernel (hf_cpt/numerics/code_kernels.py, code_kernels.c): the codes and values of the torch
formula, bit for bit, for every range layout a layer uses, and the formula wherever the kernel does not serve."""


import pytest
import torch

from hf_cpt.numerics import code_kernels, native
from hf_cpt.numerics.fake_quant import (
    MIN_SCALE,
    channel_ranges,
    fake_quantize_compact,
    quantize_compact,
    restore_compact,
    tensor_range,
    token_range,
)


@pytest.fixture(autouse=True)
def _native_kernel():
    if code_kernels._library() is None:
        pytest.skip("no C compiler on this machine")


def _reference(x: torch.Tensor, minimum: torch.Tensor, maximum: torch.Tensor, bits: int):
    """(uint8 codes, values, scale) of the quantizer's formula (docs/method.md §2), written out here: in float32 for
    half-precision operands, else in the operand's dtype."""
    dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    x, minimum, maximum = x.to(dtype), minimum.to(dtype), maximum.to(dtype)
    levels = float(2**bits - 1)
    scale = ((maximum - minimum) / levels).clamp_min(MIN_SCALE)
    codes = torch.round(torch.clamp((x - minimum) / scale, 0.0, levels))
    return codes.to(torch.uint8), codes * scale + minimum, scale


def _ranges(x: torch.Tensor, layout: str):
    if layout == "per row":
        return token_range(x)
    if layout == "per column":
        return channel_ranges(x, x.dim() - 1)
    if layout == "per output channel":
        return channel_ranges(x, 0)
    return tensor_range(x)


LAYOUTS = [
    ((512, 96), "per row"),  # a Linear's input, one range per token
    ((4, 64, 96), "per row"),  # batch x sequence x features
    ((96, 384), "per column"),  # a GPT-2 Conv1D weight [in, out], one range per output channel
    ((64, 32, 3, 3), "per output channel"),  # a Conv2d weight
    ((300, 70), "per tensor"),
]


@pytest.mark.parametrize("shape, layout", LAYOUTS)
@pytest.mark.parametrize("bits", [3, 4, 6, 8])
def test_native_codes_and_values_are_the_formulas_bit_for_bit(shape, layout, bits):
    """Operands spanning four orders of magnitude across rows, with rows of zeros (a degenerate range, clamped to the
    smallest scale) and values at the range's ends; codes, fake-quantized values and restored values all match."""
    torch.manual_seed(bits)
    x = torch.randn(shape) * torch.logspace(-3, 1, shape[0]).view(-1, *([1] * (len(shape) - 1)))
    x[:3] = 0.0
    minimum, maximum = _ranges(x, layout)
    b = torch.tensor(float(bits))
    expected_codes, expected_values, scale = _reference(x, minimum, maximum, bits)
    assert code_kernels.quantize_codes_native(x, minimum, scale, torch.tensor(2.0**bits - 1), True) is not None
    values, (codes, got_scale, got_minimum) = fake_quantize_compact(x, minimum, maximum, b)
    assert codes.dtype == torch.uint8 and torch.equal(codes, expected_codes)
    assert torch.equal(values, expected_values)
    assert torch.equal(quantize_compact(x, minimum, maximum, b)[0], expected_codes)
    assert torch.equal(restore_compact(codes, got_scale, got_minimum, torch.float32), expected_values)


def test_bf16_operands_are_quantized_in_float32_and_returned_in_bf16():
    x = torch.randn(256, 128).to(torch.bfloat16)
    minimum, maximum = token_range(x)
    expected_codes, expected_values, _ = _reference(x, minimum, maximum, 8)
    values, (codes, scale, minimum32) = fake_quantize_compact(x, minimum, maximum, torch.tensor(8.0))
    assert values.dtype == torch.bfloat16 and torch.equal(values, expected_values.to(torch.bfloat16))
    assert torch.equal(codes, expected_codes)
    assert torch.equal(restore_compact(codes, scale, minimum32, torch.bfloat16), values)


def test_the_result_does_not_depend_on_the_thread_count(monkeypatch):
    """Tensors above the kernel's per-thread share are split by rows over threads."""
    x = torch.randn(2100, 2048)
    minimum, maximum = token_range(x)
    bits = torch.tensor(5.0)
    results = []
    for count in (1, 2, 3):
        monkeypatch.setenv(native.THREADS_VARIABLE, str(count))
        values, (codes, scale, minimum32) = fake_quantize_compact(x, minimum, maximum, bits)
        results.append((values, codes, restore_compact(codes, scale, minimum32, torch.float32)))
    expected_codes, expected_values, _ = _reference(x, minimum, maximum, 5)
    for values, codes, restored in results:
        assert torch.equal(codes, expected_codes) and torch.equal(values, expected_values)
        assert torch.equal(restored, expected_values)
    # the split really ran (native_threads.h): asked for 3 threads, POSIX threads ran the 2 this size allows
    _, (_, scale, minimum32) = fake_quantize_compact(x, minimum, maximum, bits)
    out = torch.empty(x.shape)
    used = code_kernels._library().hf_cpt_restore_codes(expected_codes.data_ptr(), out.data_ptr(),
                                                        minimum32.contiguous().data_ptr(), scale.data_ptr(), 1, 0,
                                                        *x.shape, 3)
    assert used == 2 and torch.equal(out, expected_values)


def test_calls_the_kernel_does_not_serve_keep_the_formula():
    """A transposed view, a per-channel range of a channels-first activation, a tensor that needs its gradient,
    float64 and a small tensor: the native entry declines (None) and the public functions still give the formula's
    codes and values."""
    torch.manual_seed(0)
    images = torch.randn(8, 16, 32, 32)
    per_channel = images.amin(dim=(0, 2, 3), keepdim=True), images.amax(dim=(0, 2, 3), keepdim=True)
    wide = torch.randn(768, 512)
    cases = [
        (wide.t(), *channel_ranges(wide.t(), 0)),
        (images, *per_channel),
        (torch.randn(512, 96, requires_grad=True), *token_range(torch.randn(512, 96))),
        (torch.randn(512, 96, dtype=torch.float64), *token_range(torch.randn(512, 96, dtype=torch.float64))),
        (torch.randn(16, 32), *token_range(torch.randn(16, 32))),
    ]
    bits = torch.tensor(6.0)
    for x, minimum, maximum in cases:
        expected_codes, expected_values, scale = _reference(x.detach(), minimum, maximum, 6)
        assert code_kernels.quantize_codes_native(x, minimum, scale.to(x.dtype), torch.tensor(63.0), True) is None
        values, (codes, _, _) = fake_quantize_compact(x.detach(), minimum, maximum, bits)
        assert torch.equal(codes, expected_codes)
        assert torch.equal(values, expected_values.to(x.dtype))


@pytest.mark.parametrize("shape, range_shape, expected", [
    ((2048, 768), (2048, 1), (2048, 768, 1, 0)),
    ((4, 512, 768), (4, 512, 1), (2048, 768, 1, 0)),
    ((768, 2304), (1, 2304), (768, 2304, 0, 1)),
    ((64, 32, 3, 3), (64, 1, 1, 1), (64, 288, 1, 0)),
    ((300, 70), (), (1, 21000, 0, 0)),
    ((8, 16, 32, 32), (1, 16, 1, 1), None),
])
def test_range_layouts(shape, range_shape, expected):
    assert code_kernels._layout(torch.Size(shape), torch.Size(range_shape)) == expected


@pytest.mark.parametrize("shape, kind", [
    ((512, 96), "token"), ((4, 64, 96), "token"), ((96, 2304), "channel 0"), ((96, 384), "channel -1"),
    ((64, 32, 3, 3), "channel 0"), ((3, 50, 211), "token"),  # a row length off the 16-value blocks
])
def test_native_ranges_are_amin_and_amax(shape, kind):
    """One pass instead of two, the same values (min and max are exact), NaN wherever a NaN was reduced."""
    torch.manual_seed(0)
    x = torch.randn(shape) * 10
    flat = x.view(-1)
    flat[7], flat[1000] = float("nan"), float("inf")
    if kind == "token":
        got, dims = token_range(x), (-1,)
        split, per_column = x.dim() - 1, False
    else:
        channel = int(kind.split()[1]) % x.dim()
        got, dims = channel_ranges(x, channel), tuple(d for d in range(x.dim()) if d != channel)
        split, per_column = (x.dim() - 1, True) if channel == x.dim() - 1 else (1, False)
    assert code_kernels.ranges_native(x, split, per_column) is not None
    for value, reference in zip(got, (x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True))):
        assert value.shape == reference.shape
        torch.testing.assert_close(value, reference, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("shape, per_column", [((300, 211), False), ((211, 300), True), ((64, 4096), False),
                                               ((4096, 70), True)])
@pytest.mark.parametrize("bits", [4, 8])
def test_native_centred_codes_and_their_sums_are_exact(shape, per_column, bits):
    """Codes less the middle code as float32, with the integer sums and sums of squares of each row (or column), the
    extremes included: what the float32 GEMM on codes multiplies and bounds."""
    generator = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, shape, generator=generator, dtype=torch.uint8)
    codes[0], codes[:, 1] = 0, 2**bits - 1
    middle = 2 ** (bits - 1)
    values, sums, squares = code_kernels.centred_codes_native(codes, middle, per_column)
    centred = codes.long() - middle
    dim = 0 if per_column else 1
    assert values.dtype == torch.float32 and torch.equal(values.long(), centred)
    assert sums.dtype == squares.dtype == torch.int32
    assert torch.equal(sums.long(), centred.sum(dim)) and torch.equal(squares.long(), centred.square().sum(dim))


def test_kernels_run_on_torchs_team_else_on_one_thread_unless_told_and_refuse_a_bad_count(monkeypatch):
    """Built with OpenMP, a kernel splits its rows over torch's team (torch's thread count); else threads of its own
    would wait for a core torch's spinning workers hold inside a step: one unless told."""
    monkeypatch.delenv(native.THREADS_VARIABLE, raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(native, "_on_openmp_team", True)
    assert native.threads() == 4
    monkeypatch.setattr(native, "_on_openmp_team", False)
    assert native.threads() == 1
    monkeypatch.setenv(native.THREADS_VARIABLE, "3")
    assert native.threads() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(native.THREADS_VARIABLE, bad)
        with pytest.raises(ValueError, match="HF_CPT_NATIVE_THREADS must be a positive integer"):
            native.threads()


def test_kernels_built_with_openmp_run_on_the_one_runtime_torch_loaded(tmp_path):
    """Where the compiler takes -fopenmp, the kernels are built with it and their libgomp is the one torch loaded (one
    OpenMP runtime in the process: no second team competing for the cores); `hf-cpt env` says so."""
    import subprocess

    from hf_cpt.diagnostics.environment import environment_report

    compiler = native._compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    source = tmp_path / "probe.c"
    source.write_text("int probe(void) { int n = 0;\n#pragma omp parallel reduction(+:n)\n n += 1; return n; }\n")
    openmp = subprocess.run([compiler, "-fopenmp", "-shared", "-fPIC", str(source), "-o", str(tmp_path / "p.so")],
                            capture_output=True).returncode == 0
    assert native.load("code_kernels") is not None
    assert native._on_openmp_team is openmp
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(runtimes) <= 1, runtimes
    expected = "on torch's OpenMP team" if openmp else "POSIX threads"
    assert environment_report()["threads"].endswith(f"(a C kernel's: {native.threads()}, {expected})")
