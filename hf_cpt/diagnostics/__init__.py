"""Diagnostics that run on any quantized model, without the Trainer: the precision range test, output fidelity."""
