"""Does CPT keep its promise at longer horizons? The CIFAR ResNet-20 of ``bench/cifar10.py`` trained for
4, 8 and 16 epochs (same data, augmentation, optimizer and cosine learning rate, scaled to each length).
16 epochs is the longest whose twelve runs fit a background run of a few hours on a 2-core machine (about
2.5 hours on both cores; 32 epochs would take about twice that): each run's time is in the JSON and the page,
and ``--epochs 32`` adds a longer length to the same scan.

Runs at every length, two seeds:

* ``fp32`` and ``static-8/8``: the references;
* ``cpt-3-8/8-n32``: the CPT paper (cosine, repeated, 32 cycles over the run);
* ``cpt-3-8/8-n8``: the follow-up study's default (8 cycles);
* ``ct-3-8/8-n8-delay``: the follow-up's protection against the early "critical period": the
  triangular cosine schedule (starts at bits_max), 8 cycles, after a delayed start holding bits_max for
  the first eighth of training;
* ``cpt-3-8/8-n32-error-token``: the paper's schedule with the errors quantized per row
  (docs/backward.md), the one backward setting that differs from the paper's scheme on this model
  (every conv runs the paper's scheme by default).

Every conv is quantized, the classifier and BatchNorm stay FP32 (the CPT paper's CIFAR code). Each entry
records accuracy, the cost meter's report, time per step and the training curve (no precision profile).

Resumable: results go to ``--output`` after every run, under one section per length; a finished
(length, run, seed) is skipped when the command is run again. The lengths run shortest first, so that
every length has all its runs before a longer one starts. Several processes can share the scan, one per core:
each claims a (length, run, seed) before training it (`harness.claim`) and leaves the others' to them.
``python bench/report.py`` turns the JSON into ``docs/RESULTS.md``.

    OMP_NUM_THREADS=1 nohup python bench/horizon.py > outputs/horizon_a.log 2>&1 &
    OMP_NUM_THREADS=1 nohup python bench/horizon.py > outputs/horizon_b.log 2>&1 &   # a second core

On a GPU (issue 76: 4 to 160 epochs, 4 seeds, the paper's 32 cycles; `bench/gpu_horizon.sh`): ``--device cuda
--images gpu_cifar/cifar10_uint8.npz`` holds the images on the GPU and augments each batch there.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cifar10  # noqa: E402
import harness  # noqa: E402

DEFAULT_OUTPUT = os.path.join(harness.RESULTS_DIR, "horizon.json")
DEFAULT_EPOCHS = [4, 8, 16]
CPT_3_8 = dict(bits_min=3, bits_max=8, grad_bits=8, **cifar10.KEEP_FP32, **cifar10.PER_TENSOR)
RUNS = {
    "fp32": cifar10.RUNS["fp32"],
    "static-8/8": cifar10.RUNS["static-8/8"],
    "cpt-3-8/8-n32": dict(schedule="cpt", num_cycles=32, **CPT_3_8),
    "cpt-3-8/8-n8": dict(schedule="cpt", num_cycles=8, **CPT_3_8),
    "ct-3-8/8-n8-delay": dict(schedule="CT", num_cycles=8, delay=0.125, delay_precision="max", **CPT_3_8),
    "cpt-3-8/8-n32-error-token": dict(schedule="cpt", num_cycles=32,
                                      **{**CPT_3_8, **cifar10.PER_ROW}),
}


def section(epochs: float) -> str:
    """The JSON section of one training length."""
    return f"epochs-{epochs:g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", default=harness.DEFAULT_DATA)
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    parser.add_argument("--epochs", type=float, nargs="+", default=DEFAULT_EPOCHS, help="training lengths")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    cifar10.add_slice_arguments(parser)
    parser.add_argument("--work_dir", default=os.path.join("outputs", "bench_horizon"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="train there (cuda: the images and their augmentation on the GPU too)")
    parser.add_argument("--images", default=None,
                        help="the CIFAR-10 array file of `bench/gpu_bundle.py --bundle horizon` (else the folders)")
    args = parser.parse_args()

    results = harness.load_results(args.output)
    harness.check_settings(results, "settings", {
        "max_steps": args.max_steps, "train_size": args.train_size, "test_size": args.test_size,
        "model": "CIFAR ResNet-20", "batch_size": 128}, args.output)
    if args.images is not None:
        train, test = cifar10.load_cifar_arrays(args.images, args.device, args.train_size, args.test_size)
    else:
        train, test = cifar10.load_cifar(args.data_dir, args.train_size, args.test_size)
    results["data"] = {"train": len(train), "test": len(test)}
    runs = {name: RUNS[name] for name in args.runs}
    for epochs in sorted(args.epochs):
        cifar10.run_all(results, args.output, runs, args.seeds, train, test, epochs, args.max_steps,
                        os.path.join(args.work_dir, section(epochs)), profile=False,
                        desc=f"horizon, {epochs:g} epochs", section=section(epochs), device=args.device)
    print(f"results: {args.output}")


if __name__ == "__main__":
    main()
