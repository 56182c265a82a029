"""The horizon section of ``docs/RESULTS.md`` (``bench/horizon.py``'s JSON): a table, a plot of accuracy
against training length and findings in words, all computed here (used by ``bench/results_page.py``)."""

from __future__ import annotations

import os

import horizon
from results_page import _pyplot, finish_plot, judge, mean, spread

FILE = "horizon.json"
COMMAND = "python bench/horizon.py"
REFERENCES = ("fp32", "static-8/8")
PAPER_RUN = "cpt-3-8/8-n32"  # the CPT paper's schedule: the run the summary and the claim are about
PROTECTED_RUN, UNPROTECTED_RUN = "ct-3-8/8-n8-delay", "cpt-3-8/8-n8"
DESCRIPTIONS = {
    "fp32": "FP32",
    "static-8/8": "static 8/8",
    "cpt-3-8/8-n32": "CPT 3-8/8, 32 cycles (the CPT paper)",
    "cpt-3-8/8-n8": "CPT 3-8/8, 8 cycles (the follow-up's default)",
    "ct-3-8/8-n8-delay": "triangular cosine 3-8/8, 8 cycles, first eighth at 8 bits (protected start)",
    "cpt-3-8/8-n32-error-token": "CPT 3-8/8, 32 cycles, errors per row",
}


def lengths(data: dict) -> list[float]:
    """The training lengths (epochs) the JSON holds, shortest first."""
    return sorted(float(name.split("-", 1)[1]) for name in data if name.startswith("epochs-") and data[name])


def runs_at(data: dict, epochs: float) -> dict[str, list[dict]]:
    """Run name -> its entries (sorted by seed) at one length."""
    runs: dict[str, list[dict]] = {}
    for entry in data.get(f"epochs-{epochs:g}", {}).values():
        runs.setdefault(entry["run"], []).append(entry)
    order = list(DESCRIPTIONS) + sorted(set(runs) - set(DESCRIPTIONS))
    return {name: sorted(runs[name], key=lambda e: e["seed"]) for name in order if name in runs}


def _cell(entries: list[dict] | None) -> str:
    if not entries:
        return "not run yet"
    values = [100 * e["metric"] for e in entries]
    return f"{mean(values):.2f} ± {spread(values):.2f} ({len(values)})"


def _gap(runs: dict[str, list[dict]], name: str, reference: str) -> dict | None:
    """``name`` against ``reference`` at one length: gap in points, whether it lies within the seed spreads."""
    if name not in runs or reference not in runs:
        return None
    ours, theirs = [100 * e["metric"] for e in runs[name]], [100 * e["metric"] for e in runs[reference]]
    gap = mean(ours) - mean(theirs)
    return {"gap": gap, "verdict": judge(gap, spread(ours) + spread(theirs)), "seeds": min(len(ours), len(theirs)),
            "cost": mean(e["cost"]["cost_vs_static"] for e in runs[name])}


def _verdict(row: dict) -> str:
    """The results page's words: a gap within the seeds' spreads matches; one seed has no spread to judge by."""
    return "one seed, not judged" if row["seeds"] < 2 else row["verdict"]


def table(data: dict) -> list[str]:
    """Every planned run (`bench/horizon.py`'s defaults) and every recorded one, at every length."""
    spans = sorted(set(lengths(data)) | {float(e) for e in horizon.DEFAULT_EPOCHS})
    names = list(dict.fromkeys([*horizon.RUNS, *(name for epochs in spans for name in runs_at(data, epochs))]))
    longest = {name: runs_at(data, epochs)[name] for epochs in spans for name in runs_at(data, epochs)}
    lines = ["| run | " + " | ".join(f"{e:g} epochs" for e in spans) + " | cost vs static 8/8 (meter) |",
             "|---|" + "---|" * len(spans) + "---|"]
    for name in names:
        cells = [_cell(runs_at(data, epochs).get(name)) for epochs in spans]
        cost = "-"
        if name in longest and longest[name][0]["cpt_config"].get("schedule") != "fp32":
            cost = f"{mean(e['cost']['cost_vs_static'] for e in longest[name]):.3f}"
        lines.append(f"| {DESCRIPTIONS.get(name, name)} | " + " | ".join(cells) + f" | {cost} |")
    return lines


def findings(data: dict) -> list[str]:
    """In words: each CPT schedule against static 8/8 at each length, the trend with length, the protection."""
    spans = lengths(data)
    lines = []
    schedules = [n for n in dict.fromkeys(n for e in spans for n in runs_at(data, e)) if n not in REFERENCES]
    for name in schedules:
        rows = [(epochs, _gap(runs_at(data, epochs), name, "static-8/8")) for epochs in spans]
        rows = [(epochs, row) for epochs, row in rows if row]
        if not rows:
            continue
        parts = [f"{epochs:g} epochs {row['gap']:+.2f} ({_verdict(row)}"
                 + (f", {row['seeds']} seeds)" if row["seeds"] > 1 else ")") for epochs, row in rows]
        lines.append(f"- {DESCRIPTIONS.get(name, name)} against static 8/8, at {rows[-1][1]['cost']:.3f} of its "
                     f"cost: " + "; ".join(parts) + ".")
        against_fp32 = [(epochs, _gap(runs_at(data, epochs), name, "fp32")) for epochs in spans]
        against_fp32 = [f"{epochs:g} epochs {row['gap']:+.2f}" for epochs, row in against_fp32 if row]
        if against_fp32:  # what a user compares with: the same training in full precision
            lines.append("  Against FP32 training: " + "; ".join(against_fp32) + ".")
        holds = [epochs for epochs, row in rows if row["verdict"] != "worse than" and row["seeds"] > 1]
        if len(rows) > 1:
            trend = rows[-1][1]["gap"] - rows[0][1]["gap"]
            direction = "in favour of CPT" if trend > 0 else "in favour of static 8/8"
            lines.append(f"  From {rows[0][0]:g} to {rows[-1][0]:g} epochs the gap moves by {trend:+.2f} points"
                         + (f" ({direction})" if round(trend, 2) else "") + "; it matches or beats static at "
                         + (f"{', '.join(f'{e:g}' for e in holds)} epochs." if holds else "no length measured."))
    protected = [(epochs, _gap(runs_at(data, epochs), PROTECTED_RUN, UNPROTECTED_RUN)) for epochs in spans]
    protected = [(epochs, row) for epochs, row in protected if row]
    if protected:
        lines.append(f"- The protected start ({DESCRIPTIONS[PROTECTED_RUN]}) against the same 8 cycles without it "
                     f"({DESCRIPTIONS[UNPROTECTED_RUN]}): " + "; ".join(
                         f"{epochs:g} epochs {row['gap']:+.2f} ({_verdict(row)})" for epochs, row in protected) + ".")
    for epochs in spans:
        runs = runs_at(data, epochs)
        cyclic = {n: mean(100 * e["metric"] for e in runs[n]) for n in schedules if n in runs}
        if len(cyclic) > 1:
            best = max(cyclic, key=cyclic.get)
            lines.append(f"- At {epochs:g} epochs the best low-precision schedule is {DESCRIPTIONS.get(best, best)} "
                         f"({cyclic[best]:.2f}%).")
    if not lines:
        lines.append("- No CPT run has finished yet.")
    return lines


def plot(data: dict, path: str) -> None:
    """Accuracy against training length (log axis), one line per run, bars spanning the seeds."""
    plt = _pyplot()
    fig, axis = plt.subplots(figsize=(7.5, 4.5))
    spans = lengths(data)
    for name in dict.fromkeys(n for e in spans for n in runs_at(data, e)):
        points = [(epochs, [100 * e["metric"] for e in runs_at(data, epochs)[name]])
                  for epochs in spans if name in runs_at(data, epochs)]
        xs = [p[0] for p in points]
        ys = [mean(v) for _, v in points]
        bars = [[mean(v) - min(v) for _, v in points], [max(v) - mean(v) for _, v in points]]
        axis.errorbar(xs, ys, yerr=bars, marker="o", capsize=3, linewidth=1.2, label=DESCRIPTIONS.get(name, name))
    axis.set_xscale("log", base=2)
    axis.set_xticks(spans, [f"{e:g}" for e in spans])
    finish_plot(fig, axis, path, "training epochs (learning rate and cycles scaled to each length)",
                "test accuracy % (bars: range over seeds)",
                "CIFAR-10, ResNet-20 from scratch: accuracy against training length", legend_size=7)


GPU_FILE = "horizon_gpu.json"  # bench/gpu_horizon.sh: the same scan on a GPU, to 160 epochs (issue 76)
GPU_COMMAND = "bash bench/gpu_horizon.sh"


def section(data: dict, figures_dir: str, link_dir: str, gpu: bool = False) -> list[str]:
    settings, size = data.get("settings", {}), data.get("data", {})
    device = data.get("environment", {}).get("device", "a GPU") if gpu else None
    title = "## Horizon: does CPT catch up with static training when it trains longer?" + (
        f" On {device}" if gpu else "")
    lines = [title, "",
             f"`{GPU_COMMAND if gpu else COMMAND}`: the CIFAR ResNet-20 above, {size.get('train', '?'):,} training "
             "images, batch "
             f"{settings.get('batch_size')}, at each length its own cosine learning rate and schedule; the CPT "
             "paper trains 160 epochs with 32 cycles. Accuracy % as mean ± half range (seeds); a cell reads "
             "\"not run yet\" until its runs finish (the script is resumable and runs the shortest lengths "
             "first).", ""]
    seconds = sum(e["train_seconds"] for epochs in lengths(data) for entries in runs_at(data, epochs).values()
                  for e in entries)
    lines += table(data) + ["", f"Training time of these runs: {seconds / 3600:.1f} h on this machine.", "",
                            "Findings:", ""] + findings(data) + [""]
    if lengths(data):
        name = "horizon_gpu.png" if gpu else "horizon.png"
        plot(data, os.path.join(figures_dir, name))
        lines += [f"![accuracy against training length]({link_dir}/{name})", ""]
    return lines


def summary_rows(data: dict) -> list[list[str]]:
    """README rows: FP32, static 8/8 and the paper's CPT at each length with every reference run."""
    rows = []
    for epochs in lengths(data):
        runs = runs_at(data, epochs)
        row = _gap(runs, PAPER_RUN, "static-8/8")
        if row is None:
            continue
        rows.append([f"vision, {epochs:g} epochs (accuracy %)", _cell(runs.get("fp32")), _cell(runs["static-8/8"]),
                     f"{PAPER_RUN}: {_cell(runs[PAPER_RUN])}", f"{row['cost']:.3f}", _verdict(row)])
    return rows
