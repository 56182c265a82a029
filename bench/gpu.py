"""A quantized Linear's training step (forward + backward) on a GPU, against bf16 autocast (issue 73).

Per (tokens, in, out) shape: bf16 (autocast, the user's baseline), CPT on the CUDA backend with the default backward
numerics (``cpt-default``) and with both backward products on int8 (``cpt-fastest``) at 8 and 4 bits, CPT on the
reference backend (``cpt-reference``), and torchao's int8 mixed-precision training and float8 training where
torchao imports (wheels carried to the GPU machine). Every variant runs under bf16 autocast with float32 weights, as a
user's ``bf16=True`` run. Step times are medians of interleaved repeats after warm-up (CUDA events); peak memory by
``torch.cuda.max_memory_allocated`` over one step; bytes saved for the backward by a saved-tensor hook (parameters
not counted). Rows go to ``--output`` (a JSON list) after every shape; rows already there are kept (resumable), and
``python bench/report.py`` renders docs/benchmarks.md's GPU section from ``bench/results/gpu.json``.

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="one small shape, few repeats (the script's own check)")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    repeats = args.repeats or (3 if args.smoke else 20)
    rows = json.load(open(args.output)) if os.path.exists(args.output) else []
    done = {row["case"] for row in rows}
    for shape in shapes:
        case = "linear-{}x{}x{}".format(*shape)
        if case in done:
            continue
        rows.extend(measure_shape(shape, device, repeats, warmup=1 if args.smoke else 3))
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=1)
        for row in rows[-len(CPT_VARIANTS) - 1:]:
            print(json.dumps(row))
    fallbacks = backend_for(device).fallbacks
    print(json.dumps({"fallbacks": fallbacks}))


if __name__ == "__main__":
    main()
