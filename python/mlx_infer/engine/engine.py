"""The continuous-batching engine: one thread runs every model step.

An iteration of the engine thread::

    1. intake     new requests join the queue; cancelled ones finish now
                  (their pages go back to the pool before anything else runs)
    2. admit      scheduler: pages, batch room, memory (see scheduler.py)
    3. prefill    up to ``prefill_step_size`` prompt tokens, in chunks of
                  the admitted requests, through the graph's hidden phase;
                  a request whose prompt ends in this chunk gets its first
                  token from the chunk's last position (the LM head on that
                  row only), so time to first token is the prefill's time
    4. decode     one forward of every decoding request, R rows of one token,
                  planned by the C++ page groups in one call (engine/batch.py).
                  The forward is the compiled C++ paged step where the
                  binding allows it (see ``Engine.paged_decode``), else the
                  eager graph; a failing step falls back to eager for good
    5. read       step n-1's tokens are read while step n runs (pipelined);
                  text, stop strings, logprobs, finish; finished requests
                  free their pages at once; first tokens of step 3 are read
                  after this iteration's decode step is queued; tokens a
                  constraint forces next are emitted at once and fed as one
                  prefill chunk by step 3 (engine/grammar_jump.py)

Mixed steps (``EngineConfig.mixed_steps``, engine/mixed.py): while requests
decode, step 3 is skipped and the decode step of 4 carries the prompt chunks
of joining requests as extra rows of its plan, so decode never waits for a
separate prefill forward; the first token then comes from the step that ends
the prompt.

Preemption recomputes (see :mod:`.scheduler`): on unified memory a swap to
"host" memory frees nothing, and registering the victim's pages in the
prefix index lets re-admission reuse whatever was not evicted meanwhile.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Iterable

import mlx.core as mx

from ..errors import MlxInferError, PromptTooLongError
from ..generation.autoregressive import newline_ids
from ..generation.bindings.autoregressive import Composition, bind_autoregressive
from ..generation.bindings.graph_spec import DecodeStepUnsupported
from ..generation.bindings.paged_decode_step import (CompiledPagedDecodeStep, PagedDecodePolicy,
                                                     paged_unsupported_reason)
from ..generation.text_output import token_limit
from ..models import materialize_graph_constants
from ..sampling import RequestRNG, make_sampler
from ..state.paged import PagedKVStore
from .activations import activation_ceiling
from .adapters import AdapterSlotsBusyError, batch_slots, hold_adapter, rows_context, slots_for
from .batch import DecodeBatch
from .config import EngineConfig, initial_pages, kv_budget, pool_growth, pool_pages
from .metrics import PROMETHEUS_ORDER, EngineMetrics, pool_gauges, prometheus_text
from .request import EngineRequest, RequestHandle, RequestResult, TokenEvent
from .mixed import advance, mixed_batch, mixed_inputs, pick_chunks
from .output import consume, emit, finish, text_output
from .prefill import allocate_storage, prefill
from .prompt_scores import wants_scores
from .rows import Step, queue_outputs, sample_rows, step_inputs
from .scheduler import DECODE, DONE, PREFILL, LiveRequest, Scheduler

log = logging.getLogger("mlx_infer.engine")


class RequestTooLargeError(MlxInferError):
    """The prompt cannot fit the KV page pool even with nothing else running."""


class QueueFullError(MlxInferError):
    """The engine's queue is at ``max_queue``; retry later."""



#: Engines whose thread runs (started, not stopped).
_RUNNING: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@atexit.register
def _stop_running_engines() -> None:
    """At interpreter exit, stop every engine still running: its daemon thread inside MLX's eval while
    MLX's statics are destroyed would abort the process ("terminate called without an active exception")."""
    for engine in list(_RUNNING):
        try:
            engine.stop()
        except Exception:  # noqa: BLE001 - exiting: a failed stop must not mask the program's own status
            log.exception("stopping an engine at exit failed")


class EngineClosedError(MlxInferError):
    """The engine was stopped."""


class Engine:
    """Continuous batching over a paged KV store for one loaded model.

    Use it as a context manager (or call :meth:`start` / :meth:`stop`); the
    engine thread then runs iterations while there is work. Without the thread,
    :meth:`step` runs one iteration on the caller's thread.

    Args:
        loaded: the model, tokenizer and facts from :func:`mlx_infer.artifacts.loader.load_model`.
        config: scheduling and memory settings.
        composition: per-run graph choices; ``compiled_decode=False`` keeps the
            batched decode on the eager graph.
        decode_policy: how the compiled paged step compiles (S buckets).

    Attributes:
        store: the :class:`PagedKVStore` every request's pages live in.
        kv_budget: the bytes its pool was sized from and why (``None``: ``num_pages`` was given).
        scheduler: queue and running set.
        metrics: counters (see :meth:`stats`).
        paged_decode: the compiled paged decode step, or ``None`` (eager decode;
            ``paged_decode_reason`` says why).
    """

    def __init__(self, loaded: Any, config: EngineConfig | None = None, *,
                 composition: Composition | None = None, decode_policy: PagedDecodePolicy | None = None):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.config = config = (config or EngineConfig()).for_device()  # the device type's defaults filled in
        self.context_length: int | None = loaded.context_length
        self.eos = frozenset(loaded.eos_token_ids)
        self.newlines = newline_ids(loaded)
        self.vocab_size = int(getattr(self.model.args, "vocab_size", 0)) or None
        materialize_graph_constants(self.model)  # a graph not from the loader: the engine thread evaluates it
        self.kv_budget = None if config.num_pages is not None else kv_budget(self.model, config)
        from ..parallel.engine_rank import leader_value

        sizes = leader_value(self.model, pool_pages(self.model, config, self.context_length, self.kv_budget))
        growth = pool_growth(config)  # the storage grows on demand up to the pool's capacity (sizes)
        self.store = PagedKVStore.for_model(  # a split graph: rank 0's pool size on every rank
            self.model, num_pages=sizes, materialized=initial_pages(sizes, growth), growth=growth,
            page_size=config.page_size, dtype=config.kv_dtype, kv_scheme=config.kv_scheme)
        composition = composition or Composition()
        self.grammar_jump = composition.grammar_jump  # forced spans in one forward (engine/grammar_jump.py)
        self.paged_decode, self.paged_decode_reason = self._paged_decode(
            composition, decode_policy or PagedDecodePolicy())
        self.metrics = EngineMetrics()
        self.scheduler = Scheduler(
            self.store, max_batch=config.max_batch,
            # A prefix hit needs every layer group to hit (a windowed group: the pages of its window).
            prefix_cache=config.prefix_cache,
            memory_limit=None if config.memory_limit_gb is None else int(config.memory_limit_gb * 2**30),
            on_admit=lambda r: self.metrics.admitted(r.prompt_len, r.cached_tokens or 0),
            prefill_step=config.prefill_step_size)
        self._lock = threading.Lock()
        self._inbox: deque[LiveRequest] = deque()
        self._cancels: set[str] = set()
        self._live: dict[str, LiveRequest] = {}
        self._order = 0
        self._inflight: Step | None = None
        self._wakeups: dict | None = None  # set while a step's tokens are handed out
        self._batch: DecodeBatch | None = None
        self._batch_key: tuple[int, ...] = ()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        # The prefill samples each prompt's first token from its own last position when the
        # graph exposes its head; otherwise the decode step feeds the last prompt token.
        self._head = callable(getattr(self.model, "logits_from_hidden", None))
        self._bucket = self.paged_decode.policy.bucket if self.paged_decode is not None else 1
        # Prefill chunks ride in the decode step where attention reads K/V through the tables.
        mixed = config.mixed_steps if config.mixed_steps is not None else mx.default_device().type == mx.DeviceType.gpu
        self._mixing = mixed and self.paged_decode is not None and self.paged_decode.policy.attention == "kernel"
        self.mixed_steps = 0  # steps that carried prefill chunks
        self.separate_prefills = 0  # prompt forwards of their own (the eager graph's; see step())
        self._ceiling = activation_ceiling(self)  # None where activations are not bounded
        self._gauges: dict[str, Any] = {}
        self._update_gauges()
        from ..parallel.engine_rank import attach_lockstep

        self._lockstep = attach_lockstep(self)  # a sharded graph: every rank iterates in lockstep
        if self._mixing and self._lockstep is None:
            self._allocate_storage()

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> "Engine":
        """Start the engine thread (idempotent)."""
        if self._closed:
            raise EngineClosedError("This engine was stopped; create a new one.")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mlx-infer-engine", daemon=True)
            self._thread.start()
            _RUNNING.add(self)
        return self

    def stop(self) -> None:
        """Stop the thread; unfinished requests end with ``"cancelled"`` and free their pages."""
        self._closed = True
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        _RUNNING.discard(self)
        if self._lockstep is not None:
            self._lockstep.finish()
        self._drain()

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- caller API ---------------------------------------------------------

    def submit(self, request: EngineRequest, *, on_token: Callable[[TokenEvent], None] | None = None) -> RequestHandle:
        """Queue ``request``; returns its :class:`RequestHandle` at once.

        Raises:
            PromptTooLongError: the prompt does not fit the model's context window.
            RequestTooLargeError: the prompt needs more KV pages than the pool has.
            QueueFullError: ``max_queue`` requests are already waiting.
            MlxInferError: other bad input (token ids or logit-bias ids outside the vocabulary).
        """
        if self._closed:
            raise EngineClosedError("This engine was stopped; create a new one.")
        n = len(request.prompt_ids)
        if self.context_length is not None and n >= self.context_length:
            raise PromptTooLongError(
                f"The prompt has {n} tokens but the model's context window is {self.context_length} "
                f"tokens, which must also hold at least one generated token; shorten the prompt by "
                f"at least {n - self.context_length + 1} tokens.")
        need = self.scheduler.pages_for(n + 1)
        if not self.scheduler.fits(n + 1):
            raise RequestTooLargeError(
                f"The prompt has {n} tokens and needs {need} KV pages of {self.store.page_size} tokens; "
                f"the server's pool holds {self.scheduler.capacity_pages}. Shorten the prompt or start "
                "the server with a larger --memory-budget.")
        if self.vocab_size is not None:
            if max(request.prompt_ids) >= self.vocab_size:
                raise MlxInferError(f"prompt token ids must be < the vocabulary size {self.vocab_size}.")
            request.sampling.validate(self.vocab_size)
        if request.prompt_logprobs is not None and not self._head:
            raise MlxInferError("prompt_logprobs needs a graph with logits_from_hidden; this one has none.")
        if request.sampling.seed is not None and request.sampling.seed >= 2**64:
            raise MlxInferError(f"seed must be < 2**64, got {request.sampling.seed}.")
        constraint = None
        if request.constraint is not None:  # compiled here: a bad schema fails the submit, not the engine
            from ..constraints import ConstraintState

            constraint = ConstraintState.create(request.constraint, self.tokenizer, self.vocab_size,
                                                tuple(self.eos))
        limit = token_limit(request.max_tokens, n, self.context_length)
        handle = RequestHandle(request, self.cancel, on_token)
        with self._lock:
            if request.request_id in self._live:
                raise MlxInferError(f"request id {request.request_id!r} is already running.")
            if len(self._inbox) + len(self.scheduler.waiting) >= self.config.max_queue:
                self.metrics.rejected_total += 1
                raise QueueFullError(f"The queue holds {self.config.max_queue} waiting requests; retry later.")
            self._order += 1
            live = LiveRequest(request, handle, self._order, limit)
            live.constraint = constraint
            live.t_submit = time.perf_counter()
            self._live[request.request_id] = live
            self._inbox.append(live)
        self._wake.set()
        return handle

    async def asubmit(self, request: EngineRequest, *,
                      on_token: Callable[[TokenEvent], None] | None = None) -> RequestHandle:
        """:meth:`submit` for an event loop (the server's): here it returns at once; an
        :class:`~mlx_infer.engine.process.EngineProcess` awaits the engine process's answer without
        blocking the loop."""
        return self.submit(request, on_token=on_token)

    def cancel(self, request_id: str) -> None:
        """Cancel a request (a no-op once it finished); pages are freed at the next iteration."""
        with self._lock:
            if request_id in self._live:
                self._cancels.add(request_id)
        self._wake.set()

    def generate(self, requests: Iterable[EngineRequest], timeout: float | None = None) -> list[RequestResult]:
        """Submit ``requests`` together and wait for all; results in order (starts the thread)."""
        self.start()
        handles = [self.submit(r) for r in requests]
        return [h.result(timeout) for h in handles]

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(self, *args)``: what the server does to the engine's model and pool (adapters, the
        startup line), written once for this engine and for one in its own process
        (:meth:`EngineProcess.call <mlx_infer.engine.process.EngineProcess.call>`)."""
        return fn(self, *args)

    @property
    def generation_config(self) -> dict[str, Any] | None:
        """The model's sampling defaults (generation_config.json, the server's overrides applied)."""
        return self.loaded.generation_config

    # -- introspection -------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Metrics and gauges (queue depth, running, pages, memory) as a dict."""
        with self._lock:
            out = dict(self._gauges)
            out["queue_depth"] += len(self._inbox)
        out.update(self.metrics.snapshot())
        out["memory_active_bytes"] = mx.get_active_memory()
        out["memory_peak_bytes"] = mx.get_peak_memory()
        return out

    def prometheus(self) -> str:
        """:meth:`stats` in the Prometheus text format."""
        s = self.stats()
        return prometheus_text({k: s[k] for k in PROMETHEUS_ORDER})

    def _update_gauges(self) -> None:
        g = {"queue_depth": len(self.scheduler.waiting), "running": len(self.scheduler.running),
             **pool_gauges(self.store)}
        with self._lock:
            self._gauges = g

    # -- the engine thread -----------------------------------------------------

    def _run(self) -> None:
        # MLX streams belong to the thread that made them: the engine thread owns one
        # explicitly and runs every step on it. What it reads from other threads must be
        # evaluated already (the loader materializes a graph's constants; see __init__).
        stream = mx.new_stream(mx.default_device())
        try:
            with mx.stream(stream):
                while not self._stopping.is_set():
                    try:
                        busy = self._lockstep.step(self.step) if self._lockstep else self.step()
                    except Exception as e:  # a bug or an MLX failure: fail the requests, keep serving
                        log.exception("engine iteration failed")
                        self._fail_all(f"{type(e).__name__}: {e}")
                        self._after_failed_step()
                        busy = False
                    if not busy and not (self._lockstep and not self._lockstep.pg.is_leader):
                        self._wake.wait(0.05)
                        self._wake.clear()
        finally:
            self._inflight = None
            mx.synchronize(stream)
            # MLX keeps per-thread stream state; a thread that used MLX must clear it
            # before it ends, or interpreter exit may abort (ml-explore/mlx#3126).
            mx.clear_streams()

    def has_work(self) -> bool:
        """Whether anything is queued, running or in flight."""
        return bool(self._inbox or self._cancels or self.scheduler.waiting or self.scheduler.running
                    or self._inflight)

    def step(self) -> bool:
        """One iteration (see the module docstring); returns whether it did any work."""
        self._intake()
        admitted, unfit = self.scheduler.admit()
        try:
            return self._iterate(admitted, unfit)
        finally:
            if self._ceiling is not None:
                self._ceiling.release()  # the forwards that carried prompt tokens engaged it

    def _iterate(self, admitted: list[LiveRequest], unfit: list[LiveRequest]) -> bool:
        for r in unfit:
            self._finish(r, "length")
        busy, first, launched = False, None, None
        mixes = self._mixes()
        decoding = any(r.state == DECODE for r in self.scheduler.running)
        if mixes and not decoding and self._pool_allocated():
            launched = self._decode()  # prompt chunks alone, through the same compiled paged step
        if not mixes or (launched is None and not decoding):
            busy, first = self._prefill()  # else the decode step carries the prompt chunks
        if first is not None and (not self.config.pipeline
                                  or any(r.needs_history or r.constraint is not None for r in first.rows)):
            self._consume(first)  # penalties read the history (constraints advance on it): the first token in it
            first = None
        if launched is None:
            launched = self._decode()
        if self._inflight is not None:
            self._consume(self._inflight)
            self._inflight = None
            busy = True
        if first is not None:  # queued before this iteration's decode step: ready first
            self._consume(first)
        if launched is not None:
            busy = True
            if self.config.pipeline and not any(r.needs_history for r in launched.rows):
                self._inflight = launched
            else:
                self._consume(launched)
        self._update_gauges()
        return busy or bool(admitted or unfit)

    def run_until_idle(self, max_iterations: int = 1_000_000) -> None:
        """Run iterations on this thread until nothing is left (no engine thread needed)."""
        for _ in range(max_iterations):
            if not self.has_work():
                return
            self.step()

    def _intake(self) -> None:
        with self._lock:
            new, self._inbox = list(self._inbox), deque()
            cancels, self._cancels = self._cancels, set()
        if self._lockstep is not None:  # rank 0's intake, on every rank
            new, cancels = self._lockstep.exchange(new, cancels)
        deferred = []
        for live in new:
            if live.state == DONE:  # cancelled while it waited for an adapter slot
                continue
            p = live.request.sampling
            try:
                live.sampler = make_sampler(p, eos_token_ids=tuple(self.eos), newline_token_ids=self.newlines)
                live.rng = RequestRNG(p.seed)
                hold_adapter(self.model, live)  # engine/adapters.py: slot and namespace
            except AdapterSlotsBusyError:  # every slot held by running requests: wait in the queue (vLLM)
                deferred.append(live)
                continue
            except Exception as e:  # this request's parameters, not the engine: fail it alone
                self._finish(live, "error", error=f"{type(e).__name__}: {e}")
                continue
            live.text_out = text_output(self.tokenizer, live.request) if live.request.detokenize else None
            live.needs_history = bool(live.sampler.processors)
            live.simple = p.greedy and not live.needs_history and not p.logprobs and live.constraint is None
            self.scheduler.enqueue(live)
        if deferred:
            with self._lock:
                self._inbox.extendleft(reversed(deferred))
        for rid in cancels:
            live = self._live.get(rid)
            if live is not None and live.state != DONE:
                self._finish(live, "cancelled")

    # -- prefill (engine/prefill.py) ----------------------------------------------

    def _prefill(self) -> tuple[bool, Step | None]:
        return prefill(self)

    # -- decode -----------------------------------------------------------------

    def _allocate_storage(self) -> None:
        allocate_storage(self)

    def _pool_allocated(self) -> bool:
        """Whether every layer's page storage exists (the first forward allocates it, on the
        eager graph, which would gather each chunk row's keys: a prompt then prefills alone)."""
        return all(s is not None for s in self.store.storage)

    def _decode(self) -> Step | None:
        """One forward of every decoding row, plus prompt chunks where steps mix (with no
        decoding row, a step of prompt chunks alone: its rows are the prompts it ends)."""
        rows = [r for r in self.scheduler.running if r.state == DECODE]
        if not rows and not (self._mixes() and any(r.state == PREFILL for r in self.scheduler.running)):
            return None
        if self._inflight is not None and (not self.config.pipeline
                                           or any(r.needs_history or r.constraint is not None for r in rows)):
            self._sync()  # penalties read the history and constraints advance on it, in-flight token included
            rows = [r for r in self.scheduler.running if r.state == DECODE]
        batch = None
        chunks = pick_chunks(self.scheduler.running, self.config.prefill_step_size) if self._mixes() else []
        while rows or chunks:
            batch = mixed_batch(self.store, rows, chunks, self._bucket) if chunks else self._batch_for(rows)
            if batch.reserve():
                break
            if chunks:  # short of pages: decode alone this step (and preempt below if still short)
                chunks = []
                continue
            if self._inflight is not None:  # settle pending tokens first: finishes free pages
                self._sync()
            else:
                victim = self.scheduler.youngest()
                if victim is rows[0] and len(self.scheduler.running) == 1:
                    self._finish(victim, "length")  # alone and the pool is full: out of KV capacity
                else:
                    self._preempt(victim)
            rows = [r for r in self.scheduler.running if r.state == DECODE]
        if not rows and not chunks:
            return None  # (prompt chunks alone that do not fit: the separate prefill preempts or fails)
        if self._ceiling is not None and chunks:  # prompt rows: bound what the step holds (engine/activations.py)
            self._ceiling.engage(len(rows) + sum(c.n for c in chunks), len(rows) + len(chunks))
        inputs = step_inputs(rows) if rows else mx.zeros((0,), mx.uint32)  # (B,)
        ended: list[LiveRequest] = []
        if chunks:
            inputs, ended = mixed_inputs(inputs, batch, chunks)  # (R,): decode rows, chunk rows, padding
        slots = slots_for(rows + [c.r for c in chunks], [1] * len(rows) + [c.n for c in chunks], batch.rows)
        batch_slots(batch, slots)  # each row's adapter (engine/adapters.py)
        if self.paged_decode is not None:
            logits = self.paged_decode.step(inputs, batch)  # (M, vocab); eager fallback inside
        else:
            with rows_context(slots):
                logits = self.model(inputs[:, None], cache=batch.caches)[:, -1, :]  # (B, vocab)
        self.metrics.forward()
        batch.commit()
        if chunks:
            advance(chunks, self.scheduler, self.metrics)
            self.mixed_steps += 1
            rows = rows + ended
            if not rows:  # prompt chunks alone, none ending: nothing to sample; the forward still runs
                mx.async_eval(logits)
                return Step([], mx.zeros((0,), mx.uint32), None)
            logits = logits[:len(rows)]  # (B + ended, vocab): the logit rows' padding dropped
        tokens, outs = sample_rows(rows, logits)  # (B,) uint32: the next step's input, left on the device
        # The host reads a copy: on CUDA, MLX moves an array the host reads into managed memory, and
        # the next step's first kernel reading it would fault its pages back (~0.1 ms in the profile).
        readback = tokens.astype(mx.int32)  # (B,)
        queue_outputs(readback, outs)
        for i, r in enumerate(rows):
            r.next_input = (tokens, i)
        return Step(rows, readback, outs)

    def _paged_decode(self, composition: Composition,
                      policy: PagedDecodePolicy) -> tuple[CompiledPagedDecodeStep | None, str | None]:
        """The compiled paged step when the binding allows it (graph declares compiled decode,
        composition keeps it on, no adapter) and the store's KV is plain; else ``(None, why)``."""
        reason = bind_autoregressive(self.loaded, composition).decode_unavailable_reason()
        if reason is None:
            reason = paged_unsupported_reason(self.store)
        if reason is not None:
            return None, reason
        groups = DecodeBatch.windows_of(self.store)
        try:
            return CompiledPagedDecodeStep(self.model, self.store, groups, policy=policy), None
        except DecodeStepUnsupported as exc:  # no C++ step for this family or module type
            return None, str(exc)
        except (ValueError, RuntimeError) as exc:  # the C++ step refused the graph
            log.warning("compiled paged decode unavailable (%s: %s); decoding eagerly", type(exc).__name__, exc)
            return None, f"{type(exc).__name__}: {exc}"

    def _mixes(self) -> bool:
        """Whether prompt chunks ride in the decode step (not after the compiled step failed:
        the eager graph would gather every chunk row's keys)."""
        return self._mixing and not self.paged_decode.failed and not any(
            r.state == PREFILL and wants_scores(r) for r in self.scheduler.running)  # scored chunks: own forward

    def _batch_for(self, rows: list[LiveRequest]) -> DecodeBatch:
        key = tuple(r.seq.seq_id for r in rows)
        if key != self._batch_key or self._batch is None:
            self._batch = DecodeBatch(self.store, [r.seq for r in rows], table_bucket=self._bucket)
            self._batch_key = key
        return self._batch

    # -- reading tokens ----------------------------------------------------------

    def _sync(self) -> None:
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            self._consume(step)

    def _consume(self, step: Step) -> None:
        consume(self, step)

    def _emit(self, r: LiveRequest, token: int, logprob: float | None, top: list[tuple[int, float]] | None,
              *, forced: bool = False, jump: bool = True) -> None:
        emit(self, r, token, logprob, top, forced=forced, jump=jump)

    # -- finishing ---------------------------------------------------------------

    def _preempt(self, victim: LiveRequest) -> None:
        self.scheduler.preempt(victim)
        self.metrics.preemptions_total += 1

    def _finish(self, r: LiveRequest, reason: str, *, event: TokenEvent | None = None,
                error: str | None = None) -> None:
        finish(self, r, reason, event=event, error=error)

    def _fail_all(self, message: str) -> None:
        self._inflight = None
        self._batch, self._batch_key = None, ()
        for r in list(self.scheduler.running) + list(self.scheduler.waiting):
            try:
                self._finish(r, "error", error=message)
            except Exception:  # keep releasing the others
                log.exception("could not release a request")
        self._update_gauges()

    def _after_failed_step(self) -> None:
        """After an iteration raised (its requests failed): the pages it wrote or indexed are not to be
        trusted, so the prefix index forgets every cached page; and if steps were mixing prompt chunks,
        later prompts prefill in forwards of their own (the path every engine has), so one shape the
        device refuses does not fail every later request (benchmarks/RESULTS.md: a CUDA failure of a
        1,024-row chunk step on a tiny shape)."""
        try:
            self.store.drop_cached_prefixes()
        except Exception:  # noqa: BLE001 - keep serving
            log.exception("could not drop the prefix cache")
        if self._mixing and self.mixed_steps:
            self._mixing = False
            log.warning("engine: prompt chunks no longer ride in the decode step after a failed iteration")

    def _drain(self) -> None:
        self._intake()
        self._inflight = None
        for r in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._finish(r, "cancelled")
        self._update_gauges()

