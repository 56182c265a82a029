"""`CPTTrainer`: a drop-in `transformers.Trainer` that trains with CPT and saves quantized checkpoints."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel, Trainer
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_utils import get_last_checkpoint

from ..config import CPTConfig
from ..convert import QuantizationReport, find_precision_state, is_quantized, layer_settings_changed, quantize_model
from ..numerics.bits import check_bits
from ..serialization.compressed_tensors import check_compressed_tensors, write_compressed_tensors
from ..serialization.export import packed_state_dict, portable_state_dict, resolve_export_bits
from ..serialization.format import MAX_EXPORT_BITS, CheckpointFields, check_export_bits, check_float_weight_bits
from ..serialization.model_card import eval_metrics_from_log_history, write_model_card
from ..serialization.save import plain_model, staged_save, write_checkpoint
from .callback import CPTCallback

logger = logging.getLogger(__name__)

SAVE_FORMATS = ("packed", "portable", "compressed-tensors", "fp32")


@dataclass(frozen=True)
class ExportSettings:
    """What `CPTTrainer.save_model` and `push_to_hub` write: "packed" (integer CPT checkpoint), "portable" (float
    weights on the grid, loads anywhere), "compressed-tensors" (`hf_cpt.export_compressed_tensors`) or "fp32" (the
    FP32 master weights); the export precision (None: the
    run's ``bits_max``) and the storage of weights trained in FP32 (None: exact; "auto" or a bit-width rounds
    them, measured: `hf_cpt.save_quantized`)."""

    save_format: str = "packed"
    bits: int | None = None
    float_weight_bits: int | str | None = None

    def __post_init__(self) -> None:
        if self.save_format not in SAVE_FORMATS:
            raise ValueError(f"save_format must be one of {SAVE_FORMATS}, got {self.save_format!r}.")
        if self.save_format == "compressed-tensors":
            check_compressed_tensors()
        check_export_bits("bits", self.bits, allow_none=True)
        check_float_weight_bits(self.float_weight_bits)


class CPTTrainer(Trainer):
    """`transformers.Trainer` that trains with Cyclic Precision Training.

    Replace ``Trainer(`` by ``CPTTrainer(`` and pass ``cpt_config=CPTConfig(...)``; every other
    argument is passed through unchanged. Layers are converted before the optimizer and
    ``accelerator.prepare`` exist.
    """

    def __init__(self, model=None, args=None, *trainer_args, cpt_config: CPTConfig | None = None, **kwargs):
        self.cpt_config = cpt_config if cpt_config is not None else CPTConfig()
        self.cpt_report: QuantizationReport | None = None
        self.cpt_precision_profile: list[dict[str, Any]] | None = None  # set by evaluate_precisions
        if model is not None:
            self.cpt_report = self._quantize(model)
        model_init = kwargs.get("model_init")
        if model_init is not None:
            def quantized_model_init(*init_args):
                fresh = model_init(*init_args)
                self.cpt_report = self._quantize(fresh)
                return fresh

            kwargs["model_init"] = quantized_model_init
        self._cpt_push_export: dict[str, Any] | None = None  # push_to_hub's export options, for its save_model
        self._cpt_last_export: tuple[str | None, CheckpointFields | None] = (None, None)  # (directory, fields)
        unexportable = self._cpt_unexportable_bits_max()
        if self.cpt_save_format != "fp32" and unexportable:
            logger.warning(
                "CPTTrainer: %s; save_model() and push_to_hub() will write the FP32 master weights (or pass "
                "bits=<1..%d> to export at that precision).", unexportable, MAX_EXPORT_BITS,
            )
        self.cpt_callback = CPTCallback(self.cpt_config)
        self.cpt_callback.logs_injected_by_trainer = self.cpt_callback.trainer_saves_quantized = True
        kwargs["callbacks"] = [self.cpt_callback] + list(kwargs.get("callbacks") or [])
        super().__init__(model, args, *trainer_args, **kwargs)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """`transformers.Trainer.train`; a resumed run's callback reads its own files (activation ranges, cost)
        from the checkpoint resumed from, wherever it is."""
        checkpoint = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        if resume_from_checkpoint is True and os.path.isdir(self.args.output_dir):  # none found: the Trainer's error
            checkpoint = get_last_checkpoint(self.args.output_dir)
        self.cpt_callback.resume_checkpoint = checkpoint
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _quantize(self, model: nn.Module) -> QuantizationReport | None:
        if is_quantized(model):  # converted by the user, e.g. before get_peft_model: with this very numerics
            changed = layer_settings_changed(model, self.cpt_config)
            if changed:
                raise ValueError(f"CPTTrainer: the model was quantized with another CPTConfig ({changed}, as "
                                 "{name: (then, now)}): its layers would compute by the first while the run records "
                                 "the second. Quantize it with cpt_config, or pass the model unquantized.")
            return None
        report = quantize_model(model, self.cpt_config)
        logger.info("%s", report)
        return report

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        logs.update(self.cpt_callback.log_values(logs))
        super().log(logs, *args, **kwargs)

    def evaluate_precisions(
        self, bits: list[int | None] | None = None, eval_dataset=None, metric_key_prefix: str = "eval"
    ) -> list[dict[str, Any]]:
        """Evaluate the model at several precisions; one row ``{"bits": b or "fp32", <metrics>}`` per precision.

        ``bits`` defaults to every integer from ``bits_min`` to ``bits_max`` and FP32 (None). The eval
        precision is restored afterwards. The table is kept as ``self.cpt_precision_profile`` and written
        into the model card by `save_model` / `push_to_hub`, to pick a deployment precision from.
        """
        if bits is None:
            schedule = self.cpt_callback.schedule
            low = schedule.bits_min if schedule is not None else self.cpt_config.bits_min
            low = self.cpt_config.bits_max if not isinstance(low, int) else low
            bits = list(range(low, self.cpt_config.bits_max + 1)) + [None]
        precision = find_precision_state(self._cpt_unwrapped())
        rows = []
        for b in bits:
            if b is not None:
                check_bits("evaluate_precisions: bits (or None)", b)
            label = "fp32" if b is None else f"{b}bit"
            with precision.evaluating_at(b):
                metrics = self.evaluate(eval_dataset, metric_key_prefix=f"{metric_key_prefix}_{label}")
            prefix = f"{metric_key_prefix}_{label}_"
            rows.append({"bits": "fp32" if b is None else b,
                         **{k[len(prefix):]: v for k, v in metrics.items() if k.startswith(prefix)}})
        self.cpt_precision_profile = rows
        return rows

    # -- saving: quantized checkpoints (hf_cpt.serialization) -------------------------------------
    #: What `save_model` and `push_to_hub` write by default (`ExportSettings`; set on the trainer or a subclass):
    #: "packed" (integer CPT checkpoint), "portable" (float weights on the grid, loads anywhere) or "fp32".
    cpt_save_format: str = "packed"
    #: Export precision (None: ``cpt_config.bits_max``) and storage of the weights trained in FP32.
    cpt_save_bits: int | None = None
    cpt_float_weight_bits: Any = None  # exact; "auto" or a bit-width rounds FP32-trained weights (measured)

    @property
    def cpt_export(self) -> ExportSettings:
        """The export defaults as one validated record (from the three attributes above)."""
        return ExportSettings(self.cpt_save_format, self.cpt_save_bits, self.cpt_float_weight_bits)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False, **export: Any) -> None:
        """Save the trained model for use, with its tokenizer / image processor and a model card: ``export``
        overrides the `ExportSettings` for this call ("packed" at ``cpt_config.bits_max`` by default; a model that
        cannot be exported, e.g. a peft model or an FP32 run, as "fp32"). Checkpoints the Trainer writes to resume
        from always hold the FP32 master weights with plain keys (docs/checkpoints.md)."""
        if _internal_call and self._cpt_push_export is None:
            with self._cpt_plain_model():
                super().save_model(output_dir, _internal_call=True)
            return
        unknown = sorted(set(export) - {f.name for f in dataclasses.fields(ExportSettings)})
        if unknown:
            raise TypeError(f"CPTTrainer.save_model: unknown export option(s) {unknown}; see hf_cpt ExportSettings.")
        given = {**(self._cpt_push_export or {}), **export}
        settings = dataclasses.replace(self.cpt_export, **given)  # validated before any work
        save_format = given.get("save_format") or self._cpt_default_save_format(settings.save_format)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if save_format == "fp32":
            staged = staged_save(output_dir) if self.args.should_save else contextlib.nullcontext(output_dir)
            with self._cpt_plain_model(), staged as target:
                super().save_model(target, _internal_call=True)
            fields = None
        else:
            fields = self._cpt_export(output_dir, save_format, settings.bits, settings.float_weight_bits)
        self._cpt_last_export = (output_dir, fields)
        if self.args.should_save:
            self._cpt_write_card(output_dir, fields)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision, save_format=save_format,
                             bits=settings.bits, float_weight_bits=settings.float_weight_bits)

    def push_to_hub(self, *args, save_format: str | None = None, bits: int | None = None, **kwargs):
        """`Trainer.push_to_hub`, uploading the checkpoint `save_model` writes (packed by default) and its model card.

        ``save_format``, ``bits`` and ``float_weight_bits`` are `save_model`'s (`ExportSettings`); other
        arguments are `Trainer.push_to_hub`'s, which saves through ``save_model(_internal_call=True)``.
        """
        export = {key: value for key, value in (("save_format", save_format), ("bits", bits)) if value is not None}
        if "float_weight_bits" in kwargs:  # None is a value here: exact float weights
            export["float_weight_bits"] = kwargs.pop("float_weight_bits")
        dataclasses.replace(self.cpt_export, **export)  # validated before any upload work
        self._cpt_push_export = export
        try:
            return super().push_to_hub(*args, **kwargs)
        finally:
            self._cpt_push_export = None

    def create_model_card(self, language=None, license=None, tags=None, model_name=None, finetuned_from=None,
                          tasks=None, dataset_tags=None, dataset=None, dataset_args=None, **kwargs) -> None:
        """Write the CPT model card (README.md) into ``args.output_dir``: settings, schedule, cost, metrics."""
        if not isinstance(self._cpt_unwrapped(), PreTrainedModel):  # peft or plain torch models: Trainer's card
            return super().create_model_card(language=language, license=license, tags=tags, model_name=model_name,
                finetuned_from=finetuned_from, tasks=tasks, dataset_tags=dataset_tags, dataset=dataset,
                dataset_args=dataset_args)
        if not self.is_world_process_zero():
            return
        output_dir, fields = self._cpt_last_export
        fields = fields if output_dir == self.args.output_dir else None
        os.makedirs(self.args.output_dir, exist_ok=True)
        metadata = {"license": license, "language": language, "base_model": finetuned_from,
                    "datasets": dataset_tags or dataset, "pipeline_tag": tasks if isinstance(tasks, str) else None}
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        self._cpt_write_card(self.args.output_dir, fields, model_name=model_name, tags=tags, metadata=metadata)

    # helpers
    def _cpt_unwrapped(self) -> nn.Module:
        try:
            return self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        except TypeError:  # older accelerate
            return self.accelerator.unwrap_model(self.model)

    def _cpt_plain_model(self):
        return plain_model(self._cpt_unwrapped())

    def _cpt_unexportable_bits_max(self) -> str | None:
        """Why the default export precision (``bits_max``) cannot be stored, or None when it can."""
        if self.cpt_save_bits is None and self.cpt_config.bits_max > MAX_EXPORT_BITS:
            bits_max = self.cpt_config.bits_max
            return f"CPTConfig.bits_max={bits_max} is above the {MAX_EXPORT_BITS} bits a CPT checkpoint stores"
        return None

    def _cpt_default_save_format(self, save_format: str) -> str:
        """``save_format``, or "fp32" where a quantized export cannot apply (said in the log)."""
        if save_format == "fp32":
            return "fp32"
        model = self._cpt_unwrapped()
        reason = None
        if self.cpt_config.schedule == "fp32":
            reason = "the run trained in full precision (schedule='fp32')"
        elif unexportable := self._cpt_unexportable_bits_max():
            reason = unexportable
        elif not isinstance(model, PreTrainedModel):
            reason = f"{type(model).__name__} is not a transformers PreTrainedModel (e.g. a peft or plain torch model)"
        elif not is_quantized(model):
            reason = "the model has no CPT layers"
        if reason is None:
            return save_format
        logger.info("CPTTrainer.save_model: saving the FP32 master weights: %s.", reason)
        return "fp32"

    def _cpt_export(self, output_dir: str, save_format: str, bits, float_weight_bits) -> dict | None:
        if self.is_fsdp_enabled or getattr(self, "is_deepspeed_enabled", False):
            raise NotImplementedError(
                f"CPTTrainer.save_model(save_format={save_format!r}) needs the whole model on one process; with "
                "FSDP / DeepSpeed, save with save_format='fp32' and export with hf_cpt.save_quantized afterwards."
            )
        if not self.args.should_save:
            return None
        model = self._cpt_unwrapped()
        bits = resolve_export_bits(model, bits, self.cpt_config)
        if save_format == "packed":
            inputs = self._cpt_measure_inputs(model) if float_weight_bits is not None else None
            state_dict, fields = packed_state_dict(model, bits, float_weight_bits, self.cpt_config, inputs)
        elif save_format == "portable":
            state_dict, fields = portable_state_dict(model, bits, self.cpt_config)
        with staged_save(output_dir) as staging:
            if save_format == "compressed-tensors":
                inputs = self._cpt_measure_inputs(model)
                fields = write_compressed_tensors(model, staging, bits, self.cpt_config, inputs)
            else:
                write_checkpoint(model, staging, state_dict, fields)
            processing_class = self.processing_class
            if processing_class is None:
                processing_class = getattr(self.data_collator, "tokenizer", None)
            if processing_class is not None:
                processing_class.save_pretrained(staging)
            torch.save(self.args, os.path.join(staging, TRAINING_ARGS_NAME))
        return fields

    def _cpt_measure_inputs(self, model: nn.Module) -> dict | None:
        """A batch of the evaluation data (on the model's device) to measure a lossy export on, if there is one."""
        if self.eval_dataset is None or isinstance(self.eval_dataset, dict):
            return None
        try:
            batch = next(iter(self.get_eval_dataloader()))
        except Exception as error:  # measuring falls back to random inputs; never fail a save for it
            logger.info("hf_cpt: no evaluation batch to measure the export on (%s).", error)
            return None
        device = next(model.parameters()).device
        return {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}

    def _cpt_write_card(self, output_dir: str, fields: dict | None, **card) -> None:
        if not isinstance(self._cpt_unwrapped(), PreTrainedModel):
            return  # not a transformers checkpoint: no model card of ours

        callback = self.cpt_callback
        cost_report = None
        if callback.meter is not None:
            try:
                cost_report = callback.cost_report()
            except Exception as error:  # the card must not fail a save
                logger.warning("hf_cpt: no cost figures in the model card (%s).", error)
        total_steps = self.state.max_steps if self.state.max_steps and self.state.max_steps > 0 else None
        args = self.args
        hyperparameters = {"learning_rate": args.learning_rate, "train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "optimizer": str(getattr(args.optim, "value", args.optim)),
            "lr_scheduler_type": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
            "num_train_epochs": args.num_train_epochs, "max_steps": total_steps, "seed": args.seed}
        write_model_card(output_dir, self._cpt_unwrapped(), fields, cpt_config=self.cpt_config, total_steps=total_steps,
            schedule=callback.schedule, grad_schedule=getattr(callback, "grad_schedule", None),
            model_name=card.pop("model_name", None) or os.path.basename(os.path.abspath(output_dir)),
            cost_report=cost_report, eval_metrics=eval_metrics_from_log_history(self.state.log_history),
            repo_id=getattr(self, "hub_model_id", None), training_hyperparameters=hyperparameters,
            precision_profile=self.cpt_precision_profile, **card)
