"""Apply an allowed-token bitmask to logits on the device (an MLX op; no host round trip of logits).

Bits computed on the host (a numpy array, as llguidance fills them) are unpacked there
(``np.unpackbits``); bits already on the device are unpacked by MLX ops. The masking itself,
``where(allowed, logits, -inf)``, runs on the device either way.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def bitmask_to_allowed(bits: mx.array | np.ndarray, vocab_size: int) -> mx.array:
    """``(B, words)`` int32 bits -> ``(B, vocab_size)`` bool (token ``t`` is bit ``t % 32`` of word ``t // 32``)."""
    if isinstance(bits, np.ndarray):  # host bits (llguidance wrote them): unpacking there is ~0.4 ms at (32, 256k)
        allowed = np.unpackbits(np.ascontiguousarray(bits).view(np.uint8), axis=-1, bitorder="little")
        return mx.array(allowed[:, :vocab_size].view(np.bool_))  # (B, V)
    shifts = mx.arange(32, dtype=mx.int32)  # (32,); built per call: MLX streams are per thread
    unpacked = mx.right_shift(bits[..., None], shifts) & 1  # (B, W, 32)
    return unpacked.reshape(bits.shape[0], -1)[:, :vocab_size].astype(mx.bool_)  # (B, V)


def apply_bitmask(logits: mx.array, bits: mx.array | np.ndarray) -> mx.array:
    """``logits`` ``(B, V)`` (or ``(V,)``) with disallowed tokens set to -inf."""
    squeeze = logits.ndim == 1
    x = logits[None] if squeeze else logits  # (B, V)
    allowed = bitmask_to_allowed(bits, x.shape[-1])  # (B, V)
    out = mx.where(allowed, x, mx.array(-float("inf"), x.dtype))  # (B, V)
    return out[0] if squeeze else out
