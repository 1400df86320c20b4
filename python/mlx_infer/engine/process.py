"""The engine in a process of its own, for the server (vLLM's ``AsyncLLM`` / ``EngineCore`` split).

In one process the server's event loop (parsing requests, writing SSE chunks) and the engine thread (planning
and launching steps, reading tokens) take turns on one GIL: each chunk the loop writes is time the engine
cannot plan the next step in, and the device waits. :class:`EngineProcess` runs the :class:`~.engine.Engine`
in a child process instead; the server keeps the HTTP work and the tokenizer (chat templates, prompts)::

    server process                                      engine process (spawned)
    ------------------------------------------          -------------------------------------------
    EngineProcess.submit(request) ----- submit ------>  receiver thread: Engine.submit (validates)
                 (waits for the reply) <--- reply ----  (the engine's own errors, raised here again)
    reader thread: handle._deliver,    <-- events ----  sender thread: every event since its last
       one wake-up per event loop                       send, one message (a step's tokens)
    handle.cancel() ------------------- cancel ------>  Engine.cancel
    EngineProcess.call(fn, *args) ------ call ------->  fn(engine, *args) (adapters, metrics, the pool)

A request without stop strings is sent to the engine process without its text (``detokenize=False``): the
reader thread makes the text from the token ids, as vLLM's frontend does for its engine core, so the engine's
thread -- which a decode step waits on -- spends nothing on it (:class:`ServerText`;
``MLX_INFER_SERVER_TEXT=0`` leaves every request's text to the engine process). Stop strings decide when a
request ends, so a request with them keeps its text in the engine process.

Messages are pickled tuples over one ``multiprocessing`` pipe. The engine process ignores SIGINT (the server
decides when to stop: drain, then :meth:`EngineProcess.stop`) and ends when the pipe closes, so it never
outlives the server. If it dies, every live request ends with ``"error"`` and later submits raise
:class:`~.engine.EngineClosedError`.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from ..errors import MlxInferError
from ..generation.text_output import ENDINGS
from .engine import EngineClosedError
from .output import text_output
from .request import EngineRequest, RequestHandle, RequestResult, TokenEvent, wake

log = logging.getLogger("mlx_infer.engine")

#: Seconds :meth:`EngineProcess.stop` waits for the engine process to end before it is killed.
STOP_TIMEOUT_S = 30.0


def pack_event(event: TokenEvent) -> tuple:
    """``event`` as the pipe carries it: a plain tuple of its fields but the request id (the message's).
    Pickling a step's events as dataclasses costs ~5x the tuples, on the engine process's GIL (32 events:
    ~39 against ~7 us on a 2-core x86 CPU), and as much again to read them back."""
    return (event.token, event.index, event.text, event.finish_reason, event.logprob, event.top_logprobs,
            event.forced)


def unpack_event(request_id: str, packed: tuple) -> TokenEvent:
    """The :class:`TokenEvent` :func:`pack_event` packed, of request ``request_id``."""
    token, index, text, finish_reason, logprob, top_logprobs, forced = packed
    return TokenEvent(request_id=request_id, token=token, index=index, text=text, finish_reason=finish_reason,
                      logprob=logprob, top_logprobs=top_logprobs, forced=forced)


class ServerText:
    """The text of a request the engine process runs without it (no stop strings): the same output state machine
    the engine would run (:class:`~mlx_infer.generation.text_output.TextOutput`), fed each event's token with the
    engine's finish reason, which stop strings cannot change here. Used by the reader thread alone."""

    def __init__(self, tokenizer: Any, request: EngineRequest, eos: frozenset[int]):
        self.out = text_output(tokenizer, request)  # no stop strings: the engine's finish reasons are final
        self.eos = frozenset() if request.ignore_eos else eos  # as the engine's emit decides an EOS token
        self.pieces: list[str] = []

    def fill(self, packed: tuple) -> tuple:
        """A :func:`pack_event` tuple with the text its token completes (without a token: unchanged, nothing
        fed)."""
        token, index, _, finish_reason = packed[:4]
        if token is None:
            return packed
        text, _ = self.out.feed(token, finish_reason if finish_reason in ENDINGS else None, eos=token in self.eos)
        self.pieces.append(text)
        return (token, index, text, *packed[3:])

    def result(self, result: RequestResult) -> RequestResult:
        """``result`` with the whole text (the pieces the events carried)."""
        return replace(result, text="".join(self.pieces))


@dataclass(frozen=True)
class EngineFacts:
    """What the server reads of the engine once, sent by the engine process when it is ready.

    Attributes:
        tokenizer: the model's :class:`~mlx_infer.input.tokenizer.Tokenizer` (the server encodes prompts).
        generation_config: the model's sampling defaults, the operator's overrides applied.
        context_length: the model's context window (``None``: unbounded).
        eos: the end-of-sequence token ids.
        vocab_size: the vocabulary size (``None``: unknown).
        pool_summary: the KV pool, as the server's startup line states it.
    """

    tokenizer: Any
    generation_config: dict[str, Any] | None
    context_length: int | None
    eos: frozenset[int]
    vocab_size: int | None
    pool_summary: str


class EngineProcess:
    """An :class:`~.engine.Engine` in a spawned process, driven like one (see the module docstring).

    It offers what the server uses of an engine: :meth:`submit`, :meth:`cancel`, :meth:`call`,
    :meth:`stats`, :meth:`prometheus`, :meth:`stop` and the model's facts (``tokenizer``,
    ``generation_config``, ``context_length``, ``eos``, ``vocab_size``).

    Args:
        build: a picklable function that runs in the engine process, loads the model and returns
            ``(engine, facts)``: the unstarted :class:`~.engine.Engine` and its :class:`EngineFacts`.
        args: ``build``'s arguments (picklable).

    Raises:
        MlxInferError: ``build`` failed in the engine process (its error, raised again here), or the
            process died before it was ready.
    """

    def __init__(self, build: Callable[..., tuple[Any, EngineFacts]], *args: Any):
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no MLX or device state inherited
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_engine_main, args=(child, build, args), name="mlx-infer-engine",
                                 daemon=True)
        self._proc.start()
        child.close()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._handles: dict[str, RequestHandle] = {}
        self._texts: dict[str, ServerText] = {}  # requests whose text this process makes
        self._server_text = os.environ.get("MLX_INFER_SERVER_TEXT", "1") != "0"
        self._replies: dict[int, list] = {}  # call id -> [threading.Event, ok, value]
        self._next_call = 0
        self._closed = False
        self._gone: str | None = None  # why the engine process is unreachable
        first = self._recv_ready()
        if first[0] == "failed":
            self._proc.join(STOP_TIMEOUT_S)
            raise first[1]
        self.facts: EngineFacts = first[1]
        self.tokenizer = self.facts.tokenizer
        self.generation_config = self.facts.generation_config
        self.context_length = self.facts.context_length
        self.eos = self.facts.eos
        self.vocab_size = self.facts.vocab_size
        self._reader = threading.Thread(target=self._read, name="mlx-infer-engine-reader", daemon=True)
        self._reader.start()

    def _recv_ready(self) -> tuple:
        while not self._conn.poll(0.2):  # loading takes as long as it takes; a dead process ends the wait
            if not self._proc.is_alive():
                raise MlxInferError(f"the engine process exited (code {self._proc.exitcode}) before it was "
                                    "ready; its error is above")
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(STOP_TIMEOUT_S)
            raise MlxInferError(f"the engine process exited (code {self._proc.exitcode}) before it was "
                                "ready; its error is above") from None

    # -- what the server calls ------------------------------------------------------

    def submit(self, request: EngineRequest, *, on_token: Callable[[TokenEvent], None] | None = None) -> RequestHandle:
        """Queue ``request`` in the engine process; returns its :class:`RequestHandle` once the engine
        accepted it. Raises what :meth:`Engine.submit <mlx_infer.engine.Engine.submit>` raises."""
        handle, wire = self._register(request, on_token)
        try:
            self._request("submit", wire)
        except BaseException:
            self._unregister(request.request_id)
            raise
        return handle

    async def asubmit(self, request: EngineRequest, *,
                      on_token: Callable[[TokenEvent], None] | None = None) -> RequestHandle:
        """:meth:`submit` for an event loop: the loop serves other requests while the engine process answers
        (the server's routes submit this way)."""
        handle, wire = self._register(request, on_token)
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        try:
            await self._arequest(loop, answer, "submit", wire)
        except BaseException as e:
            self._unregister(request.request_id)
            if isinstance(e, asyncio.CancelledError):  # the caller left: the engine may have taken it already
                self.cancel(request.request_id)
            raise
        return handle

    def _register(self, request: EngineRequest,
                  on_token: Callable[[TokenEvent], None] | None) -> tuple[RequestHandle, EngineRequest]:
        """The request's handle, where the reader thread finds it (its events may come before the reply), and the
        request as the engine process gets it (without its text where this process makes it)."""
        handle = RequestHandle(request, self.cancel, on_token)
        text = wire = None
        if self._server_text and request.detokenize and not request.stop:
            text = ServerText(self.tokenizer, request, self.eos)
            wire = replace(request, detokenize=False)
        with self._lock:
            if request.request_id in self._handles:
                raise MlxInferError(f"request id {request.request_id!r} is already running.")
            self._handles[request.request_id] = handle
            if text is not None:
                self._texts[request.request_id] = text
        return handle, wire or request

    def _unregister(self, request_id: str) -> None:
        with self._lock:
            self._handles.pop(request_id, None)
            self._texts.pop(request_id, None)

    def cancel(self, request_id: str) -> None:
        """Cancel a request (a no-op once it finished)."""
        try:
            self._send(("cancel", request_id))
        except EngineClosedError:
            pass  # nothing runs any more

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(engine, *args)`` in the engine process, its value (or its error) returned here: what the
        server does to the engine's model and pool (adapters, the startup line). ``fn`` and the arguments
        must pickle (a module-level function)."""
        return self._request("call", fn, args)

    def stats(self) -> dict[str, Any]:
        """:meth:`Engine.stats <mlx_infer.engine.Engine.stats>` of the engine process."""
        return self.call(_stats)

    def prometheus(self) -> str:
        """:meth:`Engine.prometheus <mlx_infer.engine.Engine.prometheus>` of the engine process."""
        return self.call(_prometheus)

    def start(self) -> "EngineProcess":
        """The engine thread already runs (for the :class:`~.engine.Engine` interface)."""
        return self

    def stop(self) -> None:
        """Stop the engine process: unfinished requests end with ``"cancelled"``; waits for it to exit."""
        if self._closed:
            return
        self._closed = True
        try:
            self._send(("stop",))
        except EngineClosedError:
            pass
        self._reader.join(STOP_TIMEOUT_S)
        self._proc.join(STOP_TIMEOUT_S)
        if self._proc.is_alive():
            log.warning("the engine process did not stop within %.0f s; killing it", STOP_TIMEOUT_S)
            self._proc.kill()
            self._proc.join()
        self._conn.close()
        self._end_all("cancelled", None)

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return self._proc.pid

    @property
    def alive(self) -> bool:
        """Whether the engine process runs and answers."""
        return self._gone is None and self._proc.is_alive()

    # -- the pipe ----------------------------------------------------------------------

    def _send(self, msg: tuple) -> None:
        if self._gone is not None:
            raise EngineClosedError(f"The engine process is gone ({self._gone}); restart the server.")
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError) as e:  # the pipe broke: the process died
            raise EngineClosedError(f"The engine process is gone ({e}); restart the server.") from None

    def _request(self, kind: str, *payload: Any) -> Any:
        if self._closed:
            raise EngineClosedError("This engine was stopped; create a new one.")
        done = threading.Event()
        with self._lock:
            self._next_call += 1
            call_id = self._next_call
            self._replies[call_id] = slot = [done, False, None]
        try:
            self._send((kind, call_id, *payload))
            while not done.wait(1.0):  # a dead process answers nothing: the reader then fails the call
                if self._gone is not None:
                    break
        finally:
            with self._lock:
                self._replies.pop(call_id, None)
        if not done.is_set():
            raise EngineClosedError(f"The engine process is gone ({self._gone}); restart the server.")
        _, ok, value = slot
        if not ok:
            raise value
        return value

    async def _arequest(self, loop: asyncio.AbstractEventLoop, answer: asyncio.Future, kind: str,
                        *payload: Any) -> Any:
        if self._closed:
            raise EngineClosedError("This engine was stopped; create a new one.")
        with self._lock:
            self._next_call += 1
            call_id = self._next_call
            self._replies[call_id] = _LoopReply(loop, answer)
        try:
            self._send((kind, call_id, *payload))
            return await answer
        finally:
            with self._lock:
                self._replies.pop(call_id, None)

    def _read(self) -> None:
        """The reader thread: replies to their callers, events to their handles."""
        try:
            while True:
                msg = self._conn.recv()
                if msg[0] == "events":
                    self._deliver(msg[1])
                elif msg[0] == "reply":
                    _, call_id, ok, value = msg
                    with self._lock:
                        slot = self._replies.get(call_id)
                    if isinstance(slot, _LoopReply):
                        slot.settle(ok, value)
                    elif slot is not None:
                        slot[1], slot[2] = ok, value
                        slot[0].set()
                elif msg[0] == "stopped":
                    self._deliver(msg[1])
                    self._gone = "stopped"
                    return
        except (EOFError, OSError) as e:
            self._gone = f"its pipe closed: {type(e).__name__}"
            if not self._closed:
                log.error("the engine process exited unexpectedly (code %s)", self._proc.exitcode)
        except Exception:  # noqa: BLE001 - a message that cannot be read: the engine is unusable
            self._gone = "a message could not be read"
            log.exception("reading from the engine process failed")
        finally:
            with self._lock:
                slots = list(self._replies.values())
            gone = EngineClosedError(f"The engine process is gone ({self._gone}); restart the server.")
            for slot in slots:  # callers waiting on an answer that will not come
                if isinstance(slot, _LoopReply):
                    slot.settle(False, gone)
                elif not slot[0].is_set():
                    slot[1], slot[2] = False, gone
                    slot[0].set()
            self._end_all("error", f"the engine process is gone ({self._gone})")

    def _deliver(self, batch: list[tuple[str, tuple, RequestResult | None, Any]]) -> None:
        wakeups: dict = {}
        for rid, packed, result, scores in batch:
            with self._lock:
                handle = self._handles.get(rid)
                text = self._texts.get(rid)
                if result is not None:
                    self._handles.pop(rid, None)
                    self._texts.pop(rid, None)
            if handle is None:
                continue
            if scores is not None:
                handle.prompt_logprobs = scores
            if text is not None:
                packed = text.fill(packed)
                if result is not None:
                    result = text.result(result)
            handle._deliver(unpack_event(rid, packed), result, wakeups=wakeups)
        if wakeups:
            wake(wakeups)

    def _end_all(self, reason: str, error: str | None) -> None:
        """End every request the engine process will not answer any more."""
        with self._lock:
            left, self._handles = list(self._handles.values()), {}
            texts, self._texts = self._texts, {}
        for h in left:
            if h.done:
                continue
            n = len(h.request.prompt_ids)
            text = texts.get(h.request_id)
            h._deliver(TokenEvent(request_id=h.request_id, token=None, index=0, finish_reason=reason),
                       RequestResult(request_id=h.request_id, prompt_tokens=n, finish_reason=reason, error=error,
                                     text="".join(text.pieces) if text is not None else ""))


class _LoopReply:
    """A reply an event loop awaits: set on the loop's own thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future):
        self.loop, self.future = loop, future

    def settle(self, ok: bool, value: Any) -> None:
        def settle() -> None:
            if not self.future.done():
                self.future.set_result(value) if ok else self.future.set_exception(value)
        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody awaits
            pass


def _stats(engine: Any) -> dict[str, Any]:
    return engine.stats()


def _prometheus(engine: Any) -> str:
    return engine.prometheus()


# -- the engine process --------------------------------------------------------------


class _Outbox:
    """Events the engine thread produced, sent by one sender thread: each send carries every event since
    the last one (a step's tokens in one message), so the engine thread never waits on the pipe."""

    def __init__(self, conn: Any, send_lock: threading.Lock):
        self._conn, self._send_lock = conn, send_lock
        self._cond = threading.Condition()
        self._items: list[tuple[str, TokenEvent]] = []
        self._handles: dict[str, RequestHandle] = {}
        self._first: set[str] = set()  # requests whose first event is not sent yet (their prompt scores go with it)
        self._closing = False

    def callback(self, rid: str) -> Callable[[TokenEvent], None]:
        def on_token(event: TokenEvent) -> None:  # the engine thread: append and go on
            with self._cond:
                self._items.append((rid, event))
                self._cond.notify()
        return on_token

    def track(self, handle: RequestHandle) -> None:
        with self._cond:
            self._handles[handle.request_id] = handle
            self._first.add(handle.request_id)

    def run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._items or self._closing)
                items, self._items = self._items, []
                closing = self._closing and not items
            if closing:
                return
            self.send("events", items)

    def send(self, kind: str, items: list[tuple[str, TokenEvent]]) -> None:
        batch, late, late_ids = [], [], set()
        with self._cond:  # once for the batch: the engine thread appends under the same lock
            handles = []
            for rid, event in items:
                handle = None if rid in late_ids else self._handles.get(rid)
                first = handle is not None and rid in self._first
                if first:
                    self._first.discard(rid)
                if handle is None:  # an event before its submit returned: its handle is tracked in a moment
                    late.append((rid, event))
                    late_ids.add(rid)
                else:
                    handles.append((rid, event, handle, first))
        done = []
        for rid, event, handle, first in handles:
            result = handle.result(STOP_TIMEOUT_S) if event.finish_reason is not None else None
            if result is not None:
                done.append(rid)
            batch.append((rid, pack_event(event), result, handle.prompt_logprobs if first else None))
        if late or done:
            with self._cond:
                for rid in done:
                    self._handles.pop(rid, None)
                if late:
                    self._items[:0] = late
                    self._cond.notify()
        if late:
            time.sleep(0.001)
        with self._send_lock:
            self._conn.send((kind, batch))

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()


def _engine_main(conn: Any, build: Callable[..., tuple[Any, EngineFacts]], args: tuple) -> None:
    """The engine process: build the engine, then serve the pipe until ``stop`` or until it closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server stops us
    try:
        engine, facts = build(*args)
        engine.start()
    except BaseException as e:  # noqa: BLE001 - the server raises it again
        conn.send(("failed", e if _picklable(e) else MlxInferError(f"{type(e).__name__}: {e}")))
        conn.close()
        return
    send_lock = threading.Lock()
    outbox = _Outbox(conn, send_lock)
    sender = threading.Thread(target=outbox.run, name="mlx-infer-engine-sender", daemon=True)
    sender.start()

    def reply(call_id: int, ok: bool, value: Any) -> None:
        if not ok and not _picklable(value):
            value = MlxInferError(f"{type(value).__name__}: {value}")
        with send_lock:
            conn.send(("reply", call_id, ok, value))

    with send_lock:
        conn.send(("ready", facts))
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the server is gone
                break
            kind = msg[0]
            if kind == "stop":
                break
            if kind == "cancel":
                engine.cancel(msg[1])
            elif kind == "submit":
                _, call_id, request = msg
                try:
                    handle = engine.submit(request, on_token=outbox.callback(request.request_id))
                    outbox.track(handle)
                    reply(call_id, True, None)
                except Exception as e:  # noqa: BLE001 - the request's error, raised in the server
                    reply(call_id, False, e)
            elif kind == "call":
                _, call_id, fn, fargs = msg
                try:
                    value = fn(engine, *fargs)
                except Exception as e:  # noqa: BLE001 - raised in the server
                    reply(call_id, False, e)
                else:
                    reply(call_id, True, value)
    finally:
        engine.stop()  # unfinished requests end "cancelled": their final events go out below
        outbox.close()
        sender.join(STOP_TIMEOUT_S)
        try:
            with send_lock:
                conn.send(("stopped", []))
        except (OSError, ValueError):
            pass
        conn.close()


def _picklable(value: Any) -> bool:
    import pickle

    try:
        pickle.loads(pickle.dumps(value))
    except Exception:  # noqa: BLE001 - any failure: send a plain error instead
        return False
    return True
