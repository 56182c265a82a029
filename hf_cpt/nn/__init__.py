"""Quantized layers: the shared `PrecisionState`, `QuantLayerMixin` and its layer classes, quantized attention."""

from .attention import attention_support, find_attention_quantizer, install_attention, uninstall_attention
from .base import ACTIVATION_GRANULARITIES, QuantLayerMixin, input_features, rotation_buffers
from .layers import (
    QUANT_EMBEDDING_CLASSES,
    QUANT_LAYER_CLASSES,
    QuantConv2d,
    QuantEmbedding,
    QuantLinear,
    convert_layer,
    register_quant_layer,
    restore_layer,
    weight_channel_dim,
)
from .precision import PrecisionState

__all__ = ["ACTIVATION_GRANULARITIES", "QUANT_EMBEDDING_CLASSES", "QUANT_LAYER_CLASSES", "PrecisionState",
    "QuantConv2d", "QuantEmbedding", "QuantLayerMixin", "QuantLinear", "attention_support", "convert_layer",
    "find_attention_quantizer", "input_features", "install_attention", "register_quant_layer", "restore_layer",
    "rotation_buffers", "uninstall_attention", "weight_channel_dim"]
