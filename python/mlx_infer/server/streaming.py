"""Several choices in one SSE stream (``n > 1``, prompt arrays): their chunk streams merged; and the
server's own latency to a stream's first chunk.

Each choice's chunks keep their order and carry their ``index``; choices interleave as
their tokens arrive, as OpenAI's and vLLM's streams do.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, TypeVar

from ..engine.metrics import TTFT_BUCKETS_S, Histogram, prometheus_text

T = TypeVar("T")
_END = object()


async def merge(sources: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Items of every source as they come; ends when all have ended. A source's error is
    raised here (the others are cancelled); closing this generator cancels them all. One source
    (the common request: one prompt, ``n`` = 1) is iterated directly: no pump task and queue hop
    per token."""
    if len(sources) == 1:
        try:
            async for item in sources[0]:
                yield item
        finally:  # closed early (client gone): close the source now, as cancelling its pump did
            close = getattr(sources[0], "aclose", None)
            if close is not None:
                await close()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(src: AsyncIterator[T]) -> None:
        try:
            async for item in src:
                queue.put_nowait((item, None))
        except Exception as e:  # handed to the consumer
            queue.put_nowait((_END, e))
            return
        queue.put_nowait((_END, None))

    tasks = [asyncio.ensure_future(pump(s)) for s in sources]
    try:
        left = len(tasks)
        while left:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is _END:
                left -= 1
                continue
            yield item
    finally:
        for t in tasks:
            t.cancel()


class FirstChunkTimer:
    """``http_time_to_first_chunk_seconds``: a streamed request's arrival at its endpoint (its body parsed) to its
    first SSE data chunk handed to the server, in the server's process. For a completion that chunk carries the
    first token; a chat stream's first chunk is its role chunk, sent once the request is submitted. Beside the
    engine's ``time_to_first_token_seconds`` (the engine's own share) and a client's TTFT (the loopback's and the
    client's on top), it locates where a first token's time goes. Used on the event loop's thread only."""

    def __init__(self) -> None:
        self.histogram = Histogram(TTFT_BUCKETS_S)

    def observe_since(self, t0: float) -> None:
        self.histogram.observe(time.perf_counter() - t0)

    def prometheus(self) -> str:
        return prometheus_text({"http_time_to_first_chunk_seconds": self.histogram.snapshot()})
