"""Quantized checkpoints of CPT models: packed export, portable export, model card (docs/checkpoints.md).

`save_quantized` writes a *packed* checkpoint that transformers loads back (after ``import hf_cpt``) into CPT layers
computing what the in-memory model computes at ``bits``; a guard tensor stops a load without hf_cpt.
`export_portable` writes a plain float checkpoint. Every save is staged and moved in under a lock (`staged_save`).
"""


from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from torch import nn

from ..config import CPTConfig
from .export import packed_state_dict, portable_state_dict, resolve_export_bits
from .format import QUANT_METHODS, CheckpointFields
from .model_card import write_model_card
from .quantization_config import CPTQuantizationConfig


@contextlib.contextmanager
def _as_export(model: nn.Module, quantization_config: Any) -> Iterator[None]:
    """Let ``save_pretrained`` write ``quantization_config`` and our state dict, then restore the model."""
    config = model.config
    had_config = "quantization_config" in config.__dict__
    old_config = config.__dict__.get("quantization_config")
    had_quantizer = "hf_quantizer" in model.__dict__
    old_quantizer = model.__dict__.get("hf_quantizer")
    config.quantization_config = quantization_config
    if had_quantizer:
        del model.__dict__["hf_quantizer"]  # else save_pretrained asks it for the state dict
    try:
        yield
    finally:
        if had_config:
            config.quantization_config = old_config
        else:
            config.__dict__.pop("quantization_config", None)
        if had_quantizer:
            model.__dict__["hf_quantizer"] = old_quantizer


@contextlib.contextmanager
def plain_model(model: nn.Module) -> Iterator[None]:
    """Save as a plain FP32 model: hide a loaded CPT quantizer and its ``quantization_config``."""
    config = getattr(model, "config", None)
    quantizer = model.__dict__.get("hf_quantizer")
    is_cpt = quantizer is not None and getattr(quantizer.quantization_config, "quant_method", None) in QUANT_METHODS
    if not is_cpt:
        yield
        return
    old_config = config.__dict__.get("quantization_config")
    del model.__dict__["hf_quantizer"]
    config.__dict__.pop("quantization_config", None)
    try:
        yield
    finally:
        model.__dict__["hf_quantizer"] = quantizer
        if old_config is not None:
            config.quantization_config = old_config


PORTABLE_SETTINGS_FILE = "cpt_config.json"  # a portable export's CPT settings (`CheckpointFields`)
# The files of a checkpoint that a new save into the same folder must not leave behind from an older one.
CHECKPOINT_FILES = re.compile(r"config\.json|(model|pytorch_model).*\.(safetensors|bin)(\.index\.json)?")


@contextlib.contextmanager
def staged_save(save_directory: str) -> Iterator[str]:
    """Write a checkpoint into a staging folder inside ``save_directory``, then move it in under a lock, the old
    ``config.json`` removed first and the new one moved last: an interrupted save never leaves a mix that loads.
    """
    os.makedirs(save_directory, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".hf_cpt-save-{os.getpid()}-", dir=save_directory)
    try:
        yield staging
        try:
            folder = os.open(save_directory, os.O_RDONLY)  # locked while the files move in
        except OSError:  # no folder handles (Windows): saves into one folder are not serialized there
            folder = None
        try:
            with contextlib.suppress(ImportError, OSError, TypeError):  # POSIX, local disks
                import fcntl

                fcntl.flock(folder, fcntl.LOCK_EX)
            for name in os.listdir(save_directory):  # staging folders of saves killed before their end
                pid = name.split("-")[2] if name.startswith(".hf_cpt-save-") else ""
                if pid.isdigit() and not os.path.exists(f"/proc/{pid}") and os.path.exists("/proc/self"):
                    shutil.rmtree(os.path.join(save_directory, name), ignore_errors=True)
            new = set(os.listdir(staging))
            old = [name for name in os.listdir(save_directory) if CHECKPOINT_FILES.fullmatch(name)]
            for name in sorted(old, key=lambda name: name != "config.json"):
                if name == "config.json" or name not in new:
                    os.remove(os.path.join(save_directory, name))
            for name in sorted(new, key=lambda name: name == "config.json"):
                target = os.path.join(save_directory, name)
                if os.path.isdir(target) and not os.path.islink(target):
                    shutil.rmtree(target)
                os.replace(os.path.join(staging, name), target)
        finally:
            if folder is not None:
                os.close(folder)  # and unlocked
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_checkpoint(
    model: nn.Module, save_directory: str, state_dict: dict, fields: CheckpointFields, **save_kwargs
) -> None:
    """``model.save_pretrained`` with an export's state dict (the model is unchanged): a packed export with its
    ``quantization_config``; a portable one as a plain float checkpoint that any reader of transformers checkpoints
    loads, its CPT settings in `PORTABLE_SETTINGS_FILE` beside it."""
    if fields.packed:
        with _as_export(model, CPTQuantizationConfig.from_fields(fields)):
            model.save_pretrained(save_directory, state_dict=state_dict, **save_kwargs)
        return
    with plain_model(model):
        model.save_pretrained(save_directory, state_dict=state_dict, **save_kwargs)
    write_settings_file(save_directory, fields)


def write_settings_file(save_directory: str, fields: CheckpointFields) -> None:
    """The CPT settings of an export without a CPT ``quantization_config``, beside its weights."""
    with open(os.path.join(save_directory, PORTABLE_SETTINGS_FILE), "w") as f:
        json.dump(fields.to_dict(), f, indent=2)


def save_quantized(
    model: nn.Module,
    save_directory: str | os.PathLike,
    bits: int | None = None,
    *,
    cpt_config: CPTConfig | None = None,
    float_weight_bits: int | str | None = None,
    measure_inputs: dict[str, Any] | None = None,
    processing_class: Any = None,
    model_card: bool = True,
    card_info: dict[str, Any] | None = None,
    **save_kwargs: Any,
) -> str:
    """Write a packed CPT checkpoint of ``model`` at ``bits`` (default: ``cpt_config.bits_max``) that reproduces the
    in-memory model evaluated at ``bits``; load it with ``import hf_cpt`` and ``AutoModelFor....from_pretrained``.

    ``float_weight_bits``: the storage of the weights that trained in FP32 (embeddings, the kept head, excluded layers):
    ``None`` (default) exact; ``"auto"`` (embeddings at 8 bits above 4-bit exports, else 4; other weights 8) or a
    bit-width rounds them, a lossy opt-in measured on ``measure_inputs`` (default: random valid inputs) and written into
    ``config.json`` and the model card. ``processing_class`` is saved alongside; ``model_card`` writes ``README.md``,
    with ``card_info`` (`write_model_card`'s arguments). Other keyword arguments go to ``model.save_pretrained``.
    """
    save_directory = os.fspath(save_directory)
    bits = resolve_export_bits(model, bits, cpt_config)
    state_dict, fields = packed_state_dict(model, bits, float_weight_bits, cpt_config, measure_inputs)
    with staged_save(save_directory) as staging:
        write_checkpoint(model, staging, state_dict, fields, **save_kwargs)
        _finish_export(model, staging, fields, cpt_config, processing_class, model_card, card_info)
    return save_directory


def export_portable(
    model: nn.Module,
    save_directory: str | os.PathLike,
    bits: int | None = None,
    *,
    cpt_config: CPTConfig | None = None,
    processing_class: Any = None,
    model_card: bool = True,
    card_info: dict[str, Any] | None = None,
    **save_kwargs: Any,
) -> str:
    """Write a plain float checkpoint whose CPT-layer weights are snapped to the ``bits`` grid: it loads anywhere
    (``from_pretrained``, evaluation harnesses, serving engines), as a float model (weights on the grid; activations
    and attention products not quantized), with or without hf_cpt. No ``quantization_config``: the CPT settings
    (bits, layers, activation ranges, the run's config) go into ``cpt_config.json`` and the model card. Same size as
    FP32; for the trained model's exact computation, `save_quantized`.
    """
    save_directory = os.fspath(save_directory)
    bits = resolve_export_bits(model, bits, cpt_config)
    state_dict, fields = portable_state_dict(model, bits, cpt_config)
    with staged_save(save_directory) as staging:
        write_checkpoint(model, staging, state_dict, fields, **save_kwargs)
        _finish_export(model, staging, fields, cpt_config, processing_class, model_card, card_info)
    return save_directory


def _finish_export(model, save_directory, fields, cpt_config, processing_class, model_card, card_info) -> None:
    if processing_class is not None:
        processing_class.save_pretrained(save_directory)
    if model_card:
        write_model_card(save_directory, model, fields, cpt_config=cpt_config, **(card_info or {}))


def checkpoint_size(path: str | os.PathLike) -> int:
    """Bytes of the weight files (``*.safetensors``) in a checkpoint directory."""
    path = os.fspath(path)
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path) if name.endswith(".safetensors"))
