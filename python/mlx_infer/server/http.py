"""uvicorn, set up against slow clients and for a bounded shutdown.

- **Header timeout**: uvicorn has none (its keep-alive timeout runs only between
  requests), so a client that sends headers a byte at a time holds its connection
  forever. :class:`TimedH11Protocol` closes a connection whose request line and
  headers are not complete ``header_timeout_s`` after it opened (or after its
  previous response). The body's own limit is the guard's (:mod:`.guard`). A
  request h11 cannot parse gets its 400 in OpenAI's error shape too.
- **Bounded drain**: :class:`DrainingServer` starts the app's :class:`~.guard.Drain`
  on shutdown (SIGINT, SIGTERM, ``should_exit``): requests in flight get
  ``drain_timeout_s`` to finish, then are aborted (they end saying so, never as a
  normal stop); uvicorn cancels what is still running :data:`ABORT_GRACE_S` later.
"""

from __future__ import annotations

import asyncio
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


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-header timeout (``header_timeout_s``)."""

    header_timeout_s: float = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse: a 400 in OpenAI's error shape (uvicorn's is plain text)."""
        body = error_body(400, f"Malformed HTTP request: {msg}", code="invalid_http")
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _arm_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        cycle = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout, cycle)

    def _header_timeout(self, cycle: Any) -> None:
        # Still the cycle armed for, and the client has not finished a request's headers: cut it.
        if self.cycle is cycle and self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


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
                header_timeout_s: float = HEADER_TIMEOUT_S, lifespan: str = "auto") -> DrainingServer:
    """A :class:`DrainingServer` for ``app`` (its ``app.state.drain``, when it has one)."""
    for name, value in (("drain timeout", drain_timeout_s), ("header timeout", header_timeout_s)):
        if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
            raise MlxInferError(f"the {name} must be a positive number of seconds, got {value!r}.")
    protocol = type("TimedH11", (TimedH11Protocol,), {"header_timeout_s": float(header_timeout_s)})
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
