"""Plain per-layer KV caches: a growing one and a rotating one for sliding windows.

Both satisfy :class:`mlx_infer.contracts.Cache`. Keys and values are
``(B, kv_heads, S, head_dim)``. The buffer layouts (256-token growth steps, the
ring buffer of the rotating cache) follow mlx-lm's ``models/cache.py``, so a
model driven by these caches computes attention over the same arrays, in the
same order, as mlx-lm does, and its logits are bit-identical.

Persistence: ``state`` is a tuple of arrays and ``meta_state`` a tuple of
strings; ``Cls.from_state(state, meta_state)`` rebuilds the cache.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..layers.attention import Mask, create_causal_mask


def _mask_for(N: int, offset: int, window_size: int | None, return_array: bool) -> Mask:
    """Mask for ``N`` new queries after ``offset`` cached tokens, all kept."""
    if window_size is not None:
        return create_causal_mask(N, offset, window_size=window_size)
    if N == 1:
        return None
    if return_array:
        return create_causal_mask(N, offset)
    return "causal"


class KVCache:
    """A growing KV cache, preallocated in steps of :attr:`step` tokens.

    Growth concatenates a zero block of whole steps; writes are slice
    assignments, and reads are views of the first ``offset`` tokens.

    Attributes:
        keys: ``(B, kv_heads, capacity, head_dim)`` buffer, or ``None`` before
            the first update.
        values: ``(B, kv_heads, capacity, v_head_dim)`` buffer, or ``None``.
        offset: number of tokens written.
    """

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def _grow(self, L: int, B: int, kv_heads: int, k_dim: int, v_dim: int, dtype: mx.Dtype) -> None:
        """Room for ``L`` more tokens: whole steps of zeros appended (a first buffer when empty)."""
        prev = self.offset
        capacity = ((self.step + L - 1) // self.step) * self.step
        new_k = mx.zeros((B, kv_heads, capacity, k_dim), dtype)  # (B, KVH, C, D)
        new_v = mx.zeros((B, kv_heads, capacity, v_dim), dtype)  # (B, KVH, C, Dv)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            if prev % self.step != 0:  # drop the unused tail (left after a trim) before growing
                self.keys = self.keys[..., :prev, :]
                self.values = self.values[..., :prev, :]
            self.keys = mx.concatenate([self.keys, new_k], axis=2)
            self.values = mx.concatenate([self.values, new_v], axis=2)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``(B, KVH, L, D)`` keys/values; return all cached ones ``(B, KVH, offset, D)``."""
        prev = self.offset
        L = keys.shape[2]
        if self.keys is None or prev + L > self.keys.shape[2]:
            B, kv_heads, _, k_dim = keys.shape
            self._grow(L, B, kv_heads, k_dim, values.shape[3], keys.dtype)
        self.offset += L
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self._fetch()

    def reserve_one(self, B: int, kv_heads: int, k_dim: int, v_dim: int, dtype: mx.Dtype) -> tuple[int, int]:
        """Prepare the buffers for one more token as :meth:`update_and_fetch` would (growth included).

        For a step that writes the buffers itself (the compiled decode step): it
        writes the token at the returned slot, attention reads the returned number
        of leading slots, and :meth:`commit_one` then takes the written buffers.
        Calling it again before the commit changes nothing. ``B``, ``kv_heads``,
        ``k_dim``, ``v_dim`` and ``dtype`` shape the first buffer of an empty
        cache; an existing buffer keeps its own.

        Returns:
            ``(slot, read)``: the new token's slot and the slots attention reads.
        """
        if self.keys is None or self.offset + 1 > self.keys.shape[2]:
            if self.keys is not None:
                B, kv_heads, _, k_dim = self.keys.shape
                v_dim, dtype = self.values.shape[3], self.keys.dtype
            self._grow(1, B, kv_heads, k_dim, v_dim, dtype)
        return self.offset, self.offset + 1

    def commit_one(self, keys: mx.array, values: mx.array) -> None:
        """Hold ``keys``/``values`` (the buffers of :meth:`reserve_one` with the new token written) and count it."""
        self.keys, self.values = keys, values
        self.offset += 1

    def _fetch(self) -> tuple[mx.array, mx.array]:
        if self.offset < self.keys.shape[2]:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return self.keys, self.values

    def make_mask(self, N: int, *, window_size: int | None = None, return_array: bool = False) -> Mask:
        """Mask for the next ``N`` queries (see :mod:`mlx_infer.layers.attention`)."""
        return _mask_for(N, self.offset, window_size, return_array)

    def size(self) -> int:
        """Tokens attention reads (all of them)."""
        return self.offset

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self) -> tuple[mx.array, ...]:
        """``(keys, values)`` of the written tokens; ``()`` when empty."""
        if self.keys is None:
            return ()
        return self._fetch()

    @state.setter
    def state(self, v: tuple[mx.array, ...]) -> None:
        if not v:
            self.keys = self.values = None
            self.offset = 0
            return
        self.keys, self.values = v
        self.offset = self.keys.shape[2]

    @property
    def meta_state(self) -> tuple[str, ...]:
        return ()

    @meta_state.setter
    def meta_state(self, v: tuple[str, ...]) -> None:
        if v:
            raise ValueError(f"KVCache has no meta state, got {v!r}.")

    @classmethod
    def from_state(cls, state: tuple[mx.array, ...], meta_state: tuple[str, ...] = ()) -> "KVCache":
        cache = cls()
        cache.state = state
        cache.meta_state = meta_state
        return cache

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens (at most ``offset``); return how many were dropped."""
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and value buffers (capacity, not just ``offset``)."""
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes


class RotatingKVCache:
    """A KV cache for a sliding-window layer: at most ``max_size`` tokens kept.

    Two write paths, picked by the chunk length ``S``::

        decode (S == 1): ring buffer of max_size slots, written at _idx
            slot:   0    1    2    3    4    5
                  [t12][t13][ t8][ t9][t10][t11]    _idx = 2 -> t14 overwrites t8
        chunk (S > 1):  restore temporal order, keep the newest max_size - 1,
                        append the chunk (max_size - 1 + S tokens), so every
                        query of the chunk still sees a full window
            [t9 .. t14][c0 c1 ... c(S-1)]

    The next write after a chunk drops back to ``max_size`` tokens. Masks
    come from :meth:`make_mask`, which knows the layout.

    Attributes:
        max_size: the window (tokens kept between writes).
        offset: tokens written in total (the next token's position).
    """

    step = 256

    def __init__(self, max_size: int) -> None:
        if max_size < 1:
            raise ValueError(f"RotatingKVCache max_size must be >= 1, got {max_size}.")
        self.max_size = max_size
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self._idx = 0  # next slot to write; == keys.shape[2] when the buffer is in temporal order

    # -- layout helpers -------------------------------------------------

    def _temporal_order(self, v: mx.array) -> mx.array:
        """The buffer's written tokens, oldest first."""
        if self._idx == v.shape[2]:
            return v
        if self._idx < self.offset:  # wrapped: oldest token sits at _idx
            return mx.concatenate([v[..., self._idx :, :], v[..., : self._idx, :]], axis=2)
        return v[..., : self._idx, :]

    @staticmethod
    def _drop_oldest(n: int, v: mx.array, append: mx.array | None = None) -> mx.array:
        parts = [v[..., n:, :]] if n > 0 else [v]
        if append is not None:
            parts.append(append)
        return mx.concatenate(parts, axis=2)

    # -- writes ---------------------------------------------------------

    def _update_chunk(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            k = self._temporal_order(self.keys)
            v = self._temporal_order(self.values)
            drop = k.shape[2] - self.max_size + 1
            self.keys = self._drop_oldest(drop, k, keys)  # (B, KVH, <= max_size - 1 + S, D)
            self.values = self._drop_oldest(drop, v, values)
        self.offset += keys.shape[2]
        self._idx = self.keys.shape[2]
        return self.keys, self.values

    def _prepare_one(self, B: int, kv_heads: int, k_dim: int, v_dim: int, dtype: mx.Dtype) -> None:
        """The layout for one more token: grow below max_size, drop a chunk's excess, wrap _idx."""
        prev = self.offset
        if self.keys is None or (prev >= self.keys.shape[2] and self.keys.shape[2] < self.max_size):
            grow = min(self.step, self.max_size - prev)
            new_k = mx.zeros((B, kv_heads, grow, k_dim), dtype)
            new_v = mx.zeros((B, kv_heads, grow, v_dim), dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([self.keys, new_k], axis=2)
                self.values = mx.concatenate([self.values, new_v], axis=2)
            self._idx = prev

        excess = self.keys.shape[2] - self.max_size
        if excess > 0:  # a chunk left max_size - 1 + S tokens: keep the newest max_size
            self.keys = self._drop_oldest(excess, self.keys)
            self.values = self._drop_oldest(excess, self.values)
            self._idx = self.max_size
        if self._idx == self.max_size:
            self._idx = 0

    def _update_one(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        B, kv_heads, _, k_dim = keys.shape
        self._prepare_one(B, kv_heads, k_dim, values.shape[3], keys.dtype)
        self.keys[..., self._idx : self._idx + 1, :] = keys
        self.values[..., self._idx : self._idx + 1, :] = values
        self.offset += 1
        self._idx += 1
        return self._fetch()

    def reserve_one(self, B: int, kv_heads: int, k_dim: int, v_dim: int, dtype: mx.Dtype) -> tuple[int, int]:
        """Prepare the ring for one more token as a one-token :meth:`update_and_fetch` would.

        As :meth:`KVCache.reserve_one`: the caller writes the token at the returned
        slot, attention reads the returned number of leading slots (the whole ring
        once it is full), then :meth:`commit_one`. Idempotent until the commit.

        Returns:
            ``(slot, read)``.
        """
        if self.keys is not None:
            B, kv_heads, _, k_dim = self.keys.shape
            v_dim, dtype = self.values.shape[3], self.keys.dtype
        self._prepare_one(B, kv_heads, k_dim, v_dim, dtype)
        return self._idx, min(self.offset + 1, self.keys.shape[2])

    def commit_one(self, keys: mx.array, values: mx.array) -> None:
        """Hold the written buffers of :meth:`reserve_one` and count the token."""
        self.keys, self.values = keys, values
        self.offset += 1
        self._idx += 1

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``(B, KVH, S, D)`` keys/values; return what attention must read.

        The returned keys are in ring order for ``S == 1`` and in temporal order
        for ``S > 1``; :meth:`make_mask` (called before this) matches that.
        """
        if keys.shape[2] == 1:
            return self._update_one(keys, values)
        return self._update_chunk(keys, values)

    def _fetch(self) -> tuple[mx.array, mx.array]:
        if self.offset < self.keys.shape[2]:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return self.keys, self.values

    # -- masks ----------------------------------------------------------

    def make_mask(self, N: int, *, window_size: int | None = None, return_array: bool = False) -> Mask:
        """Mask for the next ``N`` queries, given the layout the write will produce.

        Args:
            N: queries in the next chunk.
            window_size: the layer's window; ``None`` means ``max_size``.
            return_array: never return ``"causal"``.
        """
        if N > 1:
            window = window_size or self.max_size
            kept = min(self.max_size - 1, self.offset)  # tokens the chunk write keeps
            if kept + N > window or return_array:
                return create_causal_mask(N, kept, window_size=window)
            return "causal"
        if window_size is None or window_size >= self.max_size or self.offset < window_size:
            return None  # every kept token is inside the window
        # A window narrower than the buffer: mark the newest window_size slots in ring order.
        idx = 0 if self._idx >= self.max_size else self._idx  # slot the new token lands in
        n_keys = min(self.offset + 1, self.max_size)
        mask = mx.arange(n_keys) >= (n_keys - window_size)  # temporal order
        return mx.roll(mask, shift=idx + 1)

    # -- bookkeeping ----------------------------------------------------

    def size(self) -> int:
        """Tokens kept for attention (at most ``max_size`` between writes)."""
        return min(self.offset, self.max_size)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self) -> tuple[mx.array, ...]:
        """``(keys, values)`` as laid out in the buffer; ``()`` when empty."""
        if self.keys is None:
            return ()
        return self._fetch()

    @state.setter
    def state(self, v: tuple[mx.array, ...]) -> None:
        if not v:
            self.keys = self.values = None
            return
        self.keys, self.values = v

    @property
    def meta_state(self) -> tuple[str, ...]:
        """``(max_size, offset, _idx)`` as strings."""
        return tuple(map(str, (self.max_size, self.offset, self._idx)))

    @meta_state.setter
    def meta_state(self, v: tuple[str, ...]) -> None:
        self.max_size, self.offset, self._idx = map(int, v)

    @classmethod
    def from_state(cls, state: tuple[mx.array, ...], meta_state: tuple[str, ...]) -> "RotatingKVCache":
        cache = cls.__new__(cls)
        cache.meta_state = meta_state
        cache.state = state
        return cache

    def is_trimmable(self) -> bool:
        """Only while nothing has been evicted (``offset < max_size``)."""
        return self.offset < self.max_size

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens; returns 0 once tokens were evicted."""
        if not self.is_trimmable():
            return 0
        n = min(self.offset, n)
        self.offset -= n
        self._idx -= n
        return n

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes


def cache_nbytes(caches: list[Any]) -> int:
    """Total bytes held by a model's per-layer caches."""
    return sum(c.nbytes for c in caches)
