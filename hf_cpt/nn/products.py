"""The training GEMMs of quantized products (docs/method.md §2): operands fake-quantized in forward, kept for backward
as integer codes. `QuantizedProducts`: a quantized layer's product and both gradient products from one quantized
error; `QuantizedMatmul`: the attention's ``Q Kᵀ`` and ``P V``; `quantized_input`: the input sibling layers share.
"""

from __future__ import annotations

import weakref

import torch

from ..backends import backend_for
from ..numerics.fake_quant import fake_quantize, token_range
from ..numerics.packing import pack_codes, unpack_codes
from ..numerics.rotated_codes import rotated_token_codes
from ..numerics.rotation import Rotation
from .recompute import mark_recomputable
from .shared_input import SharedInput

NOT_SAVED = (None, None, None)

# Autograd nodes whose backward keeps their own output (a ReLU keeps its result): a quantized layer fed that output
# keeps a reference to it and quantizes it again in backward, instead of a second copy of it as codes.
RESULT_KEEPING_NODES = frozenset({"ReluBackward0", "SigmoidBackward0", "TanhBackward0"})


def saved_as_is() -> bool:
    """Whether a tensor saved for backward now is kept as it is: no saved-tensor hooks run (offloading and
    checkpointing keep a copy, or nothing) and no graph is being traced."""
    hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return not torch.compiler.is_dynamo_compiling() and hooks is not None and hooks(False) is None


def kept_by_producer(x: torch.Tensor) -> bool:
    """Whether the autograd node that produced ``x`` keeps ``x`` itself for its backward, so that a reference to it
    costs no memory. Not while saved-tensor hooks run (offloading, checkpointing: the node's copy is not ``x``)."""
    if not saved_as_is():
        return False
    node = x.grad_fn
    if node is None or node.name() not in RESULT_KEEPING_NODES:
        return False
    try:
        saved = node._saved_result
    except RuntimeError:  # a backward through the producer ran already and freed it
        return False
    same_storage = saved.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    return same_storage and (saved.storage_offset(), saved.shape, saved.stride()) == (x.storage_offset(), x.shape,
                                                                                       x.stride())


def keeps_input(layer, needs_input_grad: bool, needs_weight_grad: bool) -> bool:
    """Whether the backward reads the layer's input: the weight gradient does, the input gradient only where the
    layer's product needs it (`QuantLayerMixin.input_gradient_reads_input`)."""
    return needs_weight_grad or (needs_input_grad and layer.input_gradient_reads_input)


def quantized_operand(
    t: torch.Tensor, minimum: torch.Tensor | None, maximum: torch.Tensor | None, bits: torch.Tensor | None,
    compact: bool, keep: bool,
) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """(the operand as the product uses it, what the backward saves to rebuild it: nothing unless ``keep``)."""
    if minimum is None:
        return t, ((t, None, None) if keep else NOT_SAVED)
    if compact and keep:
        return backend_for(t.device).operand(t, minimum, maximum, bits)
    value = fake_quantize(t, minimum, maximum, bits)
    return value, ((value, None, None) if keep else NOT_SAVED)


def quantized_input(x: torch.Tensor, dim: int, rotation: Rotation | None, bits: torch.Tensor, compact: bool,
                    keep: bool, integer: bool) -> SharedInput:
    """``x`` rotated over ``dim``, its per-token range and its quantized operand (codes alone for products on codes,
    ``integer``; codes kept for the backward where ``keep``). In CPU training only ``x R``'s range and codes are
    read (the product reads the values made from them), so the graph holds a stand-in and ``x R`` is never formed
    where the native kernel makes its range and codes in one pass (`rotated_token_codes`; docs/method.md §3)."""
    backend = backend_for(x.device)
    from_codes = keep and compact and not integer and backend.native
    if rotation is not None and (integer or from_codes):
        rotated = rotation.stand_in(x, dim)
        fused = rotated_token_codes(x.detach(), dim, rotation, bits, values=from_codes)
        if fused is not None:  # x R's range and codes in one pass, x R never formed
            return SharedInput(rotated, *fused)
        source = rotation.apply(x.detach(), dim)
    else:
        rotated = None if rotation is None else rotation.apply(x, dim)
        source = x if rotated is None else rotated
    codes_wanted = integer or (compact and keep)
    with torch.no_grad():
        fused = backend.token_operand(source.detach(), dim, bits, values=not integer) if codes_wanted else None
        if fused is not None:  # the range and the codes in one pass
            return SharedInput(rotated, *fused)
        x_range = token_range(source, dim)
        quantized = (backend.operand(source.detach(), *x_range, bits, values=False) if integer  # codes only
                     else quantized_operand(source.detach(), *x_range, bits, compact, keep))
    return SharedInput(rotated, x_range, quantized)


def _not_a_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` (e.g. float32 read in place over a product's int32 sums) as a tensor of its own over the same memory: a
    view returned by a custom Function may not be edited in place (an in-place ReLU after a Linear)."""
    if torch.compiler.is_dynamo_compiling() or t._base is None:  # a traced graph returns no view of its own
        return t
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                                                t.stride())


# Packed codes saved by eager forwards: each shared input's or reused weight's codes packed once for all its readers.
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _nibbles(layer) -> bool:
    """Whether the layer's saved codes may go two a byte now: read outside compiled graphs only (a guard there)."""
    return not torch.compiler.is_dynamo_compiling() and layer.cpt_precision.nibble_codes


def packed_for_backward(saved: tuple[torch.Tensor | None, ...], nibbles: bool) -> tuple[torch.Tensor | None, ...]:
    """``saved`` with its codes packed two a byte where the backend packs saved codes and the bits allow (``nibbles``,
    `_nibbles`: at most 4, never in a compiled graph): half the memory for a pass each way."""
    codes, scale, minimum = saved
    if (not nibbles or scale is None or codes is None or codes.dtype != torch.uint8 or not codes.dim()
            or not backend_for(codes.device).packs_saved_codes):
        return saved
    known = _PACKED.get(codes)
    packed = known() if known is not None else None
    if packed is None:
        packed = pack_codes(codes.reshape(-1, codes.shape[-1]), 4)
        _PACKED[codes] = weakref.ref(packed)
    return packed, scale, minimum


def _rebuilt_operand(saved: tuple[torch.Tensor | None, ...], dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    """The operand the forward used, or a meta tensor of its shape when it was not saved (not read); codes packed two
    a byte (`packed_for_backward`) are unpacked first."""
    codes, scale, minimum = saved
    if codes is None:
        return torch.empty(shape, dtype=dtype, device="meta")
    if scale is not None and codes.numel() != shape.numel():
        codes = unpack_codes(codes, 4, shape[-1]).view(shape)
    return codes if scale is None else backend_for(codes.device).restore(codes, scale, minimum, dtype)


class QuantizedProducts(torch.autograd.Function):
    """A quantized layer's GEMM in training (docs/method.md §2, §3).

    Forward: the input and weight fake-quantized over the given ranges (an operand without a range is used as it is; an
    input shared with sibling layers comes as ``x_quantized``, a weight reused within an optimizer step as
    ``weight_quantized``), then the product; with ``integer`` (`QuantLayerMixin.forward` decides), the product runs on
    the operands' integer codes (`hf_cpt.numerics.integer_matmul`). Saved for backward: only the operands a needed
    gradient reads, as uint8 codes rebuilt bit for bit, or the tensor their producer keeps (`kept_by_producer`).
    Backward: straight-through for both operands; with error bits (``grad_bits``, a tensor never modified afterwards),
    the error is quantized once and each product takes the quantized or full-precision error as ``errors.products``
    says, in the error's dtype. A rotated layer passes ``W R`` computed outside autograd; its weight gradient is
    rotated back here (`_weight_gradient`).
    """

    @staticmethod
    def forward(ctx, x, x_min, x_max, weight, weight_min, weight_max, bias, layer, bits, compact, grad_bits, errors,
                rotated_weight, weight_rotation, x_quantized, weight_quantized=None, integer=False):
        needs_x, needs_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[3]
        keep_x = keeps_input(layer, needs_x, needs_weight)
        ctx.layer, ctx.errors, ctx.weight_rotation = layer, errors, weight_rotation
        ctx.grad_bits = grad_bits  # never modified (`PrecisionState.error_bits`): the bits of this forward
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.shapes = (x.shape, weight.shape)
        operand = weight if rotated_weight is None else rotated_weight
        # An input its producer keeps anyway is saved as that tensor, with its range and bits, instead of as codes.
        producer_keeps = keep_x and compact and x_quantized is None and x_min is not None and kept_by_producer(x)
        ctx.x_bits = bits.clone() if producer_keeps else None  # a copy: the schedule edits ``bits`` in place
        if integer:
            backend = backend_for(x.device)
            x_codes = (x_quantized[1] if x_quantized is not None
                       else backend.operand(x, x_min, x_max, bits, values=False)[1])
            weight_codes = (weight_quantized[1] if weight_quantized is not None
                            else backend.operand(operand, weight_min, weight_max, bits, values=False)[1])
            x_saved = (x, x_min, x_max) if producer_keeps else x_codes if keep_x else NOT_SAVED
            # both codes kept: exact to recompute the output from them (they stay unpacked for it)
            recompute = (keep_x and needs_x and not producer_keeps and layer.cpt_precision.recompute_activation_inputs
                         and not torch.compiler.is_dynamo_compiling())
            nibbles = not recompute and _nibbles(layer)
            ctx.save_for_backward(*packed_for_backward(x_saved, nibbles),
                                  *packed_for_backward(weight_codes if needs_x else NOT_SAVED, nibbles))
            autocast = torch.is_autocast_enabled(x.device.type)
            dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
            output = _not_a_view(layer.compute_on_codes(x_codes, weight_codes, bits, bias).to(dtype))
            if recompute:
                mark_recomputable(output, layer, x_codes, weight_codes, bits, bias, dtype)
            return output
        if x_quantized is None:
            x_value, x_saved = quantized_operand(x, x_min, x_max, bits, compact, keep_x)
            if producer_keeps:
                x_saved = (x, x_min, x_max)
        else:  # the sibling layers' one copy (made with the same keep_x): one copy of the codes for all
            x_value, x_saved = x_quantized
        if weight_quantized is None:
            weight_value, weight_saved = quantized_operand(operand, weight_min, weight_max, bits, compact, needs_x)
        else:  # quantized by the layer already (its codes kept for the other forwards of this optimizer step)
            weight_value, codes = weight_quantized
            weight_saved = codes if needs_x else NOT_SAVED
        nibbles = _nibbles(layer)
        ctx.save_for_backward(*packed_for_backward(x_saved, nibbles), *packed_for_backward(weight_saved, nibbles))
        output = layer.compute(x_value.to(x.dtype), weight_value.to(weight.dtype))  # a rotation computes in float32
        return output

    @staticmethod
    def backward(ctx, error):
        errors = ctx.errors
        saved = ctx.saved_tensors
        x_dtype, weight_dtype, bias_dtype = ctx.dtypes
        layer = ctx.layer
        input_error = weight_error = error
        int8 = (False, False)
        if ctx.grad_bits is not None:
            backend = backend_for(error.device)
            int8 = int8_products(layer, errors)
            # the error as codes for an int8 input gradient (its values rebuilt where the weight gradient reads them)
            error_codes = backend.error_codes(error, ctx.grad_bits, errors) if int8[0] else None
            int8 = (error_codes is not None, int8[1])
            float_weight = errors.quantizes_weight_gradient and not int8[1]  # a float product of the quantized error
            quantized = None
            if error_codes is not None:
                if float_weight:
                    quantized = backend.restore(*error_codes, error.dtype).view(error.shape)
            elif errors.quantizes_input_gradient or float_weight:
                quantized = backend.error(error, ctx.grad_bits, errors, layer.output_feature_dim,
                                          layer.cpt_precision.fused_errors)
            input_error = (error_codes if error_codes is not None else quantized if errors.quantizes_input_gradient
                           else error)
            weight_error = quantized if float_weight else error  # an int8 weight gradient quantizes its own
        compute_dtype = error.dtype
        # The rebuilt input is this backward's own tensor (not a saved one) where it came from codes.
        x_fresh = ctx.x_bits is not None or saved[1] is not None
        if ctx.x_bits is None:
            x = _rebuilt_operand(saved[:3], x_dtype, ctx.shapes[0]).to(compute_dtype)
        else:  # the producer's output, quantized again as the forward did
            x = backend_for(saved[0].device).operand(*saved[:3], ctx.x_bits)[0].to(compute_dtype)
        weight = _rebuilt_operand(saved[3:], weight_dtype, ctx.shapes[1]).to(compute_dtype)
        int8_bits = ctx.grad_bits if int8[1] else None
        grad_x, grad_weight = _gradients(layer, input_error, weight_error, x, weight, ctx.weight_rotation,
                                         ctx.needs_input_grad[0], ctx.needs_input_grad[3], x_fresh, int8[0], int8_bits)
        grad_x = None if grad_x is None else grad_x.to(x_dtype)
        grad_weight = None if grad_weight is None else grad_weight.to(weight_dtype)
        grad_bias = None
        if bias_dtype is not None and ctx.needs_input_grad[6]:
            feature_dim = layer.output_feature_dim % weight_error.dim()
            grad_bias = weight_error.sum([d for d in range(weight_error.dim()) if d != feature_dim]).to(bias_dtype)
        return (grad_x, None, None, grad_weight, None, None, grad_bias, None, None, None, None, None, None, None, None,
                None, None, None)


def int8_products(layer, errors) -> tuple[bool, bool]:
    """Whether the layer's (input gradient, weight gradient) run on int8 grids (`hf_cpt.numerics.backward_products`):
    where the option asks for it, the product's error is quantized and the layer is a matrix product."""
    matrix = layer.compute_on_codes is not None
    return (matrix and errors.input_product == "int8" and errors.quantizes_input_gradient,
            matrix and errors.weight_product == "int8" and errors.quantizes_weight_gradient)


def _as_out_in(layer, weight: torch.Tensor) -> torch.Tensor:
    """A matrix layer's weight (or weight gradient) as ``[out, in]`` (GPT-2's Conv1D keeps ``[in, out]``)."""
    return weight if layer.weight_channel_dim == 0 else weight.t()


def _int8_input_gradient(layer, error: tuple, weight: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The input gradient ``[..., in]`` (``shape``: the input's) from the error's codes, in the weight's dtype."""
    grad = backend_for(weight.device).int8_input_gradient(error, _as_out_in(layer, weight))
    return grad.view(*shape[:-1], grad.shape[-1]).to(weight.dtype)


def _int8_weight_gradient(layer, error: torch.Tensor, x: torch.Tensor, error_bits: torch.Tensor) -> torch.Tensor:
    grad = backend_for(error.device).int8_weight_gradient(error.reshape(-1, error.shape[-1]),
                                                           x.reshape(-1, x.shape[-1]), error_bits)
    return _as_out_in(layer, grad).to(error.dtype)


def _gradients(
    layer, input_error: torch.Tensor, weight_error: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
    rotation: Rotation | None, needs_x: bool, needs_weight: bool, x_fresh: bool = False, int8_input: bool = False,
    int8_error_bits: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the input gradient, the weight gradient), None where not needed: in one call where both come from one error
    and the layer's backward kernel forms them together (`QuantLayerMixin.both_gradients`), else one product each;
    on int8 grids with ``int8_input`` (``input_error``: its codes) and ``int8_error_bits`` (the error bits of an int8
    weight gradient)."""
    if needs_x and needs_weight and input_error is weight_error and rotation is None and not int8_input:
        both = layer.both_gradients(input_error, x, weight)
        if both is not None:
            return both
    grad_x = None
    if needs_x:
        grad_x = (_int8_input_gradient(layer, input_error, weight, x.shape) if int8_input
                  else layer.input_gradient(input_error, x, weight))
    grad_weight = None
    if needs_weight:
        grad_weight = _weight_gradient(layer, weight_error, x, weight, rotation, x_fresh, int8_error_bits)
    return grad_x, grad_weight


def _weight_gradient(
    layer, error: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rotation: Rotation | None,
    x_fresh: bool = False, int8_error_bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradient of the layer's own weight ``W`` when it computed with ``W R``: ``dL/d(W R)`` rotated back by
    ``R^T``, or, the same product since the layer is linear in its input's features, the product with the input
    rotated back (``Q(x R) R^T``), whichever rotates fewer values (few tokens: the input; rotated in place where
    ``x_fresh``: the backward's own tensor, read no more). On int8 grids (``int8_error_bits``) the product always
    takes the operands as the forward did (the grids are those of ``x R``)."""
    int8 = int8_error_bits is not None

    def product(x: torch.Tensor) -> torch.Tensor:
        return (_int8_weight_gradient(layer, error, x, int8_error_bits) if int8
                else layer.weight_gradient(error, x, weight))

    if rotation is None:
        return product(x)
    if rotation.signs.dtype != x.dtype:
        rotation = rotation.to(x.device, x.dtype)
    if x.numel() <= weight.numel() and not int8:
        in_place = x_fresh and not torch.compiler.is_compiling()
        return product(rotation.apply(x, layer.input_feature_dim, transpose=True, in_place=in_place))
    return rotation.apply(product(x), layer.weight_feature_dim, transpose=True,
                          in_place=True)  # a fresh gradient: no second weight-sized tensor


class QuantizedMatmul(torch.autograd.Function):
    """``Q(a) @ Q(b)`` over the given ranges in training, straight-through for both operands, each saved as the
    integer codes of its quantized values (``compact``: uint8, up to 8 bits) where the other's gradient reads it:
    autograd's own matmul would keep a float copy of both (docs/method.md §8). The gradients are those of
    ``torch.matmul`` on the fake-quantized operands, bit for bit."""

    @staticmethod
    def forward(ctx, a, a_min, a_max, b, b_min, b_max, bits, compact):
        needs_a, needs_b = ctx.needs_input_grad[0], ctx.needs_input_grad[3]
        a_value, a_saved = quantized_operand(a, a_min, a_max, bits, compact, keep=needs_b)
        b_value, b_saved = quantized_operand(b, b_min, b_max, bits, compact, keep=needs_a)
        ctx.save_for_backward(*a_saved, *b_saved)
        ctx.operands = ((a.dtype, a.shape), (b.dtype, b.shape))
        return torch.matmul(a_value, b_value)

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        (a_dtype, a_shape), (b_dtype, b_shape) = ctx.operands
        grad_a = grad_b = None  # in the error's dtype, as autograd's matmul backward runs under autocast
        if ctx.needs_input_grad[0]:
            b = _rebuilt_operand(saved[3:], b_dtype, b_shape).to(grad.dtype)
            grad_a = grad.matmul(b.transpose(-1, -2)).to(a_dtype)
        if ctx.needs_input_grad[3]:
            a = _rebuilt_operand(saved[:3], a_dtype, a_shape).to(grad.dtype)
            grad_b = a.transpose(-1, -2).matmul(grad).to(b_dtype)
        return grad_a, None, None, grad_b, None, None, None, None
