"""What glibc's heap holds at the end of each phase of a training step, plain and CPT 8/8: the bytes in use and the
free holes below the heap's top, which stay resident, read with glibc's ``mallinfo2``.

`bench/peak_phases.py` says in which phase a step peaks; this script says what the heap is made of there. Under
glibc's default a quantized model can keep less for its backward than the plain one and still peak as high, when the
float blocks it frees during the forward (the inputs its layers keep as codes) leave holes that later blocks do not
fill (docs/benchmarks.md, "Peak memory and the allocator"). Each side runs in a fresh process with the fused AdamW
that transformers' Trainer makes by default, for `STEPS` steps; the figures are the last step's, when the heap has
settled, and the process's peak (VmHWM). Resumable: a case already in the output file is skipped.
``python bench/report.py`` renders the JSON into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import overhead  # noqa: E402  (the bench's model builders and fresh-process runner)
from harness import load_results, products_setting, save_results  # noqa: E402

PHASES = overhead.PHASES
# key -> the bench's model builder
CASES = {"bert-base-16": "bert_base_16", "minilm": "minilm", "gpt2": "gpt2_small", "vit-s": "vit_small",
         "resnet20": "resnet20"}
STEPS = 6
ADAMW = "fused"  # the model steps' AdamW (`overhead.ADAMW_CHOICES`): the Trainer's default, as users train


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc 2.33+): every field a ``size_t``."""
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2():
    library = ctypes.util.find_library("c")
    libc = ctypes.CDLL(library) if library else None
    if libc is None or not hasattr(libc, "mallinfo2"):
        raise RuntimeError("bench/heap_use.py needs glibc 2.33 or later (mallinfo2)")
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2


def heap_now(mallinfo2) -> dict[str, float]:
    """MiB of glibc's heaps now: ``in_use`` (allocated blocks), ``holes`` (free blocks below each heap's top,
    resident once written), ``top`` (the free end of the heaps) and ``mapped`` (blocks malloc mapped on their own)."""
    info, mib = mallinfo2(), 2**20
    return {"in_use": info.uordblks / mib, "holes": (info.fordblks - info.keepcost) / mib, "top": info.keepcost / mib,
            "mapped": info.hblkhd / mib}


def phase_heaps(model: torch.nn.Module, batch: dict, steps: int = STEPS) -> dict:
    """`heap_now` at the end of each phase of the last of ``steps`` training steps (`overhead.training_step`:
    forward, backward, AdamW step with the gradients then freed), and the process's peak resident MiB."""
    mallinfo2 = _mallinfo2()  # refuse before any step where it cannot be read
    heaps: dict[str, dict[str, float]] = {}
    step = overhead.training_step(model, batch, micro_batches=1,
                                  phase_ended=lambda phase: heaps.__setitem__(phase, heap_now(mallinfo2)))
    for _ in range(steps):
        step()
    return {"phases": heaps, "peak_mib": overhead.vm_hwm_mib()}


def measure(kind: str, quantized: bool) -> dict:
    """`phase_heaps` of one side of a case in a fresh process under glibc's default allocator."""
    body = "import heap_use; print(json.dumps(heap_use.phase_heaps(model, batch)))"
    return overhead._run_case_in_fresh_process(kind, quantized, True, body)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--output", default=os.path.join(HERE, "results", "heap_use.json"))
    args = parser.parse_args()
    _mallinfo2()
    overhead.ADAMW_OPTIONS = overhead.ADAMW_CHOICES[ADAMW]  # read by the fresh processes
    results = load_results(args.output)
    results.setdefault("rows", [])
    results.update(command="python bench/heap_use.py", steps=STEPS, adamw=ADAMW, torch=torch.__version__,
                   **products_setting())
    done = {row["key"] for row in results["rows"]}
    for key in args.cases:
        if key in done:
            print(f"{key}: done already")
            continue
        row = {"key": key, "sides": {side: measure(CASES[key], side == "quant") for side in ("plain", "quant")}}
        for side, figures in row["sides"].items():
            forward = figures["phases"]["forward"]
            print(f"{key} {side}: forward's end in use {forward['in_use']:.0f}, holes {forward['holes']:.0f} MiB; "
                  f"peak {figures['peak_mib']:.0f} MiB", flush=True)
        results["rows"].append(row)
        save_results(args.output, results)
    save_results(args.output, results)


if __name__ == "__main__":
    main()
