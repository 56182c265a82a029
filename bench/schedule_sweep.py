"""The follow-up study's ten precision schedules on the vision task, at reduced length, one seed.

Each of CR, CT, LR, LT, ER, ET-V, ET-H, RR, RT-V, RT-H trains the CIFAR ResNet-20 of
``bench/cifar10.py`` (same data, optimizer and layers) at 3-8 bits with 8-bit errors, 8 cycles, plus
static 8/8 and FP32 at the same length as reference points. The report plots accuracy against the
cost meter's GBitOPs, as the follow-up's figures do.

Resumable: results go to ``--output`` after every run; a finished run is skipped when the command is
run again. ``python bench/report.py`` turns the JSON into ``docs/RESULTS.md``.

    nohup python bench/schedule_sweep.py > outputs/schedule_sweep.log 2>&1 &
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cifar10  # noqa: E402
import harness  # noqa: E402

from hf_cpt.schedules.shapes import FOLLOW_UP_SCHEDULES

DEFAULT_OUTPUT = os.path.join(harness.RESULTS_DIR, "schedule_sweep.json")
RUNS = {
    "fp32": cifar10.RUNS["fp32"],
    "static-8/8": cifar10.RUNS["static-8/8"],
    **{name: dict(schedule=name, bits_min=3, bits_max=8, grad_bits=8, **cifar10.KEEP_FP32)
       for name in FOLLOW_UP_SCHEDULES},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", default=harness.DEFAULT_DATA)
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--epochs", type=float, default=2)
    parser.add_argument("--cycles", type=int, default=8, help="cycles over the run (the follow-up's default: 8)")
    cifar10.add_slice_arguments(parser)
    parser.add_argument("--work_dir", default=os.path.join("outputs", "bench_schedule_sweep"))
    args = parser.parse_args()

    results = harness.load_results(args.output)
    harness.check_settings(results, "settings", {
        "epochs": args.epochs, "cycles": args.cycles, "max_steps": args.max_steps, "train_size": args.train_size,
        "test_size": args.test_size, "model": "CIFAR ResNet-20", "batch_size": 128, "bits": "3-8/8"}, args.output)
    train, test = cifar10.load_cifar(args.data_dir, args.train_size, args.test_size)
    results["data"] = {"train": len(train), "test": len(test)}
    cifar10.run_all(results, args.output, harness.with_cycles({n: RUNS[n] for n in args.runs}, args.cycles),
                   [args.seed], train, test, args.epochs, args.max_steps, args.work_dir, profile=False,
                   desc="schedule sweep")
    print(f"results: {args.output}")


if __name__ == "__main__":
    main()
