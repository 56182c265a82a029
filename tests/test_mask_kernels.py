"""An error zeroed where a mask is set, the mask a bool tensor or packed one bit a value
(hf_cpt/numerics/mask_kernels.py, mask_kernels.c): the bits of a ReLU's and a dropout's backward, natively and by
torch's formula, and the formula wherever the kernel does not serve."""

import pytest
import torch

from hf_cpt.numerics import mask_kernels, native

SPECIAL = [-2.0, -0.0, 0.0, 1e-30, 3.0, float("nan"), float("inf"), -float("inf")]


def _case(dtype: torch.dtype, numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(an error, the bool mask ``output <= 0`` of a ReLU output, autograd's ReLU gradient for them): NaN, infinities
    and signed zeros in both the output and the error."""
    torch.manual_seed(0)
    output = torch.cat([torch.tensor(SPECIAL), torch.randn(numel - 8)]).relu().to(dtype)
    output[:8] = torch.tensor(SPECIAL).to(dtype)  # ReLU outputs are never negative, but the kernel must not care
    error = torch.cat([torch.tensor([-1.0, 2.0, -0.0, float("nan"), -3.0, -0.0, float("inf"), 5.0]),
                       torch.randn(numel - 8)]).to(dtype)
    expected = torch.ops.aten.threshold_backward(error, output, 0)
    return error, output <= 0, expected


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("native_kernel", [True, False])
def test_the_masked_error_is_relus_gradient_bit_for_bit(dtype, native_kernel, monkeypatch):
    if native_kernel and mask_kernels._library() is None:
        pytest.skip("no C compiler on this machine")
    if not native_kernel:
        monkeypatch.setattr(mask_kernels, "_library", lambda: None)
    error, mask, expected = _case(dtype, 1 << 16)
    got = mask_kernels.masked(error, mask)
    assert got.dtype == dtype and got.shape == error.shape and torch.equal(_bits(got), _bits(expected))


def test_the_kernel_serves_large_contiguous_errors_and_its_result_does_not_depend_on_the_threads(monkeypatch):
    """The native kernel is called (the torch formula, made to fail, is not), over 1 to 3 threads; small or
    strided errors take the formula."""
    if mask_kernels._library() is None:
        pytest.skip("no C compiler on this machine")
    error, mask, expected = _case(torch.float32, 3 << 22)  # above the kernel's per-thread share
    formula = torch.Tensor.masked_fill
    monkeypatch.setattr(torch.Tensor, "masked_fill", lambda *a, **k: pytest.fail("the formula ran"))
    for count in (1, 2, 3):
        monkeypatch.setenv(native.THREADS_VARIABLE, str(count))
        assert torch.equal(_bits(mask_kernels.masked(error, mask)), _bits(expected))
    calls = []
    monkeypatch.setattr(torch.Tensor, "masked_fill", lambda *a: calls.append(a) or formula(*a))
    small, small_mask, small_expected = _case(torch.float32, 1000)
    assert torch.equal(_bits(mask_kernels.masked(small, small_mask)), _bits(small_expected))
    strided = error.view(2, -1).t()
    assert torch.equal(_bits(mask_kernels.masked(strided, mask.view(2, -1).t())), _bits(expected.view(2, -1).t()))
    assert len(calls) == 2


def _packed_case(numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a float32 ReLU output with NaN and signed zeros, an error with NaN, infinities and signed zeros)."""
    torch.manual_seed(0)
    output = torch.randn(numel).relu()
    output[:8] = torch.tensor(SPECIAL)
    error = torch.randn(numel)
    error[:8] = torch.tensor([-1.0, 2.0, -0.0, float("nan"), -3.0, -0.0, float("inf"), 5.0])
    return output, error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("native_kernel", [True, False])
def test_a_packed_mask_holds_output_le_zero_and_gives_relus_gradient_bit_for_bit(dtype, native_kernel, monkeypatch):
    """One bit per value, a count of values that is no multiple of 8: unpacked, the bool mask ``output <= 0``; the
    masked error, natively and by the formula (which the kernel's absence leaves), autograd's ReLU gradient."""
    if mask_kernels._library() is None:
        pytest.skip("no C compiler on this machine")
    output, error = _packed_case((1 << 16) + 5)
    bits = mask_kernels.pack_nonpositive(output)
    assert bits.dtype == torch.uint8 and bits.numel() == ((1 << 16) + 5 + 7) // 8
    assert torch.equal(mask_kernels.unpack(bits, output.shape), output <= 0)
    square = output[: 1 << 16].view(-1, 2).contiguous()  # the output of a layer whose error comes strided
    square_bits = mask_kernels.pack_nonpositive(square)
    if not native_kernel:
        monkeypatch.setattr(mask_kernels, "_library", lambda: None)
    error = error.to(dtype)
    expected = torch.ops.aten.threshold_backward(error, output.to(dtype), 0)
    got = mask_kernels.masked_bits(error, bits)
    assert got.dtype == dtype and torch.equal(_bits(got), _bits(expected))
    strided = error[: 1 << 16].view(2, -1).t()  # not contiguous: the formula, reading the mask in the output's order
    assert not strided.is_contiguous() and strided.shape == square.shape
    assert torch.equal(_bits(mask_kernels.masked_bits(strided, square_bits)),
                       _bits(torch.ops.aten.threshold_backward(strided, square.to(dtype), 0)))
    with pytest.raises(ValueError, match="does not hold"):
        mask_kernels.masked_bits(error[:-8], bits)


def test_packing_serves_large_contiguous_float32_outputs_and_does_not_depend_on_the_threads(monkeypatch):
    if mask_kernels._library() is None:
        pytest.skip("no C compiler on this machine")
    output, error = _packed_case((3 << 22) + 3)  # above the kernels' per-thread shares
    expected_bits, expected = None, torch.ops.aten.threshold_backward(error, output, 0)
    for count in (1, 2, 3):
        monkeypatch.setenv(native.THREADS_VARIABLE, str(count))
        bits = mask_kernels.pack_nonpositive(output)
        assert expected_bits is None or torch.equal(bits, expected_bits)
        expected_bits = bits
        assert torch.equal(_bits(mask_kernels.masked_bits(error, bits)), _bits(expected))
    assert mask_kernels.pack_nonpositive(output[:1000]) is None  # small: the caller keeps a bool mask
    assert mask_kernels.pack_nonpositive(output.to(torch.bfloat16)) is None
    assert mask_kernels.pack_nonpositive(output[: 1 << 16].view(2, -1).t()) is None  # not contiguous


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
@pytest.mark.parametrize("native_kernel", [True, False])
def test_a_packed_dropout_mask_gives_native_dropouts_gradient_bit_for_bit(p, native_kernel, monkeypatch):
    """`pack_flags` packs native_dropout's bool mask (a count no multiple of 8); `dropout_backward_bits` gives
    autograd's gradient of native_dropout bit for bit, NaN, infinities and negative errors at dropped elements
    included."""
    if mask_kernels._library() is None:
        pytest.skip("no C compiler on this machine")
    torch.manual_seed(0)
    x = torch.randn((1 << 16) + 3, requires_grad=True)
    output, mask = torch.native_dropout(x, p, True)
    error = torch.randn(x.shape)
    error[:5] = torch.tensor([float("nan"), -1.0, float("inf"), -0.0, -float("inf")])
    (expected,) = torch.autograd.grad(output, x, error)
    bits = mask_kernels.pack_flags(mask)
    assert bits.numel() == (x.numel() + 7) // 8 and torch.equal(mask_kernels.unpack(bits, mask.shape), mask)
    if not native_kernel:
        monkeypatch.setattr(mask_kernels, "_library", lambda: None)
    got = mask_kernels.dropout_backward_bits(error, bits, 1.0 / (1.0 - p))
    assert torch.equal(_bits(got), _bits(expected))
    assert mask_kernels.pack_flags(mask[:1000]) is None  # small (or, without the kernel, any): a bool mask is kept
