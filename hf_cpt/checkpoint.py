"""Quantized checkpoints of CPT models: packed export, portable export, model card.

A CPT run ends with FP32 master weights that work at its top precision. `save_quantized` writes them
as a *packed* checkpoint that `transformers` loads back (after ``import hf_cpt``) into the same CPT
layers, with outputs equal to the in-memory fake-quantized model at the same precision:

* every CPT layer's weight becomes integer codes at ``bits`` (one per byte for 5-8 bits, two per byte
  for 1-4 bits) plus a per-output-channel scale and zero point (the raw float channel minimum, as in
  REFERENCE §2), so that ``weight = codes * scale + zero_point`` reproduces, bit for bit, the weight
  the layer computes with at ``bits``;
* every CPT layer's activation range (the EMA ``act_min`` / ``act_max`` used in eval mode) is stored;
* weights that trained in FP32 (embeddings, the kept output head, excluded layers) are stored as
  per-row codes too by default (``float_weight_bits="auto"``: embedding tables at 8 bits for 5-8-bit
  exports and 4 bits for 1-4-bit ones, i.e. the bytes per value of the CPT layers, other weights at
  8 bits), since embeddings alone would otherwise take a third of a BERT-base or GPT-2 file;
  ``float_weight_bits=None`` keeps them exact in their float dtype;
* biases, normalization layers and buffers are stored unchanged.

``config.json`` carries a ``quantization_config`` with ``quant_method: "cpt"`` (see
`hf_cpt.hf_quantizer.CPTQuantizationConfig`). Packed tensors have names plain layers lack
(``<layer>.weight_packed``, ``.weight_scale``, ``.weight_zero_point``, ``.act_min``, ``.act_max``),
and one *guard* tensor (``<first CPT layer>.weight``, an empty uint8 tensor) makes a plain
``transformers`` load without ``import hf_cpt`` stop with a size-mismatch error instead of loading a
wrong float model. `export_portable` writes instead float weights snapped to the grid that load
anywhere. Layout details: ``docs/checkpoints.md``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .config import CPTConfig
from .config import check_bits as check_any_bits
from .layers import QuantLayerMixin
from .quantizer import channel_ranges, num_levels, quantization_scale
from .surgery import quant_layers

try:
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover - transformers is a dependency
    Conv1D = None

logger = logging.getLogger(__name__)

QUANT_METHOD = "cpt"
FORMAT_VERSION = 2  # 2: layer_schemes (per-token / rotated layers)
SUPPORTED_FORMAT_VERSIONS = (1, 2)
CHECKPOINT_FORMATS = ("packed", "portable")
MIN_EXPORT_BITS = 1
MAX_EXPORT_BITS = 8

PACKED = "weight_packed"
SCALE = "weight_scale"
ZERO_POINT = "weight_zero_point"
ACT_MIN = "act_min"
ACT_MAX = "act_max"

MODEL_CARD_NAME = "README.md"
SCHEDULE_PLOT_NAME = "cpt_schedule.png"

_FLOAT_PACKABLE: tuple[type, ...] = (nn.Embedding, nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d) + (
    (Conv1D,) if Conv1D is not None else ()
)


# ----------------------------------------------------------------------------- integer codes


def check_bits(name: str, value: Any, allow_none: bool = False) -> int | None:
    """Validate an export bit-width (1..8), naming the field in the error."""
    if value is None and allow_none:
        return None
    return check_any_bits(name, value, MIN_EXPORT_BITS, MAX_EXPORT_BITS)


def check_float_weight_bits(value: Any) -> int | str | None:
    """``"auto"``, ``None`` (exact float) or an export bit-width."""
    if value == "auto" or value is None:
        return value
    return check_bits("float_weight_bits", value)


def float_storage_bits(bits: int, float_weight_bits: int | str | None, embedding: bool) -> int | None:
    """Storage bits of one FP32-trained weight (None: exact float).

    ``"auto"``: embedding tables (and weights tied to them) take the finest codes in the bytes per value
    of the CPT layers, 8 bits above 4-bit exports and 4 bits (two per byte) at 4 bits or fewer; other
    weights (the kept output head, excluded layers) take 8 bits.
    """
    float_weight_bits = check_float_weight_bits(float_weight_bits)
    if float_weight_bits == "auto":
        return (4 if bits <= 4 else 8) if embedding else 8
    return float_weight_bits


def weight_channel_dim(module: nn.Module) -> int:
    """The weight dimension that indexes output channels (rows of an embedding)."""
    if isinstance(module, QuantLayerMixin):
        return module.weight_channel_dim
    if Conv1D is not None and isinstance(module, Conv1D):
        return 1
    return 0


def packed_row_bytes(values_per_row: int, bits: int) -> int:
    """Bytes per output channel: one value per byte above 4 bits, two per byte at 4 bits or fewer."""
    return (values_per_row + 1) // 2 if bits <= 4 else values_per_row


def quantize_rows(
    weight: torch.Tensor, bits: int, channel_dim: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Integer codes of a weight at ``bits``, per output channel, with its scale and zero point.

    The arithmetic is the one of `hf_cpt.quantizer.fake_quantize` with `channel_ranges`, so that
    ``dequantize_rows(*quantize_rows(w, b, d), w.shape, d)`` equals the fake-quantized weight bit for bit.
    Returns codes (uint8, ``[C, K]`` with ``C = w.shape[channel_dim]``), scale and zero point (float32, ``[C]``).
    """
    source = weight.detach().float()
    minimum, maximum = channel_ranges(source, channel_dim)
    levels = num_levels(torch.tensor(float(bits), device=source.device)).to(source.dtype)
    scale = quantization_scale(minimum, maximum, levels)
    codes = (source - minimum).div_(scale).clamp_min_(0.0).clamp_max_(levels).round_()
    channels = weight.shape[channel_dim]
    codes = codes.movedim(channel_dim, 0).reshape(channels, -1).to(torch.uint8)
    return codes, scale.reshape(channels), minimum.reshape(channels)


def dequantize_rows(
    codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, shape: torch.Size, channel_dim: int = 0
) -> torch.Tensor:
    """``codes * scale + zero_point`` in float32, laid out back into ``shape``."""
    values = codes.to(torch.float32).mul_(scale.float().unsqueeze(1)).add_(zero_point.float().unsqueeze(1))
    moved = [shape[channel_dim]] + [s for d, s in enumerate(shape) if d != channel_dim]
    return values.reshape(moved).movedim(0, channel_dim).contiguous()


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``[C, K]`` uint8 codes: unchanged above 4 bits, else value ``2j`` in the low nibble of byte ``j``."""
    if bits > 4:
        return codes.contiguous()
    if codes.shape[1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_codes(packed: torch.Tensor, bits: int, values_per_row: int) -> torch.Tensor:
    """Inverse of `pack_codes`: ``[C, K]`` uint8 codes."""
    if bits > 4:
        return packed
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)[:, :values_per_row]


# ----------------------------------------------------------------------------- what is exported


@dataclass
class ExportPlan:
    """Which tensors of a model an export rewrites."""

    bits: int
    quantized: dict[str, QuantLayerMixin] = field(default_factory=dict)  # CPT layers
    float_packed: dict[str, nn.Module] = field(default_factory=dict)  # FP32-trained weights stored as codes
    float_bits: dict[str, int] = field(default_factory=dict)  # their storage bits
    shared: dict[str, str] = field(default_factory=dict)  # module -> module whose weight it shares
    guard: str | None = None


def _check_model(model: nn.Module) -> None:
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"hf_cpt checkpoints are transformers checkpoints: expected a PreTrainedModel, got {type(model).__name__}. "
            "For a plain nn.Module, save its state_dict (FP32 masters) instead; for a peft model, merge the "
            "adapters first (merge_and_unload) or save with save_format='fp32'."
        )
    if not any(True for _ in quant_layers(model)):
        raise ValueError(
            f"{type(model).__name__} has no CPT layers: convert it with hf_cpt.quantize_model (or train it with "
            "CPTTrainer) before exporting a CPT checkpoint."
        )


def plan_export(model: nn.Module, bits: int, float_weight_bits: int | str | None = "auto") -> ExportPlan:
    """Decide which module weights become codes (and at which bits), which are shared, and the guard tensor."""
    float_weight_bits = check_float_weight_bits(float_weight_bits)
    plan = ExportPlan(bits=bits)
    owner_of: dict[int, str] = {}
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is None:
            continue
        owner = owner_of.setdefault(id(weight), name)
        if isinstance(module, QuantLayerMixin):
            if owner != name:
                raise NotImplementedError(
                    f"CPT layer {name!r} shares its weight with {owner!r}; packed export of tied quantized "
                    "weights is not supported (keep the tied layer in FP32, or use save_format='fp32')."
                )
            plan.quantized[name] = module
        elif isinstance(module, _FLOAT_PACKABLE) and float_weight_bits is not None:
            if owner != name:
                plan.shared[name] = owner
            elif weight.dim() >= 2 and weight.is_floating_point() and weight.numel() > 0:
                plan.float_packed[name] = module
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, module in plan.float_packed.items():
        embedding = id(module.weight) in embedding_weights
        plan.float_bits[name] = float_storage_bits(bits, float_weight_bits, embedding)
    for name, owner in list(plan.shared.items()):
        if owner in plan.quantized:
            raise NotImplementedError(
                f"{name!r} shares its weight with CPT layer {owner!r}; packed export of tied quantized weights "
                "is not supported."
            )
        if owner not in plan.float_packed:
            del plan.shared[name]
    for name in plan.quantized:
        if name not in plan.shared.values():
            plan.guard = name
            break
    return plan


def _quantization_fields(model: nn.Module, cpt_config: CPTConfig | None) -> dict[str, Any]:
    precision = next(layer for _, layer in quant_layers(model)).cpt_precision
    from . import __version__

    return {
        "layer_schemes": {
            name: [layer.cpt_granularity, layer.cpt_rotation_seed]
            for name, layer in quant_layers(model)
            if layer.cpt_granularity != "tensor" or layer.cpt_rotation_seed is not None
        },
        "activation_momentum": precision.activation_momentum,
        "activation_ema_init": precision.activation_ema_init,
        "fused_error_quantizer": precision.fused_error_quantizer,
        "cpt_config": json_safe(cpt_config.to_dict()) if cpt_config is not None else None,
        "hf_cpt_version": __version__,
    }


def _warn_unset_activation_ranges(plan: ExportPlan) -> None:
    unset = [
        name
        for name, layer in plan.quantized.items()
        if layer.cpt_granularity == "tensor" and float(layer.act_min) == 0.0 and float(layer.act_max) == 0.0
    ]
    if unset:
        logger.warning(
            "hf_cpt: %d CPT layer(s) have the activation range [0, 0] (never trained in CPT mode?), e.g. %s; "
            "the exported model quantizes their inputs over that range, as the in-memory model does in eval.",
            len(unset),
            unset[0],
        )


def packed_state_dict(
    model: nn.Module,
    bits: int,
    float_weight_bits: int | str | None = "auto",
    cpt_config: CPTConfig | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The packed state dict of a CPT model at ``bits`` and the ``quantization_config`` fields describing it."""
    _check_model(model)
    check_bits("bits", bits)
    plan = plan_export(model, bits, float_weight_bits)
    _warn_unset_activation_ranges(plan)
    state_dict = dict(model.state_dict())
    for name in list(plan.quantized) + list(plan.float_packed) + list(plan.shared):
        state_dict.pop(f"{name}.weight", None)
    for name, module in list(plan.quantized.items()) + list(plan.float_packed.items()):
        module_bits = bits if name in plan.quantized else plan.float_bits[name]
        # a rotated CPT layer computes with Q(W R): its codes are taken in the rotated basis
        weight = module.rotate_weight(module.weight.detach()) if name in plan.quantized else module.weight
        codes, scale, zero_point = quantize_rows(weight, module_bits, weight_channel_dim(module))
        state_dict[f"{name}.{PACKED}"] = pack_codes(codes, module_bits).cpu()
        state_dict[f"{name}.{SCALE}"] = scale.cpu()
        state_dict[f"{name}.{ZERO_POINT}"] = zero_point.cpu()
        if name in plan.quantized:
            state_dict[f"{name}.{ACT_MIN}"] = module.act_min.detach().float().cpu().clone()
            state_dict[f"{name}.{ACT_MAX}"] = module.act_max.detach().float().cpu().clone()
    state_dict[f"{plan.guard}.weight"] = torch.zeros(0, dtype=torch.uint8)
    fields = {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "checkpoint_format": "packed",
        "bits": bits,
        "float_weight_bits": float_weight_bits,
        "quantized_modules": list(plan.quantized),
        "float_packed_modules": dict(plan.float_bits),
        "shared_weights": dict(plan.shared),
        "guard_tensor": f"{plan.guard}.weight",
        **_quantization_fields(model, cpt_config),
    }
    return state_dict, fields


def portable_state_dict(
    model: nn.Module, bits: int, cpt_config: CPTConfig | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Float state dict with every CPT layer's weight snapped to its ``bits`` grid (plain keys)."""
    _check_model(model)
    check_bits("bits", bits)
    plan = plan_export(model, bits, float_weight_bits=None)
    _warn_unset_activation_ranges(plan)
    state_dict = dict(model.state_dict())
    ranges = {}
    for name, layer in plan.quantized.items():
        snapped = layer.quantized_weight(bits)
        state_dict[f"{name}.weight"] = snapped.to(layer.weight.dtype)
        ranges[name] = [float(layer.act_min), float(layer.act_max)]
    fields = {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "checkpoint_format": "portable",
        "bits": bits,
        "float_weight_bits": None,
        "quantized_modules": list(plan.quantized),
        "activation_ranges": ranges,
        **_quantization_fields(model, cpt_config),
    }
    return state_dict, fields


# ----------------------------------------------------------------------------- writing


def resolve_export_bits(model: nn.Module, bits: int | None, cpt_config: CPTConfig | None) -> int:
    """``bits`` if given, else the run's ``bits_max``, else the precision the model evaluates at."""
    if bits is None and cpt_config is not None and cpt_config.schedule != "fp32":
        bits = cpt_config.bits_max
    if bits is None:
        stored = getattr(getattr(model, "config", None), "quantization_config", None)
        stored_bits = stored.get("bits") if isinstance(stored, dict) else getattr(stored, "bits", None)
        if getattr(stored, "quant_method", None) == QUANT_METHOD or (
            isinstance(stored, dict) and stored.get("quant_method") == QUANT_METHOD
        ):
            bits = stored_bits
    if bits is None:
        layers = [layer for _, layer in quant_layers(model)]
        precision = layers[0].cpt_precision if layers else None
        if precision is not None and precision.eval_enabled and not precision.eval_follows_training:
            bits = int(precision.eval_bits.item())
    if bits is None:
        raise ValueError("Cannot tell the export precision: pass bits=... (or cpt_config=CPTConfig(...)).")
    return check_bits("bits", bits)


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
    is_cpt = quantizer is not None and getattr(quantizer.quantization_config, "quant_method", None) == QUANT_METHOD
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


def write_checkpoint(model: nn.Module, save_directory: str, state_dict: dict, fields: dict, **save_kwargs) -> None:
    """``model.save_pretrained`` with an export's state dict and ``quantization_config`` (the model is unchanged)."""
    from .hf_quantizer import CPTQuantizationConfig

    quantization_config = CPTQuantizationConfig(**fields)
    with _as_export(model, quantization_config):
        model.save_pretrained(save_directory, state_dict=state_dict, **save_kwargs)


def save_quantized(
    model: nn.Module,
    save_directory: str | os.PathLike,
    bits: int | None = None,
    *,
    cpt_config: CPTConfig | None = None,
    float_weight_bits: int | str | None = "auto",
    processing_class: Any = None,
    model_card: bool = True,
    card_info: dict[str, Any] | None = None,
    **save_kwargs: Any,
) -> str:
    """Write a packed CPT checkpoint of ``model`` at ``bits`` (default: ``cpt_config.bits_max``).

    ``float_weight_bits`` is the storage precision of the weights that trained in FP32 (embeddings, the
    kept head, excluded layers), as per-row codes: ``"auto"`` (default) stores embedding tables at 8
    bits when ``bits > 4`` and at 4 bits when ``bits <= 4`` (the bytes per value of the CPT layers)
    and other weights at 8 bits; an integer picks the bits for all of them; ``None`` keeps them exact
    in their float dtype (larger file; outputs then equal the in-memory model's up to float
    re-association, otherwise up to that rounding). ``processing_class`` (tokenizer, image processor) is saved
    alongside; ``model_card`` writes ``README.md`` (and the schedule picture when ``cpt_config`` is
    known); ``card_info`` goes to `write_model_card` (``total_steps``, ``schedule``, ``cost_report``,
    ``eval_metrics``, ``model_name``, ``repo_id``, ...).
    Extra keyword arguments go to ``model.save_pretrained`` (e.g. ``max_shard_size``).
    Load with ``import hf_cpt`` and ``AutoModelFor....from_pretrained(save_directory)``.
    """
    save_directory = os.fspath(save_directory)
    bits = resolve_export_bits(model, bits, cpt_config)
    state_dict, fields = packed_state_dict(model, bits, float_weight_bits, cpt_config)
    write_checkpoint(model, save_directory, state_dict, fields, **save_kwargs)
    _finish_export(model, save_directory, fields, cpt_config, processing_class, model_card, card_info)
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
    """Write a float checkpoint whose CPT-layer weights are snapped to the ``bits`` grid; it loads anywhere.

    Without ``import hf_cpt``, transformers warns about the unknown ``cpt`` quantization and loads a
    plain float model (weights on the grid, activations not quantized). With ``import hf_cpt`` the CPT
    layers and their activation ranges are rebuilt, as from a packed checkpoint. Same size as FP32.
    """
    save_directory = os.fspath(save_directory)
    bits = resolve_export_bits(model, bits, cpt_config)
    state_dict, fields = portable_state_dict(model, bits, cpt_config)
    write_checkpoint(model, save_directory, state_dict, fields, **save_kwargs)
    _finish_export(model, save_directory, fields, cpt_config, processing_class, model_card, card_info)
    return save_directory


def _finish_export(model, save_directory, fields, cpt_config, processing_class, model_card, card_info) -> None:
    if processing_class is not None:
        processing_class.save_pretrained(save_directory)
    if model_card:
        write_model_card(save_directory, model, fields, cpt_config=cpt_config, **(card_info or {}))


def checkpoint_size(path: str | os.PathLike) -> int:
    """Bytes of the weight files (``*.safetensors``) in a checkpoint directory."""
    path = os.fspath(path)
    return sum(
        os.path.getsize(os.path.join(path, name)) for name in os.listdir(path) if name.endswith(".safetensors")
    )


# ----------------------------------------------------------------------------- model card


def json_safe(value: Any) -> Any:
    """``value`` with anything JSON cannot hold (a callable schedule, a tuple) made JSON-friendly."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return getattr(value, "__qualname__", None) or getattr(value, "__name__", None) or repr(value)


def schedule_for_card(cpt_config: CPTConfig, total_steps: int | None = None):
    """The run's `PrecisionSchedule` (a nominal 100 steps per cycle when the length is unknown), or None."""
    from .schedules import schedule_from_config

    steps = total_steps or 100 * cpt_config.num_cycles
    try:
        return schedule_from_config(cpt_config, steps)
    except (ValueError, NotImplementedError, TypeError) as error:
        logger.info("hf_cpt: no schedule picture for the model card (%s).", error)
        return None


def plot_schedule(schedule, path: str, grad_bits: Any = None, export_bits: int | None = None) -> str:
    """Save a PNG of the forward bits at every step of ``schedule`` (a `PrecisionSchedule`).

    ``grad_bits`` (an int, or a schedule of error bits) is drawn too, and so is ``export_bits``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = list(range(schedule.total_steps + 1))  # the last step drawn to the end of the run

    def values(fn) -> list[int]:
        bits = [fn(min(step, schedule.total_steps - 1)) for step in steps]
        return [32 if b is None else b for b in bits]

    figure = Figure(figsize=(7, 3.2), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    forward = values(schedule)
    axes.step(steps, forward, where="post", label="forward bits (weights, activations)")
    plotted = list(forward)
    if callable(grad_bits):
        errors = values(grad_bits)
        axes.step(steps, errors, where="post", color="tab:orange", linestyle="--", label="error bits")
        plotted += errors
    elif grad_bits is not None:
        axes.axhline(grad_bits, color="tab:orange", linestyle="--", label=f"error bits ({grad_bits})")
        plotted.append(grad_bits)
    if export_bits is not None:
        label = f"exported at {export_bits} bits"
        axes.axhline(export_bits, color="tab:green", linestyle=":", linewidth=2, label=label)
        plotted.append(export_bits)
    axes.set_ylim(min(plotted) - 0.5, max(plotted) + 0.5)
    axes.set_xlim(0, schedule.total_steps)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("bits")
    axes.set_title(f"CPT precision schedule {getattr(schedule, 'name', '')!r} over {schedule.total_steps} steps")
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, fontsize=8, frameon=False)
    figure.tight_layout()
    figure.savefig(path)
    return path


def auto_class_name(model: nn.Module) -> str:
    """The ``AutoModelFor...`` class that loads this model's class (``AutoModel`` if none is found)."""
    import transformers
    from transformers.models.auto import modeling_auto

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    class_name = type(model).__name__
    preferred = [
        "AutoModelForCausalLM",
        "AutoModelForSequenceClassification",
        "AutoModelForImageClassification",
        "AutoModelForTokenClassification",
        "AutoModelForQuestionAnswering",
        "AutoModelForMaskedLM",
        "AutoModelForSeq2SeqLM",
        "AutoModel",
    ]
    others = sorted(n for n in dir(modeling_auto) if n.startswith("AutoModel") and n not in preferred)
    for name in preferred + others:
        auto_cls = getattr(transformers, name, None) or getattr(modeling_auto, name, None)
        names = getattr(getattr(auto_cls, "_model_mapping", None), "_model_mapping", None)
        if isinstance(names, dict):
            value = names.get(model_type)
            if value == class_name or (isinstance(value, (list, tuple)) and class_name in value):
                return name
    return "AutoModel"


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, float):
        return str(value) if math.isnan(value) or math.isinf(value) else f"{value:.4g}"
    if isinstance(value, (list, tuple, dict)):
        return "`" + json.dumps(json_safe(value)) + "`"
    return str(value).replace("|", "\\|")


def eval_metrics_from_log_history(log_history: list[dict[str, Any]]) -> dict[str, Any]:
    """The last value of every ``eval_*`` metric in a Trainer's ``state.log_history`` (speed figures left out)."""
    metrics: dict[str, Any] = {}
    for entry in log_history or []:
        for key, value in entry.items():
            if key.startswith("eval_") and not key.endswith(("_runtime", "_per_second")):
                metrics[key] = value
    return metrics


_COST_LABELS = {
    "gbitops": "GBitOPs spent",
    "static_gbitops": "GBitOPs at static bits_max",
    "fp32_gbitops": "GBitOPs in FP32",
    "cost_vs_static": "cost vs static bits_max",
    "cost_vs_fp32": "cost vs FP32",
    "steps": "optimizer steps",
    "steps_at_bits": "steps at each precision",
    "bits_min": "bits_min trained with",
}


def _front_matter(tags: list[str], metadata: dict[str, Any]) -> list[str]:
    lines = ["---", "library_name: transformers"]
    for key, value in metadata.items():
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            lines.append(f"{key}:")
            lines += [f"- {json.dumps(str(item))}" for item in value]
        else:
            lines.append(f"{key}: {json.dumps(str(value))}")
    lines.append("tags:")
    lines += [f"- {tag}" for tag in tags]
    return lines + ["---", ""]


def _table(header: tuple[str, str], rows) -> list[str]:
    return [f"| {header[0]} | {header[1]} |", "|---|---|"] + [f"| {k} | {_fmt(v)} |" for k, v in rows] + [""]


def render_model_card(
    model: nn.Module,
    fields: dict[str, Any] | None,
    cpt_config: CPTConfig | None = None,
    model_name: str | None = None,
    total_steps: int | None = None,
    cost_report: dict[str, Any] | None = None,
    eval_metrics: dict[str, Any] | None = None,
    schedule_plot: str | None = None,
    repo_id: str | None = None,
    training_hyperparameters: dict[str, Any] | None = None,
    tags: list[str] | None = None,
    metadata: dict[str, Any] | None = None,
) -> str:
    """The README.md of a CPT checkpoint, as text. ``fields`` is its ``quantization_config`` (None: FP32 masters)."""
    checkpoint_format = fields["checkpoint_format"] if fields else "fp32"
    bits = fields["bits"] if fields else None
    auto_class = auto_class_name(model)
    location = repo_id or "path/to/this/model"
    all_tags = ["hf-cpt", "cyclic-precision-training"]
    if fields:
        all_tags += ["quantized", f"{bits}-bit"]
    all_tags += [t for t in (tags or []) if t not in all_tags]
    lines = _front_matter(all_tags, metadata or {})
    lines += [f"# {model_name or type(model).__name__}", ""]
    intro = "Trained with **Cyclic Precision Training (CPT)** using [hf-cpt](https://pypi.org/project/hf-cpt/)"
    if checkpoint_format == "packed":
        lines.append(
            f"{intro} and stored as a{'n' if bits == 8 else ''} **{bits}-bit packed CPT checkpoint**: integer weights, "
            "a per-channel scale and zero point, and the activation ranges, in safetensors."
        )
    elif checkpoint_format == "portable":
        lines.append(f"{intro} and exported in the **portable** format: float weights snapped to the {bits}-bit grid.")
    else:
        lines.append(f"{intro}. This checkpoint holds the FP32 master weights of the run (a plain transformers model).")
    lines += ["", "## How to load", ""]
    if checkpoint_format == "packed":
        lines.append(
            "Loading needs hf-cpt: `pip install hf-cpt`, then `import hf_cpt` before `from_pretrained` "
            "(it registers the `cpt` quantization method with transformers)."
        )
    elif checkpoint_format == "portable":
        lines.append(
            "Plain transformers loads it as a float model (weights on the quantization grid, activations not "
            "quantized). To rebuild the CPT layers with their activation quantizers: `pip install hf-cpt`, then "
            "`import hf_cpt` before `from_pretrained`."
        )
    else:
        lines.append(
            "Plain transformers loads it. To fine-tune it with CPT again: `pip install hf-cpt` and "
            "`hf_cpt.CPTTrainer(model=model, cpt_config=...)`."
        )
    lines += ["", "```python"]
    if fields:
        lines.append("import hf_cpt  # noqa: F401  (registers quant_method 'cpt' with transformers)")
    lines += [
        f"from transformers import {auto_class}",
        "",
        f'model = {auto_class}.from_pretrained("{location}")',
        "```",
        "",
    ]
    if checkpoint_format == "packed":
        lines += [
            f"Without `import hf_cpt`, transformers stops with a size-mismatch error on `{fields['guard_tensor']}` "
            f"instead of loading a wrong float model. The loaded model evaluates at {bits} bits with the stored "
            "activation ranges and keeps FP32 master weights (codes x scale + zero point), so it can be trained "
            "further with `hf_cpt.CPTTrainer`.",
            "",
        ]
    if fields:
        rows = [
            ("quant_method", fields["quant_method"]),
            ("format_version", fields["format_version"]),
            ("checkpoint_format", checkpoint_format),
            ("bits (weights and input activations)", bits),
            ("weight quantization", "asymmetric min/max per output channel, zero point = channel minimum"),
            (
                "activation quantization",
                f"asymmetric min/max per tensor, EMA range (momentum {_fmt(fields.get('activation_momentum'))})",
            ),
            ("CPT layers", len(fields["quantized_modules"])),
        ]
        if checkpoint_format == "packed":
            rows.append(("packing", "uint8, " + ("2 codes per byte" if bits <= 4 else "1 code per byte")))
            stored = fields.get("float_packed_modules") or {}
            by_bits = {}
            for name, module_bits in stored.items():
                by_bits.setdefault(module_bits, []).append(name)
            text = "; ".join(
                f"{len(names)} as {b}-bit codes per row ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                for b, names in sorted(by_bits.items())
            )
            rows.append((
                "weights trained in FP32 (embeddings, head)",
                f"{text}, rounded at export" if stored else "stored exactly (float)",
            ))
        lines += ["## Checkpoint format", ""] + _table(("field", "value"), rows)
    if cpt_config is not None:
        lines += ["## CPT training settings", ""]
        lines += _table(("setting", "value"), json_safe(cpt_config.to_dict()).items())
        lines += ["## Precision schedule", ""]
        grad = (
            f"errors follow the `{json_safe(cpt_config.grad_schedule)}` schedule up to {cpt_config.grad_bits} bits"
            if getattr(cpt_config, "grad_schedule", None) is not None
            else f"errors are quantized at {cpt_config.grad_bits} bits with stochastic rounding"
        )
        lines.append(
            f"Forward bits (weights and activations) follow the `{json_safe(cpt_config.schedule)}` schedule between "
            f"{cost_report.get('bits_min', cpt_config.bits_min) if cost_report else cpt_config.bits_min} and "
            f"{cpt_config.bits_max} bits over {cpt_config.num_cycles} cycles"
            + (f" of a {total_steps}-step run" if total_steps else "")
            + f"; {grad}."
        )
        if schedule_plot:
            note = "" if total_steps else " (run length unknown: the shape over a nominal 100 steps per cycle)"
            lines += ["", f"![CPT precision schedule]({schedule_plot}){note}"]
        lines.append("")
    if cost_report:
        rows = [(_COST_LABELS.get(k, k), v) for k, v in cost_report.items() if k != "cpt_config"]
        lines += ["## Training cost", ""] + _table(("figure", "value"), rows)
    if eval_metrics:
        lines += ["## Evaluation", ""] + _table(("metric", "value"), eval_metrics.items())
    if training_hyperparameters:
        lines += ["## Training hyperparameters", ""]
        lines += _table(("hyperparameter", "value"), training_hyperparameters.items())
    return "\n".join(lines)


def write_model_card(
    save_directory: str,
    model: nn.Module,
    fields: dict[str, Any] | None,
    cpt_config: CPTConfig | None = None,
    total_steps: int | None = None,
    schedule: Any = None,
    grad_schedule: Any = None,
    **card: Any,
) -> str:
    """Write ``README.md`` (and ``cpt_schedule.png`` when the schedule is known) into ``save_directory``.

    ``schedule`` is the run's `PrecisionSchedule` (``grad_schedule`` its error-bits schedule, if any); by
    default it is rebuilt from ``cpt_config`` over ``total_steps`` (or a nominal 100 steps per cycle).
    ``card`` goes to `render_model_card` (``model_name``, ``cost_report``, ``eval_metrics``, ``repo_id``,
    ``training_hyperparameters``, ``tags``, ``metadata``).
    """
    schedule_plot = None
    if schedule is None and cpt_config is not None:
        schedule = schedule_for_card(cpt_config, total_steps)
    if schedule is not None:
        grad = grad_schedule
        if grad is None and cpt_config is not None and cpt_config.schedule != "fp32":
            grad = cpt_config.grad_bits
        export_bits = fields["bits"] if fields else None
        plot_schedule(schedule, os.path.join(save_directory, SCHEDULE_PLOT_NAME), grad, export_bits)
        schedule_plot = SCHEDULE_PLOT_NAME
    text = render_model_card(
        model, fields, cpt_config=cpt_config, total_steps=total_steps, schedule_plot=schedule_plot, **card
    )
    path = os.path.join(save_directory, MODEL_CARD_NAME)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path
