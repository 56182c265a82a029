"""The CUDA backend's Triton kernels (an operand's codes and values; values rebuilt from codes; the backward's error
codes, blocked operands and int8 weight gradient) against the reference formulas, bit for bit where the formula is
the same, on CPU tensors under Triton's interpreter (no GPU needed); tests/test_cuda.py runs the same comparisons on a
GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
# a per-token operand's range and codes in one pass (the layers' shared input) against the range, then the operand
for dtype in (torch.float32, torch.bfloat16):
    x = (torch.randn(3, 37, 300) * 3).to(dtype).to(device)
    x[1, 5] = 0.0
    for bits in range(3, 9):
        b = torch.tensor(float(bits))
        for values in (True, False):
            (low, high), (got, codes) = cuda.token_operand(x, -1, b, values)
            want_low, want_high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
            want, want_codes = reference.operand(x, want_low, want_high, b, values)
            assert torch.equal(low.cpu(), want_low.cpu()) and torch.equal(high.cpu(), want_high.cpu())
            assert all(torch.equal(g.cpu(), w.reshape(g.shape).cpu()) for g, w in zip(codes, want_codes)), bits
            assert (got is None) == (want is None) and (got is None or torch.equal(got.cpu(), want.cpu()))
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

# The backward's kernels: the per-token error's codes (the fused error kernels' formula and hashed noise, bits 3..8,
# stochastic and nearest, an all-zero row, bf16 / fp32 errors), operands quantized in blocks of tokens (a last block
# shorter than 128 tokens), the blocked int8 GEMM against the option's float definition, and a quantized BERT's
# gradients with both int8 products on this backend against the reference backend.
BACKWARD_COMPARISON = """
import copy, json, sys, torch
from hf_cpt.backends import CPUBackend, register_backend
from hf_cpt.backends.cuda import CUDABackend
from hf_cpt.backends.cuda.backward_kernels import block_scaled_matmul, row_codes, token_block_codes
from hf_cpt.backends.reference import ReferenceBackend
from hf_cpt.numerics import backward_products as bp
from hf_cpt.numerics.error_kernels import hashed_stochastic_quantize, noise_seed, symmetric_levels
from hf_cpt.numerics.errors import ErrorQuantization
from hf_cpt.numerics.fake_quant import num_levels
device = sys.argv[1]
torch.manual_seed(0)
seed = torch.tensor(12345, dtype=torch.int32, device=device)
checked = {"errors": 0, "blocks": 0}
for dtype in (torch.float32, torch.bfloat16):
    grad = (torch.randn(37, 300) * 1e-3).to(dtype).to(device)
    grad[5] = 0.0
    for bits in range(3, 9):
        b = torch.tensor(float(bits), device=device)
        for noise in (seed, None):
            codes, scale, minimum = row_codes(grad, num_levels(b).float(), noise)[:3]
            want = bp.error_codes(grad, b, True, noise)
            assert all(torch.equal(got.cpu(), w.cpu()) for got, w in zip((codes, scale, minimum), want)), (dtype, bits)
            if noise is not None:  # the values are the fused error kernels' bit for bit
                fused = hashed_stochastic_quantize(grad.float(), num_levels(b), noise, True, False)
                assert torch.equal((codes.float() * scale + minimum).cpu(), fused.cpu())
            checked["errors"] += 1
        # the backend's quantized error (codes and values in one pass): the fused kernels' values for the seed it draws
        scheme = ErrorQuantization(granularity="token", range="minmax")
        torch.manual_seed(bits)
        got = CUDABackend().error(grad, b, scheme, -1)
        torch.manual_seed(bits)
        want = hashed_stochastic_quantize(grad.float(), num_levels(b), noise_seed(grad.device), True, False)
        assert got.dtype == dtype and torch.equal(got.cpu(), want.to(dtype).cpu()), (dtype, bits)
x = torch.randn(300, 70, device=device)
for bits in (3, 5, 8):
    b = torch.tensor(float(bits), device=device)
    for noise in (seed, None):
        codes, scales = token_block_codes(x, symmetric_levels(b).float(), noise)
        assert codes.dtype == torch.int8 and scales.shape == (3, 70)
        rebuilt = codes.float() * scales.repeat_interleave(128, 0)[:300]
        assert torch.equal(rebuilt.cpu(), bp.token_blocks(x, b, noise).cpu()), bits
        checked["blocks"] += 1
error = torch.randn(300, 48, device=device)
eight = torch.tensor(8.0, device=device)
error_codes, error_scales = token_block_codes(error, symmetric_levels(eight).float(), seed)
input_codes, input_scales = token_block_codes(x, symmetric_levels(eight).float(), None)
got = block_scaled_matmul(error_codes, error_scales, input_codes, input_scales)
want = bp.weight_gradient(error, x, eight, seed)
checked["gemm_error"] = ((got - want).abs().max() / want.abs().max()).item()
assert checked["gemm_error"] < 1e-5, checked
from transformers import BertConfig, BertForSequenceClassification
from hf_cpt import CPTConfig, quantize_model, set_precision
torch.manual_seed(0)
base = BertForSequenceClassification(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=128, vocab_size=100, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).to(device)
ids, labels = torch.randint(0, 100, (4, 40), device=device), torch.tensor([0, 1, 0, 1], device=device)
grads, cuda = {}, CUDABackend()
for name, backend in (("reference", ReferenceBackend()), ("cuda", cuda)):
    register_backend(device, backend)
    model = copy.deepcopy(base)
    quantize_model(model, CPTConfig(bits_min=6, bits_max=6, schedule="static", integer_matmul=True,
                                    input_gradient_product="int8", weight_gradient_product="int8"))
    model.train()
    set_precision(model, 6, 8)
    torch.manual_seed(1)
    model(input_ids=ids, labels=labels).loss.backward()
    grads[name] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
register_backend(device, CPUBackend() if device == "cpu" else None)
# (the attention keys' bias gets no gradient in exact arithmetic, softmax being shift-invariant: float noise alone)
checked["model_error"] = max(((grads["cuda"][n] - g).norm() / g.norm()).item() for n, g in grads["reference"].items()
                             if not n.endswith("key.bias"))
checked["fallbacks"] = cuda.fallbacks
assert checked["model_error"] < 1e-4, checked
print(json.dumps(checked))
"""

# Every kernel is a torch.library custom op with a fake implementation: torch.library.opcheck (schema, fake tensors,
# autograd registration, AOT dispatch) on each, at shapes that take every branch (per row and per tensor ranges,
# stochastic and nearest rounding, a last block of tokens shorter than 128).
OPCHECK = """
import json, sys, torch
from hf_cpt.backends.cuda import backward_kernels, kernels
device = sys.argv[1]
x = torch.randn(6, 40, device=device)
rows_min, rows_scale = x.amin(-1, keepdim=True), (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / 255
codes = torch.randint(0, 255, (6, 40), dtype=torch.uint8, device=device)
levels, seed = torch.tensor(255.0, device=device), torch.tensor(7, dtype=torch.int32, device=device)
blocks = torch.randint(-127, 127, (130, 24), dtype=torch.int8, device=device)
cases = [
    (kernels._codes_op, (x, rows_min, rows_scale, levels, True, True)),
    (kernels._codes_op, (x, x.amin().reshape(1), rows_scale[:1, 0].contiguous(), levels, False, False)),
    (kernels._restore_op, (codes, rows_min, rows_scale, torch.bfloat16, True)),
    (backward_kernels._row_codes_op, (x, levels, seed, True, False)),
    (backward_kernels._row_codes_op, (x.bfloat16(), levels, seed, False, True)),
    (backward_kernels._token_block_op, (torch.randn(130, 24, device=device), torch.tensor(127.0, device=device),
                                        seed, True)),
    (backward_kernels._block_scaled_op, (blocks, torch.rand(2, 24, device=device), blocks[:, :16].contiguous(),
                                         torch.rand(2, 16, device=device))),
]
results = [torch.library.opcheck(op, args) for op, args in cases]
assert all(set(r.values()) == {"SUCCESS"} for r in results), results
print(json.dumps({"checked": len(results)}))
"""

# The backend under the Trainer, as a user runs it: gradient accumulation (each weight's codes reused within a step),
# the int8 backward products, the cycle through 4..8 bits, then a save that loads back with the C kernels.
TRAINER_RUN = """
import json, sys, tempfile, torch
from transformers import BertForSequenceClassification, TrainingArguments
from hf_cpt import CPTConfig, CPTTrainer, set_eval_precision
from hf_cpt.backends import CPUBackend, register_backend
from hf_cpt.backends.cuda import CUDABackend
from tests.helpers import tiny_bert_config
device = sys.argv[1]
backend = CUDABackend()
register_backend(device, backend)
ids = torch.randint(5, 128, (16, 16), generator=torch.Generator().manual_seed(0))
data = [{"input_ids": row, "labels": int(row[0] % 3)} for row in ids]
torch.manual_seed(0)
model = BertForSequenceClassification(tiny_bert_config(layers=2))
before = {n: p.detach().clone() for n, p in model.named_parameters()}
folder = tempfile.mkdtemp()
args = TrainingArguments(output_dir=folder, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2,
                         logging_steps=1, save_strategy="no", report_to="none", use_cpu=device == "cpu",
                         disable_tqdm=True, seed=0, learning_rate=1e-3)
config = CPTConfig(bits_min=4, num_cycles=1, input_gradient_product="int8", weight_gradient_product="int8",
                   fidelity_threshold=None)
trainer = CPTTrainer(model=model, args=args, train_dataset=data, cpt_config=config)
trainer.train()
losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
moved = sum(not torch.equal(p.detach().cpu(), before[n]) for n, p in model.named_parameters())
trainer.save_model(folder + "/out", bits=8)
register_backend(device, CPUBackend() if device == "cpu" else None)
model = model.cpu().eval()
set_eval_precision(model, 8)
loaded = BertForSequenceClassification.from_pretrained(folder + "/out").eval()
with torch.no_grad():
    gap = (loaded(input_ids=ids[:4]).logits - model(input_ids=ids[:4]).logits).abs().max().item()
print(json.dumps({"losses": losses, "moved": moved, "fallbacks": backend.fallbacks, "gap": gap}))
"""


def run_comparison(device: str, env: dict, script: str = COMPARISON) -> dict:
    run = subprocess.run([sys.executable, "-c", script, device], capture_output=True, text=True, env=env,
                         timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_operand_kernel_gives_the_reference_codes_and_values_bit_for_bit_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    assert run_comparison("cpu", env) == {"checked": 3 * 6 * 2 * 2 + 2 * 6 * 2}


@pytest.mark.slow
def test_the_backward_kernels_give_the_reference_codes_and_the_int8_products_its_gradients_in_the_interpreter():
    """Bit for bit: the error's codes and noise, the blocked operands; the int8 weight gradient within float32
    rounding of its float definition; a BERT's gradients on this backend within 1e-4 of the reference backend's (the
    forward's epilogues round differently and an int8 product of the pooler's 4 rows falls back to float)."""
    result = run_comparison("cpu", {**os.environ, "TRITON_INTERPRET": "1"}, BACKWARD_COMPARISON)
    assert (result["errors"], result["blocks"]) == (2 * 6 * 2, 3 * 2)
    assert result["fallbacks"] > 0  # the classifier's and pooler's 4 rows: fewer than an int8 GEMM takes


@pytest.mark.slow
def test_the_trainer_trains_on_the_cuda_backend_with_int8_backward_products_and_saves_what_loads():
    result = run_comparison("cpu", {**os.environ, "TRITON_INTERPRET": "1"}, TRAINER_RUN)
    assert len(result["losses"]) == 2 and all(0 < loss < 10 for loss in result["losses"])
    assert result["moved"] > 0 and result["fallbacks"] > 0  # the pooler's and classifier's 4 rows: float products
    assert result["gap"] < 1e-4  # the checkpoint computes what the trained model computes at 8 bits


@pytest.mark.slow
def test_every_kernel_is_a_custom_op_that_passes_opcheck_in_the_interpreter():
    assert run_comparison("cpu", {**os.environ, "TRITON_INTERPRET": "1"}, OPCHECK) == {"checked": 7}


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
