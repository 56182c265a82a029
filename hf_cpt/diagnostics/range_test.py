"""Precision range test (docs/method.md §6): the lowest precision at which training makes progress, on any quantized
model and any iterable of batches; `hf_cpt.integrations.range_test` runs it for ``CPTConfig(bits_min="auto")``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..config import CPTConfig, RangeTestConfig
from ..convert import dequantize_model, find_precision_state, is_quantized, quantize_model, set_precision
from ..cost import CostMeter
from ..numerics.bits import check_bits
from ..utils import json_safe
from .training_loop import (
    BatchCycle,
    OptimizerArg,
    nanmean,
    resolve_optimizer,
    restore_snapshot,
    rng_state,
    set_rng_state,
    take_snapshot,
    train_step,
    untrained_score,
    use_initial_lr,
)

logger = logging.getLogger(__name__)




@dataclass
class PrecisionRangeResult:
    """What a precision range test measured and chose.

    ``bits_min`` is the chosen lower bound (``max_bits`` when ``found`` is False); ``curve`` holds
    the metric of every training iteration at each precision, ``scores`` their window means and
    ``improvements`` what was compared with ``threshold``. ``steps`` is the number of training
    iterations the test spent and ``gbitops`` their cost (docs/method.md §7).
    """

    bits_min: int
    found: bool
    metric: str
    threshold: float
    start_bits: int
    max_bits: int
    grad_bits: int | None
    steps_per_precision: int
    window: int
    restore_weights: bool
    baseline: float
    scores: dict[int, float] = field(default_factory=dict)
    improvements: dict[int, float] = field(default_factory=dict)
    curve: dict[int, list[float]] = field(default_factory=dict)
    steps: int = 0
    gbitops: float = 0.0

    @property
    def bits(self) -> int:
        return self.bits_min

    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        for key in ("scores", "improvements", "curve"):
            values[key] = {str(bits): value for bits, value in values[key].items()}
        return json_safe(values)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PrecisionRangeResult:
        values = dict(values)
        for key in ("scores", "improvements", "curve"):
            values[key] = {int(bits): value for bits, value in values.get(key, {}).items()}
        return cls(**values)

    def save_json(self, path: str) -> str:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
        return path

    def save_plot(self, path: str) -> str:
        """Plot the metric of every iteration, its window mean per precision, and the chosen bound."""
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        offset = 0
        for bits, values in self.curve.items():
            xs = range(offset, offset + len(values))
            ax.plot(xs, values, color="tab:blue", alpha=0.5, linewidth=1)
            score = self.scores.get(bits)
            if score is not None and len(values):
                tail = range(offset + len(values) - min(self.window, len(values)), offset + len(values))
                ax.plot(tail, [score] * len(tail), color="black", linewidth=2)
                if self.found and bits == self.bits_min:
                    ax.plot([tail[-1]], [score], "o", markersize=12, markerfacecolor="none", color="red")
            ax.axvline(offset, color="grey", linewidth=0.5)
            ax.text(offset + len(values) / 2, 1.0, f"{bits}b", transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=8)
            offset += len(values)
        ax.axhline(self.baseline, color="grey", linestyle="--", linewidth=1, label="untrained model")
        ax.set_xlabel("precision range test iteration")
        ax.set_ylabel(f"training {self.metric}")
        verdict = f"bits_min = {self.bits_min}" if self.found else f"no precision passed; bits_min = {self.bits_min}"
        ax.set_title(f"Precision range test: {verdict} (threshold {self.threshold:g}, {self.steps} steps)", pad=14)
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def __str__(self) -> str:
        lines = [
            f"Precision range test ({self.metric}, threshold {self.threshold:g}, "
            f"{'weights restored' if self.restore_weights else 'weights kept'}): "
            + (f"bits_min = {self.bits_min}" if self.found else f"no precision passed, bits_min = {self.bits_min}"),
            f"  untrained model {self.metric}: {self.baseline:.4g}",
        ]
        for bits, score in self.scores.items():
            mark = "  <- chosen" if self.found and bits == self.bits_min else ""
            lines.append(
                f"  {bits:2d} bits: {self.metric} {score:.4g}, improvement {self.improvements[bits]:+.4g}{mark}"
            )
        lines.append(f"  steps spent: {self.steps} ({self.gbitops:.4g} GBitOPs)")
        return "\n".join(lines)


def precision_range_test(
    model: nn.Module,
    data: Iterable,
    *,
    start_bits: int = 2,
    max_bits: int = 8,
    steps_per_precision: int = 20,
    threshold: float | None = None,
    metric: str = "accuracy",
    window: int | None = None,
    optimizer: OptimizerArg = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    grad_bits: int | None = 8,
    restore_weights: bool = True,
    max_grad_norm: float | None = None,
    stop_at_first: bool = True,
    cpt_config: CPTConfig | None = None,
) -> PrecisionRangeResult:
    """Find ``bits_min`` by training briefly at ``start_bits``, ``start_bits + 1``, ... ``max_bits``.

    ``model``: converted with `hf_cpt.quantize_model` (a plain model is converted with ``cpt_config``, default
    ``CPTConfig()``, and restored afterwards). ``data``: batches, re-iterated if they run out: dicts passed as
    ``model(**batch)`` (the loss is ``outputs.loss`` if there is one) or ``(inputs, labels)`` pairs. ``threshold``: the
    improvement that marks ``bits_min``, absolute for accuracy (default 0.05), a relative decrease for the loss (0.1),
    over ``window`` averaged iterations (default: a quarter of ``steps_per_precision``). ``optimizer``: None (Adam, lr
    1e-3, fresh at each precision), a function ``params -> optimizer`` or an optimizer over the model's parameters.
    ``loss_fn(logits, labels)`` for models that return no loss (default: cross-entropy). ``restore_weights=True`` judges
    every precision from the same start and restores weights, optimizer and random state; ``False`` trains through them,
    as the paper does. ``stop_at_first=False`` measures every precision up to ``max_bits``.
    """
    settings = RangeTestConfig(start_bits, steps_per_precision, threshold, metric, window, restore_weights)
    settings.check_max_bits(check_bits("precision_range_test: max_bits", max_bits))
    if grad_bits is not None:
        check_bits("precision_range_test: grad_bits", grad_bits)
    threshold, window = settings.resolved_threshold, settings.resolved_window
    if not isinstance(model, nn.Module):
        raise ValueError(f"precision_range_test: model must be a torch.nn.Module, got {type(model).__name__}.")
    if data is None or not hasattr(data, "__iter__"):
        raise ValueError(f"precision_range_test: data must be an iterable of batches, got {type(data).__name__}.")

    converted_here = not is_quantized(model)
    if converted_here:
        quantize_model(model, cpt_config)
    try:
        run = _Run(model, data, settings, grad_bits, optimizer, loss_fn, max_grad_norm)
        result = run.result(max_bits)
        try:
            reference = result.baseline = run.untrained_score()
            for bits in range(start_bits, max_bits + 1):
                run.train_at(bits, result, reference)
                if not result.found and result.improvements[bits] > threshold:
                    result.found, result.bits_min = True, bits
                    if stop_at_first:
                        break
                if not restore_weights:  # the paper's way: each precision against the one before
                    reference = result.scores[bits]
        finally:
            run.finish(result)
    finally:
        if converted_here:
            dequantize_model(model)
    result = _agree_across_processes(result, model, restore_weights)
    if not result.found:
        logger.warning(
            "Precision range test: no precision from %d to %d bits improved the training %s by more than %g; "
            "using bits_min = %d. Lower the threshold or raise steps_per_precision.",
            start_bits, max_bits, metric, threshold, max_bits,
        )
    return result


class _Run:
    """One precision range test in progress: the model's state to restore, the batches, the optimizer, the meter."""

    def __init__(self, model, data, settings: RangeTestConfig, grad_bits, optimizer, loss_fn, max_grad_norm) -> None:
        self.model, self.settings, self.grad_bits = model, settings, grad_bits
        self.loss_fn, self.max_grad_norm = loss_fn, max_grad_norm
        self.precision = find_precision_state(model)
        self.previous_precision, self.was_training, self.rng = self.precision.current, model.training, rng_state()
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("precision_range_test: the model has no trainable parameters.")
        self.optimizer, self.make_optimizer = resolve_optimizer(optimizer, self.params)
        self.current_optimizer = self.optimizer
        restore = settings.restore_weights
        self.snapshot = take_snapshot(model, self.optimizer) if restore else None
        self.lrs = use_initial_lr(self.optimizer) if self.optimizer is not None else None
        self.batches = BatchCycle(data, self.params[0].device, cache=settings.steps_per_precision if restore else None)
        self.meter = None

    def result(self, max_bits: int) -> PrecisionRangeResult:
        self.meter = CostMeter(self.model, max_bits, self.grad_bits)
        s = self.settings
        return PrecisionRangeResult(bits_min=max_bits, found=False, metric=s.metric, threshold=s.resolved_threshold,
            start_bits=s.start_bits, max_bits=max_bits, grad_bits=self.grad_bits,
            steps_per_precision=s.steps_per_precision, window=s.resolved_window, restore_weights=s.restore_weights,
            baseline=float("nan"))

    def untrained_score(self) -> float:
        self.model.train()
        return untrained_score(self.model, self.batches, self.settings.resolved_window, self.settings.metric,
                               self.loss_fn, self.precision)

    def train_at(self, bits: int, result: PrecisionRangeResult, reference: float) -> None:
        """Train ``steps_per_precision`` iterations at ``bits``; record the curve, the score and its improvement."""
        s = self.settings
        if s.restore_weights:
            restore_snapshot(self.model, self.optimizer, self.snapshot)
            set_rng_state(self.rng)
            self.batches.rewind()
        if self.current_optimizer is None or (s.restore_weights and self.make_optimizer is not None):
            self.current_optimizer = self.make_optimizer(self.params)
        set_precision(self.model, bits, self.grad_bits)
        values = []
        for _ in range(s.steps_per_precision):
            values.append(train_step(self.model, self.batches.next(), s.metric, self.loss_fn, self.current_optimizer,
                                     self.params, self.max_grad_norm))
            self.meter.end_step(bits, self.grad_bits)
            result.steps += 1
        score = nanmean(values[-s.resolved_window:])
        result.curve[bits], result.scores[bits] = values, score
        result.improvements[bits] = _improvement(s.metric, reference, score)
        logger.info("PRT %d bits: %s %.4g, improvement %+.4g", bits, s.metric, score, result.improvements[bits])

    def finish(self, result: PrecisionRangeResult) -> None:
        """Leave the model, optimizer and random state as they were (weights too when ``restore_weights``)."""
        if self.meter is not None:
            self.meter.remove()
            result.gbitops = self.meter.totals.bitops / 1e9
        self.model.zero_grad(set_to_none=True)
        if self.settings.restore_weights:
            restore_snapshot(self.model, self.optimizer, self.snapshot)
            set_rng_state(self.rng)
        if self.lrs is not None:
            for group, lr in zip(self.optimizer.param_groups, self.lrs):
                group["lr"] = lr
        self.precision.set(*self.previous_precision)
        self.model.train(self.was_training)


# -- helpers -------------------------------------------------------------------------------------
def _improvement(metric: str, reference: float, score: float) -> float:
    if metric == "accuracy":
        return score - reference
    return (reference - score) / max(abs(reference), 1e-12)


def _agree_across_processes(result: PrecisionRangeResult, model: nn.Module, restored: bool) -> PrecisionRangeResult:
    """Under torch.distributed, every process takes process 0's result (and weights, if they trained)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return result
    shared = [result]
    dist.broadcast_object_list(shared, src=0)
    if not restored:
        with torch.no_grad():
            for tensor in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(tensor.data, src=0)
    return shared[0]
