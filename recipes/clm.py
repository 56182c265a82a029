#!/usr/bin/env python
"""Causal language modelling with Cyclic Precision Training.

    python recipes/clm.py --output_dir outputs/clm                 # WikiText-103 (raw) + gpt2
    accelerate launch recipes/clm.py --output_dir outputs/clm ...  # one or several processes

Local data: ``--train_file`` / ``--validation_file`` (text files, one paragraph a line; or csv /
json / jsonl with a text column). Train from scratch with ``--model_type gpt2 --config_overrides
...`` or ``--config_name``, plus ``--tokenizer_name``. Texts are concatenated and cut into blocks
of ``--block_size`` tokens; evaluation reports the loss, next-token accuracy and perplexity.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import chain

import common
from transformers import AutoModelForCausalLM, default_data_collator

from hf_cpt import CPTTrainer

logger = logging.getLogger("hf_cpt.recipes.clm")

DEFAULT_MODEL = "gpt2"
DEFAULT_DATASET = ("wikitext", "wikitext-103-raw-v1")


@dataclass
class CLMDataArguments(common.DataArguments):
    text_column_name: str | None = field(
        default=None, metadata={"help": "Column holding the text (default: 'text', else the first column)."}
    )
    block_size: int | None = field(
        default=None,
        metadata={
            "help": "Tokens per training block after concatenating the texts (default: the model's maximum "
            "length, at most 1024)."
        },
    )
    keep_linebreaks: bool = field(default=True, metadata={"help": "Keep line breaks when reading text files."})


def main():
    model_args, data_args, cpt_config, training_args = common.parse_arguments(common.ModelArguments, CLMDataArguments)
    common.setup(training_args)
    model_args.resolve_default(DEFAULT_MODEL)

    if data_args.has_local_files:
        raw = common.load_local_files(
            {"train": data_args.train_file, "validation": data_args.validation_file},
            text=True,
            keep_linebreaks=data_args.keep_linebreaks,
        )
    else:
        raw = common.load_hub_dataset(data_args, model_args, DEFAULT_DATASET)
    raw = common.ensure_validation_split(raw, data_args)
    raw.pop("test", None)

    config = common.load_config(model_args)
    tokenizer = common.load_tokenizer(model_args)
    model = common.load_model(AutoModelForCausalLM, model_args, config, tokenizer)

    columns = next(iter(raw.values())).column_names
    text_column = data_args.text_column_name or ("text" if "text" in columns else columns[0])
    max_positions = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    block_size = data_args.block_size or min(1024, tokenizer.model_max_length, max_positions or 1024)
    if max_positions and block_size > max_positions:
        raise ValueError(f"--block_size {block_size} exceeds the model's {max_positions} positions.")
    logger.info("Block size: %d tokens", block_size)

    def tokenize(batch):
        return tokenizer(batch[text_column])

    def group_texts(batch):
        """Concatenate the texts and cut them into blocks; the remainder shorter than a block is dropped."""
        concatenated = {k: list(chain(*batch[k])) for k in batch}
        total = (len(concatenated["input_ids"]) // block_size) * block_size
        blocks = {k: [t[i : i + block_size] for i in range(0, total, block_size)] for k, t in concatenated.items()}
        blocks["labels"] = [ids.copy() for ids in blocks["input_ids"]]
        return blocks

    lm = {}
    with training_args.main_process_first(desc="tokenization and grouping"):
        for split in raw:
            tokenized = raw[split].map(
                tokenize,
                batched=True,
                num_proc=data_args.preprocessing_num_workers,
                remove_columns=raw[split].column_names,
                load_from_cache_file=not data_args.overwrite_cache,
                desc=f"Tokenizing {split}",
            )
            grouped = tokenized.map(
                group_texts,
                batched=True,
                batch_size=1000,
                num_proc=data_args.preprocessing_num_workers,
                load_from_cache_file=not data_args.overwrite_cache,
                desc=f"Grouping {split} in blocks of {block_size}",
            )
            limit = data_args.max_train_samples if split == "train" else data_args.max_eval_samples
            lm[split] = common.truncate(grouped, limit)
            logger.info("%s: %d blocks of %d tokens", split, len(lm[split]), block_size)
            if len(lm[split]) == 0:
                raise ValueError(f"{split}: too little text for one block of {block_size} tokens; lower --block_size.")

    accuracy = common.accuracy_metrics()

    def preprocess_logits_for_metrics(logits, labels):
        return (logits[0] if isinstance(logits, tuple) else logits).argmax(dim=-1)

    def compute_metrics(eval_pred):
        predictions, labels = eval_pred.predictions, eval_pred.label_ids
        # predictions[:, i] predicts labels[:, i + 1]
        eval_pred = type(eval_pred)(predictions[:, :-1].reshape(-1), labels[:, 1:].reshape(-1))
        return accuracy(eval_pred)

    def add_perplexity(metrics, prefix):
        metrics["perplexity" if prefix == "eval" else f"{prefix}_perplexity"] = common.perplexity(
            metrics[f"{prefix}_loss"]
        )

    trainer = CPTTrainer(
        model=model,
        args=training_args,
        train_dataset=lm.get("train") if training_args.do_train else None,
        eval_dataset=lm.get("validation") if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=default_data_collator,
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        cpt_config=cpt_config,
    )
    common.run(
        trainer,
        training_args,
        cpt_config,
        train_dataset=lm.get("train"),
        eval_datasets={"eval": lm["validation"]} if "validation" in lm else {},
        postprocess_eval=add_perplexity,
        model_card={
            "finetuned_from": model_args.model_name_or_path,
            "tasks": "text-generation",
            "dataset": data_args.dataset_name or (None if data_args.has_local_files else "wikitext"),
        },
    )


if __name__ == "__main__":
    main()
