"""Trainer integration: `CPTCallback` drives the schedule, `CPTTrainer` is a drop-in `Trainer`."""

from __future__ import annotations

import inspect
import json
import logging
import os
from typing import Any, Optional

from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import CallbackHandler

from .config import CPTConfig
from .cost import CostMeter
from .layers import PrecisionState
from .schedules import PrecisionSchedule, schedule_from_config
from .surgery import QuantizationReport, find_precision_state, is_quantized, quantize_model

logger = logging.getLogger(__name__)

COST_REPORT_FILE = "cpt_cost_report.json"


class CPTCallback(TrainerCallback):
    """Sets the CPT precision at every optimizer step of a `transformers.Trainer` run.

    The bits are a pure function of ``state.global_step`` and ``state.max_steps``, so gradient
    accumulation (one setting per optimizer step) and resuming from a checkpoint are right. The
    model must have been converted with `hf_cpt.quantize_model` before the Trainer was created.
    ``cpt/bits``, ``cpt/grad_bits`` and the cost figures are added to the Trainer's logs.
    """

    def __init__(self, config: Optional[CPTConfig] = None) -> None:
        self.config = config if config is not None else CPTConfig()
        self.schedule: Optional[PrecisionSchedule] = None
        self.precision: Optional[PrecisionState] = None
        self.meter: Optional[CostMeter] = None
        self.bits: Optional[int] = None
        self.grad_bits: Optional[int] = None
        self.logs_injected_by_trainer = False  # CPTTrainer adds the values in Trainer.log itself

    # -- schedule -----------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model: Optional[nn.Module] = None, **kwargs):
        if model is None or not is_quantized(model):
            raise ValueError(
                "CPTCallback: the model has no CPT layers. Call hf_cpt.quantize_model(model, config) before "
                "creating the Trainer (so the optimizer and accelerator see the quantized layers), or use "
                "hf_cpt.CPTTrainer."
            )
        if self.config.bits_min == "auto":
            raise NotImplementedError("CPTConfig(bits_min='auto') needs the precision range test (hf_cpt.prt).")
        self.precision = find_precision_state(model)
        self.schedule = schedule_from_config(self.config, state.max_steps)
        self.precision.set_eval(self.config.eval_precision, follow_training=self.config.eval_bits == "current")
        static_bits = None if self.config.schedule == "fp32" else self.config.bits_max
        if self.meter is not None:
            self.meter.remove()
        self.meter = CostMeter(model, static_bits, self.config.grad_bits, scale=max(1, args.world_size))
        self._set_bits(state.global_step)
        if not self.logs_injected_by_trainer:
            self._log_before_reporting_integrations()

    def _set_bits(self, step: int) -> None:
        self.bits = self.schedule(step)
        self.grad_bits = None if self.config.schedule == "fp32" else self.config.grad_bits
        self.precision.set(self.bits, self.grad_bits)

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
        return {"cpt_config": self.config.to_dict(), **self.meter.totals.to_dict()}


def format_cost_report(report: dict[str, Any]) -> str:
    lines = [
        "CPT training cost",
        f"  GBitOPs spent            {report['gbitops']:.4g}",
        f"  at static {report['cpt_config']['bits_max']}-bit           {report['static_gbitops']:.4g}"
        f"  (ratio {report['cost_vs_static'] or float('nan'):.3f})",
        f"  in FP32                  {report['fp32_gbitops']:.4g}  (ratio {report['cost_vs_fp32'] or float('nan'):.4f})",
        "  steps at each precision  "
        + ", ".join(f"{bits}: {count}" for bits, count in report["steps_at_bits"].items()),
    ]
    return "\n".join(lines)


class CPTTrainer(Trainer):
    """`transformers.Trainer` that trains with Cyclic Precision Training.

    Replace ``Trainer(`` by ``CPTTrainer(`` and pass ``cpt_config=CPTConfig(...)``; every other
    argument is passed through unchanged. Layers are converted before the optimizer and
    ``accelerator.prepare`` exist.
    """

    def __init__(self, model=None, args=None, *trainer_args, cpt_config: Optional[CPTConfig] = None, **kwargs):
        self.cpt_config = cpt_config if cpt_config is not None else CPTConfig()
        self.cpt_report: Optional[QuantizationReport] = None
        if model is not None:
            self.cpt_report = self._quantize(model)
        model_init = kwargs.get("model_init")
        if model_init is not None:
            def quantized_model_init(*init_args):
                fresh = model_init(*init_args)
                self.cpt_report = self._quantize(fresh)
                return fresh

            kwargs["model_init"] = quantized_model_init
        self.cpt_callback = CPTCallback(self.cpt_config)
        self.cpt_callback.logs_injected_by_trainer = True
        kwargs["callbacks"] = [self.cpt_callback] + list(kwargs.get("callbacks") or [])
        super().__init__(model, args, *trainer_args, **kwargs)

    def _quantize(self, model: nn.Module) -> Optional[QuantizationReport]:
        if is_quantized(model):
            return None  # converted by the user, e.g. before get_peft_model
        report = quantize_model(model, self.cpt_config)
        logger.info("%s", report)
        return report

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        logs.update(self.cpt_callback.log_values(logs))
        super().log(logs, *args, **kwargs)
