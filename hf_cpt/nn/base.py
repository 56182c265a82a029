"""`QuantLayerMixin`: the forward every quantized layer shares (docs/method.md §2-§3); its training GEMM and
backward are `hf_cpt.nn.products`.

A layer is converted by changing its class (`hf_cpt.nn.layers.convert_layer`): parameters, their names
and the ``state_dict`` keys stay exactly as they were, so optimizers, tied weights, peft and
``save_pretrained`` see the same model. The bit-widths are not stored in the layers: every layer of
a model reads them from one shared `PrecisionState`.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..backends import backend_for
from ..numerics.fake_quant import (
    dequantize_codes,
    fake_quantize,
    quantize_codes,
    quantize_ste,
    tensor_range,
    token_range,
    weight_ranges,
)
from ..numerics.integer_matmul import MAX_REDUCED_SIZE
from ..numerics.rotation import Rotation, factor_sizes, get_rotation, rotation_shapes
from .precision import PrecisionState
from .products import QuantizedProducts, keeps_input, quantized_input


def input_features(layer: nn.Module) -> int:
    """Input features of a Linear / Conv2d / Conv1D, from its size attributes (while transformers loads a
    checkpoint, a layer's weight may be a stand-in of another shape)."""
    for attribute in ("in_features", "in_channels", "nx"):
        if isinstance(getattr(layer, attribute, None), int):
            return getattr(layer, attribute)
    raise TypeError(f"{type(layer).__name__} has no in_features / in_channels / nx attribute")


# Buffers of a layer frozen to a checkpoint's codes (`QuantLayerMixin.freeze_weight`); never in state_dict.
FROZEN_CODES, FROZEN_SCALE, FROZEN_ZERO_POINT = "cpt_frozen_codes", "cpt_frozen_scale", "cpt_frozen_zero_point"
FROZEN_FINGERPRINT = "cpt_frozen_fingerprint"  # `weight_fingerprint` of the master weight the codes belong to
NONFINITE_INPUTS = "cpt_nonfinite_inputs"  # a layer's count of training inputs with a NaN or inf

# "none": weights only (embeddings, an output head tied to them): inputs and errors stay full precision.
ACTIVATION_GRANULARITIES = ("tensor", "token", "none")


def rotation_buffers(features: int) -> dict[str, tuple[int, ...]]:
    """``{buffer name: shape}`` of a rotated layer's rotation of ``features`` input features, signs first."""
    shapes = rotation_shapes(features)
    return {"rotation_signs": shapes[0], **{f"rotation_factor_{i}": shape for i, shape in enumerate(shapes[1:])}}



def weight_fingerprint(weight: torch.Tensor) -> torch.Tensor:
    """Per-row sums of ``weight``'s bit patterns as integers: any edit of its values moves them (but a reordering of
    values within a row), one read of the weight; its version counter misses edits made through ``.data``."""
    values = weight.detach().contiguous()
    as_integers = values.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[values.element_size()])
    return as_integers.reshape(values.shape[0], -1).sum(dim=1, dtype=torch.int64)

class QuantLayerMixin:
    """Shared forward of the quantized layers: rotate, quantize input and weight, compute, mark the error.

    Per layer: activations are quantized per tensor (a running min/max, the CPT paper's scheme) or per token (each
    row's own min/max, in training and eval); an optional fixed `Rotation` of the input features is applied to input
    and weight first (docs/method.md)."""

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
        # training forwards whose input had a NaN or inf, which the running range skipped (`nonfinite_inputs`)
        self.register_buffer(NONFINITE_INPUTS, torch.zeros((), dtype=torch.int64, device=device), persistent=False)
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
        precision = self.__dict__.get("cpt_precision")
        if precision is not None:
            precision.reused_weights.drop(self)
        for key in ("cpt_precision", "_act_range_initialized", "cpt_granularity", "cpt_rotation_seed"):
            self.__dict__.pop(key, None)
        for index in range(len(self.__dict__.pop("_rotation_kinds", ()))):
            self._buffers.pop(f"rotation_factor_{index}", None)
        for name in ("act_min", "act_max", "rotation_signs", NONFINITE_INPUTS):
            self._buffers.pop(name, None)

    # -- frozen codes: a loaded layer computes with the codes it was exported with (docs/checkpoints.md) --
    def freeze_weight(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, bits: int) -> None:
        """Compute with these codes (``[C, K]`` uint8, rotated basis) whenever the layer evaluates at ``bits``, until
        its master weight changes in any way (`weight_fingerprint` sees edits through ``.data``, such as peft's LoRA
        merge): a loaded model computes with the very weight the trained one did (``Q(W R)`` of a master rebuilt
        as ``Q(W R) R^T`` differs from the stored codes by float rounding)."""
        self.register_buffer(FROZEN_CODES, codes, persistent=False)
        self.register_buffer(FROZEN_SCALE, scale, persistent=False)
        self.register_buffer(FROZEN_ZERO_POINT, zero_point, persistent=False)
        # a buffer, so that it moves with the model (``model.to("cuda")``: the same values, still frozen)
        self.register_buffer(FROZEN_FINGERPRINT, weight_fingerprint(self.weight), persistent=False)
        self.__dict__["_frozen"] = (int(bits), weakref.ref(self.weight), self.weight._version)

    def unfreeze_weight(self) -> None:
        self.__dict__.pop("_frozen", None)
        for name in (FROZEN_CODES, FROZEN_SCALE, FROZEN_ZERO_POINT, FROZEN_FINGERPRINT):
            self._buffers.pop(name, None)

    def frozen_codes(self, bits: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(codes, scale, zero point) frozen at ``bits`` while the master weight is unchanged, else None."""
        frozen = self.__dict__.get("_frozen")
        if frozen is None or bits is None or bits != frozen[0]:
            return None
        _, weight_ref, version = frozen
        if (weight_ref() is not self.weight or self.weight._version != version
                or not torch.equal(weight_fingerprint(self.weight), self._buffers[FROZEN_FINGERPRINT])):
            self.unfreeze_weight()  # trained or replaced since loading: the master weight is the truth again
            return None
        return self._buffers[FROZEN_CODES], self._buffers[FROZEN_SCALE], self._buffers[FROZEN_ZERO_POINT]

    def weight_codes(self, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, scale, zero point) of the weight this layer computes with at ``bits`` (rotated basis)."""
        frozen = self.frozen_codes(bits)
        if frozen is not None:
            return frozen
        return quantize_codes(self.rotate_weight(self.weight.detach()), bits, self.weight_channel_dim,
                              self.cpt_precision.weight_range)

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
        """The forward bit-width now in force for this layer, on its weight's device; None for full precision."""
        precision = self.cpt_precision
        return precision.on_device(precision.forward_bits(self.training), self.weight.device)

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
        # A NaN or inf input is counted (read once a step by the Trainer integration), never absorbed for good.
        finite = torch.isfinite(minimum) & torch.isfinite(maximum)
        self._buffers[NONFINITE_INPUTS].add_((~finite).to(torch.int64))
        if precision.activation_ema_init == "first_batch" and not self._act_range_initialized:
            new_min, new_max = minimum, maximum
        else:
            momentum = precision.activation_momentum
            new_min = self.act_min * momentum + minimum * (1 - momentum)
            new_max = self.act_max * momentum + maximum * (1 - momentum)
        self.act_min.copy_(torch.where(finite, new_min, self.act_min))
        self.act_max.copy_(torch.where(finite, new_max, self.act_max))
        self.__dict__["_act_range_initialized"] = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        precision = self.cpt_precision
        bits = self.forward_bits()
        quantize_backward = (
            precision.backward_enabled and self.training and torch.is_grad_enabled() and self.quantizes_inputs
        )
        if bits is None and not quantize_backward:
            return super().forward(x)  # exactly the original layer
        weight, input_dtype = self.weight, x.dtype
        training_products = self.training and torch.is_grad_enabled()
        x_range = weight_range = (None, None)  # None: the operand is used as it is
        x_quantized = None  # the input quantized already (shared with sibling layers), else None
        weight_quantized = None  # (the weight as the product uses it, its codes) when reused or kept for reuse
        rotated_weight = weight_rotation = None  # in training: W R, computed once, and R for the weight gradient
        codes_possible = (training_products and self.compute_on_codes is not None and self.quantizes_inputs
                          and precision.compact_codes and input_features(self) <= MAX_REDUCED_SIZE)
        integer = codes_possible and precision.integer_products(weight.device)  # the product on integer codes
        if bits is not None:
            frozen = self._frozen_weight()
            rotation = self.rotation if self.quantizes_inputs else None
            reuse_key = None if frozen is not None else self._weight_reuse_key(bits, training_products)
            reused = None if reuse_key is None else precision.reused_weights.get(self, reuse_key)
            if frozen is not None:
                weight = frozen  # the loaded codes, already in the rotated basis
            elif reused is not None:  # quantized earlier in this optimizer step (or this evaluation)
                weight_quantized = (None if integer else backend_for(weight.device).restore(*reused, weight.dtype),
                                    reused)
                weight_rotation = rotation if training_products else None
            elif rotation is not None and training_products:
                rotated_weight = rotation.apply(weight.detach(), self.weight_feature_dim)
                weight_rotation = rotation
                weight_range = weight_ranges(rotated_weight, bits, self.weight_channel_dim, precision.weight_range)
            else:
                if rotation is not None:
                    weight = rotation.apply(weight, self.weight_feature_dim)
                weight_range = weight_ranges(weight, bits, self.weight_channel_dim, precision.weight_range)
            if reuse_key is not None and reused is None:
                operand = rotated_weight if rotated_weight is not None else weight.detach()
                weight_quantized = backend_for(operand.device).operand(operand, *weight_range, bits, values=not integer)
                precision.reused_weights.put(self, reuse_key, weight_quantized[1])
            if self.quantizes_inputs:
                x, x_range, x_quantized = self._prepared_input(x, rotation, bits, training_products, integer)
        if training_products:
            return QuantizedProducts.apply(x, *x_range, weight, *weight_range, self.bias, self, bits,
                precision.compact_codes, precision.error_bits(weight.device) if quantize_backward else None,
                precision.errors.for_activations(self.cpt_granularity), rotated_weight, weight_rotation, x_quantized,
                weight_quantized, integer)
        if x_quantized is not None:
            x = x_quantized[0]
        elif x_range[0] is not None:
            x = quantize_ste(x, *x_range, bits)
        if weight_quantized is not None:
            weight = weight_quantized[0]
        elif weight_range[0] is not None:
            weight = quantize_ste(weight, *weight_range, bits)
        # the plain layer's dtypes: a rotation or restored codes compute in float32 (bf16 / fp16 weights, no autocast)
        return self.compute(x.to(input_dtype), weight.to(self.weight.dtype))

    def _weight_reuse_key(self, bits: torch.Tensor, training: bool) -> tuple | None:
        """What besides the epoch must stay unchanged for this forward to reuse the weight's codes
        (`hf_cpt.nn.reused_weights`), or None when it may not: no epoch (outside the Trainer), codes wider than 8
        bits, a weight that needs its gradient outside a training product, or code that torch.compile traces."""
        precision = self.cpt_precision
        if torch.compiler.is_dynamo_compiling() or precision.reused_weights.epoch is None:  # no guard on the epoch
            return None
        if training:
            compact = precision.compact_codes
        else:
            if torch.is_grad_enabled() and self.weight.requires_grad:
                return None
            eval_bits = precision.fixed_eval_bits
            compact = precision.compact_codes if eval_bits is None else eval_bits <= 8
        if not compact:
            return None
        weight = self.weight
        return training, id(bits), bits._version, weight._version, weight.dtype, weight.device

    def _prepared_input(self, x: torch.Tensor, rotation: Rotation | None, bits: torch.Tensor, training: bool,
                        integer: bool = False):
        """(the input rotated, its range, its quantized operand or None). Per-token layers share all three with
        the sibling layers that read the same input (`hf_cpt.nn.shared_input`); the others compute the first two.
        ``integer``: the products run on codes, so the shared operand is its codes alone (no fake-quantized floats)."""
        if rotation is not None and rotation.signs.dtype != x.dtype:  # e.g. bf16 activations under autocast
            rotation = rotation.to(x.device, x.dtype)
        shareable = (
            self.cpt_granularity == "token"
            and not (torch.compiler.is_dynamo_compiling() or torch.compiler.is_exporting())
            and not x.is_inference()  # no version counter to tell an in-place edit
            and not (x.is_leaf and x.requires_grad)  # one tensor fed to several forwards, each with a backward
            and (training or not torch.is_grad_enabled())  # products with autograd's own backward: not shared
        )
        if not shareable:
            if rotation is not None:
                x = rotation.apply(x, self.input_feature_dim)
            return x, self.input_range(x), None
        precision = self.cpt_precision
        # Codes only where this layer's backward reads its input (what the products would keep themselves); a product
        # on codes (``integer``) gets its codes whatever the backward keeps.
        keep = training and keeps_input(self, x.requires_grad, self.weight.requires_grad)
        rotation_key = None if rotation is None else (rotation.features, self.cpt_rotation_seed)
        key = (self.input_feature_dim, x.dtype, rotation_key, id(bits), bits._version, precision.compact_codes,
               training, keep, integer)
        entry = precision.shared_inputs.get(x, key)
        if entry is None:
            entry = quantized_input(x, self.input_feature_dim, rotation, bits, precision.compact_codes, keep, integer)
            precision.shared_inputs.put(x, key, entry)
        return (x if entry.rotated is None else entry.rotated), entry.x_range, entry.quantized

    def compute(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # ``compute_on_codes(x, weight, bits, bias)``: `compute` from each operand's (uint8 codes, scale, minimum) and the
    # bias, in float32, for a matrix product (`hf_cpt.numerics.integer_matmul`); None: the float product only.
    compute_on_codes = None

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

    def both_gradients(
        self, error: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(`input_gradient`, `weight_gradient`) of one ``error`` in one call, where the layer's backward kernel forms
        both at once (a convolution's); None: the two products are made separately."""
        return None

    def quantized_weight(self, bits: int | None = None, rotated: bool = False) -> torch.Tensor:
        """The weight as the layer uses it at ``bits`` (default: the eval precision), without grad. A rotated layer
        computes with ``Q(W R)``: ``rotated=True`` returns that, else it is rotated back."""
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
                bits, method = torch.tensor(float(bits)), self.cpt_precision.weight_range
                snapped = fake_quantize(weight, *weight_ranges(weight, bits, self.weight_channel_dim, method), bits)
            return snapped if rotated else self.rotate_weight(snapped, inverse=True)
