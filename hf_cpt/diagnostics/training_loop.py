"""The small training loop a diagnostic runs on any model: batches on the model's device, one step, the metric,
and snapshots of weights, optimizer and random state (so a diagnostic can leave a run exactly as it was)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

OptimizerArg = torch.optim.Optimizer | Callable[[list], torch.optim.Optimizer] | None


def nanmean(values: list[float]) -> float:
    """Mean of the finite values (NaN when there are none)."""
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


class BatchCycle:
    """Cycles through ``data``; with ``cache``, keeps the first batches so each precision sees the same."""

    def __init__(self, data: Iterable, device: torch.device, cache: int | None) -> None:
        self.data, self.device, self.cache = data, device, cache is not None
        self.one_shot = isinstance(data, Iterator)  # cannot be iterated again
        self.iterator: Iterator | None = None
        self.cached: list = []
        self.position = 0

    def _draw(self):
        for _ in range(2):
            if self.iterator is None:
                self.iterator = iter(self.data)
            try:
                return to_device(next(self.iterator), self.device)
            except StopIteration:
                self.iterator = None
                if self.one_shot:
                    break
        raise ValueError("precision_range_test: data ran out of batches (an exhausted iterator or an empty dataset).")

    def next(self):
        if not self.cache:
            return self._draw()
        if self.position == len(self.cached):
            self.cached.append(self._draw())
        batch = self.cached[self.position]
        self.position += 1
        return batch

    def rewind(self) -> None:
        self.position = 0


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def forward_with_metric(model: nn.Module, batch: Any, loss_fn, metric: str):
    """(loss, logits, labels) of one batch."""
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
        outputs = model(**batch)
    elif isinstance(batch, (list, tuple)) and len(batch) == 2:
        inputs, labels = batch
        outputs = model(inputs)
    else:
        raise ValueError(
            "precision_range_test: a batch must be a dict of model inputs or an (inputs, labels) pair, "
            f"got {type(batch).__name__}."
        )
    loss, logits = None, None
    if isinstance(outputs, torch.Tensor):
        logits = outputs
    elif isinstance(outputs, Mapping):
        loss, logits = outputs.get("loss"), outputs.get("logits")
    elif isinstance(outputs, (list, tuple)) and outputs:
        if isinstance(batch, Mapping) and labels is not None and len(outputs) > 1:
            loss, logits = outputs[0], outputs[1]
        else:
            logits = outputs[0]
    if loss_fn is not None or loss is None:
        if logits is None or labels is None:
            raise ValueError(
                "precision_range_test: the model returned no loss, and no logits and labels to compute one from."
            )
        loss = (loss_fn or nn.functional.cross_entropy)(logits, labels)
    return loss, logits, labels


def metric_value(metric: str, loss: torch.Tensor, logits, labels) -> float:
    if metric == "loss":
        return float(loss.detach())
    if logits is None or labels is None:
        raise ValueError("precision_range_test: metric='accuracy' needs logits and labels; use metric='loss'.")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"precision_range_test: metric='accuracy' needs logits shaped like labels plus a class dimension, "
            f"got logits {tuple(logits.shape)} and labels {tuple(labels.shape)}; use metric='loss'."
        )
    mask = labels != -100
    correct = (logits.detach().argmax(-1) == labels) & mask
    return float(correct.sum()) / max(int(mask.sum()), 1)


def untrained_score(model, batches: BatchCycle, window: int, metric: str, loss_fn, precision) -> float:
    """The untrained model's metric (full precision, no update) on the first ``window`` batches."""
    precision.set(None, None)
    values = []
    with torch.no_grad():
        for _ in range(window):
            loss, logits, labels = forward_with_metric(model, batches.next(), loss_fn, metric)
            values.append(metric_value(metric, loss, logits, labels))
    batches.rewind()
    return nanmean(values)


def train_step(model, batch, metric, loss_fn, optimizer, params, max_grad_norm) -> float:
    loss, logits, labels = forward_with_metric(model, batch, loss_fn, metric)
    value = metric_value(metric, loss, logits, labels)
    if torch.isfinite(loss.detach()).all():
        loss.backward()
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return value


def resolve_optimizer(optimizer: OptimizerArg, params: list):
    """(optimizer instance or None, factory or None)."""
    if optimizer is None:
        return None, lambda ps: torch.optim.Adam(ps, lr=1e-3)
    if isinstance(optimizer, torch.optim.Optimizer):
        inner = getattr(optimizer, "optimizer", None)  # accelerate's AcceleratedOptimizer
        return (inner if isinstance(inner, torch.optim.Optimizer) else optimizer), None
    if callable(optimizer):
        return None, optimizer
    raise ValueError(
        f"precision_range_test: optimizer must be None, a torch optimizer or a function params -> optimizer, "
        f"got {type(optimizer).__name__}."
    )


def use_initial_lr(optimizer: torch.optim.Optimizer) -> list:
    """Train at the scheduler's peak lr (a warmup would start at 0); returns the lrs to put back."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group.get("initial_lr", group["lr"])
    return lrs


def take_snapshot(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    # parameters and every buffer, non-persistent ones (activation ranges) included; kept on the CPU
    tensors = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        tensors.setdefault(id(tensor), (tensor, tensor.detach().to("cpu", copy=True)))
    flags = {id(m): m.__dict__["_act_range_initialized"] for m in model.modules()
             if "_act_range_initialized" in m.__dict__}
    modules = {id(m): m for m in model.modules()}
    optimizer_state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
    return {"tensors": tensors, "flags": flags, "modules": modules, "optimizer": optimizer_state}


@torch.no_grad()
def restore_snapshot(model: nn.Module, optimizer: torch.optim.Optimizer | None, snapshot: dict) -> None:
    for tensor, saved in snapshot["tensors"].values():
        tensor.copy_(saved)
    for key, flag in snapshot["flags"].items():
        snapshot["modules"][key].__dict__["_act_range_initialized"] = flag
    if optimizer is not None:
        optimizer.load_state_dict(copy.deepcopy(snapshot["optimizer"]))
    model.zero_grad(set_to_none=True)


def rng_state() -> dict:
    state = {"cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
