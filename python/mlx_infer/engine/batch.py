"""The engine's batched decode step over paged sequences: one token per row.

:class:`~mlx_infer.state.paged.PagedBatch` serves any ``(B, N)`` step and
does its bookkeeping row by row and layer by layer. A decode step always
appends exactly one token to every row, so everything but the K/V values is
known before the forward and is computed once per step, in numpy, for all
rows and layers together::

    reserve()   pages.append(seq, 1) per row (C++)     -> per layer group: copies, one slot per row
                block tables per group, refreshed only when a row crosses a page
                positions (B,)            RoPE offset of each row
                slots (B,)                where each row's new K/V goes
                per window kind: (pages, offsets) (B, S) and mask (B, 1, 1, S)
    forward     every layer: its group's copies (rare), write its group's B slots, gather (B, S):
                the eager graph through ``caches``, or the compiled C++ paged
                step through ``paged_inputs()`` (per group the block tables, lengths and
                write slots; see generation/bindings/paged_decode_step.py)
    commit()    every layer's offset of every row moves to the new length

Rows are right-padded to the longest; padding reads slot 0 of the null page
and is masked out, as in :class:`~mlx_infer.state.paged.PagedBatch`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from ..state.paged import PagedKVStore, PagedSequence


class DecodeBatch:
    """B sequences of one store advanced by one token each per :meth:`reserve`.

    ``model(tokens (B, 1), cache=batch.caches)`` after a successful
    :meth:`reserve`, then :meth:`commit`.
    """

    def __init__(self, store: PagedKVStore, seqs: list[PagedSequence]):
        self.store = store
        self.seqs = list(seqs)
        self.ids = [s.seq_id for s in self.seqs]
        self.caches = [_DecodeLayerCache(self, i) for i in range(store.num_layers)]
        G = len(store.groups)
        self._tables: list[list[list[int]]] = [  # [group][row] block table
            [store.pages.block_table(i, g) for i in self.ids] for g in range(G)]
        self.offset: mx.array | None = None  # (B,) int32 positions of the new tokens
        self.slots: list[mx.array] = []  # per group, (B,) int32
        self.copies: list[tuple[mx.array, mx.array] | None] = [None] * G
        self._gather: dict[Any, tuple[Any, ...]] = {}  # per window, and the paged step's inputs
        self._masks: dict[int | None, mx.array | None] = {}
        self._windows = self.windows_of(store)
        self._group_of = {w: store.group_of_window(w) for w in self._windows}

    @staticmethod
    def windows_of(store: PagedKVStore) -> list[int | None]:
        """The store's distinct layer windows (``None`` = global first): one gather each per step."""
        return sorted(set(store.layer_windows), key=lambda w: -1 if w is None else w)

    def reserve(self) -> bool:
        """Reserve one token on every row; all or nothing (``False``: out of pages)."""
        pages, P = self.store.pages, self.store.page_size
        G = len(self.store.groups)
        done: list[int] = []
        slots: list[list[int]] = [[] for _ in range(G)]
        copies: list[list[tuple[int, int]]] = [[] for _ in range(G)]
        for b, sid in enumerate(self.ids):
            rs = pages.append(sid, 1)  # windowed groups release the pages behind their window first
            if rs is None:
                for d in done:
                    pages.truncate(d, 1)
                return False
            done.append(sid)
            for g, r in enumerate(rs):
                slots[g].append(r.slots[0])
                # A new or copied page: re-read the table. Entries a window released stay stale
                # here, which is harmless: they lie before the window and are never gathered.
                if r.copies or r.slots[0] % P == 0:
                    copies[g] += r.copies
                    self._tables[g][b] = pages.block_table(sid, g)
        starts = np.array([s.offsets[0] for s in self.seqs])  # (B,) tokens before this step
        self.offset = mx.array(starts, mx.int32)
        self.slots = [mx.array(sl, mx.int32) for sl in slots]
        self.copies = [None if not c else (mx.array([x[0] for x in c], mx.int32), mx.array([x[1] for x in c], mx.int32))
                       for c in copies]
        self._gather = {}
        self._rows = {}
        self._slots_np = [np.array(sl, np.int64) for sl in slots]
        tabs = []
        for g in range(G):
            tab = np.zeros((len(self.ids), max(map(len, self._tables[g]))), np.int64)  # (B, max_pages)
            for b, t in enumerate(self._tables[g]):
                tab[b, :len(t)] = t
            tabs.append(tab)
        self._tabs_np = tabs  # per group (B, max_pages): the paged step reads through these
        self._starts_np = starts
        self._gather_np = {w: _index_np(starts, w, tabs[self._group_of[w]], P) for w in self._windows}
        self._masks = {}
        for w, (_, _, valid) in self._gather_np.items():
            # No padding anywhere (one row, or rows of one length): no mask, the fast attention path.
            self._masks[w] = None if valid.all() else mx.array(valid[:, None, None, :])
        return True

    def group_windows(self) -> list[int | None]:
        """The windows of the gathers, in the order :meth:`paged_inputs` lists them."""
        return list(self._windows)

    def paged_inputs(self, bucket: int = 1) -> list[tuple[mx.array, mx.array, mx.array]]:
        """Per window (in :meth:`group_windows` order), what the compiled paged step reads::

            block_tables (B, T) int32   each row's pages in the window's group's storage, by
                                        logical page (0 = the null page past its end); T
                                        rounded up to a multiple of ``bucket``
            lengths      (B,)   int32   position + 1: the row attends to the keys at
                                        [max(0, length - window), length), its new one included
            write_slots  (B,)   int32   page * page_size + offset of the row's new token
        """
        key = ("paged", bucket)
        if key not in self._gather:
            lengths = mx.array(self._starts_np + 1, mx.int32)
            out = []
            for w in self._windows:
                g = self._group_of[w]
                tab = self._tabs_np[g]
                pad = -tab.shape[1] % bucket
                if pad:
                    tab = np.pad(tab, ((0, 0), (0, pad)))
                out.append((mx.array(tab, mx.int32), lengths, mx.array(self._slots_np[g], mx.int32)))
            self._gather[key] = tuple(out)
        return list(self._gather[key])

    def mask(self, window: int | None) -> mx.array | None:
        return self._masks[window]

    def slot_index(self, window: int | None) -> tuple[mx.array, mx.array]:
        """``(pages, offsets)`` ``(B, S)`` as arrays, into the window's group's storage
        (the quantized path reads through these)."""
        if window not in self._gather:
            pages, offs, _ = self._gather_np[window]
            self._gather[window] = (mx.array(pages, mx.int32), mx.array(offs, mx.int32))
        return self._gather[window]

    def rows(self, heads: int, window: int | None) -> tuple[mx.array, mx.array]:
        """Row indices into a plain part viewed as ``(pages * heads * P, D)``: the write rows
        ``(B * heads, 1)`` of the new tokens and the read rows ``(B, heads, S)`` of each row's keys."""
        key = (heads, window)
        if key not in self._rows:
            P = self.store.page_size
            h = np.arange(heads)
            s = self._slots_np[self._group_of[window]]
            write = ((s // P)[:, None] * heads + h[None]) * P + (s % P)[:, None]  # (B, H)
            pages, offs, _ = self._gather_np[window]
            read = (pages[:, None, :] * heads + h[None, :, None]) * P + offs[:, None, :]  # (B, H, S)
            self._rows[key] = (mx.array(write.reshape(-1, 1), mx.int32), mx.array(read, mx.int32))
        return self._rows[key]

    def commit(self) -> None:
        """After the forward: every layer of every row holds the new token."""
        for s in self.seqs:
            n = s.offsets[0] + 1
            s.offsets[:] = [n] * len(s.offsets)


def _index_np(starts: np.ndarray, window: int | None, tab: np.ndarray,
              P: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(pages, offsets, valid)`` ``(B, S)`` of the keys each row reads (one query per row)."""
    start = starts[:, None]  # (B, 1)
    lo = np.zeros_like(start) if window is None else np.maximum(start - (window - 1), 0)
    count = start + 1 - lo  # (B, 1) keys each row reads, its new token included
    s = np.arange(int(count.max()))[None]  # (1, S)
    valid = s < count  # (B, S)
    pos = np.where(valid, lo + s, 0)  # (B, S); padding -> position 0 of the null page
    pages = np.take_along_axis(tab, pos // P, axis=1) * valid
    return pages, pos % P * valid, valid


def _write_read(part: mx.array, new: mx.array, write: mx.array, read: mx.array) -> tuple[tuple[mx.array], mx.array]:
    """Scatter ``new`` ``(B, KVH, 1, D)`` at ``write`` rows of ``part``; gather ``read`` rows ``(B, KVH, S)``."""
    shape = part.shape  # (pages, KVH, P, D)
    D = shape[-1]
    flat = part.reshape(-1, D)  # (pages * KVH * P, D), no copy
    if new.dtype != part.dtype:
        new = new.astype(part.dtype)
    flat = mx.put_along_axis(flat, mx.broadcast_to(write, (write.shape[0], D)), new.reshape(-1, D), axis=0)
    return (flat.reshape(shape),), mx.take(flat, read, axis=0)  # (B, KVH, S, D)


class _DecodeLayerCache:
    """The cache protocol for one layer of a :class:`DecodeBatch` (``offset`` is ``(B,)``)."""

    def __init__(self, batch: DecodeBatch, layer: int):
        self.batch = batch
        self.layer = layer
        self.window: int | None = batch.store.layer_windows[layer]
        self.group: int = batch.store.layer_group[layer]

    @property
    def offset(self) -> mx.array:
        return self.batch.offset

    def make_mask(self, N: int, *, window_size: int | None = None, return_array: bool = False) -> mx.array | None:
        assert N == 1, "a DecodeBatch feeds one token per row"
        return self.batch.mask(self.window)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        """Write ``(B, KVH, 1, D)`` keys/values; return ``(B, KVH, S, D)`` padded rows."""
        b = self.batch
        storage = b.store._storage(self.layer, keys, values)
        if b.copies[self.group] is not None:
            storage.copy_pages(*b.copies[self.group])
        if storage.scheme.quantized:
            storage.write(b.slots[self.group], keys[:, :, 0].transpose(1, 0, 2), values[:, :, 0].transpose(1, 0, 2))
            k, v = storage.read_slots(*b.slot_index(self.window))  # (B, KVH, S, w)
            return storage.unwrap(k), storage.unwrap(v)
        # Plain parts as (pages * KVH * P, D) row views: one scatter and one gather per part.
        write, read = b.rows(keys.shape[1], self.window)
        storage.keys, k = _write_read(storage.keys[0], keys, write, read)
        storage.values, v = _write_read(storage.values[0], values, write, read)
        return k, v  # (B, KVH, S, D)

    @property
    def state(self) -> tuple[mx.array, ...]:
        s = self.batch.store.storage[self.layer]
        return () if s is None else s.parts
