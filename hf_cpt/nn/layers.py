"""Quantized layers that replace ``nn.Linear``, ``nn.Conv2d``, GPT-2's ``Conv1D`` and (opt-in)
``nn.Embedding`` in place, and the registry that maps a float class to its quantized class."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.utils import _pair

from ..backends import backend_for
from ..numerics.fake_quant import quantize_weight
from .base import QuantLayerMixin
from .precision import PrecisionState

try:  # GPT-2 style layer (a Linear with a transposed weight)
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover - transformers is a dependency
    Conv1D = None


class QuantLinear(QuantLayerMixin, nn.Linear):
    """``nn.Linear`` with CPT fake quantization; weights quantized per output row."""

    def compute(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight, self.bias)

    def compute_on_codes(self, x: tuple, weight: tuple, bits: torch.Tensor, bias: torch.Tensor | None
                         ) -> torch.Tensor:
        """`compute` on (codes, scale, minimum) of the input and the ``[out, in]`` weight, in float32."""
        return _matmul_on_codes(x, weight, bits, transposed_weight=True, bias=bias)

    input_gradient_reads_input = False

    def input_gradient(self, error: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return error.matmul(weight)

    def weight_gradient(self, error: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return error.reshape(-1, error.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


def _matmul_on_codes(x: tuple, weight: tuple, bits: torch.Tensor, transposed_weight: bool,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W (+ bias)`` over the last input dimension, from the input's codes (ranges per token or one) and the
    weight's (ranges per output channel)."""
    (codes, scale, minimum), (weight_codes, weight_scale, weight_minimum) = x, weight
    rows = codes.reshape(-1, codes.shape[-1])

    def per_row(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, 1) if t.dim() else t

    weight_codes = weight_codes.t() if transposed_weight else weight_codes
    out = backend_for(codes.device).code_product((rows, per_row(scale), per_row(minimum)),
        (weight_codes, weight_scale.reshape(1, -1), weight_minimum.reshape(1, -1)), bits, bias)
    return out.view(*codes.shape[:-1], out.shape[-1])


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
        return torch.nn.grad.conv2d_input(x.shape, weight, error, self.stride, self.padding, self.dilation, self.groups)

    def weight_gradient(self, error: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self._direct_gradients():
            return super().weight_gradient(error, x, weight)
        return torch.nn.grad.conv2d_weight(x, weight.shape, error, self.stride, self.padding, self.dilation,
                                           self.groups)

    def both_gradients(self, error: torch.Tensor, x: torch.Tensor, weight: torch.Tensor):
        """Both gradients from one convolution backward, as autograd's own Conv2d backward forms them (the same
        values as `input_gradient` and `weight_gradient`, in less time than two calls)."""
        if not self._direct_gradients():
            return None
        grad_x, grad_weight, _ = torch.ops.aten.convolution_backward(error, x, weight, None, _pair(self.stride),
            _pair(self.padding), _pair(self.dilation), False, [0, 0], self.groups, [True, True, False])
        return grad_x, grad_weight


QUANT_LAYER_CLASSES: dict[type, type] = {nn.Linear: QuantLinear, nn.Conv2d: QuantConv2d}

if Conv1D is not None:

    class QuantConv1D(QuantLayerMixin, Conv1D):
        """transformers' ``Conv1D`` (GPT-2) with CPT fake quantization; weight is (in, out)."""

        weight_channel_dim = 1
        weight_feature_dim = 0

        def compute(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            size_out = x.size()[:-1] + (self.nf,)
            return torch.addmm(self.bias, x.reshape(-1, x.size(-1)), weight).view(size_out)

        def compute_on_codes(self, x: tuple, weight: tuple, bits: torch.Tensor, bias: torch.Tensor | None
                             ) -> torch.Tensor:
            """`compute` on (codes, scale, minimum) of the input and the ``[in, out]`` weight, in float32."""
            return _matmul_on_codes(x, weight, bits, transposed_weight=False, bias=bias)

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
        if weight is None:
            weight = quantize_weight(self.weight, bits, 0, self.cpt_precision.weight_range)
        return F.embedding(input, weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                           self.sparse)


# Embedding conversion is opt-in, so it is kept out of QUANT_LAYER_CLASSES (the layers converted by default).
QUANT_EMBEDDING_CLASSES: dict[type, type] = {nn.Embedding: QuantEmbedding}


def register_quant_layer(float_class: type, quant_class: type) -> None:
    """Teach model surgery to convert ``float_class`` into ``quant_class`` (a `QuantLayerMixin` subclass)."""
    if not (isinstance(quant_class, type) and issubclass(quant_class, QuantLayerMixin)):
        raise TypeError(f"{quant_class!r} must subclass hf_cpt.QuantLayerMixin")
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


def weight_channel_dim(module: nn.Module) -> int:
    """The weight dimension that indexes output channels (rows of an embedding)."""
    if isinstance(module, QuantLayerMixin):  # its own class attribute
        return module.weight_channel_dim
    if Conv1D is not None and isinstance(module, Conv1D):
        return 1
    return 0
