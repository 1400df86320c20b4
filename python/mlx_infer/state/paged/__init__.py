"""Paged KV state over :mod:`mlx_infer._fast`: the cache protocol on pages.

Layout (page_size 4, one layer shown; every layer of one layer group has the
same block tables)::

    PagePool (C++)                              storage per layer (MLX arrays)
    ---------------------------------           ------------------------------------
    seq A  len 10  table [1, 2, 3]              K, V: (pages, kv_heads, page_size, D)
    seq B  len 10  table [1, 2, 4]                page 0 null   [.  .  .  . ]
           (forked from A at len 9)               page 1 A,B    [t0 t1 t2 t3]  refcount 2
                                                  page 2 A,B    [t4 t5 t6 t7]  refcount 2
    token t of a sequence lives at                page 3 A      [t8 t9 .  . ]
      slot = table[t // 4] * 4 + t % 4            page 4 B      [t8 u9 .  . ]  B's write of u9
                                                                               copied page 3 first
    one step (N new tokens):
      pages.append(seq, N) -> per group: copies, slots    once per step
      per layer: its group's copies and slots, scatter K/V, gather -> attention

Layer groups: the global layers share one pool, the layers of each sliding
window another (``PageGroups`` in C++), so a windowed group releases the pages
behind its window (keeping ``window_slack`` more tokens for rollback) while
the global group keeps them all.

Public API: :class:`PagedKVStore` (``add_sequence``, ``make_cache``, ``batch``),
:class:`PagedSequence` (``reserve``, ``fork``, ``truncate``, ``register``,
``free``), :class:`PagedLayerCache`, :class:`PagedBatch`, :class:`PagedModel`,
:class:`LayerKV` and :func:`load_kv_config` for quantized / mixed schemes.
"""

from .batch_cache import PagedBatch, PagedBatchLayerCache
from .scheme import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, LayerKV, load_kv_config, uniform_scheme
from .sequence import PagedKVExhausted, PagedLayerCache, PagedSequence
from .store import DEFAULT_PAGE_SIZE, DEFAULT_WINDOW_SLACK, LayerGroup, PagedKVStore, PagedModel, model_geometry

__all__ = [
    "DEFAULT_PAGE_SIZE", "DEFAULT_WINDOW_SLACK", "SUPPORTED_BITS", "SUPPORTED_GROUP_SIZES", "LayerGroup",
    "LayerKV", "PagedBatch",
    "PagedBatchLayerCache", "PagedKVExhausted", "PagedKVStore", "PagedLayerCache", "PagedModel",
    "PagedSequence", "load_kv_config", "model_geometry", "uniform_scheme",
]
