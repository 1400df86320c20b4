"""One layer's paged K/V arrays and the three things done to them: copy pages,
write slots, read a sequence's tokens back.

A plain layer keeps one array per K and per V; a quantized layer keeps three
(packed uint32, scales, biases), each paged the same way::

    part  (pages, kv_heads, page_size, width)
          width = head_dim                       plain
                = head_dim * bits / 32           packed
                = head_dim / group_size          scales, biases

so every index operation below applies to each part alike.
"""

from __future__ import annotations

import mlx.core as mx

from ... import _fast
from .scheme import LayerKV

Parts = tuple[mx.array, ...]


class LayerStorage:
    """Paged K/V of one layer (created on the layer's first write).

    Attributes:
        scheme: plain or quantized.
        keys, values: the parts, each ``(pages, kv_heads, page_size, width)``.
    """

    def __init__(self, scheme: LayerKV, *, num_pages: int, page_size: int, kv_heads: int,
                 k_dim: int, v_dim: int, dtype: mx.Dtype):
        self.scheme = scheme
        self.dtype = dtype
        self.keys = self._alloc(num_pages, page_size, kv_heads, k_dim)
        self.values = self._alloc(num_pages, page_size, kv_heads, v_dim)

    def _alloc(self, pages: int, page_size: int, heads: int, dim: int) -> Parts:
        s = self.scheme
        if not s.quantized:
            return (mx.zeros((pages, heads, page_size, dim), self.dtype),)
        packed = dim * s.bits // 32
        groups = dim // s.group_size
        return (mx.zeros((pages, heads, page_size, packed), mx.uint32),
                mx.zeros((pages, heads, page_size, groups), self.dtype),
                mx.zeros((pages, heads, page_size, groups), self.dtype))

    @property
    def num_pages(self) -> int:
        """Pages the arrays hold (the group's materialized pages)."""
        return self.keys[0].shape[0]

    def grow(self, pages: int) -> None:
        """Grow every part to ``pages`` pages, zeros appended along the page axis, and evaluate
        it (a no-op when it already holds that many: growth never shrinks).

        Written pages keep their ids and contents (the concatenation copies them); the old
        arrays are released once evaluated, so the transient is this layer's old and new parts.
        """
        extra = pages - self.num_pages
        if extra <= 0:
            return

        def one(p: mx.array) -> mx.array:
            return mx.concatenate([p, mx.zeros((extra, *p.shape[1:]), p.dtype)], axis=0)  # (pages, H, P, w)
        self.keys, self.values = tuple(map(one, self.keys)), tuple(map(one, self.values))
        mx.eval(self.parts)

    @property
    def parts(self) -> Parts:
        return self.keys + self.values

    @property
    def page_bytes(self) -> int:
        """Bytes one page takes in this layer (K and V, all parts)."""
        return sum(p.nbytes // p.shape[0] for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def _encode(self, x: mx.array) -> Parts:
        x = x.astype(self.dtype)
        if not self.scheme.quantized:
            return (x,)
        return tuple(mx.quantize(x, group_size=self.scheme.group_size, bits=self.scheme.bits))

    def copy_pages(self, src: mx.array, dst: mx.array) -> None:
        """Copy-on-write: page ``src[i]`` -> page ``dst[i]`` in every part."""
        def copy(parts: Parts) -> Parts:
            out = []
            for p in parts:
                p[dst] = p[src]
                out.append(p)
            return tuple(out)
        self.keys, self.values = copy(self.keys), copy(self.values)

    def write(self, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Write ``(kv_heads, T, dim)`` keys/values at flat ``slots`` ``(T,)``."""
        self.keys = tuple(_fast.scatter_slots(p, slots, v) for p, v in zip(self.keys, self._encode(keys)))
        self.values = tuple(_fast.scatter_slots(p, slots, v) for p, v in zip(self.values, self._encode(values)))

    def read(self, table: mx.array, lo: int, hi: int) -> tuple[Parts, Parts]:
        """Tokens ``lo .. hi-1`` of one sequence: parts ``(1, kv_heads, hi - lo, width)``.

        ``table`` is the sequence's block table; pages before ``lo`` are not
        read (they may be the null page after a window release).
        """
        page_size = self.keys[0].shape[2]
        first = lo // page_size
        sub = table[first:] if first else table
        skip = lo - first * page_size

        def one(p: mx.array) -> mx.array:
            x = _fast.gather_pages(p, sub, length=hi - first * page_size)  # (H, n, width)
            return (x[:, skip:] if skip else x)[None]  # (1, H, hi - lo, width)
        return tuple(map(one, self.keys)), tuple(map(one, self.values))

    def read_slots(self, pages: mx.array, offsets: mx.array) -> tuple[Parts, Parts]:
        """Tokens at ``(pages, offsets)`` ``(B, S)``: parts ``(B, kv_heads, S, width)``."""
        def one(p: mx.array) -> mx.array:
            return p[pages, :, offsets, :].transpose(0, 2, 1, 3)  # (B, S, H, w) -> (B, H, S, w)
        return tuple(map(one, self.keys)), tuple(map(one, self.values))

    def unwrap(self, parts: Parts) -> mx.array | Parts:
        """What attention reads: the array (plain) or the (packed, scales, biases) tuple."""
        return parts if self.scheme.quantized else parts[0]
