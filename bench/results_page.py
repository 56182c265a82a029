"""``docs/RESULTS.md`` and its plots, from the JSON of the results scripts (used by ``bench/report.py``).

Every figure on the page is computed here from ``bench/results/*.json``; the only constants are the
papers' published figures quoted for comparison (`PAPERS`).
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass

from hf_cpt.schedules.schedule import cost_group
from hf_cpt.schedules.shapes import FOLLOW_UP_SCHEDULES

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def recorded_products(results: dict) -> bool | str | None:
    """How a bench's run multiplied by default: its JSON's ``auto_products`` (`harness.products_setting`); a run
    before that field multiplied codes exactly where its CPU had int8 dot products (its ``integer_products``)."""
    return results.get("auto_products", results.get("integer_products"))


@dataclass(frozen=True)
class Task:
    key: str
    title: str
    file: str  # under bench/results/
    section: str  # the JSON object holding the runs
    metric: str
    higher_is_better: bool
    order: tuple[str, ...]
    command: str
    settings_key: str = "settings"
    extra_files: tuple[str, ...] = ()  # more runs of the same task, in the same section (e.g. the backward ablation)
    # Stored run name -> the name shown: the runs of today's defaults go under the plain names, the runs of an
    # earlier default keep a suffix that says what differs (so every page compares the library's defaults).
    renames: tuple[tuple[str, str], ...] = ()

    def format(self, value: float) -> str:
        return f"{100 * value:.2f}" if self.metric == "accuracy" else f"{value:.1f}"

    @property
    def unit(self) -> str:
        return "accuracy %" if self.metric == "accuracy" else "perplexity"


# Transformer layers quantize errors per row by default (`error_granularity="auto"`, docs/backward.md); the runs
# named without a suffix were measured under the earlier per-tensor default.
_DEFAULT_ERRORS_PER_ROW = (("static-8/8", "static-8/8-error-tensor"), ("cpt-4-8/8", "cpt-4-8/8-error-tensor"),
                           ("static-8/8-error-token", "static-8/8"), ("cpt-4-8/8-error-token", "cpt-4-8/8"))
# The language-model runs quantized throughout, named "-full" beside the partly quantized ones
_FULL = (("static-8/8-full", "static-8/8"), ("cpt-4-8/8-full", "cpt-4-8/8"))

TASKS = (
    Task("vision", "Vision: CIFAR-10, ResNet-20 from scratch", "vision.json", "runs", "accuracy", True,
         ("fp32", "static-8/8", "cpt-3-8/8", "static-6/6", "cpt-3-6/6"), "python bench/cifar10.py"),
    Task("entailment", "Entailment: pretrained all-MiniLM-L6-v2 fine-tuned on MNLI", "pretrained.json", "finetune",
         "accuracy", True, ("fp32", "static-8/8", "cpt-4-8/8", "cpt-5-8/8", "cpt-4-8/8-attention",
                            "cpt-4-8/8-attention-minmax", "cpt-4-8/8-attention-8-minmax", "static-8/8-error-tensor",
                            "cpt-4-8/8-error-tensor",
                            "cpt-5-8/8-error-tensor", "cpt-4-8/8-attention-error-tensor", "cpt-4-8/8-paper"),
         "python bench/pretrained.py", settings_key="finetune_settings", extra_files=("backward_ablation.json",),
         renames=_DEFAULT_ERRORS_PER_ROW + (("cpt-4-8/8-attention", "cpt-4-8/8-attention-error-tensor"),
                                            ("cpt-5-8/8", "cpt-5-8/8-error-tensor"),
                                            ("cpt-5-8/8-error-token", "cpt-5-8/8"),
                                            # the attention's errors on the min/max grid: the default before
                                            # error_range="auto" put them on the zero-centred one
                                            ("cpt-4-8/8-error-token-attention", "cpt-4-8/8-attention-minmax"),
                                            ("cpt-4-8/8-error-token-attention-8", "cpt-4-8/8-attention-8-minmax"),
                                            ("cpt-4-8/8-error-token-attention-symmetric", "cpt-4-8/8-attention"))),
    Task("language_model", "Language modelling: small GPT-2 on WikiText-2", "language_model.json", "runs",
         "perplexity", False, ("fp32", "static-8/8", "cpt-4-8/8", "static-8/8-error-tensor", "cpt-4-8/8-error-tensor"),
         "python bench/language_model.py", renames=_DEFAULT_ERRORS_PER_ROW),
    Task("language_model_full", "Language modelling, quantized throughout: small GPT-2 on WikiText-2 with the "
         "output head and the attention products quantized", "language_model_full.json", "runs", "perplexity", False,
         ("fp32", "static-8/8", "cpt-4-8/8"),
         "python bench/language_model.py --epochs 6 --runs fp32 static-8/8-full cpt-4-8/8-full --no_profile "
         "--output bench/results/language_model_full.json",
         renames=_FULL),
)
# The GPU runs (issues 75, 76; bench/gpu_finetune.sh, bench/gpu_horizon.sh): tables of their own, each naming its
# device in its settings line (the environment the JSON records)
TASKS += (
    Task("entailment_gpu", "Entailment on a GPU: pretrained all-MiniLM-L6-v2 fine-tuned on MNLI, 16 seeds",
         "finetune_gpu.json", "finetune", "accuracy", True, ("fp32", "bf16", "static-8/8", "cpt-4-8/8", "cpt-5-8/8"),
         "bash bench/gpu_finetune.sh", settings_key="finetune_settings", renames=_DEFAULT_ERRORS_PER_ROW[2:]),
    Task("rte_gpu", "Entailment on a GPU, second task: RTE", "finetune_gpu_rte.json", "finetune", "accuracy", True,
         ("fp32", "static-8/8", "cpt-4-8/8"), "STAGE=rte bash bench/gpu_finetune.sh",
         settings_key="finetune_settings", renames=_DEFAULT_ERRORS_PER_ROW[2:]),
    Task("language_model_gpu", "Language modelling on a GPU: a 70M Llama-style model on WikiText-2, quantized "
         "throughout, each run until its validation loss stalls", "language_model_gpu.json", "runs", "perplexity",
         False, ("fp32", "static-8/8", "cpt-4-8/8"), "STAGE=lm bash bench/gpu_horizon.sh",
         renames=_FULL),
)
SWEEP_FILE = "schedule_sweep.json"

# The papers' published figures (accuracy %, perplexity, BitOPs change), quoted for comparison only.
PAPERS = {
    "vision": ("CPT paper, CIFAR-100 ResNet-74 (160 epochs): static 8/8 71.44%, CPT 3-8/8 72.35% (+0.91) at "
               "37.1% fewer BitOPs; CIFAR-10: 92.57% vs 93.23%."),
    "entailment": ("Follow-up study, XNLI German with multilingual BERT: CPT 5-8/8 (2 cycles) against a static 6/6 "
                   "baseline; the CPT paper has no BERT result."),
    "language_model": ("CPT paper, WikiText-103 Transformer: static 8/8 perplexity 31.77, CPT 4-8/8 30.22 at "
                       "30.2% fewer BitOPs."),
    "language_model_full": ("CPT paper, WikiText-103 Transformer (quantized throughout): static 8/8 perplexity "
                            "31.77, CPT 4-8/8 30.22 at 30.2% fewer BitOPs."),
    "entailment_gpu": "as for the CPU runs above (no published MiniLM figure).",
    "rte_gpu": "none published for CPT.",
    "sweep": ("Follow-up study: schedules that spend long stretches at low precision (small cost: RR, RT-H) "
              "cost accuracy, most of all early in training; triangular schedules (which start at high "
              "precision) and large-cost ones (ER, ET-H) protect it."),
}
PAPERS["language_model_gpu"] = PAPERS["language_model_full"]


# ----------------------------------------------------------------------------- data helpers


def load(results_dir: str, name: str) -> dict | None:
    path = os.path.join(results_dir, name)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def task_data(results_dir: str, task: Task) -> dict | None:
    """The task's JSON, with the runs of its extra files merged in and every run under its shown name."""
    data = load(results_dir, task.file)
    if not data or not data.get(task.section):
        return None
    section = dict(data[task.section])
    for name in task.extra_files:
        extra = load(results_dir, name)
        if extra:
            section.update(extra.get(task.section, {}))
    renames = dict(task.renames)
    section = {key: {**entry, "run": renames.get(entry["run"], entry["run"])} for key, entry in section.items()}
    return {**data, task.section: section}


def by_run(section: dict, order: tuple[str, ...] | None = None) -> dict[str, list[dict]]:
    """Entries grouped by run name (in ``order`` when given), each sorted by seed."""
    runs: dict[str, list[dict]] = {}
    for entry in section.values():
        runs.setdefault(entry["run"], []).append(entry)
    names = [n for n in order if n in runs] if order else list(runs)
    return {name: sorted(runs[name], key=lambda e: e["seed"]) for name in names}


def mean(values) -> float:
    return statistics.fmean(values)


def spread(values: list[float]) -> float:
    """Half the range over the seeds (with two seeds: each seed's distance from the mean)."""
    return (max(values) - min(values)) / 2


def metric_cell(task: Task, entries: list[dict]) -> str:
    values = [e["metric"] for e in entries]
    return f"{task.format(mean(values))} ± {task.format(spread(values))}"


def static_counterpart(entry: dict, runs: dict | None = None) -> str | None:
    """The static run a CPT run is compared with: static at its ``bits_max`` and ``grad_bits``, with the longest
    part of the run's suffix that names a static run too (``cpt-4-8/8-attention-error-tensor`` is compared with
    ``static-8/8-error-tensor``)."""
    config = entry["cpt_config"]
    if config.get("schedule") in ("fp32", "static"):
        return None
    static = f"static-{config['bits_max']}/{config['grad_bits']}"
    suffix = entry["run"].split("/", 1)[1].split("-")[1:] if "/" in entry["run"] else []
    for start in range(len(suffix)):
        candidate = "-".join([static, *suffix[start:]])
        if runs is not None and candidate in runs:
            return candidate
    return static


def meter_cost(entries: list[dict]) -> float:
    """The cost meter's ratio to the same run at static ``bits_max`` (same layers and attention quantized)."""
    return mean(e["cost"]["cost_vs_static"] for e in entries)


def mean_bits(entry: dict) -> float | None:
    steps = {k: v for k, v in entry["cost"].get("steps_at_bits", {}).items() if k not in ("fp32", "None")}
    total = sum(steps.values())
    return sum(int(b) * n for b, n in steps.items()) / total if total else None


# ----------------------------------------------------------------------------- tables and findings


def task_table(task: Task, runs: dict[str, list[dict]]) -> list[str]:
    fp32_step = mean(e["seconds_per_step"] for e in runs["fp32"]) if "fp32" in runs else None
    static8 = mean(e["cost"]["gbitops"] for e in runs["static-8/8"]) if "static-8/8" in runs else None
    lines = [f"| run | seeds | {task.unit} (mean ± half range) | GBitOPs | cost vs static 8/8 run | cost vs static "
             "at its `bits_max` (meter) | cost vs FP32 (meter) | MACs in FP32 | time per step vs FP32 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, entries in runs.items():
        costs = [e["cost"] for e in entries]
        gbitops = mean(c["gbitops"] for c in costs)
        quantized = entries[0]["cpt_config"].get("schedule") != "fp32"
        share = [c["full_precision_mac_share"] for c in costs if "full_precision_mac_share" in c]
        cells = [
            name, ", ".join(str(e["seed"]) for e in entries), metric_cell(task, entries), f"{gbitops:,.0f}",
            f"{gbitops / static8:.3f}" if static8 and quantized else "-",
            f"{mean(c['cost_vs_static'] for c in costs):.3f}" if quantized else "-",
            f"{mean(c['cost_vs_fp32'] for c in costs):.4f}",
            f"{100 * mean(share):.1f}%" if share else "n/a",
            f"{mean(e['seconds_per_step'] for e in entries) / fp32_step:.2f}" if fp32_step else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def comparisons(task: Task, runs: dict[str, list[dict]]) -> list[dict]:
    """Each CPT run against its static counterpart and against FP32: gaps, spreads, cost saving."""
    rows = []
    for name, entries in runs.items():
        counterpart = static_counterpart(entries[0], runs)
        if counterpart is None:
            continue
        row = {"run": name, "seeds": len(entries), "metric": mean(e["metric"] for e in entries),
               "spread": spread([e["metric"] for e in entries])}
        if counterpart in runs:
            static = runs[counterpart]
            row.update(static=counterpart, static_metric=mean(e["metric"] for e in static),
                       static_spread=spread([e["metric"] for e in static]),
                       saving=1 - mean(e["cost"]["gbitops"] for e in entries) / mean(
                           e["cost"]["gbitops"] for e in static))
        if "fp32" in runs:
            row["fp32_metric"] = mean(e["metric"] for e in runs["fp32"])
        rows.append(row)
    return rows


def verdict(task: Task, row: dict) -> str:
    """'better than', 'matches' or 'worse than' the static run; a gap within the seeds' spreads matches."""
    return judge(row["metric"] - row["static_metric"], row["spread"] + row["static_spread"], task.higher_is_better)


def judge(gap: float, spreads: float, higher_is_better: bool = True) -> str:
    """The page's words for a gap between two means: 'matches' within the seeds' spreads, else better or worse."""
    if abs(gap) <= spreads:
        return "matches"
    return "better than" if (gap > 0) == higher_is_better else "worse than"


def gap_text(task: Task, a: float, b: float) -> str:
    scale = 100 if task.metric == "accuracy" else 1
    unit = " points" if task.metric == "accuracy" else " (lower is better)"
    return f"{scale * (a - b):+.2f}{unit}"


def findings(task: Task, runs: dict[str, list[dict]]) -> list[str]:
    lines = []
    for row in comparisons(task, runs):
        if "static" in row:
            lines.append(
                f"- **{row['run']}** {verdict(task, row)} {row['static']} ({task.format(row['metric'])} vs "
                f"{task.format(row['static_metric'])}, {gap_text(task, row['metric'], row['static_metric'])}; seed "
                f"spreads ±{task.format(row['spread'])} and ±{task.format(row['static_spread'])}) at "
                f"{100 * row['saving']:.1f}% fewer GBitOPs.")
        if "fp32_metric" in row:
            lines.append(f"  Against FP32 training: {gap_text(task, row['metric'], row['fp32_metric'])}.")
        shares = [e["cost"]["full_precision_mac_share"] for e in runs[row["run"]]
                  if e["cost"].get("full_precision_mac_share") is not None]
        if shares and mean(shares) > 0.2:
            lines.append(f"  {100 * mean(shares):.0f}% of this run's MACs ran in full precision (the layers kept in "
                         "FP32, such as the output head, and the attention products unless `quantize_attention`), "
                         "so the schedule can lower only the rest: this caps the saving.")
    return lines


def profile_table(task: Task, runs: dict[str, list[dict]]) -> list[str]:
    runs = {n: [e for e in entries if "profile" in e] for n, entries in runs.items()}
    runs = {n: entries for n, entries in runs.items() if entries}
    if not runs:
        return []
    bits = list(next(iter(runs.values()))[0]["profile"])
    lines = [f"| {task.key}: trained as | seeds | " + " | ".join(b if b == "fp32" else f"{b} bits" for b in bits)
             + " |", "|---|---|" + "---|" * len(bits)]
    for name, entries in runs.items():
        cells = [task.format(mean(e["profile"][b] for e in entries)) for b in bits]
        lines.append(f"| {name} | {len(entries)} | " + " | ".join(cells) + " |")
    return lines


def profile_findings(task: Task, runs: dict[str, list[dict]]) -> list[str]:
    """At each bit-width below 8: does each CPT run hold its metric better than its static counterpart?"""
    lines = []
    for name, entries in runs.items():
        counterpart = static_counterpart(entries[0], runs)
        if counterpart not in runs or not all("profile" in e for e in entries + runs[counterpart]):
            continue
        ours, theirs = entries, runs[counterpart]
        better, worse = [], []
        for b in ours[0]["profile"]:
            if b in ("fp32", str(entries[0]["cpt_config"]["bits_max"])):
                continue
            a, s = mean(e["profile"][b] for e in ours), mean(e["profile"][b] for e in theirs)
            (better if (a > s) == task.higher_is_better else worse).append(f"{b} bits")
        lines.append(f"- {name} against {counterpart}: better at {', '.join(better) or 'no precision'}; "
                     f"worse at {', '.join(worse) or 'no precision'}.")
    return lines


# ----------------------------------------------------------------------------- plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finish_plot(fig, axis, path: str, xlabel: str, ylabel: str, title: str, legend_size: int = 8) -> None:
    """Label one-axis figure ``fig``, write it to ``path`` and free it."""
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    axis.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)


def plot_curves(task: Task, runs: dict[str, list[dict]], path: str) -> None:
    """Training loss (top) and bit-width (bottom) against the step, first seed of each run."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True, height_ratios=(3, 1.4))
    for name, entries in runs.items():
        curve = entries[0]["curve"]
        steps = [p["step"] for p in curve]
        line = top.plot(steps, [p["loss"] for p in curve], label=f"{name} (seed {entries[0]['seed']})",
                        linewidth=1.2)[0]
        if entries[0]["cpt_config"].get("schedule") != "fp32":
            bits = [p["bits"] if p["bits"] is not None and p["bits"] <= 16 else float("nan") for p in curve]
            bottom.step(steps, bits, where="post", linewidth=1.0, label=name, color=line.get_color())
    top.set_ylabel("training loss")
    top.set_title(task.title)
    top.legend(fontsize=8)
    bottom.set_ylabel("bits (at logged steps)")
    bottom.set_xlabel("optimizer step (logged steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_profiles(tasks: list[tuple[Task, dict]], path: str) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.8), squeeze=False)
    for axis, (task, runs) in zip(axes[0], tasks):
        for name, entries in runs.items():
            entries = [e for e in entries if "profile" in e]
            if not entries:
                continue
            bits = [b for b in entries[0]["profile"] if b != "fp32"]
            values = [mean(e["profile"][b] for e in entries) for b in bits]
            scale = 100 if task.metric == "accuracy" else 1
            line = axis.plot([int(b) for b in bits], [scale * v for v in values], marker="o", label=name)[0]
            axis.axhline(scale * mean(e["profile"]["fp32"] for e in entries), color=line.get_color(),
                         linestyle=":", linewidth=0.8)
        axis.set_xlabel("inference bits (dotted: the same model in FP32)")
        axis.set_ylabel(task.unit)
        if task.metric == "perplexity":
            axis.set_yscale("log")
        axis.set_title(task.key)
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(rows: list[dict], references: dict[str, dict], path: str) -> None:
    plt = _pyplot()
    colors = {"small": "tab:red", "medium": "tab:blue", "large": "tab:green"}
    fig, axis = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        axis.scatter(row["gbitops"], 100 * row["accuracy"], color=colors[row["group"]])
        axis.annotate(row["run"], (row["gbitops"], 100 * row["accuracy"]), fontsize=8, xytext=(4, 2),
                      textcoords="offset points")
    if "static-8/8" in references:
        ref = references["static-8/8"]
        axis.scatter(ref["gbitops"], 100 * ref["accuracy"], color="black", marker="s")
        axis.annotate("static 8/8", (ref["gbitops"], 100 * ref["accuracy"]), fontsize=8, xytext=(4, 2),
                      textcoords="offset points")
    if "fp32" in references:
        axis.axhline(100 * references["fp32"]["accuracy"], color="gray", linestyle="--", linewidth=0.8,
                     label="FP32 (off the cost axis)")
    for group, color in colors.items():
        axis.scatter([], [], color=color, label=f"{group} cost")
    finish_plot(fig, axis, path, "training GBitOPs (cost meter)", "test accuracy %",
                "Schedules of the follow-up study, ResNet-20 on CIFAR-10, 3-8/8 bits")


# ----------------------------------------------------------------------------- page


def sweep_rows(sweep: dict) -> tuple[list[dict], dict[str, dict]]:
    rows, references = [], {}
    for name, entries in by_run(sweep["runs"]).items():
        entry = entries[0]
        row = {"run": name, "accuracy": entry["metric"], "gbitops": entry["cost"]["gbitops"],
               "cost_vs_static": entry["cost"]["cost_vs_static"], "mean_bits": mean_bits(entry)}
        if name in FOLLOW_UP_SCHEDULES:
            config = entry["cpt_config"]
            row["group"] = cost_group(row["mean_bits"], config["bits_min"], config["bits_max"])
            rows.append(row)
        else:
            references[name] = row
    order = {name: i for i, name in enumerate(FOLLOW_UP_SCHEDULES)}
    return sorted(rows, key=lambda r: order[r["run"]]), references


def sweep_section(sweep: dict, figures_dir: str, link_dir: str) -> list[str]:
    rows, references = sweep_rows(sweep)
    settings = sweep.get("settings", {})
    lines = ["## Schedule sweep: the follow-up study's ten schedules", "",
             f"ResNet-20 on CIFAR-10 as above, {settings.get('epochs')} epochs, {settings.get('cycles')} cycles, "
             "3-8 bits with 8-bit errors, one seed (`python bench/schedule_sweep.py`). Static 8/8 and FP32 at the "
             "same length for reference.", "",
             "| schedule | cost group | mean bits | accuracy % | GBitOPs | cost vs static 8/8 (meter) |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['run']} | {row['group']} | {row['mean_bits']:.2f} | {100 * row['accuracy']:.2f} | "
                     f"{row['gbitops']:,.0f} | {row['cost_vs_static']:.3f} |")
    for name, row in references.items():
        lines.append(f"| {name} (reference) | - | - | {100 * row['accuracy']:.2f} | {row['gbitops']:,.0f} | - |")
    lines.append("")
    if rows:
        groups: dict[str, list[float]] = {}
        for row in rows:
            groups.setdefault(row["group"], []).append(row["accuracy"])
        lines.append("Mean accuracy by cost group: " + "; ".join(
            f"{g} {100 * mean(v):.2f}% ({len(v)} schedules)" for g, v in groups.items()) + ".")
        best = max(rows, key=lambda r: r["accuracy"])
        worst = min(rows, key=lambda r: r["accuracy"])
        lines += [f"Best: {best['run']} ({100 * best['accuracy']:.2f}%), worst: {worst['run']} "
                  f"({100 * worst['accuracy']:.2f}%). One seed: differences below about one point are within "
                  "the seed-to-seed spread the vision table shows.", ""]
        plot_sweep(rows, references, os.path.join(figures_dir, "schedule_sweep.png"))
        lines += [f"![schedule sweep]({link_dir}/schedule_sweep.png)", ""]
    return lines


def scale_note(loaded: list[tuple[Task, dict]]) -> list[str]:
    """What this machine's runs are, next to the papers' (from the JSON settings), and how to read them."""
    sizes = []
    for task, data in loaded:
        settings, size = data.get(task.settings_key, {}), data.get("data", {})
        if task.key == "vision":
            sizes.append(f"{settings.get('epochs')} epochs over {size.get('train', '?'):,} CIFAR-10 images "
                         "(the paper: 160 epochs over 50,000)")
        elif task.key in ("language_model", "language_model_full"):
            sizes.append(f"{settings.get('epochs')} epochs of a {settings.get('model', {}).get('n_layer')}-layer "
                         f"GPT-2 over {size.get('train_tokens', 0):,} tokens (the paper: WikiText-103, ~100M tokens)")
        elif task.key == "entailment":
            sizes.append(f"one epoch over {settings.get('train_size')} MNLI pairs")
    return ["Runs here last minutes, not days: " + "; ".join(sizes) + ". Absolute accuracies are therefore far "
            "below the papers'; what carries over is the comparison between runs of the same length, and the "
            "cost ratios, which do not depend on length. The findings under each task say whether CPT matched "
            "static training at its cost saving here; where it did not, the papers' claim is not reproduced at "
            "this scale."]


def results_page(results_dir: str, figures_dir: str, link_dir: str = "results") -> str:
    """The whole page; writes the plots into ``figures_dir`` (linked as ``link_dir`` from the page)."""
    import horizon_page  # a section of this page, built from the helpers above

    os.makedirs(figures_dir, exist_ok=True)
    loaded = [(task, task_data(results_dir, task)) for task in TASKS]
    loaded = [(task, data) for task, data in loaded if data]
    sweep = load(results_dir, SWEEP_FILE)
    environment = next((data["environment"] for _, data in loaded if "environment" in data), None)
    lines = ["# Results: CPT through hf_cpt on real data", "",
             "<!-- generated by `python bench/report.py` from bench/results/*.json; do not edit -->", "",
             "Every figure below is computed by `bench/report.py` from the JSON the scripts write; the commands:",
             "", "```bash", "make results     # all of the below, then the report (resumable: finished runs are "
             "skipped)"]
    lines += [task.command for task, _ in loaded] + (["python bench/schedule_sweep.py"] if sweep else [])
    lines += [horizon_page.COMMAND] if load(results_dir, horizon_page.FILE) else []
    lines += ["python bench/report.py", "```", ""]
    if environment:
        lines += ["Machine and versions: " + ", ".join(f"{k} {v}" for k, v in environment.items()) + ". Costs come "
                  "from the library's cost meter (`CPTCallback.cost_report()`): BitOPs of every counted product, "
                  "forward and both backward products, at the bits each step ran. Accuracy and perplexity are "
                  "mean ± half the range over the seeds. Time per step was measured on 2 cores that other jobs "
                  "shared during some runs: it is indicative only (`bench/overhead.py` measures overhead side by "
                  "side).", ""]
    lines += ["## Summary", "", "| task | metric | " + " | ".join(("FP32", "static 8/8", "CPT")) +
              " | CPT cost vs static (meter) | CPT against static 8/8 |", "|---|---|---|---|---|---|---|"]
    for task, data in loaded:
        lines += [f"| {task.key} | {task.unit} | " + " | ".join(cells) + " |"
                  for cells in summary_cells(task, by_run(data[task.section], task.order))]
    lines.append("")
    profiles = []
    for task, data in loaded:
        runs = by_run(data[task.section], task.order)
        settings = data.get(task.settings_key, {})
        lines += [f"## {task.title}", "", f"`{task.command}`; settings: " + ", ".join(
            f"{k} {v}" for k, v in settings.items() if v not in (None, -1)) + ".", ""]
        if task.key == "entailment":
            lines += ["The fine-tuning runs of `bench/pretrained.py` (default `CPTConfig` settings for pretrained "
                      "transformers: rotated per-token activations); the output-fidelity study and details are on "
                      "[pretrained.md](pretrained.md).", ""]
        lines += task_table(task, runs) + [""] + findings(task, runs) + [""]
        older = sorted({name for name, entries in runs.items() for e in entries
                        if "full_precision_mac_share" not in e["cost"]})
        if older:
            lines += [f"Runs measured before the cost meter counted the attention products ({', '.join(older)}): "
                      "their GBitOPs cover the Linear layers only, so compare them with each other and through "
                      "the meter's own ratios, not by GBitOPs against newer runs.", ""]
        lines += [f"Reported figures to compare: {PAPERS[task.key]}", ""]
        plot_curves(task, runs, os.path.join(figures_dir, f"{task.key}_curves.png"))
        lines += [f"![{task.key} training curves]({link_dir}/{task.key}_curves.png)", ""]
        profiles.append((task, runs))
    horizon = load(results_dir, horizon_page.FILE)
    if horizon:
        lines += horizon_page.section(horizon, figures_dir, link_dir)
    horizon_gpu = load(results_dir, horizon_page.GPU_FILE)
    if horizon_gpu:
        lines += horizon_page.section(horizon_gpu, figures_dir, link_dir, gpu=True)
    if sweep and sweep.get("runs"):
        lines += sweep_section(sweep, figures_dir, link_dir)
        lines += [f"Reported: {PAPERS['sweep']}", ""]
    if any(profile_table(task, runs) for task, runs in profiles):
        lines += ["## Precision profile: the trained models at lower inference precision", "",
                  "Every trained model evaluated at 3-8 bits and in FP32 (`CPTTrainer.evaluate_precisions`), mean "
                  "over the seeds. The question: does a CPT-trained model hold its accuracy at low inference "
                  "precision better than a static-trained one?", ""]
        for task, runs in profiles:
            table = profile_table(task, runs)
            if table:
                lines += table + [""] + profile_findings(task, runs) + [""]
        plot_profiles([(t, r) for t, r in profiles if profile_table(t, r)],
                      os.path.join(figures_dir, "precision_profile.png"))
        lines += [f"![precision profile]({link_dir}/precision_profile.png)", ""]
    lines += ["## Against the papers", ""] + scale_note(loaded) + [""]
    return "\n".join(lines).rstrip() + "\n"


def summary_cells(task: Task, runs: dict[str, list[dict]]) -> list[list[str]]:
    """Per CPT run compared with static 8/8: FP32, static 8/8, the CPT run, its meter cost and the verdict."""
    rows = []
    for row in comparisons(task, runs):
        if row.get("static") != "static-8/8" or row["run"].endswith("-paper"):
            continue
        cpt = runs[row["run"]]
        rows.append([metric_cell(task, runs["fp32"]) if "fp32" in runs else "-", metric_cell(task, runs["static-8/8"]),
                     f"{row['run']}: {metric_cell(task, cpt)}", f"{meter_cost(cpt):.3f}", verdict(task, row)])
    return rows


def readme_summary(results_dir: str) -> list[str]:
    """The README's results table: one row per task (and per horizon length), linked to the full page."""
    import horizon_page

    lines = ["| task | FP32 | static 8/8 | CPT | CPT cost vs static (meter) | CPT vs static |",
             "|---|---|---|---|---|---|"]
    for task in TASKS:
        data = task_data(results_dir, task)
        if data:
            lines += [f"| {task.key} ({task.unit}) | " + " | ".join(cells) + " |"
                      for cells in summary_cells(task, by_run(data[task.section], task.order))]
    horizon = load(results_dir, horizon_page.FILE)
    if horizon:
        lines += ["| " + " | ".join(cells) + " |" for cells in horizon_page.summary_rows(horizon)]
    return lines
