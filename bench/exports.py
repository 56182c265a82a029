"""What each export of a fine-tuned pretrained model computes where hf_cpt is not installed.

all-MiniLM-L6-v2 (pretrained) is fine-tuned on MNLI pairs with `CPTTrainer` under each activation scheme
(``--steps`` steps, batch 16, CPT 6-8/8, one cycle: per-token and per-tensor activations fail the fidelity check at
4 bits on this model), then exported at 8 bits three ways: packed (`save_quantized`, loaded with hf_cpt),
compressed-tensors (`export_compressed_tensors`) and portable (`export_portable`), the last two loaded by transformers
as a reader without hf_cpt would. Each row records, against the trained model evaluated at 8
bits on ``--eval`` held-out pairs: accuracy, the max relative change of the logits, the predictions that flip, and
which layers the compressed-tensors format runs in float; and, for scale, the same figures for the trained model
itself with its input embeddings nudged by 1e-7 (relative): a quantized model's output is a step function of its
inputs, so float rounding anywhere can flip codes downstream.

Resumable: one entry per scheme in ``--output`` (JSON); ``python bench/report.py`` renders the table into
docs/clients.md.

    pip install -e ".[bench]"
    python bench/exports.py
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import harness
import pretrained
import torch

import hf_cpt
from hf_cpt import CPTConfig, CPTTrainer

SCHEMES = ("per-token", "paper", "auto")  # "auto": the default (rotated per token for Linear layers)
EXPORT_BITS = 8


def _logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()


def _against(trained: torch.Tensor, other: torch.Tensor, labels: torch.Tensor) -> dict:
    return {"accuracy": float((other.argmax(-1) == labels).float().mean()),
            "max_relative_change": float((other - trained).abs().max() / trained.abs().max()),
            "flipped_predictions": float((other.argmax(-1) != trained.argmax(-1)).float().mean())}


def run_scheme(scheme: str, args, tokenizer, train_rows, eval_rows) -> dict:
    from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding, TrainingArguments

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(pretrained.minilm_path(), num_labels=3)
    config = CPTConfig(bits_min=6, bits_max=EXPORT_BITS, grad_bits=8, num_cycles=1, quant_scheme=scheme)
    with tempfile.TemporaryDirectory() as work:
        training = TrainingArguments(output_dir=work, max_steps=args.steps, per_device_train_batch_size=16,
                                     learning_rate=1e-4, report_to=[], save_strategy="no", use_cpu=True, seed=0)
        collator = DataCollatorWithPadding(tokenizer)
        trainer = CPTTrainer(model=model, args=training, train_dataset=pretrained.PairDataset(train_rows, tokenizer),
                             data_collator=collator, cpt_config=config)
        trainer.train()
        model.eval()
        batch = collator([pretrained.PairDataset(eval_rows, tokenizer)[i] for i in range(len(eval_rows))])
        labels = batch["labels"]
        trained = _logits(model, batch)
        paths = {name: os.path.join(work, name) for name in ("packed", "compressed-tensors", "portable")}
        hf_cpt.save_quantized(model, paths["packed"], EXPORT_BITS, model_card=False)
        hf_cpt.export_compressed_tensors(model, paths["compressed-tensors"], EXPORT_BITS, model_card=False,
                                         measure_inputs={k: v for k, v in batch.items() if k != "labels"})
        hf_cpt.export_portable(model, paths["portable"], EXPORT_BITS, model_card=False)
        with open(os.path.join(paths["compressed-tensors"], "cpt_config.json")) as f:
            effect = json.load(f)["export_effect"]
        row = {"scheme": scheme, "steps": args.steps, "eval_pairs": len(eval_rows),
               "trained_accuracy": float((trained.argmax(-1) == labels).float().mean()),
               "float_layers": {why: len(names) for why, names in effect["float_layers"].items()},
               "cpt_layers": len(effect["layers"]),
               "max_layer_change_in_format": max((v for n, v in effect["layers"].items()
                                                  if not any(n in names for names in effect["float_layers"].values())),
                                                 default=None)}
        embeddings = model.get_input_embeddings().weight
        with torch.no_grad():  # how far the trained model itself moves under a 1e-7 relative nudge of its inputs
            embeddings.mul_(1 + 1e-7)
            row["nudged"] = _against(trained, _logits(model, batch), labels)
            embeddings.div_(1 + 1e-7)
        for name, path in paths.items():
            row[name] = _against(trained, _logits(AutoModelForSequenceClassification.from_pretrained(path), batch),
                                 labels)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", default=harness.DEFAULT_DATA)
    parser.add_argument("--output", default=os.path.join(harness.RESULTS_DIR, "exports.json"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval", type=int, default=256)
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pretrained.minilm_path())
    train_rows, eval_rows = pretrained.mnli_split(args.data_dir)
    results = harness.load_results(args.output)
    results.setdefault("environment", harness.environment())
    rows = results.setdefault("schemes", {})
    for scheme in args.schemes:
        if scheme in rows and rows[scheme].get("steps") == args.steps:
            print(f"{scheme}: done")
            continue
        rows[scheme] = run_scheme(scheme, args, tokenizer, train_rows, eval_rows[:args.eval])
        harness.save_results(args.output, results)
        print(scheme, rows[scheme])


if __name__ == "__main__":
    main()
