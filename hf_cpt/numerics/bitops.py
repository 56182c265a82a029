"""The cost model's formula (docs/method.md §7): bit operations per multiply-accumulate of one training step.

A GEMM with ``MACs`` forward multiply-accumulates costs ``MACs * (b_w * b_a + b_e * b_w + b_e * b_a)`` per
step: the forward product, the input gradient and the weight gradient. Full precision counts as 32 bits.
Schedules price themselves with it and the `hf_cpt.cost.CostMeter` prices every measured layer call.
"""

from __future__ import annotations

import functools

from .backward_products import REQUANTIZED_BITS
from .errors import ErrorQuantization

FULL_PRECISION_BITS = 32


def bitops_per_mac(bits: int | None, grad_bits: int | None, error_products: str = "both",
                   requantized: tuple[bool, bool] = (False, False)) -> int:
    """Bit products per forward MAC over one training step (forward + two backward GEMMs).

    ``error_products`` (`hf_cpt.CPTConfig.error_products`): a product whose error is not quantized
    ("input": the weight gradient; "weight": the input gradient) takes the full-precision error, 32 bits.
    ``requantized``: whether the (input, weight) gradient's product runs on int8 grids, its weight or input
    re-quantized at 8 bits (`hf_cpt.numerics.backward_products`; only where its error is quantized).
    """
    weight_bits = activation_bits = bits if bits is not None else FULL_PRECISION_BITS
    error_bits = grad_bits if grad_bits is not None else FULL_PRECISION_BITS
    errors = _products(error_products)
    input_error_bits = error_bits if errors.quantizes_input_gradient else FULL_PRECISION_BITS
    weight_error_bits = error_bits if errors.quantizes_weight_gradient else FULL_PRECISION_BITS
    quantized = bits is not None and grad_bits is not None
    weight_operand = (REQUANTIZED_BITS if requantized[0] and quantized and errors.quantizes_input_gradient
                      else weight_bits)
    input_operand = (REQUANTIZED_BITS if requantized[1] and quantized and errors.quantizes_weight_gradient
                     else activation_bits)
    return weight_bits * activation_bits + input_error_bits * weight_operand + weight_error_bits * input_operand


@functools.cache
def _products(error_products: str) -> ErrorQuantization:
    # Built (and validated) once per value: a schedule prices every step of a run with it.
    return ErrorQuantization(products=error_products)


def relative_cost(bits: int | None, grad_bits: int | None) -> float:
    """Cost of a training step at (bits, grad_bits) relative to FP32: ``(b^2 + 2bg) / (3 * 32^2)``."""
    return bitops_per_mac(bits, grad_bits) / bitops_per_mac(None, None)


def rotation_bitops_per_value(rotation) -> int:
    """Bit operations to rotate one value, forward and backward (`hf_cpt.numerics.rotation.Rotation`)."""
    return rotation_bitops(*rotation.operations_per_value)


def rotation_bitops(adds: int, mults: int) -> int:
    """Bit operations to rotate one value there and back, from its additions and multiplications per value."""
    # There and back, in full precision: additions at 32 bits, multiplications at 32 x 32.
    return 2 * (adds * FULL_PRECISION_BITS + mults * FULL_PRECISION_BITS * FULL_PRECISION_BITS)
