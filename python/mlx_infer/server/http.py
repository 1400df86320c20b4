"""uvicorn, set up against slow clients and for a bounded shutdown.

- **Header timeout**: uvicorn has none (its keep-alive timeout runs only between
  requests), so a client that sends headers a byte at a time holds its connection
  forever. The protocol classes (:func:`protocol_class`: httptools' when it is
  installed, else h11's) close a connection whose request line and headers are not
  complete ``header_timeout_s`` after it opened (or after its previous response).
  The body's own limit is the guard's (:mod:`.guard`). A request the parser cannot
  read gets its 400 in OpenAI's error shape too.
- **Bounded drain**: :class:`DrainingServer` starts the app's :class:`~.guard.Drain`
  on shutdown (SIGINT, SIGTERM, ``should_exit``): requests in flight get
  ``drain_timeout_s`` to finish, then are aborted (they end saying so, never as a
  normal stop); uvicorn cancels what is still running :data:`ABORT_GRACE_S` later.
"""

from __future__ import annotations

import asyncio
import functools
import socket
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .. import defaults
from ..errors import MlxInferError
from .guard import Drain, error_body

HEADER_TIMEOUT_S = defaults.HEADER_TIMEOUT_S
DRAIN_TIMEOUT_S = defaults.DRAIN_TIMEOUT_S
#: After the drain, at most this long for aborted requests to send their last event (they
#: need no engine step for it, only the event loop: a loaded machine can starve it for a while).
ABORT_GRACE_S = 3.0
#: A request's line and headers, at most (h11's own bound, uvicorn's ``h11_max_incomplete_event_size``).
MAX_HEADER_BYTES = 16 * 1024


class _HeaderTimer:
    """A request-header timeout for a uvicorn HTTP protocol class (mixed in before it): a connection
    whose next request's headers are not complete ``header_timeout_s`` after it opened (or after its
    previous response) is closed. ``_headers_done`` counts requests whose headers arrived."""

    header_timeout_s: float = HEADER_TIMEOUT_S
    _headers_done = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        self._header_timer = self.loop.call_later(  # type: ignore[attr-defined]
            self.header_timeout_s, self._header_timeout, self._headers_done)

    def _header_timeout(self, done_when_armed: int) -> None:
        # No request's headers completed since the timer was armed and no response is under way: cut it.
        cycle = self.cycle  # type: ignore[attr-defined]
        idle = cycle is None or cycle.response_complete
        if self._headers_done == done_when_armed and idle and not self.transport.is_closing():  # type: ignore[attr-defined]
            self.transport.close()  # type: ignore[attr-defined]


class TimedH11Protocol(_HeaderTimer, H11Protocol):
    """uvicorn's h11 protocol (pure Python) with the header timeout; the fallback without httptools."""

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request's headers were parsed (h11.Request): a new cycle
            self._headers_done += 1

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse: a 400 in OpenAI's error shape (uvicorn's is plain text)."""
        body = error_body(400, f"Malformed HTTP request: {msg}", code="invalid_http")
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


@functools.cache
def _httptools_protocol() -> type | None:
    """uvicorn's httptools protocol (C parser, lean response writes) with the header timeout, or
    None when httptools is not installed (then :class:`TimedH11Protocol`)."""
    try:
        import httptools
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None

    class TimedHttpToolsProtocol(_HeaderTimer, HttpToolsProtocol):  # type: ignore[misc, valid-type]
        """uvicorn's httptools protocol with the header timeout."""

        _head_bytes: int | None = 0  # bytes received of a request whose headers are not complete yet

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._head_bytes is not None and not self.transport.is_closing():
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEADER_BYTES:  # httptools has no limit of its own
                    self.send_400_response(f"the request line and headers exceed {MAX_HEADER_BYTES} bytes")

        def on_message_begin(self) -> None:
            self._head_bytes = 0
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            if self.parser.get_http_version() == "1.1" and not any(n == b"host" for n, _ in self.headers):
                # RFC 9112 3.2 (h11 refuses it too); raised in the parser's callback: uvicorn answers 400
                raise httptools.HttpParserError("an HTTP/1.1 request without a Host header")
            self._headers_done += 1
            self._head_bytes = None
            super().on_headers_complete()

        def send_400_response(self, msg: str) -> None:
            """A request httptools cannot parse: a 400 in OpenAI's error shape (uvicorn's is plain text)."""
            body = error_body(400, f"Malformed HTTP request: {msg}", code="invalid_http")
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                                 b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
                                 + body)
            self.transport.close()

    return TimedHttpToolsProtocol


def protocol_class(http: str = "auto") -> type:
    """The HTTP protocol the server runs: ``"httptools"`` (uvicorn's C parser; the default when it is
    installed, as uvicorn's own ``auto``: per streamed chunk it costs the event loop a fraction of h11's
    Python framing, and the loop shares the GIL with the engine) or ``"h11"``.

    Raises:
        MlxInferError: ``http`` is neither, or ``"httptools"`` without httptools installed.
    """
    if http not in ("auto", "httptools", "h11"):
        raise MlxInferError(f"the HTTP protocol must be auto, httptools or h11, got {http!r}.")
    fast = _httptools_protocol() if http != "h11" else None
    if fast is None and http == "httptools":
        raise MlxInferError("the httptools HTTP protocol needs httptools: pip install httptools (or use h11).")
    return fast or TimedH11Protocol


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose shutdown drains for ``drain_timeout_s``, then aborts (see the module)."""

    def __init__(self, config: uvicorn.Config, drain: Drain | None, drain_timeout_s: float):
        super().__init__(config)
        self.drain, self.drain_timeout_s = drain, drain_timeout_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = None
        if self.drain is not None:
            self.drain.begin()
            timer = asyncio.get_running_loop().call_later(self.drain_timeout_s, self.drain.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()


def make_server(app: Any, *, log_level: str = "info", drain_timeout_s: float = DRAIN_TIMEOUT_S,
                header_timeout_s: float = HEADER_TIMEOUT_S, lifespan: str = "auto",
                http: str = "auto") -> DrainingServer:
    """A :class:`DrainingServer` for ``app`` (its ``app.state.drain``, when it has one), speaking HTTP
    through :func:`protocol_class` ``(http)``."""
    for name, value in (("drain timeout", drain_timeout_s), ("header timeout", header_timeout_s)):
        if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
            raise MlxInferError(f"the {name} must be a positive number of seconds, got {value!r}.")
    base = protocol_class(http)
    protocol = type(base.__name__, (base,), {"header_timeout_s": float(header_timeout_s)})
    config = uvicorn.Config(app, log_level=log_level, lifespan=lifespan, http=protocol,
                            timeout_graceful_shutdown=drain_timeout_s + ABORT_GRACE_S)  # type: ignore[arg-type]
    drain = getattr(getattr(app, "state", None), "drain", None)
    return DrainingServer(config, drain, drain_timeout_s)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (bound before the model loads, so a busy port fails fast).

    Raises:
        MlxInferError: a bad port, or the address cannot be bound (in use, not local).
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise MlxInferError(f"--port must be in 1..65535 (0: any free port), got {port!r}.")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
            sock.listen(2048)  # clients may connect (queued) from here on, before uvicorn runs
        except OSError:
            sock.close()
            raise
    except (OSError, UnicodeError) as e:
        raise MlxInferError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}. "
                            "Pick a free port (--port) or a local address (--host).") from None
    return sock
