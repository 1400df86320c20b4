"""The FastAPI app: OpenAI-compatible routes, thin over :class:`~mlx_infer.engine.Engine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE with
``stream: true``), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``,
``GET /metrics`` (Prometheus text). Every error is OpenAI's
``{"error": {message, type, param, code}}``:

====  =====================================================================
400   a bad value (``top_p: 2``, ``n: 3``, a prompt longer than the context)
401   a missing or wrong bearer token (when the server has ``--api-key``)
404   an unknown model or route
413   a body over the size limit, or a prompt the KV pool cannot hold
422   a body that is not the schema (wrong JSON types, missing fields)
503   the queue is full, or the server is shutting down
====  =====================================================================

A client that disconnects (mid-stream or while waiting) cancels its request,
and the engine frees its pages at the next iteration.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import Engine, EngineClosedError, EngineRequest, QueueFullError, RequestHandle, RequestTooLargeError
from ..errors import MlxInferError, PromptTooLongError
from . import protocol as P

DEFAULT_MAX_TOKENS = 512
#: Completions default to 16 tokens, as OpenAI's API does.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_BODY_BYTES = 8 * 2**20
_DISCONNECT_POLL_S = 0.25


def create_app(engine: Engine, *, model_id: str, api_key: str | None = None,
               default_max_tokens: int = DEFAULT_MAX_TOKENS, aliases: tuple[str, ...] = ()) -> FastAPI:
    """An app serving ``engine``'s model under ``model_id`` (and ``aliases``).

    The caller owns the engine (starts and stops it).
    """
    app = FastAPI(title="mlx-infer", version="1", description="OpenAI-compatible API over mlx-infer's engine.")
    names = {model_id, *aliases}
    tokenizer = engine.tokenizer
    fmt = P.LogprobFormatter(tokenizer)
    defaults = dict(engine.loaded.generation_config or {})
    created = P.now()

    # -- errors -----------------------------------------------------------------

    @app.exception_handler(P.OpenAIError)
    async def _openai_error(_: Request, e: P.OpenAIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = f"{loc}: {first.get('msg', 'invalid request')}" if loc else first.get("msg", "invalid request body")
        return JSONResponse(P.OpenAIError(422, msg, param=loc or None, code="invalid_type").body(), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(P.OpenAIError(e.status_code, str(e.detail), code=code).body(), status_code=e.status_code)

    @app.middleware("http")
    async def _guard(request: Request, call_next: Callable) -> Any:
        if api_key and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not (given.startswith("Bearer ") and secrets.compare_digest(given[7:].encode(), api_key.encode())):
                return JSONResponse(P.OpenAIError(401, "Invalid or missing API key: send 'Authorization: Bearer "
                                                       "<key>'.", code="invalid_api_key").body(), status_code=401)
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            return JSONResponse(P.OpenAIError(413, f"The request body is larger than {MAX_BODY_BYTES} bytes.",
                                              code="request_too_large").body(), status_code=413)
        try:
            return await call_next(request)
        except Exception:  # never a bare 500 page: answer in the OpenAI shape
            return JSONResponse(P.OpenAIError(500, "Internal server error.", type="server_error").body(),
                                status_code=500)

    def check_model(name: str) -> None:
        if name not in names:
            raise P.OpenAIError(404, f"The model '{name}' does not exist; this server serves '{model_id}'.",
                                param="model", code="model_not_found")

    def submit(prompt_ids: list[int], req: P._Sampling, sampling: Any, max_tokens: int) -> RequestHandle:
        try:
            return engine.submit(EngineRequest(prompt_ids=prompt_ids, sampling=sampling, max_tokens=max_tokens,
                                               stop=P.stop_strings(req.stop), ignore_eos=bool(req.ignore_eos),
                                               namespace=model_id))
        except PromptTooLongError as e:
            raise P.OpenAIError(400, str(e), param="messages" if hasattr(req, "messages") else "prompt",
                                code="context_length_exceeded") from None
        except RequestTooLargeError as e:
            raise P.OpenAIError(413, str(e), code="request_too_large") from None
        except (QueueFullError, EngineClosedError) as e:
            raise P.OpenAIError(503, str(e), type="server_error", code="overloaded") from None
        except MlxInferError as e:
            raise P.OpenAIError(400, str(e), code="invalid_value") from None

    async def wait(handle: RequestHandle, request: Request) -> Any:
        """The result, cancelling the request if the client goes away first."""
        task = asyncio.ensure_future(handle.aresult())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if done:
                    result = task.result()
                    if result.finish_reason == "error":
                        raise P.OpenAIError(500, f"Generation failed: {result.error}", type="server_error")
                    return result
                if await request.is_disconnected():
                    handle.cancel()
        finally:
            if not task.done():
                handle.cancel()
                task.cancel()

    Chunks = Callable[[RequestHandle], AsyncIterator[dict[str, Any]]]

    def sse(handle: RequestHandle, chunks: Chunks) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            try:
                async for chunk in chunks(handle):
                    yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
                result = handle.result()
                if result.finish_reason == "error":
                    err = P.OpenAIError(500, f"Generation failed: {result.error}", type="server_error")
                    yield f"data: {json.dumps(err.body())}\n\n"
                yield "data: [DONE]\n\n"
            finally:  # client gone (the task is cancelled) or stream ended: release the request
                handle.cancel()
        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- routes -------------------------------------------------------------------

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(engine.prometheus(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "mlx-infer"}]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        check_model(name)
        return {"id": model_id, "object": "model", "created": created, "owned_by": "mlx-infer"}

    @app.post("/v1/completions")
    async def completions(req: P.CompletionRequest, request: Request) -> Any:
        check_model(req.model)
        P.check_common(req)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise P.OpenAIError(400, "prompt: give one prompt (batched prompts are not supported).",
                                    param="prompt", code="invalid_value")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = await asyncio.to_thread(tokenizer.encode, prompt) if prompt else []
        else:
            ids = list(prompt)
        if not ids:
            raise P.OpenAIError(400, "prompt is empty.", param="prompt", code="invalid_value")
        logprobs, top = P.completion_logprobs(req)
        sampling = P.sampling_from(req, defaults, logprobs=logprobs, top_logprobs=top)
        handle = submit(ids, req, sampling, P.max_tokens_of(req, COMPLETIONS_DEFAULT_MAX_TOKENS))
        rid, t = P.new_id("cmpl"), P.now()

        def choice(text: str, reason: str | None, lp: Any = None) -> dict[str, Any]:
            return {"index": 0, "text": text, "logprobs": lp, "finish_reason": reason}

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def chunks(h: RequestHandle) -> AsyncIterator[dict[str, Any]]:
                offset = 0
                async for ev in h:
                    lp = None
                    if logprobs and ev.token is not None:
                        lp = fmt.completion([ev.token], [ev.logprob], [ev.top_logprobs] if top else None, offset)
                    offset += len(ev.text)
                    if ev.text or ev.finish_reason or lp:
                        yield {"id": rid, "object": "text_completion", "created": t, "model": model_id,
                               "choices": [choice(ev.text, P.finish_reason(ev.finish_reason), lp)]}
                if include_usage:
                    r = h.result()
                    yield {"id": rid, "object": "text_completion", "created": t, "model": model_id, "choices": [],
                           "usage": P.usage(r.prompt_tokens, r.completion_tokens, r.cached_tokens)}
            return sse(handle, chunks)

        r = await wait(handle, request)
        lp = fmt.completion(r.token_ids, r.logprobs, r.top_logprobs) if logprobs else None
        return {"id": rid, "object": "text_completion", "created": t, "model": model_id,
                "choices": [choice(r.text, P.finish_reason(r.finish_reason), lp)],
                "usage": P.usage(r.prompt_tokens, r.completion_tokens, r.cached_tokens)}

    @app.post("/v1/chat/completions")
    async def chat(req: P.ChatCompletionRequest, request: Request) -> Any:
        check_model(req.model)
        P.check_common(req)
        messages = P.chat_messages(req.messages)
        try:
            ids = await asyncio.to_thread(tokenizer.apply_chat_template, messages, add_generation_prompt=True)
        except MlxInferError as e:
            raise P.OpenAIError(400, str(e), param="messages", code="invalid_value") from None
        except Exception as e:  # a template that raises on these messages (e.g. role order)
            raise P.OpenAIError(400, f"The chat template rejected these messages: {e}", param="messages",
                                code="invalid_value") from None
        logprobs, top = P.chat_logprobs(req)
        sampling = P.sampling_from(req, defaults, logprobs=logprobs, top_logprobs=top)
        handle = submit(ids, req, sampling, P.max_tokens_of(req, default_max_tokens))
        rid, t = P.new_id("chatcmpl"), P.now()

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            def chunk(delta: dict[str, Any], reason: str | None, lp: Any = None) -> dict[str, Any]:
                return {"id": rid, "object": "chat.completion.chunk", "created": t, "model": model_id,
                        "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": reason}]}

            async def chunks(h: RequestHandle) -> AsyncIterator[dict[str, Any]]:
                yield chunk({"role": "assistant", "content": ""}, None)
                async for ev in h:
                    lp = None
                    if logprobs and ev.token is not None:
                        lp = fmt.chat([ev.token], [ev.logprob], [ev.top_logprobs] if top else None)
                    if ev.text or ev.finish_reason or lp:
                        yield chunk({"content": ev.text} if ev.text else {}, P.finish_reason(ev.finish_reason), lp)
                if include_usage:
                    r = h.result()
                    yield {"id": rid, "object": "chat.completion.chunk", "created": t, "model": model_id,
                           "choices": [], "usage": P.usage(r.prompt_tokens, r.completion_tokens, r.cached_tokens)}
            return sse(handle, chunks)

        r = await wait(handle, request)
        lp = fmt.chat(r.token_ids, r.logprobs, r.top_logprobs) if logprobs else None
        return {"id": rid, "object": "chat.completion", "created": t, "model": model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": r.text},
                             "logprobs": lp, "finish_reason": P.finish_reason(r.finish_reason)}],
                "usage": P.usage(r.prompt_tokens, r.completion_tokens, r.cached_tokens)}

    return app
