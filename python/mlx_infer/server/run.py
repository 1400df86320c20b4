"""Start the server: load the model, start the engine, run uvicorn."""

from __future__ import annotations

import math
import os
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import defaults
from ..errors import MlxInferError
from .guard import BODY_TIMEOUT_S, DEFAULT_PUBLIC, PUBLIC_CHOICES, GuardConfig
from .http import DRAIN_TIMEOUT_S, HEADER_TIMEOUT_S, bind, make_server

DEFAULT_HOST = defaults.HOST
DEFAULT_PORT = defaults.PORT


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """What ``mlx-infer serve`` takes (flags named as mlx_lm.server's where they overlap).

    Attributes:
        model: model directory or .gguf (``None``: the embedded default model).
        host: bind address (loopback unless asked otherwise).
        port: TCP port (1..65535; 0 picks a free one).
        max_batch: most requests running at once.
        memory_budget_gb: KV pages + activations budget (see EngineConfig); ``None``: sized
            from the device's memory.
        preallocate_kv: allocate the KV pool's whole capacity at start (``EngineConfig.grow_pool=False``)
            instead of growing its storage on demand.
        api_key: require ``Authorization: Bearer <key>`` on every endpoint but ``public``.
        public: endpoints open without the key (``health``, ``metrics``, ``docs``).
        max_tokens: a chat completion's default ``max_tokens`` and every request's upper bound.
        prefill_step_size: prompt tokens per engine iteration.
        page_size: tokens per KV page.
        log_level: uvicorn's log level.
        drain_timeout_s: on shutdown, how long requests in flight may finish before they are aborted.
        header_timeout_s: how long a connection may take to send a request's headers.
        body_timeout_s: how long a request's body may take to arrive.
        served_model_name: the id clients pass as ``model`` (default: the model's file name).
        allowed_origins: CORS origins to answer (``*``: any; empty: CORS off, the default).
        temp, top_p, top_k, min_p: sampling defaults of requests that do not set them (``None``: the
            model's generation_config.json, else greedy / off).
        chat_template: a Jinja chat template for ``/v1/chat/completions`` (for a model without one, or to
            replace its own); ``None``: the model's.
        grammar_jump: commit the tokens a constraint forces as one forward (the engine's
            ``Composition.grammar_jump``; engine/grammar_jump.py).
        loras: ``(name, path)`` adapters to serve (``--lora NAME=PATH``), each a model in /v1/models.
        max_loras: most adapters resident at once (idle ones unload least recently used first).
        engine_process: run the engine in a process of its own (engine/process.py: the event loop and the
            step loop stop sharing one GIL); ``False``: a thread of the server's process. The process is
            spawned, so a script that calls :func:`serve` needs Python's ``if __name__ == "__main__":`` guard
            (the spawned interpreter imports the script's main module).
    """

    model: str | None = None
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    max_batch: int | None = None  # None: the device type's (defaults.MAX_BATCH)
    memory_budget_gb: float | None = None
    preallocate_kv: bool = False
    api_key: str | None = None
    public: tuple[str, ...] = DEFAULT_PUBLIC
    max_tokens: int = defaults.SERVER_MAX_TOKENS
    prefill_step_size: int | None = None  # None: the device type's (defaults.ENGINE_PREFILL_STEP_SIZE)
    page_size: int = defaults.PAGE_SIZE
    log_level: str = "info"
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    served_model_name: str | None = None
    allowed_origins: tuple[str, ...] = ()
    temp: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    chat_template: str | None = None
    grammar_jump: bool = True
    loras: tuple[tuple[str, str], ...] = ()
    max_loras: int = 8
    engine_process: bool = True

    def check(self) -> None:
        """Raise :class:`MlxInferError` naming the first bad option (before any model loads)."""
        for flag, value in (("--max-batch", self.max_batch), ("--max-tokens", self.max_tokens),
                            ("--max-loras", self.max_loras),
                            ("--prefill-step-size", self.prefill_step_size), ("--page-size", self.page_size)):
            if value is None and flag in ("--max-batch", "--prefill-step-size"):
                continue  # the device type's default
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MlxInferError(f"{flag} must be a positive integer, got {value!r}.")
        for flag, value in (("--memory-budget", self.memory_budget_gb), ("--drain-timeout", self.drain_timeout_s),
                            ("--header-timeout", self.header_timeout_s), ("--body-timeout", self.body_timeout_s)):
            if flag == "--memory-budget" and value is None:
                continue  # sized from the device's memory
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise MlxInferError(f"{flag} must be a positive finite number, got {value!r}.")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise MlxInferError(f"--port must be in 1..65535 (0: any free port), got {self.port!r}.")
        if not self.host:
            raise MlxInferError("--host must not be empty (127.0.0.1: this machine only; 0.0.0.0: every interface).")
        GuardConfig(api_key=self.api_key, public=self.public)  # raises on a bad key or endpoint name
        from ..sampling import SamplingParams

        try:
            SamplingParams.from_generation_config({}, **self.sampling_defaults())
        except MlxInferError as e:  # name the flag, not the field
            flags = {"temperature": "--temp", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p"}
            raise MlxInferError(re.sub(r"SamplingParams\.(\w+)", lambda m: flags.get(m.group(1), m.group(0)),
                                       str(e))) from None
        if self.chat_template is not None:
            from ..input.chat_template import ChatTemplateError, render_chat

            if not self.chat_template.strip():
                raise MlxInferError("--chat-template is empty; pass a Jinja chat template (or a file holding one).")
            try:
                render_chat(self.chat_template, [{"role": "user", "content": "hi"}])
            except ChatTemplateError as e:
                raise MlxInferError(f"--chat-template: {e}") from None
            except Exception as e:  # a template that fails on a plain user turn is no chat template
                raise MlxInferError(f"--chat-template does not render a user message: {e}") from None

    def sampling_defaults(self) -> dict[str, Any]:
        """The sampling defaults given on the command line, as generation_config keys."""
        given = {"temperature": self.temp, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p}
        return {k: v for k, v in given.items() if v is not None}


def model_name(requested: str | None) -> str:
    """The id clients pass as ``model``: the directory (or GGUF) name, or ``default``."""
    if requested is None:
        return "default"
    return Path(requested).expanduser().name.removesuffix(".gguf") or str(requested)


def make_engine(options: ServeOptions, loaded: Any) -> Any:
    """The (unstarted) engine the options ask for; every rank of a distributed server builds this same one."""
    from ..adapters import AdapterBank
    from ..engine import Engine, EngineConfig
    from ..generation.bindings.autoregressive import Composition

    bank = AdapterBank(loaded.model, capacity=options.max_loras)  # POST /v1/adapters may add more
    for name, path in options.loras:
        try:
            bank.register(name, path)
        except MlxInferError as e:
            raise MlxInferError(f"--lora {name}={path}: {e}") from None
    config = EngineConfig(max_batch=options.max_batch, memory_budget_gb=options.memory_budget_gb,
                          prefill_step_size=options.prefill_step_size, page_size=options.page_size,
                          grow_pool=False if options.preallocate_kv else None)
    return Engine(loaded, config, composition=Composition(grammar_jump=options.grammar_jump))


def load_for_serving(options: ServeOptions) -> Any:
    """The model the options name, with the operator's sampling defaults and chat template applied."""
    from ..artifacts.loader import load_model
    from .app import check_generation_defaults

    loaded = load_model(options.model)
    overrides = options.sampling_defaults()
    if overrides:  # the operator's defaults win over the model's generation_config.json
        cfg = {**(loaded.generation_config or {}), **overrides}
        if "temperature" in overrides:
            cfg.pop("do_sample", None)  # do_sample: false would force greedy again
        loaded.generation_config = cfg
    if options.chat_template is not None:
        loaded.tokenizer.chat_template = options.chat_template
    check_generation_defaults(dict(loaded.generation_config or {}))  # before an engine takes memory
    return loaded


def engine_for_process(options: ServeOptions) -> tuple[Any, Any]:
    """In the engine's own process (engine/process.py): load, build the engine, and the facts the server
    reads of it."""
    from ..engine.process import EngineFacts

    loaded = load_for_serving(options)
    engine = make_engine(options, loaded)
    facts = EngineFacts(tokenizer=loaded.tokenizer, generation_config=loaded.generation_config,
                        context_length=engine.context_length, eos=engine.eos, vocab_size=engine.vocab_size,
                        pool_summary=pool_summary(engine))
    return engine, facts


def start_engine(options: ServeOptions) -> Any:
    """The running engine the server drives: in its own process (``options.engine_process``), else here."""
    from ..parallel import current_group

    # A tensor-parallel leader keeps its engine here: the group was joined by this process.
    if options.engine_process and current_group().size == 1:
        from ..engine.process import EngineProcess

        return EngineProcess(engine_for_process, options)
    return make_engine(options, load_for_serving(options)).start()


def build(options: ServeOptions) -> tuple[Any, Any, str]:
    """Load the model, start an engine and build the app: ``(app, engine, model_id)``."""
    from .app import create_app

    options.check()
    engine = start_engine(options)
    try:
        model_id = options.served_model_name or model_name(options.model)
        aliases = tuple({options.model} - {None}) if options.model and not options.served_model_name else ()
        guard = GuardConfig(api_key=options.api_key, public=options.public, body_timeout_s=options.body_timeout_s)
        app = create_app(engine, model_id=model_id, default_max_tokens=options.max_tokens,
                         max_tokens_cap=options.max_tokens, aliases=aliases, guard=guard,
                         allowed_origins=options.allowed_origins)
    except BaseException:
        engine.stop()
        raise
    return app, engine, model_id


def exposure_lines(options: ServeOptions) -> list[str]:
    """What the startup banner says about who can reach what (and the warning for an open bind)."""
    lines = []
    loopback = options.host in ("127.0.0.1", "localhost", "::1")
    if options.api_key is None:
        lines.append("no --api-key: every endpoint is open to whoever reaches the address")
        if not loopback:
            lines.append(f"WARNING: listening on {options.host} without --api-key: anyone on the network can use "
                         "this server; pass --api-key KEY or --host 127.0.0.1")
    else:
        public = sorted(p for n in options.public for p in PUBLIC_CHOICES[n])
        lines.append(f"--api-key set: public (no key): {', '.join(public) or 'none'}; every other endpoint "
                     "needs the key (open more with --public metrics,docs)")
    return lines


def switch_interval() -> float:
    """Seconds the server's threads hold the GIL before a waiting one may take it
    (:data:`~mlx_infer.defaults.SERVER_SWITCH_INTERVAL_S`; ``MLX_INFER_SWITCH_INTERVAL`` overrides it,
    for an A/B). It matters where the engine is a thread of the server (``--no-engine-process``; with the
    engine in its own process the server's threads are the event loop and the reader of the engine's
    events, and the engine's GIL is its own). The engine thread releases the GIL while MLX evaluates a step and the event loop
    streams meanwhile; with a short interval each preempts the other mid-work, so the engine's
    planning of the next step is cut into slices behind SSE writes while the device idles. A long
    one lets each run until it blocks (the engine in eval, the loop in its poll); the loop's work
    per wake-up stays bounded because a stream's chunk carries every token that arrived since its
    last one (server/app.py)."""
    raw = os.environ.get("MLX_INFER_SWITCH_INTERVAL", "")
    try:
        value = float(raw) if raw else defaults.SERVER_SWITCH_INTERVAL_S
    except ValueError:
        raise MlxInferError(f"MLX_INFER_SWITCH_INTERVAL must be a number of seconds, got {raw!r}.") from None
    if not value > 0:
        raise MlxInferError(f"MLX_INFER_SWITCH_INTERVAL must be > 0 seconds, got {raw!r}.")
    return value


def serve(options: ServeOptions) -> None:
    """Run until interrupted: Ctrl-C or SIGTERM drains for ``drain_timeout_s``, then stops the engine.

    Raises:
        MlxInferError: a bad option, a model that cannot load, an address that cannot be bound.
    """
    options.check()
    from ..parallel import current_group

    if not current_group().is_leader:  # a tensor-parallel follower: no HTTP, rank 0's engine steps
        from ..parallel.serve_rank import follow_serving

        return follow_serving(options, make_engine)
    sock = bind(options.host, options.port)  # before loading: a busy port fails in a second
    try:
        app, engine, model_id = build(options)
    except BaseException:
        sock.close()
        raise
    try:
        port = sock.getsockname()[1]
        for line in exposure_lines(options):
            print(f"mlx-infer: {line}", file=sys.stderr, flush=True)
        pid = getattr(engine, "pid", None)
        print(f"mlx-infer: the engine runs in {'process ' + str(pid) if pid else 'a thread of this process'}",
              file=sys.stderr, flush=True)
        print(f"mlx-infer: serving '{model_id}' on http://{options.host}:{port}/v1 "
              f"({engine.call(_pool_summary)})", flush=True)
        server = make_server(app, log_level=options.log_level, drain_timeout_s=options.drain_timeout_s,
                             header_timeout_s=options.header_timeout_s)
        sys.setswitchinterval(switch_interval())  # the engine thread gets the GIL back soon after its eval
        server.run(sockets=[sock])
    finally:
        sock.close()
        engine.stop()


class ServerThread:
    """A uvicorn server on a free loopback port, in a background thread (tests, benchmarks).

    Example::

        with ServerThread(create_app(engine, model_id="m")) as server:
            openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    """

    def __init__(self, app: Any, *, host: str = DEFAULT_HOST, log_level: str = "warning",
                 drain_timeout_s: float = 2.0, header_timeout_s: float = HEADER_TIMEOUT_S, http: str = "auto"):
        self.sock = bind(host, 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = make_server(app, log_level=log_level, lifespan="off", drain_timeout_s=drain_timeout_s,
                                  header_timeout_s=header_timeout_s, http=http)
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

    def stop(self, timeout: float = 30.0) -> None:
        """Shut down (drain, then abort what is left) and wait up to ``timeout`` s for the thread."""
        self.server.should_exit = True
        self._thread.join(timeout=timeout)
        self.sock.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _pages_summary(store: Any) -> str:
    """``"4095 global, 1023 window 512"``: each layer group's usable pages."""
    return ", ".join(f"{g.num_pages - 1} {'global' if g.window is None else f'window {g.window}'}"
                     for g in store.groups)


def _pool_summary(engine: Any) -> str:  # engine.call: where the engine (and its pool) lives
    return pool_summary(engine)


def pool_summary(engine: Any) -> str:
    """The KV pool on the startup line: pages per group (the capacity), the tokens the global pool
    holds, what it was sized from, and the pages materialized now where the storage grows."""
    store = engine.store
    tokens = (store.groups[0].num_pages - 1) * store.page_size
    out = f"KV pages of {store.page_size} tokens: {_pages_summary(store)}; {tokens:,} tokens"
    if engine.kv_budget is not None:
        out += f"; {engine.kv_budget.bytes / 2**30:.2f} GiB from {engine.kv_budget.source}"
    if store.growth is not None:  # the figures above are the cap; storage starts small (state/paged/growth.py)
        now = ", ".join(str(m - 1) for m in store.materialized)
        out += f"; storage for {now} pages now, growing on demand to that cap"
    return out
