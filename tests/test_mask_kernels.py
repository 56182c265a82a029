"""An error zeroed where a bool mask is set (hf_cpt/numerics/mask_kernels.py, mask_kernels.c): the bits of a ReLU's
backward, natively and by torch's formula, and the formula wherever the kernel does not serve."""

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
