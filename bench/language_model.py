"""CPT for language modelling at CPU scale: a small GPT-2 (from a config) on WikiText-2.

Trained on ``wikitext-2/valid.txt`` and evaluated on ``test.txt`` (``../shared/data``; WikiText-2 has
no train split there), with a byte-level BPE tokenizer (8,000 tokens) trained on the training text
only, blocks of 128 tokens, batch 16, AdamW lr 1e-3 with cosine decay, default `CPTConfig` settings.
Runs: FP32, static 8/8, CPT 4-8/8, two seeds; ``-full`` runs also quantize the output head and the attention
products (the paper's Transformer is quantized throughout). Each run records test perplexity, the cost meter's
report, time per step, the training curve and the precision profile (perplexity at 3-8 bits and FP32,
on the first quarter of the test text).

Resumable: results go to ``--output`` after every run; a finished run is skipped when the command is
run again. ``python bench/report.py`` turns the JSON into ``docs/RESULTS.md``.

    nohup python bench/language_model.py > outputs/language_model.log 2>&1 &
    nohup python bench/language_model.py --epochs 6 --runs fp32 static-8/8-full cpt-4-8/8-full \
        --output bench/results/language_model_full.json > outputs/language_model_full.log 2>&1 &

On a GPU (issue 76): a Llama-style model of about 70M parameters, quantized throughout, each run trained until its
validation loss stops improving (at most 40 epochs), three seeds:

    python bench/language_model.py --device cuda --model llama-70m --until_stalled 2 --epochs 40 --no_profile \
        --runs fp32 static-8/8-full cpt-4-8/8-full --seeds 0 1 2 --output bench/results/language_model_gpu.json
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402  (sets the offline environment and the import path first)
import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from hf_cpt import CPTConfig, CPTTrainer  # noqa: E402

DEFAULT_OUTPUT = os.path.join(harness.RESULTS_DIR, "language_model.json")
BLOCK = 128
# Error ranges named per run: per tensor (the CPT paper, the runs recorded first) or per row ("-error-token",
# today's default; docs/backward.md).
PER_TENSOR, PER_ROW = dict(error_granularity="tensor"), dict(error_granularity="token")
# Quantized throughout, as the CPT paper's WikiText-103 Transformer: the output head and the two attention
# products too ("-full"; default error settings of the time they ran: the min/max error grid throughout).
FULL = dict(include_modules=["lm_head"], quantize_attention=True, error_range="minmax")
RUNS = {
    "fp32": dict(schedule="fp32"),
    "static-8/8": dict(schedule="static", bits_max=8, grad_bits=8, **PER_TENSOR),
    "cpt-4-8/8": dict(schedule="cpt", bits_min=4, bits_max=8, grad_bits=8, **PER_TENSOR),
    "static-8/8-error-token": dict(schedule="static", bits_max=8, grad_bits=8, **PER_ROW),
    "cpt-4-8/8-error-token": dict(schedule="cpt", bits_min=4, bits_max=8, grad_bits=8, **PER_ROW),
    "static-8/8-full": dict(schedule="static", bits_max=8, grad_bits=8, **FULL),
    "cpt-4-8/8-full": dict(schedule="cpt", bits_min=4, bits_max=8, grad_bits=8, **FULL),
}
DEFAULT_RUNS = ["fp32", "static-8/8", "cpt-4-8/8"]
MODEL_SHAPE = dict(n_embd=256, n_layer=4, n_head=4, n_positions=BLOCK)
# --model llama-70m (issue 76, on a GPU): a Llama-style model of about 70M parameters with the 8,000-token vocabulary
LLAMA_SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
                   num_key_value_heads=12, max_position_embeddings=BLOCK, tie_word_embeddings=False)
MODELS = {"gpt2-small": MODEL_SHAPE, "llama-70m": LLAMA_SHAPE}


class StopWhenValidationStalls(TrainerCallback):
    """Stop once the validation loss has not improved for ``patience`` evaluations (one per epoch with
    ``--until_stalled``): each run trains until its validation loss stops improving."""

    def __init__(self, patience: int) -> None:
        self.patience, self.best, self.stalled = patience, float("inf"), 0

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        loss = (metrics or {}).get("eval_loss", float("inf"))
        self.best, self.stalled = (loss, 0) if loss < self.best else (self.best, self.stalled + 1)
        control.should_training_stop = self.stalled >= self.patience


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


class BlockDataset(torch.utils.data.Dataset):
    """A text file as consecutive blocks of ``BLOCK`` token ids (labels = inputs; the model shifts)."""

    def __init__(self, path: str, tokenizer, limit: int | None = None) -> None:
        with open(path, encoding="utf-8") as f:
            ids = tokenizer(f.read())["input_ids"]
        n = len(ids) // BLOCK
        self.blocks = torch.tensor(ids[: n * BLOCK]).view(n, BLOCK)[:limit]

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.blocks[index], "labels": self.blocks[index]}


def build_tokenizer(train_file: str, work_dir: str):
    """A byte-level BPE tokenizer trained on the training text (cached in ``work_dir``)."""
    from transformers import AutoTokenizer

    sys.path.insert(0, os.path.join(harness.ROOT, "recipes"))
    from tokenizer import train_tokenizer

    folder = os.path.join(work_dir, "tokenizer")
    if os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(folder)
    return train_tokenizer([train_file], folder, vocab_size=8000, kind="bpe", model_max_length=10**7)


def build_model(name: str, tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if name == "llama-70m":
        return LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.eos_token_id,
                                            eos_token_id=tokenizer.eos_token_id, **LLAMA_SHAPE))
    return GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), bos_token_id=tokenizer.eos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, **MODEL_SHAPE))


def main() -> None:
    from transformers import TrainingArguments

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", default=harness.DEFAULT_DATA)
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, choices=list(RUNS))
    parser.add_argument("--epochs", type=float, default=2)
    parser.add_argument("--cycles", type=int, default=8, help="CPT cycles over the run")
    parser.add_argument("--max_steps", type=int, default=-1, help="cap the steps (smoke tests)")
    parser.add_argument("--train_blocks", type=int, default=None, help="cap the training blocks (smoke tests)")
    parser.add_argument("--test_blocks", type=int, default=None, help="cap the test blocks (smoke tests)")
    parser.add_argument("--no_profile", action="store_true", help="skip the precision profile")
    parser.add_argument("--work_dir", default=os.path.join("outputs", "bench_language_model"))
    parser.add_argument("--model", choices=list(MODELS), default="gpt2-small")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--until_stalled", type=int, default=None, metavar="PATIENCE",
                        help="evaluate every epoch and stop a run once its validation loss has not improved for "
                             "PATIENCE epochs (--epochs: the longest a run may train)")
    args = parser.parse_args()

    results = harness.load_results(args.output)
    settings = {"epochs": args.epochs, "cycles": args.cycles, "max_steps": args.max_steps, "block": BLOCK,
                "train_blocks": args.train_blocks, "test_blocks": args.test_blocks, "model": MODELS[args.model],
                "batch_size": 16}
    if args.until_stalled is not None:  # files written before the option hold fixed-length runs
        settings["until_stalled"] = args.until_stalled
    harness.check_settings(results, "settings", settings, args.output)
    train_file = harness.data_file(args.data_dir, "wikitext-2", "valid.txt")
    tokenizer = build_tokenizer(train_file, args.work_dir)
    train = BlockDataset(train_file, tokenizer, args.train_blocks)
    test = BlockDataset(harness.data_file(args.data_dir, "wikitext-2", "test.txt"), tokenizer, args.test_blocks)
    # The precision profile (7 evaluations a run) reads the first quarter of the test text.
    profile_set = torch.utils.data.Subset(test, range(max(1, len(test) // 4)))
    results["data"] = {"profile_tokens": len(profile_set) * BLOCK, "train_tokens": train.blocks.numel(),
                       "test_tokens": test.blocks.numel(),
                       "vocab": len(tokenizer)}

    def build(config: CPTConfig, seed: int, name: str) -> CPTTrainer:
        model = build_model(args.model, tokenizer)
        stalls = args.until_stalled is not None
        training = TrainingArguments(
            output_dir=os.path.join(args.work_dir, name), per_device_train_batch_size=16,
            per_device_eval_batch_size=32, learning_rate=1e-3, weight_decay=0.01, lr_scheduler_type="cosine",
            warmup_steps=20, num_train_epochs=args.epochs, max_steps=args.max_steps, seed=seed, logging_steps=10,
            save_strategy="no", report_to="none", use_cpu=args.device == "cpu", disable_tqdm=True,
            eval_strategy="epoch" if stalls else "no",
        )
        return CPTTrainer(model=model, args=training, train_dataset=train, eval_dataset=test, cpt_config=config,
                          callbacks=[StopWhenValidationStalls(args.until_stalled)] if stalls else None)

    runs = harness.with_cycles({name: RUNS[name] for name in args.runs}, args.cycles)
    harness.run_all(results, args.output, runs, args.seeds, build, "loss", "perplexity", not args.no_profile,
                    transform=perplexity, profile_dataset=profile_set, desc="language-model runs")
    print(f"results: {args.output}")


if __name__ == "__main__":
    main()
