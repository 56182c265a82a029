"""Demo: FP32 vs static 8-bit vs Cyclic Precision Training on scikit-learn's handwritten digits.

Run: ``python recipes/demo.py --output_dir outputs/demo [--epochs 20] [--seed 0]``.

Fully offline: the 8x8 digits ship with scikit-learn. A small CNN is trained three times with
`hf_cpt.CPTTrainer` and identical seeds and hyper-parameters: in FP32, at static 8-bit (8-bit
errors) and with CPT between 3 and 8 bits (8-bit errors). The script prints test accuracy and
training cost in BitOPs for each run, and writes ``results.json`` and the CPT run's precision
schedule (``cpt_schedule.png``) to the output directory.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from transformers import TrainingArguments, set_seed

from hf_cpt import CPTConfig, CPTTrainer, plot_schedule

RUNS = {
    "FP32": CPTConfig(schedule="fp32"),
    "static 8-bit": CPTConfig(schedule="static", bits_max=8, grad_bits=8),
    "CPT 3-8 / 8": CPTConfig(schedule="cpt", bits_min=3, bits_max=8, grad_bits=8, num_cycles=8),
}


class DigitsDataset(torch.utils.data.Dataset):
    """8x8 digit images scaled to [0, 1], as ``{"pixel_values": (1, 8, 8), "labels": int}``."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.images = torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
        self.labels = torch.tensor(labels, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.images[index], "labels": self.labels[index]}


class DigitsCNN(nn.Module):
    """Three Conv-BN-ReLU blocks and a linear classifier (kept in FP32 by hf_cpt, as in the papers)."""

    def __init__(self, num_classes: int = 10, width: int = 32) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

        self.features = nn.Sequential(
            *block(1, width), *block(width, width), nn.MaxPool2d(2), *block(width, 2 * width),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.classifier = nn.Linear(2 * width, num_classes)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.classifier(self.features(pixel_values))
        if labels is None:
            return {"logits": logits}
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def compute_metrics(eval_pred) -> dict[str, float]:
    logits, labels = eval_pred
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


def train_one(name: str, config: CPTConfig, data: tuple, args: argparse.Namespace) -> dict:
    """Train and evaluate one run; return its accuracy, cost figures and bits per step."""
    train_set, test_set = data
    set_seed(args.seed)
    model = DigitsCNN()
    run_dir = os.path.join(args.output_dir, name.split()[0].lower())
    training_args = TrainingArguments(
        output_dir=run_dir,
        num_train_epochs=args.epochs,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=256,
        learning_rate=args.learning_rate,
        weight_decay=1e-4,
        lr_scheduler_type="cosine",
        warmup_steps=20,
        logging_steps=50,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        data_seed=args.seed,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,  # CPU only: pinning would only warn
    )
    trainer = CPTTrainer(
        model=model,
        args=training_args,
        train_dataset=train_set,
        eval_dataset=test_set,
        compute_metrics=compute_metrics,
        cpt_config=config,
    )
    print(f"\n=== {name} ===", flush=True)
    start = time.perf_counter()
    trainer.train()
    metrics = trainer.evaluate()
    report = trainer.cpt_callback.cost_report()
    return {
        "accuracy": metrics["eval_accuracy"],
        "eval_loss": metrics["eval_loss"],
        "gbitops": report["gbitops"],
        "cost_vs_fp32": report["cost_vs_fp32"],
        "steps": report["steps"],
        "steps_at_bits": report["steps_at_bits"],
        "seconds": time.perf_counter() - start,
        "schedule": trainer.cpt_callback.schedule,
        "cpt_config": config.to_dict(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default="outputs/demo")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (tensors here are tiny)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.output_dir, exist_ok=True)
    start = time.perf_counter()

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data, digits.target, test_size=0.25, random_state=args.seed, stratify=digits.target
    )
    data = (DigitsDataset(x_train, y_train), DigitsDataset(x_test, y_test))
    print(f"digits: {len(y_train)} train / {len(y_test)} test images, 8x8, 10 classes")

    results = {name: train_one(name, config, data, args) for name, config in RUNS.items()}
    static_gbitops = results["static 8-bit"]["gbitops"]
    for result in results.values():
        result["cost_vs_static8"] = result["gbitops"] / static_gbitops
    wall = time.perf_counter() - start

    cpt = results["CPT 3-8 / 8"]
    plot_path = os.path.join(args.output_dir, "cpt_schedule.png")
    plot_schedule(cpt.pop("schedule"), plot_path, grad_bits=8)
    for result in results.values():
        result.pop("schedule", None)
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump({"args": vars(args), "wall_seconds": wall, "runs": results}, f, indent=2)

    header = f"{'run':<14}{'test acc':>9}{'GBitOPs':>11}{'vs FP32':>9}{'vs static 8':>13}{'time s':>8}"
    print(f"\ndigits CNN, {args.epochs} epochs, seed {args.seed}, {cpt['steps']} steps per run "
          "(eval at 8 bits for the quantized runs)")
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        print(f"{name:<14}{r['accuracy']:>9.4f}{r['gbitops']:>11.2f}{r['cost_vs_fp32']:>9.4f}"
              f"{r['cost_vs_static8']:>13.3f}{r['seconds']:>8.1f}")
    print(f"\nCPT steps per bit-width: {cpt['steps_at_bits']}")
    print(f"wrote {plot_path} and {os.path.join(args.output_dir, 'results.json')}; total {wall:.0f} s")


if __name__ == "__main__":
    main()
