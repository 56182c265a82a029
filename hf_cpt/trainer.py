"""Trainer integration: `CPTCallback` drives the schedule, `CPTTrainer` is a drop-in `Trainer`."""

from __future__ import annotations

import inspect
import json
import logging
import os
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel, Trainer, TrainerCallback
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_callback import CallbackHandler
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .bits import check_bits
from .checkpoint import plain_model, write_checkpoint
from .config import CPTConfig
from .cost import CostMeter
from .export import packed_state_dict, portable_state_dict, resolve_export_bits
from .fidelity import output_fidelity
from .layers import PrecisionState
from .model_card import eval_metrics_from_log_history, write_model_card
from .packing import MAX_EXPORT_BITS
from .prt import PrecisionRangeResult, rng_state, run_precision_range_test_for_trainer, set_rng_state, to_device
from .schedules import PrecisionSchedule, grad_schedule_from_config, schedule_from_config, training_precision
from .surgery import (
    QuantizationReport,
    activation_ranges,
    find_precision_state,
    is_quantized,
    load_activation_ranges,
    quantize_model,
)

logger = logging.getLogger(__name__)

COST_REPORT_FILE = "cpt_cost_report.json"
# Written into each Trainer checkpoint: the eval-mode activation ranges are buffers outside state_dict.
ACTIVATION_RANGES_FILE = "cpt_activation_ranges.safetensors"
# Also in each Trainer checkpoint: the cost meter's totals, so a resumed run reports the whole run's cost.
COST_STATE_FILE = "cpt_cost_state.json"


class CPTCallback(TrainerCallback):
    """Sets the CPT precision at every optimizer step of a `transformers.Trainer` run.

    The bits are a pure function of ``state.global_step`` and ``state.max_steps``, so gradient
    accumulation (one setting per optimizer step) and resuming from a checkpoint are right. The
    model must have been converted with `hf_cpt.quantize_model` before the Trainer was created.
    ``cpt/bits``, ``cpt/grad_bits`` and the cost figures are added to the Trainer's logs.
    """

    def __init__(self, config: CPTConfig | None = None) -> None:
        self.config = config if config is not None else CPTConfig()
        self.schedule: PrecisionSchedule | None = None
        self.grad_schedule: PrecisionSchedule | None = None  # None: fixed config.grad_bits
        self.prt_result: PrecisionRangeResult | None = None  # set when bits_min="auto"
        self.precision: PrecisionState | None = None
        self.meter: CostMeter | None = None
        self.bits: int | None = None
        self.grad_bits: int | None = None
        self.logs_injected_by_trainer = False  # CPTTrainer adds the values in Trainer.log itself
        self.fidelity: dict[int, float] | None = None  # output fidelity at bits_min on the first batch

    # -- schedule -----------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model: nn.Module | None = None, **kwargs):
        if model is None or not is_quantized(model):
            raise ValueError(
                "CPTCallback: the model has no CPT layers. Call hf_cpt.quantize_model(model, config) before "
                "creating the Trainer (so the optimizer and accelerator see the quantized layers), or use "
                "hf_cpt.CPTTrainer."
            )
        self.precision = find_precision_state(model)
        bits_min = None
        if self.config.bits_min == "auto":  # precision range test (docs/method.md §6), before the meter starts
            self.prt_result = run_precision_range_test_for_trainer(
                self.config, args, state, model, kwargs.get("train_dataloader"), kwargs.get("optimizer")
            )
            bits_min = self.prt_result.bits_min
        self.schedule = schedule_from_config(self.config, state.max_steps, bits_min=bits_min)
        self.grad_schedule = grad_schedule_from_config(self.config, state.max_steps)
        self.precision.set_eval(self.config.eval_precision, follow_training=self.config.eval_bits == "current")
        quantized_run = self.config.schedule != "fp32"
        if state.global_step == 0 and self.config.fidelity_threshold is not None and quantized_run:
            visited = [b for b in self.schedule.steps_at_bits() if b is not None]
            if visited:  # the lowest precision the run will actually train at
                self.fidelity = check_fidelity_at_start(model, kwargs.get("train_dataloader"), min(visited),
                                                        self.config)
        static_bits = self.config.bits_max if quantized_run else None
        if self.meter is not None:
            self.meter.remove()
        static_grad_bits = self.config.grad_bits if quantized_run else None  # an FP32 run's "static" is FP32
        self.meter = CostMeter(model, static_bits, static_grad_bits, scale=max(1, args.world_size))
        self._set_bits(state.global_step)
        if state.global_step > 0:
            self._restore_activation_ranges(args, state, model)
            self._restore_cost(args, state)
        if not self.logs_injected_by_trainer:
            self._log_before_reporting_integrations()

    def _set_bits(self, step: int) -> None:
        grad_bits = self.grad_schedule if self.grad_schedule is not None else self.config.grad_bits
        self.bits, self.grad_bits = training_precision(self.schedule(step), grad_bits, step)
        self.precision.set(self.bits, self.grad_bits)

    def on_save(self, args, state, control, model: nn.Module | None = None, **kwargs):
        checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if state.is_world_process_zero and model is not None and os.path.isdir(checkpoint):
            save_file(activation_ranges(model), os.path.join(checkpoint, ACTIVATION_RANGES_FILE))
            if self.meter is not None:
                with open(os.path.join(checkpoint, COST_STATE_FILE), "w") as f:
                    json.dump(self.meter.totals.state_dict(), f)

    def _restore_cost(self, args, state) -> None:
        path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}", COST_STATE_FILE)
        if os.path.isfile(path):
            with open(path) as f:
                self.meter.totals.load_state_dict(json.load(f))
        else:
            logger.warning("hf_cpt: no %s to resume from; the cost report covers only the steps after the resume.",
                           path)

    @staticmethod
    def _restore_activation_ranges(args, state, model: nn.Module) -> None:
        # Resuming: the Trainer restored weights and state; the running ranges come from our own file.
        path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}", ACTIVATION_RANGES_FILE)
        if os.path.isfile(path):
            load_activation_ranges(model, load_file(path))
        else:
            logger.info("hf_cpt: no %s to resume from; eval-mode activation ranges start afresh.", path)

    def on_step_begin(self, args, state, control, **kwargs):
        self._set_bits(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self.meter.end_step(self.bits, self.grad_bits)

    # -- logging ------------------------------------------------------------------------------
    def log_values(self, logs: dict[str, Any]) -> dict[str, float]:
        """The CPT values to add to a training log entry (none for evaluation logs)."""
        if self.meter is None or not any(k == "loss" or k.startswith("train_") for k in logs):
            return {}
        values = {
            "cpt/bits": float(self.bits) if self.bits is not None else 32.0,
            "cpt/grad_bits": float(self.grad_bits) if self.grad_bits is not None else 32.0,
        }
        values.update(self.meter.totals.as_logs())
        if any(k.startswith("train_") for k in logs):  # the run's final summary: the full cost report
            values["cpt/static_gbitops"] = self.meter.totals.static_bitops / 1e9
            values["cpt/fp32_gbitops"] = self.meter.totals.fp32_bitops / 1e9
            values["cpt/bits_min"] = float(self.schedule.bits_min)
            if self.prt_result is not None:
                values["cpt/prt_steps"] = float(self.prt_result.steps)
        return values

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.logs_injected_by_trainer or logs is None:
            return
        values = self.log_values(logs)
        logs.update(values)
        if state.log_history:
            state.log_history[-1].update(values)

    def _log_before_reporting_integrations(self) -> None:
        # Values added in on_log reach only the callbacks after this one, and Trainer registers the
        # report_to integrations (TensorBoard, W&B, ...) first; so move this callback to the front.
        frame = inspect.currentframe()
        while frame is not None:
            handler = frame.f_locals.get("self")
            if isinstance(handler, CallbackHandler):
                if self in handler.callbacks:
                    handler.callbacks.remove(self)
                    handler.callbacks.insert(0, self)
                return
            frame = frame.f_back
        logger.warning("CPTCallback: could not reach the callback handler; CPT values reach the console only.")

    # -- end of training ----------------------------------------------------------------------
    def on_train_end(self, args, state, control, **kwargs):
        if self.meter is None:
            return
        report = self.cost_report()
        if state.is_world_process_zero:
            logger.warning(format_cost_report(report))
            if args.output_dir:
                os.makedirs(args.output_dir, exist_ok=True)
                with open(os.path.join(args.output_dir, COST_REPORT_FILE), "w") as f:
                    json.dump(report, f, indent=2)
        self.meter.remove()

    def cost_report(self) -> dict[str, Any]:
        """The run's cost figures and CPT settings, as written to ``cpt_cost_report.json``."""
        report = {"cpt_config": self.config.to_dict(), **self.meter.totals.to_dict()}
        report["bits_min"] = self.schedule.bits_min  # the bound trained with (the PRT's choice for "auto")
        if self.prt_result is not None:
            report["prt"] = self.prt_result.to_dict()
        return report


def check_fidelity_at_start(model: nn.Module, dataloader, bits_min: int, config: CPTConfig) -> dict[int, float] | None:
    """Measure the output fidelity at ``bits_min`` (the run's lowest precision) on the first training batch;
    warn when it is low.

    The data order and every random number generator are left as they were, so the run is unchanged.
    """
    if dataloader is None:
        return None
    rng = rng_state()
    try:
        batch = to_device(next(iter(dataloader)), next(model.parameters()).device)
        fidelity = output_fidelity(model, batch, bits_min)
    except Exception as error:  # the check must never stop a run (an empty loader, an unusual batch)
        logger.info("hf_cpt: output fidelity check skipped (%s: %s).", type(error).__name__, error)
        return None
    finally:
        set_rng_state(rng)
    score = fidelity[bits_min]
    if score < config.fidelity_threshold:
        passing = _lowest_passing_bits(model, batch, bits_min, config, fidelity)
        fixes = []
        if config.quant_scheme not in ("rotated-per-token", "auto"):
            fixes.append("CPTConfig(quant_scheme='rotated-per-token') (the default, 'auto', for transformers)")
        if passing is not None:
            fixes.append(f"CPTConfig(bits_min={passing}) (cosine {fidelity[passing]:.3f} on this batch)")
        else:
            fixes.append(f"a higher CPTConfig.bits_max, or check the model's outlier features: no bits_min up to "
                         f"bits_max={config.bits_max} passes")
        fix = " or ".join(fixes)
        logger.warning(
            "hf_cpt: at bits_min=%d the model's output keeps a cosine similarity of only %.3f to full precision "
            "on the first batch (threshold CPTConfig.fidelity_threshold=%.2f, quant_scheme=%r): training at this "
            "precision can lose the model's representation (a pretrained model's outlier features). Use %s. "
            "See docs/pretrained.md.",
            bits_min, score, config.fidelity_threshold, config.quant_scheme, fix,
        )
    else:
        logger.info("hf_cpt: output fidelity at bits_min=%d on the first batch: %.3f.", bits_min, score)
    return fidelity


def _lowest_passing_bits(model: nn.Module, batch, bits_min: int, config: CPTConfig,
                         fidelity: dict[int, float]) -> int | None:
    """The lowest bit-width above ``bits_min`` whose fidelity on ``batch`` passes the threshold (added to
    ``fidelity``), None if none up to ``bits_max`` does."""
    rng = rng_state()
    try:
        for bits in range(bits_min + 1, config.bits_max + 1):
            fidelity.update(output_fidelity(model, batch, bits))
            if fidelity[bits] >= config.fidelity_threshold:
                return bits
    finally:
        set_rng_state(rng)
    return None


def format_cost_report(report: dict[str, Any]) -> str:
    lines = [
        "CPT training cost",
        f"  GBitOPs spent            {report['gbitops']:.4g}",
        f"    of which rotation      {report.get('rotation_gbitops', 0.0):.4g}",
        f"  at static {report['cpt_config']['bits_max']}-bit           {report['static_gbitops']:.4g}"
        f"  (ratio {report['cost_vs_static'] or float('nan'):.3f})",
        f"  in FP32                  {report['fp32_gbitops']:.4g}"
        f"  (ratio {report['cost_vs_fp32'] or float('nan'):.4f})",
        f"  MACs in full precision   {100 * (report.get('full_precision_mac_share') or 0.0):.1f}%",
        "  steps at each precision  "
        + ", ".join(f"{bits}: {count}" for bits, count in report["steps_at_bits"].items()),
    ]
    if "prt" in report:
        prt = report["prt"]
        lines.append(
            f"  precision range test     bits_min = {prt['bits_min']}{'' if prt['found'] else ' (none passed)'}, "
            f"{prt['steps']} steps, {prt['gbitops']:.4g} GBitOPs"
        )
    return "\n".join(lines)


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
        unexportable = self._cpt_unexportable_bits_max()
        if self.cpt_save_format != "fp32" and unexportable:
            logger.warning(
                "CPTTrainer: %s; save_model() and push_to_hub() will write the FP32 master weights (or pass "
                "bits=<1..%d> to export at that precision).", unexportable, MAX_EXPORT_BITS,
            )
        self.cpt_callback = CPTCallback(self.cpt_config)
        self.cpt_callback.logs_injected_by_trainer = True
        kwargs["callbacks"] = [self.cpt_callback] + list(kwargs.get("callbacks") or [])
        super().__init__(model, args, *trainer_args, **kwargs)

    def _quantize(self, model: nn.Module) -> QuantizationReport | None:
        if is_quantized(model):
            return None  # converted by the user, e.g. before get_peft_model
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

    # -- saving: quantized checkpoints (hf_cpt.checkpoint) ----------------------------------------
    #: What `save_model` and `push_to_hub` write by default: "packed" (integer CPT checkpoint),
    #: "portable" (float weights on the grid, loads anywhere) or "fp32" (the FP32 master weights).
    cpt_save_format: str = "packed"
    #: Export precision (None: ``cpt_config.bits_max``) and storage of the weights trained in FP32.
    cpt_save_bits: int | None = None
    cpt_float_weight_bits: Any = None  # exact; "auto" or a bit-width rounds FP32-trained weights (measured)
    _CPT_DEFAULT = object()  # "not given" (None is a valid float_weight_bits: exact float)

    def save_model(
        self,
        output_dir: str | None = None,
        _internal_call: bool = False,
        *,
        save_format: str | None = None,
        bits: int | None = None,
        float_weight_bits: Any = _CPT_DEFAULT,
    ) -> None:
        """Save the trained model for use, with its tokenizer / image processor and a model card.

        ``save_format`` (default ``self.cpt_save_format``, "packed") picks a packed CPT checkpoint at
        ``bits`` (default ``cpt_config.bits_max``), a "portable" float export on the same grid, or the
        "fp32" master weights; by default a model that cannot be exported (not a transformers
        ``PreTrainedModel``, e.g. a peft or plain torch model, or a ``schedule="fp32"`` run) is saved
        as "fp32". ``float_weight_bits`` is `hf_cpt.save_quantized`'s. Checkpoints the Trainer writes
        itself to resume from (``save_steps``, ``_internal_call=True``) always hold the FP32 master
        weights with plain keys, so that resuming continues exactly.
        """
        export = self.__dict__.pop("_cpt_export_pending", None)
        if _internal_call and export is None:
            with self._cpt_plain_model():
                super().save_model(output_dir, _internal_call=True)
            return
        export = export or {}
        explicit = save_format or export.get("save_format")
        save_format = explicit or self._cpt_default_save_format()
        bits = bits if bits is not None else export.get("bits", self.cpt_save_bits)
        if float_weight_bits is self._CPT_DEFAULT:
            float_weight_bits = export.get("float_weight_bits", self.cpt_float_weight_bits)
        if save_format not in ("packed", "portable", "fp32"):
            raise ValueError(f"save_format must be 'packed', 'portable' or 'fp32', got {save_format!r}.")
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if save_format == "fp32":
            with self._cpt_plain_model():
                super().save_model(output_dir, _internal_call=True)
            fields = None
        else:
            fields = self._cpt_export(output_dir, save_format, bits, float_weight_bits)
        self._cpt_last_export = {"fields": fields, "output_dir": output_dir}
        if self.args.should_save:
            self._cpt_write_card(output_dir, fields)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(
                commit_message="Model save",
                revision=self.args.hub_revision,
                save_format=save_format,
                bits=bits,
                float_weight_bits=float_weight_bits,
            )

    def push_to_hub(self, *args, save_format: str | None = None, bits: int | None = None,
                    float_weight_bits: Any = _CPT_DEFAULT, **kwargs):
        """`Trainer.push_to_hub`, uploading the checkpoint `save_model` writes (packed by default) and its model card.

        ``save_format``, ``bits`` and ``float_weight_bits`` are those of `save_model`; other arguments are
        `Trainer.push_to_hub`'s.
        """
        pending = {"save_format": save_format, "bits": bits}
        self._cpt_export_pending = {key: value for key, value in pending.items() if value is not None}
        if float_weight_bits is not self._CPT_DEFAULT:
            self._cpt_export_pending["float_weight_bits"] = float_weight_bits
        try:
            return super().push_to_hub(*args, **kwargs)
        finally:
            self.__dict__.pop("_cpt_export_pending", None)

    def create_model_card(self, language=None, license=None, tags=None, model_name=None, finetuned_from=None,
                          tasks=None, dataset_tags=None, dataset=None, dataset_args=None, **kwargs) -> None:
        """Write the CPT model card (README.md) into ``args.output_dir``: settings, schedule, cost, metrics."""
        if not isinstance(self._cpt_unwrapped(), PreTrainedModel):  # peft or plain torch models: Trainer's card
            return super().create_model_card(
                language=language, license=license, tags=tags, model_name=model_name, finetuned_from=finetuned_from,
                tasks=tasks, dataset_tags=dataset_tags, dataset=dataset, dataset_args=dataset_args,
            )
        if not self.is_world_process_zero():
            return
        last = self.__dict__.get("_cpt_last_export") or {}
        fields = last.get("fields") if last.get("output_dir") == self.args.output_dir else None
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

    def _cpt_default_save_format(self) -> str:
        """``cpt_save_format``, or "fp32" where a quantized export cannot apply (said in the log)."""
        if self.cpt_save_format == "fp32":
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
            return self.cpt_save_format
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
        else:
            state_dict, fields = portable_state_dict(model, bits, self.cpt_config)
        os.makedirs(output_dir, exist_ok=True)
        write_checkpoint(model, output_dir, state_dict, fields)
        processing_class = self.processing_class
        if processing_class is None:
            processing_class = getattr(self.data_collator, "tokenizer", None)
        if processing_class is not None:
            processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
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
        hyperparameters = {
            "learning_rate": args.learning_rate,
            "train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "optimizer": str(getattr(args.optim, "value", args.optim)),
            "lr_scheduler_type": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
            "num_train_epochs": args.num_train_epochs,
            "max_steps": total_steps,
            "seed": args.seed,
        }
        write_model_card(
            output_dir,
            self._cpt_unwrapped(),
            fields,
            cpt_config=self.cpt_config,
            total_steps=total_steps,
            schedule=callback.schedule,
            grad_schedule=getattr(callback, "grad_schedule", None),
            model_name=card.pop("model_name", None) or os.path.basename(os.path.abspath(output_dir)),
            cost_report=cost_report,
            eval_metrics=eval_metrics_from_log_history(self.state.log_history),
            repo_id=getattr(self, "hub_model_id", None),
            training_hyperparameters=hyperparameters,
            precision_profile=self.cpt_precision_profile,
            **card,
        )
