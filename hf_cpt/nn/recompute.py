"""Activation inputs recomputed from codes in backward (docs/method.md §2, "Recomputed activation inputs").

A product on integer codes is exact, and its layer keeps the codes anyway: so it tags its output with a
`RecomputableOutput` (references to the codes), and an activation converted here (in place, like the layers) keeps
that instead of its float input and recomputes the input in backward: the same gradient bit for bit, for one more
product on codes per layer and step (the cost meter counts it). Any other input runs the activation as before.
"""

from __future__ import annotations

import torch
from torch import nn

# The attribute a layer's output carries when it can be recomputed from codes.
RECOMPUTABLE = "_cpt_recomputable"


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

    def float_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.float_class.forward(self, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_dynamo_compiling():  # traced layers tag nothing
            return self.float_forward(x)
        recipe = getattr(x, RECOMPUTABLE, None) if isinstance(x, torch.Tensor) else None
        # autograd records this call: the activation may keep codes in place of its input
        recorded = isinstance(x, torch.Tensor) and torch.is_grad_enabled() and not getattr(self, "inplace", False)
        if recipe is None or recipe.tensors is None or not recorded or not recipe.matches(x):
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
    float_class: _recomputed_class(float_class) for float_class in dict.fromkeys(_activation_classes())}


def convert_activation(module: nn.Module) -> bool:
    """Make ``module`` recompute its input where it can, in place; False when its class is not converted or it
    holds parameters or buffers."""
    recomputed = RECOMPUTED_ACTIVATION_CLASSES.get(type(module))
    if recomputed is None or any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        return False
    module.__class__ = recomputed
    return True


def restore_activation(module: nn.Module) -> None:
    """Undo `convert_activation`."""
    if isinstance(module, RecomputedActivationMixin):
        module.__class__ = module.float_class
