#!/usr/bin/env python
"""Entailment classification (MNLI) with Cyclic Precision Training.

    python recipes/mnli.py --output_dir outputs/mnli                 # GLUE MNLI + bert-base-uncased
    accelerate launch recipes/mnli.py --output_dir outputs/mnli ...  # one or several processes

Local data: ``--train_file`` / ``--validation_file`` / ``--validation_mismatched_file`` (csv, json or
jsonl with premise / hypothesis / label columns; labels as strings or integers). Evaluates on the
matched and, when present, the mismatched validation sets. Run with ``--help`` for every flag.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import common
from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding

from hf_cpt import CPTTrainer

logger = logging.getLogger("hf_cpt.recipes.mnli")

DEFAULT_MODEL = "bert-base-uncased"
DEFAULT_DATASET = ("glue", "mnli")
MNLI_LABELS = ["entailment", "neutral", "contradiction"]  # GLUE's ids 0, 1, 2
NO_LABEL = (None, -1, "-", "")  # unlabelled pairs (GLUE test sets, SNLI without gold label)


@dataclass
class MNLIDataArguments(common.DataArguments):
    validation_mismatched_file: str | None = field(
        default=None, metadata={"help": "Local mismatched evaluation file (evaluated as eval_mismatched_*)."}
    )
    sentence1_key: str = field(default="premise", metadata={"help": "Column of the first sentence."})
    sentence2_key: str = field(default="hypothesis", metadata={"help": "Column of the second sentence."})
    label_column_name: str = field(default="label", metadata={"help": "Column of the labels."})
    label_list: list[str] | None = field(
        default=None,
        metadata={
            "help": "Label names in id order, for string labels. Default: entailment, neutral, contradiction "
            "(GLUE's order) when the labels are among these, else the sorted label strings."
        },
    )
    max_seq_length: int = field(default=128, metadata={"help": "Longest tokenized pair; longer ones are truncated."})
    pad_to_max_length: bool = field(
        default=False, metadata={"help": "Pad every pair to max_seq_length (default: pad each batch)."}
    )


def load_data(data_args: MNLIDataArguments, model_args: common.ModelArguments):
    if data_args.has_local_files or data_args.validation_mismatched_file:
        if not data_args.train_file and not data_args.validation_file:
            raise ValueError("--validation_mismatched_file needs --train_file or --validation_file.")
        raw = common.load_local_files(
            {
                "train": data_args.train_file,
                "validation": data_args.validation_file,
                "validation_mismatched": data_args.validation_mismatched_file,
            }
        )
    else:
        raw = common.load_hub_dataset(data_args, model_args, DEFAULT_DATASET)
        if "validation_matched" in raw:  # GLUE MNLI
            raw["validation"] = raw.pop("validation_matched")
    for split in [s for s in raw if s.startswith("test")]:
        raw.pop(split)  # unlabelled in GLUE
    return common.ensure_validation_split(raw, data_args)


def resolve_labels(raw, data_args: MNLIDataArguments) -> list[str]:
    """Label names in id order; string labels follow GLUE's MNLI order when they can."""
    column = data_args.label_column_name
    feature = next(iter(raw.values())).features[column]
    if hasattr(feature, "names"):  # ClassLabel (GLUE)
        return list(feature.names)
    if data_args.label_list:
        return list(data_args.label_list)
    values = set()
    for dataset in raw.values():
        values.update(v for v in dataset.unique(column) if v not in NO_LABEL)
    if all(isinstance(v, str) for v in values):
        if values <= set(MNLI_LABELS):
            return list(MNLI_LABELS)
        return sorted(values)
    ids = sorted(int(v) for v in values)
    if ids and ids[0] < 0:
        raise ValueError(f"Integer labels must be >= 0 (or -1 for unlabelled), got {ids[0]}.")
    count = max(ids[-1] + 1 if ids else 0, len(MNLI_LABELS))
    return list(MNLI_LABELS) if count == len(MNLI_LABELS) else [f"LABEL_{i}" for i in range(count)]


def main():
    model_args, data_args, cpt_config, training_args = common.parse_arguments(common.ModelArguments, MNLIDataArguments)
    common.setup(training_args)
    model_args.resolve_default(DEFAULT_MODEL)

    raw = load_data(data_args, model_args)
    label_names = resolve_labels(raw, data_args)
    label2id = {name: i for i, name in enumerate(label_names)}
    logger.info("Labels: %s", label2id)

    config = common.load_config(
        model_args,
        num_labels=len(label_names),
        label2id=label2id,
        id2label=dict(enumerate(label_names)),
        finetuning_task="mnli",
    )
    tokenizer = common.load_tokenizer(model_args)
    model = common.load_model(AutoModelForSequenceClassification, model_args, config, tokenizer)

    max_length = min(data_args.max_seq_length, tokenizer.model_max_length)
    key1, key2, label_key = data_args.sentence1_key, data_args.sentence2_key, data_args.label_column_name

    def to_id(label):
        if isinstance(label, str):
            if label not in label2id:
                raise ValueError(f"Unknown label {label!r}; known labels: {label_names} (see --label_list).")
            return label2id[label]
        if not 0 <= int(label) < len(label_names):
            raise ValueError(f"Label {label} is outside 0..{len(label_names) - 1}.")
        return int(label)

    def preprocess(batch):
        encoded = tokenizer(
            batch[key1],
            batch[key2],
            truncation=True,
            max_length=max_length,
            padding="max_length" if data_args.pad_to_max_length else False,
        )
        encoded["labels"] = [to_id(label) for label in batch[label_key]]
        return encoded

    with training_args.main_process_first(desc="tokenization"):
        for split in list(raw):
            missing = {key1, key2, label_key} - set(raw[split].column_names)
            if missing:
                raise ValueError(f"Split {split!r} lacks column(s) {sorted(missing)}; see --sentence1_key etc.")
            before = len(raw[split])
            raw[split] = raw[split].filter(lambda label: label not in NO_LABEL, input_columns=label_key)
            if len(raw[split]) < before:
                logger.info("%s: dropped %d unlabelled pairs", split, before - len(raw[split]))
            limit = data_args.max_train_samples if split == "train" else data_args.max_eval_samples
            raw[split] = common.truncate(raw[split], limit).map(
                preprocess,
                batched=True,
                num_proc=data_args.preprocessing_num_workers,
                remove_columns=raw[split].column_names,
                load_from_cache_file=not data_args.overwrite_cache,
                desc=f"Tokenizing {split}",
            )

    eval_datasets = {"eval": raw.get("validation"), "eval_mismatched": raw.get("validation_mismatched")}
    trainer = CPTTrainer(
        model=model,
        args=training_args,
        train_dataset=raw.get("train") if training_args.do_train else None,
        eval_dataset=raw.get("validation") if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=None if data_args.pad_to_max_length else DataCollatorWithPadding(tokenizer),
        compute_metrics=common.accuracy_metrics(),
        cpt_config=cpt_config,
    )
    common.run(
        trainer,
        training_args,
        cpt_config,
        train_dataset=raw.get("train"),
        eval_datasets={k: v for k, v in eval_datasets.items() if v is not None},
        model_card={
            "finetuned_from": model_args.model_name_or_path,
            "tasks": "text-classification",
            "dataset": data_args.dataset_name or (None if data_args.has_local_files else "GLUE MNLI"),
        },
    )


if __name__ == "__main__":
    main()
