"""Quantized layers that replace ``nn.Linear``, ``nn.Conv2d`` and GPT-2's ``Conv1D`` in place.

A layer is converted by changing its class (``convert_layer``): parameters, their names and the
``state_dict`` keys stay exactly as they were, so optimizers, tied weights, peft and
``save_pretrained`` see the same model. The bit-widths are not stored in the layers: every layer of
a model reads them from one shared `PrecisionState`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .quantizer import (
    PAPER_ERRORS,
    ErrorQuantization,
    channel_ranges,
    dequantize_codes,
    fake_quantize,
    fake_quantize_compact,
    quantize_codes,
    quantize_error,
    quantize_error_on_backward,
    quantize_ste,
    quantize_weight,
    restore_compact,
    tensor_range,
    token_range,
)
from .rotation import Rotation, factor_sizes, get_rotation, rotation_shapes

try:  # GPT-2 style layer (a Linear with a transposed weight)
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover - transformers is a dependency
    Conv1D = None


class PrecisionState:
    """The bit-widths of one model, read by each of its quantized layers at every forward.

    Bits are held in 0-d tensors updated in place, so a schedule can change them every step without
    making a compiled model re-trace; ``None`` (full precision) is a Python flag.
    """

    def __init__(
        self,
        activation_momentum: float = 0.9,
        activation_ema_init: str = "zeros",
        errors: ErrorQuantization = PAPER_ERRORS,
    ) -> None:
        self.bits = torch.zeros(())
        self.compact_codes = False
        self.grad_bits = torch.zeros(())
        self.eval_bits = torch.zeros(())
        self.eval_bits_value: int | None = None  # eval_bits as a Python number (None: not enabled)
        self.forward_enabled = False
        self.backward_enabled = False
        self.eval_enabled = False
        self.eval_follows_training = False
        # Eval-mode forwards that quantize per-tensor inputs over the batch's own range (without updating
        # the running range): used to measure fidelity before training, when no running range exists yet.
        self.batch_ranges_in_eval = False
        self.errors = errors
        # The attention products (two activations, no weight) quantize the errors of both their products,
        # unrotated, with the layers' ranges and rounding.
        self.attention_errors = dataclasses.replace(errors, products="both", rotation="none")
        self.activation_momentum = activation_momentum
        self.activation_ema_init = activation_ema_init

    @classmethod
    def from_settings(cls, settings) -> PrecisionState:
        """A state for the static settings of a `CPTConfig` (or a loaded checkpoint's quantization_config)."""
        return cls(settings.activation_momentum, settings.activation_ema_init, settings.errors)

    def quantize_error_on_backward(
        self, output: torch.Tensor, feature_dim: int = -1, attention: bool = False, granularity: str = "tensor"
    ) -> torch.Tensor:
        """Mark ``output`` so that the error arriving at it is quantized at the error bits, with these settings
        (``attention=True``: the attention products' settings) for activations quantized with ``granularity``."""
        scheme = self.attention_errors if attention else self.errors
        return quantize_error_on_backward(output, self.grad_bits, scheme.for_activations(granularity), feature_dim)

    def set(self, bits: int | None, grad_bits: int | None) -> None:
        """Training precision: forward bits for weights and activations, backward bits for errors."""
        self.forward_enabled = bits is not None
        self.backward_enabled = grad_bits is not None
        # Whether training codes fit in uint8: a flag, so that a compiled model does not re-trace per bit-width.
        self.compact_codes = bits is not None and bits <= 8
        if bits is not None:
            self.bits.fill_(float(bits))
        if grad_bits is not None:
            self.grad_bits.fill_(float(grad_bits))

    def set_eval(self, bits: int | None, follow_training: bool = False) -> None:
        """Precision in eval mode: fixed ``bits`` (None: full precision) or the training bits."""
        self.eval_follows_training = follow_training
        self.eval_enabled = bits is not None
        self.eval_bits_value = int(bits) if bits is not None else None
        if bits is not None:
            self.eval_bits.fill_(float(bits))

    @property
    def fixed_eval_bits(self) -> int | None:
        """The eval bit-width when it is a fixed number (not following training), else None."""
        return None if self.eval_follows_training else self.eval_bits_value

    def forward_bits(self, training: bool) -> torch.Tensor | None:
        """The forward bit-width in force for a module in training (or eval) mode; None: full precision."""
        if training or self.eval_follows_training:
            return self.bits if self.forward_enabled else None
        return self.eval_bits if self.eval_enabled else None

    @contextlib.contextmanager
    def evaluating_at(self, bits: int | None, batch_ranges: bool = False) -> Iterator[None]:
        """Temporarily evaluate at ``bits`` (None: full precision), optionally with per-tensor inputs
        quantized over each batch's own range; the eval settings are restored afterwards."""
        saved = (self.eval_bits_value, self.eval_follows_training, self.batch_ranges_in_eval)
        self.set_eval(bits)
        self.batch_ranges_in_eval = batch_ranges
        try:
            yield
        finally:
            self.set_eval(saved[0], follow_training=saved[1])
            self.batch_ranges_in_eval = saved[2]

    @property
    def current(self) -> tuple[int | None, int | None]:
        """(forward bits, grad bits) in training, as Python numbers."""
        bits = int(self.bits.item()) if self.forward_enabled else None
        grad_bits = int(self.grad_bits.item()) if self.backward_enabled else None
        return bits, grad_bits

    def __repr__(self) -> str:
        bits, grad_bits = self.current
        return f"PrecisionState(bits={bits}, grad_bits={grad_bits})"


def input_features(layer: nn.Module) -> int:
    """Input features of a Linear / Conv2d / Conv1D, from its size attributes (while transformers loads a
    checkpoint, a layer's weight may be a stand-in of another shape)."""
    for attribute in ("in_features", "in_channels", "nx"):
        if isinstance(getattr(layer, attribute, None), int):
            return getattr(layer, attribute)
    raise TypeError(f"{type(layer).__name__} has no in_features / in_channels / nx attribute")


# Buffers of a layer frozen to a checkpoint's codes (`QuantLayerMixin.freeze_weight`); never in state_dict.
FROZEN_CODES, FROZEN_SCALE, FROZEN_ZERO_POINT = "cpt_frozen_codes", "cpt_frozen_scale", "cpt_frozen_zero_point"

# "none": weights only (embeddings, an output head tied to them): inputs and errors stay full precision.
ACTIVATION_GRANULARITIES = ("tensor", "token", "none")


def rotation_buffers(features: int) -> dict[str, tuple[int, ...]]:
    """``{buffer name: shape}`` of a rotated layer's rotation of ``features`` input features, signs first."""
    shapes = rotation_shapes(features)
    return {"rotation_signs": shapes[0], **{f"rotation_factor_{i}": shape for i, shape in enumerate(shapes[1:])}}


class QuantLayerMixin:
    """Shared forward of the quantized layers: rotate, quantize input and weight, compute, mark the error.

    Per layer: activations are quantized per tensor (a running min/max, the CPT paper's scheme) or per
    token (each row's own min/max, in training and eval); an optional fixed `Rotation` of the input
    features is applied to input and weight first (docs/method.md).
    """

    weight_channel_dim = 0  # dimension of the weight that indexes output channels
    weight_feature_dim = -1  # dimension of the weight that indexes input features
    input_feature_dim = -1  # dimension of the input that indexes features
    output_feature_dim = -1  # dimension of the output that indexes features (rows of the error run across it)
    cpt_precision: PrecisionState
    cpt_granularity: str = "tensor"

    def _attach_precision(
        self, precision: PrecisionState, granularity: str = "tensor", rotation_seed: int | None = None
    ) -> None:
        if granularity not in ACTIVATION_GRANULARITIES:
            raise ValueError(f"activation granularity must be one of {ACTIVATION_GRANULARITIES}, got {granularity!r}")
        # A plain attribute, not a submodule: one state object is shared by all layers of a model.
        self.__dict__["cpt_precision"] = precision
        self.__dict__["cpt_granularity"] = granularity
        device = self.weight.device
        self.register_buffer("act_min", torch.zeros((), device=device), persistent=False)
        self.register_buffer("act_max", torch.zeros((), device=device), persistent=False)
        self.__dict__["_act_range_initialized"] = False
        self.__dict__["cpt_rotation_seed"] = rotation_seed
        self.__dict__["_rotation_kinds"] = ()
        self.build_rotation()

    def build_rotation(self) -> None:
        """(Re)build the rotation buffers from ``cpt_rotation_seed``.

        Buffers (not persistent: a packed export writes them itself) follow ``.to(device)`` and are seen by
        torch.compile as tensors. On the meta device (transformers builds the model there before loading
        the weights) they are empty placeholders of the right shapes, for the loader to fill.
        """
        seed = self.__dict__.get("cpt_rotation_seed")
        if seed is None:
            return
        device = self.weight.device
        features = input_features(self)
        if device.type == "meta":
            tensors = [torch.empty(shape, device=device) for shape in rotation_buffers(features).values()]
            kinds = tuple(kind for kind, _ in factor_sizes(features))
        else:
            rotation = get_rotation(features, seed, device=device)
            tensors, kinds = [rotation.signs, *rotation.factors], rotation.kinds
        for name, tensor in zip(rotation_buffers(features), tensors):
            self.register_buffer(name, tensor, persistent=False)
        self.__dict__["_rotation_kinds"] = kinds

    def rotation_buffer_names(self) -> list[str]:
        """Names of the rotation's buffers (signs first), empty when not rotated."""
        return list(rotation_buffers(input_features(self))) if self.__dict__.get("_rotation_kinds") else []

    def _detach_precision(self) -> None:
        self.unfreeze_weight()
        for key in ("cpt_precision", "_act_range_initialized", "cpt_granularity", "cpt_rotation_seed"):
            self.__dict__.pop(key, None)
        for index in range(len(self.__dict__.pop("_rotation_kinds", ()))):
            self._buffers.pop(f"rotation_factor_{index}", None)
        for name in ("act_min", "act_max", "rotation_signs"):
            self._buffers.pop(name, None)

    # -- frozen codes: a loaded layer computes with the codes it was exported with (docs/checkpoints.md) --
    def freeze_weight(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, bits: int) -> None:
        """Compute with these codes (``[C, K]`` uint8, in the rotated basis when rotated) whenever the layer
        evaluates at ``bits``, until its master weight changes (an optimizer step, an in-place edit).

        Loading a checkpoint freezes every CPT layer to its stored codes: the loaded model then computes with
        the very weight the trained one did, instead of re-deriving it from the float master (``Q(W R)`` of a
        master rebuilt as ``Q(W R) R^T`` differs from the stored codes by float rounding).
        """
        self.register_buffer(FROZEN_CODES, codes, persistent=False)
        self.register_buffer(FROZEN_SCALE, scale, persistent=False)
        self.register_buffer(FROZEN_ZERO_POINT, zero_point, persistent=False)
        self.__dict__["_frozen"] = (int(bits), weakref.ref(self.weight), self.weight._version)

    def unfreeze_weight(self) -> None:
        self.__dict__.pop("_frozen", None)
        for name in (FROZEN_CODES, FROZEN_SCALE, FROZEN_ZERO_POINT):
            self._buffers.pop(name, None)

    def frozen_codes(self, bits: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(codes, scale, zero point) frozen at ``bits`` while the master weight is unchanged, else None."""
        frozen = self.__dict__.get("_frozen")
        if frozen is None or bits is None or bits != frozen[0]:
            return None
        _, weight_ref, version = frozen
        if weight_ref() is not self.weight or self.weight._version != version:
            self.unfreeze_weight()  # trained or replaced since loading: the master weight is the truth again
            return None
        return self._buffers[FROZEN_CODES], self._buffers[FROZEN_SCALE], self._buffers[FROZEN_ZERO_POINT]

    def weight_codes(self, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, scale, zero point) of the weight this layer computes with at ``bits`` (rotated basis)."""
        frozen = self.frozen_codes(bits)
        if frozen is not None:
            return frozen
        return quantize_codes(self.rotate_weight(self.weight.detach()), bits, self.weight_channel_dim)

    def _frozen_weight(self) -> torch.Tensor | None:
        """The frozen weight when it is in force for this forward (eval mode at the frozen bits)."""
        if self.training or "_frozen" not in self.__dict__:
            return None
        frozen = self.frozen_codes(self.cpt_precision.fixed_eval_bits)
        if frozen is None:
            return None
        weight = dequantize_codes(*frozen, self.weight.shape, self.weight_channel_dim).to(self.weight.dtype)
        if torch.is_grad_enabled() and self.weight.requires_grad:
            # the same values, with the straight-through gradient of the master weight
            rotated = self.rotate_weight(self.weight)
            weight = weight + (rotated - rotated.detach())
        return weight


    @property
    def quantizes_inputs(self) -> bool:
        """False for weight-only layers (granularity "none")."""
        return self.cpt_granularity != "none"

    @property
    def rotation(self) -> Rotation | None:
        """The fixed rotation of this layer's input features, None when not rotated."""
        kinds = self.__dict__.get("_rotation_kinds", ())
        if not kinds:
            return None
        factors = tuple(self._buffers[f"rotation_factor_{i}"] for i in range(len(kinds)))
        return Rotation(self._buffers["rotation_signs"].numel(), self._buffers["rotation_signs"], factors, kinds)

    def rotate_weight(self, weight: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """The weight in the rotated basis (``W R``), or back (``inverse=True``); unchanged when not rotated."""
        rotation = self.rotation
        if rotation is None:
            return weight
        return rotation.apply(weight, self.weight_feature_dim, transpose=inverse)

    def forward_bits(self) -> torch.Tensor | None:
        """The forward bit-width now in force for this layer, None for full precision."""
        return self.cpt_precision.forward_bits(self.training)

    def input_range(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token: each row's own range. Per tensor: batch range in training (tracked by EMA), EMA in eval."""
        if self.cpt_granularity == "token":
            return token_range(x, self.input_feature_dim)
        if self.training:
            minimum, maximum = tensor_range(x)
            self._update_activation_range(minimum, maximum)
            return minimum, maximum
        if self.cpt_precision.batch_ranges_in_eval:
            return tensor_range(x)
        # A layer never trained at low precision (an FP32 run, a model just converted) has no tracked
        # range (min == max == 0): it would quantize everything to one value. Use the batch's range there.
        batch_min, batch_max = tensor_range(x)
        tracked = self.act_max > self.act_min
        return torch.where(tracked, self.act_min, batch_min), torch.where(tracked, self.act_max, batch_max)

    @torch.no_grad()
    def _update_activation_range(self, minimum: torch.Tensor, maximum: torch.Tensor) -> None:
        precision = self.cpt_precision
        if precision.activation_ema_init == "first_batch" and not self._act_range_initialized:
            self.act_min.copy_(minimum)
            self.act_max.copy_(maximum)
        else:
            momentum = precision.activation_momentum
            self.act_min.mul_(momentum).add_(minimum * (1 - momentum))
            self.act_max.mul_(momentum).add_(maximum * (1 - momentum))
        self.__dict__["_act_range_initialized"] = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        precision = self.cpt_precision
        bits = self.forward_bits()
        quantize_backward = (
            precision.backward_enabled and self.training and torch.is_grad_enabled() and self.quantizes_inputs
        )
        if bits is None and not quantize_backward:
            return super().forward(x)  # exactly the original layer
        weight = self.weight
        training_products = self.training and torch.is_grad_enabled()
        x_range = weight_range = (None, None)  # None: the operand is used as it is
        rotated_weight = weight_rotation = None  # in training: W R, computed once, and R for the weight gradient
        if bits is not None:
            frozen = self._frozen_weight()
            rotation = self.rotation if self.quantizes_inputs else None
            if frozen is not None:
                weight = frozen  # the loaded codes, already in the rotated basis
            elif rotation is not None and training_products:
                rotated_weight = rotation.apply(weight.detach(), self.weight_feature_dim)
                weight_rotation = rotation
                weight_range = channel_ranges(rotated_weight, self.weight_channel_dim)
            else:
                if rotation is not None:
                    weight = rotation.apply(weight, self.weight_feature_dim)
                weight_range = channel_ranges(weight, self.weight_channel_dim)
            if self.quantizes_inputs:
                if rotation is not None:
                    if rotation.signs.dtype != x.dtype:  # e.g. bf16 activations under autocast
                        rotation = rotation.to(x.device, x.dtype)
                    x = rotation.apply(x, self.input_feature_dim)
                x_range = self.input_range(x)
        if training_products:
            return _QuantizedProducts.apply(
                x, *x_range, weight, *weight_range, self.bias, self, bits, precision.compact_codes,
                precision.grad_bits if quantize_backward else None,
                precision.errors.for_activations(self.cpt_granularity), rotated_weight, weight_rotation,
            )
        if x_range[0] is not None:
            x = quantize_ste(x, *x_range, bits)
        if weight_range[0] is not None:
            weight = quantize_ste(weight, *weight_range, bits)
        return self.compute(x, weight)

    def compute(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # Whether `input_gradient` reads the input's values: if not, training does not keep the input for it and
    # passes a meta tensor of its shape.
    input_gradient_reads_input = True

    def input_gradient(self, error: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``d(compute)/dx`` applied to ``error`` (generic: by autograd through ``compute``; subclasses write
        the product directly)."""
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            return torch.autograd.grad(self.compute(x, weight.detach()), x, error)[0]

    def weight_gradient(self, error: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``d(compute)/dweight`` applied to ``error`` (generic: by autograd through ``compute``)."""
        with torch.enable_grad():
            weight = weight.detach().requires_grad_()
            return torch.autograd.grad(self.compute(x.detach(), weight), weight, error)[0]

    def quantized_weight(self, bits: int | None = None, rotated: bool = False) -> torch.Tensor:
        """The weight as the layer uses it at ``bits`` (default: the eval precision), without grad.

        A rotated layer computes with ``Q(W R)``: ``rotated=True`` returns that, else it is rotated back.
        """
        with torch.no_grad():
            if bits is None:
                if not self.cpt_precision.eval_enabled:
                    return self.weight.detach().clone()
                bits = self.cpt_precision.eval_bits_value
            frozen = self.frozen_codes(bits)
            if frozen is not None:
                snapped = dequantize_codes(*frozen, self.weight.shape, self.weight_channel_dim)
            else:
                weight = self.rotate_weight(self.weight.detach())
                minimum, maximum = channel_ranges(weight, self.weight_channel_dim)
                snapped = fake_quantize(weight, minimum, maximum, torch.tensor(float(bits)))
            return snapped if rotated else self.rotate_weight(snapped, inverse=True)


_NOT_SAVED = (None, None, None)


def _quantized_operand(
    t: torch.Tensor, minimum: torch.Tensor | None, maximum: torch.Tensor | None, bits: torch.Tensor | None,
    compact: bool, keep: bool,
) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """(the operand as the product uses it, what the backward saves to rebuild it: nothing unless ``keep``)."""
    if minimum is None:
        return t, ((t, None, None) if keep else _NOT_SAVED)
    if compact and keep:
        return fake_quantize_compact(t, minimum, maximum, bits)
    value = fake_quantize(t, minimum, maximum, bits)
    return value, ((value, None, None) if keep else _NOT_SAVED)


def _rebuilt_operand(saved: tuple[torch.Tensor | None, ...], dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    """The operand the forward used, or a meta tensor of its shape when it was not saved (not read)."""
    codes, scale, minimum = saved
    if codes is None:
        return torch.empty(shape, dtype=dtype, device="meta")
    return codes if scale is None else restore_compact(codes, scale, minimum, dtype)


class _QuantizedProducts(torch.autograd.Function):
    """A quantized layer's GEMM in training (docs/method.md §2).

    Forward: the input and weight fake-quantized over the given ranges (an operand without a range is used
    as it is), then the layer's product. Saved for backward: only the operands a needed gradient reads (the
    input for the weight gradient, the weight for the input gradient, as autograd itself does), each as the
    integer codes of its quantized values (uint8 with its scale and minimum, up to 8 bits), not a float
    copy, rebuilt bit for bit in backward.
    Backward: straight-through for both operands; with error bits, the error is quantized once and each
    product takes the quantized or the full-precision error as ``errors.products`` says (the bias gradient
    follows the weight gradient). The products run in the error's dtype, as autograd's own backward would
    under autocast. A rotated layer passes ``W R`` computed once outside autograd, and its weight gradient is
    rotated back here (`_weight_gradient`), not by autograd through a second rotation of the weight.
    """

    @staticmethod
    def forward(ctx, x, x_min, x_max, weight, weight_min, weight_max, bias, layer, bits, compact, grad_bits, errors,
                rotated_weight, weight_rotation):
        needs_x, needs_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[3]
        keep_x = needs_weight or (needs_x and layer.input_gradient_reads_input)
        x_value, x_saved = _quantized_operand(x, x_min, x_max, bits, compact, keep_x)
        operand = weight if rotated_weight is None else rotated_weight
        weight_value, weight_saved = _quantized_operand(operand, weight_min, weight_max, bits, compact, needs_x)
        ctx.save_for_backward(*x_saved, *weight_saved)
        ctx.layer, ctx.errors, ctx.weight_rotation = layer, errors, weight_rotation
        ctx.grad_bits = None if grad_bits is None else grad_bits.detach().clone()
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.shapes = (x.shape, weight.shape)
        return layer.compute(x_value, weight_value)

    @staticmethod
    def backward(ctx, error):
        saved = ctx.saved_tensors
        x_dtype, weight_dtype, bias_dtype = ctx.dtypes
        layer, errors = ctx.layer, ctx.errors
        input_error = weight_error = error
        if ctx.grad_bits is not None:
            quantized = quantize_error(error, ctx.grad_bits, errors, layer.output_feature_dim)
            input_error = quantized if errors.quantizes_input_gradient else error
            weight_error = quantized if errors.quantizes_weight_gradient else error
        compute_dtype = error.dtype
        x = _rebuilt_operand(saved[:3], x_dtype, ctx.shapes[0]).to(compute_dtype)
        weight = _rebuilt_operand(saved[3:], weight_dtype, ctx.shapes[1]).to(compute_dtype)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = layer.input_gradient(input_error, x, weight).to(x_dtype)
        if ctx.needs_input_grad[3]:
            grad_weight = _weight_gradient(layer, weight_error, x, weight, ctx.weight_rotation).to(weight_dtype)
        if bias_dtype is not None and ctx.needs_input_grad[6]:
            feature_dim = layer.output_feature_dim % weight_error.dim()
            grad_bias = weight_error.sum([d for d in range(weight_error.dim()) if d != feature_dim]).to(bias_dtype)
        return grad_x, None, None, grad_weight, None, None, grad_bias, None, None, None, None, None, None, None


def _weight_gradient(
    layer: QuantLayerMixin, error: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rotation: Rotation | None
) -> torch.Tensor:
    """The gradient of the layer's own weight ``W`` when it computed with ``W R``: ``dL/d(W R)`` rotated back by
    ``R^T``, or, the same product since the layer is linear in its input's features, the product with the input
    rotated back (``Q(x R) R^T``), whichever rotates fewer values (few tokens: the input)."""
    if rotation is None:
        return layer.weight_gradient(error, x, weight)
    if rotation.signs.dtype != x.dtype:
        rotation = rotation.to(x.device, x.dtype)
    if x.numel() <= weight.numel():
        return layer.weight_gradient(error, rotation.apply(x, layer.input_feature_dim, transpose=True), weight)
    return rotation.apply(layer.weight_gradient(error, x, weight), layer.weight_feature_dim, transpose=True)


class QuantLinear(QuantLayerMixin, nn.Linear):
    """``nn.Linear`` with CPT fake quantization; weights quantized per output row."""

    def compute(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight, self.bias)

    input_gradient_reads_input = False

    def input_gradient(self, error: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return error.matmul(weight)

    def weight_gradient(self, error: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return error.reshape(-1, error.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


class QuantConv2d(QuantLayerMixin, nn.Conv2d):
    """``nn.Conv2d`` with CPT fake quantization; weights quantized per output filter.

    Per-token granularity means per pixel (the range over channels); rotation mixes input channels
    (``groups == 1`` only).
    """

    weight_feature_dim = 1
    input_feature_dim = 1
    output_feature_dim = 1

    def compute(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, weight, self.bias)

    def _direct_gradients(self) -> bool:
        return self.padding_mode == "zeros" and not isinstance(self.padding, str)

    @property
    def input_gradient_reads_input(self) -> bool:  # the direct product reads only the input's shape
        return not self._direct_gradients()

    def input_gradient(self, error: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self._direct_gradients():
            return super().input_gradient(error, x, weight)
        return torch.nn.grad.conv2d_input(x.shape, weight, error, self.stride, self.padding, self.dilation,
                                          self.groups)

    def weight_gradient(self, error: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self._direct_gradients():
            return super().weight_gradient(error, x, weight)
        return torch.nn.grad.conv2d_weight(x, weight.shape, error, self.stride, self.padding, self.dilation,
                                           self.groups)


QUANT_LAYER_CLASSES: dict[type, type] = {nn.Linear: QuantLinear, nn.Conv2d: QuantConv2d}

if Conv1D is not None:

    class QuantConv1D(QuantLayerMixin, Conv1D):
        """transformers' ``Conv1D`` (GPT-2) with CPT fake quantization; weight is (in, out)."""

        weight_channel_dim = 1
        weight_feature_dim = 0

        def compute(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            size_out = x.size()[:-1] + (self.nf,)
            return torch.addmm(self.bias, x.reshape(-1, x.size(-1)), weight).view(size_out)

        input_gradient_reads_input = False

        def input_gradient(self, error: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return error.matmul(weight.t())

        def weight_gradient(self, error: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return x.reshape(-1, x.shape[-1]).t().matmul(error.reshape(-1, error.shape[-1]))

    QUANT_LAYER_CLASSES[Conv1D] = QuantConv1D


class QuantEmbedding(QuantLayerMixin, nn.Embedding):
    """``nn.Embedding`` whose table is quantized per row at the forward bits (straight-through gradient).

    The indices are not quantized and the lookup has no multiply (the cost meter counts no MACs); the
    error of a lookup is not quantized. Converted only with ``CPTConfig(quantize_embeddings=True)``.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        bits = self.forward_bits()
        if bits is None:
            return nn.Embedding.forward(self, input)
        weight = self._frozen_weight()
        weight = weight if weight is not None else quantize_weight(self.weight, bits, 0)
        return F.embedding(input, weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                           self.sparse)


# Embedding conversion is opt-in, so it is kept out of QUANT_LAYER_CLASSES (the layers converted by default).
QUANT_EMBEDDING_CLASSES: dict[type, type] = {nn.Embedding: QuantEmbedding}


def register_quant_layer(float_class: type, quant_class: type) -> None:
    """Teach model surgery to convert ``float_class`` into ``quant_class`` (a `QuantLayerMixin` subclass)."""
    if not (isinstance(quant_class, type) and issubclass(quant_class, QuantLayerMixin)):
        raise TypeError(f"{quant_class!r} must subclass hf_cpt.layers.QuantLayerMixin")
    if not issubclass(quant_class, float_class):
        raise TypeError(f"{quant_class.__name__} must subclass {float_class.__name__} so isinstance checks hold")
    QUANT_LAYER_CLASSES[float_class] = quant_class


def convert_layer(
    module: nn.Module, precision: PrecisionState, granularity: str = "tensor", rotation_seed: int | None = None
) -> nn.Module:
    """Turn a float layer into its quantized class in place (same object, same parameters).

    ``granularity`` is the activation range ("tensor" or "token"); ``rotation_seed`` (None: no rotation)
    picks the fixed rotation of the input features.
    """
    quant_class = QUANT_LAYER_CLASSES.get(type(module)) or QUANT_EMBEDDING_CLASSES[type(module)]
    module.__dict__["_cpt_float_class"] = type(module)
    module.__class__ = quant_class
    try:
        module._attach_precision(precision, granularity, rotation_seed)
    except Exception:
        module.__class__ = module.__dict__.pop("_cpt_float_class")
        raise
    return module


def restore_layer(module: QuantLayerMixin) -> nn.Module:
    """Undo `convert_layer`: the plain float layer with its current (trained) weights."""
    float_class = module.__dict__.pop("_cpt_float_class", None) or next(
        cls for cls in type(module).__mro__[1:] if cls in QUANT_LAYER_CLASSES or cls in QUANT_EMBEDDING_CLASSES
    )
    module._detach_precision()
    module.__class__ = float_class
    return module
