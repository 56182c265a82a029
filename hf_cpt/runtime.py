"""`RuntimeSettings`: how a machine runs CPT's numerics, never what they are.

These switches choose among engine paths that compute the same method (a product on integer codes equals the float
product up to float rounding). A `CPTConfig` carries them in its ``runtime`` part; they are not written into
checkpoints or model cards. ``HF_CPT_INT8_DOT`` (``1`` / ``0``) forces the int8 dot-product path on or off whatever
the CPU reports, so that both paths are tested on any machine (`hf_cpt.backends.cpu.int8_dot_products`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .utils import ConfigError, check_choice, setting

INTEGER_MATMUL = (True, False, "auto")  # where training products run on codes


@dataclass(frozen=True)
class RuntimeSettings:
    """Engine switches of one model's training (docs/method.md §2); none changes what the method computes."""

    integer_matmul: bool | str = setting(
        "auto",
        "CPU training products of Linear / GPT-2 Conv1D layers at 8 bits or fewer on the operands' integer codes "
        "(exact int32 sums, scaled): True, False or 'auto' (True where the CPU has int8 dot products, else False: "
        "there a product on codes is slower than the float one, for a lower peak)."
    )
    recompute_activation_inputs: bool = setting(
        True,
        "Activations fed by a product on integer codes recompute their input from the codes that layer keeps: the "
        "same gradients bit for bit, a float tensor less per layer."
    )
    fused_error_quantizer: bool = setting(
        True,
        "Quantize large error tensors in one fused kernel with counter-based noise (native C on CPU, torch.compile "
        "elsewhere); eager torch ops otherwise."
    )

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if self.integer_matmul == "activations":
            raise ConfigError(owner, "integer_matmul", "'activations' was removed: use True (codes in every layer, the "
                                                       "lowest peak) or 'auto' (the fastest step on this CPU).")
        check_choice(owner, "integer_matmul", self.integer_matmul, INTEGER_MATMUL)
        for name in ("recompute_activation_inputs", "fused_error_quantizer"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(owner, name, f"must be True or False, got {getattr(self, name)!r}.")
