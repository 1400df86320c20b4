"""When a paged store's storage grows, and to what size: the one place of that policy.

A layer group's pool has a *capacity* (``num_pages``: the cap admission and preemption
treat as the limit, sized from the device or given) and a *materialized* size, the pages
whose storage exists; only those ids are handed out. The store materializes more when
what is about to be appended exceeds the free materialized pages (free plus evictable
cached), never beyond the capacity::

    capacity 4096    materialized 192                            used 180, free 12
    a step needs 40 pages  -> short 28
    target = round_up((192 + 28) x (1 + headroom 0.25), granule 16) = 288, min(capacity)
    storage: every layer's arrays grow to 288 pages (zeros appended, layer by layer);
    pool: ids 192..287 join the free queue; ids below 192 (and their K/V) are untouched

The engine asks twice: once per admission, for the pages its prefilling requests still
need (a burst of prompts grows once, before the step that starts them), and on an append
that comes up short (a step's decode rows crossing into new pages).

So a growth adds at least ``headroom`` of what is held: from ``m0`` pages to ``m``
takes at most ``log(m / m0) / log(1 + headroom)`` growths (plus one per granule step
at the small end), and at most ``headroom`` (plus a granule) of the materialized
storage is idle after one. Each growth changes the storage's shape, so the compiled
paged step traces again once per growth (per batch shape it then sees).

Cached (freed, still indexed) prefix pages are evicted before the storage grows: the
prefix cache lives in the materialized pages, and memory follows the running work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ... import defaults
from ...errors import MlxInferError


@dataclass(frozen=True)
class PoolGrowth:
    """How a :class:`~mlx_infer.state.paged.PagedKVStore` grows its materialized pages.

    Args:
        headroom: a growth materializes what is needed plus this share more (>= 0).
        granule: materialized sizes are rounded up to a multiple of this many pages (>= 1).

    Raises:
        MlxInferError: a negative or non-finite headroom, or a granule that is not a positive integer.
    """

    headroom: float = defaults.KV_GROWTH_HEADROOM
    granule: int = defaults.KV_GROWTH_GRANULE

    def __post_init__(self) -> None:
        if isinstance(self.headroom, bool) or not isinstance(self.headroom, (int, float)) or not (
                math.isfinite(self.headroom) and self.headroom >= 0):
            raise MlxInferError(f"PoolGrowth.headroom must be a finite number >= 0, got {self.headroom!r}.")
        if isinstance(self.granule, bool) or not isinstance(self.granule, int) or self.granule < 1:
            raise MlxInferError(f"PoolGrowth.granule must be a positive integer (pages), got {self.granule!r}.")

    def round(self, pages: int, capacity: int) -> int:
        """``pages`` rounded up to the granule, within ``[2, capacity]``."""
        return max(2, min(capacity, -(-pages // self.granule) * self.granule))

    def target(self, materialized: int, short: int, capacity: int) -> int:
        """The materialized size after growing for ``short`` pages more than are free.

        ``(materialized + short) x (1 + headroom)``, rounded up to the granule, at most
        ``capacity``; ``materialized`` itself when nothing is short (growth never shrinks).
        """
        if short <= 0:
            return materialized
        need = materialized + short
        return max(materialized, self.round(math.ceil(need * (1 + self.headroom)), capacity))

    def initial(self, capacity: int) -> int:
        """The pages to materialize at first: one granule (the null page included), at most
        ``capacity``. Admission grows for what it admits before any step runs, so the start only
        has to be small."""
        return self.round(self.granule, capacity)
