"""`CPTCallback`: sets the CPT precision at every optimizer step of a `transformers.Trainer` run, meters the cost
and adds the ``cpt/*`` values to the logs."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

from safetensors.torch import load_file, save_file
from torch import nn
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..config import CPTConfig
from ..convert import activation_ranges, find_precision_state, is_quantized, load_activation_ranges, quantize_adapters
from ..cost import CostMeter
from ..diagnostics.fidelity import output_fidelity
from ..diagnostics.finite import nonfinite_inputs, step_health
from ..diagnostics.range_test import PrecisionRangeResult
from ..diagnostics.training_loop import rng_state, set_rng_state, to_device
from ..nn.precision import PrecisionState
from ..schedules.schedule import PrecisionSchedule, training_precision
from .range_test import run_precision_range_test_for_trainer

logger = logging.getLogger(__name__)

COST_REPORT_FILE = "cpt_cost_report.json"
# Written into each Trainer checkpoint: the eval-mode activation ranges are buffers outside state_dict.
ACTIVATION_RANGES_FILE = "cpt_activation_ranges.safetensors"
# Also in each Trainer checkpoint: the cost meter's totals, so a resumed run reports the whole run's cost.
COST_STATE_FILE = "cpt_cost_state.json"
# And the run's CPTConfig: a resume with another is refused, but for settings a run may change (`RESUMABLE_CHANGES`).
RUN_CONFIG_FILE = "cpt_run_config.json"
RESUMABLE_CHANGES = ("eval_bits", "fidelity_threshold", "nonfinite_inputs")


def _read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def _read_side_file(path: str, read: Callable[[str], Any]) -> Any:
    """``read(path)``; a file of a resumed checkpoint that cannot be read (truncated, corrupt) is named."""
    try:
        return read(path)
    except Exception as error:
        raise ValueError(f"hf_cpt: {path} cannot be read ({type(error).__name__}: {error}); it belongs to the "
                         "checkpoint this run resumes from: restore it, or resume from another checkpoint.") from error


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
        # The checkpoint a run resumes from (`CPTTrainer.train` sets it); None: output_dir's of the resumed step.
        self.resume_checkpoint: str | None = None
        self.precision: PrecisionState | None = None
        self.meter: CostMeter | None = None
        self.skipped_inputs = 0  # training forwards whose NaN or inf input a running range skipped (nonfinite="skip")
        self.bits: int | None = None
        self.grad_bits: int | None = None
        self.logs_injected_by_trainer = False  # CPTTrainer adds the values in Trainer.log itself
        self.trainer_saves_quantized = False  # CPTTrainer's save_model writes the packed checkpoint
        self.attached = False  # registered ahead of the reporting integrations by `attach`
        self.fidelity: dict[int, float] | None = None  # output fidelity at bits_min on the first batch

    # -- schedule -----------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model: nn.Module | None = None, **kwargs):
        """What happens at the start of a run, in order."""
        self.precision = self._precision_of(model)
        if state.global_step > 0:
            self._check_resumed_config(args, state)
        nonfinite_inputs(model)  # the counts start with the run (those of a model built on the meta device hold junk)
        if self.config.quantize_adapters:  # adapters added after quantize_model (the documented order)
            added = quantize_adapters(model, self.config).quantized
            if added and state.is_world_process_zero:
                logger.info("hf_cpt: quantized %d peft adapter layers added after quantize_model.", len(added))
        bits_min = self._range_test(args, state, model, kwargs.get("train_dataloader"), kwargs.get("optimizer"))
        self._build_schedules(state.max_steps, bits_min)
        self._check_fidelity(state, model, kwargs.get("train_dataloader"))
        self._start_meter(model, args.world_size)
        self._set_bits(state.global_step)
        if state.global_step > 0:  # resuming: our own files in the Trainer checkpoint
            self._restore_activation_ranges(args, state, model)
            self._restore_cost(args, state)
        self._check_log_order(args)
        self.precision.reused_weights.epoch = 0  # from here on, weights change only at optimizer steps (on_step_end)

    @staticmethod
    def _precision_of(model: nn.Module | None) -> PrecisionState:
        if model is None or not is_quantized(model):
            raise ValueError(
                "CPTCallback: the model has no CPT layers. Call hf_cpt.quantize_model(model, config) before "
                "creating the Trainer (so the optimizer and accelerator see the quantized layers), or use "
                "hf_cpt.CPTTrainer."
            )
        return find_precision_state(model)

    def _range_test(self, args, state, model, dataloader, optimizer) -> int | None:
        """``bits_min="auto"``: the precision range test (docs/method.md §6), before the meter starts."""
        if self.config.bits_min != "auto":
            return None
        self.prt_result = run_precision_range_test_for_trainer(self.config, args, state, model, dataloader, optimizer)
        return self.prt_result.bits_min

    def _build_schedules(self, total_steps: int, bits_min: int | None) -> None:
        self.schedule = self.config.schedule_config.forward_schedule(total_steps, bits_min=bits_min)
        self.grad_schedule = self.config.schedule_config.error_schedule(total_steps)
        self.precision.set_eval(self.config.eval_precision, follow_training=self.config.eval_bits == "current")

    def _check_fidelity(self, state, model: nn.Module, dataloader) -> None:
        """On a fresh run, warn when the lowest precision the run will train at loses the model's output."""
        if state.global_step > 0 or self.config.fidelity_threshold is None or self.config.schedule == "fp32":
            return
        visited = [b for b in self.schedule.steps_at_bits() if b is not None]
        if visited:
            self.fidelity = check_fidelity_at_start(model, dataloader, min(visited), self.config)

    def _start_meter(self, model: nn.Module, world_size: int) -> None:
        quantized_run = self.config.schedule != "fp32"  # an FP32 run's "static" counterpart is FP32
        if self.meter is not None:
            self.meter.remove()
        self.meter = CostMeter(model, self.config.bits_max if quantized_run else None,
                               self.config.grad_bits if quantized_run else None, scale=max(1, world_size))

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
            with open(os.path.join(checkpoint, RUN_CONFIG_FILE), "w") as f:
                json.dump(self.config.to_dict(), f, default=str)

    def _check_resumed_config(self, args, state) -> None:
        """Refuse to resume a run with another CPTConfig (before any step): the layers, schedule and cost would
        silently follow the new one from the middle of the run."""
        path = self._checkpoint_file(args, state, RUN_CONFIG_FILE)
        if not os.path.isfile(path):
            logger.warning("hf_cpt: no %s to resume from; the run's CPTConfig cannot be checked.", path)
            return
        saved = _read_side_file(path, _read_json)
        now = json.loads(json.dumps(self.config.to_dict(), default=str))
        changed = {k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now))
                   if saved.get(k) != now.get(k) and k not in RESUMABLE_CHANGES}
        if changed:
            raise ValueError(f"hf_cpt: {path} holds the CPTConfig the run trained with; resuming it with another "
                             f"changes {', '.join(f'{k} ({a!r} -> {b!r})' for k, (a, b) in changed.items())}. Resume "
                             f"with the run's config (only {', '.join(RESUMABLE_CHANGES)} may change), or start anew.")

    def _checkpoint_file(self, args, state, name: str) -> str:
        """The file ``name`` of the checkpoint this run resumes from."""
        checkpoint = self.resume_checkpoint or os.path.join(args.output_dir,
                                                            f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        return os.path.join(checkpoint, name)

    def _restore_cost(self, args, state) -> None:
        path = self._checkpoint_file(args, state, COST_STATE_FILE)
        if os.path.isfile(path):
            _read_side_file(path, lambda p: self.meter.totals.load_state_dict(_read_json(p)))
        else:
            logger.warning("hf_cpt: no %s to resume from; the cost report covers only the steps after the resume.",
                           path)

    def _restore_activation_ranges(self, args, state, model: nn.Module) -> None:
        # Resuming: the Trainer restored weights and state; the running ranges come from our own file.
        path = self._checkpoint_file(args, state, ACTIVATION_RANGES_FILE)
        if os.path.isfile(path):
            _read_side_file(path, lambda p: load_activation_ranges(model, load_file(p)))
        else:
            logger.warning("hf_cpt: no %s to resume from; eval-mode activation ranges start afresh.", path)

    def on_step_begin(self, args, state, control, **kwargs):
        # This step's micro-batches share one quantized copy of each weight; the last one's backward takes it over.
        micro_batches = micro_batches_of_step(args, state.global_step, kwargs.get("train_dataloader"))
        self.precision.reused_weights.begin_step(micro_batches)
        self._set_bits(state.global_step)

    def on_substep_end(self, args, state, control, **kwargs):
        self.precision.reused_weights.end_micro_batch()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        # The step's micro-batches are done: their weight codes go before the optimizer's temporaries arrive.
        self.precision.reused_weights.end_step()

    def on_step_end(self, args, state, control, model: nn.Module | None = None, **kwargs):
        self.precision.reused_weights.end_step()  # the optimizer has changed the weights (an evaluation may follow)
        self.meter.end_step(self.bits, self.grad_bits)
        nonfinite, bad_parameter = step_health(model) if model is not None else ({}, None)
        if nonfinite and (self.config.nonfinite_inputs == "raise" or not self.skipped_inputs):
            message = (f"hf_cpt: at step {state.global_step} the training inputs of {len(nonfinite)} quantized "
                       f"layer(s) held NaN or inf (first: {next(iter(nonfinite))}; forwards per layer: {nonfinite}). "
                       "Their activation ranges skipped them; check the batch and the model before the first of them")
            if self.config.nonfinite_inputs == "raise":  # a data bug: this step's loss and gradients hold it
                raise ValueError(message + " (CPTConfig(nonfinite_inputs='skip') counts them instead).")
            logger.warning("%s. Counted from now on, as cpt/nonfinite_inputs in the logs.", message)
        self.skipped_inputs += sum(nonfinite.values())
        if bad_parameter is not None:  # the Trainer would go on, its logged loss filtered to a number
            raise FloatingPointError(
                f"hf_cpt: after optimizer step {state.global_step} the trained parameter {bad_parameter!r} holds NaN "
                "or inf: the loss or its gradients were not finite (the Trainer's logged loss hides it). Stop, lower "
                "the learning rate or clip gradients, and resume from the last checkpoint.")

    # -- logging ------------------------------------------------------------------------------
    def log_values(self, logs: dict[str, Any]) -> dict[str, float]:
        """The CPT values to add to a training log entry (none for evaluation logs)."""
        if self.meter is None or not any(k == "loss" or k.startswith("train_") for k in logs):
            return {}
        values = {"cpt/bits": float(self.bits) if self.bits is not None else 32.0,
            "cpt/grad_bits": float(self.grad_bits) if self.grad_bits is not None else 32.0}
        values.update(self.meter.totals.as_logs())
        if self.skipped_inputs:
            values["cpt/nonfinite_inputs"] = float(self.skipped_inputs)
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

    def attach(self, trainer) -> CPTCallback:
        """Register this callback with ``trainer`` ahead of its other callbacks, so that the ``cpt/*`` values it adds
        to each log reach the ``report_to`` integrations (TensorBoard, W&B, ...), which the Trainer registers
        first. Uses only `Trainer.pop_callback` / `Trainer.add_callback`; returns the callback."""
        others = [trainer.pop_callback(callback) for callback in list(trainer.callback_handler.callbacks)]
        trainer.add_callback(self)
        for callback in others:
            if callback is not self:
                trainer.add_callback(callback)
        self.attached = True
        return self

    def _check_log_order(self, args) -> None:
        reporting = [name for name in (args.report_to or []) if name != "none"]
        if reporting and not (self.attached or self.logs_injected_by_trainer):
            logger.warning(
                "CPTCallback: the report_to integrations %s run before callbacks passed as Trainer(callbacks=[...]), "
                "so they would not see the cpt/* values; register it with CPTCallback(config).attach(trainer) "
                "(or use hf_cpt.CPTTrainer).", reporting,
            )

    # -- end of training ----------------------------------------------------------------------
    def on_train_end(self, args, state, control, **kwargs):
        if self.precision is not None:
            self.precision.reused_weights.epoch = None  # the weights are the user's again: nothing kept
        if self.meter is None:
            return
        report = self.cost_report()
        if state.is_world_process_zero:
            logger.warning(format_cost_report(report))
            if not self.trainer_saves_quantized and self.config.schedule != "fp32":
                bits = self.config.bits_max
                logger.warning(
                    "hf_cpt: this Trainer's save_model() writes the FP32 master weights, without quantization_config: "
                    "they reload as a float model, not the %d-bit one trained. Save the trained model with "
                    "hf_cpt.save_quantized(trainer.model, output_dir, bits=%d), or train with hf_cpt.CPTTrainer, "
                    "whose save_model does (docs/clients.md).", bits, bits)
            if args.output_dir:
                os.makedirs(args.output_dir, exist_ok=True)
                path = os.path.join(args.output_dir, COST_REPORT_FILE)
                try:  # whole or not at all: written beside, then renamed over an earlier report
                    with open(path + ".partial", "w") as f:
                        json.dump(report, f, indent=2)
                    os.replace(path + ".partial", path)
                finally:
                    if os.path.exists(path + ".partial"):
                        os.remove(path + ".partial")
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


def micro_batches_of_step(args, global_step: int, train_dataloader) -> int:
    """How many forward and backward passes the Trainer runs in optimizer step ``global_step``: the gradient
    accumulation steps, fewer in an epoch's last step where the epoch's batches do not divide evenly (as the
    Trainer's loop splits them). A wrong count costs time or memory, never a value: codes dropped too early are
    made again, and codes kept too long go at the optimizer step."""
    accumulation = args.gradient_accumulation_steps
    try:
        batches = len(train_dataloader)
    except TypeError:  # no length (an iterable dataset, or none given): every step is a full one
        return accumulation
    steps_per_epoch = max(-(-batches // accumulation), 1)
    if batches and global_step % steps_per_epoch == steps_per_epoch - 1:
        return batches - (steps_per_epoch - 1) * accumulation
    return accumulation
