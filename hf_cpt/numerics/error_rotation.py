"""Rotations of an error before it is quantized, and back after (docs/method.md §2, "Rotated errors").

An orthogonal rotation spreads a few large values over many, so that one range fits them better; the
quantization error is spread, not amplified. This module knows nothing about layers, schedules or the Trainer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from .fake_quant import _compute_dtype
from .rotation import Rotation, can_rotate, get_rotation, sylvester_hadamard

# An orthogonal rotation of the error before quantizing (and back after): none, across the output
# features (the layer's own rotation construction), or across tokens in Hadamard blocks (as HALO does).
ERROR_ROTATIONS = ("none", "features", "tokens")
TOKEN_BLOCK = 64  # tokens mixed by one Hadamard block under rotation="tokens"
ERROR_ROTATION_SEED = 1  # a rotation of the error independent of the layers' input rotations (seed 0)


@functools.lru_cache(maxsize=32)
def _feature_rotation(features: int, device: torch.device, dtype: torch.dtype) -> Rotation | None:
    return get_rotation(features, ERROR_ROTATION_SEED, device, dtype) if can_rotate(features) else None


@functools.lru_cache(maxsize=16)
def _token_block(size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # Sylvester's H / sqrt(n) is symmetric and orthogonal: it is its own inverse.
    return (sylvester_hadamard(size) / math.sqrt(size)).to(device=device, dtype=dtype)


def error_rotation_operations(rotation: str, features: int) -> tuple[int, int]:
    """(additions, multiplications) per error value for one direction of ``rotation`` (see `rotate_error`)."""
    if rotation == "features":
        matrix = _feature_rotation(features, torch.device("cpu"), torch.float32)
        return matrix.operations_per_value if matrix is not None else (0, 0)
    if rotation == "tokens":
        return TOKEN_BLOCK.bit_length() - 1, 0  # a fast Walsh-Hadamard transform of each block
    return 0, 0


def rotate_error(
    grad: torch.Tensor, rotation: str, feature_dim: int = -1
) -> tuple[torch.Tensor, int, Callable[[torch.Tensor], torch.Tensor]]:
    """``grad`` rotated for quantization: (rotated tensor, its feature dimension, the map back to ``grad``'s layout).

    ``"features"``: ``e R`` over the feature dimension (sizes the rotation cannot factor stay unrotated).
    ``"tokens"``: rows (tokens) mixed in blocks of `TOKEN_BLOCK` by a normalized Hadamard matrix, the last
    block padded with zero rows that the map back drops. Rotations are orthogonal, so the map back is exact
    up to float rounding and the quantization error is spread, not amplified.
    """
    source = _compute_dtype(grad)
    if rotation == "features":
        matrix = _feature_rotation(source.shape[feature_dim], source.device, source.dtype)
        if matrix is None:
            return grad, feature_dim, lambda q: q
        return (matrix.apply(source, feature_dim), feature_dim,
                lambda q: matrix.apply(q, feature_dim, transpose=True).to(grad.dtype))
    if rotation != "tokens":
        raise ValueError(f"error rotation must be one of {ERROR_ROTATIONS}, got {rotation!r}")
    moved = source.movedim(feature_dim, -1)
    features, rows = moved.shape[-1], moved.numel() // max(1, moved.shape[-1])
    block = min(TOKEN_BLOCK, 1 << max(0, rows - 1).bit_length())
    padded = torch.nn.functional.pad(moved.reshape(rows, features), (0, 0, 0, (-rows) % block))
    hadamard = _token_block(block, source.device, source.dtype)
    mixed = torch.matmul(hadamard, padded.view(-1, block, features)).view(-1, features)

    def back(quantized: torch.Tensor) -> torch.Tensor:
        unmixed = torch.matmul(hadamard, quantized.view(-1, block, features)).view(-1, features)[:rows]
        return unmixed.reshape(moved.shape).movedim(-1, feature_dim).to(grad.dtype)

    return mixed, -1, back
