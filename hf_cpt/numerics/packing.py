"""Nibble packing of integer codes: two codes a byte at 4 bits or fewer, one above.

A packed checkpoint's per-channel weight codes (``weight = codes * scale + zero_point`` per output channel, with the
arithmetic of `hf_cpt.numerics.fake_quant.fake_quantize`; layout: ``docs/checkpoints.md``), and the codes a training
forward saves for its backward where a backend packs them (`hf_cpt.backends.base.Backend.packs_saved_codes`).
Knows nothing about models, layers or transformers.
"""

from __future__ import annotations

import torch


def packed_row_bytes(values_per_row: int, bits: int) -> int:
    """Bytes per output channel: one value per byte above 4 bits, two per byte at 4 bits or fewer."""
    return (values_per_row + 1) // 2 if bits <= 4 else values_per_row


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``[C, K]`` uint8 codes: unchanged above 4 bits, else value ``2j`` in the low nibble of byte ``j``."""
    if bits > 4:
        return codes.contiguous()
    if codes.shape[1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_codes(packed: torch.Tensor, bits: int, values_per_row: int) -> torch.Tensor:
    """Inverse of `pack_codes`: ``[C, K]`` uint8 codes."""
    if bits > 4:
        return packed
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)[:, :values_per_row]
