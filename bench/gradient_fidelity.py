"""How close quantized errors keep a pretrained model's gradients to FP32 (docs/backward.md, "Gradient fidelity").

The pretrained all-MiniLM-L6-v2 with a fresh 3-way head (the start of `bench/pretrained.py`'s fine-tuning), two
batches of 32 MNLI training pairs, dropout off. For each variant, at static 8/8, the parameter gradients of those
batches are compared with FP32's: the cosine similarity of one draw (what one step sees: bias and noise) and of
the mean of ``--draws`` draws (mostly the bias), per group of parameters. Every variant is a `CPTConfig`, so
the JSON says exactly what ran. Resumable: a finished variant is skipped.

    python bench/gradient_fidelity.py    # about 5 minutes on 2 cores
    python bench/report.py
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import pretrained  # noqa: E402
import torch  # noqa: E402

from hf_cpt import CPTConfig, quantize_model, set_precision  # noqa: E402

DEFAULT_OUTPUT = os.path.join(harness.RESULTS_DIR, "gradient_fidelity.json")
STATIC = dict(schedule="static", bits_max=8, grad_bits=8)
# name -> CPTConfig fields
VARIANTS = {
    "layers, min/max errors (default)": dict(**STATIC),
    "layers, zero-centred errors": dict(**STATIC, error_range="symmetric"),
    "layers + attention, attention errors min/max": dict(**STATIC, quantize_attention=True, error_range="minmax"),
    "layers + attention, attention errors zero-centred (default)": dict(**STATIC, quantize_attention=True),
    "layers + attention, nearest rounding, min/max": dict(**STATIC, quantize_attention=True, error_range="minmax",
                                                          error_rounding="nearest"),
    "layers + attention, nearest rounding, attention zero-centred": dict(**STATIC, quantize_attention=True,
                                                                         error_rounding="nearest"),
}
# parameter group -> a test on the parameter's name
GROUPS = {
    "query": lambda n: ".query." in n,
    "key": lambda n: ".key." in n,
    "value": lambda n: ".value." in n,
    "FFN": lambda n: "intermediate" in n or ("output.dense" in n and "attention" not in n),
    "embeddings": lambda n: "embeddings" in n,
    "all": lambda n: True,
}


def gradients(model, batches) -> dict[str, torch.Tensor]:
    model.zero_grad()
    for batch in batches:
        model(**batch).loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", default=harness.DEFAULT_DATA)
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    parser.add_argument("--draws", type=int, default=6)
    parser.add_argument("--model_path", default=None, help="a local BERT checkpoint instead of all-MiniLM-L6-v2")
    args = parser.parse_args()
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    pretrained.MODEL_PATH = args.model_path
    results = harness.load_results(args.output)
    harness.check_settings(results, "settings", {"model": pretrained.bert_label(), "draws": args.draws,
                                                 "batches": "2 x 32 MNLI training pairs"}, args.output)
    tokenizer = AutoTokenizer.from_pretrained(pretrained.minilm_path())
    rows, _ = pretrained.mnli_split(args.data_dir)
    dataset = pretrained.PairDataset(rows[:64], tokenizer)
    collate = DataCollatorWithPadding(tokenizer)
    batches = [collate([dataset[i] for i in range(start, start + 32)]) for start in (0, 32)]
    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(pretrained.minilm_path(), num_labels=3).train()
    for module in base.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    reference = gradients(base, batches)
    variants = results.setdefault("variants", {})
    for name, fields in VARIANTS.items():
        if name in variants:
            continue
        model = copy.deepcopy(base)
        quantize_model(model, CPTConfig(**fields))
        set_precision(model, 8, 8)
        draws = [gradients(model, batches) for _ in range(args.draws)]
        entry = {"cpt_config": fields, "groups": {}}
        for group, member in GROUPS.items():
            names = [n for n in reference if member(n)]
            flat = torch.cat([reference[n].flatten() for n in names])
            one = torch.cat([draws[0][n].flatten() for n in names])
            average = torch.cat([(sum(d[n] for d in draws) / len(draws)).flatten() for n in names])
            entry["groups"][group] = {"one_draw": cosine(one, flat), "mean_of_draws": cosine(average, flat)}
        variants[name] = entry
        results["environment"] = harness.environment()
        harness.save_results(args.output, results)
        print(f"{name}: " + ", ".join(f"{g} {v['one_draw']:.4f}" for g, v in entry["groups"].items()), flush=True)
    print(f"results: {args.output}")


if __name__ == "__main__":
    main()
