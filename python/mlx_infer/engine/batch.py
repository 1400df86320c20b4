"""The engine's batched step over paged sequences: R rows of one query token each.

The step plan comes from the C++ page groups in one call
(``PageGroups.append_batch``, see ``StepPlan``): every row's sequence grows,
and the positions, lengths, block tables, write slots and copy-on-write
copies come back as int32 arrays. No per-row Python runs here::

    reserve()   pages.append_batch(ids, counts)     (C++, all rows or none; short of materialized
                                                 pages, the store grows its storage and retries)
                -> positions (R,), lengths (R,), call_ends (R,), per layer group g:
                   block_tables (R, T), write_slots (R,), copies (c_g,)
    forward     the compiled C++ paged step reads the plan's arrays as they are
                (``paged_inputs()``: block tables, lengths, write slots per group;
                see generation/bindings/paged_decode_step.py), or the eager graph
                through ``caches``:
                per window kind, the gather index (R, S) comes from the plan
                (``StepPlan.gather_index``, built in C++), shared by every layer
                of that kind; every layer: its group's copies (rare), write its
                R slots, gather
    commit()    every layer's offset of every row moves to the new length

A row is a decode row (one token) or one token of a prefill chunk (a
sequence given n tokens has n rows with the same block table and
consecutive positions). Row r attends keys ``[max(0, length - window),
length)``: all rows are written before attention, so a chunk's tokens see
each other causally. Padding reads slot 0 of the null page, masked out.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..state.paged import PagedKVStore, PagedSequence


class DecodeBatch:
    """Sequences of one store advanced together by :meth:`reserve` (one token each by default).

    ``model(tokens (R, 1), cache=batch.caches)`` after a successful
    :meth:`reserve`, then :meth:`commit`.

    Args:
        store: the page store.
        seqs: the rows' sequences, in row order.
        counts: tokens each sequence gets per step (default 1: decode rows).
        table_bucket: the plan's block-table width is rounded up to a multiple of this.
        row_bucket: R is rounded up to a multiple of this with padding rows after the real
            ones (they write and read only the null page; feed them any token).

    Attributes:
        logit_rows: ``(M,)`` int32 rows that get logits in the compiled step, or ``None``
            (every row): a mixed step sets it to its decode rows and the last row of each
            prefill chunk that ends its prompt.
    """

    def __init__(self, store: PagedKVStore, seqs: list[PagedSequence], counts: list[int] | None = None,
                 *, table_bucket: int = 1, row_bucket: int = 1):
        self.store = store
        self.seqs = list(seqs)
        self.ids = [s.seq_id for s in self.seqs]
        self.counts = list(counts) if counts is not None else [1] * len(self.seqs)
        self.table_bucket = table_bucket
        self.row_bucket = row_bucket
        self.logit_rows: mx.array | None = None
        self.caches = [_DecodeLayerCache(self, i) for i in range(store.num_layers)]
        self.plan: Any = None  # the last reserve()'s _fast.StepPlan
        self.offset: mx.array | None = None  # (R,) int32 positions of the new tokens
        self.call_ends: mx.array | None = None  # (R,) int32 start + count of each row's sequence
        self.copies: list[tuple[mx.array, mx.array] | None] = [None] * len(store.groups)
        self._windows = self.windows_of(store)
        self._group_of = {w: store.group_of_window(w) for w in self._windows}
        self._gather: dict[Any, Any] = {}
        self._rows: dict[Any, tuple[mx.array, mx.array]] = {}

    @staticmethod
    def windows_of(store: PagedKVStore) -> list[int | None]:
        """The store's distinct layer windows (``None`` = global first): one gather each per step."""
        return sorted(set(store.layer_windows), key=lambda w: -1 if w is None else w)

    @property
    def rows(self) -> int:
        """R, the rows of the reserved step."""
        return self.plan.rows

    def reserve(self) -> bool:
        """Reserve every sequence's tokens, growing the store's storage where its materialized
        pages are short; all or nothing (``False``: out of the pool's capacity)."""
        plan = self.store.append_batch(self.ids, self.counts, table_bucket=self.table_bucket,
                                       row_bucket=self.row_bucket)
        if plan is None:
            return False
        self.plan = plan
        self.offset = plan.positions
        self.call_ends = plan.call_ends
        self.copies = [None if n == 0 else (s, d) for n, s, d in zip(plan.num_copies, plan.copy_src, plan.copy_dst)]
        self._gather = {}
        self._rows = {}
        return True

    def group_windows(self) -> list[int | None]:
        """The windows of the gathers, in the order :meth:`paged_inputs` lists them."""
        return list(self._windows)

    def _index(self, window: int | None, bucket: int = 1) -> tuple[mx.array, mx.array, mx.array, bool]:
        """``(pages, offsets, valid)`` ``(R, S)`` of the keys each row reads, into the window's
        group's storage (built on the host by the C++ plan), and whether any row has padding
        (``False``: every row reads all S keys, the attention needs no mask)."""
        key = (window, bucket)
        if key not in self._gather:
            plan = self.plan
            pages, offs, valid = plan.gather_index(self._group_of[window], window or 0, bucket)
            fewest = plan.min_length if window is None else min(plan.min_length, window)
            self._gather[key] = (pages, offs, valid, fewest < pages.shape[1])
        return self._gather[key]

    def paged_inputs(self, bucket: int = 1) -> list[tuple[mx.array, mx.array, mx.array]]:
        """Per window (in :meth:`group_windows` order), what the compiled paged step reads::

            block_tables (R, T) int32   each row's pages in the window's group's storage, by
                                        logical page (0 = the null page past its end); T
                                        a multiple of ``bucket``
            lengths      (R,)   int32   position + 1: the row attends to the keys at
                                        [max(0, length - window), length), its new one included
            write_slots  (R,)   int32   page * page_size + offset of the row's new token

        The plan's tables are already ``table_bucket`` wide; another ``bucket`` pads them.
        """
        plan = self.plan
        out = []
        for w in self._windows:
            g = self._group_of[w]
            tab = plan.block_tables[g]  # (R, T)
            pad = -tab.shape[1] % bucket
            if pad:
                tab = mx.pad(tab, [(0, 0), (0, pad)])
            out.append((tab, plan.lengths, plan.write_slots[g]))
        return out

    def mask(self, window: int | None) -> mx.array | None:
        """``(R, 1, 1, S)`` bool, or ``None`` when no row has padding (the fast attention path)."""
        _, _, valid, padded = self._index(window)
        return valid[:, None, None, :] if padded else None

    def slot_index(self, window: int | None) -> tuple[mx.array, mx.array]:
        """``(pages, offsets)`` ``(R, S)`` into the window's group's storage (the quantized path reads these)."""
        return self._index(window)[:2]

    def write_slots(self, window: int | None) -> mx.array:
        """``(R,)`` flat slots of the rows' new K/V in the window's group's storage."""
        return self.plan.write_slots[self._group_of[window]]

    def row_index(self, heads: int, window: int | None) -> tuple[mx.array, mx.array]:
        """Row indices into a plain part viewed as ``(pages * heads * P, D)``: the write rows
        ``(R * heads, 1)`` of the new tokens and the read rows ``(R, heads, S)`` of each row's keys."""
        key = (heads, window)
        if key not in self._rows:
            P = self.store.page_size
            h = mx.arange(heads, dtype=mx.int32)
            s = self.write_slots(window)  # (R,)
            write = ((s // P)[:, None] * heads + h[None]) * P + (s % P)[:, None]  # (R, H)
            pages, offs, _, _ = self._index(window)
            read = (pages[:, None, :] * heads + h[None, :, None]) * P + offs[:, None, :]  # (R, H, S)
            self._rows[key] = (write.reshape(-1, 1), read)
        return self._rows[key]

    def commit(self) -> None:
        """After the forward: every layer of every row's sequence holds the new tokens."""
        for s, n in zip(self.seqs, self.counts):
            s.offsets[:] = [s.offsets[0] + n] * len(s.offsets)


def _write_read(part: mx.array, new: mx.array, write: mx.array, read: mx.array) -> tuple[tuple[mx.array], mx.array]:
    """Scatter ``new`` ``(R, KVH, 1, D)`` at ``write`` rows of ``part``; gather ``read`` rows ``(R, KVH, S)``."""
    shape = part.shape  # (pages, KVH, P, D)
    D = shape[-1]
    flat = part.reshape(-1, D)  # (pages * KVH * P, D), no copy
    if new.dtype != part.dtype:
        new = new.astype(part.dtype)
    flat = mx.put_along_axis(flat, mx.broadcast_to(write, (write.shape[0], D)), new.reshape(-1, D), axis=0)
    return (flat.reshape(shape),), mx.take(flat, read, axis=0)  # (R, KVH, S, D)


class _DecodeLayerCache:
    """The cache protocol for one layer of a :class:`DecodeBatch` (``offset`` is ``(R,)``)."""

    def __init__(self, batch: DecodeBatch, layer: int):
        self.batch = batch
        self.layer = layer
        self.window: int | None = batch.store.layer_windows[layer]
        self.group: int = batch.store.layer_group[layer]

    @property
    def offset(self) -> mx.array:
        return self.batch.offset

    def make_mask(self, N: int, *, window_size: int | None = None, return_array: bool = False) -> mx.array | None:
        assert N == 1, "a DecodeBatch feeds one query token per row"
        return self.batch.mask(self.window)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        """Write ``(R, KVH, 1, D)`` keys/values; return ``(R, KVH, S, D)`` padded rows."""
        b = self.batch
        storage = b.store._storage(self.layer, keys, values)
        if b.copies[self.group] is not None:
            storage.copy_pages(*b.copies[self.group])
        if storage.scheme.quantized:
            storage.write(b.write_slots(self.window), keys[:, :, 0].transpose(1, 0, 2),
                          values[:, :, 0].transpose(1, 0, 2))
            k, v = storage.read_slots(*b.slot_index(self.window))  # (R, KVH, S, w)
            return storage.unwrap(k), storage.unwrap(v)
        # Plain parts as (pages * KVH * P, D) row views: one scatter and one gather per part.
        write, read = b.row_index(keys.shape[1], self.window)
        storage.keys, k = _write_read(storage.keys[0], keys, write, read)
        storage.values, v = _write_read(storage.values[0], values, write, read)
        return k, v  # (R, KVH, S, D)

    @property
    def state(self) -> tuple[mx.array, ...]:
        s = self.batch.store.storage[self.layer]
        return () if s is None else s.parts
