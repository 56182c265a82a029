"""A quantized Linear's training step (forward + backward), then whole models' training steps, on a GPU against bf16
autocast (issues 73 and 74).

Per (tokens, in, out) shape: bf16 (autocast, the user's baseline), CPT on the CUDA backend with the default backward
numerics (``cpt-default``) and with both backward products on int8 (``cpt-fastest``) at 8 and 4 bits, CPT on the
reference backend (``cpt-reference``), and torchao's int8 mixed-precision training and float8 training where
torchao imports (wheels carried to the GPU machine). Every variant runs under bf16 autocast with float32 weights, as a
user's ``bf16=True`` run. Step times are medians of interleaved repeats after warm-up (CUDA events); peak memory by
``torch.cuda.max_memory_allocated`` over one step; bytes saved for the backward by a saved-tensor hook (parameters
not counted). Rows go to ``--output`` (a JSON list) after every shape; rows already there are kept (resumable), and
``python bench/report.py`` renders docs/benchmarks.md's GPU section from ``bench/results/gpu.json``.

Model rows (``--part models``): one training step (forward, backward, AdamW) of a 1.1B Llama-style model (random
weights, seq 2048, batch 8), BERT-base (seq 512, batch 32), GPT-2 medium (seq 1024, batch 8), ViT-B/16 (batch 128),
ResNet-50 (batch 256) and the MiniLM fine-tune's shape (seq 128, batch 32), bf16 and CPT 4-8/8 (default settings, at
4 bits), eager and ``torch.compile``d, interleaved; peak memory as what the variant keeps between steps (parameters,
gradients, optimizer state) plus what one step adds.

    HF_CPT_CUDA_KERNELS=1 python bench/gpu.py              # one H100/H200, under 5 minutes
    python bench/gpu.py --device cpu --smoke                # the script's own check on a CPU (tests/test_bench.py)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from hf_cpt import CPTConfig, quantize_model, set_precision  # noqa: E402
from hf_cpt.backends import REFERENCE, backend_for, register_backend  # noqa: E402

DEFAULT_OUTPUT = os.path.join(ROOT, "bench", "results", "gpu.json")
SHAPES = [(16384, 4096, 4096), (16384, 4096, 11008), (8192, 1024, 4096), (4096, 384, 1536)]
SMOKE_SHAPES = [(256, 64, 96)]
# (variant, bits, CPTConfig fields beyond the static schedule at those bits)
CPT_VARIANTS = [("cpt-default", 8, {}), ("cpt-default", 4, {}),
                ("cpt-fastest", 8, {"input_gradient_product": "int8", "weight_gradient_product": "int8"}),
                ("cpt-fastest", 4, {"input_gradient_product": "int8", "weight_gradient_product": "int8"}),
                ("cpt-reference", 8, {})]


class Timer:
    """Elapsed seconds of a callable: CUDA events on a GPU, the wall clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, step) -> float:
        if not self.cuda:
            start = time.perf_counter()
            step()
            return time.perf_counter() - start
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1000


def saved_bytes(step) -> int:
    """Bytes of the tensors the forward saves for the backward (each storage once, parameters not counted)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def make_variants(shape: tuple[int, int, int], device: torch.device) -> dict[str, tuple]:
    """name -> (the layer, the backend its CPT products use or None) of every variant that runs here."""
    _, features_in, features_out = shape
    torch.manual_seed(0)
    plain = nn.Linear(features_in, features_out).to(device)
    variants = {"bf16": (plain, None)}
    for name, bits, fields in CPT_VARIANTS:
        layer = copy.deepcopy(plain)
        quantize_model(layer, CPTConfig(schedule="static", bits_max=bits, **fields))
        set_precision(layer, bits, 8)
        reference = name == "cpt-reference"
        variants[f"{name}/{bits}"] = (layer, REFERENCE if reference else backend_for(device))
    try:  # torchao, where importable: its int8 mixed-precision training and float8 training
        from torchao import quantize_
        from torchao.prototype.quantized_training import int8_mixed_precision_training

        layer = nn.Sequential(copy.deepcopy(plain))
        quantize_(layer, int8_mixed_precision_training())
        variants["torchao-int8"] = (layer, None)
        if device.type == "cuda":
            from torchao.float8 import convert_to_float8_training

            variants["torchao-float8"] = (convert_to_float8_training(nn.Sequential(copy.deepcopy(plain))), None)
    except Exception as error:  # noqa: BLE001 - any torchao failure leaves its rows out, said in the log
        print(f"torchao rows left out: {type(error).__name__}: {error}")
    return variants


def measure_shape(shape: tuple[int, int, int], device: torch.device, repeats: int, warmup: int) -> list[dict]:
    tokens, features_in, features_out = shape
    variants = make_variants(shape, device)
    x = torch.randn(tokens, features_in, device=device)
    grad = torch.randn(tokens, features_out, device=device) * 1e-3
    timer = Timer(device)

    def step_of(name: str):
        layer, backend = variants[name]

        def step() -> None:
            previous = register_backend(device.type, backend) if backend is not None else None
            try:
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    out = layer(x.requires_grad_())
                out.backward(grad.to(out.dtype))
            finally:
                if backend is not None:
                    register_backend(device.type, previous)
            layer.zero_grad(set_to_none=True)
            x.grad = None

        return step

    steps = {name: step_of(name) for name in variants}
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):  # interleaved: every variant once per round
        for name, step in steps.items():
            times[name].append(timer(step))
    rows = []
    for name, step in steps.items():
        peak = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step()
            peak = torch.cuda.max_memory_allocated()
        rows.append({"name": name, "seconds": statistics.median(times[name]), "peak_bytes": peak,
                     "saved_bytes": saved_bytes(step)})
    base = rows[0]
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    case = f"linear-{tokens}x{features_in}x{features_out}"
    out = []
    for row in rows:
        variant, _, bits = row["name"].partition("/")
        entry = {"case": case, "variant": variant, "device": device_name, "seconds": row["seconds"],
                 "time_ratio_vs_bf16": row["seconds"] / base["seconds"],
                 "saved_ratio_vs_bf16": row["saved_bytes"] / base["saved_bytes"]}
        if bits:
            entry["bits"] = int(bits)
        if row["peak_bytes"] is not None:
            entry["peak_ratio_vs_bf16"] = row["peak_bytes"] / base["peak_bytes"]
        out.append(entry)
    return out


# ----------------------------------------------------------------------------- model steps (issue 74)


def _llama(tiny: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
    # TinyLlama's shape: about 1.1B parameters
    return LlamaForCausalLM(LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                        num_attention_heads=32, num_key_value_heads=4, vocab_size=32000))


def _bert(tiny: bool, minilm: bool = False):
    from transformers import BertConfig, BertForSequenceClassification

    if tiny:
        config = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                            vocab_size=256)
    elif minilm:  # all-MiniLM-L6-v2's shape (random weights: the step's time does not depend on them)
        config = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
    else:
        config = BertConfig()
    config.num_labels = 3
    return BertForSequenceClassification(config)


def _gpt2(tiny: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256) if tiny
                           else GPT2Config(n_embd=1024, n_layer=24, n_head=16))


def _vit(tiny: bool):
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, intermediate_size=128, num_labels=10) if tiny
                                     else ViTConfig(num_labels=1000))


def _resnet(tiny: bool):
    from transformers import ResNetConfig, ResNetForImageClassification

    return ResNetForImageClassification(ResNetConfig(depths=[1, 1], hidden_sizes=[32, 64], embedding_size=16,
                                                     num_labels=10) if tiny else ResNetConfig(num_labels=1000))


def _tokens(batch: int, length: int, vocab: int, labels: str, device: torch.device) -> dict:
    ids = torch.randint(0, vocab, (batch, length), device=device)
    target = ids if labels == "tokens" else torch.randint(0, 3, (batch,), device=device)
    return {"input_ids": ids, "labels": target}


def _images(batch: int, size: int, classes: int, device: torch.device) -> dict:
    return {"pixel_values": torch.randn(batch, 3, size, size, device=device),
            "labels": torch.randint(0, classes, (batch,), device=device)}


# case -> (model builder, batch builder (tiny, device)): the sizes; tiny ones for the CPU check
MODELS = {
    "llama-1b": (_llama, lambda tiny, d: _tokens(*((2, 16, 256) if tiny else (8, 2048, 32000)), "tokens", d)),
    "bert-base": (_bert, lambda tiny, d: _tokens(*((2, 16, 256) if tiny else (32, 512, 30522)), "classes", d)),
    "gpt2-medium": (_gpt2, lambda tiny, d: _tokens(*((2, 16, 256) if tiny else (8, 1024, 50257)), "tokens", d)),
    "vit-b16": (_vit, lambda tiny, d: _images(*((2, 32, 10) if tiny else (128, 224, 1000)), d)),
    "resnet50": (_resnet, lambda tiny, d: _images(*((2, 32, 10) if tiny else (256, 224, 1000)), d)),
    "minilm": (lambda tiny: _bert(tiny, minilm=True),
               lambda tiny, d: _tokens(*((2, 16, 256) if tiny else (32, 128, 30522)), "classes", d)),
}


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes the model keeps between steps: parameters, gradients and the optimizer's state."""
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def measure_model(case: str, device: torch.device, repeats: int, warmup: int, tiny: bool,
                  compile_models: bool) -> list[dict]:
    """One training step (forward, backward, AdamW) of ``case`` under bf16 autocast: bf16 and CPT 4-8/8 (default
    settings, at 4 bits), eager and compiled, interleaved; each ratio against bf16 in the same mode."""
    build, batch_of = MODELS[case]
    torch.manual_seed(0)
    plain = build(tiny).to(device)
    cpt = copy.deepcopy(plain)
    quantize_model(cpt, CPTConfig())
    set_precision(cpt, 4, 8)
    batch = batch_of(tiny, device)
    variants = {}
    for name, model in (("bf16", plain), ("cpt-default", cpt)):
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        variants[(name, "eager")] = (model, model, optimizer)
        if compile_models:
            variants[(name, "compiled")] = (model, torch.compile(model), optimizer)

    def step_of(model: nn.Module, runner, optimizer):
        def step() -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = runner(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        return step

    steps = {key: step_of(*value) for key, value in variants.items()}
    timer = Timer(device)
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[tuple, list[float]] = {key: [] for key in steps}
    for _ in range(repeats):
        for key, step in steps.items():
            times[key].append(timer(step))
    peaks = {}
    if device.type == "cuda":  # what the variant keeps between steps + what one step adds on top
        for key, step in steps.items():
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            model, _, optimizer = variants[key]
            peaks[key] = _state_bytes(model, optimizer) + torch.cuda.max_memory_allocated() - before
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = []
    for (name, mode), values in times.items():
        seconds, base = statistics.median(values), statistics.median(times[("bf16", mode)])
        row = {"case": case, "variant": name, "mode": mode, "device": device_name, "seconds": seconds,
               "time_ratio_vs_bf16": seconds / base}
        if peaks:
            row["peak_ratio_vs_bf16"] = peaks[(name, mode)] / peaks[("bf16", mode)]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="one small shape, few repeats (the script's own check)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--part", choices=("linear", "models", "all"), default="all")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--no_compile", action="store_true", help="eager rows only")
    args = parser.parse_args()
    device = torch.device(args.device)
    repeats = args.repeats or (3 if args.smoke else 20)
    rows = json.load(open(args.output)) if os.path.exists(args.output) else []

    def save(new_rows: list[dict]) -> None:
        rows.extend(new_rows)
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=1)
        for row in new_rows:
            print(json.dumps(row))

    done = {row["case"] for row in rows}
    if args.part in ("linear", "all"):
        for shape in SMOKE_SHAPES if args.smoke else SHAPES:
            if "linear-{}x{}x{}".format(*shape) not in done:
                save(measure_shape(shape, device, repeats, warmup=1 if args.smoke else 3))
    if args.part in ("models", "all"):
        for case in args.models:
            if case not in done:
                save(measure_model(case, device, max(3, repeats // 4), warmup=1 if args.smoke else 2, tiny=args.smoke,
                                   compile_models=not args.no_compile))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print(json.dumps({"fallbacks": backend_for(device).fallbacks}))


if __name__ == "__main__":
    main()
