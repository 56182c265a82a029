"""What handing an embedding's gradient over as rows saves: each model step's peak memory with the tables whose
gradient adds to another's handing autograd only their looked-up rows (`CPTConfig.embedding_row_gradients`, the
default) and with aten's dense table gradient instead, beside the plain model's.

GPT-2 ties its output head to its token table, so the table's gradient has two parts in every backward. Its step runs
with torch's AdamW as the other benches do (on the CPU one parameter at a time, with temporaries the size of each
parameter), with the fused AdamW that transformers' Trainer makes by default (``optim="adamw_torch_fused"``, no such
temporaries), and as 4 accumulated micro-batches (where the untied position table's gradient adds to ``.grad`` too).
Peak resident memory (VmHWM) in fresh processes that train until the peak settles, as `bench/overhead.py` measures
it: under glibc's default allocator (``--processes`` per arm, interleaved) and with its mmap threshold fixed (one
each); with ``--repeats``, each step's time both ways beside the plain step's (one process, interleaved repeats,
medians). Resumable: a case already in the output file is skipped (one measured without times gets them). ``python
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

from hf_cpt.nn import embedding_rows  # noqa: E402
from hf_cpt.numerics.integer_matmul import integer_matmul_supported  # noqa: E402

CASES = {  # key -> (the bench's model builder, AdamW's settings, micro-batches a step)
    "gpt2": ("gpt2_small", {}, 1), "gpt2-fused-adamw": ("gpt2_small", {"fused": True}, 1),
    "gpt2-accumulate": ("gpt2_small", {}, 4),
}
DENSE = {"embedding_row_gradients": False}


def lookups_as_rows(kind: str) -> dict[str, int]:
    """How many of one training step's embedding lookups (the second step's, of all its micro-batches) hand their
    gradient over as rows, and how many tables can."""
    counts: collections.Counter = collections.Counter()
    rows_gradient = embedding_rows.rows_gradient

    def counting(*args, **kwargs):
        counts["as rows"] += 1
        return rows_gradient(*args, **kwargs)

    build, batch = getattr(overhead, kind)()
    torch.manual_seed(0)
    model = overhead.cpt_copy(build(), True)
    step = overhead.training_step(model, batch)
    step()
    embedding_rows.rows_gradient = counting
    try:
        step()
    finally:
        embedding_rows.rows_gradient = rows_gradient
    tables = sum(isinstance(m, embedding_rows.EmbeddingAddingRows) for m in model.modules())
    return {"as rows": counts["as rows"], "tables": tables}


def step_times_ms(kind: str, repeats: int) -> dict[str, float]:
    """Median milliseconds a training step takes: the plain model, the CPT 8/8 copy handing rows over, and the same
    copy forming dense table gradients (as ``embedding_row_gradients=False``), interleaved, the order alternating."""
    build, batch = getattr(overhead, kind)()
    plain, quantized = overhead.model_pair(build, True)
    as_rows = overhead.training_step(quantized, batch)

    def dense() -> None:
        present = embedding_rows._other_part_present
        embedding_rows._other_part_present = lambda *args: False
        try:
            as_rows()
        finally:
            embedding_rows._other_part_present = present

    arms = {"plain": overhead.training_step(plain, batch), "as rows": as_rows, "dense": dense}
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
    parser.add_argument("--output", default=os.path.join(HERE, "results", "embedding_rows.json"))
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
        kind, adamw, micro_batches = CASES[key]
        overhead.ADAMW_OPTIONS, overhead.MICRO_BATCHES = adamw, micro_batches
        if key in done:
            if args.repeats and "time_ms" not in done[key]:
                done[key]["time_ms"] = step_times_ms(kind, args.repeats)
                print(f"{key}: ms a step {done[key]['time_ms']}", flush=True)
                save_results(args.output, results)
            else:
                print(f"{key}: done already")
            continue
        counts = lookups_as_rows(kind)
        plain, as_rows, dense = overhead.peak_memories_mib(kind, True, args.processes, other_options=[DENSE])
        fixed = [overhead.peak_memory_mib(kind, quantized, True, env=overhead.FIXED_MMAP_THRESHOLD, options=arm)[0]
                 for quantized, arm in ((False, {}), (True, {}), (True, DENSE))]
        row = {"key": key, "adamw": adamw, "micro_batches": micro_batches, "lookups": counts,
               "default": {"plain": [p for p, _ in plain], "as rows": [p for p, _ in as_rows],
                           "dense": [p for p, _ in dense]},
               "fixed": dict(zip(("plain", "as rows", "dense"), fixed))}
        if args.repeats:
            row["time_ms"] = step_times_ms(kind, args.repeats)
        results["rows"].append(row)
        medians = {arm: statistics.median(peaks) for arm, peaks in row["default"].items()}
        print(f"{key}: lookups {counts}; default glibc {medians}; threshold fixed {row['fixed']}", flush=True)
        save_results(args.output, results)
    timing["load_average"].append(os.getloadavg()[0])
    save_results(args.output, results)


if __name__ == "__main__":
    main()
