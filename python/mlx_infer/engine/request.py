"""What a caller hands the engine and what it gets back.

A caller submits an :class:`EngineRequest` and receives a
:class:`RequestHandle`. The engine thread delivers one :class:`TokenEvent` per
generated token (plus a final token-less event when a request is cancelled or
fails); it is the event type ``generate`` yields too (defined in
:mod:`mlx_infer.generation.text_output`, re-exported here), with ``request_id``
set. The handle hands them out three ways, all usable at once:

- a callback (``on_token``), called on the engine thread (keep it quick);
- a blocking iterator (``for ev in handle``) and :meth:`RequestHandle.result`;
- an async iterator (``async for ev in handle``) and :meth:`RequestHandle.aresult`.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

from .. import defaults
from ..errors import MlxInferError
from ..generation.text_output import TokenEvent
from ..sampling import SamplingParams

DEFAULT_MAX_TOKENS = defaults.MAX_TOKENS

#: Why a request ended: EOS or a stop string, the token limit, the caller, or an engine failure.
FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass(frozen=True, kw_only=True)
class EngineRequest:
    """One generation request.

    Args:
        prompt_ids: the prompt's token ids (non-empty).
        sampling: the request's own sampling parameters (seed and logprobs included).
        max_tokens: the most tokens to generate (>= 1).
        stop: stop strings; the text ends before the first match.
        request_id: a caller-chosen id (default: a fresh one).
        namespace: prefix-cache namespace (requests share cached pages only within one).
        ignore_eos: keep generating past EOS (benchmarks: every request makes ``max_tokens``).
        detokenize: produce text (``False``: token ids only, for clients that decode
            themselves; no stop strings then).
        constraint: a :class:`~mlx_infer.constraints.Constraint` the output must satisfy
            (JSON schema, regex, choice, grammar); the request ends when it is complete.
        skip_special_tokens: special tokens (``<pad>``, added tokens marked special) add no
            text (vLLM's field; the server's default is ``True``, as vLLM's).
        spaces_between_special_tokens: vLLM's field (see
            :class:`~mlx_infer.input.tokenizer.StreamingDetokenizer`); ``True`` by default.
        prompt_logprobs: score the prompt (vLLM's field): each prompt token's teacher-forced
            logprob and this many most likely alternatives (0..20), computed by the prefill over
            the request's own pages (engine/prompt_scores.py); ``None``: not scored.
        adapter: the name of an adapter in the model's bank (:mod:`mlx_infer.adapters`) this
            request runs under; ``None``: the model's default adapter, if any.
    """

    prompt_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: Sequence[str] = ()
    request_id: str = ""
    namespace: str = ""
    ignore_eos: bool = False
    detokenize: bool = True
    constraint: Any = None
    skip_special_tokens: bool = False
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    adapter: str | None = None

    def __post_init__(self) -> None:
        ids = list(self.prompt_ids)
        if not ids:
            raise MlxInferError("The prompt is empty: give at least one token.")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise MlxInferError("prompt_ids must be non-negative integer token ids.")
        object.__setattr__(self, "prompt_ids", tuple(ids))
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise MlxInferError(f"max_tokens must be a positive integer, got {self.max_tokens!r}.")
        if not isinstance(self.sampling, SamplingParams):
            raise MlxInferError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}.")
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise MlxInferError(f"stop strings must be non-empty strings, got {s!r}.")
        object.__setattr__(self, "stop", stops)
        if stops and not self.detokenize:
            raise MlxInferError("stop strings need detokenize=True (they match the generated text).")
        if not self.request_id:
            object.__setattr__(self, "request_id", uuid.uuid4().hex)
        k = self.prompt_logprobs
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 20):
            raise MlxInferError(f"prompt_logprobs must be an integer in 0..20 (or None), got {k!r}.")


@dataclass
class RequestResult:
    """A finished request.

    Attributes:
        request_id: the request.
        prompt_tokens: prompt length.
        cached_tokens: prompt tokens reused from the prefix cache (first admission).
        token_ids: every generated id (EOS included when it ended the request).
        text: the generated text (stop string and EOS excluded).
        finish_reason: one of :data:`FINISH_REASONS`.
        logprobs: per token, with ``sampling.logprobs``.
        top_logprobs: per token, with ``sampling.top_logprobs``.
        preemptions: times the request lost its pages and was recomputed.
        ttft_ms: submit to first token.
        total_ms: submit to finish.
        error: what failed, when ``finish_reason == "error"``.
        forced_tokens: generated tokens the request's constraint forced (see engine/grammar_jump.py).
        prompt_logprobs: the prompt's scores with ``EngineRequest.prompt_logprobs``
            (a :class:`~mlx_infer.engine.prompt_scores.PromptLogprobs`), else ``None``.
    """

    request_id: str
    prompt_tokens: int
    cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    preemptions: int = 0
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    error: str | None = None
    forced_tokens: int = 0
    prompt_logprobs: Any = None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


#: Put in an async iterator's queue by :meth:`RequestHandle.interrupt`: the iterator ends there.
_INTERRUPT: Any = object()


def _put_all(items: list[tuple[asyncio.Queue, TokenEvent]]) -> None:
    for q, event in items:
        q.put_nowait(event)


def wake(wakeups: dict) -> None:
    """Deliver collected async events: one wake-up per event loop (see ``RequestHandle._deliver``)."""
    for loop, items in wakeups.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the consumer's loop is closed: nobody listens
            pass


class RequestHandle:
    """The caller's side of a submitted request (see the module docstring).

    Created by :meth:`mlx_infer.engine.Engine.submit`; thread-safe.
    """

    def __init__(self, request: EngineRequest, cancel: Callable[[str], None],
                 on_token: Callable[[TokenEvent], None] | None = None):
        self.request = request
        self.request_id = request.request_id
        self._cancel = cancel
        self._on_token = on_token
        self._cond = threading.Condition()
        self._waiters = 0  # blocking iterators: only they need a notify per token
        self._done = threading.Event()
        self._events: list[TokenEvent] = []
        self._result: RequestResult | None = None
        self._queues: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, bool]] = []  # (loop, q, interruptible)
        self._interrupted = False  # interrupt(): the async iterators end without a final event
        #: With ``request.prompt_logprobs``: the prompt's scores, set before the first token's event.
        self.prompt_logprobs: Any = None

    # -- engine side --------------------------------------------------------

    def _deliver(self, event: TokenEvent, result: RequestResult | None = None,
                 wakeups: dict | None = None) -> None:
        """Hand ``event`` to the callback, the blocking iterators and the async iterators.

        With ``wakeups``, async deliveries are collected per event loop instead of
        waking each loop once per event; :func:`wake` then wakes each loop once.
        """
        if self._on_token is not None:
            try:
                self._on_token(event)
            except Exception:  # a broken callback must not take the engine down
                pass
        with self._cond:
            self._events.append(event)
            if result is not None:
                self._result = result
            if self._waiters:
                self._cond.notify_all()
            queues = list(self._queues)
        if result is not None:
            self._done.set()
        for loop, q, _ in queues:
            if wakeups is not None:
                wakeups.setdefault(loop, []).append((q, event))
                continue
            try:
                loop.call_soon_threadsafe(q.put_nowait, event)
            except RuntimeError:  # the consumer's loop is closed: nobody listens
                pass

    # -- caller side ----------------------------------------------------------

    def cancel(self) -> None:
        """Stop the request; its pages are freed at the engine's next iteration."""
        if not self.done:
            self._cancel(self.request_id)

    def interrupt(self) -> None:
        """End the async iterators (:meth:`batches`, ``async for``) now, after the events already
        delivered and without waiting for a final one: the server's shutdown ends a stream whose engine
        has not answered its cancel yet this way, with no per-event watcher task."""
        with self._cond:
            self._interrupted = True
            queues = list(self._queues)
        for loop, q, interruptible in queues:
            if not interruptible:
                continue
            try:
                loop.call_soon_threadsafe(q.put_nowait, _INTERRUPT)
            except RuntimeError:  # the consumer's loop is closed: nobody listens
                pass

    @property
    def done(self) -> bool:
        """Whether the final event was delivered."""
        return self._result is not None

    def result(self, timeout: float | None = None) -> RequestResult:
        """Block until the request ends; return its :class:`RequestResult`.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
        """
        if self._result is not None:  # set before the final event is delivered anywhere
            return self._result
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        return self._result  # type: ignore[return-value]

    def __iter__(self) -> Iterator[TokenEvent]:
        i = 0
        while True:
            with self._cond:
                self._waiters += 1
                try:
                    self._cond.wait_for(lambda: len(self._events) > i)
                finally:
                    self._waiters -= 1
                event = self._events[i]
            i += 1
            yield event
            if event.finish_reason is not None:
                return

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        batches = self.batches()
        try:
            async for events in batches:
                for event in events:
                    yield event
        finally:  # closed early: stop listening now, not when the inner generator is collected
            await batches.aclose()

    async def batches(self, interruptible: bool = True) -> AsyncIterator[list[TokenEvent]]:
        """The events in order, as lists: each holds every event that had arrived when the
        consumer asked (one when it keeps up, more when it lags), so a server that streams a list
        as one chunk sends fewer, larger chunks exactly when its event loop falls behind (vLLM's
        output collector merges a slow consumer's outputs the same way). Ends after the final event, or
        (``interruptible``) where :meth:`interrupt` was called."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._cond:
            for ev in self._events:
                q.put_nowait(ev)
            if self._interrupted and interruptible:
                q.put_nowait(_INTERRUPT)
            entry = (loop, q, interruptible)
            self._queues.append(entry)
        try:
            while True:
                first = await q.get()
                if first is _INTERRUPT:  # only ever queued when interruptible
                    return
                events = [first]
                while events[-1].finish_reason is None and not q.empty():
                    ev = q.get_nowait()
                    if ev is _INTERRUPT:
                        yield events
                        return
                    events.append(ev)
                yield events
                if events[-1].finish_reason is not None:
                    return
        finally:
            with self._cond:
                if entry in self._queues:
                    self._queues.remove(entry)

    async def aresult(self) -> RequestResult:
        """Await the :class:`RequestResult` (the final event: :meth:`interrupt` does not end this wait)."""
        async for _ in self.batches(interruptible=False):
            pass
        return self._result  # type: ignore[return-value]

