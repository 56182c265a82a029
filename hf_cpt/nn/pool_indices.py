"""Max pooling that keeps only its indices for its backward (docs/method.md §2, "ReLU masks").

``F.max_pool2d`` keeps its input and the indices of each window's maximum for its backward, which reads only the
indices: the input gives the gradient's shape. In a CNN's stem (conv, norm, ReLU, max-pool: timm's and torchvision's
ResNets) that input is a ReLU's output, which the ReLU keeps for itself as well, so no quantized layer ever reads it
and it stays a four-byte float (as large as any activation of a ResNet). `MaxPool2dKeepingIndices` keeps the
indices alone and hands the ReLU's output over (`hand_over_input`), as a quantized layer does: the ReLU then keeps a
one-bit mask. The gradient is ``max_pool2d_with_indices_backward``'s bit for bit, given a zero-stride stand-in of the
input's shape (tested). Where: CPU training with gradients on, a contiguous 4-D input, not traced, no saved-tensor
hooks of others; elsewhere the pooling runs as it was.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.utils import _pair

from .relu_masks import hand_over_input, runs_here


class _MaxPool2dKeepingIndices(torch.autograd.Function):
    """``max_pool2d(x, ...)`` keeping the indices, not ``x``, for its backward."""

    @staticmethod
    def forward(ctx, x, kernel, stride, padding, dilation, ceil_mode):
        output, indices = torch.ops.aten.max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil_mode)
        ctx.save_for_backward(indices)
        ctx.input = (x.shape, x.dtype)
        ctx.window = (kernel, stride, padding, dilation, ceil_mode)
        return output

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        shape, dtype = ctx.input
        stand_in = torch.empty((), dtype=dtype, device=grad.device).expand(shape)  # read for its shape only
        grad_input = torch.ops.aten.max_pool2d_with_indices_backward(grad, stand_in, *ctx.window, indices)
        return grad_input, None, None, None, None, None


class MaxPool2dKeepingIndices(nn.MaxPool2d):
    """``nn.MaxPool2d`` whose CPU training forward keeps only its indices for backward and hands its input over to
    the ReLU that made it (the model's `PrecisionState` in ``cpt_precision``, set by `convert_max_pool`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (x.device.type == "cpu" and x.dim() == 4 and x.is_contiguous() and runs_here(x)
                and not torch.compiler.is_compiling()):
            return super().forward(x)
        kernel = _pair(self.kernel_size)
        stride = _pair(self.stride) if self.stride else kernel  # nn.MaxPool2d's default stride: the kernel
        output = _MaxPool2dKeepingIndices.apply(x, kernel, stride, _pair(self.padding), _pair(self.dilation),
                                                self.ceil_mode)
        hand_over_input(x, None, self.__dict__["cpt_precision"])
        return output


def convert_max_pool(module: nn.Module, precision) -> bool:
    """Make an ``nn.MaxPool2d`` (the class itself, not returning indices) a `MaxPool2dKeepingIndices` of the model
    whose state is ``precision``, in place; False for any other module."""
    if type(module) is not nn.MaxPool2d or module.return_indices:
        return False
    module.__class__ = MaxPool2dKeepingIndices
    module.__dict__["cpt_precision"] = precision
    return True


def restore_max_pool(module: nn.Module) -> None:
    """Undo `convert_max_pool`."""
    if type(module) is MaxPool2dKeepingIndices:
        module.__class__ = nn.MaxPool2d
        module.__dict__.pop("cpt_precision", None)
