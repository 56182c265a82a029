"""Where in a training step the peak resident memory falls: forward, backward or optimizer step, plain and CPT 8/8,
under glibc's default allocator, with its mmap threshold fixed, and with the heap's free pages handed back to the
system (``malloc_trim``) after each backward or before each product layer's forward.

`bench/overhead.py` gives one peak per process. This script resets the peak (``/proc/self/clear_refs``, Linux) before
each phase of each step, in a fresh process per side and allocator, so the README's two memory columns can be read:
with the threshold fixed, large blocks go back to the system on free and the peak follows live memory; under the
default, freed blocks stay resident in the heap, and the phase that adds fresh mappings on top of them peaks. Each
phase's figure is its highest over the steps after the first (the optimizer's states arrive in the first); the
quantized side also reports what its reused buffers hold (docs/method.md §2, "Reused buffers"). A trim is the same
policy on both sides, applied by this script, not by hf_cpt: it shows how much of a peak is the heap's resident holes
and what returning them costs (each process's median step time: processes run one after another, not interleaved,
so an indication only). Resumable: a case already in the output file is skipped. ``python bench/report.py`` renders
the JSON into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import functools
import os
import sys
import time

import torch

from hf_cpt.convert import find_precision_state, is_quantized
from hf_cpt.numerics import scratch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import overhead  # noqa: E402  (the bench's model builders and fresh-process runner)
from harness import load_results, products_setting, save_results  # noqa: E402

PHASES = overhead.PHASES
# key -> the bench's model builder
CASES = {"bert-base-16": "bert_base_16", "gpt2": "gpt2_small", "resnet18": "resnet18", "resnet20": "resnet20"}
# allocator -> (extra environment, where the heap is trimmed: None, "backward" or "products")
ALLOCATORS = {
    "default glibc": (None, None),
    "mmap threshold fixed": (overhead.FIXED_MMAP_THRESHOLD, None),
    "default glibc, heap trimmed after each backward": (None, "backward"),
    "default glibc, heap trimmed before each product": (None, "products"),
}
STEPS = 5
# the layers whose forward a "products" trim precedes: plain and quantized alike (hf_cpt's layers subclass these)
PRODUCT_LAYERS = ("Linear", "Conv2d", "Conv1D")


def trim_heap() -> None:
    """Hand the free pages of glibc's heap back to the system (``malloc_trim(0)``)."""
    _glibc().malloc_trim(0)


@functools.cache
def _glibc():
    library = ctypes.util.find_library("c")
    libc = ctypes.CDLL(library) if library else None
    if libc is None or not hasattr(libc, "malloc_trim"):
        raise RuntimeError("heap trims need glibc's malloc_trim, which this C library lacks")
    return libc


@contextlib.contextmanager
def trimmed_before_products():
    """Trim the heap before the training forward of every Linear, Conv2d and Conv1D (plain or quantized)."""
    def trim(module, args):
        if module.training and any(k.__name__ in PRODUCT_LAYERS for k in type(module).__mro__):
            trim_heap()

    handle = torch.nn.modules.module.register_module_forward_pre_hook(trim)
    try:
        yield
    finally:
        handle.remove()


def reset_peak() -> None:
    """Set this process's VmHWM to its current resident size (Linux 4.0+)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def phase_peaks(model, batch: dict, steps: int = STEPS, trim: str | None = None,
                step_seconds: list[float] | None = None) -> dict[str, float]:
    """Peak resident MiB of each phase of a training step (forward, backward, AdamW step), the highest over
    ``steps`` steps after a first one; ``trim``: "backward" trims the heap after each backward, "products" before
    each product layer's forward; ``step_seconds`` receives the time of each of those steps."""
    if trim not in (None, "backward", "products"):
        raise ValueError(f"trim must be None, 'backward' or 'products', not {trim!r}")
    if trim is not None:
        _glibc()  # refuse before any step where trims cannot run
    with trimmed_before_products() if trim == "products" else contextlib.nullcontext():
        return _phase_peaks(model, batch, steps, trim == "backward", step_seconds)


def _phase_peaks(model, batch: dict, steps: int, trim_after_backward: bool, step_seconds: list[float] | None
                 ) -> dict[str, float]:
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    # a CPT model's weight epoch advances as under the Trainer (`overhead.training_step`)
    reused = find_precision_state(model).reused_weights if is_quantized(model) else None
    peaks = dict.fromkeys(PHASES, 0.0)
    for step in range(steps + 1):
        figures, start = [], time.perf_counter()
        if reused is not None:
            reused.begin_step(1)
        reset_peak()
        loss = model(**batch)["loss"]
        figures.append(overhead.vm_hwm_mib())
        reset_peak()
        loss.backward()
        if trim_after_backward:
            trim_heap()
        figures.append(overhead.vm_hwm_mib())
        if reused is not None:
            reused.end_step()
        reset_peak()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        figures.append(overhead.vm_hwm_mib())
        if reused is not None:
            reused.end_step()
        if step:
            peaks = {phase: max(peaks[phase], figure) for phase, figure in zip(PHASES, figures)}
            if step_seconds is not None:
                step_seconds.append(time.perf_counter() - start)
    return peaks


def measure(kind: str, quantized: bool, env: dict | None, trim: str | None = None
            ) -> tuple[dict[str, float], float, float]:
    """(`phase_peaks` of one side of a case in a fresh process, the MiB its reused buffers map at the end (the
    quantized layers' `hf_cpt.numerics.scratch`), its median step in seconds)."""
    body = ("import peak_phases, statistics; from hf_cpt.numerics import scratch; seconds = []; "
            f"peaks = peak_phases.phase_peaks(model, batch, trim={trim!r}, step_seconds=seconds); "
            "print(json.dumps([peaks, scratch.held_bytes() / 2**20, statistics.median(seconds)]))")
    peaks, reused, seconds = overhead._run_case_in_fresh_process(kind, quantized, True, body, env)[0]
    return peaks, reused, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--output", default=os.path.join(HERE, "results", "peak_phases.json"))
    args = parser.parse_args()
    if not os.path.exists("/proc/self/clear_refs"):
        sys.exit("bench/peak_phases.py needs Linux's /proc/self/clear_refs to reset the peak between phases.")
    results = load_results(args.output)
    results.setdefault("rows", [])
    results.update(command="python bench/peak_phases.py", steps=STEPS, torch=torch.__version__,
                   **products_setting(), huge_pages=scratch.huge_pages(),
                   hand_back="optimizer step")  # when the buffers go back (until 2026-11-29: each backward's end)
    done = {row["key"] for row in results["rows"]}
    for key in args.cases:
        if key in done:
            print(f"{key}: done already")
            continue
        row = {"key": key, "peaks": {}, "step_seconds": {}}
        for allocator, (env, trim) in ALLOCATORS.items():
            sides, seconds = {}, {}
            for side in ("plain", "quant"):
                sides[side], reused, seconds[side] = measure(CASES[key], side == "quant", env, trim)
                if side == "quant":
                    row["reused_buffers_mib"] = reused
            row["peaks"][allocator], row["step_seconds"][allocator] = sides, seconds
            print(f"{key}, {allocator}: " + "; ".join(
                f"{side} " + ", ".join(f"{phase} {mib:.0f}" for phase, mib in peaks.items())
                for side, peaks in sides.items()), flush=True)
        results["rows"].append(row)
        save_results(args.output, results)
    save_results(args.output, results)


if __name__ == "__main__":
    main()
