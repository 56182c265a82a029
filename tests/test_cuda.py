"""On a GPU, as most users train: `CPTTrainer` with bf16 mixed precision on CUDA, checkpoints saved there and loaded
by a fresh process on the GPU and on a CPU, weight codes equal to the CPU's and error quantizers on the CPU's codes.
Skipped where torch sees no CUDA device (CI); run on a GPU machine with ``pytest tests/test_cuda.py``."""

from __future__ import annotations

import os

import pytest
import torch

from hf_cpt import CPTConfig, CPTTrainer, backends, set_eval_precision
from hf_cpt.convert import quant_layers
from hf_cpt.numerics import error_kernels
from hf_cpt.numerics.error_kernels import KERNEL_SOURCES
from hf_cpt.numerics.fake_quant import quantize_codes

from .test_composition import COMPOSITIONS
from .test_serialization_fresh_process import FAMILIES, TOLERANCE, _data, _Rows, _run_loader

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# A model trained on a GPU and loaded on a CPU runs its float products on other kernels (other summation orders):
# the codes and ranges are the trained ones, the outputs agree to float rounding, not bit for bit.
CROSS_DEVICE_TOLERANCE = 1e-4
# A child process's environment with the CUDA backend's kernels on
KERNELS_ON = {**os.environ, backends.CUDA_KERNELS_VARIABLE: "1"}

CASES = [
    ("bert-default", "bert", {}),
    ("gpt2-attention", "gpt2", {"quantize_attention": True}),
    ("llama-embeddings-attention-8", "llama", {"quantize_embeddings": True, "quantize_attention": True,
                                               "attention_bits": 8}),
    ("vit-default", "vit", {}),
]


def _train_on_gpu_and_save(name, family, fields, root) -> tuple[list[dict], dict]:
    from transformers import TrainingArguments

    torch.manual_seed(0)
    model, kind, auto_class = FAMILIES[family]()
    rows = _data(kind, family, 48, seed=1)
    dataset = _Rows([{k: v[i] for k, v in rows.items()} for i in range(48)])
    args = TrainingArguments(output_dir=str(root / name / "run"), per_device_train_batch_size=8, learning_rate=1e-3,
                             max_steps=12, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
                             logging_steps=4, bf16=True)
    trainer = CPTTrainer(model=model, args=args, train_dataset=dataset,
                         cpt_config=CPTConfig(bits_min=4, bits_max=8, num_cycles=2, **fields))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    # accelerate wraps a mixed-precision model's forward in autocast; the checkpoint's outputs are the FP32 forward's
    model = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)
    facts = {"device": next(model.parameters()).device.type,
             "moved": sum(not torch.equal(p, before[n]) for n, p in model.named_parameters()),
             "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
             "bits": [h.get("cpt/bits") for h in trainer.state.log_history if "loss" in h]}
    model.eval()
    inputs = {k: v.cuda() for k, v in _data(kind, family, 6, seed=2).items() if k != "labels"}
    set_eval_precision(model, 8)
    with torch.no_grad():
        expected = model(**inputs).logits.float().cpu()
    path = root / name / "8bit"
    trainer.save_model(str(path), bits=8)
    torch.save({"inputs": {k: v.cpu() for k, v in inputs.items()}, "expected": expected}, root / name / "io.pt")
    entry = {"path": str(path), "io": str(root / name / "io.pt"), "auto_class": auto_class, "bits": 8}
    return [entry | {"name": f"{name} on cuda", "load_kwargs": {"device_map": "cuda"}},
            entry | {"name": f"{name} on cpu"}], facts


def test_cpt_trainer_trains_in_bf16_on_a_gpu_and_its_checkpoints_reload_on_gpu_and_cpu(tmp_path):
    entries, facts = [], {}
    for name, family, fields in CASES:
        case_entries, facts[name] = _train_on_gpu_and_save(name, family, fields, tmp_path)
        entries += case_entries
    for name, case in facts.items():
        assert case["device"] == "cuda", name
        assert case["moved"] > 0 and all(torch.isfinite(torch.tensor(case["losses"]))), (name, case)
        assert len(set(case["bits"])) > 1, (name, case["bits"])  # the schedule cycled
    results = _run_loader(entries, tmp_path / "manifest.json")
    for name, row in results.items():
        print(f"{name:40s} {row['device']:8s} max rel diff {row['max_rel_diff']:.2e}")
    assert {row["device"].split(":")[0] for row in results.values()} == {"cuda", "cpu"}
    on_gpu = {n: r["max_rel_diff"] for n, r in results.items() if r["device"].startswith("cuda")}
    on_cpu = {n: r["max_rel_diff"] for n, r in results.items() if r["device"] == "cpu"}
    assert all(value <= TOLERANCE for value in on_gpu.values()), on_gpu
    assert all(value <= CROSS_DEVICE_TOLERANCE for value in on_cpu.values()), on_cpu
    assert all(row["layers_frozen"] > 0 for row in results.values())


def test_weight_codes_on_a_gpu_equal_the_cpus():
    torch.manual_seed(0)
    weight = torch.randn(256, 384) * torch.logspace(-3, 1, 256).view(-1, 1)
    for bits in (3, 4, 6, 8):
        for channel_dim in (0, 1):
            on_cpu = quantize_codes(weight, bits, channel_dim)
            on_gpu = quantize_codes(weight.cuda(), bits, channel_dim)
            for cpu_part, gpu_part in zip(on_cpu, on_gpu):
                assert torch.equal(cpu_part, gpu_part.cpu()), (bits, channel_dim)


@pytest.mark.parametrize("granularity, grid", [("token", "minmax"), ("tensor", "minmax"), ("token", "symmetric"),
                                               ("tensor", "symmetric")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gpus_error_quantizers_pick_the_cpus_codes(granularity, grid, dtype):
    """The hashed noise depends only on the element's index and the seed, so the same error gets the same codes on
    both devices: the formula run eagerly on the GPU gives the CPU's values bit for bit; the GPU's compiled kernel
    (which fuses multiply-adds) gives nearly every value within a quarter step (bf16 within its own rounding: it
    cannot hold an 8-bit grid exactly), and the rare value whose noisy code sat on a rounding boundary one step off.
    """
    source, levels_of = KERNEL_SOURCES[granularity, grid]
    kernel = error_kernels.fused_kernel(torch.device("cuda"), granularity, grid)
    torch.manual_seed(0)
    for bits, shape in [(3.0, (1024, 96)), (4.0, (333, 257)), (8.0, (4096, 48))]:
        grad = (torch.randn(shape) * torch.logspace(-5, 0, shape[0]).view(-1, 1)).to(dtype)
        grad[-7:] = 0.0
        magnitude = grad.float().abs().amax(-1, keepdim=True)  # one range per row
        if granularity == "tensor":
            grad, magnitude = grad.reshape(-1), magnitude.max()
        levels, seed = levels_of(torch.tensor(bits)), torch.tensor(int(bits) * 977, dtype=torch.int32)
        expected = source(grad, levels, seed)
        assert torch.equal(source(grad.cuda(), levels.cuda(), seed.cuda()).cpu(), expected), (bits, shape)
        got = kernel(grad.cuda(), levels.cuda(), seed.cuda()).cpu()
        assert got.dtype == grad.dtype
        difference = (got.float() - expected.float()).abs().view(magnitude.shape[0] if magnitude.dim() else 1, -1)
        # A grid step lies between magnitude / 2^bits and magnitude * 2^(2 - bits). Nearly every value is within a
        # quarter step (or two units of the dtype); the rare value whose noisy code sat on a rounding boundary may
        # round to the neighbouring code, one step away, never further.
        near = difference <= magnitude * max(2.0 ** -(bits + 2), 2 * torch.finfo(dtype).eps)
        assert near.float().mean() >= 0.999, (bits, shape, float(near.float().mean()))
        assert (difference <= magnitude * 2.0 ** (2 - bits)).all(), (bits, shape, float(difference.max()))
        if granularity == "token":  # padding rows of zeros stay exactly zero
            assert not got[-7:].any()


def test_the_layers_read_the_current_bits_on_the_gpu():
    from hf_cpt.nn import PrecisionState

    state, cuda = PrecisionState(), torch.device("cuda")
    for bits in (4, 7, 5):
        state.set(bits, 8)
        assert state.on_device(state.bits, cuda).item() == bits and state.on_device(state.grad_bits, cuda).item() == 8


def test_quantized_layers_follow_the_model_to_the_gpu():
    """A model quantized on the CPU and moved with ``.to("cuda")`` (what Trainer does) computes on the GPU: every
    quantized layer's buffers move with it, and one quantized training step runs there."""
    from hf_cpt import quantize_model, set_precision

    model, _, _ = FAMILIES["bert"]()
    quantize_model(model, CPTConfig(quantize_attention=True))
    model.cuda().train()
    set_precision(model, 6, 8)
    stray = [f"{name}.{buffer}" for name, layer in quant_layers(model)
             for buffer, tensor in layer.named_buffers(recurse=False) if tensor.device.type != "cuda"]
    assert not stray, stray
    batch = {k: v.cuda() for k, v in _data("text-cls", "bert", 8, seed=3).items()}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(**batch).loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_a_steady_gpu_step_copies_nothing_from_the_host():
    """The bit-widths live on the CPU; a training step on the GPU reads their per-device copies and what is derived
    from them (`hf_cpt.numerics.derived`), so once the bits are set no step copies from the host (each such copy
    blocks until the GPU's queue drains), and changing them costs a few copies for the whole model."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_cpt import quantize_model, set_precision

    class HostCopies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            sources = [a for a in args if isinstance(a, torch.Tensor) and a.device.type == "cpu"]
            if func.overloadpacket.__name__ in ("_to_copy", "copy_") and sources and isinstance(out, torch.Tensor) \
                    and out.device.type == "cuda":
                self.count += 1
            return out

    batch = {k: v.cuda() for k, v in _data("text-cls", "bert", 8, seed=3).items()}

    def step(model) -> int:
        with HostCopies() as copies, torch.autocast("cuda", dtype=torch.bfloat16):
            model(**batch).loss.backward()
        return copies.count

    torch.manual_seed(0)
    plain = FAMILIES["bert"]()[0].cuda().train()
    step(plain)
    plain_copies = step(plain)  # whatever the model itself copies per step
    model = FAMILIES["bert"]()[0]
    quantize_model(model, CPTConfig(quantize_attention=True))
    model.cuda().train()
    set_precision(model, 6, 8)
    layers = len(list(quant_layers(model)))
    assert step(model) - plain_copies < layers  # the first step makes each device copy once, not once per layer
    assert step(model) == plain_copies
    set_precision(model, 5, 8)
    assert 0 < step(model) - plain_copies < layers


def test_a_loaded_checkpoint_moved_to_the_gpu_keeps_its_frozen_codes(tmp_path):
    """A packed checkpoint loaded on the CPU and moved with ``.to("cuda")``: the weights' values are unchanged, so
    the layers keep computing with the stored codes (the fingerprint of the master weight moves with the model)."""
    from transformers import AutoModelForSequenceClassification

    from hf_cpt import quantize_model, save_quantized, set_precision

    model, _, _ = FAMILIES["bert"]()
    quantize_model(model, CPTConfig())
    set_precision(model, 8, 8)
    save_quantized(model, tmp_path, 8, model_card=False)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    batch = {k: v for k, v in _data("text-cls", "bert", 8, seed=3).items() if k != "labels"}
    with torch.no_grad():
        expected = loaded(**batch).logits
    loaded.cuda()
    assert all(layer.frozen_codes(8) is not None for _, layer in quant_layers(loaded))
    with torch.no_grad():
        got = loaded(**{k: v.cuda() for k, v in batch.items()}).logits.cpu()
    assert float((got - expected).abs().max() / expected.abs().max()) <= TOLERANCE


def test_the_operand_kernel_gives_the_reference_codes_and_values_bit_for_bit_on_the_gpu():
    """The CUDA backend's Triton kernel compiled for this GPU (no interpreter): the same 72 cases as on CPU."""
    from .test_cuda_kernels import run_comparison

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    assert run_comparison("cuda", env) == {"checked": 3 * 6 * 2 * 2 + 2 * 6 * 2}


def test_the_backward_kernels_give_the_reference_codes_and_the_int8_products_its_gradients_on_the_gpu():
    from .test_cuda_kernels import BACKWARD_COMPARISON, run_comparison

    result = run_comparison("cuda", KERNELS_ON, BACKWARD_COMPARISON)
    assert (result["errors"], result["blocks"]) == (2 * 6 * 2, 3 * 2)


def test_every_kernel_is_a_custom_op_that_passes_opcheck_on_the_gpu():
    from .test_cuda_kernels import OPCHECK, run_comparison

    assert run_comparison("cuda", dict(os.environ), OPCHECK) == {"checked": 7}


def test_the_trainer_trains_on_the_cuda_backend_with_int8_backward_products_and_saves_what_loads():
    from .test_cuda_kernels import TRAINER_RUN, run_comparison

    result = run_comparison("cuda", KERNELS_ON, TRAINER_RUN)
    assert len(result["losses"]) == 2 and result["moved"] > 0 and result["gap"] < 1e-4


@pytest.fixture
def cuda_backend(monkeypatch):
    """The CUDA backend's kernels on for this test (``HF_CPT_CUDA_KERNELS=1``), chosen afresh before and after."""
    monkeypatch.setenv(backends.CUDA_KERNELS_VARIABLE, "1")
    monkeypatch.delitem(backends._BACKENDS, "cuda", raising=False)
    assert backends.backend_for("cuda").name == "cuda"
    yield
    monkeypatch.delitem(backends._BACKENDS, "cuda", raising=False)


def test_a_cpt_step_on_the_cuda_backend_replays_in_a_cuda_graph_and_compiles_once_across_bit_widths(cuda_backend):
    """Issue 74's capture and compile checks for a quantized MLP on the CUDA backend (its kernels are custom ops): a
    whole training step captured once and replayed gives the eager step's weight gradient's scale of values, and
    a compiled step keeps one graph through bits 3..8."""
    from torch._dynamo.utils import counters

    from hf_cpt import quantize_model, set_precision

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
    quantize_model(model, CPTConfig(quant_scheme="per-token", weight_gradient_product="int8",
                                    input_gradient_product="int8"))
    set_precision(model, 6, 8)
    x = torch.randn(64, 256, device="cuda")

    def step() -> None:
        model(x).square().mean().backward()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up outside the graph
            model.zero_grad(set_to_none=False)
            step()
    torch.cuda.current_stream().wait_stream(stream)
    eager = model[0].weight.grad.clone()
    graph = torch.cuda.CUDAGraph()
    model.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        step()
    for _ in range(2):
        model.zero_grad(set_to_none=False)
        graph.replay()
    torch.cuda.synchronize()
    replayed = model[0].weight.grad
    assert torch.isfinite(replayed).all() and ((replayed - eager).norm() / eager.norm()) < 0.1  # other noise draws

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model)
    for bits in (3, 4, 5, 6, 7, 8, 3):
        set_precision(model, bits, 8)
        compiled(x).square().mean().backward()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()


@pytest.mark.parametrize("composition", sorted(COMPOSITIONS))
def test_cpt_composes_with_the_stack_on_the_cuda_backend(composition, tmp_path, cuda_backend):
    """Issue 74's compositions on a GPU, each as tests/test_composition.py runs it on the CPU: peft LoRA (trained,
    reloaded, merged and exported), bf16 autocast, gradient checkpointing, gradient accumulation, torch.compile."""
    COMPOSITIONS[composition](tmp_path, "cuda")


def test_fsdp2_on_one_gpu_rank_trains_as_ddp_does_on_the_cuda_backend(tmp_path):
    """FSDP2's sharded parameters (`fully_shard`, one nccl rank) train as DDP does, on the CUDA backend."""
    from .test_distributed import fsdp2_matches_ddp

    fsdp2_matches_ddp(tmp_path, world=1, device="cuda", env=KERNELS_ON)
