"""A ReLU's output handed over to the quantized layer it feeds (docs/method.md §2, "ReLU masks").

A ReLU keeps its float output for its backward, which reads only where that output is positive. A quantized layer
fed that output keeps integer codes of it for its own backward, so once such a layer has read it, no backward needs
the float: the converted ReLU (`hf_cpt.nn.recompute` converts the activation modules) then keeps a mask instead of
the four-byte output, and the layer its codes: a byte and a bit a value where both used to share the float's four.
The mask is ``output <= 0``, one bit a value where the native kernel packs it (a float32 CPU output of at least
`NATIVE_MIN_NUMEL` values), else a bool tensor, and the backward zeroes the error there in one pass
(`hf_cpt.numerics.mask_kernels`), as fast as autograd's kernel (``masked_fill`` took three times as long).
Until a quantized layer takes it over, the ReLU keeps its output as autograd would, so a ReLU that feeds only
full-precision layers keeps what it always kept. The gradient is autograd's, bit for bit (``ReluBackward0`` passes
the error where the output is not ``<= 0``).

What the ReLU keeps is packed into its node's saved tensor by a saved-tensor hook of its own, so autograd frees it
with the node's other saved tensors once the backward has run. Under saved-tensor hooks of others (activation
checkpointing, offloading), where they are disabled, or in a compiled graph the ReLU runs as autograd's: its own
hook would stand in for theirs.

A ReLU the model's code calls as a function (``torch.relu``, ``F.relu``, ``x.relu()``) is no module to convert. The
model's first training forward runs under `FunctionalReLUs`, which sends those calls through the same path
(`FunctionalReLUScope`: hooks on the model `quantize_model` converted); the later ones do too where such a call fed a
quantized layer (`hand_over_input`), and the hooks come off where none did.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode, _pop_mode_temporarily

from ..numerics.mask_kernels import masked, masked_bits, pack_nonpositive
from .saved import same_view, saved_as_is

if TYPE_CHECKING:
    from .precision import PrecisionState


class KeptOutput:
    """What a converted ReLU keeps for its backward: its output (a detached alias: no reference cycle through the
    output's own graph node) until a quantized layer that keeps codes of it calls `hand_over`, then the mask of
    where it is ``<= 0`` (not at NaN, where autograd's kernel passes the error): its bits packed in a uint8 tensor,
    or a bool tensor where the native kernel does not pack them (`gradient` reads either). The node's saved tensor
    holds it (an autograd saved-tensor hook packs it), so autograd frees it with the node's saved tensors once the
    backward has run: a training loop that keeps its loss until the next forward keeps no mask through it. The node
    refers to it weakly (`kept_output_of`)."""

    __slots__ = ("output", "version", "zeroed", "functional", "__weakref__")

    def __init__(self, output: torch.Tensor, functional: bool = False) -> None:
        self.output: torch.Tensor | None = output.detach()  # shares the output's version counter
        self.version = output._version
        self.zeroed: torch.Tensor | None = None
        self.functional = functional  # made by a ReLU called as a function (`FunctionalReLUs`), not a module

    def holds(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is the kept output, unchanged since the ReLU made it."""
        return self.output is not None and x._version == self.version and same_view(self.output, x)

    def hand_over(self) -> None:
        """Keep the mask, drop the output (its reader keeps codes of it)."""
        if self.output is not None:
            packed = pack_nonpositive(self.output)
            self.zeroed = self.output <= 0 if packed is None else packed
            self.output = None

    def for_backward(self) -> torch.Tensor:
        """What the backward reads: the mask once handed over, else the output (checked unchanged)."""
        if self.output is None:
            return self.zeroed
        if self.output._version != self.version:
            raise RuntimeError("one of the variables needed for gradient computation has been modified by an "
                               "inplace operation: the output of a ReLU (hf_cpt.nn.relu_masks).")
        return self.output


def gradient(grad: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The input's gradient from what a `KeptOutput` gives the backward: ``grad`` where the output is not ``<= 0``,
    else ``+0.0`` (autograd's ReLU kernel on the output, `masked` on a bool mask, `masked_bits` on a packed one: the
    same bits, one pass each)."""
    if kept.dtype == torch.bool:
        return masked(grad, kept)
    if kept.dtype == torch.uint8:  # one bit per element (`pack_nonpositive`)
        return masked_bits(grad, kept)
    return torch.ops.aten.threshold_backward(grad, kept, 0)


def kept_output_of(node) -> KeptOutput | None:
    """The `KeptOutput` of a converted ReLU's autograd node, while its backward may still read it; None for any
    other node."""
    ref = getattr(node, "cpt_kept_output", None)
    return None if ref is None else ref()


class _ReLUHandingOver(torch.autograd.Function):
    """``relu(x)`` (in place where ``inplace``) saving its output, which `relu_handing_over` packs as a `KeptOutput`."""

    @staticmethod
    def forward(ctx, x, inplace):
        if inplace:
            ctx.mark_dirty(x)
            output = x.relu_()
        else:
            output = x.relu()
        ctx.save_for_backward(output)
        return output

    @staticmethod
    def backward(ctx, grad):
        (kept,) = ctx.saved_tensors
        return gradient(grad, kept), None


def _saved_tensor_hooks_enabled() -> bool:
    """Whether saved-tensor hooks may be pushed here (a functorch transform disables them)."""
    enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    return enabled is None or enabled()


def relu_handing_over(x: torch.Tensor, inplace: bool, functional: bool = False) -> torch.Tensor:
    """``relu(x)`` whose kept output a quantized layer reading it may exchange for a mask (`hand_over_input`); an
    in-place ReLU of a view runs as autograd's (autograd puts such an edit on the view's base, not on this node).
    ``functional``: called as a function (`FunctionalReLUs`)."""
    if not _saved_tensor_hooks_enabled():  # disabled by a transform: keep as autograd does
        return x.relu_() if inplace else x.relu()
    if inplace and x._is_view():
        return x.relu_()
    packed: list[KeptOutput] = []

    def pack(output: torch.Tensor) -> KeptOutput:
        packed.append(KeptOutput(output, functional))
        return packed[-1]

    with torch.autograd.graph.saved_tensors_hooks(pack, KeptOutput.for_backward):
        output = _ReLUHandingOver.apply(x, inplace)
    (kept,) = packed
    kept.version = output._version  # after apply: an in-place call bumps the version on return
    output.grad_fn.cpt_kept_output = weakref.ref(kept)
    return output


def runs_here(x: torch.Tensor) -> bool:
    """Whether a ReLU of ``x`` may keep its output this way: training (grad enabled, ``x`` needs one), no
    saved-tensor hooks, not traced."""
    return x.requires_grad and torch.is_grad_enabled() and saved_as_is()


def hand_over_input(x: torch.Tensor, saved: torch.Tensor | None, state: PrecisionState) -> None:
    """Called by a quantized layer fed ``x`` with what its backward keeps in place of ``x`` (``saved``: codes, a
    quantized copy, ``x`` itself, or None): unless that is ``x``, and ``x`` is a converted ReLU's unchanged output,
    that ReLU keeps its mask from now on instead of ``x``. When autograd's own ReLU made ``x`` (a ReLU called as a
    function: autograd's own, or the first training forward's, `FunctionalReLUScope.probe`), the model's next training
    forwards send such calls here too (``state.functional_relus``, `FunctionalReLUScope.activate`)."""
    if torch.compiler.is_dynamo_compiling():  # a traced graph holds no converted ReLU's node
        return
    kept = kept_output_of(x.grad_fn)
    called_as_function = (kept.functional if kept is not None
                          else x.grad_fn is not None and x.grad_fn.name() == "ReluBackward0")
    if called_as_function and not state.functional_relus:
        state.functional_relus = True
        if state.functional_relu_scope is not None:
            state.functional_relu_scope.activate()
    if kept is None or not kept.holds(x):
        return
    if saved is None or saved.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():  # not x, nor a view of it
        kept.hand_over()


# The functions model code calls for a ReLU -> whether the call edits its input in place (None: F.relu's own
# ``inplace`` argument says).
RELU_FUNCTIONS = {torch.relu: False, torch.relu_: True, torch.Tensor.relu: False, torch.Tensor.relu_: True,
                  F.relu: None, F.relu_: True}


class FunctionalReLUs(TorchFunctionMode):
    """While active, a ReLU called as a function runs as `relu_handing_over` where it `runs_here`; every other call
    runs as it was."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in RELU_FUNCTIONS:
            x = args[0] if args else kwargs.get("input")
            if type(x) is torch.Tensor and runs_here(x):
                inplace = RELU_FUNCTIONS[func]
                if inplace is None:  # F.relu(input, inplace=False)
                    inplace = bool(args[1] if len(args) > 1 else kwargs.get("inplace", False))
                return relu_handing_over(x, inplace, functional=True)
        return func(*args, **kwargs)


def outside_functional_relus() -> contextlib.AbstractContextManager:
    """A context with `FunctionalReLUs` off where it is the innermost torch-function mode: for a quantized layer's
    forward, which calls no ReLU and whose own tensor calls would each pass through the mode's Python handler
    (about three thousand in a CIFAR ResNet-20 training forward)."""
    if torch.compiler.is_compiling() or not isinstance(_get_current_function_mode(), FunctionalReLUs):
        return contextlib.nullcontext()
    return _pop_mode_temporarily()


class FunctionalReLUScope:
    """A forward pre-hook and an always-called forward hook on the model `quantize_model` converted, which run its
    training forwards (gradients on, not traced) under `FunctionalReLUs`. Put on by `probe` for the model's first
    training forward, so that its ReLU functions keep masks from the first step on; kept by `activate` once such a
    ReLU fed a quantized layer (`hand_over_input`), else taken off at the next call: a model whose ReLUs are
    modules, or that has none, then runs without them. A model compiled from its first forward keeps them, doing
    nothing in traced code (taken off between two compiled calls, they would fail a guard and recompile)."""

    def __init__(self, model: torch.nn.Module | None) -> None:
        self._model = None if model is None else weakref.ref(model)
        self._local = threading.local()
        self.handles: tuple = ()
        self.probing = False  # the hooks are on for the first training forward only, so far
        self.active = False  # a ReLU function fed a quantized layer: the hooks stay

    def probe(self) -> None:
        """Put the hooks on for the model's next training forward (`quantize_model` calls it)."""
        if not self.handles:
            self._put_on()
            self.probing = True

    def activate(self) -> None:
        """Keep the hooks on, putting them on again where they came off (an unpickled scope, which holds no reference
        to its model, puts none on: that model's ReLU functions then keep their outputs, as without masks; a deep
        copy of the whole model puts them on itself)."""
        self.active, self.probing = True, False
        if not self.handles:
            self._put_on()

    def _put_on(self) -> None:
        model = None if self._model is None else self._model()
        if model is not None:
            self.handles = (model.register_forward_pre_hook(self.enter),
                            model.register_forward_hook(self.exit, always_call=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = ()
        self.probing = False

    def enter(self, module, args) -> None:
        if torch.compiler.is_compiling():
            return
        if not (self.probing or self.active):  # the probe found no ReLU function: off (not in `exit`, which the
            self.remove()  # forward's exception path calls while iterating over the hooks)
            return
        mode = FunctionalReLUs() if module.training and torch.is_grad_enabled() else None
        if mode is not None:
            mode.__enter__()
        self._local.__dict__.setdefault("modes", []).append(mode)

    def exit(self, module, args, output) -> None:
        if torch.compiler.is_compiling():
            return
        modes = self._local.__dict__.get("modes")
        mode = modes.pop() if modes else None  # none: the forward that put the hooks on ends
        if mode is not None:
            mode.__exit__(None, None, None)
            if not modes:  # the first training forward ended: `activate` has kept the hooks, or the next call
                self.probing = False  # takes them off

    def __getstate__(self) -> dict:  # pickled: the hooks, not the model (a weak reference)
        return {"handles": self.handles, "probing": self.probing, "active": self.active}

    def __setstate__(self, saved: dict) -> None:
        self.__init__(None)
        self.handles, self.probing, self.active = saved["handles"], saved["probing"], saved["active"]

    def __deepcopy__(self, memo: dict) -> FunctionalReLUScope:
        """A copy bound to the model's copy when the whole model is being copied (it is in ``memo`` by then)."""
        model = None if self._model is None else memo.get(id(self._model()))
        copied = type(self)(model)
        memo[id(self)] = copied
        copied.handles = copy.deepcopy(self.handles, memo)
        copied.probing, copied.active = self.probing, self.active
        return copied
