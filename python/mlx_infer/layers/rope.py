"""Rotary position embeddings built from a checkpoint's rope settings.

``initialize_rope`` reads the ``rope_scaling`` / ``rope_parameters`` dict of an
HF config and returns a module ``rope(x, offset=0)`` over ``(B, H, L, D)``.
The frequency tables are computed with the same MLX ops, in the same order, as
mlx-lm's ``rope_utils`` so that logits stay bit-identical with it.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError

#: rope types handled here (``type`` or ``rope_type`` in the scaling dict).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type_of(scaling_config: dict[str, Any] | None) -> str:
    """The rope type named by a scaling dict (``"default"`` when there is none)."""
    if not scaling_config:
        return "default"
    return scaling_config.get("type") or scaling_config.get("rope_type") or "default"


class Llama3RoPE(nn.Module):
    """RoPE with Llama 3.1's frequency-dependent scaling.

    Low frequencies (wavelength above ``original / low_freq_factor``) are
    divided by ``factor``, high frequencies kept, and the band between is
    interpolated smoothly.
    """

    def __init__(self, dims: int, *, base: float, traditional: bool, scaling_config: dict[str, Any],
                 max_position_embeddings: int | None = None):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self.max_position_embeddings = max_position_embeddings

        factor = scaling_config["factor"]
        low_freq_factor = scaling_config.get("low_freq_factor", 1.0)
        high_freq_factor = scaling_config.get("high_freq_factor", 4.0)
        old_context = scaling_config.get("original_max_position_embeddings", 8192)
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor

        # These are inverse frequencies' reciprocals (periods / 2pi), as fast.rope expects.
        freqs = base ** (mx.arange(0, dims, 2) / dims)  # (D/2,)
        wavelens = 2 * mx.pi * freqs
        freqs = mx.where(wavelens > low_freq_wavelen, freqs * factor, freqs)
        medium = (wavelens > high_freq_wavelen) & (wavelens < low_freq_wavelen)
        smooth = (old_context / wavelens - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smooth_freqs = freqs / ((1 - smooth) / factor + smooth)
        self._freqs = mx.where(medium, smooth_freqs, freqs)

    def extra_repr(self) -> str:
        return (f"{self.dims}, traditional={self.traditional}, "
                f"max_position_embeddings={self.max_position_embeddings}")

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=None, scale=1.0,
                            offset=offset, freqs=self._freqs)


class YarnRoPE(nn.Module):
    """YaRN: NTK-by-parts interpolation plus an input magnitude correction (``mscale``)."""

    def __init__(self, dims: int, *, base: float, traditional: bool, scaling_config: dict[str, Any]):
        super().__init__()
        factor = scaling_config["factor"]
        original = scaling_config.get("original_max_position_embeddings", 4096)
        beta_fast = scaling_config.get("beta_fast", 32)
        beta_slow = scaling_config.get("beta_slow", 1)
        mscale = scaling_config.get("mscale", 1)
        mscale_all_dim = scaling_config.get("mscale_all_dim", 0)

        def correction_dim(rotations: float) -> float:
            return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        # transformers' ``truncate`` (default true) rounds the ramp's ends to whole dimensions; gpt-oss sets it false.
        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling_config.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dims - 1)

        def get_mscale(m: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

        self.mscale = get_mscale(mscale) / get_mscale(mscale_all_dim)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
        keep_mask = 1.0 - ramp  # 1 where the dimension keeps its original frequency
        freq_extra = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        freq_inter = factor * freq_extra
        self._freqs = (freq_inter * freq_extra) / (freq_inter * keep_mask + freq_extra * (1 - keep_mask))
        self.dims = dims
        self.traditional = traditional

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if self.mscale != 1.0:
            x = x.at[..., : self.dims].multiply(self.mscale)
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=None, scale=1.0,
                            offset=offset, freqs=self._freqs)


def initialize_rope(
    dims: int,
    base: float,
    traditional: bool = False,
    scaling_config: dict[str, Any] | None = None,
    max_position_embeddings: int | None = None,
) -> nn.Module:
    """Build the rope module a config asks for.

    Args:
        dims: rotated feature dimensions (the head dimension).
        base: ``rope_theta``.
        traditional: rotate interleaved pairs instead of the two halves.
        scaling_config: the config's ``rope_scaling`` (or ``rope_parameters``)
            dict, or ``None``. Its ``type``/``rope_type`` selects the scheme.
        max_position_embeddings: the config's context length (informational
            for llama3).

    Returns:
        A module called as ``rope(x, offset=0)`` on ``(B, H, L, D)`` arrays.

    Raises:
        UnsupportedModelError: the rope type is not one of
            :data:`SUPPORTED_ROPE_TYPES`.
    """
    rope_type = rope_type_of(scaling_config)
    if rope_type in ("default", "linear"):
        scale = 1 / scaling_config["factor"] if rope_type == "linear" else 1.0
        return nn.RoPE(dims, traditional=traditional, base=base, scale=scale)
    if rope_type == "llama3":
        return Llama3RoPE(dims, base=base, traditional=traditional, scaling_config=scaling_config,
                          max_position_embeddings=max_position_embeddings)
    if rope_type == "yarn":
        return YarnRoPE(dims, base=base, traditional=traditional, scaling_config=scaling_config)
    raise UnsupportedModelError(
        f"RoPE type {rope_type!r} is not supported; supported types: {', '.join(SUPPORTED_ROPE_TYPES)}."
    )


class LongRoPE(nn.Module):
    """Phi-3's LongRoPE (``rope_type`` ``longrope``, formerly ``su``): per-frequency rescaling.

    Two tables, ``short_factor`` and ``long_factor`` times the default periods, and one
    input scale (``attention_factor``, default ``sqrt(1 + log(factor) / log(original))``
    with ``factor = max_position_embeddings / original``). As transformers does, a call whose
    last position is past ``original`` rotates every position with the long table, otherwise
    with the short one (decided per row when ``offset`` is a per-row array). mlx-lm's
    ``SuScaledRoPE`` always uses the long table: the two agree once a sequence is longer
    than ``original``. The ops are mlx-lm's, in its order.
    """

    def __init__(self, dims: int, *, base: float, short_factor: list[float], long_factor: list[float],
                 original_max_position_embeddings: int, max_position_embeddings: int,
                 factor: float | None = None, attention_factor: float | None = None):
        super().__init__()
        for name, f in (("short_factor", short_factor), ("long_factor", long_factor)):
            if not isinstance(f, list) or len(f) != dims // 2:
                raise UnsupportedModelError(
                    f"longrope {name} must list {dims // 2} numbers (rotary dims / 2), got {f!r:.80}; "
                    "fix rope_scaling in config.json.")
        self.dims = dims
        self.original = original_max_position_embeddings
        freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)  # (D/2,)
        self._short_freqs = mx.array(short_factor, dtype=mx.float32) * freqs
        self._long_freqs = mx.array(long_factor, dtype=mx.float32) * freqs
        if factor is None:
            factor = max_position_embeddings / original_max_position_embeddings
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(self.original))
        self.scale = attention_factor

    def _rope(self, x: mx.array, offset: int | mx.array, freqs: mx.array) -> mx.array:
        return mx.fast.rope(x.at[..., : self.dims].multiply(self.scale), self.dims, traditional=False, base=None,
                            scale=1.0, offset=offset, freqs=freqs)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        """``x (B, H, L, D)`` rotated from position ``offset`` (an int or a ``(B,)`` array)."""
        end = offset + x.shape[-2]  # one past the last position of the call
        if isinstance(end, int):
            return self._rope(x, offset, self._long_freqs if end > self.original else self._short_freqs)
        long = (end > self.original).reshape(-1, 1, 1, 1)  # (B, 1, 1, 1)
        return mx.where(long, self._rope(x, offset, self._long_freqs), self._rope(x, offset, self._short_freqs))


class NoPE(nn.Module):
    """No rotary embedding: the identity, for layers that attend without positions (SmolLM 3)."""

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return x
