"""The training GEMMs of quantized products (docs/method.md §2): operands fake-quantized in forward, kept for
backward as integer codes, not float copies.

`QuantizedProducts` is a quantized layer's (used by `QuantLayerMixin.forward`; the layer supplies its product,
``compute``, and its gradient products): it also quantizes the error once and forms both gradient products.
`QuantizedMatmul` is the attention's two products (``Q Kᵀ`` and ``P V``, `hf_cpt.nn.attention`), whose errors
are quantized by their own node. `quantized_input` forms the input operand that sibling layers share
(`hf_cpt.nn.shared_input`).
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..numerics import scratch
from ..numerics.error_ownership import error_held_alone
from ..numerics.errors import quantize_error
from ..numerics.fake_quant import fake_quantize, fake_quantize_compact, quantize_compact, restore_compact, token_range
from ..numerics.rotated_codes import rotated_token_codes
from ..numerics.rotation import Rotation
from .recompute import mark_float_product, mark_recomputable
from .relu_masks import hand_over_input
from .saved import same_view, saved_as_is
from .shared_input import SHARED_INPUT_BUFFER, SharedInput

NOT_SAVED = (None, None, None)

# The reused buffers a layer's training forward rotates into (`Rotation.apply`), chosen so that no rotation takes a
# buffer of its own (docs/method.md §2, "Reused buffers"): ``x R``, read only for its range and codes in a forward on
# codes, into the one its backward rebuilds the input in, idle in such a forward; ``W R`` into its own (a float
# forward fills the weight's from it), the steps of a rotation done factor by factor (a Conv1D's weight, along its
# first axis) in the weight's, idle until ``W R`` is made.
INPUT_ROTATION_BUFFERS = {"scratch": "input"}
WEIGHT_ROTATION_BUFFERS = {"scratch": "rotated_weight", "between": "weight"}

# Autograd nodes whose backward keeps their own output (a ReLU keeps its result): a quantized layer fed that output
# keeps a reference to it and quantizes it again in backward, instead of a second copy of it as codes.
RESULT_KEEPING_NODES = frozenset({"ReluBackward0", "SigmoidBackward0", "TanhBackward0"})


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
    return same_view(saved, x)


def keeps_input(layer, needs_input_grad: bool, needs_weight_grad: bool) -> bool:
    """Whether the backward reads the layer's input: the weight gradient does, the input gradient only where the
    layer's product needs it (`QuantLayerMixin.input_gradient_reads_input`)."""
    return needs_weight_grad or (needs_input_grad and layer.input_gradient_reads_input)


def quantized_operand(
    t: torch.Tensor, minimum: torch.Tensor | None, maximum: torch.Tensor | None, bits: torch.Tensor | None,
    compact: bool, keep: bool, scratch: str | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """(the operand as the product uses it, what the backward saves to rebuild it: nothing unless ``keep``). With
    ``scratch``, an operand kept as codes may be formed in that reused buffer (`hf_cpt.numerics.scratch`): for a
    product that reads it at once."""
    if minimum is None:
        return t, ((t, None, None) if keep else NOT_SAVED)
    if compact and keep:
        return fake_quantize_compact(t, minimum, maximum, bits, scratch)
    value = fake_quantize(t, minimum, maximum, bits)
    return value, ((value, None, None) if keep else NOT_SAVED)


def quantized_input(x: torch.Tensor, dim: int, rotation: Rotation | None, bits: torch.Tensor, compact: bool,
                    keep: bool, integer: bool) -> SharedInput:
    """``x`` rotated over ``dim``, its per-token range and its quantized operand (codes alone for products on codes,
    ``integer``; codes kept for the backward where ``keep``). In CPU training only ``x R``'s range and codes are
    read (the product reads the values made from them), so the graph holds a stand-in and ``x R`` is never formed
    where the native kernel makes its range and codes in one pass (`rotated_token_codes`), else goes into a reused
    buffer (docs/method.md §3); the fake-quantized values a float product reads go into a reused buffer of their own,
    whose generation the entry records."""
    buffered = keep and compact and not integer and x.device.type == "cpu"
    generation = (lambda: scratch.generation(SHARED_INPUT_BUFFER)) if buffered else (lambda: None)
    if rotation is not None and (integer or buffered):
        rotated = rotation.stand_in(x, dim)
        fused = rotated_token_codes(x.detach(), dim, rotation, bits, values=buffered,
                                    out=functools.partial(scratch.take, SHARED_INPUT_BUFFER))
        if fused is not None:  # x R's range and codes in one pass, x R never formed
            return SharedInput(rotated, *fused, generation())
        source = rotation.apply(x.detach(), dim, **INPUT_ROTATION_BUFFERS)
    else:
        rotated = None if rotation is None else rotation.apply(x, dim)
        source = x if rotated is None else rotated
    x_range = token_range(source, dim)
    with torch.no_grad():
        quantized = ((None, quantize_compact(source.detach(), *x_range, bits)) if integer  # codes only
                     else quantized_operand(source.detach(), *x_range, bits, compact, keep,
                                            SHARED_INPUT_BUFFER if buffered else None))
    return SharedInput(rotated, x_range, quantized, generation())


def _not_a_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` (e.g. float32 read in place over a product's int32 sums) as a tensor of its own over the same memory: a
    view returned by a custom Function may not be edited in place (an in-place ReLU after a Linear)."""
    if torch.compiler.is_dynamo_compiling() or t._base is None:  # a traced graph returns no view of its own
        return t
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                                                t.stride())


def _rebuilt_operand(saved: tuple[torch.Tensor | None, ...], dtype: torch.dtype, shape: torch.Size,
                     scratch: str | None = None) -> torch.Tensor:
    """The operand the forward used, or a meta tensor of its shape when it was not saved (not read); rebuilt from
    codes into the reused buffer ``scratch`` where given (`hf_cpt.numerics.scratch`: read once, then dropped)."""
    codes, scale, minimum = saved
    if codes is None:
        return torch.empty(shape, dtype=dtype, device="meta")
    return codes if scale is None else restore_compact(codes, scale, minimum, dtype, scratch)


class QuantizedProducts(torch.autograd.Function):
    """A quantized layer's GEMM in training (docs/method.md §2).

    Forward: the input and weight fake-quantized over the given ranges (an operand without a range is used
    as it is; an input quantized already, shared with sibling layers, comes as ``x_quantized``), then the
    layer's product. Saved for backward: only the operands a needed gradient reads (the
    input for the weight gradient, the weight for the input gradient, as autograd itself does), each as the
    integer codes of its quantized values (uint8 with its scale and minimum, up to 8 bits), not a float
    copy, rebuilt bit for bit in backward. A weight the layer quantized itself (reused within an optimizer step)
    comes as ``weight_quantized``: (its value, its codes). An input its producer keeps anyway (`kept_by_producer`)
    is saved as that tensor and quantized again in backward: the same elementwise function of the same values,
    range and bits, so the same operand bit for bit, and no copy.
    With ``integer`` (decided by `QuantLayerMixin.forward`: 8 bits or fewer, both operands quantized, a layer with
    `compute_on_codes`), the forward product runs on the operands' integer codes (`hf_cpt.numerics.integer_matmul`)
    and the fake-quantized floats are never formed; an operand given quantized then comes as (None, its codes).
    With ``learn_codes`` (`PrecisionState.learns_products_on_codes`, a layer that could run on codes), a float
    product whose output would be recomputable on codes tags it for the activation it feeds (`hf_cpt.nn.recompute`).
    Backward: straight-through for both operands; with error bits (``grad_bits``, a tensor never modified afterwards:
    `PrecisionState.error_bits`), the error is quantized once and each
    product takes the quantized or the full-precision error as ``errors.products`` says (the bias gradient
    follows the weight gradient). The products run in the error's dtype, as autograd's own backward would
    under autocast. A rotated layer passes ``W R`` computed once outside autograd, and its weight gradient is
    rotated back here (`_weight_gradient`), not by autograd through a second rotation of the weight.
    """

    @staticmethod
    def forward(ctx, x, x_min, x_max, weight, weight_min, weight_max, bias, layer, bits, compact, grad_bits, errors,
                rotated_weight, weight_rotation, x_quantized, weight_quantized=None, integer=False, learn_codes=False):
        needs_x, needs_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[3]
        if x.device.type == "cpu" and any(ctx.needs_input_grad) and not torch.compiler.is_compiling():
            _awaiting_backward.add(ctx)
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
            x_codes = x_quantized[1] if x_quantized is not None else quantize_compact(x, x_min, x_max, bits)
            weight_codes = (weight_quantized[1] if weight_quantized is not None
                            else quantize_compact(operand, weight_min, weight_max, bits))
            x_saved = (x, x_min, x_max) if producer_keeps else x_codes if keep_x else NOT_SAVED
            if layer.cpt_precision.relu_masks:
                hand_over_input(x, x_saved[0], layer.cpt_precision)
            ctx.save_for_backward(*x_saved, *(weight_codes if needs_x else NOT_SAVED))
            autocast = torch.is_autocast_enabled(x.device.type)
            dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
            output = _not_a_view(layer.compute_on_codes(x_codes, weight_codes, bits, bias).to(dtype))
            if (keep_x and needs_x and not producer_keeps and layer.cpt_precision.recompute_activation_inputs
                    and not torch.compiler.is_dynamo_compiling()):  # both codes kept: exact to recompute
                mark_recomputable(output, layer, x_codes, weight_codes, bits, bias, dtype)
            return output
        # An operand quantized here is read by the product alone (its codes are what the backward keeps): it may be
        # formed in a reused buffer, the one its backward rebuilds it in (never in use at the same time).
        if x_quantized is None:
            x_value, x_saved = quantized_operand(x, x_min, x_max, bits, compact, keep_x, scratch="input")
            if producer_keeps:
                x_saved = (x, x_min, x_max)
        else:  # the sibling layers' one copy (made with the same keep_x): one copy of the codes for all
            x_value, x_saved = x_quantized
        if weight_quantized is None:
            weight_value, weight_saved = quantized_operand(operand, weight_min, weight_max, bits, compact, needs_x,
                                                           scratch="weight")
        else:  # quantized by the layer already (its codes kept for the other forwards of this optimizer step)
            weight_value, codes = weight_quantized
            weight_saved = codes if needs_x else NOT_SAVED
        if layer.cpt_precision.relu_masks:
            hand_over_input(x, x_saved[0], layer.cpt_precision)
        ctx.save_for_backward(*x_saved, *weight_saved)
        output = _handed_on(layer, layer.compute_into, x_value, weight_value, owner=layer)
        if output is None:
            output = layer.compute(x_value, weight_value)
        if learn_codes and keep_x and needs_x and not producer_keeps and not torch.compiler.is_dynamo_compiling():
            mark_float_product(output, layer)  # where it would be recomputable on codes
        return output

    @staticmethod
    def backward(ctx, error):
        errors = ctx.errors
        # Quantized over the error itself where nothing else holds it and no product reads it unquantized; asked
        # first: each name given to the error is one more reference to it.
        overwrite = (ctx.grad_bits is not None and ctx.layer.cpt_precision.errors_in_place
                     and errors.quantizes_input_gradient and errors.quantizes_weight_gradient
                     and error_held_alone(error))
        saved = ctx.saved_tensors
        x_dtype, weight_dtype, bias_dtype = ctx.dtypes
        layer = ctx.layer
        input_error = weight_error = error
        if ctx.grad_bits is not None:
            quantized = quantize_error(error, ctx.grad_bits, errors, layer.output_feature_dim, scratch="error",
                                       overwrite=overwrite)
            input_error = quantized if errors.quantizes_input_gradient else error
            weight_error = quantized if errors.quantizes_weight_gradient else error
        compute_dtype = error.dtype
        # The quantized error and the rebuilt operands are read by the products below and dropped: reused buffers
        # (`hf_cpt.numerics.scratch`).
        if ctx.x_bits is None:
            x = _rebuilt_operand(saved[:3], x_dtype, ctx.shapes[0], scratch="input").to(compute_dtype)
        else:  # the producer's output, quantized again as the forward did
            x = fake_quantize_compact(*saved[:3], ctx.x_bits, "input")[0].to(compute_dtype)
        weight = _rebuilt_operand(saved[3:], weight_dtype, ctx.shapes[1], scratch="weight").to(compute_dtype)
        grad_x, grad_weight = _gradients(layer, input_error, weight_error, x, weight, ctx.weight_rotation,
                                         ctx.needs_input_grad[0], ctx.needs_input_grad[3])
        grad_x = None if grad_x is None else grad_x.to(x_dtype)
        grad_weight = None if grad_weight is None else grad_weight.to(weight_dtype)
        grad_bias = None
        if bias_dtype is not None and ctx.needs_input_grad[6]:
            feature_dim = layer.output_feature_dim % weight_error.dim()
            grad_bias = weight_error.sum([d for d in range(weight_error.dim()) if d != feature_dim]).to(bias_dtype)
        _backward_ran(ctx)
        return (grad_x, None, None, grad_weight, None, None, grad_bias, None, None, None, None, None, None, None, None,
                None, None, None)


# The nodes of quantized products made on CPU whose backward has not run yet; a graph freed unrun leaves by itself.
_awaiting_backward: weakref.WeakSet = weakref.WeakSet()
_optimizer_hook = None  # the process-wide optimizer step pre-hook that hands idle buffers back, once registered


def _backward_ran(ctx) -> None:
    """After a quantized product's backward: once no product made on this CPU awaits its backward, the pass has
    reached its last quantized layer and the reused buffers are idle until the next forward (`scratch.mark_idle`),
    unless the layer's settings keep them (``CPTConfig.hand_back_buffers=False``). Their pages go back to the system
    when the next optimizer step starts (any `torch.optim.Optimizer`, through a process-wide step pre-hook): the
    step, where a model with a large optimizer state peaks, runs without them resident; a loop that steps once per
    accumulated micro-batches faults them in again once per step, and one with no optimizer step (a layer timed
    alone) never (docs/method.md §2, "Reused buffers")."""
    global _optimizer_hook
    if ctx in _awaiting_backward:
        _awaiting_backward.discard(ctx)
        if not _awaiting_backward and ctx.layer.cpt_precision.hand_back_buffers:
            scratch.mark_idle()
            if _optimizer_hook is None:
                _optimizer_hook = register_optimizer_step_pre_hook(_hand_back_idle_buffers)


def _hand_back_idle_buffers(optimizer, args, kwargs) -> None:
    """Optimizer step pre-hook: the calling thread's idle reused buffers go back to the system (CPU autograd runs a
    backward on the thread that called it, which in a training loop also steps the optimizer), and so do the idle
    handed-on blocks (`scratch.release_idle_blocks`)."""
    scratch.hand_back_if_idle()
    scratch.release_idle_blocks()


def _gradients(
    layer, input_error: torch.Tensor, weight_error: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
    rotation: Rotation | None, needs_x: bool, needs_weight: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the input gradient, the weight gradient), None where not needed: in one call where both come from one error
    and the layer's backward kernel forms them together (`QuantLayerMixin.both_gradients`), else one product each."""
    if needs_x and needs_weight and input_error is weight_error and rotation is None:
        both = layer.both_gradients(input_error, x, weight)
        if both is not None:
            return both
    grad_x = _handed_on(layer, layer.input_gradient_into, input_error, x, weight) if needs_x else None
    if needs_x and grad_x is None:
        grad_x = layer.input_gradient(input_error, x, weight)
    grad_weight = _weight_gradient(layer, weight_error, x, weight, rotation) if needs_weight else None
    return grad_x, grad_weight


def _handed_on(layer, product, *operands: torch.Tensor, owner: object = None) -> torch.Tensor | None:
    """``product(*operands, allocate)`` (a layer's `compute_into` or `input_gradient_into`): its result in a handed-on
    block (`scratch.handed_on`, for ``owner``), in CPU training where the layer's settings ask for it
    (``CPTConfig.output_mappings``), outside autocast (whose casts a product into a given tensor skips) and tracing;
    None where it does not run."""
    if (product is None or not layer.cpt_precision.output_mappings or operands[0].device.type != "cpu"
            or torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling()):
        return None
    return product(*operands, functools.partial(scratch.handed_on, owner=owner))


def _weight_gradient(
    layer, error: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rotation: Rotation | None
) -> torch.Tensor:
    """The gradient of the layer's own weight ``W`` when it computed with ``W R``: ``dL/d(W R)`` rotated back by
    ``R^T``, or, the same product since the layer is linear in its input's features, the product with the input
    rotated back (``Q(x R) R^T``), whichever rotates fewer values (few tokens: the input)."""
    if rotation is None:
        return layer.weight_gradient(error, x, weight)
    if rotation.signs.dtype != x.dtype:
        rotation = rotation.to(x.device, x.dtype)
    if x.numel() <= weight.numel():  # x rebuilt in a reused buffer is read no more: rotated back in place there
        in_place = not torch.compiler.is_compiling() and scratch.holds(x)  # a traced tensor has no address
        x = rotation.apply(x, layer.input_feature_dim, transpose=True, in_place=in_place)
        return layer.weight_gradient(error, x, weight)
    return rotation.apply(layer.weight_gradient(error, x, weight), layer.weight_feature_dim, transpose=True,
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
