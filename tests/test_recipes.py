"""The recipes (recipes/mnli.py, clm.py, vision.py): argument handling in process, and end-to-end runs
in subprocesses, offline, on tiny models built from configs, local tokenizers and generated data."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import random
import socket
import subprocess
import sys

import numpy as np
import pytest

from .fresh_python import run_python
from .helpers import SHARED_DATA, build_word_tokenizer, tiny_bert_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(ROOT, "recipes")
PYTHON = sys.executable
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")
if RECIPES not in sys.path:
    sys.path.insert(0, RECIPES)

import common  # noqa: E402
import tokenizer as tokenizer_recipe  # noqa: E402

WORDS = (
    "the a cat dog man woman child sits runs eats sleeps plays on in under park house garden red blue big small"
).split()
MNLI_LABELS = ["entailment", "neutral", "contradiction"]
QUICK = ["--report_to", "none", "--save_strategy", "no", "--cpt_num_cycles", "2", "--seed", "0"]

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# ---------------------------------------------------------------------------------------------
# Generated data and tiny models
# ---------------------------------------------------------------------------------------------
def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(WORDS, k=n))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Tiny data files, a word tokenizer and a tiny BERT config, all saved to a temp folder."""
    from transformers import BertTokenizerFast

    root = tmp_path_factory.mktemp("recipe_assets")
    rng = random.Random(0)
    paths = {}
    for name, count in (("train", 48), ("dev", 12), ("dev_mm", 9)):
        paths[f"mnli_{name}"] = str(root / f"mnli_{name}.jsonl")
        with open(paths[f"mnli_{name}"], "w") as f:
            for i in range(count):
                row = {"premise": _sentence(rng, 8), "hypothesis": _sentence(rng, 5), "label": MNLI_LABELS[i % 3]}
                f.write(json.dumps(row) + "\n")
    paths["mnli_csv"] = str(root / "mnli_int.csv")  # integer labels, one file: split by percentage
    with open(paths["mnli_csv"], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["premise", "hypothesis", "label"])
        for i in range(40):
            writer.writerow([_sentence(rng, 8), _sentence(rng, 5), i % 3])
    for name, count in (("train", 60), ("valid", 20)):
        paths[f"text_{name}"] = str(root / f"{name}.txt")
        with open(paths[f"text_{name}"], "w") as f:
            f.writelines(_sentence(rng, rng.randint(5, 15)) + "\n" for _ in range(count))

    tokenizer_dir = root / "word_tokenizer"
    tokenizer_dir.mkdir()
    build_word_tokenizer(WORDS, str(tokenizer_dir))  # writes vocab.txt
    tokenizer = BertTokenizerFast.from_pretrained(str(tokenizer_dir))
    tokenizer.save_pretrained(str(tokenizer_dir))
    paths["tokenizer"] = str(tokenizer_dir)
    config = tiny_bert_config(num_labels=3)
    config.vocab_size = len(tokenizer)
    paths["bert_config"] = str(root / "bert_config")
    config.save_pretrained(paths["bert_config"])

    paths["bpe_tokenizer"] = str(root / "bpe_tokenizer")
    tokenizer_recipe.train_tokenizer([paths["text_train"]], paths["bpe_tokenizer"], vocab_size=300, kind="bpe")

    from PIL import Image

    colours = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}
    for split, count in (("train", 6), ("val", 3)):
        for label, colour in colours.items():
            folder = root / "images" / split / label
            folder.mkdir(parents=True)
            for i in range(count):
                image = Image.new("RGB", (40, 40), colour)
                image.putpixel((rng.randrange(40), rng.randrange(40)), (i * 20, 0, 0))
                image.save(folder / f"{i}.png")
    paths["images"] = str(root / "images")
    return paths


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_recipe(script: str, args: list[str], processes: int = 0, timeout: int = 240) -> subprocess.CompletedProcess:
    """Run a recipe as a user would: ``python recipes/X.py`` (`run_python`) or ``accelerate launch`` with N
    processes."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        OMP_NUM_THREADS="1",  # the runs share 2 cores
        TOKENIZERS_PARALLELISM="false",
    )
    path = os.path.join(RECIPES, script)
    if processes:
        command = [ACCELERATE, "launch", "--num_processes", str(processes), "--num_machines", "1"]
        command += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port())]
        if processes > 1:
            command.append("--multi_gpu")  # on a CPU-only machine: N gloo processes (`--cpu` starts one)
        command.append(path)
        result = subprocess.run(command + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    else:
        command = [PYTHON, path]
        result = run_python([path, *args], cwd=ROOT, env=env, timeout=timeout)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(command + args)} failed:\n{output[-6000:]}"
    assert "Traceback" not in output, output[-6000:]
    return result


def read_json(output_dir, name: str) -> dict:
    with open(os.path.join(output_dir, name)) as f:
        return json.load(f)


def check_outputs(output_dir, eval_prefixes=("eval",), metric="accuracy") -> dict:
    """The files every recipe writes, a finite loss, and the metrics."""
    results = read_json(output_dir, "all_results.json")
    assert math.isfinite(results["train_loss"]), results
    for prefix in eval_prefixes:
        assert math.isfinite(results[f"{prefix}_loss"]), results
        assert 0.0 <= results[f"{prefix}_{metric}"] <= 1.0, results
        assert read_json(output_dir, f"{prefix}_results.json")[f"{prefix}_{metric}"] == results[f"{prefix}_{metric}"]
    assert read_json(output_dir, "train_results.json")["train_loss"] == results["train_loss"]
    cpt_settings = read_json(output_dir, "cpt_config.json")
    cost = read_json(output_dir, "cpt_cost_report.json")
    assert cost["cpt_config"]["num_cycles"] == cpt_settings["num_cycles"] == 2
    assert cost["steps"] == read_json(output_dir, "trainer_state.json")["global_step"] == results["global_step"]
    assert 0 < cost["gbitops"] < cost["fp32_gbitops"]
    return results


# ---------------------------------------------------------------------------------------------
# Argument handling (in process)
# ---------------------------------------------------------------------------------------------
HF_EXAMPLE_FLAGS = [
    "--model_name_or_path", "--config_name", "--tokenizer_name", "--dataset_name", "--dataset_config_name",
    "--train_file", "--validation_file", "--max_train_samples", "--max_eval_samples", "--output_dir",
    "--push_to_hub", "--validation_split_percentage", "--model_type", "--config_overrides",
]  # fmt: skip


def _parser(model_cls=common.ModelArguments, data_cls=common.DataArguments):
    from transformers import HfArgumentParser, TrainingArguments

    return HfArgumentParser((model_cls, data_cls, common.make_cpt_arguments(), TrainingArguments))


@pytest.mark.parametrize("recipe", ["mnli", "clm", "vision"])
def test_recipe_flags_follow_hf_examples(recipe):
    module = __import__(recipe)
    model_cls = getattr(module, "VisionModelArguments", common.ModelArguments)
    data_cls = {"mnli": "MNLIDataArguments", "clm": "CLMDataArguments", "vision": "VisionDataArguments"}[recipe]
    help_text = _parser(model_cls, getattr(module, data_cls)).format_help()
    for flag in HF_EXAMPLE_FLAGS + ["--cpt_bits_min", "--cpt_schedule", "--cpt_grad_bits"]:
        assert flag in help_text, flag
    if recipe == "vision":
        for flag in ("--train_dir", "--validation_dir", "--image_size", "--pretrained"):
            assert flag in help_text, flag


def test_cpt_flags_generated_from_every_config_field_with_help():

    from hf_cpt.config import flat_settings

    actions = {a.option_strings[0]: a for a in _parser()._actions if a.option_strings}
    for name, _, default, help_text in flat_settings():  # nested settings under their flat names
        action = actions[f"--cpt_{name}"]
        assert action.dest == f"cpt_{name}" and action.help == help_text and action.default == default
    assert "--cpt_errors" not in actions and "--cpt_runtime" not in actions


def test_cpt_flags_follow_fields_added_later():
    from hf_cpt import CPTConfig

    @dataclasses.dataclass
    class ExtendedConfig(CPTConfig):
        warmup_bits: int = dataclasses.field(default=6, metadata={"help": "A field added later."})

    cls = common.make_cpt_arguments(ExtendedConfig)
    names = {f.name for f in dataclasses.fields(cls)}
    assert "cpt_warmup_bits" in names and "cpt_bits_min" in names
    config = common.cpt_config_from_args(cls(cpt_warmup_bits=5, cpt_num_cycles=4), ExtendedConfig)
    assert config.warmup_bits == 5 and config.num_cycles == 4


def test_cli_values_become_the_config_types(tmp_path):
    _, _, config, training_args = common.parse_arguments(
        argv=[
            "--output_dir", str(tmp_path), "--cpt_bits_min", "4", "--cpt_bits_max", "6", "--cpt_eval_bits", "fp32",
            "--cpt_exclude_modules", "embeddings", "pooler", "--cpt_schedule", "static",
        ]  # fmt: skip
    )
    assert config.bits_min == 4 and isinstance(config.bits_min, int)
    assert config.bits_max == 6 and config.eval_bits == "fp32" and config.schedule == "static"
    assert config.exclude_modules == ["embeddings", "pooler"]
    assert training_args.do_train and training_args.do_eval  # neither flag given: both
    _, _, config, training_args = common.parse_arguments(
        argv=["--output_dir", str(tmp_path), "--cpt_bits_min", "auto", "--cpt_eval_bits", "5", "--do_eval"]
    )
    assert config.bits_min == "auto" and config.eval_bits == 5
    assert training_args.do_eval and not training_args.do_train
    for flag, expected in (("false", False), ("True", True), ("auto", "auto")):  # a bool | str field
        _, _, config, _ = common.parse_arguments(argv=["--output_dir", str(tmp_path), "--cpt_integer_matmul", flag])
        assert config.integer_matmul == expected


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_a_json_or_yaml_file_as_the_single_argument(tmp_path, suffix):
    import yaml

    values = {
        "model_name_or_path": "some/model",
        "train_file": "train.jsonl",
        "max_train_samples": 7,
        "cpt_bits_min": 4,
        "cpt_schedule": "static",
        "cpt_exclude_modules": ["pooler"],
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 3,
        "do_train": True,
    }
    path = tmp_path / f"args{suffix}"
    path.write_text(json.dumps(values) if suffix == ".json" else yaml.safe_dump(values))
    model_args, data_args, config, training_args = common.parse_arguments(argv=[str(path)])
    assert model_args.model_name_or_path == "some/model"
    assert data_args.train_file == "train.jsonl" and data_args.max_train_samples == 7
    assert config.bits_min == 4 and config.schedule == "static" and config.exclude_modules == ["pooler"]
    assert training_args.per_device_train_batch_size == 3 and training_args.do_train and not training_args.do_eval
    path.write_text(json.dumps({**values, "cpt_no_such_field": 1}))
    if suffix == ".json":
        with pytest.raises(ValueError, match="cpt_no_such_field"):
            common.parse_arguments(argv=[str(path)])


def test_default_models_stay_on_the_hub():
    args = common.ModelArguments()
    args.resolve_default("bert-base-uncased")
    assert args.model_name_or_path == "bert-base-uncased" and not args.from_scratch
    args = common.ModelArguments(model_type="gpt2")
    args.resolve_default("gpt2")
    assert args.model_name_or_path is None and args.from_scratch
    import clm
    import mnli
    import vision

    assert (mnli.DEFAULT_MODEL, mnli.DEFAULT_DATASET) == ("bert-base-uncased", ("glue", "mnli"))
    assert (clm.DEFAULT_MODEL, clm.DEFAULT_DATASET) == ("gpt2", ("wikitext", "wikitext-103-raw-v1"))
    assert vision.DEFAULT_DATASET[0] in ("uoft-cs/cifar10", "cifar10")


def test_mnli_labels_follow_glue_ids():
    import datasets
    import mnli

    def labels_of(*columns, **kwargs):
        raw = datasets.DatasetDict(
            {f"s{i}": datasets.Dataset.from_dict({"label": list(c)}) for i, c in enumerate(columns)}
        )
        return mnli.resolve_labels(raw, mnli.MNLIDataArguments(**kwargs))

    assert labels_of(["contradiction", "entailment"], ["neutral", "-"]) == MNLI_LABELS
    assert labels_of(["contradiction", "entailment"]) == MNLI_LABELS  # a subset keeps GLUE's ids
    assert labels_of(["not_entailment", "entailment"]) == ["entailment", "not_entailment"]
    assert labels_of(["b", "a"], label_list=["b", "a"]) == ["b", "a"]
    assert labels_of([0, 2, 1, -1]) == MNLI_LABELS
    glue = datasets.Dataset.from_dict(
        {"label": [0, 1]}, features=datasets.Features({"label": datasets.ClassLabel(names=MNLI_LABELS)})
    )
    assert mnli.resolve_labels(datasets.DatasetDict(train=glue), mnli.MNLIDataArguments()) == MNLI_LABELS


def test_validation_split_is_deterministic():
    import datasets

    def split():
        raw = datasets.DatasetDict(train=datasets.Dataset.from_dict({"x": list(range(200))}))
        return common.ensure_validation_split(raw, common.DataArguments(validation_split_percentage=10))

    first, second = split(), split()
    assert len(first["validation"]) == 20 and len(first["train"]) == 180
    assert first["validation"]["x"] == second["validation"]["x"]
    assert first["validation"]["x"] != list(range(180, 200))  # shuffled, not the file's tail


def test_the_recipes_accuracy_matches_sklearn_from_logits_and_ids_without_padded_labels():
    from sklearn.metrics import accuracy_score
    from transformers import EvalPrediction

    sys.path.insert(0, RECIPES)
    import common

    compute = common.accuracy_metrics()
    predictions, references = np.array([0, 1, 2, 2, 1, 0, 1]), np.array([0, 1, 1, 2, 0, 0, 2])
    expected = accuracy_score(references, predictions)
    assert compute(EvalPrediction(predictions, references))["accuracy"] == pytest.approx(expected)
    logits = np.eye(3)[predictions] * 5.0  # the same predictions as logits
    assert compute(EvalPrediction((logits,), references))["accuracy"] == pytest.approx(expected)
    padded = np.array([0, 1, -100, 2, -100, 0, 2])  # labels -100 are ignored
    keep = padded != -100
    assert compute(EvalPrediction(predictions, padded))["accuracy"] == pytest.approx(
        accuracy_score(padded[keep], predictions[keep]))


class _RecordingTrainer:
    """Stands in for CPTTrainer in `common.run`: records what the recipe asks of it."""

    def __init__(self, has_config=True):
        self.calls = []
        self.model = type("Model", (), {"config": object()})() if has_config else object()

    def is_world_process_zero(self):
        return True

    def __getattr__(self, name):
        def record(*args, **kwargs):
            self.calls.append((name, kwargs))
            if name == "train":
                return type("Result", (), {"metrics": {"train_loss": 1.0}, "global_step": 2})()
            return {f"{kwargs.get('metric_key_prefix', 'eval')}_loss": 1.0} if name == "evaluate" else None

        return record


@pytest.mark.parametrize("push", [False, True])
def test_run_pushes_to_the_hub_or_writes_a_card(tmp_path, push):
    from transformers import TrainingArguments

    from hf_cpt import CPTConfig

    args = TrainingArguments(str(tmp_path), do_train=True, do_eval=True, push_to_hub=push, report_to="none")
    trainer = _RecordingTrainer()
    results = common.run(
        trainer, args, CPTConfig(num_cycles=2), train_dataset=[1, 2, 3], eval_datasets={"eval": [1], "eval_mm": [2]},
        model_card={"finetuned_from": "bert-base-uncased", "dataset": None},
    )  # fmt: skip
    names = [name for name, _ in trainer.calls]
    assert names[:2] == ["train", "save_model"] and names.count("evaluate") == 2
    assert ("push_to_hub" in names) == push and ("create_model_card" in names) == (not push)
    card = dict(trainer.calls)["push_to_hub" if push else "create_model_card"]
    assert card["finetuned_from"] == "bert-base-uncased" and "dataset" not in card and "hf_cpt" in card["tags"]
    assert results["train"]["world_size"] == 1 and results["train"]["train_samples"] == 3
    assert read_json(tmp_path, "cpt_config.json")["num_cycles"] == 2


# ---------------------------------------------------------------------------------------------
# End to end, in subprocesses
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_mnli_jsonl_matched_and_mismatched(assets, tmp_path):
    out = tmp_path / "mnli"
    run_recipe(
        "mnli.py",
        [
            "--config_name", assets["bert_config"], "--tokenizer_name", assets["tokenizer"],
            "--train_file", assets["mnli_train"], "--validation_file", assets["mnli_dev"],
            "--validation_mismatched_file", assets["mnli_dev_mm"],
            "--output_dir", str(out), "--do_train", "--do_eval", "--max_steps", "4",
            "--per_device_train_batch_size", "8", "--max_eval_samples", "10", *QUICK,
        ],  # fmt: skip
    )
    results = check_outputs(out, eval_prefixes=("eval", "eval_mismatched"))
    assert results["eval_samples"] == 10 and results["eval_mismatched_samples"] == 9
    assert results["world_size"] == 1 and results["global_step"] == 4
    config = read_json(out, "config.json")
    assert config["label2id"] == {"entailment": 0, "neutral": 1, "contradiction": 2}


@pytest.mark.slow
def test_mnli_two_processes(assets, tmp_path):
    """Two gloo ranks: world size 2, a global batch of twice the per-device one, half the steps."""
    out = tmp_path / "mnli_ddp"
    run_recipe(
        "mnli.py",
        [
            "--config_name", assets["bert_config"], "--tokenizer_name", assets["tokenizer"],
            "--train_file", assets["mnli_csv"], "--validation_split_percentage", "20",
            "--output_dir", str(out), "--num_train_epochs", "1", "--per_device_train_batch_size", "4",
            "--ddp_find_unused_parameters", "false", *QUICK,
        ],  # fmt: skip
        processes=2,
    )
    results = check_outputs(out)
    assert results["world_size"] == 2
    assert results["total_train_batch_size"] == 2 * results["per_device_train_batch_size"] == 8
    assert results["train_samples"] == 32  # 40 rows, 20% held out
    assert results["global_step"] == math.ceil(32 / 8)  # one epoch over the global batch of 8
    assert results["eval_samples"] == 8


@pytest.mark.slow
def test_clm_from_scratch_on_text_files(assets, tmp_path):
    out = tmp_path / "clm"
    run_recipe(
        "clm.py",
        [
            "--model_type", "gpt2", "--config_overrides", "n_embd=32,n_layer=2,n_head=2,n_positions=64",
            "--tokenizer_name", assets["bpe_tokenizer"], "--train_file", assets["text_train"],
            "--validation_file", assets["text_valid"], "--block_size", "32",
            "--output_dir", str(out), "--max_steps", "4", "--per_device_train_batch_size", "4", *QUICK,
        ],  # fmt: skip
    )
    results = check_outputs(out)
    assert math.isfinite(results["perplexity"]) and results["perplexity"] == pytest.approx(
        math.exp(results["eval_loss"])
    )
    config = read_json(out, "config.json")
    assert (config["n_embd"], config["n_layer"]) == (32, 2)
    from transformers import AutoTokenizer

    assert config["vocab_size"] == len(AutoTokenizer.from_pretrained(assets["bpe_tokenizer"]))


@pytest.mark.slow
def test_vision_timm_wrapper_on_an_image_folder(assets, tmp_path):
    out = tmp_path / "vision"
    run_recipe(
        "vision.py",
        [
            "--model_name_or_path", "test_resnet", "--image_size", "32",
            "--train_dir", os.path.join(assets["images"], "train"),
            "--validation_dir", os.path.join(assets["images"], "val"),
            "--output_dir", str(out), "--max_steps", "3", "--per_device_train_batch_size", "6", *QUICK,
        ],  # fmt: skip
    )
    results = check_outputs(out)
    assert results["train_samples"] == 18 and results["eval_samples"] == 9
    config = read_json(out, "config.json")
    assert config["architecture"] == "test_resnet" and config["num_classes"] == 3
    assert sorted(config["label_names"]) == ["blue", "green", "red"]


@pytest.mark.slow
def test_vision_plain_timm_vit_with_accelerate_launch(assets, tmp_path):
    out = tmp_path / "vit"
    run_recipe(
        "vision.py",
        [
            "--model_name_or_path", "test_vit", "--timm_wrapper", "none", "--image_size", "32",
            "--train_dir", os.path.join(assets["images"], "train"), "--validation_split_percentage", "25",
            "--output_dir", str(out), "--max_steps", "3", "--per_device_train_batch_size", "4", *QUICK,
        ],  # fmt: skip
        processes=1,
    )
    results = check_outputs(out)
    assert results["eval_samples"] == 5  # 25% of the 18 training images
    cost = read_json(out, "cpt_cost_report.json")
    assert cost["cost_vs_fp32"] < 1


@pytest.mark.slow
def test_mnli_offline_command_on_shared_data(tmp_path):
    """The README's offline MNLI command, shortened: dev.jsonl split into train / validation."""
    data = os.path.join(SHARED_DATA, "mnli", "dev.jsonl")
    if not os.path.isfile(data):
        pytest.skip("../shared/data is not present on this machine")
    tokenizer = str(tmp_path / "tokenizer")
    tokenizer_recipe.train_tokenizer([data], tokenizer, vocab_size=2000, columns=["premise", "hypothesis"])
    out = tmp_path / "mnli_shared"
    run_recipe(
        "mnli.py",
        [
            "--model_type", "bert", "--tokenizer_name", tokenizer,
            "--config_overrides", "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64",
            "--train_file", data, "--validation_split_percentage", "18", "--max_train_samples", "64",
            "--max_eval_samples", "32", "--max_seq_length", "64",
            "--output_dir", str(out), "--max_steps", "4", "--per_device_train_batch_size", "16", *QUICK,
        ],  # fmt: skip
    )
    results = check_outputs(out)
    assert results["eval_samples"] == 32


def test_a_launch_whose_processes_do_not_join_one_run_is_refused(tmp_path, monkeypatch):
    """Accelerate's FSDP plugin on a CPU-only machine starts 2 processes with WORLD_SIZE=2 in their
    environment whose training arguments each see world size 1 (measured with `accelerate launch`);
    the recipes refuse to run them as independent single processes."""
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert args.world_size == 1
    monkeypatch.setenv("WORLD_SIZE", "2")  # what the launcher exported to each process
    with pytest.raises(RuntimeError, match="Launched as 2 processes, but the training arguments see a world size of 1"):
        common.setup(args)


def test_accelerate_fsdp_plugin_on_a_cpu_machine_is_refused(tmp_path, monkeypatch):
    from transformers import TrainingArguments

    if common._accelerator_available():
        pytest.skip("this machine has an accelerator: the FSDP plugin can run")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(RuntimeError, match="FSDP plugin does not run on a machine without GPU"):
        common.setup(args)


def test_make_demo_trains_the_three_runs_side_by_side(tmp_path):
    """`make demo` (the README's first command): FP32, static 8-bit and CPT on the same data, with their cost."""
    result = run_recipe("demo.py", ["--output_dir", str(tmp_path), "--epochs", "2"])
    assert "CPT 3-8 / 8" in result.stdout
    runs = json.load(open(tmp_path / "results.json"))["runs"]
    assert list(runs) == ["FP32", "static 8-bit", "CPT 3-8 / 8"]
    assert runs["CPT 3-8 / 8"]["gbitops"] < runs["static 8-bit"]["gbitops"] < runs["FP32"]["gbitops"]
    assert all(0.0 <= run["accuracy"] <= 1.0 for run in runs.values())
    assert (tmp_path / "cpt_schedule.png").stat().st_size > 1000
