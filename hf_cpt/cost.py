"""Training cost in bit operations (docs/method.md §7): each quantized GEMM or convolution costs
``MACs * (b_w * b_a + b_e * b_w + b_e * b_a)`` a step, full precision 32 bits, MACs from the layers' real input shapes;
the ``"cpt"`` attention products count the same way, rotations apart (``rotation_bitops``), a recomputed input again.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from .nn.attention import find_attention_quantizer
from .nn.base import QuantLayerMixin
from .nn.layers import QUANT_LAYER_CLASSES
from .nn.tally import Tally
from .numerics.bitops import bitops_per_mac, rotation_bitops_per_value


def layer_macs(module: nn.Module, output: torch.Tensor) -> int:
    """Forward multiply-accumulates of one Linear / Conv2d / Conv1D call, from its output shape."""
    if isinstance(module, nn.Conv2d):
        kernel_h, kernel_w = module.kernel_size
        return output.numel() * (module.in_channels // module.groups) * kernel_h * kernel_w
    if isinstance(module, nn.Linear):
        return output.numel() * module.in_features
    return output.numel() * module.weight.shape[0]  # Conv1D: weight is (in, out)


@dataclass
class CostTotals:
    """Cumulative cost of a run, in bit operations."""

    bitops: float = 0.0
    rotation_bitops: float = 0.0  # share of ``bitops`` spent rotating inputs and weights
    static_bitops: float = 0.0  # the same steps at static bits_max / grad_bits
    fp32_bitops: float = 0.0  # the same steps in full precision
    steps: int = 0
    steps_at_bits: Counter = field(default_factory=Counter)
    quantized_macs: float = 0.0  # forward MACs of quantized layers over the run (quantized steps)
    float_macs: float = 0.0  # forward MACs that ran in full precision (FP32 layers, FP32 steps)

    def as_logs(self, prefix: str = "cpt/") -> dict[str, float]:
        logs = {f"{prefix}gbitops": self.bitops / 1e9}
        if self.static_bitops:
            logs[f"{prefix}cost_vs_static"] = self.bitops / self.static_bitops
        if self.fp32_bitops:
            logs[f"{prefix}cost_vs_fp32"] = self.bitops / self.fp32_bitops
        return logs

    def to_dict(self) -> dict:
        return {
            "gbitops": self.bitops / 1e9,
            "rotation_gbitops": self.rotation_bitops / 1e9,
            "static_gbitops": self.static_bitops / 1e9,
            "fp32_gbitops": self.fp32_bitops / 1e9,
            "cost_vs_static": self.bitops / self.static_bitops if self.static_bitops else None,
            "cost_vs_fp32": self.bitops / self.fp32_bitops if self.fp32_bitops else None,
            "steps": self.steps,
            "full_precision_mac_share": (
                self.float_macs / (self.quantized_macs + self.float_macs) if self.quantized_macs + self.float_macs
                else None
            ),
            "steps_at_bits": {("fp32" if k is None else str(k)): v for k, v in sorted(
                self.steps_at_bits.items(), key=lambda kv: 99 if kv[0] is None else kv[0])},
        }

    @classmethod
    def _scalar_fields(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name != "steps_at_bits"]

    def state_dict(self) -> dict:
        """The totals as JSON, to save with a Trainer checkpoint (`load_state_dict` restores them)."""
        state = {k: getattr(self, k) for k in self._scalar_fields()}
        state["steps_at_bits"] = {("fp32" if k is None else str(k)): v for k, v in self.steps_at_bits.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        for key in self._scalar_fields():
            setattr(self, key, type(getattr(self, key))(state.get(key, 0)))
        self.steps_at_bits = Counter({(None if k == "fp32" else int(k)): v for k, v in state["steps_at_bits"].items()})


class CostMeter:
    """Counts the MACs of every GEMM layer in training forward passes and prices them per step.

    Forward hooks record MACs; `end_step` prices the step's MACs at that step's bits (quantized
    layers) or 32 bits (layers kept in FP32), next to what static ``bits_max`` and FP32 would cost.
    """

    def __init__(self, model: nn.Module, static_bits: int | None, static_grad_bits: int | None, scale: int = 1):
        self.static_bits = static_bits
        self.static_grad_bits = static_grad_bits
        errors = next((m.cpt_precision.errors for m in model.modules() if isinstance(m, QuantLayerMixin)), None)
        self.error_products = errors.products if errors is not None else "both"
        # matrix layers whose backward products run on int8 grids are priced at what those ran (8-bit operands)
        self.requantized = ((errors.input_product == "int8", errors.weight_product == "int8") if errors is not None
                            else (False, False))
        self.scale = scale  # e.g. the number of data-parallel processes sharing a global batch
        self.totals = CostTotals()
        # What the hooks count in training forwards until `end_step` drains it (`Tally`: no torch.compile guard).
        self._quantized_macs, self._float_macs, self._requantized_macs = Tally(), Tally(), Tally()
        self._rotation_bitops = Tally()
        layers = [module for module in model.modules() if isinstance(module, tuple(QUANT_LAYER_CLASSES))]
        # Shared inputs served so far (`hf_cpt.nn.shared_input`), and weights reused within a step
        # (`hf_cpt.nn.reused_weights`), as last seen by the hook.
        precision = next((m.cpt_precision for m in layers if isinstance(m, QuantLayerMixin)), None)
        self._precision = precision
        self._reuses = precision.shared_inputs.reuses if precision is not None else 0
        # Forward MACs recomputed in backward for activations (`hf_cpt.nn.recompute`), as last seen.
        self._recomputed_macs = precision.recomputed_macs if precision is not None else 0
        self._weight_reuses = precision.reused_weights.reuses if precision is not None else 0
        # Bit operations per rotated value of each rotated layer (fixed for the run), looked up by the hook.
        self._rotation_price = {
            id(module): rotation_bitops_per_value(module.rotation)
            for module in layers
            if isinstance(module, QuantLayerMixin) and module.rotation is not None
        }
        self._handles = [module.register_forward_hook(self._count) for module in layers]
        self._attention = next((a for m in model.modules() if (a := find_attention_quantizer(m)) is not None), None)
        if self._attention is not None:
            self._attention.drain_macs()  # what ran before the meter (a precision range test) is not this run's

    def _count(self, module: nn.Module, inputs, output) -> None:
        reused = weight_reused = False  # an input rotated already by a sibling layer; a weight quantized this step
        if isinstance(module, QuantLayerMixin):
            precision = module.cpt_precision
            reuses, weight_reuses = precision.shared_inputs.reuses, precision.reused_weights.reuses
            reused, self._reuses = reuses != self._reuses, reuses
            weight_reused, self._weight_reuses = weight_reuses != self._weight_reuses, weight_reuses
        if not (module.training and torch.is_grad_enabled() and isinstance(output, torch.Tensor)):
            return
        macs = layer_macs(module, output)
        if isinstance(module, QuantLayerMixin) and module.quantizes_inputs:
            requantized = any(self.requantized) and module.compute_on_codes is not None
            (self._requantized_macs if requantized else self._quantized_macs).add(macs)
            price = self._rotation_price.get(id(module))
            if price is not None and inputs:  # counted in end_step only for steps that quantize
                rotated = (0 if reused else inputs[0].numel()) + (0 if weight_reused else module.weight.numel())
                self._rotation_bitops.add(rotated * price)
        else:
            self._float_macs.add(macs)

    def end_step(self, bits: int | None, grad_bits: int | None) -> None:
        """Close one optimizer step trained at (bits, grad_bits)."""
        attention = attention_float = 0
        if self._attention is not None:
            attention, attention_float = self._attention.drain_macs()
        layer_rotations = self._rotation_bitops.drain()
        recomputed = 0
        if self._precision is not None:
            recomputed = (self._precision.recomputed_macs - self._recomputed_macs) * self.scale
            self._recomputed_macs = self._precision.recomputed_macs
        layers, attention = self._quantized_macs.drain() * self.scale, attention * self.scale
        requantized = self._requantized_macs.drain() * self.scale
        quantized, float_ = layers + requantized + attention, (self._float_macs.drain() + attention_float) * self.scale
        full = bitops_per_mac(None, None)
        totals = self.totals

        fixed = self._attention.fixed_bits if self._attention is not None else None
        attention_errors = self._attention is None or self._attention.quantize_errors

        def price(bits: int | None, grad_bits: int | None) -> float:
            # Attention products quantize the errors of both their products whatever error_products says (unless
            # attention_errors=False: 32-bit errors), at their fixed bit-width (attention_bits) whenever the layers
            # are quantized.
            attention_bits = fixed if fixed is not None and bits is not None else bits
            # Products recomputed in backward (from codes: only steps that quantize) run again at the forward's bits.
            again = recomputed * bits * bits if bits is not None else 0
            requantized_price = requantized * bitops_per_mac(bits, grad_bits, self.error_products, self.requantized)
            return again + layers * bitops_per_mac(bits, grad_bits, self.error_products) + attention * bitops_per_mac(
                attention_bits, grad_bits if attention_errors else None) + requantized_price

        def rotations(bits: int | None) -> float:
            # Layers rotate inputs and weights when they quantize them (FP32 steps do not).
            return self.scale * layer_rotations if bits is not None else 0

        rotation = rotations(bits)
        totals.bitops += price(bits, grad_bits) + float_ * full + rotation
        totals.rotation_bitops += rotation
        static_rotation = rotations(self.static_bits)
        totals.static_bitops += price(self.static_bits, self.static_grad_bits) + float_ * full + static_rotation
        totals.fp32_bitops += (quantized + float_) * full
        totals.steps += 1
        totals.steps_at_bits[bits] += 1
        if bits is None:  # a full-precision step: every MAC ran in full precision
            totals.float_macs += quantized + float_
        else:
            totals.quantized_macs += quantized
            totals.float_macs += float_

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
