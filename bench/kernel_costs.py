"""What each C kernel costs per value on this CPU, against a copy of the same tensor timed beside it.

The per-value work of the default scheme runs in small C kernels on CPU (docs/method.md §2-3). A kernel that reads
its operand once is bound by memory, as a copy is; one that the compiler failed to vectorize for this CPU (a
16-float comparison on AVX2 became scalar code until 2026-11-28) costs many copies. Each case alternates the kernel
and the copy (medians of interleaved repeats) at the sizes of a BERT-base layer (2048 tokens x 768 features, a
768 x 3072 weight); ``ratio`` is the kernel's median over the copy's, with a target per kind of pass. One JSON
(``--output``) holds one run per ``--label``; ``python bench/report.py`` renders it into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

from hf_cpt.numerics import code_kernels, error_kernels, native
from hf_cpt.numerics import rotation as rotation_module
from hf_cpt.numerics.fake_quant import quantization_scale
from hf_cpt.numerics.rotated_codes import rotated_token_codes
from hf_cpt.numerics.rotation import get_rotation

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from harness import load_results, save_results  # noqa: E402

TOKENS, FEATURES, WIDE = 2048, 768, 3072
# kernel / copy of its input, at most: a range reads its input (no write); codes and rebuilt values write one
# or two outputs; the error kernel hashes a noise per value; a
# rotation makes log2 P additions and a leading factor's multiply-adds per value.
# A rotated input's range, codes and values: a rotation's, a range's and codes' targets together, one pass or three.
TARGETS = {"ranges": 1.5, "codes": 3.0, "restore": 2.5, "error": 4.0, "rotation": 8.0,
           "rotated codes": 12.5}


def _cases() -> list[tuple[str, str, torch.Tensor, Callable[[], object]]]:
    """(case, kind, the input, the kernel's call on it)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, FEATURES, generator=generator)
    wide = torch.randn(FEATURES, WIDE, generator=generator)
    low, high = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    eight_bits, levels = torch.tensor(8.0), torch.tensor(255.0)
    scale = (high - low) / levels
    codes = code_kernels.quantize_codes_native(x, low, scale, levels, False)[0]
    seed = torch.tensor(7)
    errors = {name: error_kernels.fused_kernel(torch.device("cpu"), granularity, grid)
              for name, (granularity, grid) in {"token": ("token", "minmax"), "zero": ("token", "symmetric"),
                                                "tensor": ("tensor", "minmax")}.items()}
    cases = [
        ("range of each token", "ranges", x, lambda: code_kernels.ranges_native(x, 1, False)),
        ("range of each column (a Conv1D weight's output channel)", "ranges", wide,
         lambda: code_kernels.ranges_native(wide, 1, True)),
        ("codes, per token", "codes", x, lambda: code_kernels.quantize_codes_native(x, low, scale, levels, False)),
        ("codes and fake-quantized values, per token", "codes", x,
         lambda: code_kernels.quantize_codes_native(x, low, scale, levels, True)),
        ("values rebuilt from codes, per token", "restore", x,
         lambda: code_kernels.restore_codes_native(codes, scale, low)),
        ("error, a min/max grid per token", "error", x, lambda: errors["token"](x, levels, seed)),
        ("error, a zero-centred grid per token", "error", x, lambda: errors["zero"](x, levels, seed)),
        ("error, one grid for the tensor", "error", x, lambda: errors["tensor"](x, levels, seed)),
    ]
    for features in (768, 1024, 3072):
        rotation = get_rotation(features)
        rows = torch.randn(TOKENS * FEATURES // features, features, generator=generator)
        cases.append((f"rotation of {features} features", "rotation", rows,
                      lambda r=rotation, t=rows: r.apply(t, in_place=True)))
    weight_rotation = get_rotation(FEATURES)
    for name in ("factor by factor", "C kernel"):  # a GPT-2 Conv1D's [in, out] weight, over its input features
        cases.append((f"rotation of a {FEATURES} x {WIDE} weight's first axis, {name}", "rotation", wide,
                      lambda by_factors=name != "C kernel": _first_axis_rotation(wide, weight_rotation, by_factors)))
    for features in (768, 3072):  # a rotated input's range, codes and values, as a layer's training forward makes them
        rotation = get_rotation(features)
        rows = torch.randn(TOKENS * FEATURES // features, features, generator=generator)
        cases += [
            (f"rotated codes and values of {features} features, step by step", "rotated codes", rows,
             lambda r=rotation, t=rows: _rotated_codes_step_by_step(t, r, levels)),
            (f"rotated codes and values of {features} features, one pass", "rotated codes", rows,
             lambda r=rotation, t=rows: rotated_token_codes(t, -1, r, eight_bits, values=True)),
        ]
    return cases


def _first_axis_rotation(weight: torch.Tensor, rotation, by_factors: bool) -> torch.Tensor:
    """``R^T W`` into a reused buffer, as a Conv1D's training forward rotates its weight: by the C kernel, or by
    torch's products factor by factor (what ran before the kernel served that axis)."""
    saved = rotation_module.NATIVE_MIN_NUMEL
    rotation_module.NATIVE_MIN_NUMEL = sys.maxsize if by_factors else saved
    try:
        return rotation.apply(weight, 0)
    finally:
        rotation_module.NATIVE_MIN_NUMEL = saved


def _rotated_codes_step_by_step(x: torch.Tensor, rotation, levels: torch.Tensor) -> tuple:
    """What `rotated_token_codes` makes, in the steps it replaces: ``x R``, its ranges, its codes and values."""
    rotated = rotation.apply(x)
    low, high = code_kernels.ranges_native(rotated, 1, False)
    scale = quantization_scale(low, high, levels).view(-1, 1)
    return code_kernels.quantize_codes_native(rotated, low.view(-1, 1), scale, levels, True)


def time_case(kernel: Callable[[], object], source: torch.Tensor, repeats: int) -> tuple[float, float]:
    """(median seconds of the kernel, of a copy of ``source``), alternating which runs first."""
    target = torch.empty_like(source)
    copy = lambda: target.copy_(source)  # noqa: E731
    kernel(), copy()
    times = {kernel: [], copy: []}
    for repeat in range(repeats):
        for call in ((kernel, copy) if repeat % 2 == 0 else (copy, kernel)):
            start = time.perf_counter()
            call()
            times[call].append(time.perf_counter() - start)
    return statistics.median(times[kernel]), statistics.median(times[copy])


def vector_extensions() -> str:
    """The CPU's widest float vectors and whether it has int8 dot products (what the kernels are built for)."""
    flags = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    widest = "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else platform.machine()
    return widest + (" with VNNI" if "vnni" in flags else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--label", default="now", help="the run's name in the JSON (one run per label)")
    parser.add_argument("--output", default=os.path.join(HERE, "results", "kernels.json"))
    args = parser.parse_args()
    if native.load("code_kernels") is None:
        sys.exit("the C kernels are not available here (no C compiler, or HF_CPT_NATIVE_KERNELS=0)")
    rows = []
    for case, kind, source, kernel in _cases():
        seconds, copy_seconds = time_case(kernel, source, args.repeats)
        row = {"case": case, "kind": kind, "ns_per_value": seconds / source.numel() * 1e9,
               "copy_ns_per_value": copy_seconds / source.numel() * 1e9, "ratio": seconds / copy_seconds,
               "target": TARGETS[kind]}
        rows.append(row)
        print(f"{case:58s} {row['ns_per_value']:6.3f} ns/value, {row['ratio']:6.2f} copies (target "
              f"{row['target']})")
    results = load_results(args.output)
    results.setdefault("runs", {})[args.label] = {
        "command": "python bench/kernel_costs.py" + (f" --label '{args.label}'" if args.label != "now" else ""),
        "torch": torch.__version__, "threads": native.threads(), "cpu": vector_extensions(),
        "repeats": args.repeats, "rows": rows}
    save_results(args.output, results)


if __name__ == "__main__":
    main()
