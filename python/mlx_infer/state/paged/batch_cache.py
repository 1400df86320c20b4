"""Batched decode over paged sequences of different lengths.

Each row gathers its own tokens, right-padded to the longest row; padding
reads slot 0 of the null page and is masked out::

    row 0  len 5   [k0 k1 k2 k3 k4 __ __]      mask  1 1 1 1 1 0 0
    row 1  len 7   [k0 k1 k2 k3 k4 k5 k6]            1 1 1 1 1 1 1
    row 2  len 2   [k0 k1 __ __ __ __ __]            1 1 0 0 0 0 0

    offset = [4, 6, 1]   (B,) positions of the new tokens: RoPE takes an
                          array offset and rotates each row at its own position
    mask   (B, 1, N, S)  bool; a windowed layer reads only the last w - 1
                          cached tokens of each row plus the new ones

Layers of different layer groups (global, each window) have their own pages,
so the gather index of a window indexes that window's group's storage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from ...errors import MlxInferError
from .sequence import PagedKVExhausted, PagedSequence

if TYPE_CHECKING:
    from .store import PagedKVStore


class PagedBatch:
    """B sequences of one store decoded together: ``model(tokens (B, N), cache=batch.caches)``.

    Attributes:
        seqs: the rows, in order.
        caches: one :class:`PagedBatchLayerCache` per layer.
    """

    def __init__(self, store: "PagedKVStore", seqs: list[PagedSequence]):
        if not seqs:
            raise MlxInferError("A PagedBatch needs at least one sequence.")
        if len({id(s) for s in seqs}) != len(seqs):
            raise MlxInferError("A PagedBatch cannot hold the same sequence twice; fork it first.")
        for s in seqs:
            s._live("batch it")
            if s.store is not store:
                raise MlxInferError(f"Sequence {s.seq_id} belongs to another PagedKVStore.")
        self.store = store
        self.seqs = list(seqs)
        self.caches = [PagedBatchLayerCache(self, i) for i in range(store.num_layers)]
        self._steps_key: list[int] = []
        self._steps: list = []  # kept alive so their ids stay unique
        self._gathers: dict[tuple[int, int | None], tuple[mx.array, mx.array]] = {}

    def reserve(self, n: int = 1) -> bool:
        """Reserve ``n`` tokens on every row; all or nothing (``False``: out of pages)."""
        # One growth for the whole batch (before any window release, so at most one page per
        # windowed row more than needed) rather than one per row that comes up short.
        self.store.ensure_free(self.store.pages.pages_needed([s.seq_id for s in self.seqs], [n] * len(self.seqs)))
        done = []
        for s in self.seqs:
            if not s.reserve(n):
                for d in done:  # roll back the rows already grown
                    d.store.pages.truncate(d.seq_id, n)
                    d._step = None
                return False
            done.append(s)
        return True

    def mask(self, starts: tuple[int, ...], n: int, window: int | None) -> mx.array:
        """``(B, 1, n, S)`` bool: row ``b``'s query ``j`` may read key ``s``."""
        return self._index(starts, n, window, None)[2]

    def gather_index(self, steps: list, n: int, window: int | None) -> tuple[mx.array, mx.array]:
        """``(pages, offsets)`` ``(B, S)`` of the tokens each row reads this step.

        ``pages`` index the storage of the layers whose window is ``window``
        (their layer group's pool). Computed once per step and window, shared
        by every layer of that kind.
        """
        if [id(st) for st in steps] != self._steps_key:
            self._steps_key, self._steps, self._gathers = [id(st) for st in steps], steps, {}
        if (n, window) not in self._gathers:
            starts = tuple(st.start for st in steps)
            g = self.store.group_of_window(window)
            self._gathers[(n, window)] = self._index(starts, n, window, [st.groups[g].table for st in steps])[:2]
        return self._gathers[(n, window)]

    def _index(self, starts: tuple[int, ...], n: int, window: int | None,
               tables: list[list[int]] | None) -> tuple[mx.array | None, mx.array | None, mx.array]:
        start = np.array(starts)[:, None]  # (B, 1)
        lo = np.zeros_like(start) if window is None else np.maximum(start - (window - 1), 0)
        count = start + n - lo  # (B, 1) keys per row
        s = np.arange(int(count.max()))[None]  # (1, S)
        valid = s < count  # (B, S)
        pos = np.where(valid, lo + s, 0)  # (B, S) token positions; padding -> position 0
        q = start + np.arange(n)[None]  # (B, n) query positions
        mask = valid[:, None, :] & (pos[:, None, :] <= q[:, :, None])  # (B, n, S)
        if window is not None:
            mask &= pos[:, None, :] > q[:, :, None] - window
        if tables is None:
            return None, None, mx.array(mask[:, None])
        P = self.store.page_size
        tab = np.zeros((len(tables), max(map(len, tables))), np.int64)  # (B, max_pages)
        for b, t in enumerate(tables):
            tab[b, :len(t)] = t
        pages = np.take_along_axis(tab, pos // P, axis=1) * valid  # (B, S); padding -> null page
        return mx.array(pages, mx.int32), mx.array(pos % P * valid, mx.int32), mx.array(mask[:, None])


class PagedBatchLayerCache:
    """The cache protocol for one layer of a :class:`PagedBatch`.

    ``offset`` is a ``(B,)`` int32 array (each row's position); ``make_mask``
    always returns a ``(B, 1, N, S)`` boolean array.
    """

    def __init__(self, batch: PagedBatch, layer: int):
        self.batch = batch
        self.layer = layer
        self.window: int | None = batch.store.layer_windows[layer]
        self.group: int = batch.store.layer_group[layer]

    def _starts(self) -> tuple[int, ...]:
        return tuple(s.offsets[self.layer] for s in self.batch.seqs)

    @property
    def offset(self) -> mx.array:
        return mx.array(self._starts(), mx.int32)  # (B,)

    def make_mask(self, N: int, *, window_size: int | None = None, return_array: bool = False) -> mx.array:
        window = window_size if window_size is not None else self.window
        return self.batch.mask(self._starts(), N, window)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        """Write ``(B, KVH, N, D)`` keys/values; return ``(B, KVH, S, D)`` padded rows."""
        B, H, n, _ = keys.shape
        if B != len(self.batch.seqs):
            raise MlxInferError(f"The batch has {len(self.batch.seqs)} sequences but keys have B={B}.")
        seqs = self.batch.seqs
        if all(s._step is None or s.offsets[self.layer] != s._step.start for s in seqs):
            if not self.batch.reserve(n):  # all rows or none, before any row is written
                free = ", ".join(map(str, self.batch.store.free_pages()))
                raise PagedKVExhausted(
                    f"The KV page pools have {free} free pages (per layer group), too few to append "
                    f"{n} tokens to each of {B} sequences; free sequences or use a larger pool (or "
                    "call batch.reserve() first and handle False).")
        steps = [s._take_step(self.layer, n) for s in seqs]
        mine = [st.groups[self.group] for st in steps]
        storage = self.batch.store._storage(self.layer, keys, values)
        src = [g.src for g in mine if g.src is not None]
        if src:
            storage.copy_pages(mx.concatenate(src), mx.concatenate([g.dst for g in mine if g.dst is not None]))
        slots = mx.concatenate([g.slots for g in mine])  # (B * n,) row-major like the values
        flat_k = keys.transpose(1, 0, 2, 3).reshape(H, B * n, -1)  # (KVH, B*n, D)
        flat_v = values.transpose(1, 0, 2, 3).reshape(H, B * n, -1)
        storage.write(slots, flat_k, flat_v)
        pages, offsets = self.batch.gather_index(steps, n, self.window)
        k, v = storage.read_slots(pages, offsets)  # (B, KVH, S, w)
        return storage.unwrap(k), storage.unwrap(v)

    @property
    def state(self) -> tuple[mx.array, ...]:
        s = self.batch.store.storage[self.layer]
        return () if s is None else s.parts

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    @property
    def nbytes(self) -> int:
        return sum(s.store.make_cache(s)[self.layer].nbytes for s in self.batch.seqs)
