#!/usr/bin/env python
"""Image classification with timm models and Cyclic Precision Training.

    python recipes/vision.py --output_dir outputs/cifar10                  # CIFAR-10 + resnet18
    accelerate launch recipes/vision.py --output_dir outputs/cifar10 ...   # one or several processes

``--model_name_or_path`` is a timm architecture (``resnet18``, ``vit_tiny_patch16_224``, ...; add
``--pretrained`` for timm's pretrained weights), a Hub repository (``timm/resnet18.a1_in1k``) or a
saved model folder. Data: a Hub dataset (``uoft-cs/cifar10``, ``uoft-cs/cifar100``) or image folders
``--train_dir`` / ``--validation_dir`` with one sub-folder per class. Images go through timm's
transforms for the model (``--image_size`` changes the input size); evaluation reports accuracy.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import common
import datasets
import timm
import torch
from timm.data import create_transform, resolve_data_config
from torch import nn
from transformers import AutoModelForImageClassification, TimmWrapperConfig, TimmWrapperForImageClassification
from transformers.modeling_outputs import ImageClassifierOutput

from hf_cpt import CPTTrainer

logger = logging.getLogger("hf_cpt.recipes.vision")

DEFAULT_MODEL = "resnet18"
DEFAULT_DATASET = ("uoft-cs/cifar10", None)


@dataclass
class VisionModelArguments(common.ModelArguments):
    pretrained: bool = field(
        default=False,
        metadata={"help": "Start from timm's pretrained weights for an architecture name (needs the Hub)."},
    )
    timm_wrapper: str = field(
        default="transformers",
        metadata={
            "help": "How to hold a timm architecture: 'transformers' (TimmWrapperForImageClassification: "
            "save_pretrained / push_to_hub as a transformers model) or 'none' (the plain timm module)."
        },
    )
    drop_path_rate: float | None = field(default=None, metadata={"help": "timm stochastic depth rate."})


@dataclass
class VisionDataArguments(common.DataArguments):
    train_dir: str | None = field(
        default=None, metadata={"help": "Image folder for training (one sub-folder a class)."}
    )
    validation_dir: str | None = field(default=None, metadata={"help": "Image folder for evaluation."})
    image_column_name: str | None = field(
        default=None, metadata={"help": "Column of the images (default: the first image column)."}
    )
    label_column_name: str | None = field(
        default=None, metadata={"help": "Column of the labels (default: the first class-label column)."}
    )
    image_size: int | None = field(
        default=None, metadata={"help": "Input resolution (default: the model's, e.g. 224); e.g. 32 for CIFAR."}
    )

    @property
    def has_local_files(self) -> bool:
        return bool(self.train_dir or self.validation_dir or self.train_file or self.validation_file)


class TimmClassifier(nn.Module):
    """A plain timm model with the Trainer's interface: ``forward(pixel_values, labels)``."""

    def __init__(self, timm_model: nn.Module) -> None:
        super().__init__()
        self.timm_model = timm_model

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> ImageClassifierOutput:
        logits = self.timm_model(pixel_values)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return ImageClassifierOutput(loss=loss, logits=logits)


def load_data(data_args: VisionDataArguments, model_args: VisionModelArguments) -> datasets.DatasetDict:
    if data_args.train_dir or data_args.validation_dir:
        files = {
            split: os.path.join(folder, "**")
            for split, folder in (("train", data_args.train_dir), ("validation", data_args.validation_dir))
            if folder
        }
        for folder in (data_args.train_dir, data_args.validation_dir):
            if folder and not os.path.isdir(folder):
                raise FileNotFoundError(f"Image folder {folder} does not exist.")
        raw = datasets.load_dataset("imagefolder", data_files=files, cache_dir=model_args.cache_dir)
    elif data_args.train_file or data_args.validation_file:
        raise ValueError("Images come from --train_dir / --validation_dir folders or a --dataset_name.")
    else:
        raw = common.load_hub_dataset(data_args, model_args, DEFAULT_DATASET)
        if "validation" not in raw and "test" in raw:
            raw["validation"] = raw.pop("test")  # CIFAR-10/100 on the Hub: train / test
    return common.ensure_validation_split(raw, data_args)


def find_column(features: datasets.Features, wanted: str | None, kind: type, what: str) -> str:
    if wanted is not None:
        if wanted not in features:
            raise ValueError(f"No column {wanted!r}; columns: {list(features)}.")
        return wanted
    for name, feature in features.items():
        if isinstance(feature, kind):
            return name
    raise ValueError(f"No {what} column among {list(features)}; name it with --{what}_column_name.")


def build_model(model_args: VisionModelArguments, data_args: VisionDataArguments, labels: list[str]) -> nn.Module:
    """A timm model by architecture name (wrapped as asked), or a pretrained transformers model."""
    label2id, id2label = {name: i for i, name in enumerate(labels)}, dict(enumerate(labels))
    name = model_args.model_name_or_path
    if name not in timm.list_models() and (os.path.isdir(name) or "/" in name):  # Hub repo or saved folder
        if model_args.timm_wrapper != "transformers":
            raise ValueError("--timm_wrapper none needs a timm architecture name as --model_name_or_path.")
        return AutoModelForImageClassification.from_pretrained(
            name,
            num_labels=len(labels),
            label2id=label2id,
            id2label=id2label,
            ignore_mismatched_sizes=True,  # a new head for these classes
            **model_args.hub_kwargs(),
        )
    timm_kwargs = {}
    if data_args.image_size is not None and _accepts_img_size(name):
        timm_kwargs["img_size"] = data_args.image_size  # ViTs: position embeddings for this size
    if model_args.drop_path_rate is not None:
        timm_kwargs["drop_path_rate"] = model_args.drop_path_rate
    if model_args.timm_wrapper == "transformers":
        config = TimmWrapperConfig(
            architecture=name, num_labels=len(labels), label2id=label2id, id2label=id2label, model_args=timm_kwargs
        )
        model = TimmWrapperForImageClassification(config)
        timm_model = model.timm_model
    elif model_args.timm_wrapper == "none":
        timm_model = timm.create_model(name, pretrained=False, num_classes=len(labels), **timm_kwargs)
        model = TimmClassifier(timm_model)
    else:
        raise ValueError(f"--timm_wrapper must be 'transformers' or 'none', got {model_args.timm_wrapper!r}.")
    if model_args.pretrained:
        source = timm.create_model(name, pretrained=True, num_classes=len(labels), **timm_kwargs)
        timm_model.load_state_dict(source.state_dict())
        logger.info("Loaded timm's pretrained weights of %s (new %d-class head)", name, len(labels))
    logger.info("%s: %.2fM parameters", name, sum(p.numel() for p in model.parameters()) / 1e6)
    return model


def _accepts_img_size(name: str) -> bool:
    try:
        with torch.device("meta"):
            timm.create_model(name, pretrained=False, img_size=224)
        return True
    except TypeError:
        return False


def transforms_for(model: nn.Module, data_args: VisionDataArguments):
    """timm's train and eval transforms for this model (``--image_size`` overrides its input size)."""
    timm_model = getattr(model, "timm_model", model)
    data_config = resolve_data_config({}, model=timm_model)
    if data_args.image_size is not None:
        data_config["input_size"] = (3, data_args.image_size, data_args.image_size)
    logger.info("timm data config: %s", data_config)
    return create_transform(**data_config, is_training=True), create_transform(**data_config, is_training=False)


def main():
    model_args, data_args, cpt_config, training_args = common.parse_arguments(VisionModelArguments, VisionDataArguments)
    common.setup(training_args)
    model_args.resolve_default(DEFAULT_MODEL)
    if training_args.push_to_hub and model_args.timm_wrapper != "transformers":
        raise ValueError("--push_to_hub needs --timm_wrapper transformers (a plain timm module has no config).")
    if not model_args.model_name_or_path:
        raise ValueError("--model_name_or_path names the timm architecture (e.g. resnet18) or a model repository.")

    raw = load_data(data_args, model_args)
    features = next(iter(raw.values())).features
    image_column = find_column(features, data_args.image_column_name, datasets.Image, "image")
    label_column = find_column(features, data_args.label_column_name, datasets.ClassLabel, "label")
    labels = features[label_column].names
    logger.info("%d classes: %s", len(labels), labels)

    model = build_model(model_args, data_args, labels)
    train_transform, eval_transform = transforms_for(model, data_args)

    def transform_with(transform):
        def apply(batch):
            return {
                "pixel_values": [transform(image.convert("RGB")) for image in batch[image_column]],
                "labels": batch[label_column],
            }

        return apply

    splits = {}
    if "train" in raw:
        splits["train"] = common.truncate(raw["train"], data_args.max_train_samples)
        splits["train"].set_transform(transform_with(train_transform))
    if "validation" in raw:
        splits["validation"] = common.truncate(raw["validation"], data_args.max_eval_samples)
        splits["validation"].set_transform(transform_with(eval_transform))

    def collate(examples):
        return {
            "pixel_values": torch.stack([e["pixel_values"] for e in examples]),
            "labels": torch.tensor([e["labels"] for e in examples]),
        }

    training_args.remove_unused_columns = False  # the transforms read the image column on the fly
    trainer = CPTTrainer(
        model=model,
        args=training_args,
        train_dataset=splits.get("train") if training_args.do_train else None,
        eval_dataset=splits.get("validation") if training_args.do_eval else None,
        data_collator=collate,
        compute_metrics=common.accuracy_metrics(),
        cpt_config=cpt_config,
    )
    common.run(
        trainer,
        training_args,
        cpt_config,
        train_dataset=splits.get("train"),
        eval_datasets={"eval": splits["validation"]} if "validation" in splits else {},
        model_card={
            "finetuned_from": model_args.model_name_or_path if model_args.pretrained else None,
            "tasks": "image-classification",
            "dataset": data_args.dataset_name or (None if data_args.has_local_files else "cifar10"),
        },
        # CPTTrainer's quantized checkpoints are transformers checkpoints; a plain timm module keeps its
        # FP32 master weights (model.safetensors, keys prefixed "timm_model.").
        save_kwargs={"save_format": "fp32"} if isinstance(model, TimmClassifier) else None,
    )


if __name__ == "__main__":
    main()
