"""Reuse the KV of earlier calls: a byte-capped LRU of plain caches keyed by tokens.

An entry is the cache a generation ended with and the tokens it holds
(prompt + generated, as fed). A new prompt takes the entry sharing its longest
token prefix: the entry's caches are copied (new array handles, so neither
side's later writes reach the other) and trimmed to the shared prefix when the
caches allow it (a rotating cache that already dropped tokens cannot be
trimmed, so such an entry is only used when it is wholly a prefix). Entries
are namespaced (e.g. by active adapter set): a cache never crosses namespaces.
With paged KV the same job is done by the paged prefix index instead.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

import mlx.core as mx

DEFAULT_PROMPT_CACHE_BYTES = 2 << 30


def copy_cache(cache: list[Any]) -> list[Any]:
    """An independent copy of a per-layer cache list."""
    return [type(c).from_state(tuple(mx.array(x) for x in c.state), c.meta_state) for c in cache]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PromptCache:
    """LRU of ``(namespace, tokens) -> caches`` under a byte cap.

    Args:
        max_bytes: evict least recently used entries beyond this many KV bytes.
    """

    def __init__(self, max_bytes: int = DEFAULT_PROMPT_CACHE_BYTES):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, tuple[int, ...]], list[Any]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        """KV bytes held by all entries."""
        return sum(sum(c.nbytes for c in cache) for cache in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def fetch(self, prompt_ids: Sequence[int], namespace: str = "") -> tuple[list[Any] | None, int]:
        """A copy of the best cache for ``prompt_ids`` and how many prompt tokens it holds.

        At most ``len(prompt_ids) - 1`` tokens are reused, so the last prompt
        token is always computed (it yields the first logits).
        """
        limit = len(prompt_ids) - 1
        best: tuple[int, tuple[str, tuple[int, ...]]] | None = None
        for key, cache in self._entries.items():
            if key[0] != namespace:
                continue
            tokens = key[1]
            n = min(_common_prefix(tokens, prompt_ids), limit)
            if n == 0 or (best is not None and n <= best[0]):
                continue
            if n < len(tokens) and not all(c.is_trimmable() for c in cache):
                continue
            best = (n, key)
        if best is None:
            self.misses += 1
            return None, 0
        n, key = best
        self._entries.move_to_end(key)
        cache = copy_cache(self._entries[key])
        drop = len(key[1]) - n
        if drop:
            for c in cache:
                c.trim(drop)
        self.hits += 1
        return cache, n

    def store(self, tokens: Sequence[int], cache: list[Any], namespace: str = "") -> None:
        """Keep ``cache`` (holding exactly ``tokens``) for later prompts; evicts LRU entries over the cap."""
        if not tokens or not cache:
            return
        key = (namespace, tuple(tokens))
        self._entries[key] = cache
        self._entries.move_to_end(key)
        # An entry that is a prefix of the new one adds nothing: drop it.
        for other in [k for k in self._entries if k != key and k[0] == namespace
                      and len(k[1]) <= len(tokens) and tuple(tokens[: len(k[1])]) == k[1]]:
            del self._entries[other]
        while self._entries and self.nbytes > self.max_bytes:
            self._entries.popitem(last=False)
