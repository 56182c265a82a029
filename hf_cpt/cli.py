"""Command line: ``hf-cpt schedules`` and ``hf-cpt env`` (or ``python -m hf_cpt ...``).

``schedules`` lists every registered precision schedule with its mean bits, training cost relative to static
``bits_max`` and to FP32, and its cost group; ``--plot FILE.png`` draws them, one panel per schedule,
the rounded bits over the smooth profile. ``env`` prints what on this machine decides a CPT run's speed and memory
(`hf_cpt.diagnostics.environment`), for a bug report or before a long CPU run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .schedules.schedule import LARGE_COST_ABOVE, SMALL_COST_BELOW, PrecisionSchedule, get_schedule
from .schedules.shapes import DELAY_PRECISIONS, ROUNDING_MODES, available_schedules

PLOT_POINTS = 2000  # points per panel for the smooth profile and the rounded bits


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-cpt", description="Cyclic Precision Training tools.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    sched = commands.add_parser(
        "schedules",
        help="list the precision schedules with their mean bits, cost and cost group (and plot them)",
        description=(
            "List the precision schedules with mean bits, training cost relative to static bits_max and to FP32 "
            f"(docs/method.md §7), and cost group (mean bits in the lower third of [bits_min, bits_max]: small; upper "
            f"third: large; f < {SMALL_COST_BELOW:.3f} / f > {LARGE_COST_ABOVE:.3f})."
        ),
    )
    sched.add_argument("--bits-min", type=int, default=3, help="lower precision bound (default 3)")
    sched.add_argument("--bits-max", type=int, default=8, help="upper precision bound (default 8)")
    sched.add_argument("--grad-bits", type=int, default=8, help="error precision, fixed (default 8)")
    sched.add_argument("--cycles", type=int, default=8, help="number of cycles (default 8, the follow-up study's)")
    sched.add_argument("--steps", type=int, default=64000, help="optimizer steps of the run (default 64000)")
    sched.add_argument("--rounding", choices=ROUNDING_MODES, default="nearest", help="rounding of the profile")
    sched.add_argument("--delay", type=float, default=0.0, help="delayed start, fraction of training (default 0)")
    sched.add_argument("--delay-precision", choices=DELAY_PRECISIONS, default="max", help="precision of the delay")
    sched.add_argument("--names", nargs="+", metavar="NAME", help="only these schedules (default: all registered)")
    sched.add_argument("--plot", metavar="FILE.png", help="draw the schedules into this PNG file")
    sched.add_argument("--json", action="store_true", help="print the table as JSON")
    sched.set_defaults(handler=_schedules_command, subparser=sched)
    env = commands.add_parser(
        "env", help="print what on this machine decides a CPT run's speed and memory",
        description="Print the library versions, the accelerator, how the layers multiply on this CPU, the C kernels, "
                    "the threads and the memory allocator this process runs on.")
    env.add_argument("--json", action="store_true", help="print them as JSON")
    env.set_defaults(handler=_env_command, subparser=env)
    return parser


def schedules_table(schedules: Sequence[PrecisionSchedule], grad_bits: int | None) -> str:
    """A markdown table: schedule, mean bits, cost vs static bits_max and vs FP32, group, description."""
    if not schedules:
        return ""
    bits_max = schedules[0].bits_max
    grad = "FP32" if grad_bits is None else f"{grad_bits}"
    header = f"| schedule | mean bits | cost vs static {bits_max}/{grad} | cost vs FP32 | cost group | description |"
    lines = [header, "|---|---:|---:|---:|---|---|"]
    for schedule in schedules:
        lines.append(
            f"| {schedule.name} | {schedule.mean_bits():.2f} | {schedule.cost_vs_static(grad_bits):.3f} "
            f"| {schedule.relative_cost(grad_bits):.4f} | {schedule.cost_group} | {schedule.shape.description} |"
        )
    return "\n".join(lines)


def plot_schedules(schedules: Sequence[PrecisionSchedule], path: str, points: int = PLOT_POINTS) -> str:
    """One panel per schedule: the rounded bits (steps) over the smooth profile."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    count = len(schedules)
    columns = min(4, count)
    rows = -(-count // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.6 * columns, 2.4 * rows), squeeze=False)
    for ax in axes.flat[count:]:
        ax.axis("off")
    for ax, schedule in zip(axes.flat, schedules):
        total = schedule.total_steps
        stride = max(1, total // points)
        steps = list(range(0, total, stride))
        if steps[-1] != total - 1:
            steps.append(total - 1)
        full = schedule.bits_max + 1  # where full-precision steps are drawn
        smooth = [schedule.smooth(t) for t in steps]
        bits = [schedule(t) for t in steps]
        ax.plot(steps, [full if v is None else v for v in smooth], color="tab:red", linewidth=1, label="profile")
        ax.step(steps, [full if b is None else b for b in bits], where="post", color="tab:blue", linewidth=1.2,
                label="bits")
        ax.set_title(f"{schedule.name}  (mean {schedule.mean_bits():.2f}, {schedule.cost_group})", fontsize=9)
        ticks = list(range(schedule.bits_min, schedule.bits_max + 1))
        labels = [str(b) for b in ticks]
        if any(b is None for b in bits):
            ticks.append(full)
            labels.append("FP32")
        ax.set_yticks(ticks, labels)
        ax.set_ylim(schedule.bits_min - 0.5, ticks[-1] + 0.5)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("step", fontsize=7)
    axes.flat[0].set_ylabel("bits", fontsize=8)
    axes.flat[0].legend(fontsize=7, loc="lower right")
    first = schedules[0]
    fig.suptitle(
        f"Precision schedules, {first.bits_min}-{first.bits_max} bits, {first.num_cycles} cycles, "
        f"{first.total_steps} steps" + (f", delay {first.delay:g} at {first.delay_precision}" if first.delay else ""),
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _schedules_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    names = args.names or list(available_schedules())
    unknown = [name for name in names if name not in available_schedules()]
    if unknown:
        parser.error(f"unknown schedule(s) {unknown}; choose from {sorted(available_schedules())}")
    try:
        schedules = [get_schedule(name, args.bits_min, args.bits_max, args.steps, args.cycles, rounding=args.rounding,
            delay=args.delay, delay_precision=args.delay_precision) for name in names]
        for schedule in schedules:
            schedule.static_grad_bits(args.grad_bits)  # validates --grad-bits
    except ValueError as error:
        parser.error(str(error))
    if args.json:
        print(json.dumps([s.summary(args.grad_bits) for s in schedules], indent=2))
    else:
        print(
            f"{args.bits_min}-{args.bits_max} bits forward, {args.grad_bits} bits backward, {args.cycles} cycles, "
            f"{args.steps} steps"
            + (f", delay {args.delay:g} at {args.delay_precision}" if args.delay else "")
            + "\n"
        )
        print(schedules_table(schedules, args.grad_bits))
    if args.plot:
        if not args.plot.lower().endswith(".png"):
            parser.error(f"--plot needs a .png file name, got {args.plot!r}")
        try:
            plot_schedules(schedules, args.plot)
        except OSError as error:
            parser.error(f"cannot write {args.plot!r}: {error}")
        print(f"\nwrote {args.plot}", file=sys.stderr)
    return 0


def _env_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .diagnostics.environment import environment_report

    report = environment_report()
    lines = (f"- {key}: {value}" for key, value in report.items())
    print(json.dumps(report, indent=2) if args.json else "\n".join(lines))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hf-cpt`` and ``python -m hf_cpt``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help()
        return 1
    return args.handler(args, args.subparser)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
