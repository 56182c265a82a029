"""Numerics: fake quantization of weights and activations, error quantization, rotations, the cost formula.

Pure tensor functions; nothing here knows about layers, models, schedules or the Trainer.
"""
