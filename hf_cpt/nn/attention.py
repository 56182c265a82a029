"""The attention products in low precision, through transformers' attention interface (docs/method.md §8).

`install_attention` registers ``"cpt"`` in ``AttentionInterface`` (BERT, GPT-2, Llama-style models, ViT) and switches
the model to it; no module is rewritten. With ``CPTConfig(quantize_attention=True)`` the function fake-quantizes Q
and K before ``Q Kᵀ`` and P and V before ``P V`` (at the forward bits or a fixed ``attention_bits``), over each
batch's own ranges (per tensor, or per row of Q, K, P and per channel of V with per-token activations), keeps the
operands for backward as uint8 codes (`QuantizedMatmul`) and quantizes both products' errors (unless
``attention_errors=False``). It always counts both products' MACs for the cost meter. Dropout and grouped key/value
heads behave as in the eager implementation.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from ..numerics.fake_quant import quantize_ste, tensor_range, token_range
from .precision import PrecisionState
from .products import QuantizedMatmul
from .tally import Tally

ATTENTION_NAME = "cpt"


@dataclass
class AttentionQuantizer:
    """What the ``"cpt"`` attention function needs, shared by every attention module of one model."""

    precision: PrecisionState
    quantize: bool  # False: full-precision products, only counted
    granularity: str = "tensor"  # "tensor" or "token"
    replaced_implementation: str = "eager"  # restored by `uninstall_attention`
    # Bit-width the products hold while the layers are quantized (None: the layers' bits, following the schedule).
    fixed_bits: int | None = None
    quantize_errors: bool = True  # False: the products' errors stay full precision (CPTConfig.attention_errors)
    # Training-forward MACs since the cost meter last drained them (quantized, full precision): `Tally`s, which
    # torch.compile does not guard on.
    quantized_macs: Tally = field(default_factory=Tally, repr=False)
    float_macs: Tally = field(default_factory=Tally, repr=False)
    _modules: list = field(default_factory=list, repr=False)
    _fixed_bits: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.fixed_bits is not None:
            self._fixed_bits = torch.tensor(float(self.fixed_bits))

    def bits(self, training: bool) -> torch.Tensor | None:
        """The products' bit-width in this mode: None (full precision) whenever the layers run in full precision
        or quantization is off, else ``fixed_bits`` or the layers' bits."""
        bits = self.precision.forward_bits(training) if self.quantize else None
        return bits if bits is None or self._fixed_bits is None else self._fixed_bits

    @property
    def compact_codes(self) -> bool:
        """Whether the training products' operands fit in uint8 codes (at most 8 bits)."""
        return self.fixed_bits <= 8 if self.fixed_bits is not None else self.precision.compact_codes

    def drain_macs(self) -> tuple[int, int]:
        """(quantized, full-precision) attention MACs counted since the last call; resets both."""
        return self.quantized_macs.drain(), self.float_macs.drain()


def _operand_range(x: torch.Tensor, granularity: str, reduced_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The range of an input of a product whose reduced dimension is ``reduced_dim``."""
    if granularity == "token":
        return token_range(x, reduced_dim)  # scales along the kept dimensions only
    return tensor_range(x)


def _quantized_matmul(a: torch.Tensor, b: torch.Tensor, bits: torch.Tensor, state: AttentionQuantizer,
                      training: bool) -> torch.Tensor:
    """``Q(a) @ Q(b)`` (straight-through gradients); in training its backward keeps the operands' codes."""
    a_range = _operand_range(a, state.granularity, -1)
    b_range = _operand_range(b, state.granularity, -2)
    if training:
        return QuantizedMatmul.apply(a, *a_range, b, *b_range, bits, state.compact_codes)
    return torch.matmul(quantize_ste(a, *a_range, bits), quantize_ste(b, *b_range, bits))


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def cpt_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``"cpt"`` attention function: ``(b, h, s, d)`` inputs, ``(b, s, h, d)`` output and the weights."""
    state: AttentionQuantizer | None = getattr(module, "cpt_attention", None)
    if state is None:
        raise RuntimeError(
            f"{type(module).__name__} runs attn_implementation='{ATTENTION_NAME}' but was not prepared by "
            "hf_cpt.quantize_model; call quantize_model on the whole model, or set another attn_implementation."
        )
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    original_key, original_value = key, value
    key, value = _repeat_kv(key, query.shape[1]), _repeat_kv(value, query.shape[1])
    precision = state.precision
    bits = precision.on_device(state.bits(module.training), query.device)
    training = module.training and torch.is_grad_enabled()
    quantize_backward = state.quantize and state.quantize_errors and training and precision.backward_enabled
    if training:
        macs = 2 * query.shape[0] * query.shape[1] * query.shape[2] * key.shape[2] * query.shape[3]
        (state.float_macs if bits is None else state.quantized_macs).add(macs)
    if bits is None and state.replaced_implementation == "sdpa":  # full precision: the model's own kernel
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, original_key, original_value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    if bits is None:
        scores = torch.matmul(query, key.transpose(2, 3))
    else:
        scores = _quantized_matmul(query, key.transpose(2, 3), bits, state, training)
    if quantize_backward:
        scores = precision.quantize_error_on_backward(scores, attention=True, granularity=state.granularity)
    scores = scores * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    if bits is None:
        output = torch.matmul(weights, value)
    else:
        output = _quantized_matmul(weights, value, bits, state, training)
    if quantize_backward:
        output = precision.quantize_error_on_backward(output, attention=True, granularity=state.granularity)
    return output.transpose(1, 2).contiguous(), weights


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION_NAME, cpt_attention_forward)
    if ATTENTION_NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)  # the additive float mask eager uses


def attention_support(model: nn.Module) -> str | None:
    """None when ``model`` dispatches attention through the attention interface, else why not."""
    # A PreTrainedModel exists only once transformers' modeling code is imported: a model from elsewhere (timm)
    # is told apart without importing it (several hundred modules and tens of MB that its user never loads).
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None or not isinstance(model, modeling.PreTrainedModel):
        return f"{type(model).__name__} is not a transformers PreTrainedModel"
    if not model._can_set_attn_implementation():
        return (f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface "
                "(its attention is model-specific code)")
    return None


def install_attention(model: nn.Module, precision: PrecisionState, quantize: bool, granularity: str = "tensor",
                      replaced_implementation: str | None = None, fixed_bits: int | None = None,
                      quantize_errors: bool = True) -> AttentionQuantizer:
    """Switch ``model`` to the ``"cpt"`` attention function; raises ValueError naming why it cannot.

    ``replaced_implementation`` (default: the model's current one) is the kernel the function calls for
    full-precision products (SDPA or eager arithmetic); a loaded checkpoint passes the trained model's.
    ``fixed_bits`` holds the quantized products at that bit-width instead of the layers' bits;
    ``quantize_errors=False`` leaves their errors in full precision.
    """
    reason = attention_support(model)
    if reason is not None:
        raise ValueError(reason)
    _register()
    current = model.config._attn_implementation or "eager"
    replaced = replaced_implementation or (current if current != ATTENTION_NAME else "eager")
    state = AttentionQuantizer(precision, quantize, granularity, replaced, fixed_bits=fixed_bits,
                               quantize_errors=quantize_errors)
    for module in model.modules():
        if getattr(module, "config", None) is not None and not isinstance(module, type(model)):
            object.__setattr__(module, "cpt_attention", state)  # a plain attribute: not a submodule
            state._modules.append(module)
    object.__setattr__(model, "cpt_attention", state)
    model.set_attn_implementation(ATTENTION_NAME)
    return state


def find_attention_quantizer(model: nn.Module) -> AttentionQuantizer | None:
    return getattr(model, "cpt_attention", None)


def uninstall_attention(model: nn.Module) -> None:
    """Give the model back the attention implementation it had before `install_attention`."""
    state = find_attention_quantizer(model)
    if state is None:
        return
    for module in state._modules + [model]:
        module.__dict__.pop("cpt_attention", None)
    model.set_attn_implementation(state.replaced_implementation)
