"""Start the server: load the model, start the engine, run uvicorn."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import MlxInferError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """What ``mlx-infer serve`` takes (flags named as mlx_lm.server's where they overlap).

    Attributes:
        model: model directory or .gguf (``None``: the embedded default model).
        host: bind address (loopback unless asked otherwise).
        port: TCP port.
        max_batch: most requests running at once.
        memory_budget_gb: KV pages + activations budget (see EngineConfig); ``None``: sized
            from the device's memory.
        api_key: require ``Authorization: Bearer <key>`` on /v1 routes.
        max_tokens: default generation limit for chat completions.
        prefill_step_size: prompt tokens per engine iteration.
        page_size: tokens per KV page.
        log_level: uvicorn's log level.
    """

    model: str | None = None
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    max_batch: int = 32
    memory_budget_gb: float | None = None
    api_key: str | None = None
    max_tokens: int = 512
    prefill_step_size: int = 512
    page_size: int = 16
    log_level: str = "info"


def model_name(loaded: Any, requested: str | None) -> str:
    """The id clients pass as ``model``: the directory (or GGUF) name, or ``default``."""
    if requested is None:
        return "default"
    return Path(requested).expanduser().name.removesuffix(".gguf") or str(requested)


def build(options: ServeOptions) -> tuple[Any, Any, str]:
    """Load the model, start an engine and build the app: ``(app, engine, model_id)``."""
    from ..artifacts.loader import load_model
    from ..engine import Engine, EngineConfig
    from .app import create_app

    loaded = load_model(options.model)
    config = EngineConfig(max_batch=options.max_batch, memory_budget_gb=options.memory_budget_gb,
                          prefill_step_size=options.prefill_step_size, page_size=options.page_size)
    engine = Engine(loaded, config).start()
    model_id = model_name(loaded, options.model)
    aliases = tuple({options.model} - {None}) if options.model else ()
    app = create_app(engine, model_id=model_id, api_key=options.api_key, default_max_tokens=options.max_tokens,
                     aliases=aliases)
    return app, engine, model_id


def serve(options: ServeOptions) -> None:
    """Run until interrupted (Ctrl-C stops uvicorn, then the engine)."""
    import uvicorn

    if options.max_tokens < 1:
        raise MlxInferError(f"--max-tokens must be >= 1, got {options.max_tokens}.")
    app, engine, model_id = build(options)
    try:
        print(f"mlx-infer: serving '{model_id}' on http://{options.host}:{options.port}/v1 "
              f"({_pool_summary(engine)})", flush=True)
        uvicorn.run(app, host=options.host, port=options.port, log_level=options.log_level)
    finally:
        engine.stop()


class ServerThread:
    """A uvicorn server on a free loopback port, in a background thread (tests, benchmarks).

    Example::

        with ServerThread(create_app(engine, model_id="m")) as server:
            openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    """

    def __init__(self, app: Any, *, host: str = DEFAULT_HOST, log_level: str = "warning"):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # not the main thread
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="mlx-infer-server", daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread.start()
        for _ in range(int(timeout / 0.02)):
            if self.server.started:
                return self
            if not self._thread.is_alive():
                break
            threading.Event().wait(0.02)
        raise RuntimeError("the server did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _pages_summary(store: Any) -> str:
    """``"4095 global, 1023 window 512"``: each layer group's usable pages."""
    return ", ".join(f"{g.num_pages - 1} {'global' if g.window is None else f'window {g.window}'}"
                     for g in store.groups)


def _pool_summary(engine: Any) -> str:
    """The KV pool on the startup line: pages per group, the tokens the global pool holds, and
    what it was sized from."""
    store = engine.store
    tokens = (store.groups[0].num_pages - 1) * store.page_size
    out = f"KV pages of {store.page_size} tokens: {_pages_summary(store)}; {tokens:,} tokens"
    if engine.kv_budget is not None:
        out += f"; {engine.kv_budget.bytes / 2**30:.2f} GiB from {engine.kv_budget.source}"
    return out
