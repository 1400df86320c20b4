"""Continuous batching over the paged KV store.

:class:`Engine` owns one model, its :class:`~mlx_infer.state.paged.PagedKVStore`
and a thread that interleaves chunked prefill of joining requests with
batched decode of running ones. Submit an :class:`EngineRequest`, get a
:class:`RequestHandle` (callback, iterator, async iterator, result).
"""

from .config import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MEMORY_BUDGET_GB,
    DEFAULT_PAGE_SIZE,
    EngineConfig,
    kv_page_bytes,
    pool_pages,
)
from .engine import Engine, EngineClosedError, QueueFullError, RequestTooLargeError
from .metrics import EngineMetrics, prometheus_text
from .request import DEFAULT_MAX_TOKENS, FINISH_REASONS, EngineRequest, RequestHandle, RequestResult, TokenEvent

__all__ = [
    "DEFAULT_MAX_BATCH", "DEFAULT_MAX_TOKENS", "DEFAULT_MEMORY_BUDGET_GB", "DEFAULT_PAGE_SIZE", "FINISH_REASONS",
    "Engine", "EngineClosedError", "EngineConfig", "EngineMetrics", "EngineRequest", "QueueFullError",
    "RequestHandle", "RequestResult", "RequestTooLargeError", "TokenEvent", "kv_page_bytes", "pool_pages",
    "prometheus_text",
]
