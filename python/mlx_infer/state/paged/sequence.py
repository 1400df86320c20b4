"""A sequence in a :class:`~.store.PagedKVStore` and its per-layer cache views.

One forward pass is one *step*: it appends ``N`` tokens to the sequence. The
page groups are asked once per step (``reserve``); every layer then writes
its own K/V at its group's slots::

    reserve(N) -> pages.append(seq, N): per group, copies (src, dst) and
                  slots s0..sN-1 (a windowed group first releases the pages
                  behind its window)
    layer 0:   its group's copies and slots on layer 0's storage, gather -> attention
    layer 1:   same for layer 1 (another group: other slots)
    ...
    offsets    layer i has written offsets[i] tokens; a layer whose offset
               equals the sequence length starts the next step

A layer that finds no reserved step reserves one itself, raising
:class:`PagedKVExhausted` when a pool is out of pages (a scheduler calls
``reserve`` first, where running out is a ``False`` return).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from ...errors import MlxInferError
from ...layers.attention import Mask, create_causal_mask

if TYPE_CHECKING:
    from .store import PagedKVStore


class PagedKVExhausted(MlxInferError):
    """The page pool has too few free pages for a step that was not reserved."""


@dataclass
class _GroupStep:
    slots: mx.array  # (n,) int32 flat slots in the group's storage
    src: mx.array | None  # (c,) pages to copy before writing, or None
    dst: mx.array | None
    table: list[int]  # the group's block table after the append
    table_arr: mx.array  # (pages,) int32


@dataclass
class _Step:
    start: int  # sequence length before the step
    n: int
    groups: list[_GroupStep]  # one per layer group of the store


class PagedSequence:
    """One sequence's handle: its id in the pool and each layer's write offset.

    Attributes:
        seq_id: the id in the store's :class:`mlx_infer._fast.PagePool`.
        cached_tokens: prompt tokens reused from the prefix cache at creation.
    """

    def __init__(self, store: "PagedKVStore", seq_id: int, offsets: list[int], cached_tokens: int = 0):
        self.store = store
        self.seq_id = seq_id
        self.offsets = offsets
        self.cached_tokens = cached_tokens
        self.freed = False
        self._step: _Step | None = None

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"length={self.length}"
        return f"PagedSequence(id={self.seq_id}, {state})"

    def _live(self, what: str) -> None:
        if self.freed:
            raise MlxInferError(
                f"Cannot {what}: paged sequence {self.seq_id} was freed. Start a new sequence "
                "with store.add_sequence()."
            )

    @property
    def length(self) -> int:
        """Tokens in the sequence (what every layer has once a step is done)."""
        self._live("read the length")
        return self.store.pages.length(self.seq_id)

    @property
    def block_table(self) -> list[int]:
        """Group 0's block table (the global layers' when there are any)."""
        self._live("read the block table")
        return self.store.pages.block_table(self.seq_id, 0)

    @property
    def block_tables(self) -> list[list[int]]:
        """One block table per layer group (0 entries: released by the group's window)."""
        self._live("read the block tables")
        return [self.store.pages.block_table(self.seq_id, g.index) for g in self.store.groups]

    def _idle(self) -> bool:
        n = self.store.pages.length(self.seq_id)
        return all(o == n for o in self.offsets)

    # -- steps ------------------------------------------------------------

    def reserve(self, n: int) -> bool:
        """Reserve pages for the next step of ``n`` tokens (growing the store's storage where its
        materialized pages are short); ``False`` when some group's capacity is out of pages."""
        self._live("append tokens")
        assert self._idle(), "reserve() while a step is still in flight on some layers"
        pages = self.store.pages
        results = self.store.append(self.seq_id, n)
        if results is None:
            return False
        groups = []
        for g, r in enumerate(results):
            src = dst = None
            if r.copies:
                src = mx.array([c[0] for c in r.copies], mx.int32)
                dst = mx.array([c[1] for c in r.copies], mx.int32)
            table = pages.block_table(self.seq_id, g)
            groups.append(_GroupStep(mx.array(r.slots, mx.int32), src, dst, table, mx.array(table, mx.int32)))
        self._step = _Step(pages.length(self.seq_id) - n, n, groups)
        return True

    def _take_step(self, layer: int, n: int) -> _Step:
        """The step layer ``layer`` writes ``n`` tokens into (reserving one if needed)."""
        self._live("append tokens")
        off = self.offsets[layer]
        if self._step is None or off != self._step.start:
            if not self.reserve(n):
                free = ", ".join(map(str, self.store.free_pages()))
                raise PagedKVExhausted(
                    f"The KV page pools have {free} free pages (per layer group), too few to "
                    f"append {n} tokens to sequence {self.seq_id}; free sequences or use a larger pool."
                )
        step = self._step
        assert step.start == off and step.n == n, (
            f"layer {layer} writes {n} tokens at {off}, but the step reserved {step.n} at {step.start}")
        self.offsets[layer] = off + n
        return step

    # -- lifetime -----------------------------------------------------------

    def fork(self) -> "PagedSequence":
        """A new sequence sharing this one's pages (copy-on-write on divergence)."""
        self._live("fork")
        assert self._idle(), "fork() while a step is in flight"
        return self.store._fork(self)

    def truncate(self, n: int) -> int:
        """Drop the last ``n`` tokens on every layer; returns how many were dropped.

        Raises:
            ValueError: a windowed layer would have to read tokens it already
                released (roll back at most the store's ``window_slack``
                past the last step); nothing changes then.
        """
        self._live("truncate")
        n = min(n, min(self.offsets))
        self._set_offsets([o - n for o in self.offsets])
        return n

    def _set_offsets(self, offsets: list[int]) -> None:
        """Move the layers' offsets, truncating the pages first (which may refuse)."""
        pages = self.store.pages
        excess = pages.length(self.seq_id) - max(offsets)
        if excess > 0:
            pages.truncate(self.seq_id, excess)
            self._step = None
        self.offsets[:] = offsets

    def register(self, token_ids: list[int]) -> int:
        """Index this sequence's full pages under its namespace for prefix reuse.

        Args:
            token_ids: the sequence's tokens from position 0 (the prompt).

        Returns:
            Pages newly indexed, summed over layer groups (a windowed group
            indexes only the pages it still holds).
        """
        self._live("register pages")
        return self.store.pages.register_full_pages(self.seq_id, list(token_ids))

    def free(self) -> None:
        """Release the pages (indexed ones stay cached until evicted). Idempotent."""
        if not self.freed:
            self.store._free(self)

    @property
    def nbytes(self) -> int:
        """Bytes of the pages this sequence references, all layers (0 once freed)."""
        if self.freed:
            return 0
        return sum(c.nbytes for c in self.store.make_cache(self))


class PagedLayerCache:
    """The cache protocol (:class:`mlx_infer.contracts.Cache`) for one layer of one sequence.

    ``update_and_fetch`` returns ``(1, kv_heads, S, D)`` keys/values: every
    token for a global layer; for a window ``w``, the last ``w - 1`` cached
    tokens plus the new ones (as :class:`~mlx_infer.state.kv.RotatingKVCache`
    keeps them). Quantized layers return ``(packed, scales, biases)`` tuples.
    """

    def __init__(self, seq: PagedSequence, layer: int):
        self.seq = seq
        self.layer = layer
        self.window: int | None = seq.store.layer_windows[layer]
        self.group: int = seq.store.layer_group[layer]

    @property
    def offset(self) -> int:
        return self.seq.offsets[self.layer]

    def _kept(self) -> int:
        """Cached tokens attention reads before the new ones."""
        return self.offset if self.window is None else min(self.window - 1, self.offset)

    def make_mask(self, N: int, *, window_size: int | None = None, return_array: bool = False) -> Mask:
        """Mask for the next ``N`` queries over the keys ``update_and_fetch`` will return."""
        kept = self._kept()
        if window_size is None or kept + N <= window_size:
            if N == 1:
                return None
            return create_causal_mask(N, kept) if return_array else "causal"
        return create_causal_mask(N, kept, window_size=window_size)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        """Write ``(1, KVH, N, D)`` keys/values; return what attention reads."""
        if keys.shape[0] != 1:
            raise MlxInferError(
                f"A PagedLayerCache holds one sequence but got a batch of {keys.shape[0]}; "
                "use store.batch([...]) for batched decode."
            )
        kept, n = self._kept(), keys.shape[2]
        step = self.seq._take_step(self.layer, n)
        g = step.groups[self.group]
        storage = self.seq.store._storage(self.layer, keys, values)
        if g.src is not None:
            storage.copy_pages(g.src, g.dst)
        storage.write(g.slots, keys[0], values[0])
        if kept == 0 and not storage.scheme.quantized:
            # Nothing cached before this chunk (a prompt's first chunk): attention reads the
            # chunk's own contiguous K/V, as a plain cache would; no gather back from the pages.
            return keys.astype(storage.dtype), values.astype(storage.dtype)
        end = step.start + n
        k, v = storage.read(g.table_arr, end - n - kept, end)  # (1, KVH, kept + n, w)
        return storage.unwrap(k), storage.unwrap(v)

    @property
    def state(self) -> tuple[mx.array, ...]:
        """The layer's storage arrays (what ``mx.eval`` must materialize)."""
        s = self.seq.store.storage[self.layer]
        return () if s is None else s.parts

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget this layer's last ``n`` tokens; pages go once every layer has trimmed."""
        self.seq._live("trim")
        n = min(n, self.offset)
        offsets = list(self.seq.offsets)
        offsets[self.layer] -= n
        self.seq._set_offsets(offsets)
        return n

    def size(self) -> int:
        return self._kept()

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        """Bytes of the pages this sequence references in this layer."""
        if self.seq.freed:
            return 0
        s = self.seq.store.storage[self.layer]
        if s is None:
            return 0
        return self.seq.store.pages.held_pages(self.seq.seq_id, self.group) * s.page_bytes
