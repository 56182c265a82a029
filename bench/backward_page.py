"""The backward ablation page (docs/backward.md) from bench/results/backward_ablation.json and pretrained.json.

Runs are grouped by what they recorded (their `CPTConfig`), not by name: a run keeps its meaning when a
default changes. Baselines (FP32, per-tensor errors) come from ``pretrained.json``. The targets are the
backward issue's: static 8/8 within 0.5 points of FP32, CPT within 1 point, CPT 4-8/8 at most 0.75 of static.
"""

from __future__ import annotations

import math
import statistics

from results_page import mean, spread

from hf_cpt.numerics.errors import PAPER_ERRORS, ErrorQuantization

STATIC_TARGET = 0.5  # points below FP32
CPT_TARGET = 1.0
ATTENTION_TARGET = 1.5
COST_TARGET = 0.75  # CPT 4-8/8 cost vs static 8/8
# What runs recorded before these settings existed used: the paper's errors (error rotation, an option until
# 2026-12-04, is read from the runs that recorded it; every run since is unrotated).
ERROR_DEFAULTS = {"error_granularity": PAPER_ERRORS.granularity, "error_rounding": PAPER_ERRORS.rounding,
                  "error_products": PAPER_ERRORS.products, "error_rotation": "none",
                  "error_range": PAPER_ERRORS.range}


def method(config: dict) -> str:
    if config["schedule"] == "fp32":
        return "FP32"
    name = (f"static {config['bits_max']}/{config['grad_bits']}" if config["schedule"] == "static"
            else f"CPT {config['bits_min']}-{config['bits_max']}/{config['grad_bits']}")
    if config.get("delay"):
        name += f" (first {100 * config['delay']:.0f}% at {config.get('delay_precision', 'max')})"
    if config.get("rounding", "nearest") == "ceil":  # the smooth schedule rounded up (the CPT paper's Eq. 1)
        name += CEIL_LABEL
    if config.get("weight_range", "minmax") != "minmax":  # runs without the field used min/max weight ranges
        name += CLIPPED_LABEL
    if config.get("quant_scheme", "auto") != "auto":
        name += f" ({config['quant_scheme']} activations)"
    if config.get("integer_matmul") is True:  # runs without the field used the float product
        name += INTEGER_LABEL
    name += int8_label(config)
    if config.get("quantize_attention"):
        name += " + attention" + (f" at {config['attention_bits']} bits" if config.get("attention_bits") else "")
        grid = ErrorQuantization(range=config.get("error_range", PAPER_ERRORS.range)).for_attention().range
        if not config.get("attention_errors", True):
            name += ", its errors in full precision"
        else:
            name += ", its errors zero-centred" if grid == "symmetric" else ", its errors min/max"
    return name + "".join(f" + {module}" for module in config.get("include_modules") or [])


def errors(config: dict) -> tuple[str, ...]:
    """The layers' error settings a run recorded: (granularity, rounding, products, rotation, grid)."""
    recorded = [config.get(key, default) for key, default in ERROR_DEFAULTS.items()]
    recorded[-1] = "minmax" if recorded[-1] == "auto" else recorded[-1]  # the layers' grid under "auto"
    return tuple(recorded)


def describe(option: tuple[str, ...]) -> str:
    granularity, rounding, products, rotation, grid = option
    ranges = "one range per tensor" if granularity == "tensor" else "one range per row (token)"
    used = {"both": "both products", "input": "input gradient only (weight gradient from the FP32 error)",
            "weight": "weight gradient only (input gradient from the FP32 error)"}[products]
    turned = {"none": "", "features": ", rotated across features", "tokens": ", rotated across tokens"}[rotation]
    centred = ", zero-centred grid" if grid == "symmetric" else ""
    return f"{ranges}{centred}, {rounding} rounding{turned}, {used}"


def groups(*sections: dict) -> dict[tuple[str, tuple], list[dict]]:
    grouped: dict[tuple[str, tuple], list[dict]] = {}
    for section in sections:
        for entry in section.values():
            config = entry["cpt_config"]
            key = (method(config), () if config["schedule"] == "fp32" else errors(config))
            if all(e["seed"] != entry["seed"] for e in grouped.get(key, [])):
                grouped.setdefault(key, []).append(entry)
    return grouped


def _points(entries: list[dict]) -> float:
    return 100 * mean(e["metric"] for e in entries)


def resolved_option(errors: ErrorQuantization, activations: str) -> tuple[str, ...]:
    """The (granularity, rounding, products, rotation, grid) ``errors`` give a layer with ``activations`` ranges."""
    resolved = errors.for_activations(activations)
    return resolved.granularity, resolved.rounding, resolved.products, "none", resolved.range


def fp32_entries(grouped: dict) -> list[dict] | None:
    """The FP32 runs of `groups`' result, or None."""
    return next((entries for (name, _), entries in grouped.items() if name == "FP32"), None)


def backward_page(ablation: dict, pretrained: dict, default: ErrorQuantization,
                  from_scratch: list[tuple[str, dict, str, tuple, str]] | None = None,
                  gradient_fidelity: dict | None = None, on_gpu: dict | None = None) -> str:
    default_errors = resolved_option(default, "token")  # MiniLM's layers: rotated, per-token activations
    grouped = groups(pretrained.get("finetune", {}), ablation.get("finetune", {}))
    fp32 = fp32_entries(grouped)
    lines = ["# Quantized errors: which backward keeps FP32 accuracy", "",
             "<!-- generated by `python bench/report.py` from bench/results/backward_ablation.json and "
             "pretrained.json; do not edit -->", "",
             "Pretrained all-MiniLM-L6-v2 fine-tuned on 8,000 MNLI pairs and evaluated on the other 1,815 "
             "(`bench/pretrained.py`: one epoch, batch 32, lr 1e-4), every run differing only in how the errors "
             "(output gradients) are quantized (docs/method.md §2). Accuracy: mean ± half the range over the "
             "seeds; vs FP32: the mean gap to the FP32 run of the same seed (the same data order and initial head), "
             "over the seeds both ran; cost: the library's cost meter (a product left with the FP32 error is priced "
             "at 32-bit errors). Written by:", "", "```bash",
             "nohup python bench/pretrained.py --part finetune --runs backward --no_profile \\",
             "    --output bench/results/backward_ablation.json > outputs/backward_ablation.log 2>&1 &",
             "python bench/report.py", "```", "",
             "| run | errors | seeds | accuracy % | vs FP32 (points) | cost vs static 8/8 | cost vs FP32 |",
             "|---|---|---|---|---|---|---|"]
    for (name, option), entries in sorted(grouped.items(), key=lambda kv: (kv[0][0] != "FP32", kv[0])):
        points = [e["metric"] for e in entries]
        gap = "-" if fp32 is None or name == "FP32" else f"{_gap_to_fp32(entries, fp32):+.2f}"
        cost = [e["cost"] for e in entries]
        vs_static = "-" if name == "FP32" else f"{mean(c['cost_vs_static'] for c in cost):.3f}"
        vs_fp32 = f"{mean(c['cost_vs_fp32'] for c in cost):.4f}" + _uncounted_attention(entries)
        marker = " (default)" if option == default_errors else ""
        lines.append(f"| {name} | {describe(option) + marker if option else '-'} | "
                     f"{', '.join(str(e['seed']) for e in sorted(entries, key=lambda e: e['seed']))} | "
                     f"{100 * mean(points):.2f} ± {100 * spread(points):.2f} | {gap} | {vs_static} | {vs_fp32} |")
    lines += ["", "† measured before the cost meter counted the attention products (in FP32 there): both cost "
              "ratios of that row leave them out, so they read lower than a row that counts them.",
              "", "## Findings", ""] + findings(grouped, fp32, default_errors)
    if on_gpu:
        lines += [""] + gpu_section(on_gpu)
    if gradient_fidelity:
        lines += [""] + gradient_section(gradient_fidelity)
    for title, results, command, metric, activations in from_scratch or []:
        lines += [""] + scratch_section(title, results, command, metric, resolved_option(default, activations))
    return "\n".join(lines).rstrip() + "\n"


GPU_COMMAND = ("python bench/pretrained.py --part finetune --device cuda --no_profile --seeds $(seq 100 115) \\\n"
               "    --runs fp32 static-8/8-error-token cpt-4-8/8-error-token cpt-5-8/8-error-token \\\n"
               "           cpt-4-8/8-error-token-attention-8-symmetric \\\n"
               "    --model_path <all-MiniLM-L6-v2, weights in float16> --output bench/results/backward_gpu.json")


def _paired_gaps(results: dict) -> tuple[list[dict], list[tuple[str, tuple, list[dict], list[float], float]]] | None:
    """FP32's entries and, per other setting, (name, errors, entries, seed-by-seed gaps to FP32 in points, the
    standard error of their mean); None without FP32 runs."""
    grouped = groups(results.get("finetune", {}))
    fp32 = fp32_entries(grouped)
    if fp32 is None:
        return None
    rows = []
    for (name, option), entries in sorted(grouped.items(), key=lambda kv: kv[0]):
        gaps = seed_gaps(entries, fp32)
        if name == "FP32" or not gaps:
            continue
        error = statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else float("nan")
        rows.append((name, option, entries, gaps, error))
    return fp32, rows


def gpu_section(results: dict) -> list[str]:
    """The same fine-tuning on a GPU, many seeds per setting: the paired gap to FP32 with its standard error, which
    the CPU's few seeds cannot resolve."""
    paired = _paired_gaps(results)
    if paired is None:
        return []
    fp32, rows = paired
    gpu = results.get("environment", {}).get("gpu") or "a GPU"

    def seconds(entries: list[dict]) -> str:
        return f"{statistics.median(e['seconds_per_step'] for e in entries):.3f}"

    def accuracy(entries: list[dict]) -> str:
        points = [e["metric"] for e in entries]
        return f"{100 * mean(points):.2f} ± {100 * spread(points):.2f}"

    lines = [f"## On a GPU: {len(fp32)} seeds per setting", "",
             f"The same script, split and settings on one {gpu} (`--device cuda`; seeds of their own, 100 and up, "
             "since a GPU's kernels round differently from the CPU's), with the pretrained weights stored in float16 "
             "to travel to that machine (loaded as float32; every run, FP32 included, starts from them). vs FP32: "
             "the mean of the seed-by-seed gaps ± its standard error; s/step: the median seconds per training step, "
             "with several runs sharing the GPU at once (indicative only). Written by:", "", "```bash", GPU_COMMAND,
             "python bench/report.py", "```", "",
             "| run | errors | seeds | accuracy % | vs FP32 (points) | pairs below FP32 | cost vs static 8/8 "
             "| target | s/step |",
             "|---|---|---|---|---|---|---|---|---|",
             f"| FP32 | - | {len(fp32)} | {accuracy(fp32)} | - | - | - | - | {seconds(fp32)} |"]
    for name, option, entries, gaps, error in rows:
        gap = mean(gaps)
        cost = mean(e["cost"]["cost_vs_static"] for e in entries)
        target = (STATIC_TARGET if name.startswith("static") else
                  ATTENTION_TARGET if "+ attention" in name else CPT_TARGET)
        verdict = f"{'meets' if gap >= -target else 'misses'} {target}"
        if name.startswith("CPT 4-8/8"):
            verdict += f"; cost {'within' if cost <= COST_TARGET else 'above'} {COST_TARGET}"
        lines.append(f"| {name} | {describe(option)} | {len(entries)} | {accuracy(entries)} | {gap:+.2f} ± "
                     f"{error:.2f} | {sum(g < 0 for g in gaps)} of {len(gaps)} | {cost:.3f} | {verdict} | "
                     f"{seconds(entries)} |")
    return lines


def gpu_summary(results: dict) -> list[str]:
    """One line for the README: each setting's paired gap to FP32 on the GPU."""
    paired = _paired_gaps(results)
    if paired is None or not paired[1]:
        return []
    fp32, rows = paired
    gpu = results.get("environment", {}).get("gpu") or "a GPU"
    return [f"- On one {gpu}, {len(fp32)} seeds per setting (default errors; [docs/backward.md](backward.md)), "
            "points against FP32 of the same seed, ± standard error: "
            + "; ".join(f"{name} {mean(gaps):+.2f} ± {error:.2f}" for name, _, _, gaps, error in rows) + "."]


def gradient_section(results: dict) -> list[str]:
    """The gradient-fidelity table (bench/gradient_fidelity.py) and what separates the two attention grids."""
    variants = results.get("variants", {})
    groups = list(next(iter(variants.values()))["groups"]) if variants else []
    lines = ["## Gradient fidelity: the errors of the attention products", "",
             f"`python bench/gradient_fidelity.py`: {results['settings']['model']}, "
             f"{results['settings']['batches']}, static 8/8. Cosine similarity of the quantized run's parameter "
             f"gradients to FP32's: one draw (what one training step sees), and in brackets the mean of "
             f"{results['settings']['draws']} draws (mostly the bias).", "",
             "| variant | " + " | ".join(groups) + " |", "|---|" + "---|" * len(groups)]
    for name, entry in variants.items():
        cells = [f"{v['one_draw']:.4f} ({v['mean_of_draws']:.4f})" for v in entry["groups"].values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    def counterpart(name: str) -> str | None:  # the same variant with the attention errors zero-centred
        wanted = name.replace("errors min/max", "errors zero-centred").replace(", min/max", ", attention zero-centred")
        return next((other for other in variants if other != name and other.startswith(wanted)), None)

    pairs = [(name, counterpart(name)) for name in variants if "min/max" in name and "attention" in name]
    for minmax, centred in [(a, b) for a, b in pairs if b is not None]:
        before = {g: 1 - v["one_draw"] for g, v in variants[minmax]["groups"].items()}
        after = {g: 1 - v["one_draw"] for g, v in variants[centred]["groups"].items()}
        worst = max(before, key=lambda g: before[g] / max(after[g], 1e-12))
        lines += ["", f"- {centred} against {minmax}: the distance to FP32 (1 - cosine, one draw) of all gradients "
                      f"goes from {before['all']:.4f} to {after['all']:.4f}; the most changed group, {worst}, from "
                      f"{before[worst]:.4f} to {after[worst]:.4f}."]
    return lines


# (title, results file, the command that adds its per-row runs, (metric name, higher is better, scale), the
# activation ranges of its quantized layers under the default scheme)
FROM_SCRATCH = (
    ("CIFAR-10, ResNet-20 from scratch (4 epochs)", "vision.json",
     "python bench/cifar10.py --runs static-8/8-error-token cpt-3-8/8-error-token", ("accuracy %", True, 100),
     "tensor"),
    ("WikiText-2, GPT-2-shaped language model from scratch (2 epochs)", "language_model.json",
     "python bench/language_model.py --runs static-8/8-error-token cpt-4-8/8-error-token", ("perplexity", False, 1),
     "token"),
)


def scratch_section(title: str, results: dict, command: str, metric: tuple[str, bool, float],
                    default_errors: tuple) -> list[str]:
    """One from-scratch task: each method with the paper's per-tensor errors and with the default."""
    name, higher_is_better, scale = metric
    grouped = groups(results.get("runs", {}))
    fp32 = fp32_entries(grouped)
    lines = [f"## {title}", "", f"Same settings as docs/RESULTS.md; the per-row runs added by `{command}`. vs FP32: "
             "the mean gap to the FP32 run of the same seed.", "",
             f"| run | errors | seeds | {name} | vs FP32 | cost vs static |", "|---|---|---|---|---|---|"]
    for (method_name, option), entries in sorted(grouped.items(), key=lambda kv: (kv[0][0] != "FP32", kv[0])):
        values = [scale * e["metric"] for e in entries]
        gap = "-" if fp32 is None or method_name == "FP32" else f"{_gap_to_fp32(entries, fp32, scale):+.2f}"
        cost = "-" if method_name == "FP32" else f"{mean(e['cost']['cost_vs_static'] for e in entries):.3f}"
        marker = " (default)" if option == default_errors else ""
        lines.append(f"| {method_name} | {describe(option) + marker if option else '-'} | "
                     f"{', '.join(str(e['seed']) for e in sorted(entries, key=lambda e: e['seed']))} | "
                     f"{mean(values):.2f} ± {spread(values):.2f} | {gap} | {cost} |")
    paper = tuple(ERROR_DEFAULTS.values())
    per_row = ("token", *paper[1:])
    pairs = [(method_name, grouped[(method_name, paper)], grouped[(method_name, per_row)])
             for (method_name, option) in grouped if option == paper and (method_name, per_row) in grouped]
    lines.append("")
    for method_name, paper_entries, row_entries in sorted(pairs, key=lambda p: p[0]):
        change = scale * (mean(e["metric"] for e in row_entries) - mean(e["metric"] for e in paper_entries))
        better = (change > 0) == higher_is_better
        lines.append(f"- {method_name}: per-row errors {'improve' if better else 'worsen'} {name} by "
                     f"{abs(change):.2f} against per-tensor errors ({len(row_entries)} against "
                     f"{len(paper_entries)} seed(s)).")
    return lines


def findings(grouped: dict, fp32: list[dict] | None, default_errors: tuple) -> list[str]:
    if fp32 is None:
        return ["- No FP32 run yet: nothing to compare with."]
    lines = _noise(grouped)
    for (name, option), entries in sorted(grouped.items(), key=lambda kv: kv[0]):
        if name == "FP32":
            continue
        gap = _gap_to_fp32(entries, fp32)
        seeds = len(entries)
        line = f"- {name}, {describe(option)}: {gap:+.2f} points against FP32 over {seeds} seed(s)"
        if name.startswith("static") and not name.startswith("static 8/8"):
            line += " (a probe below 8 bits: no target)"  # the targets are for static 8/8 and CPT
        else:
            target = (STATIC_TARGET if name.startswith("static") else
                      ATTENTION_TARGET if "+ attention" in name else CPT_TARGET)
            line += f"; {'meets' if gap >= -target else 'misses'} the {target}-point target"
        lines.append(line + ("" if seeds >= 2 else " (one seed: a direction, not a result)") + ".")
    lines += _attention_pairs(grouped)
    lines += _integer_pairs(grouped)
    lines += _variant_pairs(grouped)
    lines += _int8_findings(grouped)
    lines += _attention_by_schedule(grouped, default_errors)
    lines += _attention_errors_share(grouped)
    cpt = [(name, entries, option) for (name, option), entries in sorted(grouped.items(), key=lambda kv: kv[0])
           if name.startswith("CPT 4-8/8") and "activations)" not in name]
    for name, entries, option in cpt:
        cost = mean(e["cost"]["cost_vs_static"] for e in entries)
        uncounted = " without the attention products (†)" if _uncounted_attention(entries) else ""
        lines.append(f"- {name} ({describe(option)}) costs {cost:.3f} of static 8/8{uncounted} "
                     f"({'within' if cost <= COST_TARGET else 'above'} the {COST_TARGET} target)."
                     + (_cost_floor(entries) if cost > COST_TARGET else ""))
    lines += _both_targets(grouped, fp32)
    lines.append(f"- The library's default errors (`CPTConfig()`, `error_granularity='auto'`) in these per-token "
                 f"layers: {describe(default_errors)}; in layers with per-tensor activations (Conv2d under the "
                 f"default scheme) one range per tensor.")
    return lines


README_METHODS = ("static 8/8", "CPT 4-8/8", "CPT 5-8/8", "CPT 4-8/8 + attention, its errors zero-centred",
                  "CPT 4-8/8 + attention at 8 bits, its errors zero-centred", "CPT 4-8/8 (paper activations)")


def readme_summary(ablation: dict, pretrained: dict, default_errors: tuple, on_gpu: dict | None = None) -> list[str]:
    """The README's table: FP32 against each method with per-tensor errors (the paper's) and the default."""
    grouped = groups(pretrained.get("finetune", {}), ablation.get("finetune", {}))
    fp32 = fp32_entries(grouped)
    paper_errors = tuple(ERROR_DEFAULTS.values())
    columns = [(name, option) for name in README_METHODS for option in (paper_errors, default_errors)
               if (name, option) in grouped]
    if fp32 is None or not columns:
        return []

    def label(name, option):
        return f"{name}, {'per-tensor errors' if option == paper_errors else 'default errors'}"

    def cell(entries):
        points = [e["metric"] for e in entries]
        return f"{100 * mean(points):.2f} ± {100 * spread(points):.2f}"

    return ["| MNLI fine-tuning, all-MiniLM-L6-v2 | FP32 | " + " | ".join(label(*c) for c in columns) + " |",
            "|---|---|" + "---|" * len(columns),
            "| accuracy %, mean ± half range over seeds | " + cell(fp32) + " | "
            + " | ".join(cell(grouped[c]) for c in columns) + " |",
            "| points vs FP32, same seeds | - | "
            + " | ".join(f"{_gap_to_fp32(grouped[c], fp32):+.2f}" for c in columns) + " |",
            "| seeds | " + str(len(fp32)) + " | " + " | ".join(str(len(grouped[c])) for c in columns) + " |",
            "| training cost vs static 8/8 (cost meter) | - | " + " | ".join(
                f"{mean(e['cost']['cost_vs_static'] for e in grouped[c]):.3f}" + _uncounted_attention(grouped[c])
                for c in columns) + " |",
            "",
            "† measured before the cost meter counted the attention products: attention, in FP32 unless "
            "`quantize_attention=True`, is left out of both sides of this ratio.",
            ""] + _attention_by_schedule(grouped, default_errors) + _both_targets(grouped, fp32) + gpu_summary(
                on_gpu or {})


def _noise(grouped: dict) -> list[str]:
    """How far apart two runs of one setting land: the pooled standard deviation over seeds of every setting
    with two or more, and the standard error of a difference of two such means; smaller gaps are unresolved."""
    groups = [[100 * e["metric"] for e in entries] for entries in grouped.values() if len(entries) > 1]
    freedom = sum(len(points) - 1 for points in groups)
    if not freedom:
        return []
    deviation = (sum((p - mean(points)) ** 2 for points in groups for p in points) / freedom) ** 0.5
    seeds = round(mean(len(points) for points in groups))
    error = deviation * (2 / seeds) ** 0.5
    return [f"- Seed-to-seed noise: one run of a setting lands within ±{deviation:.2f} points (pooled standard "
            f"deviation over {len(groups)} settings with 2 or more seeds); the difference of two {seeds}-seed means "
            f"has a standard error of {error:.2f} points, so gaps smaller than about {2 * error:.1f} points are not "
            "resolved by these runs, the targets below included."]


def seed_gaps(entries: list[dict], baseline: list[dict], scale: float = 100) -> list[float]:
    """Each entry against the baseline run of the same seed (same data order and initial head), in points (the
    metric times ``scale``)."""
    by_seed = {e["seed"]: e["metric"] for e in baseline}
    return [scale * (e["metric"] - by_seed[e["seed"]]) for e in entries if e["seed"] in by_seed]


def _gap_to_fp32(entries: list[dict], fp32: list[dict], scale: float = 100) -> float:
    """A run's mean gap to FP32 (the metric times ``scale``), seed by seed over the seeds both ran (the paired
    comparison: each seed fixes the data order and the initial head), or between the two means where they share
    no seed."""
    gaps = seed_gaps(entries, fp32, scale)
    return mean(gaps) if gaps else scale * (mean(e["metric"] for e in entries) - mean(e["metric"] for e in fp32))


def _attention_pairs(grouped: dict) -> list[str]:
    """Each run with quantized attention against the same run without it, seed by seed (same data order and
    initial head): what quantizing the attention products costs, apart from the seeds' spread."""
    lines = []
    for (name, option), entries in sorted(grouped.items(), key=lambda kv: kv[0]):
        if " + attention" not in name:
            continue
        gaps = seed_gaps(entries, grouped.get((name.split(" + attention")[0], option), []))
        if gaps:
            lines.append(f"- {name} against the same run without quantized attention, seed by seed "
                         f"({describe(option)}): " + ", ".join(f"{g:+.2f}" for g in gaps)
                         + f" points (mean {mean(gaps):+.2f}).")
    return lines


INTEGER_LABEL = " (forward on integer codes)"
CLIPPED_LABEL = " (clipped weight ranges)"
CEIL_LABEL = " (ceil-rounded cycle)"
# A variant's label -> what its twin without the label ran: each variant run against its twin, seed by seed.
VARIANT_TWINS = {CLIPPED_LABEL: "on min/max weight ranges", CEIL_LABEL: "with the nearest-rounded cycle"}
INT8_PRODUCTS = (("input_gradient_product", "input"), ("weight_gradient_product", "weight"))


def int8_label(config: dict) -> str:
    """The backward products a run ran on int8 grids (runs without the fields ran both in float)."""
    on = [name for key, name in INT8_PRODUCTS if config.get(key, "float") == "int8"]
    return f" (int8 {' and '.join(on)} gradient{'s' if len(on) > 1 else ''})" if on else ""


def int8_verdicts(grouped: dict) -> list[tuple[str, tuple, float, tuple[float, float], bool, list[float]]]:
    """(run, errors, mean accuracy %, the float run's seed range in %, whether the mean lies inside it, the gaps to
    the float run seed by seed in points) of each run with backward products on int8 grids against the same run with
    both in float (the CPT paper's): the rule that picks the default numerics (docs/method.md §2)."""
    verdicts = []
    for (name, option), entries in sorted(grouped.items(), key=lambda kv: kv[0]):
        label = next((f" (int8 {part})" for part in ("input and weight gradients", "input gradient", "weight gradient")
                      if f" (int8 {part})" in name), None)
        baseline = grouped.get((name.replace(label, ""), option)) if label else None
        if baseline:
            accuracy = _points(entries)
            seeds = (100 * min(e["metric"] for e in baseline), 100 * max(e["metric"] for e in baseline))
            verdicts.append((name, option, accuracy, seeds, seeds[0] <= accuracy <= seeds[1],
                             seed_gaps(entries, baseline)))
    return verdicts


def _int8_findings(grouped: dict) -> list[str]:
    return [f"- {name}: {accuracy:.2f}% mean accuracy, {'inside' if inside else 'outside'} the seeds' range of the "
            f"same run with both products in float ({low:.2f}-{high:.2f}%); against it seed by seed: "
            + ", ".join(f"{g:+.2f}" for g in gaps) + f" points (mean {mean(gaps):+.2f})."
            for name, _, accuracy, (low, high), inside, gaps in int8_verdicts(grouped) if gaps]


def _integer_pairs(grouped: dict) -> list[str]:
    """Each run whose layers' forward ran on integer codes against the same run with the float product, seed by
    seed: the two compute the same values up to float rounding, which sends a run down another path, so pairs are
    noise unless they agree in sign and size."""
    lines = []
    for (name, option), entries in sorted(grouped.items(), key=lambda kv: kv[0]):
        if INTEGER_LABEL not in name:
            continue
        gaps = seed_gaps(entries, grouped.get((name.replace(INTEGER_LABEL, ""), option), []))
        if gaps:
            lines.append(f"- {name} against the same run with the float product, seed by seed ({describe(option)}; "
                         "any change of rounding sends a run down another path, so a single gap is noise): "
                         + ", ".join(f"{g:+.2f}" for g in gaps) + f" points (mean {mean(gaps):+.2f}).")
    return lines


def _variant_pairs(grouped: dict) -> list[str]:
    """Each run of a `VARIANT_TWINS` variant (clipped weight ranges, the ceil-rounded cycle) against its twin without
    it, seed by seed (the same data order and initial head)."""
    lines = []
    for (name, option), entries in sorted(grouped.items(), key=lambda kv: kv[0]):
        for label, twin in VARIANT_TWINS.items():
            gaps = seed_gaps(entries, grouped.get((name.replace(label, ""), option), [])) if label in name else []
            if gaps:
                lines.append(f"- {name} against the same run {twin}, seed by seed: "
                             + ", ".join(f"{g:+.2f}" for g in gaps) + f" points (mean {mean(gaps):+.2f}).")
    return lines


def _both_targets(grouped: dict, fp32: list[dict]) -> list[str]:
    """The CPT 4-8/8 settings (two or more seeds) that meet the accuracy target and the cost target together."""
    met = []
    for (name, option), entries in sorted(grouped.items(), key=lambda kv: kv[0]):
        if not name.startswith("CPT 4-8/8") or "activations)" in name or len(entries) < 2:
            continue
        gap = _gap_to_fp32(entries, fp32)
        cost = mean(e["cost"]["cost_vs_static"] for e in entries)
        if gap >= -CPT_TARGET and cost <= COST_TARGET and not _uncounted_attention(entries):
            met.append(f"{name} ({describe(option)}): {gap:+.2f} points over {len(entries)} seeds at {cost:.3f}")
    head = (f"- CPT 4-8/8 within {CPT_TARGET} point of FP32 at no more than {COST_TARGET} of static 8/8's cost "
            "(two or more seeds): ")
    return [head + ("; ".join(met) if met else "no setting yet") + "."]


def _attention_by_schedule(grouped: dict, option: tuple) -> list[str]:
    """The seed-by-seed gaps of `_attention_pairs` pooled per layer schedule over every attention variant (cycled
    or held bits, errors quantized or not) with the layers' errors ``option``: whether quantizing the attention
    products costs accuracy under that schedule, with how many pairs point the same way."""
    pooled: dict[str, list[float]] = {}
    for (name, variant_option), entries in sorted(grouped.items(), key=lambda kv: kv[0]):
        if " + attention" not in name or variant_option != option:
            continue
        layers = name.split(" + attention")[0]
        pooled.setdefault(layers, []).extend(seed_gaps(entries, grouped.get((layers, option), [])))
    lines = []
    for layers, gaps in pooled.items():
        if not gaps:  # no run of these layers without quantized attention to pair with
            continue
        below = sum(g < 0 for g in gaps)
        chance = sum(math.comb(len(gaps), k) for k in range(below, len(gaps) + 1)) / 2 ** len(gaps)
        lines.append(f"- Quantized attention against the same run without it, pooled over its variants, {layers} "
                     f"({describe(option)}): {len(gaps)} pairs, mean {mean(gaps):+.2f} points, {below} of {len(gaps)} "
                     f"below zero (as many or more by chance, with no effect: {chance:.3f}; the variants share seeds, "
                     "so the pairs are not independent).")
    return lines


def _attention_errors_share(grouped: dict) -> list[str]:
    """Each run whose attention errors are quantized against the same run with those errors in full precision
    (`attention_errors=False`), seed by seed: the share of the attention's cost that its quantized errors add to
    its quantized forward."""
    lines = []
    for (name, option), entries in sorted(grouped.items(), key=lambda kv: kv[0]):
        if " + attention" not in name or "its errors in full precision" in name:
            continue
        forward_only = name.split(", its errors")[0] + ", its errors in full precision"
        gaps = seed_gaps(entries, grouped.get((forward_only, option), []))
        if gaps:
            lines.append(f"- {name} against the same run with the attention errors in full precision, seed by seed "
                         f"({describe(option)}): " + ", ".join(f"{g:+.2f}" for g in gaps)
                         + f" points (mean {mean(gaps):+.2f}): what quantizing those errors adds to the quantized "
                         "forward's cost.")
    return lines


def _cost_floor(entries: list[dict]) -> str:
    """Why a run's cost stays above the target: the share of its static counterpart's BitOPs spent on MACs that
    ran in full precision, which no schedule of the quantized layers lowers."""
    costs = [e["cost"] for e in entries
             if {"full_precision_mac_share", "fp32_gbitops", "static_gbitops"} <= set(e["cost"])]
    if not costs:
        return ""
    share = mean(c["full_precision_mac_share"] for c in costs)
    floor = mean(c["full_precision_mac_share"] * c["fp32_gbitops"] / c["static_gbitops"] for c in costs)
    return (f" {100 * share:.1f}% of its MACs ran in full precision (the attention products and the classifier), "
            f"{100 * floor:.0f}% of static 8/8's BitOPs: no schedule of the quantized layers takes its cost below "
            f"{floor:.2f}; quantizing the attention products (`quantize_attention`, `attention_bits`) is what can.")


def _uncounted_attention(entries: list[dict]) -> str:
    return " †" if any("full_precision_mac_share" not in e["cost"] for e in entries) else ""
