"""The ASGI layer in front of the routes: API key, body limits, shutdown, the last-resort 500.

A pure ASGI middleware, not Starlette's ``BaseHTTPMiddleware`` (``@app.middleware``):
that one runs the route behind a wrapped ``receive`` on which the route never sees
the client's ``http.disconnect``, so a non-streaming request whose client left kept
generating. Here the routes get the server's own ``receive`` once the body is read.

- **API key** (``--api-key``): every path needs ``Authorization: Bearer <key>``
  except the ones listed public (``/health`` by default; ``/metrics`` and ``/docs``
  on request). The raw header bytes are compared with the key's UTF-8 bytes.
- **Body**: read here, in full, before any route runs: more than ``max_body_bytes``
  is a 413 as soon as the count passes it (with or without ``Content-Length``,
  chunked included); a body not complete ``body_timeout_s`` after the headers is
  a 408. Both close the connection.
- **Shutdown** (:class:`Drain`): while draining, new requests are 503s; when the
  drain time is up the in-flight requests are aborted: streams end with an error
  event (``code: "server_shutdown"``), waiting requests get a 503, and body reads
  in progress stop.
- **Anything unexpected** is logged with its traceback and answered as a 500 in
  OpenAI's error shape (no hostile input should get there: tests/test_hostile_server.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from .. import defaults

logger = logging.getLogger("mlx_infer.server")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

MAX_BODY_BYTES = defaults.MAX_BODY_BYTES
BODY_TIMEOUT_S = defaults.BODY_TIMEOUT_S
#: The public paths ``--public`` can name: ``docs`` opens the interactive docs and the schema.
PUBLIC_CHOICES: dict[str, tuple[str, ...]] = {
    "health": ("/health",),
    "metrics": ("/metrics",),
    "docs": ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"),
}
DEFAULT_PUBLIC = defaults.PUBLIC_ENDPOINTS


def error_body(status: int, message: str, *, type: str | None = None, code: str | None = None,
               param: str | None = None) -> bytes:
    """OpenAI's ``{"error": {...}}`` as ASCII JSON (safe for any message, lone surrogates included)."""
    kind = type or ("server_error" if status >= 500 else "invalid_request_error")
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


async def send_error(send: Send, status: int, message: str, *, code: str | None = None,
                     close: bool = False) -> None:
    body = error_body(status, message, code=code)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class Drain:
    """Shutdown state shared by the app (which registers its requests) and the server.

    ``begin()`` starts the drain (new requests: 503); ``abort_all()`` ends it: every
    registered request is cancelled and remembered as cut by shutdown.
    """

    def __init__(self) -> None:
        self.draining = False
        self.live: set[Any] = set()  # RequestHandles in flight
        self._aborted: set[str] = set()
        self._abort_event: asyncio.Event | None = None  # bound to the server's loop on first use

    @property
    def abort_event(self) -> asyncio.Event:
        if self._abort_event is None:
            self._abort_event = asyncio.Event()
        return self._abort_event

    def begin(self) -> None:
        self.draining = True

    def abort_all(self) -> None:
        """Cancel every request in flight (call on the server's event loop)."""
        self.draining = True
        self.abort_event.set()
        for handle in list(self.live):
            if not handle.done:  # one that just finished keeps its normal end
                self._aborted.add(handle.request_id)
                handle.cancel()
                handle.interrupt()  # its stream ends now, not when the engine answers the cancel

    def aborted(self, handle: Any) -> bool:
        """Whether ``handle`` was cut by shutdown (not by its client)."""
        return handle.request_id in self._aborted


@dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """What :class:`Guard` enforces (see the module docstring)."""

    api_key: str | None = None
    public: tuple[str, ...] = DEFAULT_PUBLIC
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = BODY_TIMEOUT_S
    public_paths: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        from ..errors import MlxInferError

        unknown = sorted(set(self.public) - set(PUBLIC_CHOICES))
        if unknown:
            raise MlxInferError(f"unknown public endpoint(s) {unknown}; choose from {sorted(PUBLIC_CHOICES)}.")
        if self.api_key is not None:
            if not self.api_key or not all(0x21 <= ord(c) <= 0x7E for c in self.api_key):
                raise MlxInferError("--api-key must be printable ASCII without spaces (HTTP headers carry ASCII; "
                                    "clients cannot send other characters).")
        if not self.max_body_bytes > 0 or not self.body_timeout_s > 0:
            raise MlxInferError("the body limit and the body timeout must be > 0.")
        object.__setattr__(self, "public_paths", frozenset(p for n in self.public for p in PUBLIC_CHOICES[n]))


class Guard:
    """The ASGI middleware (see the module docstring)."""

    def __init__(self, app: Any, *, config: GuardConfig, drain: Drain):
        self.app, self.config, self.drain = app, config, drain
        self._key = config.api_key.encode() if config.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            if not self._authorized(scope):
                await send_error(send, 401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                                 code="invalid_api_key")
                return
            if self.drain.draining:
                await send_error(send, 503, "The server is shutting down; retry on another instance.",
                                 code="server_shutdown", close=True)
                return
            body = await self._read_body(scope, receive, send)
            if body is None:  # answered (413/408/503) or the client left
                return
            await self.app(scope, _replay(body, receive), tracked_send)
        except Exception:
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise  # the response is half sent: let the server close the connection
            await send_error(send, 500, "Internal server error (logged on the server).")

    def _authorized(self, scope: Scope) -> bool:
        if self._key is None or scope.get("path", "") in self.config.public_paths:
            return True
        given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        scheme, _, token = given.partition(b" ")  # raw bytes: no latin-1 vs UTF-8 mismatch
        return scheme.lower() == b"bearer" and secrets.compare_digest(token, self._key)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        limit = self.config.max_body_bytes
        too_large = f"The request body is larger than {limit} bytes."
        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > limit):
            await send_error(send, 413, too_large, code="request_too_large", close=True)
            return None
        deadline = time.monotonic() + self.config.body_timeout_s
        chunks, size = [], 0
        while True:
            message = await self._receive_before(receive, deadline)
            if message is None:
                if self.drain.abort_event.is_set():
                    await send_error(send, 503, "The server is shutting down.", code="server_shutdown", close=True)
                else:
                    await send_error(send, 408, f"The request body did not arrive within "
                                                f"{self.config.body_timeout_s:g} s.", code="request_timeout",
                                     close=True)
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await send_error(send, 413, too_large, code="request_too_large", close=True)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _receive_before(self, receive: Receive, deadline: float) -> Message | None:
        """The next message, or ``None`` past ``deadline`` or once shutdown aborts requests."""
        recv = asyncio.ensure_future(receive())
        abort = asyncio.ensure_future(self.drain.abort_event.wait())
        try:
            done, _ = await asyncio.wait({recv, abort}, timeout=max(0.0, deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            abort.cancel()
            if not recv.done():
                recv.cancel()
        return recv.result() if recv in done else None


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the routes: the buffered body once, then the server's own (disconnects)."""
    pending = True

    async def replay() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay
