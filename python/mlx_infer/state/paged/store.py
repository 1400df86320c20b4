"""The paged KV store of one model: one page pool, per-layer paged storage."""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import mlx.core as mx

from ... import _fast
from ...errors import MlxInferError
from .batch import PagedBatch
from .scheme import LayerKV, load_kv_config, uniform_scheme
from .sequence import PagedLayerCache, PagedSequence
from .storage import LayerStorage

DEFAULT_PAGE_SIZE = 16


def model_geometry(model: Any) -> tuple[list[int | None], int, int]:
    """``(layer windows, kv_heads, head_dim)`` of a graph (``None`` = global layer)."""
    args = model.args
    window = getattr(args, "sliding_window", None)
    windows = [window if getattr(layer, "use_sliding", False) else None for layer in model.layers]
    attn = model.layers[0].self_attn
    return windows, attn.n_kv_heads, attn.head_dim


class PagedKVStore:
    """Paged K/V for every sequence of one model.

    All layers share one :class:`mlx_infer._fast.PagePool` (a token sits at
    the same slot in every layer) and each layer has its own storage, created
    on its first write from the K/V shapes::

        pool (bookkeeping, C++)        storage, per layer (MLX arrays)
        seq 3: block table [5, 2]      K (pages, kv_heads, page_size, D)
        seq 4: block table [5, 7]      V (pages, kv_heads, page_size, D)
                   |                       page 0: null page, never written
        page 5 shared (refcount 2) ------> page 5: tokens 0..P-1 of seqs 3 and 4

    Sliding-window layers read only their window. Pages outside the window
    are released only when every layer is windowed (a global layer of the
    same model still reads them).

    Args:
        num_layers: attention layers.
        num_pages: pages in the pool, the null page included.
        page_size: tokens per page (a power of two).
        layer_windows: sliding window per layer (``None`` = global); default all global.
        dtype: element type of plain storage and of quantization scales;
            ``None`` takes the first write's dtype (the model's).
        kv_scheme: one :class:`LayerKV` per layer, a ``kv_config.json`` path or
            list (see :func:`load_kv_config`), or ``None`` for all plain.
        head_dim: when given, the scheme is checked against it now.
        release_windows: release pages outside the windows when every layer
            is windowed (``False`` keeps them for rollback / prefix reuse).

    Raises:
        ValueError: a page size that is not a power of two, a scheme the model
            cannot use, or a bad ``kv_config``.
    """

    def __init__(self, *, num_layers: int, num_pages: int, page_size: int = DEFAULT_PAGE_SIZE,
                 layer_windows: Sequence[int | None] | None = None, dtype: mx.Dtype | None = None,
                 kv_scheme: Any = None, head_dim: int | None = None, release_windows: bool = True):
        self.pool = _fast.PagePool(num_pages=num_pages, page_size=page_size)
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
        self.storage: list[LayerStorage | None] = [None] * num_layers
        # Every future step reads at most the last w - 1 cached tokens of a window w.
        all_windowed = all(w is not None for w in self.layer_windows)
        self.release_window = (max(max(self.layer_windows) - 1, 1)
                               if release_windows and all_windowed else None)
        self._next_id = 0
        self._live: dict[int, PagedSequence] = {}

    @classmethod
    def for_model(cls, model: Any, *, num_pages: int, page_size: int = DEFAULT_PAGE_SIZE,
                  dtype: mx.Dtype | None = None, kv_scheme: Any = None,
                  release_windows: bool = True) -> "PagedKVStore":
        """A store shaped for ``model`` (its layer count, windows and head_dim)."""
        windows, _, head_dim = model_geometry(model)
        return cls(num_layers=len(windows), num_pages=num_pages, page_size=page_size,
                   layer_windows=windows, dtype=dtype, kv_scheme=kv_scheme, head_dim=head_dim,
                   release_windows=release_windows)

    def __repr__(self) -> str:
        return (f"PagedKVStore(layers={self.num_layers}, sequences={len(self._live)}, "
                f"{self.pool!r})")

    # -- sequences ----------------------------------------------------------

    def add_sequence(self, prompt_ids: Sequence[int] | None = None, *, namespace: str = "") -> PagedSequence:
        """Start a sequence; with ``prompt_ids``, reuse the longest cached prefix.

        Returns:
            The sequence; ``seq.cached_tokens`` prompt tokens are already in
            place, and the caller runs ``prompt_ids[seq.cached_tokens:]``.
        """
        seq_id = self._next_id
        self._next_id += 1
        cached = 0
        if prompt_ids is None:
            self.pool.add_sequence(seq_id, namespace=namespace)
        else:
            cached = self.pool.add_sequence_with_prefix(seq_id, list(prompt_ids), namespace=namespace)
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
        self.pool.fork(seq.seq_id, new_id)
        child = PagedSequence(self, new_id, list(seq.offsets), seq.cached_tokens)
        self._live[new_id] = child
        return child

    def _free(self, seq: PagedSequence) -> None:
        self.pool.free(seq.seq_id)
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
            s = LayerStorage(scheme, num_pages=self.pool.num_pages, page_size=self.page_size,
                             kv_heads=keys.shape[1], k_dim=keys.shape[-1], v_dim=values.shape[-1],
                             dtype=self.dtype or keys.dtype)
            self.storage[layer] = s
        return s

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every allocated layer."""
        return sum(s.page_bytes for s in self.storage if s is not None)

    @property
    def nbytes(self) -> int:
        """Bytes of the allocated storage (every page of the pool, every layer)."""
        return sum(s.nbytes for s in self.storage if s is not None)

    @property
    def used_bytes(self) -> int:
        """Bytes of the pages some sequence references (shared pages counted once)."""
        return self.pool.num_used_pages() * self.page_bytes


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
