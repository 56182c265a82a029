"""Model cards of CPT checkpoints: settings, schedule picture, cost, metrics, how to load."""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

from torch import nn

from ..config import AUTO_STEPS_PER_CYCLE, CPTConfig
from ..utils import json_safe
from ..version import INSTALL_HINT
from .format import CheckpointFields

logger = logging.getLogger(__name__)

MODEL_CARD_NAME = "README.md"
SCHEDULE_PLOT_NAME = "cpt_schedule.png"

def schedule_for_card(cpt_config: CPTConfig, total_steps: int | None = None):
    """The run's `PrecisionSchedule` (a nominal 100 steps per cycle when the length is unknown), or None."""
    nominal_cycles = cpt_config.num_cycles if cpt_config.num_cycles != "auto" else 1
    steps = total_steps or 100 * nominal_cycles
    try:
        return cpt_config.schedule_config.forward_schedule(steps)
    except (ValueError, NotImplementedError, TypeError) as error:
        logger.info("hf_cpt: no schedule picture for the model card (%s).", error)
        return None


def plot_schedule(schedule, path: str, grad_bits: Any = None, export_bits: int | None = None) -> str:
    """Save a PNG of the forward bits at every step of ``schedule`` (a `PrecisionSchedule`).

    ``grad_bits`` (an int, or a schedule of error bits) is drawn too, and so is ``export_bits``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    stride = max(1, schedule.total_steps // 4000)  # a picture's worth of steps, not every step of a long run
    steps = list(range(0, schedule.total_steps, stride)) + [schedule.total_steps]  # the last drawn to the end

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
    preferred = ["AutoModelForCausalLM", "AutoModelForSequenceClassification", "AutoModelForImageClassification",
        "AutoModelForTokenClassification", "AutoModelForQuestionAnswering", "AutoModelForMaskedLM",
        "AutoModelForSeq2SeqLM", "AutoModel"]
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


_COST_LABELS = {"gbitops": "GBitOPs spent", "static_gbitops": "GBitOPs at static bits_max",
    "fp32_gbitops": "GBitOPs in FP32", "cost_vs_static": "cost vs static bits_max", "cost_vs_fp32": "cost vs FP32",
    "steps": "optimizer steps", "steps_at_bits": "steps at each precision", "bits_min": "bits_min trained with"}


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


def _activation_text(fields: CheckpointFields) -> str:
    schemes = fields.layer_schemes or {}
    per_tensor = len(fields.quantized_modules) - sum(1 for n in schemes if n in fields.quantized_modules)
    label = {"token": "per token (each row's min/max)", "tensor": "per tensor", "none": "none (weights only)"}
    counts: dict[str, int] = {}
    for granularity, seed in schemes.values():
        text = label[granularity] + (f", after a Hadamard rotation (seed {seed})" if seed is not None else "")
        counts[text] = counts.get(text, 0) + 1
    if per_tensor:
        momentum = _fmt(fields.activation_momentum)
        counts[f"asymmetric min/max per tensor, EMA range (momentum {momentum})"] = per_tensor
    return "; ".join(f"{text}: {n} layers" for text, n in counts.items())


def _exactness_section(fields: CheckpointFields) -> list[str]:
    """Whether the checkpoint reproduces the trained model, and what a lossy export changed (measured)."""
    if fields.checkpoint_format == "portable":
        return ["## Exactness", "", "Not the trained model's computation: the weights are the trained ones on the "
                f"{fields.bits}-bit grid, but activations and attention products are not quantized.", ""]
    effect = fields.export_effect if not fields.packed else fields.rounding_effect
    if fields.packed and not fields.float_packed_modules:
        return ["## Exactness", "", "This checkpoint is **exact**: loaded with `import hf_cpt`, it reproduces the "
                f"trained model evaluated at {fields.bits} bits: the layers compute with the stored codes, "
                "rotations and activation ranges, and attention runs through the same function (max relative output "
                "difference at most 1e-5; 0 in hf-cpt's tests).", ""]
    if fields.packed:
        lines = ["## Exactness: a lossy export", "", "Weights that trained in FP32 were **rounded after training** "
                 f"(`float_weight_bits={fields.float_weight_bits!r}`), so this checkpoint does not reproduce the "
                 "trained model exactly."]
    else:
        float_layers = effect.get("float_layers", {})
        lines = ["## Exactness", "", "Layers in the format's int8 scheme compute what the trained layers compute, to "
                 "float rounding (a rounding tie can still flip an activation code). "
                 + (f"{sum(map(len, float_layers.values()))} CPT layer(s) run in float here: "
                    + "; ".join(f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''} ({reason})"
                                for reason, names in float_layers.items()) + "." if float_layers else "")]
    if effect and "examples" in effect:
        lines += ["Measured at export against the trained model on "
                  f"{effect['examples']} examples ({effect['inputs']}):", ""]
        rows = [("max relative output change", effect["max_relative_output_change"]),
                ("predictions that flip", f"{100 * effect['flipped_predictions']:.1f}%")]
        if "loss_change" in effect:
            rows.append(("loss change", effect["loss_change"]))
        lines += _table(("figure", "value"), rows)
    else:
        lines.append("")
    return lines


def _profile_section(profile: list[dict[str, Any]]) -> list[str]:
    """The evaluation metrics at each precision (`CPTTrainer.evaluate_precisions`), to pick a deployment precision."""
    metrics = [k for k in profile[0] if k != "bits" and not k.endswith(("runtime", "per_second"))]
    lines = ["## Precision profile", "", "The trained model evaluated at each precision (`evaluate_precisions`); "
             "a packed export at any of these bits reproduces its row.", "",
             "| bits | " + " | ".join(metrics) + " |", "|---|" + "---|" * len(metrics)]
    lines += ["| " + str(row["bits"]) + " | " + " | ".join(_fmt(row.get(m)) for m in metrics) + " |" for row in profile]
    return lines + [""]


def _intro_section(model_name: str, fields: CheckpointFields | None) -> list[str]:
    intro = "Trained with **Cyclic Precision Training (CPT)** using hf-cpt"
    lines = [f"# {model_name}", ""]
    if fields is None:
        return lines + [f"{intro}. This checkpoint holds the FP32 master weights of the run (a plain transformers "
                        "model)."]
    if fields.packed:
        return lines + [
            f"{intro} and stored as a{'n' if fields.bits == 8 else ''} **{fields.bits}-bit packed CPT checkpoint**: "
            "integer weights, a per-channel scale and zero point, and the activation ranges, in safetensors."
        ]
    if fields.checkpoint_format == "compressed-tensors":
        return lines + [f"{intro} and exported in the **compressed-tensors** format (`int-quantized`): "
                        f"{fields.bits}-bit integer weights per output channel with their inputs' quantization, which "
                        "transformers runs without hf-cpt (the CPT settings: `cpt_config.json`)."]
    return lines + [f"{intro} and exported in the **portable** format: a plain float checkpoint whose quantized "
                    f"layers' weights are snapped to the {fields.bits}-bit grid (the CPT settings: `cpt_config.json`)."]


def _loading_section(model: nn.Module, fields: CheckpointFields | None, repo_id: str | None) -> list[str]:
    auto_class = auto_class_name(model)
    lines = ["", "## How to load", ""]
    if fields is None:
        lines.append(
            f"Plain transformers loads it. To fine-tune it with CPT again: {INSTALL_HINT}, and use "
            "`hf_cpt.CPTTrainer(model=model, cpt_config=...)`."
        )
    elif fields.packed:
        lines.append(
            f"Loading needs hf-cpt: {INSTALL_HINT}, then `import hf_cpt` before `from_pretrained` "
            "(it registers the `cpt` quantization method with transformers)."
        )
    elif fields.checkpoint_format == "compressed-tensors":
        lines.append("transformers loads it with the compressed-tensors package (`pip install compressed-tensors`), "
                     "without hf-cpt.")
    else:
        lines.append(
            "Any reader of transformers checkpoints loads it, without hf-cpt, as a float model (weights on the "
            "quantization grid, activations not quantized)."
        )
    lines += ["", "```python"]
    if fields is not None and fields.packed:
        lines.append("import hf_cpt  # noqa: F401  (registers quant_method 'cpt' with transformers)")
    lines += [f"from transformers import {auto_class}", "",
              f'model = {auto_class}.from_pretrained("{repo_id or "path/to/this/model"}")', "```", ""]
    if fields is not None and fields.packed:
        lines += [
            f"Without `import hf_cpt`, transformers stops with a size-mismatch error on `{fields.guard_tensor}` "
            f"instead of loading a wrong float model. The loaded model evaluates at {fields.bits} bits with the "
            "stored activation ranges and keeps FP32 master weights (codes x scale + zero point), so it can be "
            "trained further with `hf_cpt.CPTTrainer`.",
            "",
        ]
    return lines


def _format_section(fields: CheckpointFields) -> list[str]:
    rows = [
        ("quant_method", fields.quant_method if fields.packed else "none (a plain float checkpoint)"
         if fields.checkpoint_format == "portable" else "compressed-tensors (int-quantized, float zero points)"),
        ("format_version", fields.format_version),
        ("checkpoint_format", fields.checkpoint_format),
        ("bits (weights and input activations)", fields.bits),
        ("weight quantization", "asymmetric min/max per output channel, zero point = channel minimum"),
        ("activation quantization", _activation_text(fields)),
        ("CPT layers", len(fields.quantized_modules)),
    ]
    if fields.packed:
        rows.append(("packing", "uint8, " + ("2 codes per byte" if fields.bits <= 4 else "1 code per byte")))
        stored = fields.float_packed_modules or {}
        by_bits = {}
        for name, module_bits in stored.items():
            by_bits.setdefault(module_bits, []).append(name)
        text = "; ".join(
            f"{len(names)} as {b}-bit codes per row ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
            for b, names in sorted(by_bits.items())
        )
        rows.append(("weights trained in FP32 (embeddings, head)",
            f"{text}, rounded at export (lossy, see below)" if stored else "stored exactly (float)"))
    return ["## Checkpoint format", ""] + _table(("field", "value"), rows) + _exactness_section(fields)


def _settings_section(cpt_config: CPTConfig, total_steps: int | None, cost_report: dict[str, Any] | None,
                      schedule_plot: str | None) -> list[str]:
    lines = ["## CPT training settings", ""]
    lines += _table(("setting", "value"), json_safe(cpt_config.to_dict()).items())
    lines += ["## Precision schedule", ""]
    grad = (
        f"errors follow the `{json_safe(cpt_config.grad_schedule)}` schedule up to {cpt_config.grad_bits} bits"
        if cpt_config.grad_schedule is not None
        else f"errors are quantized at {cpt_config.grad_bits} bits with stochastic rounding"
    )
    bits_min = cost_report.get("bits_min", cpt_config.bits_min) if cost_report else cpt_config.bits_min
    cycles = (f"{cpt_config.cycles_for(total_steps)} cycles" if total_steps or cpt_config.num_cycles != "auto"
              else f"one cycle per {AUTO_STEPS_PER_CYCLE} optimizer steps")
    lines.append(
        f"Forward bits (weights and activations) follow the `{json_safe(cpt_config.schedule)}` schedule between "
        f"{bits_min} and {cpt_config.bits_max} bits over {cycles}"
        + (f" of a {total_steps}-step run" if total_steps else "") + f"; {grad}."
    )
    if schedule_plot:
        note = "" if total_steps else " (run length unknown: the shape over a nominal 100 steps per cycle)"
        lines += ["", f"![CPT precision schedule]({schedule_plot}){note}"]
    return lines + [""]


def render_model_card(
    model: nn.Module,
    fields: CheckpointFields | None,
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
    precision_profile: list[dict[str, Any]] | None = None,
) -> str:
    """The README.md of a CPT checkpoint, as text. ``fields`` is its ``quantization_config`` (None: FP32 masters)."""
    all_tags = ["hf-cpt", "cyclic-precision-training"]
    if fields is not None:
        all_tags += ["quantized", f"{fields.bits}-bit"]
    all_tags += [t for t in (tags or []) if t not in all_tags]
    lines = _front_matter(all_tags, metadata or {})
    lines += _intro_section(model_name or type(model).__name__, fields)
    lines += _loading_section(model, fields, repo_id)
    if fields is not None:
        lines += _format_section(fields)
    if cpt_config is not None:
        lines += _settings_section(cpt_config, total_steps, cost_report, schedule_plot)
    if cost_report:
        rows = [(_COST_LABELS.get(k, k), v) for k, v in cost_report.items() if k != "cpt_config"]
        lines += ["## Training cost", ""] + _table(("figure", "value"), rows)
    if eval_metrics:
        lines += ["## Evaluation", ""] + _table(("metric", "value"), eval_metrics.items())
    if precision_profile:
        lines += _profile_section(precision_profile)
    if training_hyperparameters:
        lines += ["## Training hyperparameters", ""]
        lines += _table(("hyperparameter", "value"), training_hyperparameters.items())
    return "\n".join(lines)


def write_model_card(
    save_directory: str,
    model: nn.Module,
    fields: CheckpointFields | None,
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
        export_bits = fields.bits if fields else None
        try:
            plot_schedule(schedule, os.path.join(save_directory, SCHEDULE_PLOT_NAME), grad, export_bits)
            schedule_plot = SCHEDULE_PLOT_NAME
        except ImportError:  # matplotlib is optional (the `plot` extra): the card goes without its picture
            logger.info("hf_cpt: matplotlib is not installed; the model card has no schedule picture.")
    text = render_model_card(model, fields, cpt_config=cpt_config, total_steps=total_steps, schedule_plot=schedule_plot,
        **card)
    path = os.path.join(save_directory, MODEL_CARD_NAME)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path
