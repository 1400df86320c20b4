"""The sampler: temperature 0 is argmax, otherwise a categorical draw.

Each request owns a :class:`RequestRNG` whose key sequence depends only on its
seed and its own step count, so a request's tokens do not depend on what else
runs beside it.
"""

from __future__ import annotations

import secrets

import mlx.core as mx

from ..errors import MlxInferError


class RequestRNG:
    """A per-request key sequence: step n draws with the n-th split of ``key(seed)``.

    Args:
        seed: an explicit seed reproduces; ``None`` picks a fresh one (kept in ``seed``).
    """

    def __init__(self, seed: int | None = None):
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise MlxInferError(f"seed must be a non-negative integer, got {seed!r}.")
        self.explicit = seed is not None
        self.seed = seed if seed is not None else secrets.randbits(63)
        self._key = mx.random.key(self.seed)
        self.steps = 0

    def next_key(self) -> mx.array:
        """The key for the next draw; advances the sequence."""
        self._key, sub = mx.random.split(self._key)
        self.steps += 1
        return sub


def sample(logits: mx.array, *, temperature: float, rng: RequestRNG | None = None) -> mx.array:
    """Pick next tokens from ``logits`` ``(B, vocab)``; returns ``(B,)`` uint32.

    Args:
        temperature: 0 means argmax; positive values scale logits before a
            categorical draw.
        rng: the request's key sequence (needed when ``temperature > 0``).
    """
    if temperature < 0:
        raise MlxInferError(f"temperature must be >= 0 (0 = greedy), got {temperature}.")
    if temperature == 0:
        return mx.argmax(logits, axis=-1)
    if rng is None:
        raise MlxInferError("sampling with temperature > 0 needs a RequestRNG.")
    return mx.random.categorical(logits * (1.0 / temperature), key=rng.next_key())
