"""Shared parts of the hf_cpt recipes (`mnli.py`, `clm.py`, `vision.py`).

* argument dataclasses in the style of the `transformers` example scripts, plus ``--cpt_*`` flags
  generated at runtime from the fields of `hf_cpt.CPTConfig` (with their help text);
* `parse_arguments`: command line, or one JSON / YAML file as the single argument;
* loading of Hub datasets or local files, deterministic validation splits, config / tokenizer / model
  loading (pretrained or from scratch);
* `run`: train, evaluate, write ``*_results.json``, ``cpt_config.json`` (the trainer writes
  ``cpt_cost_report.json``), and push to the Hub or write a model card.

``recipes/tokenizer.py`` builds a tokenizer from local files, for offline training from scratch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union, get_args, get_origin, get_type_hints

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # `python recipes/X.py` from a checkout without `pip install -e .`
    sys.path.insert(1, _ROOT)

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import transformers  # noqa: E402
from transformers import HfArgumentParser, TrainingArguments, set_seed  # noqa: E402

from hf_cpt import CPTConfig  # noqa: E402

logger = logging.getLogger("hf_cpt.recipes")

CPT_PREFIX = "cpt_"
CPT_CONFIG_FILE = "cpt_config.json"

TEXT_EXTENSIONS = {"txt": "text", "text": "text", "raw": "text", "tokens": "text"}
TABLE_EXTENSIONS = {"csv": "csv", "tsv": "csv", "json": "json", "jsonl": "json"}


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------
@dataclass
class ModelArguments:
    """Which model, config and tokenizer to start from (as in the `transformers` examples)."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Pretrained model name on the Hub or path to a local folder. When neither this, --config_name "
            "nor --model_type is given, the recipe's default Hub model is used. Leave it out and give "
            "--config_name or --model_type to train from scratch."
        },
    )
    model_type: str | None = field(
        default=None,
        metadata={
            "help": "Train from scratch with the default config of this model type (e.g. bert, gpt2), "
            "adjusted by --config_overrides."
        },
    )
    config_overrides: str | None = field(
        default=None,
        metadata={
            "help": "Override config values when training from scratch, e.g. "
            "'n_embd=128,n_layer=2,n_head=2' or 'hidden_size=128,num_hidden_layers=2'."
        },
    )
    config_name: str | None = field(
        default=None, metadata={"help": "Config name or path, if different from --model_name_or_path."}
    )
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Tokenizer name or path, if different from --model_name_or_path."}
    )
    cache_dir: str | None = field(
        default=None, metadata={"help": "Where to store models and datasets downloaded from the Hub."}
    )
    use_fast_tokenizer: bool = field(default=True, metadata={"help": "Use a fast (Rust) tokenizer."})
    model_revision: str = field(
        default="main", metadata={"help": "Model version to use (branch name, tag name or commit id)."}
    )
    token: str | None = field(
        default=None, metadata={"help": "Hub token for private models (default: the one from `hf auth login`)."}
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow models defined by code in their Hub repository."}
    )
    ignore_mismatched_sizes: bool = field(
        default=False, metadata={"help": "Load a pretrained model even if its head has a different size."}
    )

    def hub_kwargs(self) -> dict[str, Any]:
        return {
            "cache_dir": self.cache_dir,
            "revision": self.model_revision,
            "token": self.token,
            "trust_remote_code": self.trust_remote_code,
        }

    def resolve_default(self, default_model: str) -> None:
        """Use the recipe's default Hub model when no model, config or model type is given."""
        if not (self.model_name_or_path or self.config_name or self.model_type):
            self.model_name_or_path = default_model

    @property
    def from_scratch(self) -> bool:
        return not self.model_name_or_path


@dataclass
class DataArguments:
    """Which data to train and evaluate on (as in the `transformers` examples)."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Dataset name on the Hub (or a local dataset folder). When neither this nor a local file is "
            "given, the recipe's default Hub dataset is used."
        },
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "Configuration of the dataset."})
    train_file: str | None = field(default=None, metadata={"help": "Local training data file."})
    validation_file: str | None = field(default=None, metadata={"help": "Local evaluation data file."})
    validation_split_percentage: int = field(
        default=5,
        metadata={
            "help": "When the data has no validation split, the percentage of the train split held out for "
            "evaluation (a shuffled split with --split_seed: the same on every run and every process)."
        },
    )
    split_seed: int = field(default=42, metadata={"help": "Seed of the train/validation split."})
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Truncate the training set to this many examples (debugging, quick runs)."}
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Truncate each evaluation set to this many examples."}
    )
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"help": "Number of processes for the preprocessing."}
    )
    overwrite_cache: bool = field(default=False, metadata={"help": "Redo the preprocessing instead of caching it."})

    @property
    def has_local_files(self) -> bool:
        return bool(self.train_file or self.validation_file)


def _resolved_types(cls) -> dict[str, Any]:
    return get_type_hints(cls)  # each base class's annotations resolved in its own module


def _is_union(tp) -> bool:
    origin = get_origin(tp)
    return origin is Union or (hasattr(types, "UnionType") and origin is types.UnionType)


def _cli_type(tp):
    """A type HfArgumentParser can parse for a config field of type ``tp``."""
    if _is_union(tp):
        members = [a for a in get_args(tp) if a is not type(None)]
        optional = len(members) < len(get_args(tp))
        inner = _cli_type(members[0]) if len(members) == 1 else str  # e.g. Union[int, str]: parsed in _from_cli
        return Optional[inner] if optional else inner  # noqa: UP045 (a runtime type for HfArgumentParser)
    origin = get_origin(tp)
    if origin in (list, tuple, set):
        args = [a for a in get_args(tp) if a is not Ellipsis]
        item = args[0] if args and args[0] in (int, float, str) else str
        return list[item]
    if origin is Literal or tp in (int, float, str, bool):
        return tp
    return str  # dicts and other structures: JSON text


def _from_cli(value: Any, tp) -> Any:
    """Turn a parsed ``--cpt_*`` value back into what the CPTConfig field expects."""
    if value is None:
        return None
    members = [a for a in get_args(tp) if a is not type(None)] if _is_union(tp) else [tp]
    if isinstance(value, str) and str not in members and get_origin(tp) is not Literal:
        if dict in members or any(get_origin(m) is dict for m in members):
            return json.loads(value)
    if isinstance(value, str) and bool in members and value.lower() in ("true", "false"):
        return value.lower() == "true"  # e.g. bool | str: True, False or "auto"
    if isinstance(value, str) and len(members) > 1:
        for number in (int, float):
            if number in members:
                try:
                    return number(value)
                except ValueError:
                    pass
    if isinstance(value, list) and any(get_origin(m) is tuple for m in members):
        return tuple(value)
    return value


def _cli_settings(config_cls: type) -> list[tuple[str, Any, dataclasses.Field, str | None, str | None]]:
    """(flag name, type, field, its part, its name in the part) of every setting of ``config_cls``: its own fields,
    each nested part's settings under their flat names (`hf_cpt.config.flat_settings`)."""
    from hf_cpt.config.cpt_config import PART_CLASSES, PART_FIELDS

    hints = _resolved_types(config_cls)
    settings = []
    for f in dataclasses.fields(config_cls):
        if not f.init:
            continue
        part_cls = PART_CLASSES.get(f.name)
        if part_cls is None:
            settings.append((f.name, hints[f.name], f, None, None))
            continue
        part_hints = _resolved_types(part_cls)
        for own in dataclasses.fields(part_cls):
            if own.name in PART_FIELDS[part_cls]:
                default = getattr(f.default, own.name)
                flag = dataclasses.field(default=default, metadata=own.metadata)
                settings.append((PART_FIELDS[part_cls][own.name], part_hints[own.name], flag, f.name, own.name))
    return settings


def make_cpt_arguments(config_cls: type = CPTConfig, prefix: str = CPT_PREFIX) -> type:
    """A dataclass with one ``--{prefix}{name}`` flag per setting of ``config_cls`` (a nested part's settings under
    their flat names), help text included.

    Built at runtime, so fields added to `CPTConfig` become flags without touching the recipes.
    """
    specs = []
    for name, tp, f, _, _ in _cli_settings(config_cls):
        metadata = dict(f.metadata)
        metadata.setdefault("help", f"CPTConfig.{name}")
        cli_field = field(metadata=metadata)
        if f.default is not dataclasses.MISSING:
            cli_field = field(default=f.default, metadata=metadata)
        elif f.default_factory is not dataclasses.MISSING:
            cli_field = field(default_factory=f.default_factory, metadata=metadata)
        specs.append((prefix + name, _cli_type(tp), cli_field))
    return dataclasses.make_dataclass(
        "CPTArguments", specs, namespace={"__doc__": f"`{config_cls.__name__}` settings as {prefix}* flags."}
    )


def cpt_config_from_args(cpt_args: Any, config_cls: type = CPTConfig, prefix: str = CPT_PREFIX):
    """Build the `CPTConfig` from a `make_cpt_arguments` instance (flat names gathered into their parts)."""
    values: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {}
    for name, tp, _, part, own in _cli_settings(config_cls):
        if not hasattr(cpt_args, prefix + name):
            continue
        value = _from_cli(getattr(cpt_args, prefix + name), tp)
        if part is None:
            values[name] = value
        else:
            parts.setdefault(part, {})[own] = value
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
    for part, changes in parts.items():
        values[part] = dataclasses.replace(defaults[part], **changes)
    return config_cls(**values)


CPTArguments = make_cpt_arguments()


def parse_arguments(
    model_cls: type = ModelArguments,
    data_cls: type = DataArguments,
    argv: list[str] | None = None,
) -> tuple[Any, Any, CPTConfig, TrainingArguments]:
    """(model_args, data_args, cpt_config, training_args) from the command line or one JSON / YAML file."""
    argv = sys.argv[1:] if argv is None else list(argv)
    cpt_cls = make_cpt_arguments()
    parser = HfArgumentParser((model_cls, data_cls, cpt_cls, TrainingArguments))
    cpu_processes = _several_processes_without_accelerator()
    if len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")):
        with open(argv[0]) as f:
            if argv[0].endswith(".json"):
                values = json.load(f)
            else:
                import yaml

                values = yaml.safe_load(f)
        if cpu_processes and "use_cpu" not in values:
            values["use_cpu"] = True
        parsed = parser.parse_dict(values)
    else:
        if cpu_processes and not any(a.split("=")[0] in ("--use_cpu", "--use-cpu") for a in argv):
            argv.append("--use_cpu")
        parsed = parser.parse_args_into_dataclasses(args=argv)
    model_args, data_args, cpt_args, training_args = parsed
    if not (training_args.do_train or training_args.do_eval or training_args.do_predict):
        training_args.do_train = training_args.do_eval = True  # neither flag given: do both
    return model_args, data_args, cpt_config_from_args(cpt_args), training_args


def _launched_processes() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _several_processes_without_accelerator() -> bool:
    """Launched as several processes on a machine without GPU (or other accelerator).

    There, `TrainingArguments` only joins the processes into one run (gloo) with ``use_cpu``; without
    it each process would train alone, so the recipes turn ``use_cpu`` on unless it is given.
    """
    return _launched_processes() > 1 and not _accelerator_available()


def _accelerator_available() -> bool:
    import torch

    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return accelerator.is_available()
    return torch.cuda.is_available()


def setup(training_args: TrainingArguments) -> None:
    """Logging as in the `transformers` examples, and the seed."""
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    log_level = training_args.get_process_log_level()
    logger.setLevel(logging.INFO if training_args.should_log else log_level)
    logging.getLogger("hf_cpt").setLevel(logging.INFO if training_args.should_log else log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()
    logger.warning(
        "Process rank: %s, device: %s, world size: %s, distributed: %s",
        training_args.process_index,
        training_args.device,
        training_args.world_size,
        training_args.parallel_mode.value,
    )
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not _accelerator_available():
        raise RuntimeError(
            "Accelerate's FSDP plugin does not run on a machine without GPU (fsdp_version 1 finds no device; "
            "fsdp_version 2 ran each process on its own). On CPU, launch with `accelerate launch --multi_gpu "
            "--num_processes N` (DDP over gloo), or shard with torch's fully_shard in your own loop."
        )
    if _launched_processes() > 1 and training_args.world_size == 1:
        raise RuntimeError(
            f"Launched as {_launched_processes()} processes, but the training arguments see a world size of "
            f"{training_args.world_size}: each process would train on its own. On a machine without GPU, "
            "pass --use_cpu (or leave it out: the recipes set it)."
        )
    set_seed(training_args.seed)


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
def builder_for_file(path: str, text: bool = False) -> str:
    """The `datasets` builder for a local file, from its extension."""
    extension = path.rsplit(".", 1)[-1].lower() if "." in os.path.basename(path) else ""
    table = {**TABLE_EXTENSIONS, **(TEXT_EXTENSIONS if text else {})}
    if extension not in table:
        raise ValueError(f"{path}: unsupported file type {extension!r}; use one of {sorted(table)}.")
    return table[extension]


def load_local_files(files: dict[str, str | None], text: bool = False, **builder_kwargs) -> datasets.DatasetDict:
    """Load local files, one per split (csv / json / jsonl, and text files when ``text``)."""
    files = {split: path for split, path in files.items() if path}
    builders = {split: builder_for_file(path, text) for split, path in files.items()}
    if len(set(builders.values())) != 1:
        raise ValueError(f"All data files must have the same format, got {builders}.")
    builder = next(iter(builders.values()))
    for path in files.values():
        if not os.path.exists(path):
            raise FileNotFoundError(f"Data file {path} does not exist.")
    if builder == "csv" and any(path.endswith(".tsv") for path in files.values()):
        builder_kwargs.setdefault("delimiter", "\t")
    if builder != "text":
        builder_kwargs.pop("keep_linebreaks", None)
    return datasets.load_dataset(builder, data_files=files, **builder_kwargs)


def load_hub_dataset(data_args: DataArguments, model_args: ModelArguments, default: tuple[str, str | None]):
    """``load_dataset(--dataset_name, --dataset_config_name)``, or the recipe's default dataset."""
    name, config_name = data_args.dataset_name, data_args.dataset_config_name
    if name is None:
        name, config_name = default[0], config_name or default[1]
    logger.info("Loading dataset %s (%s)", name, config_name)
    return datasets.load_dataset(name, config_name, cache_dir=model_args.cache_dir, token=model_args.token)


def ensure_validation_split(raw: datasets.DatasetDict, data_args: DataArguments, name: str = "validation"):
    """Hold out ``--validation_split_percentage`` of train as ``name`` when no evaluation split exists.

    The split is shuffled with ``--split_seed``, so every run and every process gets the same one.
    """
    if name in raw or "train" not in raw or data_args.validation_split_percentage <= 0:
        return raw
    if data_args.validation_split_percentage >= 100:
        raise ValueError("--validation_split_percentage must be below 100.")
    parts = raw["train"].train_test_split(
        test_size=data_args.validation_split_percentage / 100, seed=data_args.split_seed, shuffle=True
    )
    raw["train"], raw[name] = parts["train"], parts["test"]
    logger.info(
        "No validation data: held out %d%% of train (seed %d): %d train / %d validation examples",
        data_args.validation_split_percentage,
        data_args.split_seed,
        len(raw["train"]),
        len(raw[name]),
    )
    return raw


def truncate(dataset: datasets.Dataset, max_samples: int | None) -> datasets.Dataset:
    if max_samples is None:
        return dataset
    return dataset.select(range(min(max_samples, len(dataset))))


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------
def load_config(model_args: ModelArguments, **config_kwargs):
    """The model config: from --config_name / --model_name_or_path, or a fresh one of --model_type."""
    from transformers import CONFIG_MAPPING, AutoConfig

    if model_args.config_name or model_args.model_name_or_path:
        source = model_args.config_name or model_args.model_name_or_path
        config = AutoConfig.from_pretrained(source, **model_args.hub_kwargs(), **config_kwargs)
    elif model_args.model_type:
        if model_args.model_type not in CONFIG_MAPPING:
            raise ValueError(f"--model_type {model_args.model_type!r} is unknown; e.g. bert, gpt2, llama.")
        config = CONFIG_MAPPING[model_args.model_type](**config_kwargs)
        logger.warning("Training a new %s model from scratch.", model_args.model_type)
    else:
        raise ValueError("Give --model_name_or_path, --config_name or --model_type.")
    if model_args.config_overrides:
        if model_args.model_name_or_path:
            raise ValueError("--config_overrides only applies to models trained from scratch.")
        logger.info("Overriding config: %s", model_args.config_overrides)
        config.update_from_string(model_args.config_overrides)
    return config


def load_tokenizer(model_args: ModelArguments, **kwargs):
    from transformers import AutoTokenizer

    source = model_args.tokenizer_name or model_args.model_name_or_path
    if not source:
        raise ValueError(
            "Training from scratch needs a tokenizer: pass --tokenizer_name (a Hub name or a local folder; "
            "`python recipes/tokenizer.py` builds one from local files)."
        )
    return AutoTokenizer.from_pretrained(
        source, use_fast=model_args.use_fast_tokenizer, **model_args.hub_kwargs(), **kwargs
    )


def load_model(auto_cls, model_args: ModelArguments, config, tokenizer=None):
    """A pretrained model, or a new one built from ``config`` whose vocabulary follows the tokenizer."""
    if model_args.model_name_or_path:
        model = auto_cls.from_pretrained(
            model_args.model_name_or_path,
            config=config,
            ignore_mismatched_sizes=model_args.ignore_mismatched_sizes,
            **model_args.hub_kwargs(),
        )
    else:
        if tokenizer is not None:
            if getattr(config, "vocab_size", None) not in (None, len(tokenizer)):
                logger.info("From scratch: vocab_size %s -> %d (the tokenizer's)", config.vocab_size, len(tokenizer))
                config.vocab_size = len(tokenizer)
            for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
                if hasattr(config, name):
                    setattr(config, name, getattr(tokenizer, name, None))
        model = auto_cls.from_config(config, trust_remote_code=model_args.trust_remote_code)
        logger.info("New model: %.2fM parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    if tokenizer is not None and hasattr(model, "get_input_embeddings"):
        embeddings = model.get_input_embeddings()
        if embeddings is not None and len(tokenizer) > embeddings.weight.shape[0]:
            model.resize_token_embeddings(len(tokenizer))
    return model


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------
def accuracy_metrics() -> Callable:
    """``compute_metrics`` giving ``accuracy`` from logits or predicted ids (labels -100 are ignored), computed here:
    the same online and offline, no metric script to fetch."""

    def compute_metrics(eval_pred):
        predictions = eval_pred.predictions[0] if isinstance(eval_pred.predictions, tuple) else eval_pred.predictions
        references = np.asarray(eval_pred.label_ids)
        predictions = np.asarray(predictions)
        if predictions.ndim > references.ndim:  # logits
            predictions = predictions.argmax(axis=-1)
        keep = references != -100  # padding of labels
        return {"accuracy": float((predictions[keep] == references[keep]).mean())}

    return compute_metrics


# ---------------------------------------------------------------------------------------------
# Run and outputs
# ---------------------------------------------------------------------------------------------
def distributed_metrics(training_args: TrainingArguments) -> dict[str, int]:
    """Processes and global batch of the run (written to train_results.json)."""
    return {
        "world_size": training_args.world_size,
        "per_device_train_batch_size": training_args.per_device_train_batch_size,
        "gradient_accumulation_steps": training_args.gradient_accumulation_steps,
        "total_train_batch_size": training_args.per_device_train_batch_size
        * training_args.gradient_accumulation_steps
        * training_args.world_size,
    }


def write_cpt_config(output_dir: str, cpt_config: CPTConfig) -> str:
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, CPT_CONFIG_FILE)
    with open(path, "w") as f:
        json.dump(cpt_config.to_dict(), f, indent=2)
    return path


def run(
    trainer,
    training_args: TrainingArguments,
    cpt_config: CPTConfig,
    train_dataset=None,
    eval_datasets: dict[str, Any] | None = None,
    postprocess_eval: Callable[[dict[str, float], str], None] | None = None,
    model_card: dict[str, Any] | None = None,
    save_kwargs: dict[str, Any] | None = None,
) -> dict[str, dict[str, float]]:
    """Train, evaluate, write the outputs, push to the Hub: the part every recipe shares.

    ``eval_datasets`` maps a metric prefix ("eval", "eval_mismatched") to a dataset. Writes
    ``train_results.json``, ``<prefix>_results.json``, ``all_results.json``, ``trainer_state.json``,
    ``cpt_config.json``, the model (``trainer.save_model(**save_kwargs)``), and (through the trainer)
    ``cpt_cost_report.json``.
    """
    results: dict[str, dict[str, float]] = {}
    if trainer.is_world_process_zero():
        write_cpt_config(training_args.output_dir, cpt_config)
    if training_args.do_train:
        if train_dataset is None:
            raise ValueError("--do_train needs training data.")
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model(**(save_kwargs or {}))
        metrics = dict(train_result.metrics)
        metrics["train_samples"] = len(train_dataset)
        metrics["global_step"] = train_result.global_step
        metrics.update(distributed_metrics(training_args))
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        results["train"] = metrics
    if training_args.do_eval:
        if not eval_datasets:
            raise ValueError("--do_eval needs evaluation data (a validation split or --validation_file).")
        for prefix, dataset in eval_datasets.items():
            logger.info("*** Evaluate (%s) ***", prefix)
            metrics = trainer.evaluate(eval_dataset=dataset, metric_key_prefix=prefix)
            metrics[f"{prefix}_samples"] = len(dataset)
            if postprocess_eval is not None:
                postprocess_eval(metrics, prefix)
            trainer.log_metrics(prefix, metrics)
            trainer.save_metrics(prefix, metrics)
            results[prefix] = metrics
    card = {"tags": ["hf_cpt", "cyclic-precision-training"], **(model_card or {})}
    card = {key: value for key, value in card.items() if value is not None}
    if training_args.push_to_hub:
        trainer.push_to_hub(**card)
    elif training_args.do_train and hasattr(trainer.model, "config") and trainer.is_world_process_zero():
        trainer.create_model_card(**card)
    if trainer.is_world_process_zero():
        logger.info("Outputs in %s", os.path.abspath(training_args.output_dir))
    return results


def perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return float("inf")
