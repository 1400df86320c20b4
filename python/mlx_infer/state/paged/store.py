"""The paged KV store of one model: one page pool per layer group, per-layer paged storage."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx

from ... import defaults
from ... import _fast
from ...errors import MlxInferError
from ..kv import RotatingKVCache
from .batch_cache import PagedBatch
from .growth import PoolGrowth
from .scheme import LayerKV, load_kv_config, uniform_scheme
from .sequence import PagedLayerCache, PagedSequence
from .storage import LayerStorage

DEFAULT_PAGE_SIZE = defaults.PAGE_SIZE


def model_geometry(model: Any) -> tuple[list[int | None], int, int]:
    """``(layer windows, kv_heads, head_dim)`` of a graph (``None`` = global layer).

    One window per cache the graph makes (``model.make_cache()``): a layer is
    paged in a window exactly when its own cache rotates, and a KV-shared layer
    (Gemma 4: it reads its donor's K/V and is given no cache) gets no pages; the
    graphs pass their caches to the KV-owning layers, which come first.
    """
    windows = [c.max_size if isinstance(c, RotatingKVCache) else None for c in model.make_cache()]
    attn = model.layers[0].self_attn
    return windows, attn.n_kv_heads, attn.head_dim


#: Tokens a sliding-window group keeps beyond its window, so a caller can roll
#: back (truncate / trim) that far past the last step.
DEFAULT_WINDOW_SLACK = defaults.WINDOW_SLACK


@dataclass(frozen=True)
class LayerGroup:
    """Layers that share a sliding window (or are global), and so one page pool.

    Attributes:
        index: the group's index in the store's :class:`mlx_infer._fast.PageGroups`.
        window: the layers' sliding window, ``None`` for global layers.
        layers: the layer indices, ascending.
        num_pages: the group's pool capacity, null page included (its materialized
            size, the pages with storage, is ``store.pages.pool(index).materialized``).
        keep: tokens behind a sequence's end the group holds (``None`` = all).
    """

    index: int
    window: int | None
    layers: tuple[int, ...]
    num_pages: int
    keep: int | None


class PagedKVStore:
    """Paged K/V for every sequence of one model.

    Layers are grouped by attention span: one group for the global layers and
    one per distinct sliding window. Each group has its own page pool and
    block tables (one :class:`mlx_infer._fast.PageGroups` drives them all), so
    a windowed group hands back the pages behind its window while the global
    group keeps every page. Each layer has its own storage, sized by its
    group's pool and created on its first write::

        groups (bookkeeping, C++)               storage, per layer (MLX arrays)
        group 0, global   seq 3: [5, 2, 8, 1]   layers 5, 11, 17: (pages_0, kv_heads, P, D)
        group 1, w 512    seq 3: [0, 0, 4, 9]   layers 0-4, 6-10 ...: (pages_1, kv_heads, P, D)
                                 ^ released: back in group 1's pool

    A token of a sequence sits at the same slot in every layer of a group;
    slots differ between groups. A group of window ``w`` keeps the last
    ``w - 1 + window_slack`` tokens: rolling back (truncate / trim) up to
    ``window_slack`` tokens before the longest length a step started at is
    always allowed; a rollback that would make a windowed layer read a
    released token raises ``ValueError`` and changes nothing.

    Growth (state/paged/growth.py): a group's pool holds up to ``num_pages``
    (its capacity) but only its first ``materialized`` page ids have storage
    and are handed out. With a ``growth`` policy, an append that finds too few
    free materialized pages first grows the storage (:meth:`grow`: every
    layer's arrays, zeros appended along the page axis, layer by layer) and
    the pool, then succeeds; it fails (``None`` / ``False``) only when the
    capacity itself is short. Page ids never move, so block tables and written
    K/V survive a growth unchanged.

    Args:
        num_layers: attention layers.
        num_pages: pages per group's pool, the null page included: one int for
            every group, or one per group in :attr:`groups` order (the global
            group first, then windows ascending).
        page_size: tokens per page (a power of two).
        layer_windows: sliding window per layer (``None`` = global); default all global.
        dtype: element type of plain storage and of quantization scales;
            ``None`` takes the first write's dtype (the model's).
        kv_scheme: one :class:`LayerKV` per layer, a ``kv_config.json`` path or
            list (see :func:`load_kv_config`), or ``None`` for all plain.
        head_dim: when given, the scheme is checked against it now.
        release_windows: give windowed layers their own pools and release pages
            behind the window (``False``: one pool, every page kept).
        window_slack: tokens a windowed group keeps beyond its window.
        materialized: pages (null page included) each group has storage for at
            first, one int or one per group like ``num_pages``; ``None``: all.
        growth: grow the materialized pages on demand by this policy; ``None``:
            never by itself (:meth:`grow` still works).

    Raises:
        ValueError: a page size that is not a power of two, a scheme the model
            cannot use, a bad ``kv_config``, a bad pool size or materialized size.
    """

    def __init__(self, *, num_layers: int, num_pages: int | Sequence[int], page_size: int = DEFAULT_PAGE_SIZE,
                 layer_windows: Sequence[int | None] | None = None, dtype: mx.Dtype | None = None,
                 kv_scheme: Any = None, head_dim: int | None = None, release_windows: bool = True,
                 window_slack: int = DEFAULT_WINDOW_SLACK, materialized: int | Sequence[int] | None = None,
                 growth: PoolGrowth | None = None):
        self.num_layers = num_layers
        self.page_size = page_size
        self.dtype = dtype
        windows = list(layer_windows) if layer_windows is not None else [None] * num_layers
        if len(windows) != num_layers:
            raise MlxInferError(f"layer_windows has {len(windows)} entries for {num_layers} layers.")
        self.layer_windows: list[int | None] = [w or None for w in windows]
        if kv_scheme is None:
            scheme = uniform_scheme(num_layers)
        elif isinstance(kv_scheme, LayerKV):
            scheme = [kv_scheme] * num_layers
        elif isinstance(kv_scheme, (list, tuple)) and all(isinstance(s, LayerKV) for s in kv_scheme):
            scheme = list(kv_scheme)
        else:
            scheme = load_kv_config(kv_scheme, num_layers)
        if len(scheme) != num_layers:
            raise MlxInferError(f"kv_scheme has {len(scheme)} entries for {num_layers} layers.")
        for i, s in enumerate(scheme):
            s.check(layer=i, head_dim=head_dim)
        self.scheme = scheme

        # Group keys: None (global) first, then windows ascending; without
        # release every layer shares one pool and reads its window from it.
        keys = [None] if not release_windows else sorted(
            set(self.layer_windows), key=lambda w: -1 if w is None else w)
        self.layer_group: list[int] = [0 if not release_windows else keys.index(w) for w in self.layer_windows]
        sizes = [num_pages] * len(keys) if isinstance(num_pages, int) else list(num_pages)
        if len(sizes) != len(keys):
            raise MlxInferError(
                f"num_pages has {len(sizes)} entries but the store has {len(keys)} layer groups "
                f"(windows {keys}); give one int, or one per group.")
        initial = self._per_group(materialized, sizes, keys)
        self.pages = _fast.PageGroups(num_pages=sizes, page_size=page_size, windows=[w or 0 for w in keys],
                                      slack=window_slack, materialized=initial)
        self.growth = growth
        self.growths = 0  # grow() calls that materialized pages (each changes the storage's shape)
        self.groups: list[LayerGroup] = [
            LayerGroup(g, w, tuple(i for i, lg in enumerate(self.layer_group) if lg == g), sizes[g],
                       self.pages.keep(g) or None)
            for g, w in enumerate(keys)]
        self.storage: list[LayerStorage | None] = [None] * num_layers
        self._next_id = 0
        self._live: dict[int, PagedSequence] = {}

    @staticmethod
    def _per_group(materialized: int | Sequence[int] | None, sizes: list[int], keys: list) -> list[int]:
        """The initial materialized size of each group (``[]``: all pages), validated."""
        if materialized is None:
            return []
        initial = list(materialized) if isinstance(materialized, (list, tuple)) else [materialized] * len(sizes)
        if len(initial) != len(sizes):
            raise MlxInferError(
                f"materialized has {len(initial)} entries but the store has {len(sizes)} layer groups "
                f"(windows {keys}); give one int, or one per group.")
        for m, cap, w in zip(initial, sizes, keys):
            if isinstance(m, bool) or not isinstance(m, int) or not 2 <= m <= cap:
                raise MlxInferError(
                    f"materialized pages of the {'global' if w is None else f'window-{w}'} group must be an "
                    f"integer in [2, num_pages = {cap}] (the null page and at least one more), got {m!r}.")
        return initial

    @classmethod
    def for_model(cls, model: Any, *, num_pages: int | Sequence[int], page_size: int = DEFAULT_PAGE_SIZE,
                  dtype: mx.Dtype | None = None, kv_scheme: Any = None, release_windows: bool = True,
                  window_slack: int = DEFAULT_WINDOW_SLACK, materialized: int | Sequence[int] | None = None,
                  growth: PoolGrowth | None = None) -> "PagedKVStore":
        """A store shaped for ``model`` (its layer count, windows and head_dim)."""
        windows, _, head_dim = model_geometry(model)
        return cls(num_layers=len(windows), num_pages=num_pages, page_size=page_size,
                   layer_windows=windows, dtype=dtype, kv_scheme=kv_scheme, head_dim=head_dim,
                   release_windows=release_windows, window_slack=window_slack, materialized=materialized,
                   growth=growth)

    def __repr__(self) -> str:
        return f"PagedKVStore(layers={self.num_layers}, sequences={len(self._live)}, {self.pages!r})"

    @property
    def pool(self) -> Any:
        """Group 0's :class:`mlx_infer._fast.PagePool` (the global layers' when there are any).

        For inspection; change sequences through :attr:`pages` (all groups at once).
        """
        return self.pages.pool(0)

    def group_of_window(self, window: int | None) -> int:
        """The group of the layers whose window is ``window``."""
        for layer, w in enumerate(self.layer_windows):
            if w == window:
                return self.layer_group[layer]
        raise MlxInferError(f"No layer of this store has window {window!r}; windows: {sorted(set(self.layer_windows), key=str)}.")

    def pages_to_hold(self, tokens: int, step: int | None = None) -> list[int]:
        """Pages each group needs at most for a sequence of ``tokens`` tokens fed ``step`` at a time.

        A global group holds every page; a windowed group only its ``keep``
        tokens plus one step (at most ``ceil((keep + step) / P) + 1`` pages).
        """
        P = self.page_size
        full = -(-tokens // P)
        step = tokens if step is None else step
        return [full if g.keep is None else min(full, -(-(g.keep + step) // P) + 1) for g in self.groups]

    def drop_cached_prefixes(self) -> int:
        """Evict every cached (unreferenced) page of every group from the prefix index; returns how many.
        After a failed step: pages it indexed may never have been written."""
        dropped = 0
        for g in self.groups:
            pool = self.pages.pool(g.index)
            cap, before = pool.cache_cap, pool.num_cached_pages()
            pool.set_cache_cap(0)
            pool.set_cache_cap(cap)
            dropped += before - pool.num_cached_pages()
        return dropped

    def free_pages(self) -> list[int]:
        """Pages each group's pool can still hand out within its capacity: free plus evictable
        cached plus not yet materialized (what admission and preemption reason about)."""
        return [self.pages.pool(g.index).num_free_pages() + self.pages.pool(g.index).num_unmaterialized_pages()
                for g in self.groups]

    # -- growth (state/paged/growth.py) --------------------------------------

    @property
    def materialized(self) -> list[int]:
        """Pages (null page included) each group has storage for now."""
        return [self.pages.pool(g.index).materialized for g in self.groups]

    def grow(self, to: int | Sequence[int]) -> bool:
        """Materialize each group up to ``to`` pages (one int for every group, or one per group;
        a group already that large is left as it is). Returns whether anything grew.

        Every allocated layer's storage grows first, one layer at a time (each evaluated before
        the next, so the transient is one layer's old and new arrays, not the whole pool's),
        then the pool hands out the new ids. Written pages keep their ids and contents.

        Raises:
            MlxInferError: a size above a group's capacity.
        """
        targets = [to] * len(self.groups) if isinstance(to, int) else list(to)
        if len(targets) != len(self.groups):
            raise MlxInferError(f"grow() got {len(targets)} sizes for {len(self.groups)} layer groups.")
        grew = False
        for g, t in zip(self.groups, targets):
            pool = self.pages.pool(g.index)
            if t > pool.num_pages:
                raise MlxInferError(f"Cannot grow layer group {g.index} to {t} pages: its capacity is "
                                    f"{pool.num_pages} (null page included).")
            if t <= pool.materialized:
                continue
            for layer in g.layers:
                if self.storage[layer] is not None:
                    self.storage[layer].grow(t)
            self.pages.grow(g.index, t)
            grew = True
        if grew:
            self.growths += 1
            mx.clear_cache()  # the old arrays' buffers go back to the device, not to MLX's cache
        return grew

    def ensure_free(self, need: Sequence[int]) -> bool:
        """Grow (by :attr:`growth`) each group whose free materialized pages are fewer than
        ``need[g]``, where its capacity can cover it; returns whether anything grew.

        A group whose capacity is short too is left as it is: the append fails there, and
        the caller frees pages (preempts) as it would with every page materialized.
        """
        if self.growth is None:
            return False
        targets = []
        for g, n in zip(self.groups, need):
            pool = self.pages.pool(g.index)
            free = pool.num_free_pages()
            short = n - free
            fits = n <= free + pool.num_unmaterialized_pages()
            targets.append(self.growth.target(pool.materialized, short, pool.num_pages)
                           if short > 0 and fits else pool.materialized)
        return self.grow(targets)

    def append(self, seq_id: int, n: int) -> list | None:
        """``pages.append(seq_id, n)``, growing the storage first where the materialized pages
        are short (:meth:`ensure_free`); ``None`` when the capacity is."""
        out = self.pages.append(seq_id, n)
        if out is None and self.ensure_free(self.pages.pages_needed([seq_id], [n])):  # exact: released already
            out = self.pages.append(seq_id, n)
        return out

    def append_batch(self, seq_ids: list[int], counts: list[int], *, table_bucket: int = 1,
                     row_bucket: int = 1) -> Any:
        """``pages.append_batch(...)`` (one step's plan), growing as :meth:`append` does."""
        plan = self.pages.append_batch(seq_ids, counts, table_bucket=table_bucket, row_bucket=row_bucket)
        if plan is None and self.ensure_free(self.pages.pages_needed(seq_ids, counts)):
            plan = self.pages.append_batch(seq_ids, counts, table_bucket=table_bucket, row_bucket=row_bucket)
        return plan

    # -- sequences ----------------------------------------------------------

    def add_sequence(self, prompt_ids: Sequence[int] | None = None, *, namespace: str = "") -> PagedSequence:
        """Start a sequence; with ``prompt_ids``, reuse the longest cached prefix every group can serve.

        Returns:
            The sequence; ``seq.cached_tokens`` prompt tokens are already in
            place, and the caller runs ``prompt_ids[seq.cached_tokens:]``.
        """
        seq_id = self._next_id
        self._next_id += 1
        cached = 0
        if prompt_ids is None:
            self.pages.add_sequence(seq_id, namespace=namespace)
        else:
            cached = self.pages.add_sequence_with_prefix(seq_id, list(prompt_ids), namespace=namespace)
        seq = PagedSequence(self, seq_id, [cached] * self.num_layers, cached)
        self._live[seq_id] = seq
        return seq

    def sequence(self, seq_id: int) -> PagedSequence:
        """The live sequence with this id."""
        if seq_id not in self._live:
            raise MlxInferError(f"Unknown paged sequence id {seq_id} (never added, or already freed).")
        return self._live[seq_id]

    def _fork(self, seq: PagedSequence) -> PagedSequence:
        new_id = self._next_id
        self._next_id += 1
        self.pages.fork(seq.seq_id, new_id)
        child = PagedSequence(self, new_id, list(seq.offsets), seq.cached_tokens)
        self._live[new_id] = child
        return child

    def _free(self, seq: PagedSequence) -> None:
        self.pages.free(seq.seq_id)
        seq.freed = True
        self._live.pop(seq.seq_id, None)

    def make_cache(self, seq: PagedSequence | int) -> list[PagedLayerCache]:
        """One cache per layer for ``seq``, as ``model.make_cache()`` returns."""
        if isinstance(seq, int):
            seq = self.sequence(seq)
        seq._live("make a cache")
        return [PagedLayerCache(seq, i) for i in range(self.num_layers)]

    def batch(self, seqs: Sequence[PagedSequence]) -> PagedBatch:
        """A batched view: ``model(tokens (B, N), cache=store.batch(seqs).caches)``."""
        return PagedBatch(self, list(seqs))

    # -- storage ------------------------------------------------------------

    def _storage(self, layer: int, keys: mx.array, values: mx.array) -> LayerStorage:
        s = self.storage[layer]
        if s is None:
            scheme = self.scheme[layer]
            scheme.check(layer=layer, head_dim=keys.shape[-1])
            scheme.check(layer=layer, head_dim=values.shape[-1])
            group = self.groups[self.layer_group[layer]]
            s = LayerStorage(scheme, num_pages=self.pages.pool(group.index).materialized, page_size=self.page_size,
                             kv_heads=keys.shape[1], k_dim=keys.shape[-1], v_dim=values.shape[-1],
                             dtype=self.dtype or keys.dtype)
            self.storage[layer] = s
        return s

    def group_page_bytes(self, group: int) -> int:
        """Bytes of one page of ``group`` over its allocated layers."""
        return sum(self.storage[i].page_bytes for i in self.groups[group].layers if self.storage[i] is not None)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in every allocated layer (one page of each group)."""
        return sum(s.page_bytes for s in self.storage if s is not None)

    @property
    def nbytes(self) -> int:
        """Bytes of the allocated storage (every materialized page of each group, every allocated layer)."""
        return sum(s.nbytes for s in self.storage if s is not None)

    @property
    def used_bytes(self) -> int:
        """Bytes of the pages some sequence references (shared pages counted once)."""
        return sum(self.pages.pool(g.index).num_used_pages() * self.group_page_bytes(g.index) for g in self.groups)


class PagedModel:
    """A graph whose ``make_cache()`` opens a sequence in a :class:`PagedKVStore`.

    Drop-in for the plain graph wherever only ``make_cache``, ``__call__`` and
    attribute access are used (e.g. ``generate_tokens``). A sequence opened
    here is freed when its cache list is garbage-collected.
    """

    def __init__(self, model: Any, store: PagedKVStore, *, namespace: str = ""):
        self.inner = model
        self.store = store
        self.namespace = namespace

    def make_cache(self) -> list[PagedLayerCache]:
        seq = self.store.add_sequence(namespace=self.namespace)
        caches = _CacheList(self.store.make_cache(seq))
        caches.seq = seq
        weakref.finalize(caches, seq.free)
        return caches

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _CacheList(list):
    """A list that can carry its sequence and be weakly referenced."""

    seq: PagedSequence
