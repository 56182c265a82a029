"""CPT on CIFAR-10 at CPU scale: a CIFAR ResNet-20 trained from scratch with `CPTTrainer`.

The 10,000-image train folder and the 10,000-image test folder of ``cifar10/`` (``../shared/data``),
standard augmentation (4-pixel padded random crop, horizontal flip), SGD with momentum 0.9, lr 0.1
with cosine decay, weight decay 5e-4, batch 128. Runs: FP32, static 8/8, CPT 3-8/8, static 6/6 and
CPT 3-6/6 (the CPT paper's CIFAR settings, cycles scaled to the run), two seeds. Every conv is
quantized (the paper's scheme: ``quant_scheme="auto"`` picks it for Conv2d); the classifier and
BatchNorm stay FP32. Each run records accuracy, the cost meter's report, time per step, the training
curve and the precision profile (accuracy at 3-8 bits and FP32).

Resumable: results go to ``--output`` after every run; a finished run is skipped when the command is
run again. ``python bench/report.py`` turns the JSON into ``docs/RESULTS.md``.

    nohup python bench/cifar10.py > outputs/cifar10.log 2>&1 &
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402  (sets the offline environment and the import path first)
import torch  # noqa: E402
from cifar_resnet import CifarResNet  # noqa: E402
from torch import nn  # noqa: E402

from hf_cpt import CPTConfig, CPTTrainer  # noqa: E402

DEFAULT_OUTPUT = os.path.join(harness.RESULTS_DIR, "vision.json")
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)

# name -> CPTConfig fields; cycles are set per run from --cycles. The classifier stays FP32, as in the
# CPT paper's CIFAR code.
# The runs name their error ranges: one per tensor (the CPT paper, the runs recorded first) or one per row
# ("-error-token", today's default for quant_scheme="auto"; docs/backward.md).
KEEP_FP32 = dict(exclude_modules=["fc"])
PER_TENSOR, PER_ROW = dict(error_granularity="tensor"), dict(error_granularity="token")
RUNS = {
    "fp32": dict(schedule="fp32"),
    "static-8/8": dict(schedule="static", bits_max=8, grad_bits=8, **KEEP_FP32, **PER_TENSOR),
    "cpt-3-8/8": dict(schedule="cpt", bits_min=3, bits_max=8, grad_bits=8, **KEEP_FP32, **PER_TENSOR),
    "static-6/6": dict(schedule="static", bits_max=6, grad_bits=6, **KEEP_FP32, **PER_TENSOR),
    "cpt-3-6/6": dict(schedule="cpt", bits_min=3, bits_max=6, grad_bits=6, **KEEP_FP32, **PER_TENSOR),
    "static-8/8-error-token": dict(schedule="static", bits_max=8, grad_bits=8, **KEEP_FP32, **PER_ROW),
    "cpt-3-8/8-error-token": dict(schedule="cpt", bits_min=3, bits_max=8, grad_bits=8, **KEEP_FP32, **PER_ROW),
}
DEFAULT_RUNS = ["fp32", "static-8/8", "cpt-3-8/8", "static-6/6", "cpt-3-6/6"]


# ----------------------------------------------------------------------------- data


def load_folder(folder: str, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """An image folder ``<class>/<file>.jpg`` decoded once into uint8 images (N, 3, 32, 32) and labels."""
    import numpy as np
    from PIL import Image

    images, labels = [], []
    for label, name in enumerate(CLASSES):
        files = sorted(os.listdir(harness.data_file(folder, name)))
        for file in files[: None if limit is None else max(1, limit // len(CLASSES))]:
            with Image.open(os.path.join(folder, name, file)) as image:
                images.append(np.asarray(image.convert("RGB")))
            labels.append(label)
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous(), torch.tensor(labels)


class ImageDataset(torch.utils.data.Dataset):
    """Normalised images; with ``augment``, a padded random crop and a horizontal flip per sample."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, augment: bool) -> None:
        mean, std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
        self.images = (images.float() / 255 - mean) / std
        self.labels, self.augment = labels, augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        image = self.images[index]
        if self.augment:
            padded = nn.functional.pad(image, (4, 4, 4, 4))
            top, left = torch.randint(0, 9, (2,)).tolist()
            image = padded[:, top:top + 32, left:left + 32]
            if torch.rand(()) < 0.5:
                image = image.flip(-1)
        return {"pixel_values": image, "labels": self.labels[index]}


class DeviceImages(ImageDataset):
    """`ImageDataset`'s images held on a device, served as indices; `DeviceImages.collate` gathers a batch there and
    augments it there (the same padded random crop and horizontal flip, per sample, drawn on the device): no
    per-sample host work, no copies to the device."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, augment: bool, device: str) -> None:
        super().__init__(images, labels, augment)
        self.images, self.labels = self.images.to(device), self.labels.to(device)

    def __getitem__(self, index: int) -> int:
        return index

    def collate(self, indices: list[int]) -> dict:
        index = torch.tensor(indices, device=self.images.device)
        images = self.images[index]
        if self.augment:
            count = len(indices)
            padded = nn.functional.pad(images, (4, 4, 4, 4))
            top, left = (torch.randint(0, 9, (count, 1), device=index.device) for _ in range(2))
            rows = (top + torch.arange(32, device=index.device))[:, None, :, None]
            columns = (left + torch.arange(32, device=index.device))[:, None, None, :]
            images = padded[torch.arange(count, device=index.device)[:, None, None, None],
                            torch.arange(3, device=index.device)[None, :, None, None], rows, columns]
            flip = torch.rand(count, device=index.device) < 0.5
            images = torch.where(flip[:, None, None, None], images.flip(-1), images)
        return {"pixel_values": images, "labels": self.labels[index]}


def load_cifar_arrays(path: str, device: str, train_size: int | None, test_size: int | None):
    """The CIFAR-10 images of a `bench/gpu_bundle.py` array file (``--images``), held on ``device``."""
    import numpy as np

    arrays = np.load(path)

    def split(name: str, limit: int | None) -> DeviceImages:
        images = torch.from_numpy(arrays[f"x_{name}"])
        labels = torch.from_numpy(arrays[f"y_{name}"])
        if limit is not None:  # the first images of each class, as `load_folder` caps them
            keep = torch.cat([torch.nonzero(labels == c)[: max(1, limit // len(CLASSES)), 0]
                              for c in range(len(CLASSES))])
            images, labels = images[keep], labels[keep]
        return DeviceImages(images, labels, augment=name == "train", device=device)

    return split("train", train_size), split("test", test_size)


# ----------------------------------------------------------------------------- runs


def make_trainer(model: nn.Module, config: CPTConfig, train, evaluation, epochs: float, seed: int, work_dir: str,
                 max_steps: int = -1, batch_size: int = 128, lr: float = 0.1, device: str = "cpu") -> CPTTrainer:
    from transformers import TrainingArguments, get_cosine_schedule_with_warmup

    on_device = isinstance(train, DeviceImages)  # batches gathered and augmented where the images are
    args = TrainingArguments(
        output_dir=work_dir, per_device_train_batch_size=batch_size, per_device_eval_batch_size=500,
        num_train_epochs=epochs, max_steps=max_steps, seed=seed, logging_steps=10, save_strategy="no",
        report_to="none", use_cpu=device == "cpu", disable_tqdm=True,
        **({"remove_unused_columns": False, "dataloader_pin_memory": False} if on_device else {}),
    )
    steps = max_steps if max_steps > 0 else math.ceil(epochs * math.ceil(len(train) / batch_size))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    scheduler = get_cosine_schedule_with_warmup(optimizer, max(1, steps // 50), steps)
    return CPTTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                      compute_metrics=harness.accuracy, optimizers=(optimizer, scheduler), cpt_config=config,
                      **({"data_collator": train.collate} if on_device else {}))


def run_all(results: dict, path: str, runs: dict[str, dict], seeds: list[int], train, evaluation, epochs: float,
            max_steps: int, work_dir: str, profile: bool, desc: str = "vision runs", section: str = "runs",
            device: str = "cpu") -> None:
    """Every (run, seed) of a fresh CIFAR ResNet-20 (`harness.run_all`)."""
    def build(config: CPTConfig, seed: int, name: str) -> CPTTrainer:
        return make_trainer(CifarResNet(20), config, train, evaluation, epochs, seed, os.path.join(work_dir, name),
                            max_steps, device=device)

    harness.run_all(results, path, runs, seeds, build, "accuracy", "accuracy", profile, section=section, desc=desc)


def add_slice_arguments(parser) -> None:
    """The options that cap a CIFAR run for smoke tests (steps, training and test images)."""
    parser.add_argument("--max_steps", type=int, default=-1, help="cap the steps (smoke tests)")
    parser.add_argument("--train_size", type=int, default=None, help="cap the training images (smoke tests)")
    parser.add_argument("--test_size", type=int, default=None, help="cap the test images (smoke tests)")


def load_cifar(data_dir: str, train_size: int | None, test_size: int | None):
    root = harness.data_file(data_dir, "cifar10")
    train = ImageDataset(*load_folder(os.path.join(root, "train"), train_size), augment=True)
    test = ImageDataset(*load_folder(os.path.join(root, "test"), test_size), augment=False)
    return train, test


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", default=harness.DEFAULT_DATA)
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, choices=list(RUNS))
    parser.add_argument("--epochs", type=float, default=4)
    parser.add_argument("--cycles", type=int, default=8, help="CPT cycles over the run (the paper: 32 in 160 epochs)")
    add_slice_arguments(parser)
    parser.add_argument("--no_profile", action="store_true", help="skip the precision profile")
    parser.add_argument("--work_dir", default=os.path.join("outputs", "bench_vision"))
    args = parser.parse_args()

    results = harness.load_results(args.output)
    harness.check_settings(results, "settings", {
        "epochs": args.epochs, "cycles": args.cycles, "max_steps": args.max_steps, "train_size": args.train_size,
        "test_size": args.test_size, "model": "CIFAR ResNet-20", "batch_size": 128}, args.output)
    train, test = load_cifar(args.data_dir, args.train_size, args.test_size)
    results["data"] = {"train": len(train), "test": len(test)}
    run_all(results, args.output, harness.with_cycles({n: RUNS[n] for n in args.runs}, args.cycles), args.seeds, train,
            test, args.epochs, args.max_steps, args.work_dir, not args.no_profile)
    print(f"results: {args.output}")


if __name__ == "__main__":
    main()
