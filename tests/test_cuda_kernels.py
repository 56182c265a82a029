"""The CUDA backend's Triton kernels (an operand's codes and values; values rebuilt from codes) against the reference
formulas, bit for bit, on CPU tensors under Triton's interpreter (no GPU needed); tests/test_cuda.py runs the same
comparison on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

# Every case a layer meets: per-token ranges (keepdim, as the layers pass them) and one range per tensor, bits 3..8,
# float32 / bf16 / fp16 inputs, an all-zero row (scale clamped to 1e-8), rows not a multiple of the block, codes alone.
COMPARISON = """
import json, sys, torch
from hf_cpt.backends.cuda import CUDABackend
from hf_cpt.backends.reference import ReferenceBackend
device = sys.argv[1]
cuda, reference = CUDABackend(), ReferenceBackend()
torch.manual_seed(0)
checked = 0
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    x = (torch.randn(3, 37, 300) * 3).to(dtype).to(device)
    x[1, 5] = 0.0
    flat = x.float()
    ranges = [(flat.amin(-1, keepdim=True), flat.amax(-1, keepdim=True)), (flat.amin(), flat.amax())]
    for bits in range(3, 9):
        b = torch.tensor(float(bits))
        for low, high in ranges:
            for values in (True, False):
                got, (codes, scale, minimum) = cuda.operand(x, low, high, b, values)
                want, (want_codes, want_scale, want_minimum) = reference.operand(x, low, high, b, values)
                assert torch.equal(codes.cpu(), want_codes.reshape(codes.shape).cpu()), (dtype, bits, values)
                assert torch.equal(scale.cpu(), want_scale.cpu()) and torch.equal(minimum.cpu(), want_minimum.cpu())
                assert (got is None) == (want is None) and (got is None or torch.equal(got.cpu(), want.cpu()))
                assert got is None or got.dtype == dtype
                rebuilt = cuda.restore(codes, scale, minimum, dtype)  # what a backward rebuilds from saved codes
                assert torch.equal(rebuilt.cpu(), reference.restore(want_codes, want_scale, want_minimum, dtype).cpu())
                checked += 1
# per-column ranges of a square weight (GPT-2's Conv1D): not rows, whatever their count; the reference serves them
square = torch.randn(64, 64).to(device)
low, high = square.amin(0, keepdim=True), square.amax(0, keepdim=True)
got, codes = cuda.operand(square, low, high, torch.tensor(8.0))
want, want_codes = reference.operand(square, low, high, torch.tensor(8.0))
assert torch.equal(got.cpu(), want.cpu())
assert torch.equal(cuda.restore(*codes, torch.float32).cpu(), reference.restore(*want_codes, torch.float32).cpu())
print(json.dumps({"checked": checked}))
"""


def run_comparison(device: str, env: dict) -> dict:
    run = subprocess.run([sys.executable, "-c", COMPARISON, device], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_operand_kernel_gives_the_reference_codes_and_values_bit_for_bit_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    assert run_comparison("cpu", env) == {"checked": 3 * 6 * 2 * 2}


def test_the_cuda_backend_serves_cuda_tensors_only_when_enabled(monkeypatch):
    """Until the kernels' test has passed on a GPU, CUDA tensors get the reference unless HF_CPT_CUDA_KERNELS=1."""
    from hf_cpt import backends
    from hf_cpt.backends.cuda import CUDABackend

    for value, expected in ((None, backends.ReferenceBackend), ("1", CUDABackend)):
        monkeypatch.delitem(backends._BACKENDS, "cuda", raising=False)
        if value is None:
            monkeypatch.delenv("HF_CPT_CUDA_KERNELS", raising=False)
        else:
            monkeypatch.setenv("HF_CPT_CUDA_KERNELS", value)
        assert type(backends.backend_for("cuda")) is expected
    monkeypatch.delitem(backends._BACKENDS, "cuda", raising=False)
