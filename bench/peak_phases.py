"""Where in a training step the peak resident memory falls: forward, backward or optimizer step, plain and CPT 8/8,
under glibc's default allocator and with its mmap threshold fixed.

`bench/overhead.py` gives one peak per process. This script resets the peak (``/proc/self/clear_refs``, Linux) before
each phase of each step, in a fresh process per side and allocator, so the README's two memory columns can be read:
with the threshold fixed, large blocks go back to the system on free and the peak follows live memory; under the
default, freed blocks stay resident in the heap, and the phase that adds fresh mappings on top of them peaks. Each
phase's figure is its highest over the steps after the first (the optimizer's states arrive in the first); the
quantized side also reports what its reused buffers hold (docs/method.md §2, "Reused buffers"). Resumable:
a case already in the output file is skipped. ``python bench/report.py`` renders the JSON into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from hf_cpt.convert import find_precision_state, is_quantized
from hf_cpt.numerics import scratch
from hf_cpt.numerics.integer_matmul import integer_matmul_supported

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import overhead  # noqa: E402  (the bench's model builders and fresh-process runner)
from harness import load_results, save_results  # noqa: E402

PHASES = ("forward", "backward", "optimizer step")
# key -> the bench's model builder
CASES = {"bert-base-16": "bert_base_16", "gpt2": "gpt2_small", "resnet18": "resnet18", "resnet20": "resnet20"}
ALLOCATORS = {"default glibc": None, "mmap threshold fixed": overhead.FIXED_MMAP_THRESHOLD}
STEPS = 5


def reset_peak() -> None:
    """Set this process's VmHWM to its current resident size (Linux 4.0+)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def phase_peaks(model, batch: dict, steps: int = STEPS) -> dict[str, float]:
    """Peak resident MiB of each phase of a training step (forward, backward, AdamW step), the highest over
    ``steps`` steps after a first one."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    # a CPT model's weight epoch advances as under the Trainer (`overhead.training_step`)
    reused = find_precision_state(model).reused_weights if is_quantized(model) else None
    peaks = dict.fromkeys(PHASES, 0.0)
    for step in range(steps + 1):
        figures = []
        if reused is not None:
            reused.begin_step(1)
        reset_peak()
        loss = model(**batch)["loss"]
        figures.append(overhead.vm_hwm_mib())
        reset_peak()
        loss.backward()
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
    return peaks


def measure(kind: str, quantized: bool, env: dict | None) -> tuple[dict[str, float], float]:
    """(`phase_peaks` of one side of a case in a fresh process, the MiB its reused buffers map at the end: the
    quantized layers' `hf_cpt.numerics.scratch`)."""
    body = ("import peak_phases; from hf_cpt.numerics import scratch; "
            "print(json.dumps([peak_phases.phase_peaks(model, batch), scratch.held_bytes() / 2**20]))")
    peaks, reused = overhead._run_case_in_fresh_process(kind, quantized, True, body, env)[0]
    return peaks, reused


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
                   integer_products=integer_matmul_supported(), huge_pages=scratch.huge_pages())
    done = {row["key"] for row in results["rows"]}
    for key in args.cases:
        if key in done:
            print(f"{key}: done already")
            continue
        row = {"key": key, "peaks": {}}
        for allocator, env in ALLOCATORS.items():
            sides = {}
            for side in ("plain", "quant"):
                sides[side], reused = measure(CASES[key], side == "quant", env)
                if side == "quant":
                    row["reused_buffers_mib"] = reused
            row["peaks"][allocator] = sides
            print(f"{key}, {allocator}: " + "; ".join(
                f"{side} " + ", ".join(f"{phase} {mib:.0f}" for phase, mib in peaks.items())
                for side, peaks in sides.items()), flush=True)
        results["rows"].append(row)
        save_results(args.output, results)
    save_results(args.output, results)


if __name__ == "__main__":
    main()
