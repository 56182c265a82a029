"""Activation inputs recomputed from codes in backward (docs/method.md §2, "Recomputed activation inputs").

An activation such as GELU keeps its input for its backward: the float output of the quantized layer before it,
a full-size float32 tensor per layer (24 MiB per layer of BERT-base at batch 16x128). A product on integer codes
(`hf_cpt.numerics.integer_matmul`) is exact by construction: the same codes give the same output bit for bit, and
the layer keeps those codes for its own backward anyway. So a layer whose product ran on codes tags its output with
a `RecomputableOutput` (references to the codes, no copy), an activation converted here keeps that instead of its
input, and its backward recomputes the input and differentiates the activation as autograd would: the same
gradient bit for bit, for one more product on codes per layer and step (the cost meter counts it).

Activations are converted in place, like the layers (same object, ``isinstance`` holds, no state but the
``output_mappings`` flag). One that is fed anything else (a normalization's output, an edited tensor) runs as before.

Which layers multiply codes is `integer_matmul`'s choice. Under ``"activations"`` (an option on a CPU without int8
dot products, where a product on codes costs more than a float one: memory for time) a layer multiplies floats until
an activation it feeds asks for its codes: its float product tags its output (`mark_float_product`), a converted
activation fed that output marks the layer (`PrecisionState.mark_products_on_codes`), and from the next optimizer
step on its product runs on codes and its output is recomputable (docs/method.md §2, "Integer products").
"""

from __future__ import annotations

import torch
from torch import nn

from . import relu_masks

# The attribute a layer's output carries when it can be recomputed from codes.
RECOMPUTABLE = "_cpt_recomputable"
# The attribute a float product's output carries where its layer could multiply codes instead: (layer, version).
FLOAT_PRODUCT = "_cpt_float_product"


class RecomputableOutput:
    """How to recompute one output of a product on codes: the layer, the operands' (codes, scale, minimum), the
    bits, bias and dtype it ran with. References the codes (kept by the layer anyway); copies the bits and bias."""

    def __init__(self, layer: nn.Module, x_codes: tuple, weight_codes: tuple, bits: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype, output: torch.Tensor) -> None:
        self.layer, self.dtype = layer, dtype
        self.tensors: tuple[torch.Tensor, ...] | None = (*x_codes, *weight_codes)
        # Copies of what may change before the backward: the schedule updates the bits in place, an optimizer or a
        # sharding wrapper (FSDP frees the gathered parameters after the forward) the bias. Both are small.
        self.bits = bits.clone()
        self.bias = None if bias is None else bias.detach().clone()
        self.version = output._version

    def matches(self, output: torch.Tensor) -> bool:
        """Whether ``output`` still holds what the product computed (not edited in place since)."""
        return output._version == self.version

    def recompute(self, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The output again, bit for bit, from ``tensors`` (the codes this recipe referenced)."""
        output = self.layer.compute_on_codes(tensors[:3], tensors[3:], self.bits, self.bias).to(self.dtype)
        self.layer.cpt_precision.recomputed_macs += output.numel() * tensors[0].shape[-1]
        return output

    def without_tensors(self) -> RecomputableOutput:
        recipe = object.__new__(RecomputableOutput)
        recipe.__dict__.update(self.__dict__, tensors=None)
        return recipe


def mark_recomputable(output: torch.Tensor, layer: nn.Module, x_codes: tuple, weight_codes: tuple,
                      bits: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
    """Tag ``output``, computed on ``x_codes`` and ``weight_codes`` (kept by the layer's backward), ``bits`` and
    ``bias``, as recomputable."""
    setattr(output, RECOMPUTABLE, RecomputableOutput(layer, x_codes, weight_codes, bits, bias, dtype, output))


def mark_float_product(output: torch.Tensor, layer: nn.Module) -> None:
    """Tag ``output``, a float product of ``layer`` that could have run on its codes, with its layer: an activation
    fed it unedited marks the layer to multiply codes (`PrecisionState.mark_products_on_codes`)."""
    setattr(output, FLOAT_PRODUCT, (layer, output._version))


def _ask_for_codes(x: torch.Tensor) -> None:
    """Mark the layer whose float product ``x`` is, unedited, to multiply codes from the next optimizer step on."""
    source = getattr(x, FLOAT_PRODUCT, None)
    if source is not None and source[1] == x._version:
        source[0].cpt_precision.mark_products_on_codes(source[0])


class _ActivationOfRecomputedInput(torch.autograd.Function):
    """``activation(x)``, keeping the codes ``x`` is recomputed from instead of ``x``."""

    @staticmethod
    def forward(ctx, x, activation, recipe, *tensors):
        ctx.activation, ctx.recipe = activation, recipe.without_tensors()
        ctx.save_for_backward(*tensors)  # saved like the layer's own codes (offloading hooks see them)
        return activation.float_forward(x)

    @staticmethod
    def backward(ctx, grad):
        tensors = ctx.saved_tensors  # read once (a checkpointed region unpacks each saved tensor once)
        x = ctx.recipe.recompute(tensors)
        with torch.enable_grad():
            x.requires_grad_()
            (grad_x,) = torch.autograd.grad(ctx.activation.float_forward(x), x, grad)
        return (grad_x, None, None) + (None,) * len(tensors)


class RecomputedActivationMixin:
    """An elementwise, parameter-free activation that recomputes its input in backward when the input is a
    recomputable output (`RecomputableOutput`); any other input runs the activation as it was."""

    float_class: type  # set on each converted class
    masks_relu_output = False  # `ReLUKeepingMask`: keeps its output until a quantized layer hands it a mask

    def float_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.float_class.forward(self, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_dynamo_compiling():  # traced layers tag nothing
            return self.float_forward(x)
        recipe = getattr(x, RECOMPUTABLE, None) if isinstance(x, torch.Tensor) else None
        # autograd records this call: the activation may keep codes in place of its input
        recorded = isinstance(x, torch.Tensor) and torch.is_grad_enabled() and not getattr(self, "inplace", False)
        if recipe is None and recorded:
            _ask_for_codes(x)
        if recipe is None or recipe.tensors is None or not recorded or not recipe.matches(x):
            if self.masks_relu_output and isinstance(x, torch.Tensor) and relu_masks.runs_here(x):
                return relu_masks.relu_handing_over(x, self.inplace)
            return self.float_forward(x)
        return _ActivationOfRecomputedInput.apply(x, self, recipe, *recipe.tensors)


def _activation_classes() -> list[type]:
    """The float classes converted: elementwise activations without parameters, from torch and transformers."""
    classes = [nn.GELU, nn.SiLU, nn.Mish, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Hardswish, nn.Tanh, nn.Sigmoid,
               nn.Softplus, nn.ELU]
    try:
        from transformers import activations
    except ImportError:  # pragma: no cover - transformers is a dependency
        return classes
    names = ("GELUActivation", "NewGELUActivation", "FastGELUActivation", "QuickGELUActivation", "GELUTanh",
             "AccurateGELUActivation", "ClippedGELUActivation", "SiLUActivation", "MishActivation",
             "ReLUSquaredActivation", "LaplaceActivation", "PytorchGELUTanh")
    return classes + [getattr(activations, name) for name in names if hasattr(activations, name)]


def _recomputed_class(float_class: type, name: str | None = None, **attributes) -> type:
    cls = type(name or f"Recomputed{float_class.__name__}", (RecomputedActivationMixin, float_class),
               {"float_class": float_class, "__module__": __name__, "__doc__": float_class.__doc__, **attributes})
    globals()[cls.__name__] = cls  # importable by name: a pickled model finds its class
    return cls


# float activation class -> its recomputing class
RECOMPUTED_ACTIVATION_CLASSES: dict[type, type] = {
    float_class: _recomputed_class(float_class) for float_class in dict.fromkeys(_activation_classes())
}
# A ReLU that also keeps a mask in place of an output a quantized layer keeps as codes (`relu_masks`).
ReLUKeepingMask = _recomputed_class(nn.ReLU, "ReLUKeepingMask", masks_relu_output=True)


def convert_activation(module: nn.Module, recompute: bool = True, relu_masks: bool = True) -> bool:
    """Make ``module`` recompute its input where it can (``recompute``), or, a ReLU, keep a mask in place of its
    output where it can (``relu_masks``, `hf_cpt.nn.relu_masks`), in place; False when its class is not converted
    for either or it holds parameters or buffers."""
    masks = relu_masks and type(module) is nn.ReLU
    recomputed = ReLUKeepingMask if masks else RECOMPUTED_ACTIVATION_CLASSES.get(type(module)) if recompute else None
    if recomputed is None or any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        return False
    module.__class__ = recomputed
    return True


def restore_activation(module: nn.Module) -> None:
    """Undo `convert_activation`."""
    if isinstance(module, RecomputedActivationMixin):
        module.__class__ = module.float_class
