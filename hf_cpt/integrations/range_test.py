"""``CPTConfig(bits_min="auto")`` in a Trainer run: the precision range test on the Trainer's batches and optimizer."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable

import torch
from torch import nn

from ..config import CPTConfig
from ..diagnostics.range_test import PrecisionRangeResult, precision_range_test

logger = logging.getLogger(__name__)

PRT_REPORT_FILE = "cpt_prt.json"
PRT_PLOT_FILE = "cpt_prt.png"


def run_precision_range_test_for_trainer(
    config: CPTConfig,
    args,
    state,
    model: nn.Module,
    train_dataloader: Iterable | None,
    optimizer: torch.optim.Optimizer | None = None,
) -> PrecisionRangeResult:
    """``CPTConfig(bits_min="auto")`` at the start of a Trainer run: run the test, save and log it.

    Uses the Trainer's training batches and optimizer (at its peak learning rate), writes
    ``cpt_prt.json`` and ``cpt_prt.png`` to the output directory, and on a resumed run reuses the
    ``cpt_prt.json`` found there instead of testing again.
    """
    output_dir = getattr(args, "output_dir", None)
    saved = os.path.join(output_dir, PRT_REPORT_FILE) if output_dir else None
    if state.global_step > 0 and saved and os.path.exists(saved):
        with open(saved) as f:
            result = PrecisionRangeResult.from_dict(json.load(f))
        logger.warning("Precision range test: resuming with bits_min = %d from %s", result.bits_min, saved)
        return result
    if train_dataloader is None:
        raise ValueError(
            "CPTConfig(bits_min='auto') needs the Trainer's train_dataloader for the precision range test."
        )
    test = config.range_test
    result = precision_range_test(model, train_dataloader, start_bits=test.start_bits, max_bits=config.bits_max,
        steps_per_precision=test.steps_per_precision, threshold=test.threshold, metric=test.metric, window=test.window,
        optimizer=optimizer, grad_bits=config.grad_bits, restore_weights=test.restore_weights,
        max_grad_norm=getattr(args, "max_grad_norm", None) or None)
    logger.warning("%s", result)
    if output_dir and getattr(state, "is_world_process_zero", True):
        os.makedirs(output_dir, exist_ok=True)
        result.save_json(os.path.join(output_dir, PRT_REPORT_FILE))
        try:
            result.save_plot(os.path.join(output_dir, PRT_PLOT_FILE))
        except Exception as error:  # a plot must never stop a training run
            logger.warning("Precision range test: could not save the plot: %s", error)
    return result
