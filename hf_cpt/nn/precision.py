"""`PrecisionState`: the bit-widths of one model, shared by all its quantized layers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..backends import backend_for
from ..numerics.derived import derived
from ..numerics.errors import PAPER_ERRORS, ErrorQuantization, quantize_error_on_backward
from ..runtime import RuntimeSettings
from .reused_weights import ReusedWeights
from .shared_input import SharedInputs


class PrecisionState:
    """The bit-widths of one model, read by each of its quantized layers at every forward.

    Bits are held in 0-d tensors updated in place, so a schedule can change them every step without
    making a compiled model re-trace; ``None`` (full precision) is a Python flag.
    """

    def __init__(
        self,
        activation_momentum: float = 0.9,
        activation_ema_init: str = "zeros",
        errors: ErrorQuantization = PAPER_ERRORS,
        runtime: RuntimeSettings | None = None,
        weight_range: str = "minmax",
    ) -> None:
        runtime = runtime or RuntimeSettings()
        self.weight_range = weight_range  # how each weight's channel ranges are chosen (`weight_ranges`)
        self.bits = torch.zeros(())
        self.compact_codes = False
        self.nibble_codes = False
        self.grad_bits = torch.zeros(())
        self.eval_bits = torch.zeros(())
        self.eval_bits_value: int | None = None  # eval_bits as a Python number (None: not enabled)
        self.forward_enabled = False
        self.backward_enabled = False
        self.eval_enabled = False
        self.eval_follows_training = False
        # Eval-mode forwards that quantize per-tensor inputs over the batch's own range (without updating
        # the running range): used to measure fidelity before training, when no running range exists yet.
        self.batch_ranges_in_eval = False
        self.errors = errors
        # The attention products (two activations, no weight) quantize the errors of both their products,
        # unrotated, with the layers' rounding and granularity (range "auto": the zero-centred grid).
        self.attention_errors = errors.for_attention()
        # Training products on integer codes (`hf_cpt.numerics.integer_matmul`): True, False or "auto", resolved per
        # device by its backend (`Backend.products_on_codes`).
        self.runtime = runtime
        self.integer_matmul = runtime.integer_matmul
        # Products on codes tag their outputs so that a converted activation recomputes them in backward instead of
        # keeping them (`hf_cpt.nn.recompute`); the forward MACs those recomputations ran so far.
        self.recompute_activation_inputs = runtime.recompute_activation_inputs
        self.recomputed_macs = 0
        # Large errors quantized by one fused kernel (`hf_cpt.numerics.error_kernels`).
        self.fused_errors = runtime.fused_error_quantizer
        self.activation_momentum = activation_momentum
        self.activation_ema_init = activation_ema_init
        # The last input of the per-token layers, rotated and quantized once for its sibling layers.
        self.shared_inputs = SharedInputs()
        # Each weight's codes, kept for the other forwards of one optimizer step while the Trainer integration
        # sets an epoch (`hf_cpt.nn.reused_weights`).
        self.reused_weights = ReusedWeights()
        # The bit-width tensors on each accelerator the layers run on: (source id, device) -> [source version, copy].
        self._device_bits: dict[tuple[int, torch.device], list] = {}
        self.quantized_with = None  # the CPTConfig `quantize_model` converted the model with (None: a loaded model)

    @classmethod
    def from_settings(cls, settings) -> PrecisionState:
        """A state for the static settings of a `CPTConfig` (or a loaded checkpoint's quantization_config, which
        holds no runtime settings: the loading process's defaults)."""
        return cls(settings.activation_momentum, settings.activation_ema_init, settings.errors,
                   getattr(settings, "runtime", RuntimeSettings()), settings.weight_range)

    def on_device(self, bits: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
        """``bits`` (one of the 0-d bit-width tensors, kept on the CPU) on ``device``, for the layers there.

        On an accelerator a blocking host-to-device copy waits for the device's queue to drain. One such copy per
        quantized product would stall a GPU at every layer, so each device keeps its own copy of each tensor,
        refreshed in place when the source changes (about once per optimizer step). The copy's version counter
        moves with it, so keys built from (id, version) stay valid. The CPU and traced code get ``bits`` itself.
        """
        if bits is None or bits.device == device or torch.compiler.is_dynamo_compiling():
            return bits
        key = (id(bits), device)
        entry = self._device_bits.get(key)
        if entry is None or entry[0] != bits._version:
            # Made and refreshed outside inference mode: a copy first made under it (an evaluation) could not be
            # updated in place by the training that follows.
            with torch.inference_mode(False), torch.no_grad():
                if entry is None:
                    entry = self._device_bits[key] = [None, torch.empty((), dtype=bits.dtype, device=device)]
                entry[1].copy_(bits)
                entry[0] = bits._version
        return entry[1]

    def error_bits(self, device: torch.device) -> torch.Tensor:
        """The error bits on ``device`` as they are now, in a tensor that is never modified: the same tensor until
        ``grad_bits`` changes. A layer's backward reads the bits its forward ran with from it without a copy per
        product, and what is derived from it (the top code) is computed once per value (`hf_cpt.numerics.derived`).
        """
        grad_bits = self.grad_bits
        return derived(grad_bits, ("error_bits", device), lambda: grad_bits.to(device, copy=True))

    def integer_products(self, device: torch.device) -> bool:
        """Whether the layers' training products on ``device`` run on integer codes (its backend resolves the
        setting)."""
        return backend_for(device).products_on_codes(self.integer_matmul)

    def quantize_error_on_backward(
        self, output: torch.Tensor, feature_dim: int = -1, attention: bool = False, granularity: str = "tensor"
    ) -> torch.Tensor:
        """Mark ``output`` so that the error arriving at it is quantized at the error bits, with these settings
        (``attention=True``: the attention products' settings) for activations quantized with ``granularity``."""
        scheme = self.attention_errors if attention else self.errors
        return quantize_error_on_backward(output, self.on_device(self.grad_bits, output.device),
                                          scheme.for_activations(granularity), feature_dim, self.fused_errors)

    def set(self, bits: int | None, grad_bits: int | None) -> None:
        """Training precision: forward bits for weights and activations, backward bits for errors."""
        self.forward_enabled = bits is not None
        self.backward_enabled = grad_bits is not None
        # Whether training codes fit in uint8: a flag, so that a compiled model does not re-trace per bit-width.
        self.compact_codes = bits is not None and bits <= 8
        # Whether saved codes fit two a byte (read by eager forwards only: no guard of a compiled graph).
        self.nibble_codes = bits is not None and bits <= 4
        if bits is not None:
            self.bits.fill_(float(bits))
        if grad_bits is not None:
            self.grad_bits.fill_(float(grad_bits))

    def set_eval(self, bits: int | None, follow_training: bool = False) -> None:
        """Precision in eval mode: fixed ``bits`` (None: full precision) or the training bits."""
        self.eval_follows_training = follow_training
        self.eval_enabled = bits is not None
        self.eval_bits_value = int(bits) if bits is not None else None
        if bits is not None:
            self.eval_bits.fill_(float(bits))

    @property
    def fixed_eval_bits(self) -> int | None:
        """The eval bit-width when it is a fixed number (not following training), else None."""
        return None if self.eval_follows_training else self.eval_bits_value

    def forward_bits(self, training: bool) -> torch.Tensor | None:
        """The forward bit-width in force for a module in training (or eval) mode; None: full precision."""
        if training or self.eval_follows_training:
            return self.bits if self.forward_enabled else None
        return self.eval_bits if self.eval_enabled else None

    @contextlib.contextmanager
    def evaluating_at(self, bits: int | None, batch_ranges: bool = False) -> Iterator[None]:
        """Temporarily evaluate at ``bits`` (None: full precision), optionally with per-tensor inputs
        quantized over each batch's own range; the eval settings are restored afterwards."""
        saved = (self.eval_bits_value, self.eval_follows_training, self.batch_ranges_in_eval)
        self.set_eval(bits)
        self.batch_ranges_in_eval = batch_ranges
        try:
            yield
        finally:
            self.set_eval(saved[0], follow_training=saved[1])
            self.batch_ranges_in_eval = saved[2]

    @property
    def current(self) -> tuple[int | None, int | None]:
        """(forward bits, grad bits) in training, as Python numbers."""
        bits = int(self.bits.item()) if self.forward_enabled else None
        grad_bits = int(self.grad_bits.item()) if self.backward_enabled else None
        return bits, grad_bits

    def __repr__(self) -> str:
        bits, grad_bits = self.current
        return f"PrecisionState(bits={bits}, grad_bits={grad_bits})"
