"""The FastAPI app: OpenAI-compatible routes, thin over :class:`~mlx_infer.engine.Engine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE with
``stream: true``), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``,
``GET /metrics`` (Prometheus text). Every error is OpenAI's
``{"error": {message, type, param, code}}``:

====  =====================================================================
400   a bad value (``top_p: 2``, ``n: 17``, a prompt longer than the context,
      ``max_tokens`` over ``--max-tokens`` or the context), an unknown field,
      text with a lone surrogate, a body that is not JSON
401   a missing or wrong bearer token (when the server has ``--api-key``)
404   an unknown model or route
405   a known route with the wrong method
408   a body that did not arrive in time
413   a body over the size limit, or a prompt the KV pool cannot hold
422   a body that is not the schema (wrong JSON types, missing fields)
503   the queue is full, or the server is shutting down
====  =====================================================================

A client that disconnects (mid-stream or while waiting) cancels its request,
and the engine frees its pages at the next iteration. A request cut by shutdown
(see :class:`~mlx_infer.server.guard.Drain`) never claims a normal end: a stream
gets a last chunk with ``finish_reason: "abort"`` (vLLM's word) and an error
event with ``code: "server_shutdown"`` before ``[DONE]``; a waiting request gets
a 503 with that code. A 500 means a bug: it is logged with its traceback.

Streams: a choice's chunk carries every token that arrived since its last chunk
(:meth:`~mlx_infer.engine.RequestHandle.batches`): one token while the event loop keeps up,
several when it lags, so a busy server sends fewer, larger chunks instead of queueing one per
token (vLLM merges a slow consumer's outputs the same way). ``stream_options:
{"continuous_usage_stats": true}`` (vLLM's) puts the usage so far in every chunk.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import defaults
from ..engine import Engine, EngineClosedError, EngineRequest, QueueFullError, RequestHandle, RequestTooLargeError
from ..errors import MlxInferError, PromptTooLongError
from ..sampling import SamplingParams
from ..engine import RequestResult
from ..engine.process import EngineProcess
from ..engine.prompt_scores import PromptLogprobs
from .prompt_logprobs import check_scorable, echo_logprobs, vllm_prompt_logprobs
from .streaming import FirstChunkTimer, merge
from .structured import constraint_of
from .adapters import adapter_models, adapter_names, adapter_of, add_adapter_routes, served_name
from .extras import add_cors, add_token_routes, template_kwargs
from .tools import ToolPlan, template_messages
from . import protocol as P
from .guard import Drain, Guard, GuardConfig, error_body

DEFAULT_MAX_TOKENS = defaults.SERVER_MAX_TOKENS
COMPLETIONS_DEFAULT_MAX_TOKENS = defaults.COMPLETIONS_MAX_TOKENS
_DISCONNECT_POLL_S = 0.1
logger = logging.getLogger("mlx_infer.server")


def error_response(e: P.OpenAIError) -> Response:
    """``e`` as OpenAI's error JSON (ASCII, so any message encodes)."""
    return Response(error_body(e.status, e.message, type=e.type, code=e.code, param=e.param),
                    status_code=e.status, media_type="application/json")


def choice_samplings(sampling: SamplingParams, n: int | None) -> list[SamplingParams]:
    """One sampling per choice: with a seed, choice ``i`` draws with ``seed + i`` (reproducible and distinct)."""
    n = n or 1
    if sampling.seed is None or n == 1:
        return [sampling] * n
    return [dataclasses.replace(sampling, seed=(sampling.seed + i) % 2**63) for i in range(n)]


def total_usage(results: list[Any], n: int | None) -> dict[str, Any]:
    """Usage over the choices: each prompt counted once (not once per of its ``n`` choices), as vLLM does."""
    firsts = results[::n or 1]
    return P.usage(sum(r.prompt_tokens for r in firsts), sum(r.completion_tokens for r in results),
                   sum(r.cached_tokens for r in firsts))


def running_usage(chunk: dict[str, Any], on: bool, prompt_tokens: int, streamed: list[int]) -> dict[str, Any]:
    """``chunk`` (its choice's ``_tokens``: the tokens it carries, removed here) with the usage so far when
    ``on`` (vLLM's ``stream_options.continuous_usage_stats``): the prompts' tokens and every token streamed up
    to and including this chunk. ``streamed`` is the stream's one-element running count."""
    streamed[0] += sum(c.pop("_tokens", 0) for c in chunk["choices"])
    if on:
        chunk["usage"] = P.usage(prompt_tokens, streamed[0], 0)
    return chunk


def warm_constraint_tokenizer(engine: Engine) -> None:
    """Build structured output's token trie in the background when llguidance is installed
    (~6 s for a 256k vocabulary), so the first constrained request does not wait for it. It runs where
    the engine compiles constraints: through ``engine.call``, in the engine's process when it has one."""
    engine.call(_warm_constraint_tokenizer)


def _warm_constraint_tokenizer(engine: Engine) -> None:
    import importlib.util
    import threading

    if importlib.util.find_spec("llguidance") is None or engine.vocab_size is None:
        return
    from ..constraints import constraint_tokenizer

    def build() -> None:
        try:
            constraint_tokenizer(engine.tokenizer, engine.vocab_size, tuple(engine.eos))
        except MlxInferError as e:  # a tokenizer llguidance cannot read: requests get the error
            logger.warning("structured output unavailable for this tokenizer: %s", e)

    threading.Thread(target=build, name="mlx-infer-constraint-warmup", daemon=True).start()


def check_generation_defaults(defaults: dict[str, Any]) -> None:
    """Refuse a model whose generation_config sampling defaults are invalid (every request would fail).

    Raises:
        MlxInferError: naming the bad key.
    """
    try:
        SamplingParams.from_generation_config(defaults)
    except MlxInferError as e:
        raise MlxInferError(f"the model's generation_config.json has invalid sampling defaults: {e} "
                            "Fix or remove that key in generation_config.json.") from None


def create_app(engine: "Engine | EngineProcess", *, model_id: str, api_key: str | None = None,
               default_max_tokens: int = DEFAULT_MAX_TOKENS, max_tokens_cap: int | None = None,
               aliases: tuple[str, ...] = (), guard: GuardConfig | None = None,
               drain: Drain | None = None, allowed_origins: tuple[str, ...] = ()) -> FastAPI:
    """An app serving ``engine``'s model under ``model_id`` (and ``aliases``).

    Args:
        engine: a started engine, in this process or in its own (:class:`~mlx_infer.engine.process.EngineProcess`);
            the caller owns it (starts and stops it).
        model_id: the id clients pass as ``model``.
        api_key: require ``Authorization: Bearer <key>`` (shorthand for ``GuardConfig(api_key=...)``;
            give one or the other).
        default_max_tokens: a chat completion's ``max_tokens`` when the client gives none.
        max_tokens_cap: the most ``max_tokens`` a client may ask (default: the larger of
            ``default_max_tokens`` and the model's context).
        aliases: more names for the model.
        guard: API key, public endpoints, body limits (see :mod:`.guard`).
        drain: shutdown state shared with the server (see :class:`~.guard.Drain`).
        allowed_origins: CORS origins to answer (``("*",)``: any; empty: CORS off).

    Raises:
        MlxInferError: bad settings, or a model whose generation defaults are invalid.
    """
    if guard is not None and api_key is not None:
        raise MlxInferError("give api_key or guard=GuardConfig(api_key=...), not both.")
    guard = guard or GuardConfig(api_key=api_key)
    drain = drain or Drain()
    defaults = dict(engine.generation_config or {})
    check_generation_defaults(defaults)
    context = engine.context_length
    cap = max_tokens_cap if max_tokens_cap is not None else max(default_max_tokens, context or 0)
    if cap < 1 or default_max_tokens < 1:
        raise MlxInferError(f"max tokens must be >= 1, got default {default_max_tokens}, cap {cap}.")
    app = FastAPI(title="mlx-infer", version="1", description="OpenAI-compatible API over mlx-infer's engine.")
    first_chunk = FirstChunkTimer()
    app.state.drain = drain
    app.add_middleware(Guard, config=guard, drain=drain)
    add_cors(app, tuple(allowed_origins))  # outermost: preflights are answered before the key check
    names = {model_id, *aliases}
    tokenizer = engine.tokenizer
    fmt = P.LogprobFormatter(tokenizer)
    vocab_size = engine.vocab_size
    created = P.now()

    # -- errors -----------------------------------------------------------------

    @app.exception_handler(P.OpenAIError)
    async def _openai_error(_: Request, e: P.OpenAIError) -> Response:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> Response:
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        extra = [".".join(str(x) for x in err["loc"][1:]) for err in errs if err.get("type") == "extra_forbidden"]
        if extra:  # OpenAI's words for unknown fields
            top = str(errs[0]["loc"][1]) if first.get("type") == "extra_forbidden" else extra[0].split(".")[0]
            return error_response(P.OpenAIError(400, f"Unrecognized request argument supplied: {', '.join(extra)}",
                                                param=top, code="unknown_parameter"))
        if first.get("type") == "json_invalid":
            where = first["loc"][1] if len(first.get("loc", ())) > 1 else "?"
            return error_response(P.OpenAIError(400, f"The body is not valid JSON: "
                                                f"{first.get('ctx', {}).get('error', 'decode error')} "
                                                f"(at character {where}).", code="invalid_json"))
        msg = f"{loc}: {first.get('msg', 'invalid request')}" if loc else first.get("msg", "invalid request body")
        return error_response(P.OpenAIError(422, msg, param=loc.split(".")[0] or None, code="invalid_type"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        detail = str(e.detail)
        if e.status_code == 400 and detail == "There was an error parsing the body":  # FastAPI's, cause dropped
            detail, code = ("The body could not be parsed: send UTF-8 JSON with integers under 4300 digits "
                            "and shallow nesting."), "invalid_json"
        return error_response(P.OpenAIError(e.status_code, detail, code=code))

    def check_model(name: str) -> None:
        if name not in names and name not in adapter_names(engine):
            raise P.OpenAIError(404, f"The model '{name}' does not exist; this server serves '{model_id}'.",
                                param="model", code="model_not_found")

    async def submit(prompt_ids: list[int], req: P._Sampling, sampling: Any, max_tokens: int, constraint: Any = None,
                     keep_special: bool = False, prompt_logprobs: int | None = None) -> RequestHandle:
        if drain.draining:
            raise P.OpenAIError(503, "The server is shutting down; retry on another instance.", type="server_error",
                                code="server_shutdown")
        constraint = constraint or constraint_of(req)
        try:
            request = EngineRequest(prompt_ids=prompt_ids, sampling=sampling, max_tokens=max_tokens,
                                    stop=P.stop_strings(req.stop), ignore_eos=bool(req.ignore_eos),
                                    namespace=model_id, constraint=constraint, adapter=adapter_of(engine, req, names),
                                    skip_special_tokens=req.skip_special_tokens is not False and not keep_special,
                                    spaces_between_special_tokens=req.spaces_between_special_tokens is not False,
                                    prompt_logprobs=prompt_logprobs)
            handle = await engine.asubmit(request)  # an engine process answers while the loop serves others
        except PromptTooLongError as e:
            raise P.OpenAIError(400, str(e), param="messages" if hasattr(req, "messages") else "prompt",
                                code="context_length_exceeded") from None
        except RequestTooLargeError as e:
            raise P.OpenAIError(413, str(e), code="request_too_large") from None
        except (QueueFullError, EngineClosedError) as e:
            raise P.OpenAIError(503, str(e), type="server_error", code="overloaded") from None
        except MlxInferError as e:
            raise P.OpenAIError(400, str(e), code="invalid_value") from None
        drain.live.add(handle)
        return handle

    def release(handle: RequestHandle) -> None:
        handle.cancel()
        drain.live.discard(handle)

    def shutdown_error(handle: RequestHandle) -> P.OpenAIError:
        return P.OpenAIError(503, "The server is shutting down: this generation was cut before its end; "
                                  "retry on another instance.", type="server_error", code="server_shutdown")

    def generation_failed(handle: RequestHandle, error: str | None) -> P.OpenAIError:
        logger.error("request %s failed in the engine: %s", handle.request_id, error)
        return P.OpenAIError(500, f"Generation failed: {error}", type="server_error")

    async def wait(handle: RequestHandle, request: Request) -> Any:
        """The result, cancelling the request as soon as the client goes away."""
        task = asyncio.ensure_future(handle.aresult())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if done:
                    result = task.result()
                    if result.finish_reason == "error":
                        raise generation_failed(handle, result.error)
                    if result.finish_reason == "cancelled" and drain.aborted(handle):
                        raise shutdown_error(handle)
                    return result
                if drain.aborted(handle):  # shutdown: answer now, whatever the engine is doing
                    raise shutdown_error(handle)
                if await request.is_disconnected():
                    handle.cancel()
        finally:
            if not task.done():
                task.cancel()
            release(handle)

    async def submit_all(jobs: list[tuple]) -> list[RequestHandle]:
        """Submit every ``(prompt_ids, req, sampling, limit[, constraint, keep_special, prompt_logprobs])`` job, or none."""
        handles = []
        try:
            for job in jobs:
                handles.append(await submit(*job))
            return handles
        except BaseException:
            for h in handles:  # one failed: the others stop too
                release(h)
            raise

    async def wait_all(jobs: list[tuple], request: Request) -> list[Any]:
        """Submit every job (see :func:`submit_all`); their results in order."""
        handles = await submit_all(jobs)
        try:
            return list(await asyncio.gather(*(wait(h, request) for h in handles)))
        except BaseException:
            for h in handles:  # one failed (or the client left): the others stop too
                release(h)
            raise

    def release_all(handles: list[RequestHandle]) -> None:
        for h in handles:
            release(h)

    def sse(handles: list[RequestHandle], chunks: AsyncIterator[dict[str, Any]],
            last: Callable[[str, list[int]], dict[str, Any]], t0: float) -> StreamingResponse:
        """The SSE response of choices ``0..len(handles)-1``; ``last(reason, indices)`` builds a final
        chunk for the choices a shutdown cut before their end; ``t0``: the request's arrival (FirstChunkTimer)."""
        async def body() -> AsyncIterator[str]:
            waiting = True  # for the stream's first chunk with a choice (FirstChunkTimer)
            try:
                finished: set[int] = set()
                async for chunk in chunks:  # a shutdown's abort ends it (Drain.abort_all interrupts the handles)
                    if drain.abort_event.is_set():
                        break
                    if waiting and chunk.get("choices"):
                        first_chunk.observe_since(t0)
                        waiting = False
                    finished.update(c["index"] for c in chunk.get("choices", ()) if c.get("finish_reason"))
                    yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
                err = None
                if any(drain.aborted(h) for h in handles):  # cut by shutdown (the engine may not have noticed)
                    left = [i for i in range(len(handles)) if i not in finished]
                    if left:
                        yield f"data: {json.dumps(last('abort', left), ensure_ascii=False)}\n\n"
                    err = shutdown_error(handles[0])
                else:
                    bad = next((h for h in handles if h.result().finish_reason == "error"), None)
                    if bad is not None:
                        err = generation_failed(bad, bad.result().error)
                if err is not None:
                    yield f"data: {json.dumps(err.body())}\n\n"
                yield "data: [DONE]\n\n"
            finally:  # client gone (the task is cancelled) or stream ended: release the requests
                release_all(handles)

        async def release_after() -> None:  # async: Starlette runs a sync task through a worker thread
            release_all(handles)

        # The background task also releases requests whose client left before the body started.
        return StreamingResponse(body(), media_type="text/event-stream",
                                 background=BackgroundTask(release_after),
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- routes -------------------------------------------------------------------

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        text = engine.prometheus() + first_chunk.prometheus()  # the engine's metrics, then the server's own
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "mlx-infer", "max_model_len": context}]
                + adapter_models(engine, model_id, created)}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        check_model(name)
        adapter = next((m for m in adapter_models(engine, model_id, created) if m["id"] == name), None)
        if adapter is not None and name not in names:
            return adapter
        return {"id": model_id, "object": "model", "created": created, "owned_by": "mlx-infer",
                "max_model_len": context}

    add_token_routes(app, engine, check_model)
    add_adapter_routes(app, engine, names)
    warm_constraint_tokenizer(engine)

    @app.post("/v1/completions")
    async def completions(req: P.CompletionRequest, request: Request) -> Any:
        t0 = time.perf_counter()
        P.check_common(req)  # first: it also rejects unencodable text, the model name's included
        check_model(req.model)
        served = served_name(engine, req, names, model_id)  # an adapter's name when it serves (vLLM)
        prompts: list[Any] = [req.prompt]
        if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int):
            prompts = list(req.prompt)  # a batch: one choice (n choices) per prompt, in order
            if len(prompts) > P.MAX_N:
                raise P.OpenAIError(400, f"prompt: give at most {P.MAX_N} prompts, got {len(prompts)}.",
                                    param="prompt", code="invalid_value")
        all_ids = []
        for prompt in prompts:
            ids = (await asyncio.to_thread(tokenizer.encode, prompt) if prompt else []) if isinstance(prompt, str) \
                else list(prompt)
            if not ids:
                raise P.OpenAIError(400, "prompt is empty.", param="prompt", code="invalid_value")
            all_ids.append(ids)
        # echo: the choice's text starts with its prompt (as given; token-id prompts decoded)
        echoes = [(p if isinstance(p, str) else tokenizer.decode(ids)) if req.echo else ""
                  for p, ids in zip(prompts, all_ids)]
        logprobs, top = P.completion_logprobs(req)
        sampling = P.sampling_from(req, defaults, logprobs=logprobs, top_logprobs=top, vocab_size=vocab_size)
        echo_only = req.max_tokens == 0  # score the prompt (echo or prompt_logprobs), generate nothing (as vLLM)
        # echo with logprobs: the prompt tokens' own logprobs lead, scored by the engine's prefill over the
        # request's pages (engine/prompt_scores.py), so the prompt's KV counts against the pool like any other;
        # prompt_logprobs (vLLM's, not streamed) asks the same scores in vLLM's layout
        echo_k, prompt_k = (top if req.echo and logprobs else None), P.prompt_logprobs_of(req)
        score_k = max(echo_k or 0, prompt_k or 0) if echo_k is not None or prompt_k is not None else None
        if echo_only:
            for ids in all_ids:
                try:
                    check_scorable(ids, vocab_size, context)
                except ValueError as e:
                    raise P.OpenAIError(400, str(e), param="prompt", code="invalid_value") from None
        # echo-only scoring runs one token past the prompt (the prefill that scores it samples it), dropped
        limits = [1 if echo_only else P.max_tokens_of(req, COMPLETIONS_DEFAULT_MAX_TOKENS, cap=cap,
                                                      prompt_tokens=len(ids), context=context) for ids in all_ids]
        rid, t = P.new_id("cmpl"), P.now()
        n = req.n or 1
        samplings = choice_samplings(sampling, req.n)
        # every choice scores its own prompt: its scores arrive with its own first token
        jobs = [] if echo_only and score_k is None else [(ids, req, s, limit, None, False, score_k)
                                                        for ids, limit in zip(all_ids, limits) for s in samplings]

        def shown(r: RequestResult) -> RequestResult:
            """What a choice reports: an echo-only choice generated nothing."""
            if not echo_only:
                return r
            return dataclasses.replace(r, token_ids=[], text="", logprobs=[], top_logprobs=None,
                                       finish_reason="length")

        def scores_of(source: Any, ids: list[int]) -> PromptLogprobs:
            got = getattr(source, "prompt_logprobs", None)  # None: a one-token prompt has nothing to score
            return got or PromptLogprobs(token_ids=list(ids), logprobs=[None] * len(ids), top=[None] * len(ids))

        def choice(text: str, reason: str | None, lp: Any = None, index: int = 0, r: Any = None) -> dict[str, Any]:
            out = {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
            if r is not None and prompt_k is not None:
                out["prompt_logprobs"] = vllm_prompt_logprobs(fmt.text, scores_of(r, all_ids[index // n]), prompt_k)
            return out

        def choice_logprobs(r: Any, k: int) -> Any:
            if echo_k is not None:
                return echo_logprobs(fmt.text, scores_of(r, all_ids[k]), r.token_ids, r.logprobs or [],
                                     r.top_logprobs, top)
            return fmt.completion(r.token_ids, r.logprobs, r.top_logprobs) if logprobs else None

        if req.stream:  # every choice in one stream (prompt k's choices are k*n .. k*n+n-1)
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
            handles = await submit_all(jobs)

            async def choice_chunks(i: int, h: RequestHandle | None) -> AsyncIterator[dict[str, Any]]:
                offset = 0
                echo = echoes[i // n]
                if echo and echo_k is None:
                    yield choice(echo, "length" if h is None else None, None, i)
                if h is None:  # max_tokens 0 without logprobs: the prompt alone
                    return
                first, held = True, 0
                async for evs in h.batches():  # what arrived since the last chunk: one chunk (module doc)
                    if first and echo_k is not None:  # the prompt's scores are set before its first event
                        first = False
                        lp = echo_logprobs(fmt.text, scores_of(h, all_ids[i // n]), [], [], None, top)
                        offset = sum(map(len, lp["tokens"]))
                        yield choice(echo, "length" if echo_only else None, lp, i)
                        if echo_only:
                            return
                    toks = [ev for ev in evs if ev.token is not None]
                    lp = None
                    if logprobs and toks:
                        lp = fmt.completion([ev.token for ev in toks], [ev.logprob for ev in toks],
                                            [ev.top_logprobs for ev in toks] if top else None, offset)
                        offset += sum(map(len, lp["tokens"]))  # over token strings, as the whole response
                    text, reason = "".join(ev.text for ev in evs), evs[-1].finish_reason
                    held += len(toks)  # a token with no text yet (held back) is counted with the next chunk
                    if text or reason or lp:
                        yield {**choice(text, P.finish_reason(reason), lp, i), "_tokens": held}
                        held = 0

            def wrap(choices: list[dict[str, Any]]) -> dict[str, Any]:
                return {"id": rid, "object": "text_completion", "created": t, "model": served, "choices": choices}

            count = len(all_ids) * n
            streamed = [0]  # tokens sent so far over all choices (running_usage)
            prompt_total = sum(map(len, all_ids))

            async def chunks() -> AsyncIterator[dict[str, Any]]:
                async for c in merge([choice_chunks(i, handles[i] if handles else None) for i in range(count)]):
                    yield running_usage(wrap([c]), continuous, prompt_total, streamed)
                if include_usage:
                    results = [shown(h.result()) for h in handles] or [
                        RequestResult(request_id=rid, prompt_tokens=len(ids)) for ids in all_ids for _ in range(n)]
                    yield {**wrap([]), "usage": total_usage(results, req.n)}
            return sse(handles, chunks(), lambda reason, left: wrap([choice("", reason, None, i) for i in left]), t0)

        if jobs:
            results = [shown(r) for r in await wait_all(jobs, request)]
        else:  # max_tokens 0 without logprobs: the prompt alone
            results = [RequestResult(request_id=rid, prompt_tokens=len(ids), finish_reason="length")
                       for ids in all_ids for _ in range(n)]
        return {"id": rid, "object": "text_completion", "created": t, "model": served,
                "choices": [choice(echoes[i // n] + r.text, P.finish_reason(r.finish_reason),
                                   choice_logprobs(r, i // n), i, r) for i, r in enumerate(results)],
                "usage": total_usage(results, req.n)}

    @app.post("/v1/chat/completions")
    async def chat(req: P.ChatCompletionRequest, request: Request) -> Any:
        t0 = time.perf_counter()
        P.check_common(req)  # first: it also rejects unencodable text, the model name's included
        check_model(req.model)
        served = served_name(engine, req, names, model_id)  # an adapter's name when it serves (vLLM)
        messages = P.chat_messages(req.messages)
        if not tokenizer.chat_template:
            raise P.OpenAIError(400, f"The model {model_id!r} has no chat template (it is a base model), so it "
                                "cannot answer chat messages; use /v1/completions with a plain prompt, or start "
                                "the server with a chat model.", param="messages", code="no_chat_template")
        try:
            plan = ToolPlan(req.tools, req.tool_choice, req.parallel_tool_calls, tokenizer.chat_template)
        except ValueError as e:
            raise P.OpenAIError(400, str(e), param="tool_choice" if "tool_choice" in str(e) else "tools",
                                code="invalid_value") from None
        if plan.constraint is not None and constraint_of(req) is not None:
            raise P.OpenAIError(400, f'tool_choice "{plan.mode}" constrains the output itself; drop response_format '
                                "(or the other structured-output field).", param="tool_choice", code="invalid_value")
        try:
            if req.continue_final_message and (req.add_generation_prompt is not False
                                               or messages[-1]["role"] != "assistant"):
                raise P.OpenAIError(400, "continue_final_message needs add_generation_prompt: false and an assistant "
                                         "message last.", param="continue_final_message", code="invalid_value")
            ids = await asyncio.to_thread(tokenizer.apply_chat_template, template_messages(messages),
                                          add_generation_prompt=req.add_generation_prompt is not False,
                                          continue_final_message=bool(req.continue_final_message),
                                          tools=plan.template_tools,
                                          **template_kwargs(req.chat_template_kwargs))
        except P.OpenAIError:
            raise
        except MlxInferError as e:
            raise P.OpenAIError(400, str(e), param="messages", code="invalid_value") from None
        except Exception as e:  # a template that raises on these messages (e.g. role order)
            raise P.OpenAIError(400, f"The chat template rejected these messages: {e}", param="messages",
                                code="invalid_value") from None
        # tool-call markup may be special tokens (Gemma 4's): kept for the parser, as vLLM's tool parsers ask
        tool_markup = plan.mode != "none"
        logprobs, top = P.chat_logprobs(req)
        sampling = P.sampling_from(req, defaults, logprobs=logprobs, top_logprobs=top, vocab_size=vocab_size)
        limit = P.max_tokens_of(req, default_max_tokens, cap=cap, prompt_tokens=len(ids), context=context)
        rid, t = P.new_id("chatcmpl"), P.now()

        def chat_choice(r: Any, index: int) -> dict[str, Any]:
            lp = fmt.chat(r.token_ids, r.logprobs, r.top_logprobs) if logprobs else None
            finish = P.finish_reason(r.finish_reason)
            content, calls = plan.parse(r.text, finish)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [c.openai() for c in calls]
                finish = "tool_calls"
            return {"index": index, "message": message, "logprobs": lp, "finish_reason": finish}

        samplings = choice_samplings(sampling, req.n)
        prompt_k = P.prompt_logprobs_of(req)  # vLLM's: the prompt's scores, on the response (the first choice's)
        jobs = [(ids, req, s, limit, plan.constraint, tool_markup, prompt_k if j == 0 else None)
                for j, s in enumerate(samplings)]

        def prompt_part(r: Any) -> dict[str, Any]:
            if prompt_k is None:
                return {}
            got = r.prompt_logprobs or PromptLogprobs(token_ids=list(ids), logprobs=[None] * len(ids),
                                                      top=[None] * len(ids))  # None: a one-token prompt
            return {"prompt_logprobs": vllm_prompt_logprobs(fmt.text, got, prompt_k)}
        if req.stream:  # every choice in one stream, each with its own tool-call parser state
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
            handles = await submit_all(jobs)

            def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
                return {"id": rid, "object": "chat.completion.chunk", "created": t, "model": served,
                        "choices": choices}

            def delta(i: int, d: dict[str, Any], reason: str | None, lp: Any = None) -> dict[str, Any]:
                return {"index": i, "delta": d, "logprobs": lp, "finish_reason": reason}

            streamed = [0]  # tokens sent so far over all choices (running_usage)
            prompt_total = len(ids)  # one prompt, counted once over its n choices (as the final usage)

            async def choice_chunks(i: int, h: RequestHandle) -> AsyncIterator[dict[str, Any]]:
                own = ToolPlan(req.tools, req.tool_choice, req.parallel_tool_calls, tokenizer.chat_template)
                held = 0
                yield delta(i, {"role": "assistant", "content": ""}, None)
                async for evs in h.batches():  # what arrived since the last chunk: one chunk (module doc)
                    toks = [ev for ev in evs if ev.token is not None]
                    lp = None
                    if logprobs and toks:
                        lp = fmt.chat([ev.token for ev in toks], [ev.logprob for ev in toks],
                                      [ev.top_logprobs for ev in toks] if top else None)
                    deltas = own.feed("".join(ev.text for ev in evs))  # content, or tool-call pieces (markup held)
                    reason = P.finish_reason(evs[-1].finish_reason)
                    if evs[-1].finish_reason is not None:
                        last, reason = own.end(reason)
                        deltas += last
                    for d in deltas[:-1]:
                        yield delta(i, d, None)
                    held += len(toks)  # counted with the batch's last chunk, or the next one (markup held back)
                    if deltas or reason or lp:
                        yield {**delta(i, deltas[-1] if deltas else {}, reason, lp), "_tokens": held}
                        held = 0

            async def chunks() -> AsyncIterator[dict[str, Any]]:
                async for c in merge([choice_chunks(i, h) for i, h in enumerate(handles)]):
                    yield running_usage(chunk([c]), continuous, prompt_total, streamed)
                if include_usage:
                    yield {**chunk([]), "usage": total_usage([h.result() for h in handles], req.n)}
            return sse(handles, chunks(), lambda reason, left: chunk([delta(i, {}, reason) for i in left]), t0)

        if (req.n or 1) > 1:
            results = await wait_all(jobs, request)
            return {"id": rid, "object": "chat.completion", "created": t, "model": served,
                    "choices": [chat_choice(r, i) for i, r in enumerate(results)],
                    "usage": total_usage(results, req.n), **prompt_part(results[0])}
        handle = await submit(*jobs[0])

        r = await wait(handle, request)
        return {"id": rid, "object": "chat.completion", "created": t, "model": served,
                "choices": [chat_choice(r, 0)],
                "usage": P.usage(r.prompt_tokens, r.completion_tokens, r.cached_tokens), **prompt_part(r)}

    return app
