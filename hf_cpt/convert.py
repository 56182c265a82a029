"""Model surgery: swap float layers for quantized ones in place, and back. `quantize_model` reports what it
converted and what it kept, and why; by default (as in the papers) embeddings, norms and the output head stay FP32.
"""

from __future__ import annotations

import copy
import functools
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .config import ActivationConfig, CPTConfig, ModuleSelection, WeightConfig
from .config.parts import PART_FIELDS
from .nn.attention import attention_support, install_attention, uninstall_attention
from .nn.base import QuantLayerMixin, input_features
from .nn.layers import QUANT_EMBEDDING_CLASSES, QUANT_LAYER_CLASSES, convert_layer, restore_layer
from .nn.precision import PrecisionState
from .nn.recompute import convert_activation, restore_activation
from .numerics import native
from .numerics.bits import check_bits
from .numerics.errors import ErrorQuantization
from .numerics.rotation import can_rotate
from .utils import model_embeddings

# Module names that hold a model's output head in transformers and timm models.
HEAD_MODULE_NAMES = ("lm_head", "classifier", "score", "head", "qa_outputs", "cls")
ADAPTER_MARKERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


@dataclass
class QuantizationReport:
    """What `quantize_model` did: converted layer names, and kept layers with the reason."""

    quantized: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    schemes: dict[str, str] = field(default_factory=dict)  # quantized layer -> its activation scheme
    not_rotated: dict[str, str] = field(default_factory=dict)  # layers a rotated scheme could not rotate, why
    attention: str = "not counted"  # the attention products: quantized / counted in full precision / why not
    # activations that recompute their input from a product's codes in backward (`hf_cpt.nn.recompute`)
    recomputing: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"hf_cpt: {len(self.quantized)} layers quantized, {len(self.kept)} kept in full precision"]
        counts = Counter(self.schemes.values())
        if counts:
            lines.append("  activation schemes: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
        lines += [f"  kept {name}: {reason}" for name, reason in self.kept.items()]
        lines += [f"  not rotated {name}: {reason}" for name, reason in self.not_rotated.items()]
        lines.append(f"  attention products: {self.attention}")
        if self.recomputing:
            lines.append(f"  activations that recompute their input where a product on codes feeds them: "
                         f"{len(self.recomputing)}")
        return "\n".join(lines)


def resolve_scheme(quant_scheme: str, module: nn.Module) -> tuple[str, bool]:
    """(activation granularity, rotate?) of one layer under ``CPTConfig.quant_scheme``.

    "auto" is "rotated-per-token" for Linear / Conv1D layers (transformers: outlier features, measured in
    docs/pretrained.md) and "paper" for Conv2d (the CNNs the CPT paper trains from scratch).
    """
    if quant_scheme == "auto":
        quant_scheme = "paper" if isinstance(module, nn.Conv2d) else "rotated-per-token"
    granularity = "token" if quant_scheme in ("per-token", "rotated-per-token") else "tensor"
    return granularity, quant_scheme in ("rotated", "rotated-per-token")


def scheme_name(granularity: str, rotated: bool) -> str:
    """The `CPTConfig.quant_scheme` value of a resolved (granularity, rotated) pair."""
    if granularity == "token":
        return "rotated-per-token" if rotated else "per-token"
    return "rotated" if rotated else "paper"


def _rotation_obstacle(module: nn.Module) -> str | None:
    if isinstance(module, nn.Conv2d) and module.groups != 1:
        return f"grouped convolution (groups={module.groups}) cannot be rotated"
    features = input_features(module)
    if not can_rotate(features):
        return f"no fast rotation of {features} features"
    return None


def matches_any(name: str, patterns: list[str] | None) -> str | None:
    """The first pattern naming this module: exact name, dotted suffix, or a full regex match."""
    for pattern in patterns or ():
        if name == pattern or name.endswith("." + pattern) or re.fullmatch(pattern, name):
            return pattern
    return None


def layer_settings_changed(model: nn.Module, config: CPTConfig) -> dict[str, tuple[Any, Any]]:
    """The settings that decide how the layers compute (modules, activations, weights, errors) on which ``config``
    differs from the config ``model`` was quantized with: {flat name: (then, now)}; empty for a model loaded from a
    checkpoint."""
    used = find_precision_state(model).quantized_with
    parts = (ModuleSelection, ActivationConfig, WeightConfig, ErrorQuantization)
    names = [flat for part in parts for flat in PART_FIELDS[part].values()]
    return {} if used is None else {name: (getattr(used, name), getattr(config, name)) for name in names
                                    if getattr(used, name) != getattr(config, name)}


def _check_patterns(model: nn.Module, config: CPTConfig) -> None:
    """Every module pattern of ``config`` names a module of ``model``: a typo is an error, before any work."""
    names = [name for name, _ in model.named_modules() if name]
    for field_name in ("target_modules", "include_modules", "exclude_modules"):
        for pattern in getattr(config, field_name) or ():
            if not any(matches_any(name, [pattern]) for name in names):
                raise ValueError(f"CPTConfig.{field_name}: the pattern {pattern!r} matches no module of "
                                 f"{type(model).__name__} (its modules are named like {names[:3]} ... {names[-2:]}).")


def output_head_names(model: nn.Module) -> set[str]:
    """Names of the modules that form the output head, found generically."""
    names_by_id = {id(module): name for name, module in model.named_modules()}
    heads: set[str] = set()
    candidates = [model_embeddings(model, "output")]
    for module in model.modules():
        get_classifier = getattr(module, "get_classifier", None)  # timm models
        if callable(get_classifier):
            try:
                candidates.append(get_classifier())
            except (NotImplementedError, AttributeError, TypeError):
                pass
    for candidate in candidates:
        if isinstance(candidate, nn.Module) and id(candidate) in names_by_id:
            heads.add(names_by_id[id(candidate)])
    for name, _ in model.named_modules():
        if name.rsplit(".", 1)[-1] in HEAD_MODULE_NAMES:
            heads.add(name)
    heads.discard("")
    return heads


def _inside(name: str, parents: set[str]) -> bool:
    return any(name == parent or name.startswith(parent + ".") for parent in parents)


def _is_candidate_layer(module: nn.Module) -> bool:
    return isinstance(module, tuple(QUANT_LAYER_CLASSES)) and not isinstance(module, QuantLayerMixin)


def quant_layers(model: nn.Module) -> Iterator[tuple[str, QuantLayerMixin]]:
    """The quantized layers of a model, with their names."""
    for name, module in model.named_modules():
        if isinstance(module, QuantLayerMixin):
            yield name, module


def find_precision_state(model: nn.Module) -> PrecisionState:
    """The `PrecisionState` shared by a quantized model's layers."""
    for _, layer in quant_layers(model):
        return layer.cpt_precision
    raise ValueError(
        f"{type(model).__name__} has no CPT-quantized layers: call hf_cpt.quantize_model(model, config) "
        "first (CPTTrainer does it for you)."
    )


def is_quantized(model: nn.Module) -> bool:
    return any(True for _ in quant_layers(model))


def quantize_model(model: nn.Module, config: CPTConfig | None = None) -> QuantizationReport:
    """Convert the model's Linear / Conv2d / Conv1D layers to CPT layers in place.

    Call it before creating the optimizer and before ``accelerator.prepare`` (CPTTrainer does):
    parameters are kept as the same objects, but wrappers such as DDP or FSDP fix their view of the
    model when they are created. The model starts in full precision until `set_precision` is called.
    """
    config = config or CPTConfig()
    if is_quantized(model):
        raise ValueError(f"{type(model).__name__} is already CPT-quantized; call hf_cpt.dequantize_model first.")
    _check_patterns(model, config)
    heads = output_head_names(model)
    precision = PrecisionState.from_settings(config)
    precision.quantized_with = config
    report = QuantizationReport()
    for name, module in list(model.named_modules()):
        if _is_candidate_layer(module):
            _convert_layer(name, module, config, precision, report, heads)
    if config.quantize_embeddings:
        _quantize_embeddings(model, config, precision, report)
    if not report.quantized:
        raise ValueError(
            "hf_cpt.quantize_model found no layer to quantize in "
            f"{type(model).__name__}:\n{report}\nCheck CPTConfig.target_modules / exclude_modules."
        )
    report.attention = _prepare_attention(model, config, precision)
    if config.runtime.recompute_activation_inputs:
        report.recomputing = [name for name, module in _beside_quantized_layers(model, config)
                              if convert_activation(module)]
    if config.quantize_adapters:  # adapters loaded later with plain peft (``PeftModel.from_pretrained``)
        model.register_load_state_dict_post_hook(functools.partial(_quantize_loaded_adapters, config))
    if any(p.device.type == "cpu" for p in model.parameters()):
        native.build_ahead()  # the CPU kernels, built while the run sets up (a new machine; else nothing to do)
    precision.set(None, None)
    eval_bits = config.eval_precision
    precision.set_eval(eval_bits, follow_training=config.eval_bits == "current")
    return report


def _beside_quantized_layers(model: nn.Module, config: CPTConfig) -> list[tuple[str, nn.Module]]:
    """The modules that may read a quantized layer's output, and so may be converted to keep less for the backward
    (activations): those whose parent module holds a quantized layer, outside
    ``exclude_modules``. A module elsewhere (outside ``target_modules``, beside full-precision layers only) keeps its
    own class."""
    parents = {name.rpartition(".")[0] for name, _ in quant_layers(model)}
    holders = {prefix for parent in parents for prefix in _prefixes(parent)}
    return [(name, module) for name, module in list(model.named_modules())
            if name and name.rpartition(".")[0] in holders and matches_any(name, config.exclude_modules) is None]


def _prefixes(name: str) -> list[str]:
    """``name`` and every module above it (``"a.b"``: ``"a.b"``, ``"a"``, ``""``)."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts) + 1)]


def attention_granularity(config: CPTConfig) -> str:
    """The attention inputs' ranges: per token when the scheme gives Linear layers per-token activations."""
    return resolve_scheme(config.quant_scheme, nn.Linear(1, 1))[0]


def _prepare_attention(model: nn.Module, config: CPTConfig, precision: PrecisionState) -> str:
    """Route attention through the ``"cpt"`` function: quantized when asked, else only counted for the cost
    meter (eager and SDPA models; other kernels keep theirs). Returns the report's line."""
    reason = attention_support(model)
    if reason is not None:
        if config.quantize_attention:
            raise ValueError(f"CPTConfig.quantize_attention=True cannot be applied: {reason}.")
        return f"not counted ({reason})"
    granularity = attention_granularity(config)
    current = model.config._attn_implementation or "eager"
    if not config.quantize_attention and current not in ("eager", "sdpa"):
        return f"not counted (attn_implementation={current!r} is kept)"
    install_attention(model, precision, config.quantize_attention, granularity, fixed_bits=config.attention_bits,
                      quantize_errors=config.attention_errors)
    if config.quantize_attention:
        at = "the forward bits" if config.attention_bits is None else f"{config.attention_bits} bits"
        errors = "" if config.attention_errors else ", errors in full precision"
        return f"quantized ({'per token' if granularity == 'token' else 'per tensor'}) at {at}{errors}, counted there"
    return f"full precision ({current}), counted at 32 bits"


def _quantize_embeddings(model: nn.Module, config: CPTConfig, precision: PrecisionState, report) -> None:
    """Convert embedding tables (weights only), then the layers that share their weight (a tied output head)."""
    embedding_weights = set()
    for name, module in list(model.named_modules()):
        if type(module) not in QUANT_EMBEDDING_CLASSES:
            continue
        pattern = matches_any(name, config.exclude_modules)
        if pattern is not None:
            report.kept[name] = f"excluded by exclude_modules pattern {pattern!r}"
            continue
        convert_layer(module, precision, "none")
        report.quantized.append(name)
        report.schemes[name] = "weights only"
        embedding_weights.add(id(module.weight))
    for name, module in list(model.named_modules()):
        if id(getattr(module, "weight", None)) in embedding_weights and not isinstance(module, QuantLayerMixin):
            if type(module) not in QUANT_LAYER_CLASSES:
                raise ValueError(f"{name} ({type(module).__name__}) shares an embedding's weight and cannot follow its "
                                 "quantization; set CPTConfig(quantize_embeddings=False).")
            convert_layer(module, precision, "none")
            report.kept.pop(name, None)
            report.quantized.append(name)
            report.schemes[name] = "weights only (tied to an embedding)"


def _reason_to_keep(name: str, module: nn.Module, config: CPTConfig, heads: set[str]) -> str | None:
    if type(module) not in QUANT_LAYER_CLASSES:
        return f"{type(module).__name__} subclasses {type(module).__mro__[1].__name__} with its own forward"
    if not config.quantize_adapters and _is_adapter(name):
        return "peft adapter (set quantize_adapters=True to quantize it)"
    pattern = matches_any(name, config.exclude_modules)
    if pattern is not None:
        return f"excluded by exclude_modules pattern {pattern!r}"
    if matches_any(name, config.include_modules):
        return None
    if config.target_modules is not None and matches_any(name, config.target_modules) is None:
        return "not matched by target_modules"
    if _inside(name, heads):
        return "output head (kept FP32 as in the papers; list it in include_modules to quantize it)"
    return None


def _convert_layer(name: str, module: nn.Module, config: CPTConfig, precision: PrecisionState,
                   report: QuantizationReport, heads: set[str]) -> None:
    """Convert one candidate layer as ``config`` selects it, or note in ``report`` why it stays."""
    reason = _reason_to_keep(name, module, config, heads)
    if reason is not None:
        report.kept[name] = reason
        return
    granularity, rotate = resolve_scheme(config.quant_scheme, module)
    if rotate:
        obstacle = _rotation_obstacle(module)
        if obstacle is not None:
            rotate = False
            report.not_rotated[name] = obstacle
    convert_layer(module, precision, granularity, config.rotation_seed if rotate else None)
    report.quantized.append(name)
    report.schemes[name] = scheme_name(granularity, rotate)


def _is_adapter(name: str) -> bool:
    return any(marker in name.split(".") for marker in ADAPTER_MARKERS)


def quantize_adapters(model: nn.Module, config: CPTConfig | None = None) -> QuantizationReport:
    """Quantize the peft adapter layers (``lora_A`` / ``lora_B``) added to a quantized model after `quantize_model`
    (``get_peft_model``, ``PeftModel.from_pretrained``), in place, with the model's precision and ``config``'s
    scheme (give the run's config; default `CPTConfig()`). `CPTCallback` and `CPTTrainer` call it when a run starts
    with ``quantize_adapters=True``; call it after loading adapters onto a quantized base."""
    config = copy.copy(config or CPTConfig())
    config.quantize_adapters = True
    precision, heads = find_precision_state(model), output_head_names(model)
    report = QuantizationReport()
    for name, module in list(model.named_modules()):
        if _is_candidate_layer(module) and _is_adapter(name):
            _convert_layer(name, module, config, precision, report, heads)
    return report


def _quantize_loaded_adapters(config: CPTConfig, model: nn.Module, incompatible_keys) -> None:
    """A load_state_dict post-hook (``quantize_adapters=True``): peft loads adapters by creating float ``lora_A`` /
    ``lora_B`` layers and loading their weights through ``load_state_dict``; then they are quantized as the run's."""
    if is_quantized(model):
        quantize_adapters(model, config)


def dequantize_model(model: nn.Module) -> nn.Module:
    """Restore plain float layers, keeping the trained weights (in place; returns the model)."""
    for _, layer in list(quant_layers(model)):
        restore_layer(layer)
    uninstall_attention(model)
    for module in model.modules():
        restore_activation(module)
    return model


def activation_ranges(model: nn.Module) -> dict[str, torch.Tensor]:
    """The running input ranges of every quantized layer, ``{"<layer>.act_min": t, "<layer>.act_max": t}``."""
    ranges = {}
    for name, layer in quant_layers(model):
        ranges[f"{name}.act_min"] = layer.act_min.detach().cpu().clone()
        ranges[f"{name}.act_max"] = layer.act_max.detach().cpu().clone()
    return ranges


def load_activation_ranges(model: nn.Module, ranges: dict[str, torch.Tensor]) -> None:
    """Restore what `activation_ranges` returned; a layer missing from ``ranges`` is an error."""
    for name, layer in quant_layers(model):
        for key in ("act_min", "act_max"):
            if f"{name}.{key}" not in ranges:
                raise KeyError(f"no saved activation range {name}.{key}")
            getattr(layer, key).copy_(ranges[f"{name}.{key}"])
        layer.__dict__["_act_range_initialized"] = True


def set_precision(
    model: nn.Module,
    bits: int | None,
    grad_bits: int | None = None,
) -> None:
    """Set the training precision of every quantized layer of ``model`` (None = full precision).

    For custom training loops: call it before each step with the bits of a schedule.
    """
    for name, value in (("bits", bits), ("grad_bits", grad_bits)):
        if value is not None:
            check_bits(f"set_precision: {name} (or None)", value)
    find_precision_state(model).set(bits, grad_bits)


def set_eval_precision(model: nn.Module, bits: int | None, follow_training: bool = False) -> None:
    """Set the precision used in eval mode (None = full precision; or follow the training bits)."""
    if bits is not None:
        check_bits("set_eval_precision: bits (or None)", bits)
    find_precision_state(model).set_eval(bits, follow_training)
