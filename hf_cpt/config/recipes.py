"""Named `CPTConfig` recipes (`CPTConfig.from_recipe`), each the settings one body of evidence supports.

- ``"paper"``: the CPT paper's exact scheme (Fu et al., ICLR 2021): bits 3-8 forward, 8-bit errors, the cosine
  schedule, ceil rounding (its Eq. 1), per-tensor running activation ranges (`quant_scheme="paper"`, bit-exact to
  the published quantizer), per-tensor min/max errors with stochastic rounding, no fidelity check.
- ``"finetune"``: `CPTConfig()`'s defaults, for pretrained transformers: bits 4-8 (3 fails the fidelity check on
  every model of docs/pretrained.md), rotated per-token activations and per-row errors (the paper's per-tensor
  ranges cannot hold a pretrained transformer's outlier features; docs/pretrained.md, docs/backward.md).
- ``"from-scratch"``: a model trained from random weights (the paper's CIFAR setting): bits 3-8, the paper's
  per-tensor scheme for every layer, no fidelity check (a random model's output has nothing to be faithful to).
"""

from __future__ import annotations

from typing import Any

RECIPES: dict[str, dict[str, Any]] = {
    "paper": {
        "bits_min": 3, "bits_max": 8, "grad_bits": 8, "schedule": "cpt", "rounding": "ceil",
        "quant_scheme": "paper", "error_granularity": "tensor", "error_range": "minmax",
        "error_rounding": "stochastic", "fidelity_threshold": None,
    },
    "finetune": {},
    "from-scratch": {
        "bits_min": 3, "bits_max": 8, "quant_scheme": "paper", "error_granularity": "tensor",
        "fidelity_threshold": None,
    },
}
