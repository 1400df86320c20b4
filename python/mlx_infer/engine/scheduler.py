"""Admission, preemption and page release: the third paging layer (DESIGN.md, convention 3).

The pool hands out pages; each sequence grows page by page; the scheduler
decides who may hold pages at all::

    waiting (FIFO)             running (admission order)          pool
    [r7, r8, r9]  --admit-->   [r1 r2 r3 r4 r5 r6]               free + cached pages
                  <-preempt--  youngest first (r6, then r5 ...)

    admit head while: running < max_batch
                      in every layer group (global; each sliding window):
                      free pages - pages promised to prefilling requests
                          >= pages it holds for prompt + 1 + one per running request
                      (a windowed group holds only its window plus a prefill chunk)
                      (optionally) MLX active memory <= a limit
    grow              a store that grows its storage on demand materializes, once per
                      admission, what the prefilling requests still need plus one page per
                      running request (the pool's capacity, not its materialized pages, is
                      the limit above)
    preempt (recompute): register the victim's full pages in the prefix
                      index, free its sequence, put it back at the head of
                      the queue; on re-admission its prompt + generated tokens
                      are prefilled again, through whatever cached pages
                      survived.

The head of the queue blocks the rest (no overtaking), so a long prompt is
never starved by a stream of short ones. A head whose first page a running prompt is still
prefilling waits for that prefill, then reuses its indexed pages (``n`` choices share their
prompt's pages).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

import mlx.core as mx

from ..state.paged import PagedKVStore, PagedLayerCache, PagedSequence
from .request import EngineRequest, RequestHandle

WAITING, PREFILL, DECODE, DONE = "waiting", "prefill", "decode", "done"


class LiveRequest:
    """The engine's state of one request between submit and finish.

    ``all_ids`` is prompt + generated tokens. While running, the first
    ``prefilled`` of them are in the sequence's pages; once prefill is done
    the decode step feeds ``next_input`` (the last token: a host int, or a
    row of the previous step's lazy token array).
    """

    def __init__(self, request: EngineRequest, handle: RequestHandle, order: int, limit: int):
        self.request = request
        self.handle = handle
        self.order = order  # submit order
        self.limit = limit  # tokens this request may generate
        self.all_ids: list[int] = list(request.prompt_ids)
        self.prompt_len = len(self.all_ids)
        self.state = WAITING
        self.seq: PagedSequence | None = None
        self.caches: list[PagedLayerCache] | None = None
        self.prefilled = 0
        self.next_input: int | tuple[mx.array, int] | None = None
        self.cached_tokens: int | None = None  # set at first admission
        self.admitted_at = 0  # admission counter (preemption picks the largest)
        self.preemptions = 0
        # Set on the engine thread at intake.
        self.sampler: Any = None
        self.rng: Any = None
        self.text_out: Any = None  # generation/text_output.py TextOutput: detokenizer + stop strings
        self.simple = False  # greedy, no processors, no logprobs: one batched argmax
        self.needs_history = False
        self.constraint: Any = None  # the request's ConstraintState (compiled at submit)
        self.prompt_scores: Any = None  # (logprobs, tops, ranks) per prompt position (engine/prompt_scores.py)
        self.text: list[str] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.t_submit = 0.0
        self.t_first: float | None = None
        self.t_last: float | None = None  # when its last token was read out of a step (inter-token latency)

    @property
    def generated(self) -> int:
        return len(self.all_ids) - self.prompt_len

    def __repr__(self) -> str:
        return f"LiveRequest({self.request.request_id[:8]}, {self.state}, {len(self.all_ids)} ids)"


class Scheduler:
    """Queue and running set over one :class:`PagedKVStore`.

    Args:
        store: the page store.
        max_batch: most running requests.
        prefix_cache: add sequences through the prefix index and register
            their full pages when they are released.
        memory_limit: admit nobody new while MLX's active memory exceeds this
            (bytes; ``None``, the default, disables the check: the pool's size
            already bounds the KV).
        on_admit: called with each admitted request (metrics).
        prefill_step: prompt tokens per prefill chunk (bounds what a windowed
            group holds while prefilling); ``None``: the whole prompt at once.
    """

    def __init__(self, store: PagedKVStore, *, max_batch: int, prefix_cache: bool = True,
                 memory_limit: int | None = None, on_admit: Callable[[LiveRequest], None] | None = None,
                 prefill_step: int | None = None):
        self.store = store
        self.prefill_step = prefill_step
        self.max_batch = max_batch
        self.prefix_cache = prefix_cache
        self.memory_limit = memory_limit
        self.on_admit = on_admit
        self.waiting: deque[LiveRequest] = deque()
        self.running: list[LiveRequest] = []
        self._admissions = 0

    @property
    def capacity_pages(self) -> int:
        """Pages a sequence can ever hold in group 0 (the global layers'; null page excluded)."""
        return self.store.groups[0].num_pages - 1

    def pages_for(self, tokens: int) -> int:
        """Pages of group 0 (every page, when it is the global group) for ``tokens`` tokens."""
        return self.group_pages(tokens)[0]

    def group_pages(self, tokens: int) -> list[int]:
        """Pages each layer group holds at most for a sequence of ``tokens`` tokens."""
        return self.store.pages_to_hold(tokens, self.prefill_step)

    def fits(self, tokens: int) -> bool:
        """Whether a sequence of ``tokens`` tokens fits every group's pool alone."""
        return all(need <= g.num_pages - 1 for need, g in zip(self.group_pages(tokens), self.store.groups))

    def enqueue(self, live: LiveRequest) -> None:
        self.waiting.append(live)

    def admit(self) -> tuple[list[LiveRequest], list[LiveRequest]]:
        """Admit from the head of the queue while pages, batch room and memory allow.

        Returns:
            ``(admitted, unfit)``: ``unfit`` are requests that cannot fit the
            pool even alone (a preempted request that grew to the pool's size);
            they are out of the queue and the caller finishes them.
        """
        admitted: list[LiveRequest] = []
        unfit: list[LiveRequest] = []
        while self.waiting and len(self.running) < self.max_batch:
            live = self.waiting[0]
            need = self.group_pages(len(live.all_ids) + 1)
            if not self.fits(len(live.all_ids) + 1):
                unfit.append(self.waiting.popleft())
                continue
            if self._prefix_pending(live):
                break  # its first pages are being computed by a running prompt: reuse them once indexed
            free, promised = self.store.free_pages(), self._promised()
            if any(f - p < n + len(self.running) for f, p, n in zip(free, promised, need)):
                break
            if (self.memory_limit is not None and self.running
                    and mx.get_active_memory() > self.memory_limit):
                break
            self.waiting.popleft()
            self._start(live)
            admitted.append(live)
        if admitted:  # one growth for the whole admission (state/paged/growth.py), not one per step
            self.store.ensure_free([p + len(self.running) for p in self._promised()])
        return admitted, unfit

    def _prefix_pending(self, live: LiveRequest) -> bool:
        """Whether a running request is still prefilling ``live``'s first page (same namespace).

        Requests with one prompt (``n`` choices, a batch of lm-eval prompts on one context) then
        share its pages: the later one is admitted once the first's prefill has indexed them,
        instead of computing the same prefix beside it.
        """
        P = self.store.page_size
        if (not self.prefix_cache or len(live.all_ids) <= P
                or getattr(live.request, "prompt_logprobs", None) is not None):  # a scorer computes all anyway
            return False
        head = live.all_ids[:P]
        return any(r.state == PREFILL and r.request.namespace == live.request.namespace and r.all_ids[:P] == head
                   for r in self.running)

    def _promised(self) -> list[int]:
        """Pages of each group admitted requests still need to finish their prefill (not allocated yet)."""
        out = [0] * len(self.store.groups)
        pages = self.store.pages
        for r in self.running:
            if r.state == PREFILL and r.seq is not None:
                for g, need in enumerate(self.group_pages(len(r.all_ids) + 1)):
                    out[g] += max(0, need - pages.held_pages(r.seq.seq_id, g))
        return out

    def _start(self, live: LiveRequest) -> None:
        ids = live.all_ids
        # A request scoring its prompt computes every position: no prefix hit (engine/prompt_scores.py).
        reuse = self.prefix_cache and getattr(live.request, "prompt_logprobs", None) is None
        seq = self.store.add_sequence(ids if reuse else None, namespace=live.request.namespace)
        live.seq = seq
        live.caches = self.store.make_cache(seq)
        live.prefilled = seq.cached_tokens
        self._admissions += 1
        live.admitted_at = self._admissions
        if live.cached_tokens is None:
            live.cached_tokens = seq.cached_tokens
            if self.on_admit is not None:
                self.on_admit(live)
        if live.prefilled >= len(ids) - 1:
            live.state = DECODE
            live.next_input = ids[-1]
        else:
            live.state = PREFILL
        self.running.append(live)

    def youngest(self) -> LiveRequest | None:
        """The running request admitted last (the preemption victim)."""
        return max(self.running, key=lambda r: r.admitted_at, default=None)

    def preempt(self, live: LiveRequest) -> None:
        """Free ``live``'s pages (recompute later) and put it at the head of the queue."""
        self.release(live)
        live.state = WAITING
        live.next_input = None
        live.preemptions += 1
        self.waiting.appendleft(live)

    def release(self, live: LiveRequest) -> None:
        """Take ``live`` out of the running set and free its sequence, indexing its full pages first."""
        if live in self.running:
            self.running.remove(live)
        else:
            try:
                self.waiting.remove(live)
            except ValueError:
                pass
        seq = live.seq
        live.seq = live.caches = None
        live.prefilled = 0
        if seq is None or seq.freed:
            return
        try:
            if self.prefix_cache:
                fed = min(seq.length, len(live.all_ids))
                if fed >= self.store.page_size:
                    seq.register(live.all_ids[:fed])
        finally:
            seq.free()

    def register_prompt(self, live: LiveRequest, tokens: int) -> None:
        """Index the full pages of the first ``tokens`` ids (done after prefill)."""
        if self.prefix_cache and live.seq is not None and tokens >= self.store.page_size:
            live.seq.register(live.all_ids[:tokens])
